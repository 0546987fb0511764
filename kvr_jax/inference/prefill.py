"""`prefill`: one API over every registered strategy (kvr_jax.strategies).

Every input is validated here, before anything is traced or compiled; then the strategy lays
the tokens out over the mesh, its compiled program runs, and the rank that holds the cache
hands the result over on its own device.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.inference import buckets as buckets_lib
from kvr_jax.inference.cache_form import PrefillRun
from kvr_jax.inference.prefill_plan import PrefillPlan, plan_from_shape
from kvr_jax.inference.results import PrefillResult
from kvr_jax.inference.shape import PrefillShape
from kvr_jax.planning.partition import (
  PartitionPlan,
)
from kvr_jax.runtime.loading import Model
from kvr_jax.runtime.mesh import (
  AXIS,
  global_array,
  rank_device,
  shard_on,
)
from kvr_jax.strategies import get_strategy
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
  its programs under the same arguments, its result's past in the model's own form
  (`cache_form.OwnWhole` / `OwnParts`):
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


def run_prefill(
  model: Model, plan: PrefillPlan, tokens, move_cache: bool = True, decode_room: int = 0
):
  """Runs `plan` on `tokens` (a prompt of the plan's padded length and batch) and returns
  its `PrefillResult`, one path for every model: the plan's program, then its outputs placed
  by the model's cache form (`plan.cache_form`: inference.cache_form) as the plan's layout
  asks, and a padded row's logits from one decode step of its last real token. A model with
  its own cache (a hybrid, a latent model) keeps room for `decode_room` more positions in
  it (a K,V cache grows when decode starts). move_cache=False: with cache="last", return as
  soon as the program's outputs exist (what kvr_jax.tools.timing times apart): a K,V cache
  laid out as cache="sharded" (plus KV-Runahead's `last_hop`), whose `moved_to_last_rank()`
  then brings it onto the last rank; a model's own cache is not joined at all (the result
  has the logits alone)."""
  tokens_BT, lengths_B = _planned_rows(model, plan, tokens)
  run = PrefillRun(model, plan, tokens_BT, lengths_B, decode_room)
  form, deferred = plan.cache_form, not move_cache and plan.cache == "last"
  if run.padded and not plan.padded:
    raise ValueError("these prompts are padded past their lengths, the plan's were not: plan them")
  form.check_run(run, deferred)
  if not any(d.process_index == jax.process_index() for d in plan.mesh.devices.flat):
    return form.held_elsewhere(run, deferred)
  result = form.one_rank_prefill(run) if plan.strategy.max_ranks == 1 else None
  if result is None:
    result = program_result(run, deferred)
  return form.at_last_real_tokens(run, result) if run.padded else result


def program_result(run: PrefillRun, deferred: bool = False, ends_B=None):
  """The plan's program (`PrefillPlan.compile`) on the run's rows, and its outputs placed by
  the form: left in the ranks' parts (cache="sharded", or `deferred`) or joined on the last
  rank. ends_B: where each row's past stops (`CacheForm.operands`), by default a padded
  row's last real token where the form stops there (`CacheForm.stops_at_row_ends`)."""
  plan, form = run.plan, run.plan.cache_form
  if ends_B is None and run.padded and form.stops_at_row_ends:
    ends_B = run.lengths_B - 1
  rows = form.operands(run.tokens_BT, ends_B)
  logits_pBV, out = _run_program(run.model, plan, rows, padded=isinstance(rows, tuple))
  logits_BV = shard_on(logits_pBV, rank_device(plan.mesh, last_rank(plan.chunks)))
  if logits_BV is None:  # another process's rank is last: this one returns when its part is done
    jax.block_until_ready(out)
  if plan.cache == "sharded" or deferred:
    return form.in_parts(run, logits_pBV, logits_BV, out, deferred)
  return form.joined(run, logits_BV, out)


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


def _run_program(model, plan, rows, padded: bool = False):
  """(logits [p, B, V], the program's other outputs): the plan's program (`PrefillPlan.compile`)
  on `rows` (tokens [B, T], or a tuple of [B, T] operands) laid out by rank as its strategy
  arranges them, every model's."""
  by_rank = NamedSharding(plan.mesh, jax.P(AXIS))
  arranged = jax.tree.map(
    lambda a: global_array(plan.strategy.arrange(a, plan.chunks), by_rank), rows
  )
  return plan.compile(model.graphdef, padded)(model.state_for(plan.mesh), arranged)
