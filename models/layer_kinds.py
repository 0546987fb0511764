"""What a layer computes and what its past is, as data: one frozen record per kind of layer,
in the manner of models/kernels.py.

A model's layers are a sequence of kinds (`ModelConfig.layer_kinds`); `scan_layers` compiles
one layer body per distinct kind (`ModelConfig.kinds`) and gives each its one-kind config
(`ModelConfig.of_kind`). What the parallel code asks of a layer it asks of its kind:

- the strategies: which positions a hop into a chunk that starts at S carries (`hop_span`),
  its bytes (`hop_bytes`), whether the last hop carries the whole prefix (so the last rank
  can keep it as its cache: `hop_keeps_whole_prefix`), which keys a query sees (`first_key`);
- decode and the memory tool: how many positions of the past decode reads (`decode_keys`).

Three kinds today: softmax attention over a K,V prefix, with or without a sliding window
(`AttentionKind`); Gated DeltaNet linear attention, whose past is a fixed-size state
(`GatedDeltaNetKind`, Qwen3.5's linear layers: models/gated_deltanet.py); and multi-head
latent attention, whose past is a compressed latent per token (`LatentAttentionKind`,
DeepSeek-V3: models/latent_attention.py). prefill's K,V strategies run the first; a model
with another kind (`unbuilt_kinds`) runs under the same prefill and generate through its
cache form's programs (kvr_jax.inference.cache_form), as its kind's `runs_today` says.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar


@dataclasses.dataclass(frozen=True)
class AttentionKind:
  """Softmax attention over a K,V prefix: every key (`window` None), or with a sliding window
  W only the W latest (query q sees keys s with q - W < s <= q). Its past is K and V of
  `num_kv_heads` heads per token; a hop carries the part of the prefix a later query can see."""

  window: int | None = None
  computes: ClassVar[str] = "softmax attention"
  past: ClassVar[str] = "K,V prefix"
  splits_over_model: ClassVar[bool] = True  # heads split over "model" (runtime.tensor_parallel)

  def __post_init__(self):
    bad = isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1
    if self.window is not None and bad:
      raise ValueError(
        f"a layer's sliding window must be a positive integer or None, got {self.window!r}"
      )

  @property
  def name(self) -> str:
    return "full attention" if self.window is None else f"attention, window {self.window}"

  def first_key(self, position: int) -> int:
    """The first key position any query at or after `position` can see (0 without a window)."""
    return 0 if self.window is None else max(0, position - self.window + 1)

  def last_hop_holds(self, hop_end: int, last: int) -> bool:
    """Whether the last hop (into the last chunk, at `hop_end`) and the last rank's own chunk
    hold all of this layer's past that decode reads from position `last` on: every key its
    window lets a later query see."""
    return self.first_key(hop_end) <= self.first_key(last)

  def hop_span(self, end: int) -> tuple[int, int]:
    """The positions [a, end) a hop into a chunk that starts at `end` carries: the whole
    prefix, or with a window only its last W-1 keys (all any later query can see): bounded by
    W, not by the prompt."""
    return self.first_key(end), end

  def hop_keeps_whole_prefix(self, end: int) -> bool:
    """The hop into a chunk at `end` carries every earlier position (no window cuts it): the
    receiver can keep it as its cache."""
    return self.first_key(end) == 0

  def hop_bytes(self, config, end: int, batch: int, dtype_bytes: int) -> int:
    """Bytes of the hop into a chunk at `end`: K and V of its span, with the model's own KV
    head count (`config`: num_kv_heads, head_dim)."""
    a, end = self.hop_span(end)
    return 2 * batch * (end - a) * config.num_kv_heads * config.head_dim * dtype_bytes

  def kept_hop_bytes(self, config, prefix: int, batch: int, dtype_bytes: int, kv_heads: int):
    """Bytes of the last hop that cache="last" keeps as the last rank's cache, on every rank
    (SPMD's one output shape): K and V of the whole `prefix` (its buffer is prefix-long even
    where a window cuts the hop), `kv_heads` heads (one device's share of a model group)."""
    return 2 * batch * prefix * kv_heads * config.head_dim * dtype_bytes

  def decode_keys(self, length: int) -> int:
    """Positions of a `length`-token past the next token's query reads."""
    return length if self.window is None else min(length, self.window)

  def cache_bytes(self, config, context_len: int, batch: int, dtype_bytes: int, shards: int = 1):
    """Bytes of this layer's past after a `context_len`-token prompt on one device of a model
    group of `shards`: K and V of the positions decode reads (a window's ring of W), its share
    of the KV heads (one repeated head per device where there are fewer heads than devices)."""
    kv_heads = max(config.num_kv_heads // shards, 1)
    positions = self.decode_keys(context_len)
    return 2 * batch * positions * kv_heads * config.head_dim * dtype_bytes


FULL_ATTENTION = AttentionKind()


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetKind:
  """Gated DeltaNet linear attention: its past is one state of [key_dim, value_dim] per value
  head (float32) and the last conv_kernel - 1 rows of its convolution's input, whatever the
  prompt length. A hop into a chunk carries that state (and the halo), not a prefix."""

  key_heads: int
  value_heads: int
  key_dim: int
  value_dim: int
  conv_kernel: int
  computes: ClassVar[str] = "Gated DeltaNet linear attention"
  past: ClassVar[str] = "recurrent state and convolution halo"
  window: ClassVar[None] = None  # no window: `narrowest_window` and the kernels ask it
  # How a model with this kind runs while prefill's strategies do not run it.
  runs_today: ClassVar[str] = (
    "kvr_jax.prefill and generate run it with its own programs (kvr_jax.inference.hybrid: "
    "single, KV-Runahead, ring, all-gather), on a 1-D mesh or a 2-D one (key heads, heads and "
    "experts split over 'model')"
  )
  splits_over_model: ClassVar[bool] = True  # by key head (kvr_jax.strategies.hybrid)

  @property
  def name(self) -> str:
    return "linear attention (Gated DeltaNet)"

  @property
  def conv_channels(self) -> int:
    return (2 * self.key_heads * self.key_dim) + self.value_heads * self.value_dim

  def hop_bytes(self, config, end: int, batch: int, dtype_bytes: int) -> int:
    """Bytes of a hop into a chunk at any `end`: the float32 state and the halo's rows."""
    state = self.value_heads * self.key_dim * self.value_dim * 4
    halo = (self.conv_kernel - 1) * self.conv_channels * dtype_bytes
    return batch * (state + halo)

  def kept_hop_bytes(self, config, prefix: int, batch: int, dtype_bytes: int, kv_heads: int):
    """None kept: its hop is the state and halo, which leave the program whatever the cache."""
    return 0

  def last_hop_holds(self, hop_end: int, last: int) -> bool:
    """Always: its past is the state and halo the last rank computes itself, whole."""
    return True

  def cache_bytes(self, config, context_len: int, batch: int, dtype_bytes: int, shards: int = 1):
    """Bytes of this layer's past on one device of a model group of `shards`, whatever the
    prompt's length: the hop's state and halo, split by head and channel over the group."""
    return self.hop_bytes(config, context_len, batch, dtype_bytes) // shards


@dataclasses.dataclass(frozen=True)
class LatentAttentionKind:
  """Multi-head latent attention (DeepSeek-V3, Kimi K2, Moonlight: models/latent_attention.py):
  its past is one compressed latent per token, `latent_dim` numbers (kv_lora_rank) and the
  `rope_dim` numbers of the rope key every head shares, whatever the head count. Each head's
  K and V are expanded from it; a hop would carry the latent prefix (71x less than DeepSeek-V3's
  128 heads of K and V)."""

  latent_dim: int
  rope_dim: int
  computes: ClassVar[str] = "multi-head latent attention"
  past: ClassVar[str] = "latent prefix"
  window: ClassVar[None] = None
  runs_today: ClassVar[str] = (
    "kvr_jax.prefill and generate run it with its own programs (kvr_jax.inference.latent: "
    "single, KV-Runahead, ring, all-gather, TSP), on a 1-D mesh or a 2-D one (heads and "
    "experts split over 'model')"
  )
  splits_over_model: ClassVar[bool] = True  # in its own programs (kvr_jax.strategies.latent)

  @property
  def name(self) -> str:
    return "multi-head latent attention"

  def first_key(self, position: int) -> int:
    return 0  # no window: every earlier latent

  def last_hop_holds(self, hop_end: int, last: int) -> bool:
    return True  # its hop carries the whole latent prefix

  def hop_span(self, end: int) -> tuple[int, int]:
    return 0, end

  def hop_bytes(self, config, end: int, batch: int, dtype_bytes: int) -> int:
    """Bytes of a hop into a chunk at `end`: the latent prefix, one headless copy."""
    return batch * end * (self.latent_dim + self.rope_dim) * dtype_bytes

  def kept_hop_bytes(self, config, prefix: int, batch: int, dtype_bytes: int, kv_heads: int):
    """The latent prefix the last hop carries, headless (whole on every shard of a group)."""
    return self.hop_bytes(config, prefix, batch, dtype_bytes)

  def decode_keys(self, length: int) -> int:
    return length

  def cache_bytes(self, config, context_len: int, batch: int, dtype_bytes: int, shards: int = 1):
    """Bytes of this layer's past: the latent prefix, headless, whole on every device of a
    model group."""
    return self.hop_bytes(config, context_len, batch, dtype_bytes)


def kinds_in_order(kinds) -> tuple:
  """The distinct kinds of a model's layers, one compiled layer body each: the kinds of a
  past of their own first (a linear layer's state; by name among themselves), then windowed
  attention, smallest window first, then full attention. A kind without a window (a made-up
  kind, tests/test_by_kind.py) orders as one with none."""

  def order(kind):
    window = getattr(kind, "window", None)
    return (isinstance(kind, AttentionKind), window is None, window or 0, kind.name)

  return tuple(sorted(set(kinds), key=order))


def past_kind(config) -> str:
  """What a model's past is, which chooses its cache form, its cost model and its fitting:
  "hybrid" where any layer is Gated DeltaNet (a fixed-size state beside K,V), "latent" where
  any layer is latent attention (a compressed latent per token), else "kv" (K,V per layer).
  A model of both would be a hybrid first: no such model exists to say otherwise."""
  if any(isinstance(kind, GatedDeltaNetKind) for kind in config.kinds):
    return "hybrid"
  if any(isinstance(kind, LatentAttentionKind) for kind in config.kinds):
    return "latent"
  return "kv"


def unbuilt_kinds(config) -> tuple:
  """The kinds of `config`'s layers that the parallel strategies do not run yet."""
  return tuple(k for k in config.kinds if not isinstance(k, AttentionKind))
