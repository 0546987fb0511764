"""Qwen3.5's configuration (`Qwen35Config`: the hybrid's layer types, its linear layers'
heads and dims, partial rotary, the experts of Qwen3.5-MoE and Qwen3-Next) and its
translation from a Hugging Face `config.json` as transformers reads it; models/qwen3_5.py
holds the module, the tensor names and the family's record."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from models.config import ModelConfig
from models.hf_config import kv_heads_from_hf, or_default, rope_from_hf
from models.layer_kinds import FULL_ATTENTION, GatedDeltaNetKind, kinds_in_order

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
