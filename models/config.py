"""Model configurations: one frozen dataclass per architecture.

A config is plain data. It is built from a preset in `configs/` or from a Hugging Face
`config.json` (both the older `rope_theta`/`rope_scaling` layout and the current
`rope_parameters` one) and it refuses, by field name, anything the models do not implement.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, ClassVar, Literal

from models.layer_kinds import AttentionKind, kinds_in_order

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
  """Rotary position embedding: base `theta` and an optional frequency scaling."""

  theta: float = 10000.0
  type: Literal["default", "linear", "llama3", "yarn"] = "default"
  factor: float = 1.0
  # llama3 only: the band of wavelengths that is smoothly interpolated.
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  # llama3 and yarn: the context the model was pretrained on.
  original_max_position_embeddings: int = 8192
  # yarn only (YaRN, Peng et al. 2023, as transformers computes it): frequencies that turn
  # more than beta_fast times over the original context are kept, fewer than beta_slow
  # times interpolated by `factor`, a linear ramp between (its ends rounded outwards when
  # `truncate`); cos and sin are multiplied by `attention_factor` (None: 0.1 ln(factor) + 1,
  # or the ratio of the two with `mscale` and `mscale_all_dim`).
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None

  def __post_init__(self):
    if self.type not in ROPE_TYPES:
      raise ValueError(f"rope type {self.type!r} is not supported; expected one of {ROPE_TYPES}")
    if self.factor <= 0:
      raise ValueError(f"rope `factor` must be positive, got {self.factor}")
    if self.original_max_position_embeddings < 1:
      raise ValueError(
        "rope `original_max_position_embeddings` must be positive, got "
        f"{self.original_max_position_embeddings}"
      )

  @property
  def attention_scaling(self) -> float:
    """What cos and sin are multiplied by (so every score by its square): 1 but for yarn."""
    if self.type != "yarn":
      return 1.0
    if self.attention_factor is not None:
      return float(self.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
      return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if self.mscale and self.mscale_all_dim:
      return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
    return mscale(self.factor)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Fields every architecture shares. Dimension letters used across the code base:

  V vocab_size, D d_model, L num_layers, N num_heads, K num_kv_heads, H head_dim, F mlp_dim.
  """

  architecture: ClassVar[str] = "base"
  # Set by each architecture: its MLP's [D, F] matrices and the tensor-parallel reductions
  # of one layer (what the cost model counts instead of testing the config's class).
  mlp_matrices: ClassVar[int]
  reductions_per_layer: ClassVar[int]
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  max_position_embeddings: int
  norm_eps: float
  rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
  tie_embeddings: bool = False
  eos_token_id: int | tuple[int, ...] | None = None
  bos_token_id: int | None = None
  # Switches of the shared attention (models/base.Block), one per model family that needs it:
  # bias on the Q/K/V projections (Qwen2/2.5), per-head RMSNorm of q and k before RoPE
  # (Qwen3), sliding-window attention: query q sees keys s with q - W < s <= q (Mistral).
  qkv_bias: bool = False
  qk_norm: bool = False
  sliding_window: int | None = None
  # A window per layer where the layers differ (Qwen2/Qwen3's `max_window_layers`, mixed
  # `layer_types`): layer l attends through layer_windows[l] keys (None: every key), and
  # `sliding_window` is None. None here: every layer attends through `sliding_window`.
  layer_windows: tuple[int | None, ...] | None = None

  def __post_init__(self):
    for name in (
      "vocab_size",
      "d_model",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "mlp_dim",
      "max_position_embeddings",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"config field `{name}` must be a positive integer, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"`num_heads` ({self.num_heads}) must be a multiple of `num_kv_heads` ({self.num_kv_heads})"
      )
    if self.head_dim % 2:
      raise ValueError(f"`head_dim` must be even for rotary embeddings, got {self.head_dim}")
    for window in (self.sliding_window, *(self.layer_windows or ())):
      bad_window = isinstance(window, bool) or not isinstance(window, int) or window < 1
      if window is not None and bad_window:
        raise ValueError(
          f"config field `sliding_window` must be a positive integer or None, got {window!r}"
        )
    if self.layer_windows is not None:
      if len(self.layer_windows) != self.num_layers:
        raise ValueError(
          f"`layer_windows` has {len(self.layer_windows)} entries for {self.num_layers} layers"
        )
      if self.sliding_window is not None:
        raise ValueError("give `sliding_window` (every layer) or `layer_windows`, not both")

  @property
  def windows(self) -> tuple[int | None, ...]:
    """Each layer's window (None: all keys)."""
    return self.layer_windows or (self.sliding_window,) * self.num_layers

  @property
  def narrowest_window(self) -> int | None:
    """The smallest window of any layer, None when no layer has one: what decides whether a
    kernel must take windows and whether hops carry whole prefixes."""
    return min((k.window for k in self.kinds if k.window is not None), default=None)

  @property
  def layer_kinds(self) -> tuple[AttentionKind, ...]:
    """Each layer's kind (models/layer_kinds.py): what it computes and what its past is."""
    return tuple(AttentionKind(w) for w in self.windows)

  @property
  def kinds(self) -> tuple[AttentionKind, ...]:
    """The distinct kinds of the layers, in the order `scan_blocks` compiles their bodies."""
    return kinds_in_order(self.layer_kinds)

  @property
  def kind(self) -> AttentionKind:
    """The kind of every layer of a one-kind config (a layer's block sees `of_kind`'s)."""
    if len(self.kinds) != 1:
      names = ", ".join(k.name for k in self.kinds)
      raise ValueError(f"this model's layers are of {len(self.kinds)} kinds ({names}), not one")
    return self.kinds[0]

  def of_kind(self, kind: AttentionKind) -> ModelConfig:
    """The config of this model's layers of `kind`, as their block and the cost model see it."""
    return self.with_window(kind.window)

  def with_window(self, window: int | None) -> ModelConfig:
    """This config with one window on every layer (a layer of a mixed model, as its block and
    the cost model see it)."""
    return dataclasses.replace(self, sliding_window=window, layer_windows=None)

  def attention_params(self) -> int:
    """Parameters of one layer's attention: projections, Q/K/V biases, q/k norms."""
    D, N, K, H = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
    bias = (N + 2 * K) * H if self.qkv_bias else 0
    norms = 2 * H if self.qk_norm else 0
    return D * (N + 2 * K) * H + N * H * D + bias + norms

  @property
  def eos_ids(self) -> tuple[int, ...]:
    if self.eos_token_id is None:
      return ()
    if isinstance(self.eos_token_id, int):
      return (self.eos_token_id,)
    return tuple(self.eos_token_id)

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["architecture"] = self.architecture
    return out

  def num_params(self) -> int:
    """Parameter count, without building the model."""
    raise NotImplementedError

  # What the cost model counts of the MLP (a mixture of experts overrides them).
  @property
  def active_mlp_dim(self) -> int:
    """MLP columns a token runs through."""
    return self.mlp_dim

  def mlp_weight_dim(self, num_tokens: float) -> float:
    """MLP columns whose weights `num_tokens` tokens read."""
    return self.mlp_dim

  @property
  def router_dim(self) -> int:
    """Columns of the MLP's router (a mixture's experts; 0 without one)."""
    return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(ModelConfig):
  """Llama 2 / Llama 3: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

  The same decoder is Mistral (sliding_window), Qwen2/2.5 (qkv_bias) and Qwen3 (qk_norm, a
  head_dim that need not be d_model / num_heads): switches of this config, not other models.
  """

  architecture: ClassVar[str] = "llama"
  # The block's shape as the cost model counts it: SwiGLU's gate, up and down matrices; two
  # partial sums reduced per layer under tensor parallelism (after attention, after the MLP).
  mlp_matrices: ClassVar[int] = 3
  reductions_per_layer: ClassVar[int] = 2
  # A mixture of experts in place of the MLP (Qwen3-MoE, Mixtral): `num_experts` SwiGLU
  # experts of `mlp_dim` columns each, a router [D, E], each token through its
  # `experts_per_token` most probable experts, weighted by their router probabilities
  # (renormalised over the chosen ones when `normalize_expert_weights`). 0: a dense MLP.
  num_experts: int = 0
  experts_per_token: int = 0
  normalize_expert_weights: bool = True

  def __post_init__(self):
    super().__post_init__()
    E, k = self.num_experts, self.experts_per_token
    for name, value in (("num_experts", E), ("experts_per_token", k)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config field `{name}` must be an integer >= 0, got {value!r}")
    if E and not 1 <= k <= E:
      raise ValueError(f"`experts_per_token` must be in [1, num_experts={E}], got {k}")
    if not E and k:
      raise ValueError(f"`experts_per_token`={k} needs `num_experts` > 0 (a dense MLP has none)")

  @property
  def router_dim(self) -> int:
    return self.num_experts

  @property
  def active_mlp_dim(self) -> int:
    """MLP columns a token runs through: its experts' (k F) or the dense MLP's (F)."""
    return self.mlp_dim * (self.experts_per_token if self.num_experts else 1)

  def mlp_weight_dim(self, num_tokens: float) -> float:
    """MLP columns whose weights `num_tokens` tokens read: every expert some token routes to
    (at most E, at most T k; the router's choice is data, so the bound), or the dense F."""
    if not self.num_experts:
      return self.mlp_dim
    return self.mlp_dim * min(self.num_experts, num_tokens * self.experts_per_token)

  def num_params(self) -> int:
    D, F = self.d_model, self.mlp_dim
    mlp = self.mlp_matrices * D * F * max(self.num_experts, 1) + D * self.num_experts  # router
    per_layer = self.attention_params() + mlp + 2 * D
    head = 0 if self.tie_embeddings else self.vocab_size * D
    return self.vocab_size * D + self.num_layers * per_layer + D + head


@dataclasses.dataclass(frozen=True, kw_only=True)
class FalconConfig(ModelConfig):
  """Falcon with rotary embeddings and a parallel attention + MLP block.

  `separate_mlp_norm` is the Falcon-40B form (`ln_attn` and `ln_mlp`); without it one input
  LayerNorm feeds both branches (Falcon-7B).
  """

  architecture: ClassVar[str] = "falcon"
  # Up and down matrices; attention and MLP run in parallel, so one reduction per layer.
  mlp_matrices: ClassVar[int] = 2
  reductions_per_layer: ClassVar[int] = 1
  separate_mlp_norm: bool = False
  # How the fused query_key_value weight is laid out in Hugging Face checkpoints:
  # "grouped" (new_decoder_architecture), "multi_query" (Falcon-7B) or "interleaved" (MHA).
  qkv_layout: Literal["grouped", "multi_query", "interleaved"] = "multi_query"
  tie_embeddings: bool = True

  def num_params(self) -> int:
    D, F = self.d_model, self.mlp_dim
    norms = (4 if self.separate_mlp_norm else 2) * D
    per_layer = self.attention_params() + self.mlp_matrices * D * F + norms
    head = 0 if self.tie_embeddings else self.vocab_size * D
    return self.vocab_size * D + self.num_layers * per_layer + 2 * D + head


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


ARCHITECTURES: dict[str, type[ModelConfig]] = {
  "llama": LlamaConfig,
  "falcon": FalconConfig,
  "gemma3": GemmaConfig,
}


def config_from_dict(data: dict[str, Any], *, complete: bool = False) -> ModelConfig:
  """Inverse of `ModelConfig.to_dict` (the format of the presets in `configs/` and of a
  kvr-jax checkpoint's metadata). Every value is checked against its field's type, and a
  wrong one refused by name; complete=True (a saved checkpoint, written whole by `to_dict`)
  also refuses a missing field, which would otherwise take a default and change the model."""
  if not isinstance(data, dict):
    raise ValueError(f"a config must be a dict of fields, got {type(data).__name__}")
  data = dict(data)
  arch = data.pop("architecture", None)
  if arch not in ARCHITECTURES:
    raise ValueError(
      f"config field `architecture` must be one of {sorted(ARCHITECTURES)}, got {arch!r}"
    )
  cls = ARCHITECTURES[arch]
  _check_dict_fields(cls, data, complete, arch)
  for key in ("rope", "local_rope"):
    if isinstance(data.get(key), dict):
      _check_dict_fields(RopeConfig, data[key], complete, f"{arch} `{key}`")
      data[key] = RopeConfig(**data[key])
  if isinstance(data.get("eos_token_id"), list):
    data["eos_token_id"] = tuple(data["eos_token_id"])
  if isinstance(data.get("layer_windows"), list):
    data["layer_windows"] = tuple(data["layer_windows"])
  return cls(**data)


def _check_dict_fields(cls: type, data: dict[str, Any], complete: bool, where: str) -> None:
  """Unknown, missing (when `complete`) and ill-typed fields of `cls` in `data`, by name."""
  hints = typing.get_type_hints(cls)
  fields = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise ValueError(f"unknown config field(s) for {where}: {unknown}")
  missing = [name for name in fields if name not in data]
  if complete and missing:
    raise ValueError(f"config of {where} lacks the field(s) {missing} (a saved config is whole)")
  for name, value in data.items():
    if not _is_of_type(value, hints[name]):
      raise ValueError(
        f"config field `{name}` of {where} must be of type {_type_name(hints[name])}, got {value!r}"
      )


def _is_of_type(value: Any, hint: Any) -> bool:
  """Whether a JSON value can stand for a field of type `hint` (lists for tuples, a dict for a
  RoPE record, an int for a float; a bool is no number)."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    return any(_is_of_type(value, a) for a in args)
  if origin is typing.Literal:
    return value in args
  if origin is tuple:
    if not isinstance(value, (list, tuple)):
      return False
    if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
      return all(_is_of_type(v, args[0]) for v in value)
    return len(value) == len(args) and all(
      _is_of_type(v, t) for v, t in zip(value, args, strict=True)
    )
  if hint is type(None):
    return value is None
  if hint is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if hint is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if dataclasses.is_dataclass(hint):
    return isinstance(value, (dict, hint))
  return isinstance(value, hint)


def _type_name(hint: Any) -> str:
  return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json


def _yarn_from_hf(hf: dict[str, Any], merged: dict[str, Any], max_positions: int) -> dict:
  """YaRN's fields as transformers reads them: the pretraining context from a top-level
  `original_max_position_embeddings` first (Phi-3's layout, which transformers lets win), then
  the rope parameters', else the model's `max_position_embeddings`; beta_fast / beta_slow
  given as null take their defaults (transformers' `or 32`, `or 1`)."""
  original = hf.get("original_max_position_embeddings")
  if original is None:
    original = merged.get("original_max_position_embeddings", max_positions)
  out = {"original_max_position_embeddings": int(original)}
  out["beta_fast"] = float(merged.get("beta_fast") or 32.0)
  out["beta_slow"] = float(merged.get("beta_slow") or 1.0)
  out["truncate"] = bool(merged.get("truncate", True))
  for key in ("attention_factor", "mscale", "mscale_all_dim"):
    if merged.get(key) is not None:
      out[key] = float(merged[key])
  return out


# The numbers a RoPE dict may hold (a string or a boolean there is refused by name, as
# transformers' validation refuses it).
ROPE_NUMBER_FIELDS = (
  "rope_theta",
  "factor",
  "low_freq_factor",
  "high_freq_factor",
  "original_max_position_embeddings",
  "attention_factor",
  "beta_fast",
  "beta_slow",
  "mscale",
  "mscale_all_dim",
)


def _rope_from_hf(hf: dict[str, Any], max_positions: int, model_type: str) -> RopeConfig:
  """Reads RoPE settings from either config layout.

  transformers < 5 wrote `rope_theta` and `rope_scaling` ({"type" or "rope_type": ...});
  transformers >= 5 writes `rope_parameters` = {"rope_type", "rope_theta", ...}.
  max_positions: the model's position limit (YaRN's pretraining context when none is given).
  """
  for key in ("rope_parameters", "rope_scaling"):
    if hf.get(key) is not None and not isinstance(hf[key], dict):
      raise ValueError(f"config.json: `{key}` must be a dict, got {hf[key]!r}")
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  params_type = params.get("rope_type", params.get("type", "default"))
  if scaling and params_type == "default" and set(params) <= {"rope_type", "type", "rope_theta"}:
    # A transformers-5 config without scaling (`rope_parameters` holds the default type and
    # the base) and a `rope_scaling` added as Qwen's model cards say, for YaRN: transformers
    # honours the scaling, and so does this reader (on the base the parameters give).
    # transformers takes the card in place of the parameters: a `rope_theta` inside the card
    # wins over the parameters' base (which is kept only where the card has none).
    params = (
      {} if "rope_theta" in scaling else {k: v for k, v in params.items() if k == "rope_theta"}
    )
  elif params and scaling:
    # Both layouts naming a scaling: which one a reader honours differs, so a disagreement
    # is refused by name, never resolved quietly.
    scaling_type = scaling.get("rope_type", scaling.get("type", "default"))
    shared = set(params) & set(scaling) - {"rope_type", "type"}
    differing = sorted(k for k in shared if params[k] != scaling[k])
    if params_type != scaling_type or differing:
      raise ValueError(
        f"config.json: `rope_scaling` ({scaling_type!r}) and `rope_parameters` "
        f"({params_type!r}) disagree{' on ' + ', '.join(differing) if differing else ''}; "
        "keep one of them"
      )
  merged = {**scaling, **params}
  for key in ROPE_NUMBER_FIELDS:
    value = merged.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
      raise ValueError(f"config.json: rope `{key}` must be a number, got {value!r}")
  theta = merged.get("rope_theta", _or_default(hf, "rope_theta", model_type, 10000.0))
  rope_type = merged.get("rope_type", merged.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise ValueError(
      f"config.json: rope type {rope_type!r} (in `rope_parameters`/`rope_scaling`)"
      f" is not supported; supported: {ROPE_TYPES}"
    )
  kwargs: dict[str, Any] = {"theta": float(theta), "type": rope_type}
  if rope_type in ("linear", "llama3", "yarn"):
    if merged.get("factor") is None:
      raise ValueError(f"config.json: rope type {rope_type!r} needs a `factor`")
    kwargs["factor"] = float(merged["factor"])
  if rope_type == "yarn":
    kwargs.update(_yarn_from_hf(hf, merged, max_positions))
  if rope_type == "llama3":
    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
      if key not in merged:
        raise ValueError(f"config.json: rope type 'llama3' needs `{key}`")
      kwargs[key] = merged[key]
  # transformers 5 moves a top-level `partial_rotary_factor` into rope_parameters (and its
  # Llama then ignores it): a model that asks for partial rotary is refused either way.
  if merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError("config.json: `partial_rotary_factor` != 1 is not supported")
  return RopeConfig(**kwargs)


def _gemma_from_hf(hf: dict[str, Any], common: dict[str, Any]) -> GemmaConfig:
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
  _refuse(hf, "use_bidirectional_attention", True, "causal attention only")
  _refuse(hf, "attention_bias", True, "Gemma 3 attention without bias")
  if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
    raise ValueError(
      f"config.json: `hidden_activation`={hf['hidden_activation']!r} is not supported "
      "(gelu_pytorch_tanh)"
    )
  L, window = hf["num_hidden_layers"], _or_default(hf, "sliding_window", kind)
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
    num_kv_heads=_kv_heads(hf, kind, num_heads),
    head_dim=_or_default(hf, "head_dim", kind),
    mlp_dim=hf["intermediate_size"],
    norm_eps=hf.get("rms_norm_eps", 1e-6),
    rope=rope,
    local_rope=local,
    query_pre_attn_scalar=float(_or_default(hf, "query_pre_attn_scalar", kind)),
    tie_embeddings=_or_default(hf, "tie_word_embeddings", kind),
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
    "rope_theta", _or_default(hf, "rope_theta", kind, FAMILY_DEFAULTS[kind]["rope_theta"])
  )
  kinds["sliding_attention"].setdefault("rope_theta", _or_default(hf, "rope_local_base_freq", kind))
  full, local = (
    _rope_from_hf({"rope_parameters": kinds[name]}, max_positions, kind)
    for name in ("full_attention", "sliding_attention")
  )
  return full, local


def _experts_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
  """The mixture of experts of a MoE family, as transformers reads it: Qwen3-MoE's
  `num_experts` (or `num_local_experts`, as transformers 5 writes it), `moe_intermediate_size`
  per expert, `norm_topk_prob`; Mixtral's `num_local_experts`, weights always renormalised.
  Qwen3-MoE layers with a dense MLP (`mlp_only_layers`, `decoder_sparse_step` > 1) are
  refused by name: every layer of a stacked model has one MLP shape."""
  if model_type not in MOE_FAMILIES:
    return {}
  if model_type == "qwen3_moe":
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
      raise ValueError(
        "config.json: dense MLP layers among the experts (`mlp_only_layers`="
        f"{hf.get('mlp_only_layers')!r}, `decoder_sparse_step`={hf.get('decoder_sparse_step')!r})"
        " are not supported: every layer a mixture of experts"
      )
    # transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`.
    experts = hf.get("num_experts", _or_default(hf, "num_local_experts", model_type))
    experts = _or_default(hf, "num_experts", model_type) if experts is None else experts
  else:
    if "num_experts" in hf and hf.get("num_local_experts") != hf["num_experts"]:
      raise ValueError(
        f"config.json: Mixtral reads its expert count from `num_local_experts` "
        f"({hf.get('num_local_experts')!r}), not `num_experts` ({hf['num_experts']!r}, which "
        "transformers ignores); rename the key"
      )
    experts = _or_default(hf, "num_local_experts", model_type)
  top_k = _or_default(hf, "num_experts_per_tok", model_type)
  for name, value in (("num_experts", experts), ("num_experts_per_tok", top_k)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"config.json: `{name}` must be an integer >= 1, got {value!r}")
  if top_k > experts:
    raise ValueError(
      f"config.json: `num_experts_per_tok`={top_k} (absent: {model_type}'s default) exceeds "
      f"the {experts} experts"
    )
  normalize = True if model_type == "mixtral" else _or_default(hf, "norm_topk_prob", model_type)
  return {
    "num_experts": experts,
    "experts_per_token": top_k,
    "normalize_expert_weights": bool(normalize),
  }


def _refuse(hf: dict[str, Any], field: str, bad: Any, why: str) -> None:
  if hf.get(field, None) == bad:
    raise ValueError(f"config.json: `{field}`={bad!r} is not supported ({why})")


# Hugging Face model types that are the Llama decoder with switches (see LlamaConfig).
LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
# The families whose MLP is a mixture of experts, and their config keys (`_experts_from_hf`).
MOE_FAMILIES = ("qwen3_moe", "mixtral")
SUPPORTED_MODEL_TYPES = LLAMA_FAMILIES + ("falcon", "gemma3_text")


# Defaults transformers (5.x) takes when config.json leaves a key out, where they are not the
# generic ones: Qwen3's head_dim is a fixed 128 (not hidden_size / heads), Mistral's window is
# 4096 (`sliding_window` absent is not `null`), and the position limits per family.
HEAD_DIM_DEFAULTS = {"qwen3": 128}
WINDOW_DEFAULTS = {"mistral": 4096}
# What transformers' config classes fill in for a key a config.json does not have, per family
# (tests/test_config_fidelity.py removes every key in turn and compares with the classes).
# num_key_value_heads absent: Llama repeats num_attention_heads, the others have a number.
FAMILY_DEFAULTS = {
  "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
  "mistral": {
    "max_position_embeddings": 131072,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "num_key_value_heads": 8,
  },
  "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
  "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
  "qwen3_moe": {
    "max_position_embeddings": 32768,
    "num_key_value_heads": 4,
    "norm_topk_prob": False,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
  },
  "mixtral": {
    "max_position_embeddings": 131072,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
  },
  "falcon": {"max_position_embeddings": 2048, "bos_token_id": 11, "eos_token_id": 11},
  "gemma3_text": {
    "max_position_embeddings": 131072,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
    "tie_word_embeddings": True,
    "rope_theta": 1e6,
    "rope_local_base_freq": 10000.0,
  },
}
MAX_POSITION_DEFAULTS = {k: v["max_position_embeddings"] for k, v in FAMILY_DEFAULTS.items()}


def _kv_heads(hf: dict[str, Any], model_type: str, num_heads: int) -> int:
  """num_key_value_heads, or the family's default where absent (Llama: num_heads); an absent
  key whose default does not divide num_attention_heads is refused naming it (transformers
  would build a model that cannot run)."""
  kv_heads = _or_default(hf, "num_key_value_heads", model_type) or num_heads
  if "num_key_value_heads" not in hf and isinstance(num_heads, int) and num_heads % kv_heads:
    raise ValueError(
      f"config.json has no `num_key_value_heads`: {model_type}'s default is {kv_heads}, which "
      f"does not divide num_attention_heads={num_heads}; give num_key_value_heads"
    )
  return kv_heads


def _or_default(hf: dict[str, Any], key: str, model_type: str, fallback=None):
  """`hf[key]`, or where config.json has no such key what the family's transformers class
  fills in (FAMILY_DEFAULTS), else `fallback`."""
  if key in hf:
    return hf[key]
  return FAMILY_DEFAULTS.get(model_type, {}).get(key, fallback)


QWEN_MAX_WINDOW_LAYERS = 28  # Qwen2Config / Qwen3Config's default

# What config.json must hold, per family, and the types of the fields read from it: a missing
# or mistyped field is refused by name at load (not a KeyError, nor a TypeError inside a
# traced program).
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
LLAMA_REQUIRED_FIELDS = ("intermediate_size",)
POSITIVE_INT_FIELDS = (
  "vocab_size",
  "hidden_size",
  "num_hidden_layers",
  "num_attention_heads",
  "intermediate_size",
  "num_key_value_heads",
  "num_kv_heads",
  "head_dim",
  "max_position_embeddings",
  "ffn_hidden_size",
)
NON_NEGATIVE_INT_FIELDS = ("max_window_layers",)
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "rope_theta")
# Booleans of transformers' config classes (typed `bool`, so its strict validation refuses a
# string or null there); present, they must be true or false.
BOOL_FIELDS = (
  "tie_word_embeddings",
  "use_sliding_window",
  "norm_topk_prob",
  "attention_bias",
  "mlp_bias",
  "new_decoder_architecture",
  "multi_query",
  "parallel_attn",
  "alibi",
  "bias",
)
# Present and not null, these must be positive: Gemma 3's attention scale, its window (one
# windowed layer in every `sliding_window_pattern`).
GEMMA_POSITIVE_FIELDS = {"query_pre_attn_scalar": (int, float), "sliding_window_pattern": (int,)}


def _check_fields(hf: dict[str, Any], model_type: str) -> None:
  """Required fields present, every field read of the right type (null = absent)."""
  needs_mlp = model_type in LLAMA_FAMILIES or model_type == "gemma3_text"
  required = REQUIRED_FIELDS + (LLAMA_REQUIRED_FIELDS if needs_mlp else ())
  missing = [name for name in required if hf.get(name) is None]
  if missing:
    raise ValueError(f"config.json lacks the required field(s) {missing} ({model_type})")
  for name in POSITIVE_INT_FIELDS + NON_NEGATIVE_INT_FIELDS:
    value = hf.get(name)
    smallest = 0 if name in NON_NEGATIVE_INT_FIELDS else 1
    if value is not None and (
      isinstance(value, bool) or not isinstance(value, int) or value < smallest
    ):
      raise ValueError(f"config.json: `{name}` must be an integer >= {smallest}, got {value!r}")
  for name in POSITIVE_FLOAT_FIELDS:
    value = hf.get(name)
    if value is not None and (
      isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
    ):
      raise ValueError(f"config.json: `{name}` must be a positive number, got {value!r}")
  for name in BOOL_FIELDS:
    if name in hf and not isinstance(hf[name], bool):
      raise ValueError(f"config.json: `{name}` must be true or false, got {hf[name]!r}")
  for name in ("eos_token_id", "bos_token_id"):
    value = hf.get(name)
    ids = value if isinstance(value, list) and name == "eos_token_id" else [value]
    if value is not None and any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
      form = "an integer, a list of integers or null" if name == "eos_token_id" else "an integer"
      raise ValueError(f"config.json: `{name}` must be {form}, got {value!r}")
  if model_type == "gemma3_text":
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


def _sliding_window_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
  """{"sliding_window": W or None} (one window for every layer, or none), or
  {"layer_windows": (...)} where the layers differ, as transformers reads them.

  Mistral: `sliding_window` (null: none). Llama: never (transformers ignores the field there).
  Qwen2/Qwen3: a window only if `use_sliding_window`,
  and then only on layers >= `max_window_layers`. transformers >= 4.54 also writes
  `layer_types`, which decides when present.
  """
  window = hf.get("sliding_window", WINDOW_DEFAULTS.get(model_type))
  if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
    window = None
  if model_type == "llama":  # transformers' Llama has no window and ignores the field
    window = None
  num_layers = hf["num_hidden_layers"]
  # Qwen3-MoE and Mixtral have no layer kinds: one mask for every layer, `layer_types` (a key
  # their config classes keep but never read) is ignored, as transformers ignores it.
  layer_types = None if model_type in MOE_FAMILIES else hf.get("layer_types")
  if layer_types is None:
    # transformers' Qwen2/Qwen3 config classes default max_window_layers to 28 when absent.
    first_windowed = (
      hf.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS) if model_type in ("qwen2", "qwen3") else 0
    )
    layer_types = [
      "sliding_attention" if window is not None and i >= first_windowed else "full_attention"
      for i in range(num_layers)
    ]
  kinds = set(layer_types)
  if not kinds <= {"full_attention", "sliding_attention"}:
    raise ValueError(
      f"config.json: `layer_types` {sorted(kinds)} are not supported "
      "(full_attention or sliding_attention only)"
    )
  if len(layer_types) != num_layers:
    raise ValueError(
      f"config.json: `layer_types` has {len(layer_types)} entries for {num_layers} layers"
    )
  if "sliding_attention" in kinds and (
    not isinstance(window, int) or isinstance(window, bool) or window <= 0
  ):
    raise ValueError(
      f"config.json: sliding_attention layers need a positive `sliding_window`, got {window!r}"
    )
  if kinds == {"full_attention", "sliding_attention"}:  # a window on some layers
    return {
      "layer_windows": tuple(window if t == "sliding_attention" else None for t in layer_types)
    }
  return {"sliding_window": window if kinds == {"sliding_attention"} else None}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
  """Builds a config from the dict of a Hugging Face `config.json`."""
  model_type = hf.get("model_type")
  if model_type in SUPPORTED_MODEL_TYPES:
    _check_fields(hf, model_type)
  eos = _or_default(hf, "eos_token_id", model_type)
  if isinstance(eos, list):
    eos = tuple(eos)
  common = dict(
    vocab_size=hf["vocab_size"],
    d_model=hf["hidden_size"],
    num_layers=hf["num_hidden_layers"],
    num_heads=hf["num_attention_heads"],
    eos_token_id=eos,
    bos_token_id=_or_default(hf, "bos_token_id", model_type),
    max_position_embeddings=_or_default(hf, "max_position_embeddings", model_type, 2048),
  )
  if model_type in LLAMA_FAMILIES:
    _refuse(hf, "attention_bias", True, f"{model_type} attention without bias on o_proj only")
    _refuse(hf, "mlp_bias", True, f"{model_type} MLP without bias only")
    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"config.json: `hidden_act`={hf['hidden_act']!r} is not supported (silu)")
    num_heads = hf["num_attention_heads"]
    return LlamaConfig(
      **common,
      num_kv_heads=_kv_heads(hf, model_type, num_heads),
      head_dim=hf.get("head_dim")
      or HEAD_DIM_DEFAULTS.get(model_type, hf["hidden_size"] // num_heads),
      mlp_dim=(
        _or_default(hf, "moe_intermediate_size", model_type)
        if model_type == "qwen3_moe"
        else hf["intermediate_size"]
      ),
      norm_eps=_or_default(hf, "rms_norm_eps", model_type, 1e-6),
      rope=_rope_from_hf(hf, common["max_position_embeddings"], model_type),
      tie_embeddings=hf.get("tie_word_embeddings", False),
      qkv_bias=model_type == "qwen2",  # Qwen2's q/k/v projections always carry a bias
      qk_norm=model_type in ("qwen3", "qwen3_moe"),
      **_sliding_window_from_hf(hf, model_type),
      **_experts_from_hf(hf, model_type),
    )
  if model_type == "gemma3_text":
    return _gemma_from_hf(hf, common)
  if model_type == "falcon":
    _refuse(hf, "alibi", True, "ALiBi Falcon models are not implemented; rotary Falcon only")
    _refuse(hf, "bias", True, "Falcon linear layers without bias only")
    new_arch = bool(hf.get("new_decoder_architecture", False))
    if not new_arch and not hf.get("parallel_attn", True):
      raise ValueError(
        "config.json: `parallel_attn`=False is not supported (parallel "
        "attention + MLP Falcon blocks only)"
      )
    if hf.get("activation", "gelu") != "gelu":
      raise ValueError(f"config.json: `activation`={hf['activation']!r} is not supported (gelu)")
    num_heads = hf["num_attention_heads"]
    multi_query = bool(hf.get("multi_query", True))
    if new_arch:
      layout, num_kv = "grouped", hf.get("num_kv_heads") or num_heads
      separate = (hf.get("num_ln_in_parallel_attn") or 2) == 2
    elif multi_query:
      layout, num_kv, separate = "multi_query", 1, False
    else:
      layout, num_kv, separate = "interleaved", num_heads, False
    return FalconConfig(
      **common,
      num_kv_heads=num_kv,
      head_dim=hf["hidden_size"] // num_heads,
      mlp_dim=hf.get("ffn_hidden_size") or 4 * hf["hidden_size"],
      norm_eps=hf.get("layer_norm_epsilon", 1e-5),
      rope=_rope_from_hf(hf, common["max_position_embeddings"], model_type),
      tie_embeddings=hf.get("tie_word_embeddings", True),
      separate_mlp_norm=separate,
      qkv_layout=layout,
    )
  raise ValueError(
    f"config.json: `model_type`={model_type!r} is not supported; supported: "
    f"{', '.join(repr(t) for t in SUPPORTED_MODEL_TYPES)}"
  )
