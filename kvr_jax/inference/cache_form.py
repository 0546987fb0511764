"""What a model says of the past its layers keep: its `CacheForm`, the contract between the
one prefill path (`kvr_jax.inference.prefill.run_prefill`) and the model's cache.

Every model has one (`prefill_plan.cache_form_of`):
  kv       softmax attention layers alone (Llama, Mistral, Qwen, Gemma 3, Falcon, gpt-oss):
           K,V per layer, a window's ring where the prompt outgrew it
           (kvr_jax.inference.kv_form.FORM: a `KVWhole` / `KVParts` past)
  hybrid   Gated DeltaNet's fixed-size state and halo beside full layers' K,V (Qwen3.5,
           Qwen3-Next: kvr_jax.inference.hybrid.FORM)
  latent   one latent per position (DeepSeek-V3, Kimi K2, Moonlight:
           kvr_jax.inference.latent.FORM)
The last two keep the model's own cache (`ModelCacheForm`: an `OwnWhole` / `OwnParts` past,
the model's own decode step). Every form's result is a `results.PrefillResult`, which reads
its past through the form (`stepper`, `gather_cache`, ...). `run_prefill` runs the plan's
program and hands its outputs to the form, which places them as the plan's layout asks
(`in_parts`, `joined`), gives a padded row its last real token's logits
(`at_last_real_tokens`) and says what its one-rank prefill is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.inference import decode, steppers
from kvr_jax.inference.results import PrefillResult
from kvr_jax.runtime.mesh import (
  AXIS,
  global_array,
  model_parallel,
  piece_on,
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
  joined on the last rank; "sharded": left in the ranks' parts). operands(tokens_BT, ends_B):
  the program's tokens operand (where rows end before the prompt, what the past needs to
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
  # last rank can run (and be timed) apart (K,V: `KVForm.moved_to_last_rank`); else the
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

  def last_real_tokens_joined(self, run: PrefillRun, result):
    """cache="last", every form: one decode step of each row's last real token at its own
    position, by the model's own step where the cache lies (`stepper`: the last rank's
    device, or its model group on a 2-D mesh), written into the prefill's own cache (the
    causal prefill left every position before a row's end as that row alone gives it; the
    token's past entry, already in the cache, is written again identically). The padded
    positions after a row's end are overwritten by its decoded tokens before any query reads
    them."""
    step, cache, _, _ = result.stepper(run.model, run.lengths_B - 1, 0, 0, consume=True)
    logits_BV, cache = step(run.last_tokens_B, 0, cache)
    logits_BV = piece_on(logits_BV, result.device)  # a model group's: replicated over it
    past = self.with_decoded(result.past, cache)
    return dataclasses.replace(result, logits=logits_BV, past=past)

  def with_decoded(self, past, cache):
    """`past` holding `cache`, the decode cache a step over `decode_past`'s returned."""
    raise NotImplementedError  # pragma: no cover - interface

  # --- how a result reads its past (`PrefillResult`'s methods, each form's own) ------------

  def stepper(self, model, result, lengths_B, max_new_tokens, seed, consume=False):
    """decode_from's stepper for `result`'s past (kvr_jax.inference.steppers): cache="last"
    the one for every model (`steppers.last_rank_stepper`: the model's own decode step over
    `decode_past`), cache="sharded" too (`steppers.sharded_stepper`, over the form's
    `sharded_decode(model, result, max_new_tokens)` -> (program, inputs, caches): each
    form's parts read where they lie)."""
    if model.config != result.config:
      raise ValueError(
        f"this cache is a {result.config.architecture} model's ({self.name} cache); decode "
        "it with the model that made it"
      )
    if result.cache == "sharded":
      return steppers.sharded_stepper(model, result, max_new_tokens, seed)
    return steppers.last_rank_stepper(model, result, lengths_B, max_new_tokens, seed, consume)

  def decode_past(self, result, lengths_B, capacity: int, consume: bool):
    """cache="last": the model's own decode cache from `result`'s past, with room for
    `capacity` positions (lengths_B: each row's, placed where the cache decodes)."""
    raise NotImplementedError  # pragma: no cover - interface

  def decode_cache_spec(self, cache):
    """How `decode_past`'s cache lies over the last rank's model group (a PartitionSpec or a
    pytree of them, `cache`'s structure)."""
    raise NotImplementedError  # pragma: no cover - interface

  def after_decode(self, result, tail, consume: bool, max_new_tokens: int):
    """`result` after a decode from it: itself, its cache as the prefill left it (a decode
    that writes into a grown copy)."""
    del tail, consume, max_new_tokens
    return result

  def decode_cache(self, result):
    """The cache as decode reads it (`PrefillResult.decode_cache`)."""
    raise NotImplementedError  # pragma: no cover - interface

  def gather_cache(self, result):
    """The cache in one device's layout (`PrefillResult.gather_cache`)."""
    raise NotImplementedError  # pragma: no cover - interface

  def layer_cache(self, result, layer: int):
    """(K, V) of one layer (`PrefillResult.layer_cache`)."""
    raise NotImplementedError  # pragma: no cover - interface

  def moved_to_last_rank(self, result):
    """The result in parts as cache="last" (a form whose join runs apart: `joins_apart`)."""
    raise ValueError(
      f"a {self.name} cache is joined on the last rank inside its prefill: run it with "
      "move_cache=True"
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OwnWhole:
  """cache="last"'s past of a model with a cache of its own: `cache` is the model's (a
  hybrid's `HybridCache`: each full layer's K,V, each linear layer's state and halo; a latent
  model's [L, B, S, C] latents), S = capacity (the prompt and the room kept for decoding:
  `generate`'s new tokens, written there), on the last rank's device, or split over its model
  group on a 2-D mesh (`PrefillResult.decode_mesh`; by head, hybrid.CACHE_SPECS; a latent
  cache whole on each shard)."""

  cache: Any
  capacity: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OwnParts:
  """cache="sharded"'s past of a model with a cache of its own: each rank's part where the
  program left it, by rank [p, ...] (a latent model's latents [p, L, B, T_rank, C], a
  hybrid's full layers' K,V [p, L_full, 2, B*P, K, H] laid out as the result's cache_layout
  says). part_positions (latent models): the prompt position of each part's rows [p, T_rank]
  (-1: padding). linear_state (hybrids): the prompt's final linear states and halos on every
  rank."""

  parts: jax.Array
  part_positions: np.ndarray | None = None
  linear_state: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelCacheForm(CacheForm):
  """A form whose cache is the model's own (a hybrid's, a latent model's: an `OwnWhole` or
  `OwnParts` past), decoded by the model's own step; the hooks say how the program's outputs `out`
  (per rank [p, ...]) become it.

  group_cache_spec: how the joined cache lies over a model group (a PartitionSpec or a
  pytree of them). left_in_parts(out, plan) -> cache="sharded"'s `OwnParts` fields (and
  the parts' `cache_layout` where the form's own);
  joined_from_last_hop(out, plan, capacity) -> the cache of `capacity` positions from the
  last rank's outputs alone (KV-Runahead's kept last hops: no move); joined_from_parts(out,
  plan, capacity) -> the cache from every rank's parts moved onto the last rank in prompt
  order (None in a process without it). grown(cache, capacity) -> the cache with room for
  `capacity` positions (a fresh buffer: the decode steps donate theirs).
  sharded_decode(model, result, max_new_tokens) -> (the form's sharded step program, its
  read-only inputs, its first caches): what `steppers.sharded_stepper` runs."""

  group_cache_spec: Any
  left_in_parts: Callable
  joined_from_last_hop: Callable
  joined_from_parts: Callable
  grown: Callable
  one_device_layout: Callable  # (config, cache split over m, m) -> one device's layout
  prompt_part: Callable  # (cache, T) -> its first T positions (the room for decoding cut)
  sharded_decode: Callable
  # (a one-rank prefill's cache, T, its mesh) -> cache="sharded"'s OwnParts fields
  one_rank_parts: Callable
  # (result, the caches the sharded step returned) -> the past's fields that the step of
  # a padded row's last real token changed (`at_last_real_tokens`).
  after_sharded_step: Callable = lambda result, caches: {}

  def _result(self, run: PrefillRun, logits_BV, past=None, **fields) -> PrefillResult:
    plan = run.plan
    fields.setdefault("cache_layout", plan.cache_layout)
    return PrefillResult(
      logits=logits_BV,
      **result_fields(plan, run.lengths_B),
      cache=plan.cache,
      past=past,
      form=self,
      mesh=plan.mesh,
      config=run.model.config,
      **fields,
    )

  def _whole(self, run: PrefillRun, logits_BV, cache, **fields) -> PrefillResult:
    """cache="last"'s result with the model's cache `cache` (None: another process's)."""
    past = None if cache is None else OwnWhole(cache, run.capacity)
    return self._result(run, logits_BV, past, **fields)

  def _in_parts(self, run: PrefillRun, logits_BV, fields: dict, **more) -> PrefillResult:
    """cache="sharded"'s result from the form's fields of it (`left_in_parts`'s): the parts'
    own layout where the form gives one (a hybrid's full layers'), else the plan's."""
    fields = dict(fields)
    layout = fields.pop("cache_layout", run.plan.cache_layout)
    return self._result(run, logits_BV, OwnParts(**fields), cache_layout=layout, **more)

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
    return self._in_parts(run, logits_BV, fields, replicated_logits=replicated)

  def joined(self, run: PrefillRun, logits_BV, out):
    plan = run.plan
    if logits_BV is None and plan.keep_last_hop:  # another process's rank is last
      return self._result(run, None)
    if plan.keep_last_hop:  # the last rank holds every position: its last hops and own chunk
      return self._whole(run, logits_BV, self.joined_from_last_hop(out, plan, run.capacity))
    cache = self.joined_from_parts(out, plan, run.capacity)  # every process sends its parts
    return self._whole(run, logits_BV, cache, moved=True)

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
      return self._in_parts(run, logits_BV, self.one_rank_parts(cache, plan.prompt_len, mesh))
    return self._whole(run, logits_BV, cache)

  def at_last_real_tokens(self, run: PrefillRun, result):
    """One decode step of each row's last real token at its own position, where the cache
    lies: cache="last" `last_real_tokens_joined`; cache="sharded" the form's sharded step
    with a one-token tail, every rank's part read up to the row's last token only (its copy
    there hidden), in every process that holds a rank; what the step changed that decoding
    reads next is kept (`after_sharded_step`: a hybrid's linear pasts, and the token's K,V
    written into its part, where the prefill, stopped before it, left other values)."""
    if result.past is None:  # held in another process
      return result
    lengths_B, last_tokens_B = run.lengths_B, run.last_tokens_B
    if result.cache == "last":
      return self.last_real_tokens_joined(run, result)
    mesh = result.mesh
    before_last = dataclasses.replace(result, lengths=lengths_B - 1)
    step, caches, _, _ = steppers.sharded_stepper(run.model, before_last, 1, 0)
    tokens_B = global_array(last_tokens_B.astype(np.int32), NamedSharding(mesh, jax.P()))
    replicated_BV, caches = step(tokens_B, 0, caches)
    changed = self.after_sharded_step(before_last, caches)
    result = dataclasses.replace(result, past=dataclasses.replace(result.past, **changed))
    owner = rank_device(mesh, mesh.shape[AXIS] - 1)
    logits_BV = None  # on the last rank's device, in its process
    if owner.process_index == jax.process_index():
      logits_BV = jax.device_put(replicated_BV.addressable_shards[0].data, owner)
    replicated = replicated_BV if spans_processes(mesh) else None
    return dataclasses.replace(result, logits=logits_BV, replicated_logits=replicated)

  # --- how a result reads its past ---------------------------------------------------------

  def check_held(self, result) -> None:
    """Refuses a cache="last" result without its cache, by why."""
    if result.cache == "last" and result.past is None:
      raise ValueError(
        "this result holds no cache: its prefill left it where the program put it "
        "(run_prefill(move_cache=False)), or another process's rank is last and holds it"
      )

  def decode_past(self, result, lengths_B, capacity: int, consume: bool):
    """The model's cache grown to `capacity` (a fresh buffer: the steps donate theirs), or
    generate's own, written in place where it has the room (`consumed_by`)."""
    del lengths_B  # a model's own cache holds its rows' lengths as written
    self.check_held(result)
    if self.consumed_by(result, consume, capacity - result.prompt_len):
      return result.past.cache  # generate's own: the steps donate and write into it
    return self.grown(result.past.cache, capacity)

  def decode_cache_spec(self, cache):
    del cache
    return self.group_cache_spec

  def with_decoded(self, past: OwnWhole, cache) -> OwnWhole:
    return dataclasses.replace(past, cache=cache)

  def consumed_by(self, result, consume: bool, max_new_tokens: int) -> bool:
    """Whether a decode of `max_new_tokens` writes into `result`'s cache itself (generate's
    own, made with the room: consume), its buffer donated to the steps, not into a grown
    copy."""
    if not consume or result.cache != "last" or result.past is None:
      return False
    return result.past.capacity >= result.prompt_len + max_new_tokens

  def after_decode(self, result, tail, consume: bool, max_new_tokens: int):
    """Where the decode consumed the result's cache (`consumed_by`): the result with the last
    step's cache (the prompt's positions and the fed tokens'), the prefill's buffer being
    donated; else the result itself."""
    if self.consumed_by(result, consume, max_new_tokens):
      return dataclasses.replace(result, past=dataclasses.replace(result.past, cache=tail))
    return result

  def gather_cache(self, result):
    """The cache (cache="last") as the model's own one-device forward lays it out, on the
    last rank's first device: a hybrid's split over a model group put back in order
    (`hybrid.one_device_layout`); a latent cache as it is."""
    if result.cache != "last":
      raise ValueError(f"gather_cache reads cache='last'; this prefill ran cache={result.cache!r}")
    self.check_held(result)
    # The prompt's positions (not the room kept for decoding), through the host: a group's
    # arrays are typed with its mesh's axes, which one device lacks.
    cache = jax.tree.map(lambda a: jax.device_put(np.asarray(a), result.device), result.past.cache)
    cache = self.one_device_layout(result.config, cache, model_parallel(result.mesh))
    return self.prompt_part(cache, result.prompt_len)

  def layer_cache(self, result, layer: int):
    """Refused: a hybrid's or latent model's cache is not one (K, V) per layer."""
    raise ValueError(
      f"a {self.name} model's cache is its own form, not (K, V) per layer: read gather_cache()"
    )

  def decode_cache(self, result):
    """Refused as `layer_cache` is: its decode reads the past itself
    (`CausalLM.decode_step` overridden: `steppers.last_rank_stepper`)."""
    return self.layer_cache(result, 0)


def padded_positions(array, axis: int, capacity: int):
  """`array` with room for `capacity` positions on `axis` (never fewer than it has)."""
  pad = [(0, 0)] * array.ndim
  pad[axis] = (0, max(capacity - array.shape[axis], 0))
  return jnp.pad(array, pad)
