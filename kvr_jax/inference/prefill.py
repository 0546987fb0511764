"""`prefill`: one API over every registered strategy (kvr_jax.strategies).

Every input is validated here, before anything is traced or compiled; then the strategy lays
the tokens out over the mesh, its compiled program runs, and the rank that holds the cache
hands the result over on its own device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.inference import buckets as buckets_lib
from kvr_jax.inference import decode, sharded_decode
from kvr_jax.inference.prefill_plan import PrefillPlan, plan_from_shape
from kvr_jax.inference.results import CacheParts, ModelCache, PrefillResult, WholeCache
from kvr_jax.inference.shape import PrefillShape
from kvr_jax.planning.partition import (
  PartitionPlan,
)
from kvr_jax.runtime.loading import Model
from kvr_jax.runtime.mesh import (
  AXIS,
  global_array,
  model_parallel,
  rank_device,
  shard_on,
  spans_processes,
)
from kvr_jax.strategies import get_strategy, single
from kvr_jax.strategies.base import AUTO, last_rank
from models.kernels import get_kernel


def prefill_arguments(strategy: str, *, mesh=None, partition: Any = None, attention=None):
  """The `prefill` keyword arguments for `strategy`: the mesh always, the partition only for a
  partitioned strategy, the attention kernel named (None or "auto": each strategy's own
  choice); strategy="auto": only a PartitionPlan (the hardware and links it plans for). A
  kernel the strategy does not run is refused, except by TSP, which is dense by definition
  and keeps its dense kernel (shown in every report)."""
  if strategy == AUTO:
    # The cost model chooses the strategy, its split and its kernel: a plan's hardware and
    # links are what it plans for; lengths or a method name of the user's are another
    # strategy's (kvr's) and are not passed.
    plan = partition if isinstance(partition, PartitionPlan) else None
    return {"strategy": AUTO, "mesh": mesh, "partition": plan}
  spec = get_strategy(strategy)
  kwargs: dict[str, Any] = {"strategy": strategy, "mesh": mesh}
  if spec.partitioned:
    kwargs["partition"] = partition
  if attention is not None and attention != AUTO:
    kernel = get_kernel(attention)  # refuses an unknown kernel
    if kernel.name in spec.attention_kinds:
      kwargs["attention"] = attention
    elif not spec.fixed_kernel:  # TSP keeps its dense kernel
      spec.check_attention(attention)  # raises, naming what it runs and why
  return kwargs


def prefill(
  model: Model,
  tokens,
  strategy: str = "single",
  mesh=None,
  partition: Any = None,
  attention: str | None = None,
  cache: str = "auto",
  buckets=None,
) -> PrefillResult:
  """Runs the prompt phase and returns each row's last-position logits and the KV cache:
  `run_prefill(model, plan_prefill(model, tokens, ...), tokens)`. A model with its own
  cache form (a hybrid, Qwen3.5; latent attention, DeepSeek-V3: inference.cache_form) runs
  its programs under the same arguments and returns a `ModelCache` (a `PrefillResult` whose
  cache is in the model's own form):
  strategies "single", "kvr", "ring", "allgather" (and "tsp" on latent models) or "auto",
  cache "auto", "last" or "sharded", buckets and ragged batches as on any model (a
  hybrid's linear layers stop each padded row's state at its end).

  tokens: [B, T] (or [T]) token ids, or a list of rows of different lengths (a ragged
    batch: each row is padded at its end, see `buckets`; `lengths` in the result).
  buckets: None (exact shapes: one program per prompt length; a ragged batch is padded to
    its longest row), "auto" (kvr_jax.inference.buckets: the prompt is padded up to the
    default ladder's length, so that every length in a bucket shares one program) or an
    increasing sequence of lengths. Padded rows get their last real token's logits from one
    decode step at its position, run after the prefill program (part of the call).
  strategy: a name in kvr_jax.strategies.STRATEGIES: "single" (one device, the oracle),
    "tsp" (all-gather baseline) or "kvr" (KV-Runahead), or a `Strategy` (a variant outside
    the registry, e.g. runahead.PER_RANK_STRATEGY). mesh: from `make_mesh(p)`; default
    all local devices ("single" runs on its first device of this process). A mesh from
    `make_mesh(p, model=m)` makes every rank m devices sharing each layer (tensor
    parallelism, kvr_jax.runtime.tensor_parallel; "single" runs on the first rank's row): the
    prefill runs in either cache layout, heads split over "model" (`generate` decodes on the
    last rank's row); buckets and timelines are refused there so far.
  partition (partitioned strategies, i.e. kvr): p chunk lengths summing to T (rank 0 the
    earliest tokens), or "even", "search", "balanced", "predict", or a `PartitionPlan` (see
    kvr_jax.planning.partition). On a hybrid model also one per layer kind,
    {"linear": .., "full": ..}: the full layers on their own split, the hidden states moved
    between the two at each full layer (strategies.kind_program.KindSplit; the result's
    `full_partition`). There "search" (modelled) searches the pair
    (`search.kind_split_search`) and gives the full layers their own split where that
    models faster; `full_partition` is None where it kept one split.
  attention: the kernel; "auto" (or None, the default) is the fastest exact kernel this
    strategy runs on the mesh's platform (strategies.base.AUTO_KERNELS: "cudnn" on NVIDIA GPUs
    in bfloat16/float16 without a sliding window, else "flash"; TSP is dense by definition).
    "flash": online softmax over key blocks, fully masked blocks skipped, no score matrix in
    memory; "dense": each rank's whole query x key rectangle, masked (the paper's
    accounting); "blocked": query blocks over the keys up to their last query; "fused": the
    prefix and the causal diagonal as two pieces merged by their float32 log-sum-exp (XLA);
    "cudnn": the same two pieces in cuDNN's fused flash kernel.
  cache: "auto" (the default: "last" where the last rank's device holds the weights and the
    whole cache within kv_cache.WHOLE_CACHE_SHARE of its memory, each layer's past as its
    kind holds it (K,V, a window's ring, a latent, a linear state), else "sharded"; the
    result's `cache` says which, the same on every process), "last" (the paper's layout:
    the whole cache in prompt order on the last rank's device; moving the ranks' parts there
    is part of the call) or "sharded" (each rank keeps the part it computed; `generate`
    decodes from it where it lies, on every process). See PrefillResult.
  """
  plan = plan_prefill(model, tokens, strategy, mesh, partition, attention, cache, buckets)
  return run_prefill(model, plan, tokens)


def plan_prefill(
  model: Model,
  tokens,
  strategy: str = "single",
  mesh=None,
  partition: Any = None,
  attention: str | None = None,
  cache: str = "auto",
  buckets=None,
  timeline: bool = False,
) -> PrefillPlan:
  """The `PrefillPlan` of `prefill(model, tokens, ...)` (the same arguments), every argument
  checked; nothing compiles or runs. tokens may be the prompt or any prompt of its shape.
  timeline: the program places probes at its phase boundaries (strategies with
  `timeline_probes`: kvr, ring, allgather); kvr_jax.tools.timeline reads them."""
  if not isinstance(model, Model):
    raise ValueError(f"`model` must come from kvr_jax.load_model, got {type(model).__name__}")
  rows, lengths_B, T, buckets = buckets_lib.padded_prompts(model, tokens, buckets)
  shape = PrefillShape.of_model(model, lengths_B, T)
  return plan_from_shape(
    shape, strategy, mesh, partition, attention, cache, buckets=buckets, timeline=timeline
  )


def _hop_holds_rows(config, chunks, lengths_B) -> bool:
  """Whether KV-Runahead's last hop and the last chunk hold what every row decodes from. A
  windowed layer's hop carries only the W-1 keys before the last chunk (the prompt's last
  window): a row that ends at or before that chunk's start (a padded row) reads keys before
  them, so the parts move for that run. Layers whose hop carries the whole prefix hold any
  row."""
  hop_end = sum(chunks[:-1])
  whole = all(kind.hop_keeps_whole_prefix(hop_end) for kind in config.kinds)
  return whole or int(np.min(lengths_B)) > hop_end


def run_prefill(
  model: Model, plan: PrefillPlan, tokens, move_cache: bool = True, decode_room: int = 0
):
  """Runs `plan` on `tokens` (a prompt of the plan's padded length and batch) and returns
  its `PrefillResult` (a `ModelCache` for a model with its own programs, its cache with room
  for `decode_room` more positions; a K,V cache grows when decode starts). move_cache=False:
  with cache="last", return as soon as the program's outputs exist, laid out as
  cache="sharded" (plus KV-Runahead's `last_hop`); `gather_cache()` then brings the cache onto
  the last rank (what kvr_jax.tools.timing times apart)."""
  tokens_BT, lengths_B = _planned_rows(model, plan, tokens)
  T = tokens_BT.shape[1]
  if plan.cache_form is not None:  # a hybrid's or latent model's own cache form
    return _run_model_cache(model, plan, tokens_BT, lengths_B, decode_room, move_cache)
  B, padded = plan.batch, bool((lengths_B < T).any())
  if padded and not plan.padded:
    raise ValueError("these prompts are padded past their lengths, the plan's were not: plan them")
  mesh, chunks, cache = plan.mesh, plan.chunks, plan.cache
  if not any(d.process_index == jax.process_index() for d in mesh.devices.flat):
    return _held_elsewhere(plan, lengths_B, move_cache)
  state = model.state_for(mesh)
  logits, outputs = _run_program(model, plan, tokens_BT)
  kv_parts = outputs["kv"]
  last_hop = None
  if plan.keep_last_hop:
    kv_parts, last_hop = kv_parts
    if not _hop_holds_rows(model.config, chunks, lengths_B):
      last_hop = None  # a row's window lies before the windowed layers' last hop: move
  layout = plan.cache_layout
  owner = rank_device(mesh, last_rank(chunks))
  logits_BV = shard_on(logits, owner)
  common = dict(_result_fields(plan, lengths_B), kv_heads=model.config.num_kv_heads)
  # A padded row's last real token is not at position T - 1: its logits come from one decode
  # step at its own position (its K,V, already in the cache, are written again identically).
  last_tokens_B = tokens_BT[np.arange(B), lengths_B - 1]
  if cache == "sharded" or not move_cache:
    replicated = None
    if padded:
      replicated = sharded_decode.last_real_logits_sharded(
        model, state, mesh, layout, kv_parts, last_tokens_B, lengths_B
      )
      logits_BV = _piece_on(replicated, owner)
    elif cache == "sharded" and spans_processes(mesh):
      replicated = decode.from_last_rank(mesh, ranked=True)(logits)
    # In one process the owner's logits are every process's.
    replicated = replicated if spans_processes(mesh) else None
    parts = dict(kv_parts=kv_parts, mesh=mesh, last_hop=last_hop, replicated_logits=replicated)
    kept = decode.DecodeLayout.of(model.config, T)
    if cache == "sharded" and kept.rings != (None,):
      # A window the prompt outgrew: its layers keep only their rings from here on (what
      # decode reads), the parts only the other layers.
      program = sharded_decode.sharded_rings_program(mesh, layout, kept)
      lengths = global_array(np.asarray(lengths_B, np.int32), NamedSharding(mesh, jax.P()))
      parts["kv_parts"], rings = program(kv_parts, lengths)
      parts.update(kept=kept, rings=rings)
    return CacheParts(logits_BV, **common, **parts)
  parts = CacheParts(logits_BV, **common, kv_parts=kv_parts, mesh=mesh, last_hop=last_hop)
  whole = parts.moved_to_last_rank(model.config)
  if padded and whole.k_layers is not None:
    logits_BV, caches = decode.last_real_logits(model, *whole.groups(), last_tokens_B, lengths_B)
    whole = whole.with_groups(logits_BV, caches)
  elif padded:  # another process holds the cache and the logits
    whole = dataclasses.replace(whole, logits=None)
  return whole


def _planned_rows(model: Model, plan: PrefillPlan, tokens) -> tuple[np.ndarray, np.ndarray]:
  """`tokens` padded as `plan` runs them ([B, T] and each row's length), refused where the
  plan was made for other prompts."""
  if not isinstance(plan, PrefillPlan):
    raise ValueError(
      f"run_prefill takes the PrefillPlan that plan_prefill returns, got {type(plan).__name__}"
    )
  rows, lengths_B, T, _ = buckets_lib.padded_prompts(model, tokens, plan.buckets)
  if (T, len(rows)) != (plan.prompt_len, plan.batch):
    raise ValueError(
      f"this plan runs {plan.batch} row(s) padded to {plan.prompt_len} tokens; these prompts "
      f"are {len(rows)} row(s) padded to {T}: plan them with plan_prefill"
    )
  return buckets_lib.pad_rows(rows, T), lengths_B


def _result_fields(plan: PrefillPlan, lengths_B) -> dict:
  """The fields every `PrefillResult` of `plan` has, whichever its layout."""
  return dict(
    prompt_len=plan.prompt_len,
    strategy=plan.strategy.name,
    partition=plan.partition,
    cache_layout=plan.cache_layout,
    attention=plan.kernel.name,
    lengths=lengths_B,
    choice=plan.choice,
    full_partition=plan.full_chunks,
  )


def _held_elsewhere(plan: PrefillPlan, lengths_B, move_cache: bool) -> PrefillResult:
  """The result in a process that holds no device of the plan's mesh (auto's pick of one
  device runs in the last rank's process alone): its layout, no logits, no cache."""
  common = _result_fields(plan, lengths_B)
  if plan.cache == "sharded" or not move_cache:
    return CacheParts(None, **common, kv_parts=None, mesh=plan.mesh)
  return WholeCache(None, **common, k_layers=None, v_layers=None)


def _piece_on(array: jax.Array, device):
  """`device`'s copy of a replicated array as a single-device array; None where `device` is
  another process's."""
  piece = next((s.data for s in array.addressable_shards if s.device == device), None)
  if piece is None:
    return None
  return jax.device_put(piece, jax.sharding.SingleDeviceSharding(device))


def _run_model_cache(
  model, plan, tokens_BT: np.ndarray, lengths_B: np.ndarray, room: int = 0, join: bool = True
) -> ModelCache:
  """`run_prefill` of a model whose cache has its own form (`plan.cache_form`, which the
  plan checked: `CacheForm.check_plan`): the form's program; "single" is the model's own
  forward on the plan's one device (its model group on a 2-D mesh). room: positions the
  cache keeps for decoding. join=False
  (`run_prefill(move_cache=False)`, what a benchmark times): with cache="last", return once
  the last rank's logits exist, the program's outputs left where it put them (no cache in the
  result: KV-Runahead's last rank holds the whole cache there already, the peers' is spread
  over their ranks). A process that holds no device of the mesh (auto's pick of one
  device in another process) gets no logits and no cache."""
  form = plan.cache_form
  padded = bool((lengths_B < plan.prompt_len).any())
  if padded and not join and plan.cache == "last":
    raise ValueError(
      f"move_cache=False runs a {form.name} model's rows of one length: these are padded "
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
    form=form,
    mesh=mesh,
    config=model.config,
    choice=plan.choice,
    full_partition=plan.full_chunks,
  )
  if not any(d.process_index == jax.process_index() for d in mesh.devices.flat):
    return ModelCache(None, **fields)
  ends_B = lengths_B - 1 if padded and form.stops_at_row_ends else None
  if spec.max_ranks == 1:
    result = _one_group_prefill(model, plan, form, tokens_BT, room, ends_B, fields)
  else:
    result = ModelCache(**prefill_outputs(model, plan, tokens_BT, room, ends_B, join), **fields)
  held = result.model_cache is not None or result.parts is not None
  if padded and held:
    result = _at_last_real_tokens(model, result, tokens_BT, lengths_B)
  return result


def prefill_outputs(model, plan, tokens_BT, room: int, ends_B, join: bool) -> dict:
  """The plan's program (`PrefillPlan.compile`) on tokens_BT [B, T] (each
  row's prefill end `ends_B` where rows are padded: `CacheForm.operands`), and the
  `ModelCache` fields of what it made: logits [B, V] on the last rank's device (None in
  another process), and the cache joined there with room for `room` more positions (from
  KV-Runahead's kept last hops without a move, else from the parts moved there: `moved`), or
  left in the ranks' parts (cache="sharded"; across processes the logits replicated
  everywhere: every process decodes), or neither (join=False: the outputs left where the
  program put them, `run_prefill(move_cache=False)`)."""
  form, mesh, chunks = plan.cache_form, plan.mesh, plan.chunks
  rows = form.operands(tokens_BT, ends_B, model_parallel(mesh))
  logits_pBV, out = _run_program(model, plan, rows, padded=isinstance(rows, tuple))
  logits_BV = shard_on(logits_pBV, rank_device(mesh, last_rank(chunks)))  # None elsewhere
  if logits_BV is None:  # another process's rank is last: this one returns when its part is done
    jax.block_until_ready(out)
  if plan.cache == "sharded":  # nothing moves
    replicated = None
    if spans_processes(mesh):
      replicated = decode.from_last_rank(mesh, ranked=True)(logits_pBV)
    return dict(logits=logits_BV, replicated_logits=replicated, **form.left_in_parts(out, plan))
  if not join or (logits_BV is None and plan.keep_last_hop):
    return dict(logits=logits_BV)
  capacity = plan.prompt_len + room
  if plan.keep_last_hop:  # the last rank holds every position: its last hops and own chunk
    return dict(logits=logits_BV, model_cache=form.joined_from_last_hop(out, plan, capacity))
  cache = form.joined_from_parts(out, plan, capacity)  # every process sends its parts
  return dict(logits=logits_BV, model_cache=cache, moved=True)  # both None without the last rank


def _run_program(model, plan, rows, padded: bool = False):
  """(logits [p, B, V], the program's other outputs): the plan's program (`PrefillPlan.compile`)
  on `rows` (tokens [B, T], or a tuple of [B, T] operands) laid out by rank as its strategy
  arranges them, every model's."""
  by_rank = NamedSharding(plan.mesh, jax.P(AXIS))
  arranged = jax.tree.map(
    lambda a: global_array(plan.strategy.arrange(a, plan.chunks), by_rank), rows
  )
  return plan.compile(model.graphdef, padded)(model.state_for(plan.mesh), arranged)


def _one_group_prefill(model, plan, form, tokens_BT, room, ends_B, fields) -> ModelCache:
  """strategy="single": the model's own forward on the plan's one device (its model group on
  a 2-D mesh), its cache joined there or, for cache="sharded", as the one rank's part.
  ends_B: each row's prefill end (`CacheForm.stops_at_row_ends`), None for the whole rows."""
  mesh = plan.mesh
  forward = single.one_group_forward(
    model.graphdef,
    mesh,
    plan.kernel,  # the record: a kernel given with its own block sizes runs with them
    form.group_cache_spec,
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
    parts = form.one_rank_parts(cache, plan.prompt_len, mesh)
    return ModelCache(logits_BV, **fields, **parts)
  return ModelCache(logits_BV, **fields, model_cache=cache)


def _at_last_real_tokens(model, result: ModelCache, tokens_BT, lengths_B) -> ModelCache:
  """A padded batch's result with each row's logits at its last real token: one decode step of
  that token at its own position, where the cache lies (the causal prefill left every
  position before a row's end as that row alone gives it; the token's past entry, already in
  the cache, is written again identically). The padded positions after a row's end are
  overwritten by its decoded tokens before any query reads them. cache="sharded": the
  form's sharded step with a one-token tail, every rank's part read up to the row's last
  token only (its copy there hidden), in every process that holds a rank; what the step
  changed that decoding reads next is kept (`CacheForm.after_sharded_step`: a hybrid's
  linear pasts, and the token's K,V written into its part, where the prefill, stopped
  before it, left other values)."""
  last_tokens_B = np.asarray(tokens_BT)[np.arange(len(lengths_B)), lengths_B - 1]
  if result.cache == "last":
    step, cache, _, _ = result.stepper(model, lengths_B - 1, 0, 0, consume=True)
    logits_BV, cache = step(last_tokens_B, 0, cache)
    logits_BV = jax.device_put(logits_BV, result.device)
    return dataclasses.replace(result, logits=logits_BV, model_cache=cache)
  mesh = result.mesh
  before_last = dataclasses.replace(result, lengths=lengths_B - 1)
  step, caches, _, _ = result.form.sharded_stepper(model, before_last, 1, 0)
  tokens_B = global_array(last_tokens_B.astype(np.int32), NamedSharding(mesh, jax.P()))
  replicated_BV, caches = step(tokens_B, 0, caches)
  result = dataclasses.replace(result, **result.form.after_sharded_step(before_last, caches))
  owner = rank_device(mesh, mesh.shape[AXIS] - 1)
  logits_BV = None  # on the last rank's device, in its process
  if owner.process_index == jax.process_index():
    logits_BV = jax.device_put(replicated_BV.addressable_shards[0].data, owner)
  replicated = replicated_BV if spans_processes(mesh) else None
  return dataclasses.replace(result, logits=logits_BV, replicated_logits=replicated)
