"""What `prefill` returns: the last position's logits and the cache, whole on the last rank
(`WholeCache`, cache="last") or in the ranks' parts (`CacheParts`, cache="sharded")."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import numpy as np

from kvr_jax.inference.kv_cache import (
  gather_on_last_rank,
)
from kvr_jax.planning.choice import StrategyChoice
from kvr_jax.runtime.cache_layout import CacheLayout


@dataclasses.dataclass(frozen=True, eq=False)
class PrefillResult:
  """What a prefill hands to decode: one of two layouts, `WholeCache` (cache="last") or
  `CacheParts` (cache="sharded"), with these fields in common.

  logits: [B, V] float32, each row's last prompt position, on the last rank's device (None in
  a process of a multi-process run that does not hold it: `is_local` is False).
  prompt_len: T, the rows' padded length. strategy: the strategy's name. partition: the
  chunk lengths a partitioned strategy ran, else None. cache_layout: which prompt positions
  each rank's part held. attention: the kernel that ran ("auto" resolved). lengths: [B]
  int32, each row's true length: positions [lengths[b], prompt_len) of row b are padding
  (buckets, ragged batches); decode continues row b at position lengths[b].
  """

  logits: jax.Array | None
  prompt_len: int
  strategy: str
  partition: tuple[int, ...] | None
  cache_layout: CacheLayout
  attention: str
  lengths: np.ndarray
  # strategy="auto": the strategy it picked and every candidate's MODELLED TTFT; else None.
  choice: StrategyChoice | None = dataclasses.field(default=None, kw_only=True)
  # The model's KV heads: on a 2-D mesh with more "model" shards than KV heads the caches hold
  # each head repeated (tensor_parallel.shard_ready_state), which `gather_cache` undoes.
  kv_heads: int | None = dataclasses.field(default=None, kw_only=True)

  cache: ClassVar[str]

  @property
  def is_local(self) -> bool:
    return self.logits is not None

  @property
  def device(self):
    return next(iter(self.logits.devices()))

  def gather_cache(self) -> tuple[jax.Array, jax.Array]:
    """(K, V) [L, B, S, K, H] in prompt order on the last rank's device (its row of devices on
    a 2-D mesh), whichever layout, with the model's K heads (single's shape) on every mesh."""
    return _model_heads(*self.decode_cache(), self.kv_heads)

  def decode_cache(self) -> tuple[jax.Array, jax.Array]:  # pragma: no cover - interface
    """The cache as decode reads it: `gather_cache`'s, but on a 2-D mesh with more "model"
    shards than KV heads each head stays repeated, one per shard (the decode step's split)."""
    raise NotImplementedError

  def layer_cache(self, layer: int) -> tuple[jax.Array, jax.Array]:
    """(K, V) of one layer, each [B, S, K, H]."""
    k, v = self.gather_cache()
    return k[layer], v[layer]


def _model_heads(k_LBSKH, v_LBSKH, kv_heads: int | None):
  """(k, v) with the model's KV heads: a head repeated r times over "model" shards (K < m)
  taken once, so that the cache has single's shape on every mesh."""
  if k_LBSKH is None or kv_heads is None or k_LBSKH.shape[3] == kv_heads:
    return k_LBSKH, v_LBSKH
  repeats = k_LBSKH.shape[3] // kv_heads

  def once(x):  # the heads axis is split over "model": replicate over the row, then slice
    whole = jax.device_put(x, x.sharding.update(spec=jax.P()))
    return whole[:, :, :, ::repeats]

  return once(k_LBSKH), once(v_LBSKH)


@dataclasses.dataclass(frozen=True, eq=False)
class WholeCache(PrefillResult):
  """cache="last" (the paper's layout): k_cache, v_cache [L, B, S, K, H] with S = prompt_len,
  in prompt order on the last rank's device (`device`), where decode continues; None in a
  process that does not hold them. A windowed layer's (W) positions before
  prompt_len - W + 1 may be zeros: no query from the prompt's end on reads them, and
  KV-Runahead's last hop does not carry them (its join keeps what decode reads)."""

  k_cache: jax.Array | None
  v_cache: jax.Array | None

  cache: ClassVar[str] = "last"

  def decode_cache(self) -> tuple[jax.Array, jax.Array]:
    return self.k_cache, self.v_cache


@dataclasses.dataclass(frozen=True, eq=False)
class CacheParts(PrefillResult):
  """cache="sharded": the parts where they were computed. kv_parts [p, L, 2, B*P, K, H]
  (batch folded into the rows: `strategies.base.unfold_batch(part, cache_layout.part_len)`
  gives [..., B, P, K, H]) sharded over `mesh`, rank r's part holding the positions
  `cache_layout.segments[r]` says. last_hop: KV-Runahead's last-hop messages where the plan
  kept them (`run_prefill(move_cache=False)`): the last rank's cache is joined from them and
  its part, without a move. `gather_cache()` brings the cache into prompt order on the last
  rank; `whole(k, v)` is the same result with that cache."""

  kv_parts: jax.Array
  mesh: Any
  last_hop: jax.Array | None = None
  # [B, V] replicated over `mesh` when the mesh spans processes: every process holds the
  # logits, so every process can run the decode steps that read its parts (generate).
  replicated_logits: jax.Array | None = None

  cache: ClassVar[str] = "sharded"

  def decode_cache(self) -> tuple[jax.Array, jax.Array]:
    if self.kv_parts is None:  # another process holds every part (auto's one-device pick)
      return None, None
    return gather_on_last_rank(self.kv_parts, self.cache_layout, self.mesh, last_hop=self.last_hop)

  def whole(self, k_cache, v_cache) -> WholeCache:
    """This prefill with its cache gathered (`decode_cache()`'s output) as cache="last"."""
    common = {f.name: getattr(self, f.name) for f in dataclasses.fields(PrefillResult)}
    return WholeCache(**common, k_cache=k_cache, v_cache=v_cache)
