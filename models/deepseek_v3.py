"""DeepSeek-V3 in Flax NNX (model_type `deepseek_v3`: DeepSeek-V3 / R1, Kimi K2, Moonlight), as
transformers 5 computes it (`DeepseekV3ForCausalLM`).

Legend: B batch, T tokens, S cache positions, D d_model, N heads, F the dense MLP's columns,
E routed experts, f an expert's columns, C the latent cache entry (kv_lora_rank + rope dim).

Every layer is multi-head latent attention (models/latent_attention.py) then an MLP: the first
`first_dense_layers` layers a dense SwiGLU, the rest a mixture of experts: DeepSeek's router
(sigmoid scores, a correction bias for the choice only, group-limited top-k, renormalised and
scaled: models.experts.route_grouped_sigmoid), the routed SwiGLU experts and `shared_experts`
shared ones (one SwiGLU of shared_experts x f columns, ungated). The two MLP kinds have
different weights, so the layers are two stacks run one after the other: `dense_blocks` then
`blocks` (either may be empty: None). Plain RMSNorms (w x). The cache is one latent per token
per layer, [L, B, S, C]: prefill writes it, decode attends it in the absorbed form and writes
the new token's entry in place.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models.base import CausalLM, no_reduce, normal_param, ones_param, zeros_param
from models.config import ModelConfig
from models.experts import route_grouped_sigmoid, run_experts, swiglu
from models.family import Family
from models.hf_config import or_default, rope_from_hf
from models.kernels import get_kernel
from models.latent_attention import LatentAttention
from models.layer_kinds import LatentAttentionKind
from models.norms import rms_norm
from models.tensor_names import Target, linear_entry, same


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(ModelConfig):
  """DeepSeek-V3: latent attention's ranks and head dims; the experts and their router.
  `head_dim` is a query's (and an expanded key's) width, nope + rope; `num_kv_heads` is
  `num_heads` (every head expands its own key and value from the shared latent); `mlp_dim`
  is the dense layers' F."""

  architecture: ClassVar[str] = "deepseek_v3"
  mlp_matrices: ClassVar[int] = 3
  reductions_per_layer: ClassVar[int] = 2
  q_lora_rank: int  # 0: a direct q projection
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  rope_interleave: bool = True
  first_dense_layers: int = 0
  num_experts: int = 0
  experts_per_token: int = 0
  expert_dim: int = 0
  shared_experts: int = 0
  num_expert_groups: int = 1
  groups_per_token: int = 1
  normalize_expert_weights: bool = True
  routed_scaling_factor: float = 1.0

  def __post_init__(self):
    super().__post_init__()
    ints = (
      ("q_lora_rank", 0),
      ("kv_lora_rank", 1),
      ("qk_nope_head_dim", 1),
      ("qk_rope_head_dim", 2),
      ("v_head_dim", 1),
      ("first_dense_layers", 0),
      ("num_experts", 0),
      ("experts_per_token", 0),
      ("expert_dim", 0),
      ("shared_experts", 0),
      ("num_expert_groups", 1),
      ("groups_per_token", 1),
    )
    for name, smallest in ints:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < smallest:
        raise ValueError(f"config field `{name}` must be an integer >= {smallest}, got {value!r}")
    if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
      raise ValueError(
        f"`head_dim` ({self.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
        f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim})"
      )
    if self.num_kv_heads != self.num_heads:
      raise ValueError("latent attention expands a key per head: `num_kv_heads` = `num_heads`")
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"`qk_rope_head_dim` must be even, got {self.qk_rope_head_dim}")
    if self.sliding_window is not None or self.layer_windows is not None:
      raise ValueError("DeepSeek-V3 has no sliding window")
    if self.first_dense_layers > self.num_layers:
      raise ValueError(
        f"`first_dense_layers` ({self.first_dense_layers}) exceeds the {self.num_layers} layers"
      )
    if self.moe_layers:
      self._check_experts()

  def _check_experts(self) -> None:
    E, k = self.num_experts, self.experts_per_token
    G, g = self.num_expert_groups, self.groups_per_token
    if not E or not self.expert_dim:
      raise ValueError(
        f"{self.moe_layers} layers are a mixture of experts: `num_experts` and `expert_dim` "
        "must be > 0"
      )
    if E % G or not 1 <= g <= G:
      raise ValueError(
        f"{E} experts in `num_expert_groups`={G} groups, `groups_per_token`={g}: the groups "
        "must divide the experts and a token choose 1 to all of them"
      )
    if E // G < 2:
      raise ValueError(f"a group's score is its two best experts': groups of {E // G} cannot")
    if not 1 <= k <= g * (E // G):
      raise ValueError(
        f"`experts_per_token`={k} must be in [1, {g * (E // G)}] (the experts of the "
        f"{g} groups a token chooses)"
      )

  @property
  def moe_layers(self) -> int:
    return self.num_layers - self.first_dense_layers

  @property
  def layer_kinds(self) -> tuple[LatentAttentionKind, ...]:
    return (LatentAttentionKind(self.kv_lora_rank, self.qk_rope_head_dim),) * self.num_layers

  @property
  def kinds(self) -> tuple[LatentAttentionKind, ...]:
    return self.layer_kinds[:1]

  @property
  def kind(self) -> LatentAttentionKind:
    return self.layer_kinds[0]

  def of_kind(self, kind) -> DeepseekV3Config:
    return self

  @property
  def cache_width(self) -> int:
    """C: one token's cache entry per layer (the latent and the shared rope key)."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def softmax_scale(self) -> float:
    """1/sqrt(nope + rope), times YaRN's mscale(factor, mscale_all_dim) squared where the
    rope scales (transformers' `yarn_apply_mscale`)."""
    scale = self.head_dim**-0.5
    rope = self.rope
    if rope.type != "default" and rope.mscale_all_dim and rope.factor > 1:
      mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
      scale *= mscale * mscale
    return scale

  # What the cost model counts of the MLP: the mixture's layers (most of them): a token's k
  # experts and the shared ones; the router's E columns.
  @property
  def active_mlp_dim(self) -> int:
    if not self.moe_layers:
      return self.mlp_dim
    return self.expert_dim * (self.experts_per_token + self.shared_experts)

  def mlp_weight_dim(self, num_tokens: float) -> float:
    if not self.moe_layers:
      return self.mlp_dim
    routed = min(self.num_experts, num_tokens * self.experts_per_token)
    return self.expert_dim * (routed + self.shared_experts)

  @property
  def router_dim(self) -> int:
    return self.num_experts if self.moe_layers else 0

  def attention_params(self) -> int:
    D, N, Q, R = self.d_model, self.num_heads, self.q_lora_rank, self.kv_lora_rank
    n, r, v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
    q = D * Q + Q + Q * N * (n + r) if Q else D * N * (n + r)
    return q + D * (R + r) + R + R * N * (n + v) + N * v * D

  def num_params(self) -> int:
    D, E, f = self.d_model, self.num_experts, self.expert_dim
    dense = self.first_dense_layers * self.mlp_matrices * D * self.mlp_dim
    moe = self.moe_layers * (self.mlp_matrices * D * f * (E + self.shared_experts) + D * E)
    head = 0 if self.tie_embeddings else self.vocab_size * D
    per_layer = self.attention_params() + 2 * D
    return self.vocab_size * D + self.num_layers * per_layer + dense + moe + D + head


class DeepseekV3Block(LatentAttention):
  """Stacked layers of one MLP kind: latent attention, then a dense SwiGLU (`experts` False)
  or the mixture of experts."""

  def __init__(self, config: DeepseekV3Config, *, num_layers: int, experts: bool, dtype, rngs):
    self.config = config
    self.experts = experts
    L, D = num_layers, config.d_model
    self.init_attention(L, dtype, rngs)
    self.mlp_norm = ones_param((L, D), dtype)
    if not experts:
      F = config.mlp_dim
      self.w_gate = normal_param(rngs, (L, D, F), dtype)
      self.w_up = normal_param(rngs, (L, D, F), dtype)
      self.w_down = normal_param(rngs, (L, F, D), dtype)
      return
    E, f, Fs = config.num_experts, config.expert_dim, config.expert_dim * config.shared_experts
    self.router = normal_param(rngs, (L, D, E), dtype)
    self.choice_bias = zeros_param((L, E), jnp.float32)  # e_score_correction_bias
    self.w_gate = normal_param(rngs, (L, E, D, f), dtype)
    self.w_up = normal_param(rngs, (L, E, D, f), dtype)
    self.w_down = normal_param(rngs, (L, E, f, D), dtype)
    if Fs:
      self.w_shared_gate = normal_param(rngs, (L, D, Fs), dtype)
      self.w_shared_up = normal_param(rngs, (L, D, Fs), dtype)
      self.w_shared_down = normal_param(rngs, (L, Fs, D), dtype)

  def attention_input(self, x_BTD):
    return rms_norm(x_BTD, self.attn_norm[...], self.config.norm_eps)

  def mlp(self, x_BTD, reduce=no_reduce):
    cfg = self.config
    h_BTD = rms_norm(x_BTD, self.mlp_norm[...], cfg.norm_eps)
    if not self.experts:
      return x_BTD + reduce(swiglu(h_BTD, self.w_gate[...], self.w_up[...], self.w_down[...]))
    weights_BTk, experts_BTk = route_grouped_sigmoid(
      h_BTD,
      self.router[...],
      self.choice_bias[...],
      cfg.experts_per_token,
      cfg.num_expert_groups,
      cfg.groups_per_token,
      cfg.normalize_expert_weights,
      cfg.routed_scaling_factor,
    )
    out_BTD = run_experts(
      h_BTD, weights_BTk, experts_BTk, self.w_gate[...], self.w_up[...], self.w_down[...]
    )
    if cfg.shared_experts:
      shared = (self.w_shared_gate[...], self.w_shared_up[...], self.w_shared_down[...])
      out_BTD = out_BTD + swiglu(h_BTD, *shared)
    return x_BTD + reduce(out_BTD)


class DeepseekV3(CausalLM):
  """Token embedding -> the dense layers, then the mixture-of-experts layers -> RMSNorm ->
  logits."""

  def __init__(self, config: DeepseekV3Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.dtype = jnp.dtype(dtype)
    V, D = config.vocab_size, config.d_model
    self.embedding = normal_param(rngs, (V, D), dtype)
    dense, moe = config.first_dense_layers, config.moe_layers
    self.dense_blocks = (
      DeepseekV3Block(config, num_layers=dense, experts=False, dtype=dtype, rngs=rngs)
      if dense
      else None
    )
    self.blocks = (
      DeepseekV3Block(config, num_layers=moe, experts=True, dtype=dtype, rngs=rngs) if moe else None
    )
    self.lm_head = None if config.tie_embeddings else normal_param(rngs, (D, V), dtype)
    self.norm = ones_param((D,), dtype)

  def final_norm(self, x_BTD):
    return rms_norm(x_BTD, self.norm[...], self.config.norm_eps)

  def empty_cache(self, batch: int, capacity: int) -> jax.Array:
    """A zero latent cache [L, B, capacity, C]."""
    cfg = self.config
    return jnp.zeros((cfg.num_layers, batch, capacity, cfg.cache_width), self.dtype)

  def forward(self, tokens_BT, attention="dense", reduce=no_reduce, capacity=None):
    """The whole prompt on one device: (final hidden states [B, T, D], the latent cache
    [L, B, capacity (default T), C] with the prompt's entries). Every head's keys and values
    are expanded from the latents and attended with the kernel `attention`
    (`attend_expanded`)."""
    get_kernel(attention)  # an unknown kernel is refused by name before anything traces
    B, T = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))

    def layer(block, l, carry):
      x_BTD, cache = carry
      h_BTD = block.attention_input(x_BTD)
      q_nope, q_rope = block.queries(h_BTD, positions_BT)
      entry_BTC = block.latents(h_BTD, positions_BT)
      attn_BTNv = block.attend_expanded(q_nope, q_rope, entry_BTC, 0, attention)
      x_BTD = block.mlp(x_BTD + reduce(block.attention_output(attn_BTNv)), reduce)
      cache = jax.lax.dynamic_update_slice(cache, entry_BTC[None].astype(cache.dtype), (l, 0, 0, 0))
      return x_BTD, cache

    cache = self.empty_cache(B, T if capacity is None else capacity)
    return self.scan_layers(layer, (self.embed(tokens_BT), cache))

  def __call__(self, tokens_BT):
    """Logits of every position, [B, T, V] float32."""
    x_BTD, _ = self.forward(tokens_BT)
    return self.logits(x_BTD)

  def decode_step(self, tokens_B, positions_B, cache):
    """One token per row, row b at `positions_B[b]` (its length so far): (logits [B, V], the
    cache with the token's latent written at its position), attending in the absorbed form."""
    B = tokens_B.shape[0]
    positions_B = jnp.broadcast_to(jnp.asarray(positions_B, jnp.int32), (B,))
    rows_B = jnp.arange(B)

    def layer(block, l, carry):
      x_B1D, cache = carry
      h_B1D = block.attention_input(x_B1D)
      q_nope, q_rope = block.queries(h_B1D, positions_B[:, None])
      entry_BC = block.latents(h_B1D, positions_B[:, None])[:, 0]
      cache = cache.at[l, rows_B, positions_B].set(entry_BC.astype(cache.dtype))
      attn_BNv = block.attend_absorbed(q_nope[:, 0], q_rope[:, 0], cache[l], positions_B)
      x_B1D = x_B1D + block.attention_output(attn_BNv[:, None])
      return block.mlp(x_B1D), cache

    x_B1D, cache = self.scan_layers(layer, (self.embed(tokens_B[:, None]), cache))
    return self.logits(x_B1D)[:, 0], cache

  def scan_layers(self, body, carry):
    """The dense stack's layers, then the experts' (one `lax.scan` each, the weights read in
    place): body(block of layer l, l, carry) -> carry, l the layer's index in the model."""
    first = 0
    for stack in (self.dense_blocks, self.blocks):
      if stack is None:
        continue
      graphdef, stacked = nnx.split(stack)
      num = jax.tree.leaves(stacked)[0].shape[0]

      def step(carry, inputs, graphdef=graphdef):
        layer_state, l = inputs
        return body(nnx.merge(graphdef, layer_state), l, carry), None

      carry, _ = jax.lax.scan(step, carry, (stacked, first + jnp.arange(num)))
      first += num
    return carry


# --- Hugging Face config.json and tensor names

MODEL_TYPES = ("deepseek_v3",)


def deepseek_v3_from_hf(
  hf: dict[str, Any], model_type: str, common: dict[str, Any]
) -> DeepseekV3Config:
  """DeepSeek-V3 as transformers reads it (its defaults where a key is absent)."""
  if hf.get("attention_bias", False):
    raise ValueError("config.json: `attention_bias`=true is not supported (DeepSeek-V3 has none)")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: `hidden_act`={hf['hidden_act']!r} is not supported (silu)")
  get = lambda key: or_default(hf, key, model_type)  # noqa: E731
  num_heads = common["num_heads"]
  kv_heads = hf.get("num_key_value_heads") or num_heads
  if kv_heads != num_heads:
    raise ValueError(
      f"config.json: `num_key_value_heads`={kv_heads} != num_attention_heads={num_heads}: "
      "latent attention expands a key per head (transformers would repeat them)"
    )
  nope, rope_dim = get("qk_nope_head_dim"), get("qk_rope_head_dim")
  rope_hf = dict(hf)
  rope_hf.pop("partial_rotary_factor", None)
  return DeepseekV3Config(
    **common,
    num_kv_heads=num_heads,
    head_dim=nope + rope_dim,
    mlp_dim=get("intermediate_size"),
    norm_eps=get("rms_norm_eps"),
    rope=rope_from_hf(rope_hf, common["max_position_embeddings"], model_type),
    tie_embeddings=hf.get("tie_word_embeddings", False),
    q_lora_rank=get("q_lora_rank") or 0,
    kv_lora_rank=get("kv_lora_rank"),
    qk_nope_head_dim=nope,
    qk_rope_head_dim=rope_dim,
    v_head_dim=get("v_head_dim"),
    rope_interleave=bool(get("rope_interleave")),
    first_dense_layers=min(get("first_k_dense_replace") or 0, common["num_layers"]),
    num_experts=get("n_routed_experts"),
    experts_per_token=get("num_experts_per_tok"),
    expert_dim=get("moe_intermediate_size"),
    shared_experts=get("n_shared_experts") or 0,
    num_expert_groups=get("n_group") or 1,
    groups_per_token=get("topk_group") or 1,
    normalize_expert_weights=bool(get("norm_topk_prob")),
    routed_scaling_factor=float(get("routed_scaling_factor")),
  )


def ignored_tensor(cfg: DeepseekV3Config, name: str) -> str | None:
  """The multi-token-prediction layers a checkpoint may hold past the model's layers."""
  m = re.fullmatch(r"model\.layers\.(\d+)\..+", name)
  if m and int(m.group(1)) >= cfg.num_layers:
    return "a multi-token-prediction layer (not used by prefill or greedy decoding)"
  return None


_PROJECTIONS = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


def deepseek_v3_targets(cfg: DeepseekV3Config, name: str) -> list[Target] | None:
  D, V = cfg.d_model, cfg.vocab_size
  if name == "lm_head.weight" and not cfg.tie_embeddings:
    return [(("lm_head",), None, lambda w: w.T, (V, D))]
  if name == "model.embed_tokens.weight":
    return [(("embedding",), None, same, (V, D))]
  if name == "model.norm.weight":
    return [(("norm",), None, same, (D,))]
  m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
  if not m or int(m.group(1)) >= cfg.num_layers:
    return None
  layer, rest = int(m.group(1)), m.group(2)
  dense = layer < cfg.first_dense_layers
  stack = "dense_blocks" if dense else "blocks"
  row = layer if dense else layer - cfg.first_dense_layers
  if rest == "self_attn.kv_b_proj.weight":  # per head: n key rows, then v value rows
    R, N, n = cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim
    per_head = lambda w: w.T.reshape(R, N, n + cfg.v_head_dim)  # noqa: E731
    hf_shape = (N * (n + cfg.v_head_dim), R)
    return [
      ((stack, "wk_b"), row, lambda w: per_head(w)[..., :n], hf_shape),
      ((stack, "wv_b"), row, lambda w: per_head(w)[..., n:], hf_shape),
    ]
  entry = _attention_entry(cfg, rest) or _mlp_entry(cfg, rest, dense)
  if entry is None:
    return _expert_target(cfg, stack, row, rest) if not dense else None
  param, fn, hf_shape = entry
  return [((stack, param), row, fn, hf_shape)]


def _attention_entry(cfg: DeepseekV3Config, rest: str):
  D, N, Q, R = cfg.d_model, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
  n, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  entries = {
    "input_layernorm.weight": ("attn_norm", same, (D,)),
    "post_attention_layernorm.weight": ("mlp_norm", same, (D,)),
    "self_attn.kv_a_proj_with_mqa.weight": linear_entry("wkv_a", (D,), (R + r,)),
    "self_attn.kv_a_layernorm.weight": ("kv_a_norm", same, (R,)),
    "self_attn.o_proj.weight": linear_entry("wo", (N, v), (D,)),
  }
  if Q:
    entries.update(
      {
        "self_attn.q_a_proj.weight": linear_entry("wq_a", (D,), (Q,)),
        "self_attn.q_a_layernorm.weight": ("q_a_norm", same, (Q,)),
        "self_attn.q_b_proj.weight": linear_entry("wq_b", (Q,), (N, n + r)),
      }
    )
  else:
    entries["self_attn.q_proj.weight"] = linear_entry("wq", (D,), (N, n + r))
  return entries.get(rest)


def _mlp_entry(cfg: DeepseekV3Config, rest: str, dense: bool):
  D = cfg.d_model
  if dense:
    F = cfg.mlp_dim
    entries = {
      "mlp.gate_proj.weight": linear_entry("w_gate", (D,), (F,)),
      "mlp.up_proj.weight": linear_entry("w_up", (D,), (F,)),
      "mlp.down_proj.weight": linear_entry("w_down", (F,), (D,)),
    }
    return entries.get(rest)
  E, Fs = cfg.num_experts, cfg.expert_dim * cfg.shared_experts
  entries = {
    "mlp.gate.weight": ("router", lambda w: w.T, (E, D)),
    "mlp.gate.e_score_correction_bias": ("choice_bias", same, (E,)),
  }
  if Fs:
    entries.update(
      {
        "mlp.shared_experts.gate_proj.weight": linear_entry("w_shared_gate", (D,), (Fs,)),
        "mlp.shared_experts.up_proj.weight": linear_entry("w_shared_up", (D,), (Fs,)),
        "mlp.shared_experts.down_proj.weight": linear_entry("w_shared_down", (Fs,), (D,)),
      }
    )
  return entries.get(rest)


def _expert_target(cfg: DeepseekV3Config, stack: str, row: int, rest: str) -> list[Target] | None:
  """Routed expert e's gate, up or down [f, D] / [D, f] -> its slice (row, e) of the stack."""
  m = re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)\.weight", rest)
  if not m or int(m.group(1)) >= cfg.num_experts or m.group(2) not in _PROJECTIONS:
    return None
  param = _PROJECTIONS[m.group(2)]
  D, f = cfg.d_model, cfg.expert_dim
  hf_shape = (D, f) if param == "w_down" else (f, D)
  return [((stack, param), (row, int(m.group(1))), lambda w: w.T, hf_shape)]


FAMILY = Family(
  architecture="deepseek_v3",
  model_types=MODEL_TYPES,
  config_class=DeepseekV3Config,
  module_class=DeepseekV3,
  from_hf=deepseek_v3_from_hf,
  tensor_targets=deepseek_v3_targets,
  ignores=ignored_tensor,
)
