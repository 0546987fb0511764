"""The automatic choices of a prefill plan: `strategy="auto"` (the cost model's pick for the
prompt's bucket on this mesh), its one-device case, and `cache="auto"` (the whole cache on
the last rank where it fits). Across processes every process takes process 0's answer."""

from __future__ import annotations

from kvr_jax.inference.kv_cache import (
  CACHE_LAYOUTS,
  choose_cache_layout,
  device_memory_bytes,
  whole_cache_bytes,
)
from kvr_jax.inference.shape import PrefillShape
from kvr_jax.planning import presets
from kvr_jax.planning.choice import AUTO_CANDIDATES, choose_strategy
from kvr_jax.planning.costmodel import kernel_flags
from kvr_jax.planning.partition import PartitionPlan
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.agreement import agreed
from kvr_jax.runtime.mesh import (
  AXIS,
  check_mesh,
  make_mesh,
  model_parallel,
  rank_device,
  rank_row_mesh,
)
from kvr_jax.runtime.roofline import shard_expert_imbalance
from kvr_jax.strategies import REGISTRY, STRATEGIES
from kvr_jax.strategies.base import AUTO


def plan_cache(shape: PrefillShape, mesh) -> str:
  """cache="auto": "last" where the last rank's device holds the weights and the whole cache
  (its shard of them on a 2-D mesh), else "sharded" (kv_cache.choose_cache_layout). Across
  processes every process takes process 0's answer."""
  m, itemsize, T, B = model_parallel(mesh), shape.itemsize, shape.prompt_len, shape.batch
  tensor_parallel.check_model_parallel(shape.config, m)
  cache_bytes = whole_cache_bytes(shape.config, T, B, itemsize, m)
  weights_bytes = shape.config.num_params() * itemsize // m
  last_device = mesh.devices.reshape(-1)[-1]
  cache = choose_cache_layout(cache_bytes, weights_bytes, device_memory_bytes(last_device))
  index = agreed("cache", (shape.model_key, T, B), mesh, CACHE_LAYOUTS.index(cache))
  return CACHE_LAYOUTS[index]


def auto_one_device(shape: PrefillShape, mesh, cache: str):
  """auto's pick of one device: the last rank's, run in its process alone, where the other
  strategies' cache="last" puts the cache; the other processes hold nothing of the result.
  Every process running it would only slow the one that answers (on this machine two busy
  cores ran one process's prefill 1.2-1.6x slower than one). cache="auto" is decided over the
  whole mesh (every process the same answer). Returns (the one-device mesh, cache)."""
  mesh = make_mesh() if mesh is None else mesh
  if cache == AUTO:
    cache = plan_cache(shape, mesh)
  last = mesh.shape[AXIS] - 1
  if model_parallel(mesh) > 1:  # the last rank's model group: tensor parallelism alone
    return rank_row_mesh(mesh, last), cache
  return make_mesh(1, devices=[rank_device(mesh, last)]), cache


def choose_auto_strategy(shape: PrefillShape, mesh, partition, attention):
  """strategy="auto": the cost model's pick for T tokens (the prompt's bucket) of B rows on
  this mesh, with the hardware and links of `partition` (a PartitionPlan; default the `local`
  calibration) and each strategy's own kernel. Returns (strategy, partition, choice)."""
  if attention not in (None, AUTO):
    raise ValueError(
      "strategy='auto' runs each strategy's own kernel (attention='auto'); name a strategy "
      "to choose its kernel"
    )
  if partition is not None and not isinstance(partition, PartitionPlan):
    raise ValueError(
      "strategy='auto' chooses KV-Runahead's split itself: pass partition=None or a "
      f"PartitionPlan naming the hardware and links to plan for, got {partition!r}"
    )
  plan = partition or PartitionPlan("search")
  mesh = make_mesh() if mesh is None else mesh
  # On a ("ranks", "model") mesh every candidate runs on p ranks of m devices (single: one
  # rank's group), as the cost model's shards (Setup.model_parallel) model them.
  p, m = check_mesh(mesh, allow_model=True), model_parallel(mesh)
  tensor_parallel.check_model_parallel(shape.config, m)
  device = mesh.devices.flat[0]
  T, B = shape.prompt_len, shape.batch
  # The kernel the cost model plans with: that of the partitioned candidate (its split is
  # searched with it), the kernel its auto runs.
  planned = next(REGISTRY[s] for s in AUTO_CANDIDATES if REGISTRY[s].partitioned)
  kernel = planned.resolve_attention(None, device, shape.dtype, shape.config.narrowest_window)
  setup = presets.make_setup(
    plan.hardware,
    plan.links,
    dtype_bytes=shape.itemsize,
    batch=B,
    model_parallel=m,
    expert_imbalance=shard_expert_imbalance(shape.config, m, plan.expert_imbalance),
    **kernel_flags(kernel),
  )
  choice = choose_strategy(shape.config, T, p, setup, multiple=plan.multiple)
  # Calibrations are per process: every process runs process 0's pick (and, for kvr, its
  # split: `_plan_partition` broadcasts that).
  key = (shape.model_key, T, B, plan)
  strategy = STRATEGIES[agreed("strategy", key, mesh, STRATEGIES.index(choice.strategy))]
  split = choice.partition if strategy == choice.strategy else None
  return strategy, split, choice
