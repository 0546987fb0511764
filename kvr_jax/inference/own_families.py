"""`kvr_jax.prefill`, `generate` and `decode_from` for the models with their own context-parallel
programs: the hybrids (Qwen3.5, Qwen3-Next: Gated DeltaNet and full layers,
kvr_jax.inference.hybrid) and latent attention (DeepSeek-V3, Kimi K2, Moonlight,
kvr_jax.inference.latent).

Such a model is planned as any other (kvr_jax.inference.prefill: the strategy or "auto", the
mesh, KV-Runahead's split by name, list or PartitionPlan, the kernel, every argument checked
before anything compiles); its family (`OwnFamily`) then says what its programs run, the plan
runs them (`run_own_prefill`), and the result (`ModelCache`) holds the cache in the model's
own form. `decode_from` decodes from it with the model's own step (`own_stepper`), in the same
token loop as a K,V cache (end-of-sequence stops, sampling, text).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from kvr_jax.core.caches import kept_cache
from kvr_jax.inference import hybrid, latent
from kvr_jax.inference.decode import decode_step_of, group_decode_step
from kvr_jax.inference.results import PrefillResult
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.mesh import (
  AXIS,
  global_array,
  model_parallel,
  placements,
  rank_device,
  rank_row_mesh,
  spans_processes,
)
from kvr_jax.strategies import family_program
from kvr_jax.strategies import hybrid as hybrid_programs
from kvr_jax.strategies import latent as latent_programs
from models.base import no_reduce
from models.layer_kinds import GatedDeltaNetKind, LatentAttentionKind
from models.qwen3_5 import HybridCache


@dataclasses.dataclass(frozen=True)
class OwnFamily:
  """What one family's own programs run. strategies: the parallel ones (with "single", the
  model's own forward on one device or one rank's model group). caches: the layouts its
  decode reads ("last": joined on the last rank; "sharded": left in the ranks' parts).
  group_cache_spec: how the joined cache lies over a model group (a PartitionSpec or a pytree
  of them). run(model, plan, tokens_BT, room, ends_B, join) -> the `ModelCache` fields the
  prefill of `plan` (a PrefillPlan: its mesh, strategy, split, kernel, cache, probes) made:
  logits [B, V] on the last rank's first device, and the joined cache (with room for `room`
  more positions; join=False: none, the outputs left where the program put them) or the
  ranks' parts.
  grown(cache, capacity) -> the cache with room for `capacity` positions (a fresh buffer: the
  decode steps donate theirs). sharded_stepper(model, result, max_new_tokens, seed): decode
  from cache="sharded" (`own_stepper`'s return)."""

  name: str
  strategies: tuple[str, ...]
  caches: tuple[str, ...]
  group_cache_spec: Any
  run: Callable
  grown: Callable
  one_device_layout: Callable  # (config, cache split over m, m) -> the model's own layout
  prompt_part: Callable  # (cache, T) -> its first T positions (the room for decoding cut)
  sharded_stepper: Callable
  # (a one-rank prefill's cache, T, its mesh) -> cache="sharded"'s ModelCache fields
  one_rank_parts: Callable
  # Whether KV-Runahead's split as data runs (`runahead.split_as_data_strategy`'s record:
  # one program for every split that fits its envelope).
  takes_split_as_data: bool = False
  # A fixed-size past that a row's padding would advance (a linear layer's state and halo,
  # where a causal K,V or latent past is written per position): the prefill of padded rows
  # stops it before each row's last real token, whose decode step then runs it from there.
  stops_at_row_ends: bool = False
  # (plan, graphdef, padded) -> the prefill program of `plan` (PrefillPlan.compile): the
  # family's program builder with the plan's strategy, mesh, split, kernel, cache and probes;
  # padded: rows padded past their ends (`stops_at_row_ends`: each position's distance from
  # its row's end beside the tokens).
  compile: Callable | None = None
  # (config, strategy record, T, p, the full layers' own chunks or None) -> None: what the
  # family's programs refuse of a split, by name, once the plan has made it.
  check_split: Callable | None = None
  # (result, the caches the sharded step returned) -> the result's fields that the step of
  # a padded row's last real token changed (`_at_last_real_tokens`).
  after_sharded_step: Callable = lambda result, caches: {}


def _compile_hybrid(plan, graphdef, padded: bool = False):
  """The plan's hybrid program (strategies.hybrid.compile_hybrid, by `hybrid.bound_program`):
  cache="last" keeps KV-Runahead's last hops; the full layers' own split; a
  split as data's one program bound to the plan's split (`runahead.on_split`, the full
  layers' table)."""
  spec, body, split_shape = family_program(plan.strategy, None, None)
  options = (plan.keep_last_hop, plan.timeline, body, padded)
  config = plan.strategy.options.config if split_shape is not None else None
  return hybrid.bound_program(
    spec, graphdef, plan.mesh, plan.chunks, plan.kernel, options, plan.full_chunks,
    split_shape, config,
  )  # fmt: skip


def _compile_latent(plan, graphdef, padded: bool = False):
  """The plan's latent program (strategies.latent.compile_latent, by `latent.bound_program`):
  KV-Runahead's last hop kept where cache="last" joins it (a latent layer's hop
  carries the whole prefix). A causal past takes padded rows as they are (padded unused)."""
  del padded
  spec, body, split_shape = family_program(plan.strategy, None, None)
  options = (plan.keep_last_hop, plan.timeline, body)
  config = plan.strategy.options.config if split_shape is not None else None
  return latent.bound_program(
    spec, graphdef, plan.mesh, plan.chunks, plan.kernel, options, split_shape, config
  )


def _padded_positions(array, axis: int, capacity: int):
  """`array` with room for `capacity` positions on `axis` (never fewer than it has)."""
  pad = [(0, 0)] * array.ndim
  pad[axis] = (0, max(capacity - array.shape[axis], 0))
  return jnp.pad(array, pad)


@functools.partial(jax.jit, static_argnums=1)
def _grown_hybrid(cache: HybridCache, capacity: int) -> HybridCache:
  # K,V [L_full, 2, B, S, K, H] grow along S; a linear layer's state and halo do not grow.
  return cache._replace(
    kv_2BSKH=_padded_positions(cache.kv_2BSKH, 3, capacity),
    linear=jax.tree.map(jnp.copy, cache.linear),
  )


@functools.partial(jax.jit, static_argnums=1)
def _grown_latent(cache_LBSC, capacity: int):
  return _padded_positions(cache_LBSC, 2, capacity)


def check_own_plan(family: OwnFamily, config, spec, cache: str):
  """What a plan for `family` runs, refused by name before anything compiles: its strategies
  and cache layouts. Timeline probes are the record's (`Strategy.timeline_probes`, checked
  by the plan for every model): the families' programs mark what the K,V ones do. Rows
  padded past their length (a bucket, a ragged batch) run in both layouts, as on K,V models."""
  what = f"a {config.architecture} model ({family.name}: its own programs)"
  name, (_, _, split_shape) = spec.registered_name, family_program(spec)
  if name not in family.strategies:
    raise ValueError(f"{what} runs under {list(family.strategies)}, not {spec.name!r}")
  if split_shape is not None and not family.takes_split_as_data:
    raise ValueError(f"{what} does not take KV-Runahead's split as data ({spec.name!r})")
  if cache not in family.caches:
    raise ValueError(f"{what} keeps its cache as {list(family.caches)}, not cache={cache!r}")


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class ModelCache(PrefillResult):
  """What `prefill` returns for a model with its own programs (`own_family`): a
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
  family: str
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
  # KV-Runahead on a hybrid with a split per layer kind: the full layers' (`partition` is
  # then the linear layers'); None where one split ran every layer.
  full_partition: tuple[int, ...] | None = None
  # cache="last": whether the ranks' parts moved onto the last rank (the peers, the split as
  # data's parts) or were there already (KV-Runahead's last hops and own chunk: no move).
  moved: bool = False

  def gather_cache(self):
    """The cache (cache="last") as the model's own one-device forward lays it out, on the
    last rank's first device: a hybrid's split over a model group put back in order
    (`hybrid.one_device_layout`); a latent cache as it is."""
    if self.cache != "last":
      raise ValueError(f"gather_cache reads cache='last'; this prefill ran cache={self.cache!r}")
    self.check_held()
    family = own_family(self.config)
    # The prompt's positions (not the room kept for decoding), through the host: a group's
    # arrays are typed with its mesh's axes, which one device lacks.
    cache = jax.tree.map(lambda a: jax.device_put(np.asarray(a), self.device), self.model_cache)
    cache = family.one_device_layout(self.config, cache, model_parallel(self.mesh))
    return family.prompt_part(cache, self.prompt_len)

  def check_held(self) -> None:
    """Refuses a cache="last" result without its cache, by why."""
    if self.cache == "last" and self.model_cache is None:
      raise ValueError(
        "this result holds no cache: its prefill left it where the program put it "
        "(run_prefill(move_cache=False)), or another process's rank is last and holds it"
      )

  def layer_cache(self, layer: int):
    """Refused: a hybrid's or latent model's cache is not one (K, V) per layer."""
    raise ValueError(
      f"a {self.family} model's cache is its own form, not (K, V) per layer: read gather_cache()"
    )

  def decode_cache(self):
    """Refused as `layer_cache` is: its decode reads `model_cache` (`own_stepper`)."""
    return self.layer_cache(0)

  @property
  def decode_mesh(self):
    """The last rank's model group where the mesh has one (its cache split there), else None."""
    if model_parallel(self.mesh) == 1:
      return None
    return rank_row_mesh(self.mesh, self.mesh.shape[AXIS] - 1)


def run_own_prefill(
  model, plan, tokens_BT: np.ndarray, lengths_B: np.ndarray, room: int = 0, join: bool = True
) -> ModelCache:
  """Runs `plan` (kvr_jax.inference.prefill_plan.PrefillPlan, checked by `check_own_plan`) with the
  family's own program; "single" is the model's own forward on the plan's one device (its
  model group on a 2-D mesh). room: positions the cache keeps for decoding. join=False
  (`run_prefill(move_cache=False)`, what a benchmark times): with cache="last", return once
  the last rank's logits exist, the program's outputs left where it put them (no cache in the
  result: KV-Runahead's last rank holds the whole cache there already, the peers' is spread
  over their ranks). A process that holds no device of the mesh (auto's pick of one
  device in another process) gets no logits and no cache."""
  family = own_family(model.config)
  padded = bool((lengths_B < plan.prompt_len).any())
  if padded and not join and plan.cache == "last":
    raise ValueError(
      f"move_cache=False runs a {family.name} model's rows of one length: these are padded "
      "past their lengths, whose logits are read from the joined cache (move the cache, or "
      "give rows of one length)"
    )
  spec, mesh = plan.strategy, plan.mesh
  fields = dict(
    prompt_len=plan.prompt_len,
    strategy=spec.name,
    partition=plan.partition,
    attention=plan.kernel.name,
    lengths=lengths_B,
    cache=plan.cache,
    capacity=plan.prompt_len + room,
    family=family.name,
    mesh=mesh,
    config=model.config,
    choice=plan.choice,
    full_partition=plan.full_chunks,
  )
  if not any(d.process_index == jax.process_index() for d in mesh.devices.flat):
    return ModelCache(None, **fields)
  ends_B = lengths_B - 1 if padded and family.stops_at_row_ends else None
  if spec.max_ranks == 1:
    result = _one_group_prefill(model, plan, family, tokens_BT, room, ends_B, fields)
  else:
    result = ModelCache(**family.run(model, plan, tokens_BT, room, ends_B, join), **fields)
  held = result.model_cache is not None or result.parts is not None
  if padded and held:
    result = _at_last_real_tokens(model, result, tokens_BT, lengths_B)
  return result


def _one_group_prefill(model, plan, family, tokens_BT, room, ends_B, fields) -> ModelCache:
  """strategy="single": the model's own forward on the plan's one device (its model group on
  a 2-D mesh), its cache joined there or, for cache="sharded", as the one rank's part.
  ends_B: each row's prefill end (`OwnFamily.stops_at_row_ends`), None for the whole rows."""
  mesh = plan.mesh
  forward = one_group_forward(
    model.graphdef,
    mesh,
    plan.kernel,  # the record: a kernel given with its own block sizes runs with them
    family.group_cache_spec,
    plan.prompt_len + room,
    ends_B is not None,
  )
  ends = () if ends_B is None else (np.asarray(ends_B, np.int32),)
  if model_parallel(mesh) > 1:
    replicated = NamedSharding(mesh, jax.P())
    state = model.state_split_over(mesh)
    operands = jax.device_put((tokens_BT, *ends), replicated)
  else:  # one device, its arrays placed on it alone (no mesh axis in their types)
    device = mesh.devices.flat[0]
    state, operands = model.state_on(device), jax.device_put((tokens_BT, *ends), device)
  logits_BV, cache = forward(state, *operands)
  logits_BV = jax.device_put(logits_BV, rank_device(mesh, 0))
  if plan.cache == "sharded":  # the cache as the one rank's part
    parts = family.one_rank_parts(cache, plan.prompt_len, mesh)
    return ModelCache(logits_BV, **fields, **parts)
  return ModelCache(logits_BV, **fields, model_cache=cache)


def _at_last_real_tokens(model, result: ModelCache, tokens_BT, lengths_B) -> ModelCache:
  """A padded batch's result with each row's logits at its last real token: one decode step of
  that token at its own position, where the cache lies (the causal prefill left every
  position before a row's end as that row alone gives it; the token's past entry, already in
  the cache, is written again identically). The padded positions after a row's end are
  overwritten by its decoded tokens before any query reads them. cache="sharded": the
  family's sharded step with a one-token tail, every rank's part read up to the row's last
  token only (its copy there hidden), in every process that holds a rank; what the step
  changed that decoding reads next is kept (`OwnFamily.after_sharded_step`: a hybrid's
  linear pasts, and the token's K,V written into its part, where the prefill, stopped
  before it, left other values)."""
  last_tokens_B = np.asarray(tokens_BT)[np.arange(len(lengths_B)), lengths_B - 1]
  if result.cache == "last":
    step, cache, _, _ = own_stepper(model, result, lengths_B - 1, 0, 0, consume=True)
    logits_BV, cache = step(last_tokens_B, 0, cache)
    logits_BV = jax.device_put(logits_BV, result.device)
    return dataclasses.replace(result, logits=logits_BV, model_cache=cache)
  mesh = result.mesh
  before_last = dataclasses.replace(result, lengths=lengths_B - 1)
  family = own_family(model.config)
  step, caches, _, _ = family.sharded_stepper(model, before_last, 1, 0)
  tokens_B = global_array(last_tokens_B.astype(np.int32), NamedSharding(mesh, jax.P()))
  replicated_BV, caches = step(tokens_B, 0, caches)
  result = dataclasses.replace(result, **family.after_sharded_step(before_last, caches))
  owner = rank_device(mesh, mesh.shape[AXIS] - 1)
  logits_BV = None  # on the last rank's device, in its process
  if owner.process_index == jax.process_index():
    logits_BV = jax.device_put(replicated_BV.addressable_shards[0].data, owner)
  replicated = replicated_BV if spans_processes(mesh) else None
  return dataclasses.replace(result, logits=logits_BV, replicated_logits=replicated)


@kept_cache(8)
def one_group_forward(graphdef, mesh, attention, cache_spec, capacity: int, row_ends: bool = False):
  """strategy="single" for a model with its own programs: (state, tokens [B, T]) -> (the last
  position's logits [B, V], the model's cache of `capacity` positions), its own `forward` on
  the mesh of one rank: one device, or a model group whose shards run their heads and experts (the
  partial sums added over "model") and keep the cache as `cache_spec` places it. row_ends:
  a third operand, each row's end [B], where the model's past stops (`forward(lengths_B=)`:
  every row's hidden states computed; the logits at T - 1 are then a padded row's)."""
  m = model_parallel(mesh)

  def forward(state, tokens_BT, *ends_B, reduce=no_reduce):
    model = nnx.merge(graphdef, state)
    lengths = dict(lengths_B=ends_B[0]) if row_ends else dict(last_row_only=True)
    x_BTD, cache = model.forward(
      tokens_BT, attention=attention, reduce=reduce, capacity=capacity, **lengths
    )
    return model.logits(x_BTD[:, -1:])[:, 0], cache

  if m == 1:
    return jax.jit(forward)

  @jax.jit
  def split(state, tokens_BT, *ends_B):
    # check_vma=False: the psums make the hidden states whole on every shard (as in own_spmd).
    return jax.shard_map(
      functools.partial(forward, reduce=tensor_parallel.psum_over_model),
      mesh=mesh,
      in_specs=(tensor_parallel.partition_specs(state, m), jax.P(), *(jax.P(),) * row_ends),
      out_specs=(jax.P(), cache_spec),
      check_vma=False,
    )(state, tokens_BT, *ends_B)

  return split


def own_stepper(
  model, result: ModelCache, lengths_B, max_new_tokens: int, seed: int, consume: bool = False
):
  """`decode_from`'s stepper for a `ModelCache`: (step(token_B, index, cache) -> (logits,
  cache), the first cache, the prompt's logits, the sampling key), placed where the cache
  lies. cache="last": the model's own decode step on the last rank's device (its model group
  on a 2-D mesh, the cache split as the prefill left it), from a grown copy of the cache
  (consume: from the prefill's own cache where it has the room, written in place);
  cache="sharded": every rank attends its own part (latent.latent_sharded_step)."""
  if own_family(model.config) is None or own_family(model.config).name != result.family:
    raise ValueError(
      f"this cache is a {result.family} model's; decode it with the model that made it"
    )
  family = own_family(model.config)
  result.check_held()
  if result.cache == "sharded":
    return family.sharded_stepper(model, result, max_new_tokens, seed)
  group = result.decode_mesh
  if group is None:
    device = result.device
    state = model.state_on(device)
    program = decode_step_of(model.graphdef)

    def placed(x):
      return jax.device_put(x, device)
  else:
    replicated = NamedSharding(group, jax.P())
    state = model.state_split_over(group)
    program = group_decode_step(model.graphdef, group, family.group_cache_spec)

    def placed(x):
      return jax.device_put(x, replicated)

  capacity = result.prompt_len + max_new_tokens
  if consume and result.capacity >= capacity:
    cache = result.model_cache  # generate's own: the steps donate and write into it
  else:
    cache = family.grown(result.model_cache, capacity)
  if group is not None:  # where the group's step reads it (a latent cache joined on one device)
    cache = jax.device_put(cache, placements(group, family.group_cache_spec))
  lengths_B = np.asarray(lengths_B, np.int32)

  def step(token_B, index, cache):
    return program(state, placed(token_B), placed(lengths_B + index), cache)

  return step, cache, placed(result.logits), placed(jax.random.key(seed))


HYBRID = OwnFamily(
  "hybrid",
  ("single", *hybrid_programs.STRATEGIES),
  hybrid.CACHES,
  hybrid.CACHE_SPECS,
  hybrid.prefill_planned,
  _grown_hybrid,
  hybrid.one_device_layout,
  lambda cache, T: cache._replace(kv_2BSKH=cache.kv_2BSKH[:, :, :, :T]),
  hybrid.sharded_hybrid_stepper,
  hybrid.one_rank_hybrid_parts,
  takes_split_as_data=True,
  stops_at_row_ends=True,
  compile=_compile_hybrid,
  check_split=hybrid.check_split,
  after_sharded_step=hybrid.after_hybrid_step,
)
LATENT = OwnFamily(
  "latent",
  ("single", *latent_programs.STRATEGIES),
  latent.CACHES,
  jax.P(),  # headless: whole on every shard
  latent.prefill_planned,
  _grown_latent,
  lambda config, cache, m: cache,
  lambda cache, T: cache[:, :, :T],
  latent.sharded_latent_stepper,
  latent.one_rank_latent_parts,
  takes_split_as_data=True,
  compile=_compile_latent,
)


def own_family(config) -> OwnFamily | None:
  """The family whose own programs run `config`'s model; None for a model of softmax
  attention layers alone (prefill's strategies run it)."""
  if any(isinstance(kind, GatedDeltaNetKind) for kind in config.kinds):
    return HYBRID
  if any(isinstance(kind, LatentAttentionKind) for kind in config.kinds):
    return LATENT
  return None
