"""What `prefill` returns: the last position's logits and the cache, whole on the last rank
(`WholeCache`, cache="last") or in the ranks' parts (`CacheParts`, cache="sharded"), or for a
model that keeps a cache of its own (a hybrid's, a latent model's: `cache_form.ModelCacheForm`)
that cache in either layout (`ModelCache`). The model's cache form builds each
(inference.cache_form)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import numpy as np

from kvr_jax.inference import steppers
from kvr_jax.inference.decode import DecodeLayout
from kvr_jax.inference.kv_cache import cut_on_last_rank, gather_on_last_rank, kept_on_last_rank
from kvr_jax.inference.sharded_decode import prompt_order_of_rings
from kvr_jax.planning.choice import StrategyChoice
from kvr_jax.runtime.cache_layout import CacheLayout
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, model_parallel, rank_row_mesh, spans_processes


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
  # KV-Runahead on a hybrid with a split per layer kind: the full layers' chunks (`partition`
  # is then the linear layers'); None where one split ran every layer (every K,V model).
  full_partition: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)
  # cache="last": whether the ranks' parts moved onto the last rank (the peers' parts, the
  # split as data's) or were there already (KV-Runahead's kept last hops and own chunk: no
  # move). False for cache="sharded", where nothing moves.
  moved: bool = dataclasses.field(default=False, kw_only=True)

  cache: ClassVar[str]

  @property
  def is_local(self) -> bool:
    return self.logits is not None

  @property
  def device(self):
    return next(iter(self.logits.devices()))

  @property
  def decodes_here(self) -> bool:
    """Whether this process decodes from this cache: it holds the last rank's logits (or,
    left in parts, some rank's part)."""
    return self.is_local

  @property
  def decodes_in_every_process(self) -> bool:
    """Whether every process runs each decode step (the cache left in parts over a mesh that
    spans processes), all of them taking the last rank's token."""
    return False

  def stepper(self, model, lengths_B, max_new_tokens: int, seed: int, consume: bool = False):
    """decode_from's stepper for this cache's layout (kvr_jax.inference.steppers): (step,
    the first tail, the prompt's logits, the sampling key). consume: the decode may write
    into the prefill's own cache where it has the room (a ModelCache of generate's; a K,V
    cache grows into a fresh buffer either way)."""
    raise NotImplementedError  # pragma: no cover - interface

  def after_decode(self, tail, consume: bool, max_new_tokens: int) -> PrefillResult:
    """This result after a decode of `max_new_tokens` from it (`stepper(consume=)`; tail: the
    last step's cache): itself, its cache as the prefill left it (a K,V decode writes into a
    grown copy)."""
    del tail, consume, max_new_tokens
    return self

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


def prompt_order(k_full, v_full, kept: DecodeLayout | None, rings, lengths, prompt_len: int):
  """(k, v) [L, B, C, K, H] in prompt order from what is kept where windowed layers keep
  rings (`kept`; None: k_full, v_full already hold every layer): the every-position layers
  [L_f, B, C, K, H] as they are, each ring's positions in prompt order (zeros before the
  window), stacked by layer."""
  if kept is None:
    return k_full, v_full
  pieces = [
    (k_full, v_full) if ring is None else prompt_order_of_rings(*rings[g], lengths, prompt_len)
    for g, ring in enumerate(kept.rings)
  ]
  return tuple(kept.in_layer_order([kv[i] for kv in pieces]) for i in (0, 1))


@dataclasses.dataclass(frozen=True, eq=False)
class WholeCache(PrefillResult):
  """cache="last" (the paper's layout): the cache on the last rank's device (`device`; its
  row of devices on a 2-D mesh, heads split over "model"), where decode continues; None in a
  process that does not hold it.

  k_layers, v_layers: [L_f, B, S, K, H], S = prompt_len, in prompt order: every layer, or
  where a window is shorter than the prompt (`kept`, decode.DecodeLayout of the prompt) only
  the layers that keep every position; such a window's layers keep only a ring, `rings[g]` =
  (k, v) [L_g, B, W, K, H] per group of `kept` (None for the every-position group), each
  row's last W prompt positions at slot position mod W: what decode reads, all that moved or
  was joined. `k_cache` / `v_cache` give every layer in prompt order (zeros before a ring's
  window)."""

  k_layers: jax.Array | None
  v_layers: jax.Array | None
  kept: DecodeLayout | None = None
  rings: tuple = ()

  cache: ClassVar[str] = "last"

  @property
  def k_cache(self) -> jax.Array | None:
    return self.decode_cache()[0]

  @property
  def v_cache(self) -> jax.Array | None:
    return self.decode_cache()[1]

  def decode_cache(self) -> tuple[jax.Array, jax.Array]:
    if self.k_layers is None:
      return None, None
    return prompt_order(
      self.k_layers, self.v_layers, self.kept, self.rings, self.lengths, self.prompt_len
    )

  def stepper(self, model, lengths_B, max_new_tokens: int, seed: int, consume: bool = False):
    # On a ("ranks", "model") mesh the cache's heads are split over the last rank's row (a
    # result rebuilt around a gathered cache, as timing does, says so by its sharding).
    spec = getattr(getattr(self.k_layers, "sharding", None), "spec", ())
    on_group = MODEL_AXIS in tuple(spec)
    stepper = steppers.model_group_stepper if on_group else steppers.whole_cache_stepper
    return stepper(model, self, lengths_B, max_new_tokens, seed)

  def groups(self) -> tuple[DecodeLayout, tuple]:
    """(layout, caches): the cache as decode's whole-cache step reads it, per group of the
    layout (the every-position layers, then each ring), with no copy."""
    kept = self.kept or DecodeLayout.whole(self.k_layers.shape[0])
    caches = tuple(
      (self.k_layers, self.v_layers) if ring is None else self.rings[g]
      for g, ring in enumerate(kept.rings)
    )
    return kept, caches

  def with_groups(self, logits, caches) -> WholeCache:
    """This result with `logits` and the caches per group of `groups()`'s layout."""
    kept, _ = self.groups()
    every = kept.every_position_group
    k, v = (self.k_layers, self.v_layers) if every is None else caches[every]
    rings = tuple(None if ring is None else caches[g] for g, ring in enumerate(kept.rings))
    return dataclasses.replace(
      self, logits=logits, k_layers=k, v_layers=v, rings=rings if self.kept else ()
    )


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
  # (sharded_decode.sharded_rings_program).
  kept: DecodeLayout | None = None
  rings: tuple = ()

  cache: ClassVar[str] = "sharded"

  @property
  def decodes_here(self) -> bool:
    return self.kv_parts is not None or self.is_local  # a rank's part, or the logits

  @property
  def decodes_in_every_process(self) -> bool:
    return spans_processes(self.mesh)

  def stepper(self, model, lengths_B, max_new_tokens: int, seed: int, consume: bool = False):
    return steppers.sharded_stepper(model, self, lengths_B, max_new_tokens, seed)

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
    each ring's positions in prompt order (zeros before its window), stacked by layer, where
    the every-position layers lie (the last rank's device, or its row's heads)."""
    k, v, rings = cut_on_last_rank(
      self.kv_parts, self.rings, self.cache_layout, self.mesh, self.kept
    )
    if k is None:
      return None, None  # another process holds the last rank
    kv = prompt_order(k, v, self.kept, rings, self.lengths, self.prompt_len)
    return tuple(jax.device_put(x, k.sharding) for x in kv)

  def moved_to_last_rank(self, config) -> WholeCache:
    """This prefill as cache="last" (`config`: the model's, which says its windows): the cache
    brought onto the last rank as prefill(cache="last") brings it, from the parts that
    run_prefill(move_cache=False) leaves. Every layer in prompt order, or where a window is
    shorter than the prompt the every-position layers and each window's ring only
    (kv_cache.kept_on_last_rank: KV-Runahead joins its last hop, the peers move only the
    rings' windows)."""
    common = {f.name: getattr(self, f.name) for f in dataclasses.fields(PrefillResult)}
    # The parts move unless KV-Runahead's last hop holds them or one rank holds them all.
    common["moved"] = self.last_hop is None and self.mesh.shape[AXIS] > 1
    if self.kv_parts is None:  # another process holds every part (auto's one-device pick)
      return WholeCache(**common, k_layers=None, v_layers=None)
    if self.kept is not None:  # cut already (cache="sharded"): gather the parts, keep rings
      k, v, rings = cut_on_last_rank(
        self.kv_parts, self.rings, self.cache_layout, self.mesh, self.kept
      )
      return WholeCache(**common, k_layers=k, v_layers=v, kept=self.kept, rings=rings)
    kept = DecodeLayout.of(config, self.prompt_len)
    if kept.rings == (None,):
      k, v = gather_on_last_rank(
        self.kv_parts, self.cache_layout, self.mesh, last_hop=self.last_hop
      )
      return WholeCache(**common, k_layers=k, v_layers=v)
    k, v, rings = kept_on_last_rank(
      self.kv_parts, self.cache_layout, self.mesh, kept, self.lengths, self.last_hop
    )
    return WholeCache(**common, k_layers=k, v_layers=v, kept=kept, rings=rings)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class ModelCache(PrefillResult):
  """What `prefill` returns for a model with a cache of its own (a `ModelCacheForm`): a
  `PrefillResult` (logits [B, V] float32 on the last rank's first device, None in a process
  that does not hold it; prompt_len; strategy; partition; attention; lengths; choice) with
  its cache in the model's own form; `cache` ("last" or "sharded") is a field here, where
  `WholeCache` and `CacheParts` are one layout each.

  model_cache (cache="last"): a hybrid's `HybridCache` (each full layer's K,V, each linear
  layer's state and halo) or a latent model's [L, B, S, C] latents, S = capacity (the prompt
  and the room kept for decoding: `generate`'s new tokens, written there), on the
  last rank's device, or split over its model group on a 2-D mesh (`decode_mesh`; by head,
  hybrid.CACHE_SPECS; a latent cache whole on each shard). parts, part_positions
  (cache="sharded", latent models): each rank's latents where the program left them
  [p, L, B, T_rank, C] and the prompt position of each of their rows [p, T_rank] (-1:
  padding). `gather_cache()`: the cache in one device's layout. `decode_from` reads the
  cache without consuming it."""

  cache: str
  capacity: int
  # The model's `cache_form.ModelCacheForm` (hybrid.FORM, latent.FORM), which builds this result.
  form: Any = dataclasses.field(repr=False)
  mesh: Any
  config: Any = dataclasses.field(repr=False)
  model_cache: Any = None
  parts: jax.Array | None = None
  part_positions: np.ndarray | None = None
  # cache="sharded" across processes: the logits replicated on every device (every process
  # decodes its ranks' parts and samples the same tokens).
  replicated_logits: jax.Array | None = None
  # cache="sharded", hybrid models: where each rank's K,V rows lie in the prompt (None on a
  # latent model, whose parts say it by `part_positions`), and the prompt's final linear
  # states and halos on every rank.
  cache_layout: Any = None
  linear_state: Any = None

  def gather_cache(self):
    """The cache (cache="last") as the model's own one-device forward lays it out, on the
    last rank's first device: a hybrid's split over a model group put back in order
    (`hybrid.one_device_layout`); a latent cache as it is."""
    if self.cache != "last":
      raise ValueError(f"gather_cache reads cache='last'; this prefill ran cache={self.cache!r}")
    self.check_held()
    form = self.form
    # The prompt's positions (not the room kept for decoding), through the host: a group's
    # arrays are typed with its mesh's axes, which one device lacks.
    cache = jax.tree.map(lambda a: jax.device_put(np.asarray(a), self.device), self.model_cache)
    cache = form.one_device_layout(self.config, cache, model_parallel(self.mesh))
    return form.prompt_part(cache, self.prompt_len)

  def check_held(self) -> None:
    """Refuses a cache="last" result without its cache, by why."""
    if self.cache == "last" and self.model_cache is None:
      raise ValueError(
        "this result holds no cache: its prefill left it where the program put it "
        "(run_prefill(move_cache=False)), or another process's rank is last and holds it"
      )

  @property
  def decodes_here(self) -> bool:
    return self.parts is not None or self.is_local  # a rank's part, or the logits

  @property
  def decodes_in_every_process(self) -> bool:
    return self.parts is not None and spans_processes(self.mesh)

  def stepper(self, model, lengths_B, max_new_tokens: int, seed: int, consume: bool = False):
    return steppers.model_cache_stepper(model, self, lengths_B, max_new_tokens, seed, consume)

  def consumed_by(self, consume: bool, max_new_tokens: int) -> bool:
    """Whether a decode of `max_new_tokens` writes into this cache itself (generate's own,
    made with the room: consume), its buffer donated to the steps, not into a grown copy."""
    fits = self.capacity >= self.prompt_len + max_new_tokens
    return consume and fits and self.cache == "last"

  def after_decode(self, tail, consume: bool, max_new_tokens: int) -> ModelCache:
    """Where the decode consumed this cache (`consumed_by`): this result with the last step's
    cache (the prompt's positions and the fed tokens'), the prefill's buffer being donated;
    else itself."""
    if self.consumed_by(consume, max_new_tokens):
      return dataclasses.replace(self, model_cache=tail)
    return self

  @property
  def family(self) -> str:
    """The cache form's name ("hybrid", "latent")."""
    return self.form.name

  def layer_cache(self, layer: int):
    """Refused: a hybrid's or latent model's cache is not one (K, V) per layer."""
    raise ValueError(
      f"a {self.family} model's cache is its own form, not (K, V) per layer: read gather_cache()"
    )

  def decode_cache(self):
    """Refused as `layer_cache` is: its decode reads `model_cache`
    (`steppers.model_cache_stepper`)."""
    return self.layer_cache(0)

  @property
  def decode_mesh(self):
    """The last rank's model group where the mesh has one (its cache split there), else None."""
    if model_parallel(self.mesh) == 1:
      return None
    return rank_row_mesh(self.mesh, self.mesh.shape[AXIS] - 1)
