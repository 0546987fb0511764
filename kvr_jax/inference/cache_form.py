"""What a model says of the past its layers keep: its `CacheForm`, the contract between the
one prefill path (`kvr_jax.inference.prefill.run_prefill`) and the model's cache.

Every model has one (`prefill_plan.cache_form_of`):
  kv       softmax attention layers alone (Llama, Mistral, Qwen, Gemma 3, Falcon, gpt-oss):
           K,V per layer, a window's ring where the prompt outgrew it
           (kvr_jax.inference.kv_form.FORM: `WholeCache` / `CacheParts` results)
  hybrid   Gated DeltaNet's fixed-size state and halo beside full layers' K,V (Qwen3.5,
           Qwen3-Next: kvr_jax.inference.hybrid.FORM)
  latent   one latent per position (DeepSeek-V3, Kimi K2, Moonlight:
           kvr_jax.inference.latent.FORM)
The last two keep the model's own cache (`ModelCacheForm`: a `ModelCache` result, the model's
own decode step). `run_prefill` runs the plan's program and hands its outputs to the form,
which places them as the plan's layout asks (`in_parts`, `joined`), gives a padded row its
last real token's logits (`at_last_real_tokens`) and says what its one-rank prefill is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.inference import decode
from kvr_jax.inference.results import ModelCache
from kvr_jax.runtime.mesh import (
  AXIS,
  global_array,
  model_parallel,
  rank_device,
  spans_processes,
)
from kvr_jax.strategies import REGISTRY, family_program, registered_record, single


@dataclasses.dataclass(frozen=True)
class PrefillRun:
  """One run of a plan, what a form's hooks read: the model, the plan, the rows as the plan
  runs them ([B, T] token ids, each row's true length [B]) and the positions a joined cache
  keeps for decoding past the prompt (`room`)."""

  model: Any
  plan: Any
  tokens_BT: np.ndarray
  lengths_B: np.ndarray
  room: int = 0

  @property
  def padded(self) -> bool:
    """Whether some row ends before the prompt does (a bucket, a ragged batch)."""
    return bool((self.lengths_B < self.plan.prompt_len).any())

  @property
  def capacity(self) -> int:
    return self.plan.prompt_len + self.room

  @property
  def last_tokens_B(self) -> np.ndarray:
    """Each row's last real token."""
    return np.asarray(self.tokens_BT)[np.arange(len(self.lengths_B)), self.lengths_B - 1]


def result_fields(plan, lengths_B) -> dict:
  """The fields every `PrefillResult` of `plan` has, whichever its form and layout."""
  return dict(
    prompt_len=plan.prompt_len,
    strategy=plan.strategy.name,
    partition=plan.partition,
    attention=plan.kernel.name,
    lengths=lengths_B,
    choice=plan.choice,
    full_partition=plan.full_chunks,
  )


def replicated_logits(plan, logits_pBV):
  """cache="sharded" over a mesh that spans processes: the last rank's logits [B, V] on every
  device (every process decodes its ranks' parts and samples the same tokens); else None."""
  if plan.cache == "sharded" and spans_processes(plan.mesh):
    return decode.from_last_rank(plan.mesh, ranked=True)(logits_pBV)
  return None


@dataclasses.dataclass(frozen=True)
class CacheForm:
  """One kind of past's contract with the prefill path (the base of `kv_form.KVForm` and
  `ModelCacheForm`).

  runs(record): whether its programs run a registered strategy's record (every one-rank
  record runs); `strategies` names them. caches: the layouts its decode reads ("last":
  joined on the last rank; "sharded": left in the ranks' parts). operands(tokens_BT, ends_B,
  m): the program's tokens operand (where rows end before the prompt, what the past needs to
  stop there)."""

  name: str
  runs: Callable
  caches: tuple[str, ...]
  operands: Callable
  # The layer kinds whose outputs the cache holds even where no layer of the model is of
  # them (a hybrid's full layers' K,V: empty, as decode reads it), beside the model's own
  # (`strategies.by_kind.compile_plan`, the plan's program).
  also_kinds: tuple = ()
  # Whether KV-Runahead's split as data runs (`runahead.split_as_data_strategy`'s record:
  # one program for every split that fits its envelope).
  takes_split_as_data: bool = True
  # Whether KV-Runahead takes a split per layer kind ({"linear": .., "full": ..}: a hybrid's
  # two kinds of layer balance on different splits, strategies.kind_program.KindSplit).
  splits_per_kind: bool = False
  # A fixed-size past that a row's padding would advance (a linear layer's state and halo,
  # where a causal K,V or latent past is written per position): the prefill of padded rows
  # stops it before each row's last real token, whose decode step then runs it from there.
  stops_at_row_ends: bool = False
  # (config, strategy record, T, p, the full layers' own chunks or None) -> None: what the
  # form's programs refuse of a split, by name, once the plan has made it.
  check_split: Callable | None = None
  # Whether run_prefill(move_cache=False) leaves the parts in a result whose join onto the
  # last rank can run (and be timed) apart (K,V: `CacheParts.moved_to_last_rank`); else the
  # join is part of the call.
  joins_apart: bool = False

  @property
  def strategies(self) -> tuple[str, ...]:
    """The registered strategies this form's programs run, by name (messages, tests)."""
    return tuple(name for name, record in REGISTRY.items() if self._runs(record))

  def _runs(self, record) -> bool:
    return record.max_ranks == 1 or self.runs(record)

  def check_layers(self, config) -> None:
    """What the form refuses of the model's layers before a plan is made (none here)."""

  def check_plan(self, config, spec, cache: str) -> None:
    """What a plan for this form runs, refused by name before anything compiles: its
    strategies and cache layouts. Timeline probes are the record's (`Strategy.timeline_probes`,
    checked by the plan for every model)."""
    what = f"a {config.architecture} model ({self.name} cache)"
    record, (_, _, split_shape) = registered_record(spec), family_program(spec)
    if record is None or not self._runs(record):
      raise ValueError(f"{what} runs under {list(self.strategies)}, not {spec.name!r}")
    if split_shape is not None and not self.takes_split_as_data:
      raise ValueError(f"{what} does not take KV-Runahead's split as data ({spec.name!r})")
    if cache not in self.caches:
      raise ValueError(f"{what} keeps its cache as {list(self.caches)}, not cache={cache!r}")

  def check_run(self, run: PrefillRun, deferred: bool) -> None:
    """What the form refuses of a run (`deferred`: run_prefill(move_cache=False) of
    cache="last"), before its program runs (nothing here)."""

  # --- the hooks of `run_prefill` (each form's own) ---------------------------------------

  def held_elsewhere(self, run: PrefillRun, deferred: bool):
    """The result in a process that holds no device of the plan's mesh (auto's pick of one
    device in another process): its layout, no logits, no cache."""
    raise NotImplementedError  # pragma: no cover - interface

  def one_rank_prefill(self, run: PrefillRun):
    """strategy="single"'s result where the form runs it outside the plan's program (the
    model's own forward), else None (the one-rank program runs)."""
    del run

  def in_parts(self, run: PrefillRun, logits_pBV, logits_BV, out, deferred: bool):
    """The result where the program's outputs `out` stay in the ranks' parts: cache="sharded",
    or `deferred` (the parts left for the caller to move: `gather_cache`)."""
    raise NotImplementedError  # pragma: no cover - interface

  def joined(self, run: PrefillRun, logits_BV, out):
    """cache="last"'s result: the cache joined on the last rank (KV-Runahead's kept last hops
    without a move where `plan.keep_last_hop`, else the parts moved there)."""
    raise NotImplementedError  # pragma: no cover - interface

  def at_last_real_tokens(self, run: PrefillRun, result):
    """A padded batch's result with each row's logits at its last real token."""
    raise NotImplementedError  # pragma: no cover - interface


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelCacheForm(CacheForm):
  """A form whose cache is the model's own (a hybrid's, a latent model's), a `ModelCache`
  result, decoded by the model's own step; the hooks say how the program's outputs `out`
  (per rank [p, ...]) become it.

  group_cache_spec: how the joined cache lies over a model group (a PartitionSpec or a
  pytree of them). left_in_parts(out, plan) -> cache="sharded"'s `ModelCache` fields;
  joined_from_last_hop(out, plan, capacity) -> the cache of `capacity` positions from the
  last rank's outputs alone (KV-Runahead's kept last hops: no move); joined_from_parts(out,
  plan, capacity) -> the cache from every rank's parts moved onto the last rank in prompt
  order (None in a process without it). grown(cache, capacity) -> the cache with room for
  `capacity` positions (a fresh buffer: the decode steps donate theirs).
  sharded_stepper(model, result, max_new_tokens, seed): decode from cache="sharded"
  (`steppers.model_cache_stepper`'s return)."""

  group_cache_spec: Any
  left_in_parts: Callable
  joined_from_last_hop: Callable
  joined_from_parts: Callable
  grown: Callable
  one_device_layout: Callable  # (config, cache split over m, m) -> one device's layout
  prompt_part: Callable  # (cache, T) -> its first T positions (the room for decoding cut)
  sharded_stepper: Callable
  # (a one-rank prefill's cache, T, its mesh) -> cache="sharded"'s ModelCache fields
  one_rank_parts: Callable
  # (result, the caches the sharded step returned) -> the result's fields that the step of
  # a padded row's last real token changed (`at_last_real_tokens`).
  after_sharded_step: Callable = lambda result, caches: {}

  def _result(self, run: PrefillRun, logits_BV, **fields) -> ModelCache:
    plan = run.plan
    return ModelCache(
      logits_BV,
      **result_fields(plan, run.lengths_B),
      cache=plan.cache,
      capacity=run.capacity,
      form=self,
      mesh=plan.mesh,
      config=run.model.config,
      **fields,
    )

  def check_run(self, run: PrefillRun, deferred: bool) -> None:
    if run.padded and deferred:
      raise ValueError(
        f"move_cache=False runs a {self.name} model's rows of one length: these are padded "
        "past their lengths, whose logits are read from the joined cache (move the cache, or "
        "give rows of one length)"
      )

  def held_elsewhere(self, run: PrefillRun, deferred: bool):
    del deferred
    return self._result(run, None)

  def in_parts(self, run: PrefillRun, logits_pBV, logits_BV, out, deferred: bool):
    if deferred:  # the outputs left where the program put them: no cache in the result
      return self._result(run, logits_BV)
    replicated = replicated_logits(run.plan, logits_pBV)
    fields = self.left_in_parts(out, run.plan)
    return self._result(run, logits_BV, replicated_logits=replicated, **fields)

  def joined(self, run: PrefillRun, logits_BV, out):
    plan = run.plan
    if logits_BV is None and plan.keep_last_hop:  # another process's rank is last
      return self._result(run, None)
    if plan.keep_last_hop:  # the last rank holds every position: its last hops and own chunk
      cache = self.joined_from_last_hop(out, plan, run.capacity)
      return self._result(run, logits_BV, model_cache=cache)
    cache = self.joined_from_parts(out, plan, run.capacity)  # every process sends its parts
    return self._result(run, logits_BV, model_cache=cache, moved=True)

  def one_rank_prefill(self, run: PrefillRun):
    """strategy="single": the model's own forward on the plan's one device (its model group
    on a 2-D mesh), its cache joined there or, for cache="sharded", as the one rank's part."""
    plan, model = run.plan, run.model
    mesh, padded = plan.mesh, run.padded and self.stops_at_row_ends
    forward = single.one_group_forward(
      model.graphdef,
      mesh,
      plan.kernel,  # the record: a kernel given with its own block sizes runs with them
      self.group_cache_spec,
      run.capacity,
      padded,
    )
    ends = (np.asarray(run.lengths_B - 1, np.int32),) if padded else ()
    if model_parallel(mesh) > 1:
      state = model.state_split_over(mesh)
      operands = jax.device_put((run.tokens_BT, *ends), NamedSharding(mesh, jax.P()))
    else:  # one device, its arrays placed on it alone (no mesh axis in their types)
      device = mesh.devices.flat[0]
      state, operands = model.state_on(device), jax.device_put((run.tokens_BT, *ends), device)
    logits_BV, cache = forward(state, *operands)
    logits_BV = jax.device_put(logits_BV, rank_device(mesh, 0))
    if plan.cache == "sharded":  # the cache as the one rank's part
      return self._result(run, logits_BV, **self.one_rank_parts(cache, plan.prompt_len, mesh))
    return self._result(run, logits_BV, model_cache=cache)

  def at_last_real_tokens(self, run: PrefillRun, result):
    """One decode step of each row's last real token at its own position, where the cache
    lies (the causal prefill left every position before a row's end as that row alone gives
    it; the token's past entry, already in the cache, is written again identically). The
    padded positions after a row's end are overwritten by its decoded tokens before any query
    reads them. cache="sharded": the form's sharded step with a one-token tail, every rank's
    part read up to the row's last token only (its copy there hidden), in every process that
    holds a rank; what the step changed that decoding reads next is kept
    (`after_sharded_step`: a hybrid's linear pasts, and the token's K,V written into its
    part, where the prefill, stopped before it, left other values)."""
    if result.model_cache is None and result.parts is None:  # held in another process
      return result
    lengths_B, last_tokens_B = run.lengths_B, run.last_tokens_B
    if result.cache == "last":
      step, cache, _, _ = result.stepper(run.model, lengths_B - 1, 0, 0, consume=True)
      logits_BV, cache = step(last_tokens_B, 0, cache)
      logits_BV = jax.device_put(logits_BV, result.device)
      return dataclasses.replace(result, logits=logits_BV, model_cache=cache)
    mesh = result.mesh
    before_last = dataclasses.replace(result, lengths=lengths_B - 1)
    step, caches, _, _ = self.sharded_stepper(run.model, before_last, 1, 0)
    tokens_B = global_array(last_tokens_B.astype(np.int32), NamedSharding(mesh, jax.P()))
    replicated_BV, caches = step(tokens_B, 0, caches)
    result = dataclasses.replace(result, **self.after_sharded_step(before_last, caches))
    owner = rank_device(mesh, mesh.shape[AXIS] - 1)
    logits_BV = None  # on the last rank's device, in its process
    if owner.process_index == jax.process_index():
      logits_BV = jax.device_put(replicated_BV.addressable_shards[0].data, owner)
    replicated = replicated_BV if spans_processes(mesh) else None
    return dataclasses.replace(result, logits=logits_BV, replicated_logits=replicated)


def padded_positions(array, axis: int, capacity: int):
  """`array` with room for `capacity` positions on `axis` (never fewer than it has)."""
  pad = [(0, 0)] * array.ndim
  pad[axis] = (0, max(capacity - array.shape[axis], 0))
  return jnp.pad(array, pad)
