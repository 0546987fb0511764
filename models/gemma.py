"""Gemma 3 (text) in Flax NNX.

Legend: B batch, T tokens, D d_model, N query heads, K KV heads, H head dim, F MLP dim,
L layers. Block parameters carry a leading [L] axis (see models/base.py). What differs from
Llama: RMSNorms of the form x (1 + w) computed in float32 (before and after attention and the
MLP, and of each q and k head), GeGLU with tanh GELU, the embedding times sqrt(D), the
softmax scaled by query_pre_attn_scalar^-1/2 (folded into q), a tied head, and a window and
a RoPE per layer kind (`GemmaConfig.with_window`, what `scan_layers` gives each layer).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models.base import Block, CausalLM, no_reduce, normal_param, zeros_param
from models.config import ModelConfig, RopeConfig
from models.family import Family
from models.hf_config import FAMILY_DEFAULTS, kv_heads_from_hf, or_default, refuse, rope_from_hf
from models.llama import llama_targets
from models.norms import rms_norm_one_plus
from models.rope import apply_rope
from models.tensor_names import Target, same


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig(ModelConfig):
  """Gemma 3 (text): RMSNorms of the form x (1 + w) around attention and the MLP (before and
  after each), RMSNorm of q and k per head, GeGLU (tanh GELU), the embedding scaled by
  sqrt(D), a softmax scale of query_pre_attn_scalar^-1/2, the head tied to the embedding.
  Its layers interleave sliding-window ones (`layer_windows`: W) with full ones (None), each
  with its own RoPE: `local_rope` on the windowed layers, `rope` on the full ones."""

  architecture: ClassVar[str] = "gemma3"
  mlp_matrices: ClassVar[int] = 3
  reductions_per_layer: ClassVar[int] = 2
  query_pre_attn_scalar: float = 256.0
  local_rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
  qk_norm: bool = True
  tie_embeddings: bool = True

  def __post_init__(self):
    super().__post_init__()
    if not self.qk_norm or self.qkv_bias:
      raise ValueError("Gemma 3 norms q and k and has no Q/K/V bias")

  def with_window(self, window: int | None) -> GemmaConfig:
    """One layer of this model: its window and the RoPE of its kind (local where windowed).
    (Without `layer_windows` every layer runs `sliding_window` with `rope`.)"""
    rope = self.local_rope if window is not None else self.rope
    return dataclasses.replace(self, sliding_window=window, layer_windows=None, rope=rope)

  def num_params(self) -> int:
    D, F = self.d_model, self.mlp_dim
    per_layer = self.attention_params() + self.mlp_matrices * D * F + 4 * D
    head = 0 if self.tie_embeddings else self.vocab_size * D
    return self.vocab_size * D + self.num_layers * per_layer + D + head


class GemmaBlock(Block):
  """Pre- and post-norm attention, pre- and post-norm GeGLU MLP, each with a residual."""

  def __init__(self, config: GemmaConfig, *, num_layers: int, dtype, rngs: nnx.Rngs):
    self.config = config
    L, D, F, H = num_layers, config.d_model, config.mlp_dim, config.head_dim
    self.init_attention(num_layers, dtype, rngs)  # wq, wk, wv, wo, q_norm, k_norm
    self.q_norm = zeros_param((L, H), dtype)  # x (1 + w): zero is the identity
    self.k_norm = zeros_param((L, H), dtype)
    for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"):
      setattr(self, name, zeros_param((L, D), dtype))
    self.w_gate = normal_param(rngs, (L, D, F), dtype)
    self.w_up = normal_param(rngs, (L, D, F), dtype)
    self.w_down = normal_param(rngs, (L, F, D), dtype)

  def attention_input(self, x_BTD: jax.Array) -> jax.Array:
    return rms_norm_one_plus(x_BTD, self.attn_norm[...], self.config.norm_eps)

  def project_qkv(self, x_BTD: jax.Array, positions_BT: jax.Array):
    """Norm, projections, q/k norms, RoPE of this layer's kind; q carries the softmax scale
    query_pre_attn_scalar^-1/2 in place of the kernels' H^-1/2."""
    cfg = self.config
    h_BTD = self.attention_input(x_BTD)
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", h_BTD, self.wq[...])
    k_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, self.wk[...])
    v_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, self.wv[...])
    q_BTNH = rms_norm_one_plus(q_BTNH, self.q_norm[...], cfg.norm_eps)
    k_BTKH = rms_norm_one_plus(k_BTKH, self.k_norm[...], cfg.norm_eps)
    q_BTNH = apply_rope(q_BTNH, positions_BT, cfg.rope)
    k_BTKH = apply_rope(k_BTKH, positions_BT, cfg.rope)
    scale = math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar)
    return (q_BTNH * scale).astype(q_BTNH.dtype), k_BTKH, v_BTKH

  def finish_rows(self, x_BTD: jax.Array, attn_BTNH: jax.Array, reduce=no_reduce) -> jax.Array:
    eps = self.config.norm_eps
    attn_BTD = reduce(self.attention_output(attn_BTNH))
    x_BTD = x_BTD + rms_norm_one_plus(attn_BTD, self.post_attn_norm[...], eps)
    h_BTD = rms_norm_one_plus(x_BTD, self.mlp_norm[...], eps)
    gate_BTF = jax.nn.gelu(jnp.einsum("BTD,DF->BTF", h_BTD, self.w_gate[...]), approximate=True)
    up_BTF = jnp.einsum("BTD,DF->BTF", h_BTD, self.w_up[...])
    mlp_BTD = reduce(jnp.einsum("BTF,FD->BTD", gate_BTF * up_BTF, self.w_down[...]))
    return x_BTD + rms_norm_one_plus(mlp_BTD, self.post_mlp_norm[...], eps)


class Gemma(CausalLM):
  block_class = GemmaBlock

  def __init__(self, config: GemmaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    super().__init__(config, dtype=dtype, rngs=rngs)
    self.norm = zeros_param((config.d_model,), dtype)

  def embed(self, tokens_BT: jax.Array) -> jax.Array:
    """The embedding times sqrt(D), the scale rounded to the weights' dtype first."""
    scale = jnp.asarray(math.sqrt(self.config.d_model), jnp.float32).astype(self.dtype)
    return super().embed(tokens_BT) * scale

  def final_norm(self, x_BTD: jax.Array) -> jax.Array:
    return rms_norm_one_plus(x_BTD, self.norm[...], self.config.norm_eps)


# --- Hugging Face config.json and tensor names


# Present and not null, these must be positive: Gemma 3's attention scale, its window (one
# windowed layer in every `sliding_window_pattern`).
GEMMA_POSITIVE_FIELDS = {"query_pre_attn_scalar": (int, float), "sliding_window_pattern": (int,)}


def _check_gemma_fields(hf: dict[str, Any]) -> None:
  """Gemma 3's own fields, typed: its attention scale and window pattern positive, its window
  present (its windowed layers need one)."""
  for name, types in GEMMA_POSITIVE_FIELDS.items():
    value = hf.get(name)
    if name in hf and (isinstance(value, bool) or not isinstance(value, types) or value <= 0):
      kind = "an integer" if types == (int,) else "a number"
      raise ValueError(f"config.json: `{name}` must be {kind} > 0, got {value!r}")
  if "sliding_window" in hf and hf["sliding_window"] is None:
    raise ValueError(
      "config.json: Gemma 3's `sliding_window` must be a positive integer (its windowed "
      "layers need one), got null"
    )


def gemma_from_hf(hf: dict[str, Any], model_type: str, common: dict[str, Any]) -> GemmaConfig:
  """Gemma 3's text decoder as transformers reads config.json: layer kinds from `layer_types`
  (or the older `sliding_window_pattern`, every n-th layer full), a RoPE per kind (nested
  `rope_parameters`, or the older `rope_theta` with `rope_scaling` for the full layers and
  `rope_local_base_freq` for the windowed ones)."""
  kind = "gemma3_text"
  for field, bad, why in (
    ("final_logit_softcapping", None, "no logit soft-capping"),
    ("attn_logit_softcapping", None, "no attention soft-capping"),
  ):
    if hf.get(field) is not bad:
      raise ValueError(f"config.json: `{field}`={hf[field]!r} is not supported ({why})")
  refuse(hf, "use_bidirectional_attention", True, "causal attention only")
  refuse(hf, "attention_bias", True, "Gemma 3 attention without bias")
  if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
    raise ValueError(
      f"config.json: `hidden_activation`={hf['hidden_activation']!r} is not supported "
      "(gelu_pytorch_tanh)"
    )
  L, window = hf["num_hidden_layers"], or_default(hf, "sliding_window", kind)
  pattern = hf.get("sliding_window_pattern", 6)
  layer_types = hf.get("layer_types") or [
    "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)
  ]
  if len(layer_types) != L or not set(layer_types) <= {"sliding_attention", "full_attention"}:
    raise ValueError(f"config.json: `layer_types` {layer_types!r} for {L} layers")
  rope, local = _gemma_ropes(hf, common["max_position_embeddings"])
  num_heads = hf["num_attention_heads"]
  return GemmaConfig(
    **common,
    num_kv_heads=kv_heads_from_hf(hf, kind, num_heads),
    head_dim=or_default(hf, "head_dim", kind),
    mlp_dim=hf["intermediate_size"],
    norm_eps=hf.get("rms_norm_eps", 1e-6),
    rope=rope,
    local_rope=local,
    query_pre_attn_scalar=float(or_default(hf, "query_pre_attn_scalar", kind)),
    tie_embeddings=or_default(hf, "tie_word_embeddings", kind),
    layer_windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
  )


def _gemma_ropes(hf: dict[str, Any], max_positions: int) -> tuple[RopeConfig, RopeConfig]:
  """(full layers' RoPE, windowed layers' RoPE) as Gemma3TextConfig reads them (transformers
  5): `rope_parameters` nested by layer kind (absent: both default), a kind absent or null
  is default; `rope_scaling` updates the full kind; a kind without `rope_theta` takes the
  top-level `rope_theta` (full) or `rope_local_base_freq` (windowed), else 1e6 / 1e4. A flat
  `rope_parameters` (one dict, not per kind) transformers ignores: refused, not ignored."""
  kind = "gemma3_text"
  params = hf.get("rope_parameters") or {}  # absent: each kind default
  if not isinstance(params, dict):
    raise ValueError(
      "config.json: Gemma 3's `rope_parameters` must be a dict per layer kind "
      f"({{'full_attention': {{...}}, 'sliding_attention': {{...}}}}), got {params!r}"
    )
  flat = sorted(set(params) - {"full_attention", "sliding_attention"})
  if flat:
    raise ValueError(
      f"config.json: Gemma 3's `rope_parameters` has keys {flat} beside (or instead of) its "
      "layer kinds; it takes one dict per kind, {'full_attention': {...}, "
      "'sliding_attention': {...}} (transformers 5 ignores a flat one)"
    )
  kinds = {}
  for name in ("full_attention", "sliding_attention"):
    given = params.get(name)
    if given is not None and not isinstance(given, dict):
      raise ValueError(f"config.json: `rope_parameters.{name}` must be a dict, got {given!r}")
    kinds[name] = dict(given) if given else {"rope_type": "default"}
  scaling = hf.get("rope_scaling")
  if scaling is not None:
    if not isinstance(scaling, dict):
      raise ValueError(f"config.json: `rope_scaling` must be a dict, got {scaling!r}")
    if "type" in scaling and "rope_type" not in scaling and "rope_type" in kinds["full_attention"]:
      raise ValueError(
        "config.json: Gemma 3's `rope_scaling` names its type as `type`, which transformers 5 "
        "reads as default RoPE (the scaling ignored); write `rope_type` to scale"
      )
    kinds["full_attention"].update(scaling)
  kinds["full_attention"].setdefault(
    "rope_theta", or_default(hf, "rope_theta", kind, FAMILY_DEFAULTS[kind]["rope_theta"])
  )
  kinds["sliding_attention"].setdefault("rope_theta", or_default(hf, "rope_local_base_freq", kind))
  full, local = (
    rope_from_hf({"rope_parameters": kinds[name]}, max_positions, kind)
    for name in ("full_attention", "sliding_attention")
  )
  return full, local


# Gemma 3's norms beside Llama's names (the rest of its tensors are named as Llama's).
_GEMMA_NORMS = {
  "post_attention_layernorm.weight": "post_attn_norm",
  "pre_feedforward_layernorm.weight": "mlp_norm",
  "post_feedforward_layernorm.weight": "post_mlp_norm",
}


def gemma_targets(cfg: GemmaConfig, name: str) -> list[Target] | None:
  m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
  if m and m.group(2) in _GEMMA_NORMS and int(m.group(1)) < cfg.num_layers:
    return [(("blocks", _GEMMA_NORMS[m.group(2)]), int(m.group(1)), same, (cfg.d_model,))]
  return llama_targets(cfg, name)


FAMILY = Family(
  architecture="gemma3",
  model_types=("gemma3_text",),
  config_class=GemmaConfig,
  module_class=Gemma,
  from_hf=gemma_from_hf,
  tensor_targets=gemma_targets,
  required_hf_fields=("intermediate_size",),
  check_hf=_check_gemma_fields,
)
