"""Context partitions: how many prompt tokens each rank takes (rank 0 the earliest)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence


def even_partition(context_len: int, num_ranks: int) -> tuple[int, ...]:
  """C/p tokens each; the first C mod p ranks take one more (earlier ranks do less attention)."""
  base, extra = divmod(context_len, num_ranks)
  return tuple(base + (1 if i < extra else 0) for i in range(num_ranks))


def check_partition(partition: Sequence[int], context_len: int, num_ranks: int) -> tuple[int, ...]:
  """Validates explicit chunk lengths: p positive integers summing to C."""
  chunks = tuple(partition)
  if len(chunks) != num_ranks:
    raise ValueError(f"`partition` has {len(chunks)} chunks but the mesh has {num_ranks} ranks")
  for i, c in enumerate(chunks):
    if isinstance(c, bool) or not isinstance(c, int) and not hasattr(c, "__index__"):
      raise ValueError(f"`partition`[{i}] must be an integer, got {c!r}")
    if c <= 0:
      raise ValueError(f"`partition`[{i}] = {c}: every chunk must hold at least one token")
  chunks = tuple(int(c) for c in chunks)
  if sum(chunks) != context_len:
    raise ValueError(
      f"`partition` {list(chunks)} sums to {sum(chunks)}, but the prompt has {context_len} tokens"
    )
  return chunks


METHODS = ("even", "search", "balanced", "predict")


@dataclasses.dataclass(frozen=True)
class PartitionPlan:
  """How to choose chunk lengths when they are not given explicitly.

  method: "even" (KVR-E), "search" (KVR-S, modelled TTFT), "balanced" (equal modelled compute)
    or "predict" (KVR-P, interpolated from a table in configs/partitions/).
  hardware, links: cost-model presets (kvr_jax.costmodel); "local" is measured on this machine.
  multiple: boundaries held to multiples of this (kernel-friendly shapes).
  table_model: which model's table "predict" reads (default: the preset the model came from).
  objective: "modelled" (cost model, seconds) or "measured" (times prefill on the mesh for
    each candidate; `cache_path` keeps results on disk so an interrupted search resumes).
  """

  method: str = "even"
  hardware: str = "local"
  links: str = "local"
  multiple: int = 1
  table_model: str | None = None
  objective: str = "modelled"
  cache_path: str | None = None

  def __post_init__(self):
    if self.objective not in ("modelled", "measured"):
      raise ValueError(f"`objective` must be 'modelled' or 'measured', got {self.objective!r}")
    if self.objective == "measured" and self.method != "search":
      raise ValueError("objective='measured' applies only to method='search'")
    if self.method not in METHODS:
      raise ValueError(f"unknown partition method {self.method!r}; expected one of {METHODS}")
    if not isinstance(self.multiple, int) or self.multiple < 1:
      raise ValueError(f"`multiple` must be a positive integer, got {self.multiple!r}")


def resolve_partition(
  partition,
  context_len: int,
  num_ranks: int,
  *,
  config=None,
  batch: int = 1,
  dtype_bytes: int = 4,
  model_name: str | None = None,
) -> tuple[int, ...]:
  """`"even"`, `"search"`, `"balanced"`, `"predict"`, a PartitionPlan or explicit lengths ->
  a validated tuple of p chunk lengths (rank 0 first)."""
  if num_ranks > context_len:
    raise ValueError(
      f"{num_ranks} ranks but only {context_len} prompt tokens: every rank needs "
      "at least one token; use fewer devices"
    )
  if partition is None:
    partition = "even"
  if isinstance(partition, str):
    if partition not in METHODS:
      raise ValueError(
        f"unknown partition {partition!r}; expected one of {METHODS} or a list of p chunk lengths"
      )
    partition = PartitionPlan(partition)
  if isinstance(partition, PartitionPlan):
    return _plan_chunks(partition, context_len, num_ranks, config, batch, dtype_bytes, model_name)
  return check_partition(partition, context_len, num_ranks)


@functools.lru_cache(maxsize=256)
def _plan_chunks(
  plan: PartitionPlan, context_len, num_ranks, config, batch, dtype_bytes, model_name
) -> tuple[int, ...]:
  from kvr_jax import search  # the cost model is only needed for these methods

  if plan.method == "even":
    chunks = even_partition(context_len, num_ranks)
    if plan.multiple == 1:
      return chunks
    return search.round_to_multiple(chunks, context_len, plan.multiple)
  if config is None:
    raise ValueError(f"partition method {plan.method!r} needs the model config")
  sim = dict(batch=batch, hardware=plan.hardware, links=plan.links, dtype_bytes=dtype_bytes)
  if plan.method == "balanced":
    return search.balanced_partition(config, context_len, num_ranks, multiple=plan.multiple, **sim)
  if plan.method == "search":
    return search.modelled_search(config, context_len, num_ranks, multiple=plan.multiple, **sim)
  name = plan.table_model or model_name
  if name is None:
    raise ValueError(
      "partition 'predict' needs a table: pass PartitionPlan('predict', "
      "table_model=<preset name>, hardware=..., links=...)"
    )
  table = search.load_table(name, plan.hardware, plan.links, num_ranks)
  return search.predict_partition(table, context_len, plan.multiple)


def prefix_ends(chunks: Sequence[int]) -> tuple[int, ...]:
  """S_i = c_0 + ... + c_i: the prefix length rank i ends with."""
  ends, total = [], 0
  for c in chunks:
    total += c
    ends.append(total)
  return tuple(ends)
