"""Partition plans: how many prompt tokens each rank takes, chosen by method or given.

Resolves "even" (KVR-E), "search" (KVR-S over the modelled TTFT), "balanced" and "predict"
(KVR-P) into chunk lengths with the cost model; on a hybrid model "search" also gives the full
layers their own split where that models faster (`resolve_kind_split`). A search over
*measured* TTFT runs prefills, so it lives above them: kvr_jax.tools.measured.
"""

from __future__ import annotations

import dataclasses

from kvr_jax.core.caches import kept_cache
from kvr_jax.core.chunks import check_chunks, check_ranks, even_partition, round_to_multiple
from kvr_jax.planning import presets, search, tables
from kvr_jax.runtime.roofline import shard_expert_imbalance

METHODS = ("even", "search", "balanced", "predict")


@dataclasses.dataclass(frozen=True)
class PartitionPlan:
  """How to choose chunk lengths when they are not given explicitly.

  method: "even" (KVR-E), "search" (KVR-S, modelled TTFT), "balanced" (equal modelled compute)
    or "predict" (KVR-P, interpolated from a table in configs/partitions/).
  hardware, links: cost-model presets (kvr_jax.planning.presets); "local" is measured on
    this machine.
  multiple: boundaries held to multiples of this (kernel-friendly shapes).
  table_model: which model's table "predict" reads (default: the preset the model came from).
  objective: "modelled" (cost model, seconds) or "measured" (times prefill on the mesh for
    each candidate; `cache_path` keeps results on disk so an interrupted search resumes).
  max_chunk: no chunk longer than this many tokens ("balanced" and "search"; any answer is
    checked against it): a per-device memory cap, since every rank's cache part and
    activations are as long as the longest chunk (kvr_jax.compiled_memory measures them).
  expert_imbalance: on a 2-D mesh whose mixture of experts is split by expert, the busiest
    device's routed rows over its group's mean (costmodel.Setup.expert_imbalance; measure it
    with kvr_jax.tools.expert_load.routing_imbalance); 1: balanced routing.
  """

  method: str = "even"
  hardware: str = "local"
  links: str = "local"
  multiple: int = 1
  table_model: str | None = None
  objective: str = "modelled"
  cache_path: str | None = None
  max_chunk: int | None = None
  expert_imbalance: float = 1.0

  def __post_init__(self):
    if self.objective not in ("modelled", "measured"):
      raise ValueError(f"`objective` must be 'modelled' or 'measured', got {self.objective!r}")
    if self.objective == "measured" and self.method != "search":
      raise ValueError("objective='measured' applies only to method='search'")
    if self.method not in METHODS:
      raise ValueError(f"unknown partition method {self.method!r}; expected one of {METHODS}")
    if isinstance(self.multiple, bool) or not isinstance(self.multiple, int) or self.multiple < 1:
      raise ValueError(f"`multiple` must be a positive integer, got {self.multiple!r}")
    presets.check_preset_names(self.hardware, self.links)
    if self.max_chunk is not None and (
      isinstance(self.max_chunk, bool) or not isinstance(self.max_chunk, int) or self.max_chunk < 1
    ):
      raise ValueError(f"`max_chunk` must be a positive integer, got {self.max_chunk!r}")
    u = self.expert_imbalance
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 1 <= u < float("inf"):
      raise ValueError(
        "`expert_imbalance` must be a number >= 1 (the busiest device's expert rows over its "
        f"group's mean), got {u!r}"
      )


def resolve_partition(
  partition,
  context_len: int,
  num_ranks: int,
  *,
  config=None,
  batch: int = 1,
  dtype_bytes: int = 4,
  model_name: str | None = None,
  scores_in_memory: bool = True,
  causal_skip: bool = False,
  model_parallel: int = 1,
) -> tuple[int, ...]:
  """`"even"`, `"search"`, `"balanced"`, `"predict"`, a PartitionPlan or explicit lengths ->
  a validated tuple of p chunk lengths (rank 0 first). model_parallel: the devices of each
  rank (a 2-D mesh), whose shards the modelled methods model.

  scores_in_memory: whether the attention kernel that will run writes its scores to memory
  (dense, blocked) or not (flash, fused), and whether it skips the masked future of a rank's
  diagonal block (all but dense); the modelled methods model that kernel."""
  check_ranks(context_len, num_ranks)
  if partition is None:
    partition = "even"
  if isinstance(partition, str):
    if partition not in METHODS:
      raise ValueError(
        f"unknown partition {partition!r}; expected one of {METHODS} or a list of p chunk lengths"
      )
    partition = PartitionPlan(partition)
  if isinstance(partition, PartitionPlan):
    setup = _plan_setup(
      partition, config, dtype_bytes, batch, scores_in_memory, causal_skip, model_parallel
    )
    cap = _check_cap(partition.max_chunk, context_len, num_ranks)
    chunks = _plan_chunks(partition, context_len, num_ranks, config, setup, model_name)
    if cap is not None and max(chunks) > cap:
      raise ValueError(
        f"partition {partition.method!r} gives a chunk of {max(chunks)} tokens, above "
        f"max_chunk={cap}; use 'balanced' or 'search', which respect it"
      )
    # Every plan's answer is checked like a user's list: a bad plan never reaches a program.
    return check_chunks(chunks, context_len, num_ranks)
  return check_chunks(partition, context_len, num_ranks)


def searches_kind_split(partition, config) -> bool:
  """Whether `partition` asks KV-Runahead's modelled search ("search", or a PartitionPlan of
  method "search" on the modelled objective) on a hybrid model with linear and full layers:
  then the search is per layer kind (`resolve_kind_split`)."""
  if isinstance(partition, str):
    partition = PartitionPlan(partition) if partition == "search" else None
  return (
    isinstance(partition, PartitionPlan)
    and partition.method == "search"
    and partition.objective == "modelled"
    and config is not None
    and search.splits_by_kind(config)
  )


def resolve_kind_split(
  partition,
  context_len: int,
  num_ranks: int,
  *,
  config,
  batch: int = 1,
  dtype_bytes: int = 4,
  scores_in_memory: bool = True,
  causal_skip: bool = False,
  model_parallel: int = 1,
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
  """KV-Runahead's modelled search on a hybrid model (`searches_kind_split`), with the full
  layers' own split: (the linear layers' split, the full layers' or None where one split for
  both models as fast; `search.kind_split_search`). Every argument as `resolve_partition`'s,
  and both splits checked as a user's (`max_chunk` included)."""
  check_ranks(context_len, num_ranks)
  plan = PartitionPlan(partition) if isinstance(partition, str) else partition
  if not searches_kind_split(plan, config):
    raise ValueError(
      "a split per layer kind is searched by partition 'search' (modelled) on a hybrid model "
      f"with linear and full layers, got {partition!r}"
    )
  setup = _plan_setup(
    plan, config, dtype_bytes, batch, scores_in_memory, causal_skip, model_parallel
  )
  _check_cap(plan.max_chunk, context_len, num_ranks)
  linear, full = _plan_kind_split(plan, context_len, num_ranks, config, setup)
  linear = check_chunks(linear, context_len, num_ranks)
  return linear, None if full is None else check_chunks(full, context_len, num_ranks)


def _check_cap(cap: int | None, context_len: int, num_ranks: int) -> int | None:
  """A plan's max_chunk, refused where even the even split does not fit it."""
  if cap is not None and cap < -(-context_len // num_ranks):
    raise ValueError(
      f"max_chunk={cap} is below ceil(C/p) = {-(-context_len // num_ranks)} "
      f"({context_len} tokens on {num_ranks} ranks): no partition fits it"
    )
  return cap


@kept_cache(64)
def _plan_kind_split(plan: PartitionPlan, context_len, num_ranks, config, setup) -> tuple:
  """Keyed on the resolved Setup, as `_plan_chunks`."""
  return search.kind_split_search(
    config, context_len, num_ranks, setup, multiple=plan.multiple, max_chunk=plan.max_chunk
  )


def _plan_setup(plan, config, dtype_bytes, batch, scores_in_memory, causal_skip, model_parallel):
  """The cost-model setup a modelled plan runs on (None for the methods that need none);
  refuses a measured plan (it runs prefills, above this layer) and a plan without a config."""
  if plan.objective == "measured":
    raise ValueError(
      "a measured search times prefills, so it runs above them: "
      "chunks = kvr_jax.tools.measured.measured_partition(model, tokens, mesh, plan), then "
      "prefill(..., partition=chunks)"
    )
  if plan.method != "even" and config is None:
    raise ValueError(f"partition method {plan.method!r} needs the model config")
  if plan.method not in ("balanced", "search"):
    return None
  return presets.make_setup(
    plan.hardware,
    plan.links,
    dtype_bytes=dtype_bytes,
    batch=batch,
    scores_in_memory=scores_in_memory,
    causal_skip=causal_skip,
    model_parallel=model_parallel,
    expert_imbalance=shard_expert_imbalance(config, model_parallel, plan.expert_imbalance),
  )


@kept_cache(256)
def _plan_chunks(
  plan: PartitionPlan, context_len, num_ranks, config, setup, model_name
) -> tuple[int, ...]:
  """Keyed on the resolved Setup (not the preset names), so a recalibration is seen."""
  if plan.method == "even":
    chunks = even_partition(context_len, num_ranks)
    if plan.multiple == 1:
      return chunks
    return round_to_multiple(chunks, context_len, plan.multiple)
  if plan.method == "balanced":
    return search.balanced_partition(
      config, context_len, num_ranks, setup, multiple=plan.multiple, max_chunk=plan.max_chunk
    )
  if plan.method == "search":
    return search.modelled_search(
      config, context_len, num_ranks, setup, multiple=plan.multiple, max_chunk=plan.max_chunk
    )
  name = plan.table_model or model_name
  if name is None:
    raise ValueError(
      "partition 'predict' needs a table: pass PartitionPlan('predict', "
      "table_model=<preset name>, hardware=..., links=...)"
    )
  table = tables.load_table(name, plan.hardware, plan.links, num_ranks)
  return tables.predict_partition(table, context_len, plan.multiple)
