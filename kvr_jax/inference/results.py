"""What `prefill` returns: the last position's logits and the cache, whole on the last rank
(`WholeCache`, cache="last") or in the ranks' parts (`CacheParts`, cache="sharded")."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvr_jax.inference.decode import DecodeLayout, prompt_order_of_rings
from kvr_jax.inference.kv_cache import gather_on_last_rank
from kvr_jax.planning.choice import StrategyChoice
from kvr_jax.runtime.cache_layout import CacheLayout
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, model_parallel, rank_row_mesh


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
  # What each layer keeps (cache="sharded" on a model with a window shorter than the prompt;
  # else None: every layer in the parts): kv_parts holds only the layers of `kept`'s
  # every-position group, [p, L_f, 2, B*P, K, H]; a windowed layer keeps a ring of its window,
  # `rings[g]` = (k, v) [L_g, B, W, K, H] replicated over `mesh` (None for the every-position
  # group), each row's last W prompt positions at slot position mod W
  # (decode.sharded_rings_program).
  kept: DecodeLayout | None = None
  rings: tuple = ()

  cache: ClassVar[str] = "sharded"

  def decode_cache(self) -> tuple[jax.Array, jax.Array]:
    if self.kv_parts is None:  # another process holds every part (auto's one-device pick)
      return None, None
    if self.kept is None:
      return gather_on_last_rank(
        self.kv_parts, self.cache_layout, self.mesh, last_hop=self.last_hop
      )
    return self._with_rings_in_prompt_order()

  def _with_rings_in_prompt_order(self) -> tuple[jax.Array, jax.Array]:
    """decode_cache() where windowed layers keep rings: the parts' layers gathered as ever,
    each ring's positions in prompt order (zeros before its window), stacked by layer."""
    last_row = self.mesh.devices.reshape(self.mesh.shape[AXIS], -1)[-1]
    if last_row[0].process_index != jax.process_index():
      return None, None  # another process holds the last rank
    if model_parallel(self.mesh) > 1:
      group = rank_row_mesh(self.mesh, self.mesh.shape[AXIS] - 1)
      target = jax.sharding.NamedSharding(group, jax.P(None, None, None, MODEL_AXIS, None))
    else:
      target = jax.sharding.SingleDeviceSharding(last_row[0])

    def on_last_row(x):  # a ring's copy on the last rank's devices (its heads' shards)
      shards = {s.device: s.data for s in x.addressable_shards}
      if model_parallel(self.mesh) == 1:
        return shards[last_row[0]]
      return jax.make_array_from_single_device_arrays(
        x.shape, target, [shards[d] for d in last_row]
      )

    pieces = []
    for group, ring in enumerate(self.kept.rings):
      if ring is None:
        kv = gather_on_last_rank(self.kv_parts, self.cache_layout, self.mesh)
      else:
        ring_kv = [on_last_row(x) for x in self.rings[group]]
        kv = prompt_order_of_rings(*ring_kv, self.lengths, self.prompt_len)
      pieces.append(jax.device_put(kv, target))
    order = np.concatenate([self.kept.layers_of(g) for g in range(len(self.kept.rings))])
    in_layer_order = np.argsort(order)
    return tuple(
      jax.device_put(jnp.concatenate([kv[i] for kv in pieces])[in_layer_order], target)
      for i in (0, 1)
    )

  def whole(self, k_cache, v_cache) -> WholeCache:
    """This prefill with its cache gathered (`decode_cache()`'s output) as cache="last"."""
    common = {f.name: getattr(self, f.name) for f in dataclasses.fields(PrefillResult)}
    return WholeCache(**common, k_cache=k_cache, v_cache=v_cache)
