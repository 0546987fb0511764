"""Model configurations: one frozen dataclass per architecture.

A config is plain data. It is built from a preset in `configs/` or from a Hugging Face
`config.json` (both the older `rope_theta`/`rope_scaling` layout and the current
`rope_parameters` one) and it refuses, by field name, anything the models do not implement.
"""

from __future__ import annotations

import dataclasses
import functools
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
  # (Qwen3), sliding-window attention: query q sees keys s with q - W < s <= q (Mistral),
  # a learned sink logit per head in every query's softmax (gpt-oss: models/sinks.py).
  qkv_bias: bool = False
  qk_norm: bool = False
  attention_sinks: bool = False
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

  # Cached on the (frozen) config: the cost model's search asks a config its kinds hundreds of
  # thousands of times per grid (launch.paper --grids=paper: 2.8 million records built).
  @functools.cached_property
  def layer_kinds(self) -> tuple[AttentionKind, ...]:
    """Each layer's kind (models/layer_kinds.py): what it computes and what its past is."""
    return tuple(AttentionKind(w) for w in self.windows)

  @functools.cached_property
  def kinds(self) -> tuple[AttentionKind, ...]:
    """The distinct kinds of the layers, in the order `scan_layers` compiles their bodies."""
    return kinds_in_order(self.layer_kinds)

  @property
  def kind(self) -> AttentionKind:
    """The kind of every layer of a one-kind config (a layer's block sees `of_kind`'s)."""
    if self.layer_windows is None:  # one window for every layer (the cost model's hot path)
      return AttentionKind(self.sliding_window)
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
    """Parameters of one layer's attention: projections, Q/K/V biases, q/k norms, sinks."""
    D, N, K, H = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
    bias = (N + 2 * K) * H if self.qkv_bias else 0
    norms = 2 * H if self.qk_norm else 0
    sinks = N if self.attention_sinks else 0
    return D * (N + 2 * K) * H + N * H * D + bias + norms + sinks

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


def check_dict_fields(cls: type, data: dict[str, Any], complete: bool, where: str) -> None:
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
