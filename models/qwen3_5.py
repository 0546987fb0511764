"""Qwen3.5 (text) in Flax NNX: a hybrid of Gated DeltaNet linear attention and softmax
attention, as transformers 5 computes it (`Qwen3_5ForCausalLM`, model_type `qwen3_5_text`,
and the language model of a `qwen3_5` checkpoint).

Legend: B batch, T tokens, S cache positions, D d_model, N query heads, K KV heads, H head dim,
F MLP dim; linear layers: h value heads, g key heads, k key dim, v value dim, C convolution
channels (2 g k + h v), W convolution kernel, w = W - 1.

Layers follow `layer_types` (transformers' default: three linear layers then one full, repeated).
The two kinds have different weights, so they are two stacks: `blocks` holds the full-attention
layers (a `models.base.Block`: project_qkv, attend, finish, as every family's) and
`linear_blocks` the linear ones. `models.base.scan_layers` runs the L layers in order in one
`lax.scan` (the stacks interleave), each step its kind's body on its own slice of its kind's
stack.

A full layer: (1 + w) RMSNorm; q_proj gives each head its query and an output gate; per-head
(1 + w) q/k norms; RoPE on the first `rotary_dim` features of each head (partial rotary); the
attention output times sigmoid(gate), then o_proj. A linear layer: Gated DeltaNet
(models/gated_deltanet_layer.py). Both end in a SwiGLU MLP. The past of a full layer is its
K,V; of a linear layer, its state [h, k, v] (float32) and the last w rows of its
convolution's input (`HybridCache`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.base import (
  Block,
  CausalLM,
  LayerStack,
  finish_one_row,
  no_reduce,
  normal_param,
  scan_layers,
  write_rows,
  zeros_param,
)
from models.family import Family
from models.gated_deltanet_layer import GatedDeltaNetBlock, LinearState, OnePlusNormMlp
from models.kv_cache import KVCache
from models.layer_kinds import GatedDeltaNetKind
from models.norms import rms_norm_one_plus
from models.qwen3_5_config import (
  FULL,
  LINEAR,
  MODEL_TYPES,
  Qwen35Config,
  qwen35_from_hf,
  text_config,
)
from models.rope import apply_rope
from models.tensor_names import Target, linear_entry, same


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

  def layer_stacks(self) -> tuple[LayerStack, ...]:
    """The linear layers' stack and the full layers', each with the layers it holds (they
    interleave: `scan_layers` runs them in one scan)."""
    stacks = (
      (self.linear_blocks, self.config.layers_of(LINEAR)),
      (self.blocks, self.config.layers_of(FULL)),
    )
    return tuple(LayerStack(blocks, layers) for blocks, layers in stacks if layers)

  def empty_cache(self, batch: int, capacity: int) -> HybridCache:
    """A zero past for `batch` rows and `capacity` positions (the prompt and what decode adds)."""
    # Sizes from the weights: a shard's heads and channels where a model axis splits them.
    L_full, _, K, H = self.blocks.wk.shape
    L_linear, W, g, d_k = self.linear_blocks.conv_q.shape
    h, d_v = self.linear_blocks.conv_v.shape[2:]
    C = 2 * g * d_k + h * d_v
    return HybridCache(
      jnp.zeros((L_full, 2, batch, capacity, K, H), self.dtype),
      LinearState(
        jnp.zeros((L_linear, batch, h, d_k, d_v), jnp.float32),
        jnp.zeros((L_linear, batch, W - 1, C), self.dtype),
      ),
    )

  def forward(
    self,
    tokens_BT,
    attention="dense",
    reduce=no_reduce,
    lengths_B=None,
    capacity=None,
    last_row_only=False,
  ):
    """The whole prompt on one device: (final hidden states [B, T, D], `HybridCache` of
    `capacity` positions (default T)). lengths_B: each row's real length (right padding).
    last_row_only: a full last layer attends and finishes the last row alone (a prefill's:
    its other rows' hidden states are then not the model's; rows of one length only)."""
    if last_row_only and lengths_B is not None:
      raise ValueError("last_row_only reads position T-1 of every row: give no lengths_B")
    B, T = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    cache = self.empty_cache(B, T if capacity is None else capacity)

    def full(block, at, carry):
      i = at.row  # the layer's row in its kind's stack
      x_BTD, cache = carry
      q, k, v = block.project_qkv(x_BTD, positions_BT)
      kv_2BTKH = jnp.stack([k, v])

      def every_row(x_BTD):
        return block.finish(x_BTD, block.attend(q, k, v, 0, attention), reduce=reduce)

      def last_row(x_BTD):
        return finish_one_row(block, x_BTD, q, kv_2BTKH, T - 1, T - 1, reduce)

      if last_row_only:
        last = at.index == self.config.num_layers - 1
        x_BTD = jax.lax.cond(last, last_row, every_row, x_BTD)
      else:
        x_BTD = every_row(x_BTD)
      kv_2BTKH = kv_2BTKH.astype(cache.kv_2BSKH.dtype)
      kv = jax.lax.dynamic_update_slice(cache.kv_2BSKH, kv_2BTKH[None], (i, 0, 0, 0, 0, 0))
      return x_BTD, cache._replace(kv_2BSKH=kv)

    def linear(block, at, carry):
      i = at.row  # the layer's row in its kind's stack
      x_BTD, cache = carry
      past = jax.tree.map(lambda s: s[i], cache.linear)
      x_BTD, past = block.run(x_BTD, past, lengths_B, reduce=reduce)
      stacked = jax.tree.map(lambda s, new: s.at[i].set(new.astype(s.dtype)), cache.linear, past)
      return x_BTD, cache._replace(linear=LinearState(*stacked))

    return scan_layers(self, by_kind(full, linear), (self.embed(tokens_BT), cache))[0]

  def __call__(self, tokens_BT):
    """Logits of every position, [B, T, V] float32."""
    x_BTD, _ = self.forward(tokens_BT)
    return self.logits(x_BTD)

  def decode_step(self, tokens_B, positions_B, cache: HybridCache | KVCache, reduce=no_reduce):
    """One token per row, row b at `positions_B[b]` (its length so far): (logits [B, V], the
    cache with the token's K,V written at its position and every linear layer's past moved
    on). reduce: a model group's sum over its shards (each holds some heads, their cache and
    states: runtime.tensor_parallel). A model of full-attention layers alone keeps a K,V
    model's cache (`KVCache`) and decodes as one."""
    if isinstance(cache, KVCache):
      return super().decode_step(tokens_B, positions_B, cache, reduce=reduce)
    B = tokens_B.shape[0]
    positions_B = jnp.broadcast_to(jnp.asarray(positions_B, jnp.int32), (B,))

    def full(block, at, carry):
      i = at.row  # the layer's row in its kind's stack
      x_B1D, cache = carry
      q_B1NH, k_B1KH, v_B1KH = block.project_qkv(x_B1D, positions_B[:, None])
      kv = cache.kv_2BSKH
      kv = write_rows(kv, (i, 0), positions_B, k_B1KH)
      kv = write_rows(kv, (i, 1), positions_B, v_B1KH)
      attn_B1NH = block.attend(q_B1NH, kv[i, 0], kv[i, 1], positions_B, "dense")
      return block.finish(x_B1D, attn_B1NH, reduce=reduce), cache._replace(kv_2BSKH=kv)

    def linear(block, at, carry):
      i = at.row  # the layer's row in its kind's stack
      x_B1D, cache = carry
      x_B1D, past = block.step(x_B1D, jax.tree.map(lambda s: s[i], cache.linear), reduce)
      stacked = jax.tree.map(lambda s, new: s.at[i].set(new.astype(s.dtype)), cache.linear, past)
      return x_B1D, cache._replace(linear=LinearState(*stacked))

    x_B1D, cache = scan_layers(self, by_kind(full, linear), (self.embed(tokens_B[:, None]), cache))[
      0
    ]
    return self.logits(x_B1D)[:, 0], cache


def by_kind(on_full, on_linear):
  """One `scan_layers` body from a full layer's and a linear layer's, each on_*(block,
  layer, carry) -> carry (`models.base.Layer`: its index in the model, its row in its
  kind's stack)."""

  def body(block, layer, carry):
    on_layer = on_linear if isinstance(layer.kind, GatedDeltaNetKind) else on_full
    return on_layer(block, layer, carry), None

  return body


# --- Hugging Face config.json and tensor names

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
  D, N, H, V = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.vocab_size
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
  if layer_type == FULL and rest == "self_attn.q_proj.weight":
    # per head: H query rows, then H gate rows
    split = lambda w, half: w.T.reshape(D, N, 2, H)[:, :, half]  # noqa: E731
    return [
      ((stack, "wq"), row, lambda w: split(w, 0), (2 * N * H, D)),
      ((stack, "wq_gate"), row, lambda w: split(w, 1), (2 * N * H, D)),
    ]
  per_layer = _layer_entries(cfg, layer_type)
  if rest not in per_layer:
    return None
  param, fn, hf_shape = per_layer[rest]
  return [((stack, param), row, fn, hf_shape)]


def _layer_entries(cfg: Qwen35Config, layer_type: str) -> dict:
  """A layer's tensors by their name within the layer (q_proj aside): (param, fn, shape)."""
  D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
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
    h, v = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    per_layer.update(
      {
        "linear_attn.in_proj_z.weight": linear_entry("w_z", (D,), (h, v)),
        "linear_attn.in_proj_b.weight": linear_entry("w_b", (D,), (h,)),
        "linear_attn.in_proj_a.weight": linear_entry("w_a", (D,), (h,)),
        "linear_attn.dt_bias": ("dt_bias", same, (h,)),
        "linear_attn.A_log": ("A_log", same, (h,)),
        "linear_attn.norm.weight": ("out_norm", same, (v,)),
        "linear_attn.out_proj.weight": linear_entry("w_out", (h, v), (D,)),
      }
    )
  return per_layer


_FUSED_LINEAR = (
  "linear_attn.in_proj_qkv.weight",
  "linear_attn.conv1d.weight",
  "linear_attn.in_proj_qkvz.weight",
  "linear_attn.in_proj_ba.weight",
)
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
  """The fused tensors of a linear layer, into per-head q, k, v weights (w_q, w_k [D, g, k],
  w_v [D, h, v]) and convolution kernels (conv_q, conv_k [W, g, k], conv_v [W, h, v]).
  Qwen3.5: in_proj_qkv's rows and conv1d's channels every key head's q, then k, then every
  value head's v. Qwen3-Next: in_proj_qkvz laid out per key head g, rows [q (k), k (k),
  v (r v), z (r v)] of each g (r = h / g value heads per key head: value head g r + j, as
  transformers' reshape orders them), in_proj_ba rows [b (r), a (r)] of each g."""
  D, g, d_k = cfg.d_model, cfg.linear_num_key_heads, cfg.linear_key_head_dim
  h, d_v, W = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel
  r = h // g
  stack = "linear_blocks"
  qkv_shapes = ((g, d_k), (g, d_k), (h, d_v))
  bounds = [g * d_k, 2 * g * d_k]

  C = 2 * g * d_k + h * d_v

  def per_head(params, columns, hf_shape):  # columns(w) -> [rows, C]: q, k, v channels
    return [
      (
        (stack, param),
        row,
        lambda w, i=i, shape=shape: _part(columns(w), bounds, i, shape),
        hf_shape,
      )
      for i, (param, shape) in enumerate(zip(params, qkv_shapes, strict=True))
    ]

  if rest == "linear_attn.in_proj_qkv.weight":
    return per_head(("w_q", "w_k", "w_v"), lambda w: w.T, (C, D))
  if rest == "linear_attn.conv1d.weight":
    return per_head(("conv_q", "conv_k", "conv_v"), lambda w: w[:, 0].T, (C, 1, W))
  if rest == "linear_attn.in_proj_qkvz.weight":
    per_key_head = 2 * d_k + 2 * r * d_v
    pieces = lambda w: np.split(  # noqa: E731
      w.T.reshape(D, g, per_key_head), [d_k, 2 * d_k, 2 * d_k + r * d_v], axis=-1
    )
    hf_shape = (g * per_key_head, D)
    return [
      ((stack, "w_q"), row, lambda w: pieces(w)[0], hf_shape),
      ((stack, "w_k"), row, lambda w: pieces(w)[1], hf_shape),
      ((stack, "w_v"), row, lambda w: pieces(w)[2].reshape(D, h, d_v), hf_shape),
      ((stack, "w_z"), row, lambda w: pieces(w)[3].reshape(D, h, d_v), hf_shape),
    ]
  split = lambda w, half: w.T.reshape(D, g, 2, r)[:, :, half].reshape(D, h)  # noqa: E731
  return [
    ((stack, "w_b"), row, lambda w: split(w, 0), (2 * h, D)),
    ((stack, "w_a"), row, lambda w: split(w, 1), (2 * h, D)),
  ]


def _part(columns_RC, bounds, index: int, shape: tuple[int, int]):
  """Part `index` (q, k or v) of fused channels [R, C] split at `bounds`, as [R, *shape]."""
  part = np.split(columns_RC, bounds, axis=-1)[index]
  return part.reshape(part.shape[0], *shape)


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
