"""Qwen3.5 (text) in Flax NNX: a hybrid of Gated DeltaNet linear attention and softmax
attention, as transformers 5 computes it (`Qwen3_5ForCausalLM`, model_type `qwen3_5_text`,
and the language model of a `qwen3_5` checkpoint).

Legend: B batch, T tokens, S cache positions, D d_model, N query heads, K KV heads, H head dim,
F MLP dim; linear layers: h value heads, g key heads, k key dim, v value dim, C convolution
channels (2 g k + h v), W convolution kernel, w = W - 1.

Layers follow `layer_types` (transformers' default: three linear layers then one full, repeated).
The two kinds have different weights, so they are two stacks: `blocks` holds the full-attention
layers (a `models.base.Block`: project_qkv, attend, finish, as every family's) and
`linear_blocks` the linear ones. `scan_layers` runs the L layers in order in one `lax.scan`,
each step its kind's body on its own slice of its kind's stack.

A full layer: (1 + w) RMSNorm; q_proj gives each head its query and an output gate; per-head
(1 + w) q/k norms; RoPE on the first `rotary_dim` features of each head (partial rotary); the
attention output times sigmoid(gate), then o_proj. A linear layer: Gated DeltaNet
(models/gated_deltanet_layer.py). Both end in a SwiGLU MLP. The past of a full layer is its
K,V; of a linear layer, its state [h, k, v] (float32) and the last w rows of its
convolution's input (`HybridCache`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.base import Block, CausalLM, no_reduce, normal_param, zeros_param
from models.config import ModelConfig
from models.family import Family
from models.gated_deltanet_layer import GatedDeltaNetBlock, LinearState, OnePlusNormMlp
from models.hf_config import kv_heads_from_hf, or_default, rope_from_hf
from models.layer_kinds import FULL_ATTENTION, GatedDeltaNetKind, kinds_in_order
from models.norms import rms_norm_one_plus
from models.rope import apply_rope
from models.tensor_names import Target, linear_entry, same

LINEAR, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen35Config(ModelConfig):
  """Qwen3.5 text: `layer_types` names each layer's kind (LINEAR or FULL); the linear layers'
  heads and dims; partial rotary on the full layers."""

  architecture: ClassVar[str] = "qwen3_5"
  mlp_matrices: ClassVar[int] = 3
  reductions_per_layer: ClassVar[int] = 2
  layer_types: tuple[str, ...]
  linear_num_key_heads: int
  linear_num_value_heads: int
  linear_key_head_dim: int
  linear_value_head_dim: int
  linear_conv_kernel: int = 4
  partial_rotary_factor: float = 0.25
  # A mixture of experts in every layer's MLP (Qwen3.5-MoE, Qwen3-Next; 0: a dense MLP of
  # `mlp_dim` columns): `num_experts` SwiGLU experts of `mlp_dim` columns, each token through
  # its `experts_per_token` most probable (renormalised over them when
  # `normalize_expert_weights`), plus one shared SwiGLU expert of `shared_expert_dim` columns
  # scaled by its sigmoid gate.
  num_experts: int = 0
  experts_per_token: int = 0
  normalize_expert_weights: bool = True
  shared_expert_dim: int = 0

  def __post_init__(self):
    super().__post_init__()
    self._check_experts()
    if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {LINEAR, FULL}:
      raise ValueError(
        f"`layer_types` must name {LINEAR!r} or {FULL!r} for each of the {self.num_layers} "
        f"layers, got {self.layer_types!r}"
      )
    for name in (
      "linear_num_key_heads",
      "linear_num_value_heads",
      "linear_key_head_dim",
      "linear_value_head_dim",
      "linear_conv_kernel",
    ):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config field `{name}` must be a positive integer, got {value!r}")
    if self.linear_num_value_heads % self.linear_num_key_heads:
      raise ValueError(
        f"`linear_num_value_heads` ({self.linear_num_value_heads}) must be a multiple of "
        f"`linear_num_key_heads` ({self.linear_num_key_heads})"
      )
    rotary = self.rotary_dim
    if not 0 < rotary <= self.head_dim or rotary % 2:
      raise ValueError(
        f"`partial_rotary_factor`={self.partial_rotary_factor} gives {rotary} rotary features "
        f"of head_dim {self.head_dim}: it must be even and in (0, head_dim]"
      )
    if self.sliding_window is not None or self.layer_windows is not None:
      raise ValueError("Qwen3.5 has no sliding window")

  def _check_experts(self) -> None:
    E, k, Fs = self.num_experts, self.experts_per_token, self.shared_expert_dim
    for name, value in (("num_experts", E), ("experts_per_token", k), ("shared_expert_dim", Fs)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config field `{name}` must be an integer >= 0, got {value!r}")
    if E and not 1 <= k <= E:
      raise ValueError(f"`experts_per_token` must be in [1, num_experts={E}], got {k}")
    if E and not Fs:
      raise ValueError(
        "`shared_expert_dim` must be > 0 with experts: Qwen3.5-MoE and Qwen3-Next add a "
        "shared expert to every layer's mixture"
      )
    if not E and (k or Fs):
      raise ValueError(
        f"`experts_per_token`={k} and `shared_expert_dim`={Fs} need `num_experts` > 0 "
        "(a dense MLP has neither)"
      )

  # What the cost model counts of the MLP: the routed experts' columns and the shared
  # expert's; the router's E columns and the shared expert's one-column gate.
  @property
  def router_dim(self) -> int:
    return self.num_experts + 1 if self.num_experts else 0

  @property
  def active_mlp_dim(self) -> int:
    if not self.num_experts:
      return self.mlp_dim
    return self.mlp_dim * self.experts_per_token + self.shared_expert_dim

  def mlp_weight_dim(self, num_tokens: float) -> float:
    """MLP columns whose weights `num_tokens` tokens read (every routed expert some token
    chooses, at most E and at most T k, and the shared one)."""
    if not self.num_experts:
      return self.mlp_dim
    routed = min(self.num_experts, num_tokens * self.experts_per_token)
    return self.mlp_dim * routed + self.shared_expert_dim

  @property
  def rotary_dim(self) -> int:
    """Features of each head that RoPE rotates (transformers: int(head_dim x factor))."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def linear_kind(self) -> GatedDeltaNetKind:
    return GatedDeltaNetKind(
      key_heads=self.linear_num_key_heads,
      value_heads=self.linear_num_value_heads,
      key_dim=self.linear_key_head_dim,
      value_dim=self.linear_value_head_dim,
      conv_kernel=self.linear_conv_kernel,
    )

  @property
  def layer_kinds(self) -> tuple[Any, ...]:
    linear = self.linear_kind
    return tuple(linear if t == LINEAR else FULL_ATTENTION for t in self.layer_types)

  @property
  def kinds(self) -> tuple[Any, ...]:
    return kinds_in_order(self.layer_kinds)

  @property
  def kind(self):
    if len(self.kinds) != 1:
      names = ", ".join(k.name for k in self.kinds)
      raise ValueError(f"this model's layers are of {len(self.kinds)} kinds ({names}), not one")
    return self.kinds[0]

  def of_kind(self, kind) -> Qwen35Config:
    """This model's config as its layers of `kind` see it (every layer of that kind): a full
    layer's block answers `kind` as full attention, as the strategies ask it."""
    layer_type = LINEAR if isinstance(kind, GatedDeltaNetKind) else FULL
    return dataclasses.replace(self, layer_types=(layer_type,) * self.num_layers)

  def layers_of(self, layer_type: str) -> tuple[int, ...]:
    """The indices of the layers of `layer_type`, in order (their rows in its stack)."""
    return tuple(i for i, t in enumerate(self.layer_types) if t == layer_type)

  @property
  def conv_channels(self) -> int:
    """C: the convolution runs over q, k (g k each) and v (h v), fused."""
    k_dim = self.linear_num_key_heads * self.linear_key_head_dim
    return 2 * k_dim + self.linear_num_value_heads * self.linear_value_head_dim

  def attention_params(self) -> int:
    """A full layer's attention: q_proj with its gate (2 N H), k, v, o and the q/k norms."""
    D, N, K, H = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
    return D * (2 * N + 2 * K) * H + N * H * D + 2 * H

  def linear_attention_params(self) -> int:
    """A linear layer's: in_proj_qkv, z, a, b, the convolution, A_log, dt_bias, the gated
    norm and out_proj."""
    D, C, W = self.d_model, self.conv_channels, self.linear_conv_kernel
    h, v = self.linear_num_value_heads, self.linear_value_head_dim
    return D * C + D * h * v + 2 * D * h + C * W + 2 * h + v + h * v * D

  def mlp_params(self) -> int:
    """A layer's MLP: the dense SwiGLU, or every expert, the shared one, the router and the
    shared expert's gate."""
    D, F, E = self.d_model, self.mlp_dim, self.num_experts
    if not E:
      return self.mlp_matrices * D * F
    return self.mlp_matrices * D * (E * F + self.shared_expert_dim) + D * (E + 1)

  def num_params(self) -> int:
    D = self.d_model
    mixers = (
      len(self.layers_of(FULL)) * self.attention_params()
      + len(self.layers_of(LINEAR)) * self.linear_attention_params()
    )
    per_layer = self.mlp_params() + 2 * D
    head = 0 if self.tie_embeddings else self.vocab_size * D
    return self.vocab_size * D + mixers + self.num_layers * per_layer + D + head


class Qwen35AttentionBlock(Block, OnePlusNormMlp):
  """A full-attention layer (see the module docstring): the `Block` interface every strategy
  uses; its output gate is taken from the layer's input in `finish`."""

  def __init__(self, config: Qwen35Config, *, num_layers: int, dtype, rngs: nnx.Rngs):
    self.config = config
    L, D, N = num_layers, config.d_model, config.num_heads
    K, H = config.num_kv_heads, config.head_dim
    self.attn_norm = zeros_param((L, D), dtype)
    self.wq = normal_param(rngs, (L, D, N, H), dtype)
    self.wq_gate = normal_param(rngs, (L, D, N, H), dtype)  # q_proj's second half per head
    self.wk = normal_param(rngs, (L, D, K, H), dtype)
    self.wv = normal_param(rngs, (L, D, K, H), dtype)
    self.wo = normal_param(rngs, (L, N, H, D), dtype)
    self.q_norm = zeros_param((L, H), dtype)
    self.k_norm = zeros_param((L, H), dtype)
    self.init_mlp(L, dtype, rngs)

  def attention_input(self, x_BTD):
    return rms_norm_one_plus(x_BTD, self.attn_norm[...], self.config.norm_eps)

  def project_qkv(self, x_BTD, positions_BT):
    cfg = self.config
    h_BTD = self.attention_input(x_BTD)
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", h_BTD, self.wq[...])
    k_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, self.wk[...])
    v_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, self.wv[...])
    q_BTNH = rms_norm_one_plus(q_BTNH, self.q_norm[...], cfg.norm_eps)
    k_BTKH = rms_norm_one_plus(k_BTKH, self.k_norm[...], cfg.norm_eps)
    return partial_rope(q_BTNH, positions_BT, cfg), partial_rope(k_BTKH, positions_BT, cfg), v_BTKH

  def finish_rows(self, x_BTD, attn_BTNH, reduce=no_reduce):
    gate_BTNH = jnp.einsum("BTD,DNH->BTNH", self.attention_input(x_BTD), self.wq_gate[...])
    gated_BTNH = attn_BTNH * jax.nn.sigmoid(gate_BTNH).astype(attn_BTNH.dtype)
    return self.mlp(x_BTD + reduce(self.attention_output(gated_BTNH)), reduce)


def partial_rope(x_BTnH, positions_BT, config: Qwen35Config):
  """RoPE on each head's first `rotary_dim` features; the rest pass through."""
  r = config.rotary_dim
  rotated = apply_rope(x_BTnH[..., :r], positions_BT, config.rope)
  return jnp.concatenate([rotated, x_BTnH[..., r:]], axis=-1)


class HybridCache(NamedTuple):
  """What decode reads of a hybrid model's past: K,V of the full layers [L_full, 2, B, S, K,
  H] (S the capacity: the prompt and the tokens to come) and each linear layer's past
  (`LinearState`, stacked [L_linear, ...])."""

  kv_2BSKH: jax.Array
  linear: LinearState


class Qwen35(CausalLM):
  """Token embedding -> the hybrid layers in order -> (1 + w) final norm -> logits."""

  block_class = Qwen35AttentionBlock

  def __init__(self, config: Qwen35Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.dtype = jnp.dtype(dtype)
    V, D = config.vocab_size, config.d_model
    self.embedding = normal_param(rngs, (V, D), dtype)
    self.blocks = Qwen35AttentionBlock(
      config, num_layers=len(config.layers_of(FULL)), dtype=dtype, rngs=rngs
    )
    self.linear_blocks = GatedDeltaNetBlock(
      config, num_layers=len(config.layers_of(LINEAR)), dtype=dtype, rngs=rngs
    )
    self.lm_head = None if config.tie_embeddings else normal_param(rngs, (D, V), dtype)
    self.norm = zeros_param((D,), dtype)

  def final_norm(self, x_BTD):
    return rms_norm_one_plus(x_BTD, self.norm[...], self.config.norm_eps)

  def empty_cache(self, batch: int, capacity: int) -> HybridCache:
    """A zero past for `batch` rows and `capacity` positions (the prompt and what decode adds)."""
    cfg = self.config
    L_full, L_linear = len(cfg.layers_of(FULL)), len(cfg.layers_of(LINEAR))
    K, H = cfg.num_kv_heads, cfg.head_dim
    h, d_k, d_v = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return HybridCache(
      jnp.zeros((L_full, 2, batch, capacity, K, H), self.dtype),
      LinearState(
        jnp.zeros((L_linear, batch, h, d_k, d_v), jnp.float32),
        jnp.zeros((L_linear, batch, cfg.linear_conv_kernel - 1, cfg.conv_channels), self.dtype),
      ),
    )

  def forward(self, tokens_BT, attention="dense", reduce=no_reduce, lengths_B=None, capacity=None):
    """The whole prompt on one device: (final hidden states [B, T, D], `HybridCache` of
    `capacity` positions (default T)). lengths_B: each row's real length (right padding)."""
    B, T = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    cache = self.empty_cache(B, T if capacity is None else capacity)

    def full(block, i, carry):
      x_BTD, cache = carry
      q, k, v = block.project_qkv(x_BTD, positions_BT)
      x_BTD = block.finish(x_BTD, block.attend(q, k, v, 0, attention), reduce=reduce)
      kv_2BTKH = jnp.stack([k, v]).astype(cache.kv_2BSKH.dtype)
      kv = jax.lax.dynamic_update_slice(cache.kv_2BSKH, kv_2BTKH[None], (i, 0, 0, 0, 0, 0))
      return x_BTD, cache._replace(kv_2BSKH=kv)

    def linear(block, i, carry):
      x_BTD, cache = carry
      past = jax.tree.map(lambda s: s[i], cache.linear)
      x_BTD, past = block.run(x_BTD, past, lengths_B)
      stacked = jax.tree.map(lambda s, new: s.at[i].set(new.astype(s.dtype)), cache.linear, past)
      return x_BTD, cache._replace(linear=LinearState(*stacked))

    return scan_layers(self, full, linear, (self.embed(tokens_BT), cache))

  def __call__(self, tokens_BT):
    """Logits of every position, [B, T, V] float32."""
    x_BTD, _ = self.forward(tokens_BT)
    return self.logits(x_BTD)

  def decode_step(self, tokens_B, positions_B, cache: HybridCache):
    """One token per row, row b at `positions_B[b]` (its length so far): (logits [B, V], the
    cache with the token's K,V written at its position and every linear layer's past moved
    on)."""
    B = tokens_B.shape[0]
    positions_B = jnp.broadcast_to(jnp.asarray(positions_B, jnp.int32), (B,))
    rows_B = jnp.arange(B)

    def full(block, i, carry):
      x_B1D, cache = carry
      q_B1NH, k_B1KH, v_B1KH = block.project_qkv(x_B1D, positions_B[:, None])
      kv = cache.kv_2BSKH
      kv = kv.at[i, 0, rows_B, positions_B].set(k_B1KH[:, 0].astype(kv.dtype))
      kv = kv.at[i, 1, rows_B, positions_B].set(v_B1KH[:, 0].astype(kv.dtype))
      attn_B1NH = block.attend(q_B1NH, kv[i, 0], kv[i, 1], positions_B, "dense")
      return block.finish(x_B1D, attn_B1NH), cache._replace(kv_2BSKH=kv)

    def linear(block, i, carry):
      x_B1D, cache = carry
      x_B1D, past = block.step(x_B1D, jax.tree.map(lambda s: s[i], cache.linear))
      stacked = jax.tree.map(lambda s, new: s.at[i].set(new.astype(s.dtype)), cache.linear, past)
      return x_B1D, cache._replace(linear=LinearState(*stacked))

    x_B1D, cache = scan_layers(self, full, linear, (self.embed(tokens_B[:, None]), cache))
    return self.logits(x_B1D)[:, 0], cache


def scan_layers(model: Qwen35, on_full, on_linear, carry):
  """One `lax.scan` over the L layers in order: step l runs its kind's body, on_full(block, i,
  carry) or on_linear(block, i, carry), where i is the layer's row in its kind's stack and the
  block that row's weights (read in place: a dynamic slice of the stack)."""
  cfg = model.config
  stacks = {FULL: nnx.split(model.blocks), LINEAR: nnx.split(model.linear_blocks)}
  bodies = {FULL: on_full, LINEAR: on_linear}
  present = [t for t in (LINEAR, FULL) if cfg.layers_of(t)]
  rows_L = jnp.asarray([cfg.layers_of(t).index(l) for l, t in enumerate(cfg.layer_types)])
  kind_L = jnp.asarray([present.index(t) for t in cfg.layer_types], jnp.int32)

  def branch(layer_type):
    graphdef, stacked = stacks[layer_type]

    def run(carry, row):
      block = nnx.merge(graphdef, jax.tree.map(lambda w: w[row], stacked))
      return bodies[layer_type](block, row, carry)

    return run

  def step(carry, inputs):
    kind, row = inputs
    return jax.lax.switch(kind, [branch(t) for t in present], carry, row), None

  carry, _ = jax.lax.scan(step, carry, (kind_L, rows_L))
  return carry


# --- Hugging Face config.json and tensor names

# The language-model configs this family reads, and the multimodal checkpoints whose
# `text_config` is one (their vision tower is not loaded).
MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
_TEXT_MODEL_TYPE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
  """A multimodal checkpoint's language model config (its `text_config`), else `hf` itself."""
  model_type = hf.get("model_type")
  if model_type in _TEXT_MODEL_TYPE:
    text = hf.get("text_config")
    if not isinstance(text, dict):
      raise ValueError(f"config.json: a `{model_type}` checkpoint needs its `text_config` dict")
    return {**text, "model_type": _TEXT_MODEL_TYPE[model_type]}
  return hf


def layer_types_from_hf(hf: dict[str, Any]) -> tuple[str, ...]:
  """`layer_types`, or transformers' default pattern from `full_attention_interval` (4):
  layer i is full where (i + 1) is a multiple of the interval."""
  L = hf["num_hidden_layers"]
  types = hf.get("layer_types")
  if types is None:
    interval = hf.get("full_attention_interval", 4)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
      raise ValueError(
        f"config.json: `full_attention_interval` must be an integer >= 1, got {interval!r}"
      )
    types = [LINEAR if (i + 1) % interval else FULL for i in range(L)]
  if not isinstance(types, list) or len(types) != L or not set(types) <= {LINEAR, FULL}:
    raise ValueError(
      f"config.json: `layer_types` must list {LINEAR!r} or {FULL!r} for each of the {L} "
      f"layers, got {types!r}"
    )
  return tuple(types)


def qwen35_from_hf(hf: dict[str, Any], model_type: str, common: dict[str, Any]) -> Qwen35Config:
  """Qwen3.5 text as transformers reads it (a `qwen3_5` checkpoint: its text_config)."""
  if hf.get("attention_bias", False):
    raise ValueError("config.json: `attention_bias`=true is not supported (Qwen3.5 has none)")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: `hidden_act`={hf['hidden_act']!r} is not supported (silu)")
  num_heads = hf["num_attention_heads"]
  rope_hf = dict(hf)
  params = dict(hf.get("rope_parameters") or {})
  # transformers' Qwen3.5 defaults partial rotary to 0.25; its text positions are one
  # position per token on all three mRoPE sections, which is plain RoPE.
  factor = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
  for key in ("mrope_section", "mrope_interleaved"):
    params.pop(key, None)
  rope_hf["rope_parameters"] = params
  rope_hf.pop("partial_rotary_factor", None)
  linear = _experts_from_hf(hf, model_type)
  for ours, theirs, default in (
    ("linear_num_key_heads", "linear_num_key_heads", 16),
    ("linear_num_value_heads", "linear_num_value_heads", 32),
    ("linear_key_head_dim", "linear_key_head_dim", 128),
    ("linear_value_head_dim", "linear_value_head_dim", 128),
    ("linear_conv_kernel", "linear_conv_kernel_dim", 4),
  ):
    linear[ours] = hf.get(theirs, default)
  return Qwen35Config(
    **common,
    num_kv_heads=kv_heads_from_hf(hf, model_type, num_heads),
    head_dim=hf.get("head_dim") or 256,
    norm_eps=or_default(hf, "rms_norm_eps", model_type, 1e-6),
    rope=rope_from_hf(rope_hf, common["max_position_embeddings"], model_type),
    tie_embeddings=hf.get("tie_word_embeddings", False),
    qk_norm=True,
    layer_types=layer_types_from_hf(hf),
    partial_rotary_factor=float(factor),
    **linear,
  )


def _positive_int(hf: dict[str, Any], key: str, model_type: str) -> int:
  value = or_default(hf, key, model_type)
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"config.json: `{key}` must be an integer >= 1, got {value!r} ({model_type})")
  return value


def _experts_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
  """The MLP fields as transformers reads them: Qwen3.5's dense `intermediate_size`;
  Qwen3.5-MoE's experts (every layer; its router always renormalises the chosen weights);
  Qwen3-Next's (`num_experts` 0: dense), whose layers with a dense MLP among the experts
  (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused by name: one MLP per stack."""
  if model_type == "qwen3_5_text" or (
    model_type == "qwen3_next" and or_default(hf, "num_experts", model_type) == 0
  ):
    return {"mlp_dim": _positive_int(hf, "intermediate_size", model_type)}
  if model_type == "qwen3_next":
    L, step = hf["num_hidden_layers"], or_default(hf, "decoder_sparse_step", model_type)
    only = hf.get("mlp_only_layers") or []
    dense = [i for i in range(L) if i in only or not isinstance(step, int) or (i + 1) % step]
    if dense:
      raise ValueError(
        f"config.json: dense MLP layers {dense} among the experts (`mlp_only_layers`={only!r}, "
        f"`decoder_sparse_step`={step!r}) are not supported: every layer a mixture of experts"
      )
  experts = _positive_int(hf, "num_experts", model_type)
  top_k = _positive_int(hf, "num_experts_per_tok", model_type)
  if top_k > experts:
    raise ValueError(
      f"config.json: `num_experts_per_tok`={top_k} exceeds the {experts} experts ({model_type})"
    )
  normalize = or_default(hf, "norm_topk_prob", model_type)
  if model_type == "qwen3_5_moe_text":
    normalize = True  # its router renormalises whatever `norm_topk_prob` says
  return {
    "mlp_dim": _positive_int(hf, "moe_intermediate_size", model_type),
    "num_experts": experts,
    "experts_per_token": top_k,
    "normalize_expert_weights": bool(normalize),
    "shared_expert_dim": _positive_int(hf, "shared_expert_intermediate_size", model_type),
  }


# Where a `qwen3_5` checkpoint (with a vision tower) keeps the language model's tensors, and
# the vision tower's (not loaded: said so by `ignored_tensor`).
_TEXT_PREFIXES = ("model.language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.", "mtp.")


def ignored_tensor(cfg: Qwen35Config, name: str) -> str | None:
  """Why a tensor a checkpoint holds is not loaded: the vision tower, the multi-token
  prediction head (None: it is the language model's)."""
  if name.startswith("mtp."):
    return "the multi-token-prediction head (not used by prefill or greedy decoding)"
  if name.startswith(VISION_PREFIXES):
    return "the vision tower (kvr-jax runs the language model)"
  return None


def qwen35_targets(cfg: Qwen35Config, name: str) -> list[Target] | None:
  D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  F, V = cfg.mlp_dim, cfg.vocab_size
  if name == "lm_head.weight" and not cfg.tie_embeddings:
    return [(("lm_head",), None, lambda w: w.T, (V, D))]
  prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
  if prefix is None:
    return None
  rest = name[len(prefix) :]
  if rest == "embed_tokens.weight":
    return [(("embedding",), None, same, (V, D))]
  if rest == "norm.weight":
    return [(("norm",), None, same, (D,))]
  m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
  if not m or int(m.group(1)) >= cfg.num_layers:
    return None
  layer, rest = int(m.group(1)), m.group(2)
  layer_type = cfg.layer_types[layer]
  stack = "blocks" if layer_type == FULL else "linear_blocks"
  row = cfg.layers_of(layer_type).index(layer)
  if cfg.num_experts:
    expert = _expert_target(cfg, stack, row, rest)
    if expert is not None:
      return expert
  if layer_type == LINEAR and rest in _FUSED_LINEAR:
    return _fused_linear_targets(cfg, row, rest)
  per_layer = {
    "input_layernorm.weight": ("attn_norm", same, (D,)),
    "post_attention_layernorm.weight": ("mlp_norm", same, (D,)),
  }
  if not cfg.num_experts:
    per_layer.update(
      {
        "mlp.gate_proj.weight": linear_entry("w_gate", (D,), (F,)),
        "mlp.up_proj.weight": linear_entry("w_up", (D,), (F,)),
        "mlp.down_proj.weight": linear_entry("w_down", (F,), (D,)),
      }
    )
  if layer_type == FULL:
    if rest == "self_attn.q_proj.weight":  # per head: H query rows, then H gate rows
      split = lambda w, half: w.T.reshape(D, N, 2, H)[:, :, half]  # noqa: E731
      return [
        ((stack, "wq"), row, lambda w: split(w, 0), (2 * N * H, D)),
        ((stack, "wq_gate"), row, lambda w: split(w, 1), (2 * N * H, D)),
      ]
    per_layer.update(
      {
        "self_attn.k_proj.weight": linear_entry("wk", (D,), (K, H)),
        "self_attn.v_proj.weight": linear_entry("wv", (D,), (K, H)),
        "self_attn.o_proj.weight": linear_entry("wo", (N, H), (D,)),
        "self_attn.q_norm.weight": ("q_norm", same, (H,)),
        "self_attn.k_norm.weight": ("k_norm", same, (H,)),
      }
    )
  else:
    C, W = cfg.conv_channels, cfg.linear_conv_kernel
    h, v = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    per_layer.update(
      {
        "linear_attn.in_proj_qkv.weight": linear_entry("w_qkv", (D,), (C,)),
        "linear_attn.in_proj_z.weight": linear_entry("w_z", (D,), (h, v)),
        "linear_attn.in_proj_b.weight": linear_entry("w_b", (D,), (h,)),
        "linear_attn.in_proj_a.weight": linear_entry("w_a", (D,), (h,)),
        "linear_attn.conv1d.weight": ("conv", lambda w: w[:, 0].T, (C, 1, W)),
        "linear_attn.dt_bias": ("dt_bias", same, (h,)),
        "linear_attn.A_log": ("A_log", same, (h,)),
        "linear_attn.norm.weight": ("out_norm", same, (v,)),
        "linear_attn.out_proj.weight": linear_entry("w_out", (h, v), (D,)),
      }
    )
  if rest not in per_layer:
    return None
  param, fn, hf_shape = per_layer[rest]
  return [((stack, param), row, fn, hf_shape)]


_FUSED_LINEAR = ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")
_EXPERT_PROJECTIONS = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


def _expert_target(cfg: Qwen35Config, stack: str, row: int, rest: str) -> list[Target] | None:
  """A mixture's tensors: the router [E, D] -> [D, E]; expert e's gate, up, down -> its slice
  of w_gate, w_up, w_down [L, E, ...] (index (row, e)); the shared expert's -> w_shared_*;
  the shared expert's gate [1, D] -> [D]."""
  D, F, E, Fs = cfg.d_model, cfg.mlp_dim, cfg.num_experts, cfg.shared_expert_dim
  if rest == "mlp.gate.weight":
    return [((stack, "router"), row, lambda w: w.T, (E, D))]
  if rest == "mlp.shared_expert_gate.weight":
    return [((stack, "shared_gate"), row, lambda w: w[0], (1, D))]
  m = re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)\.weight", rest)
  if m and int(m.group(1)) < E and m.group(2) in _EXPERT_PROJECTIONS:
    param = _EXPERT_PROJECTIONS[m.group(2)]
    hf_shape = (D, F) if param == "w_down" else (F, D)
    return [((stack, param), (row, int(m.group(1))), lambda w: w.T, hf_shape)]
  m = re.fullmatch(r"mlp\.shared_expert\.(\w+)\.weight", rest)
  if m and m.group(1) in _EXPERT_PROJECTIONS:
    param = _EXPERT_PROJECTIONS[m.group(1)].replace("w_", "w_shared_")
    hf_shape = (D, Fs) if param == "w_shared_down" else (Fs, D)
    return [((stack, param), row, lambda w: w.T, hf_shape)]
  return None


def _fused_linear_targets(cfg: Qwen35Config, row: int, rest: str) -> list[Target]:
  """Qwen3-Next's fused in-projections, laid out per key head g: in_proj_qkvz rows [q (k),
  k (k), v (r v), z (r v)] of each g (r = h / g value heads per key head), in_proj_ba rows
  [b (r), a (r)] of each g; into Qwen3.5's layout: w_qkv's columns every head's q, then k,
  then v (value head g r + j, as transformers' reshape orders them), w_z, w_b, w_a."""
  D, g, d_k = cfg.d_model, cfg.linear_num_key_heads, cfg.linear_key_head_dim
  h, d_v = cfg.linear_num_value_heads, cfg.linear_value_head_dim
  r = h // g
  stack = "linear_blocks"
  if rest == "linear_attn.in_proj_qkvz.weight":
    per_head = 2 * d_k + 2 * r * d_v
    pieces = lambda w: np.split(  # noqa: E731
      w.T.reshape(D, g, per_head), [d_k, 2 * d_k, 2 * d_k + r * d_v], axis=-1
    )

    def qkv(w):
      q, k, v, _ = pieces(w)
      return np.concatenate([x.reshape(D, -1) for x in (q, k, v)], axis=-1)

    hf_shape = (g * per_head, D)
    return [
      ((stack, "w_qkv"), row, qkv, hf_shape),
      ((stack, "w_z"), row, lambda w: pieces(w)[3].reshape(D, h, d_v), hf_shape),
    ]
  split = lambda w, half: w.T.reshape(D, g, 2, r)[:, :, half].reshape(D, h)  # noqa: E731
  return [
    ((stack, "w_b"), row, lambda w: split(w, 0), (2 * h, D)),
    ((stack, "w_a"), row, lambda w: split(w, 1), (2 * h, D)),
  ]


FAMILY = Family(
  architecture="qwen3_5",
  model_types=MODEL_TYPES,
  config_class=Qwen35Config,
  module_class=Qwen35,
  from_hf=qwen35_from_hf,
  tensor_targets=qwen35_targets,
  text_config=text_config,
  ignores=ignored_tensor,
)
