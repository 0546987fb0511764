"""A prefill's plan (`PrefillPlan`), made from the prompt's shape alone and every argument
checked before anything compiles: the strategy (or auto's pick), the mesh, the kernel, the
split (a hybrid's per layer kind), the cache layout and KV-Runahead's join of its last hops.
`plan_from_shape` is what `plan_prefill` makes for a model and its tokens, and what
kvr_jax.tools.memory compiles from shapes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from kvr_jax.inference import hybrid, kv_form, latent
from kvr_jax.inference.auto import auto_one_device, choose_auto_strategy, plan_cache
from kvr_jax.inference.kv_cache import (
  check_cache,
  device_memory_bytes,
  join_affordable,
  last_hop_bytes,
)
from kvr_jax.inference.shape import PrefillShape
from kvr_jax.planning.choice import StrategyChoice
from kvr_jax.planning.costmodel import kernel_flags
from kvr_jax.planning.partition import (
  PartitionPlan,
  resolve_kind_split,
  resolve_partition,
  searches_kind_split,
)
from kvr_jax.runtime.agreement import agreed
from kvr_jax.runtime.cache_layout import CacheLayout
from kvr_jax.runtime.loading import Model
from kvr_jax.runtime.mesh import (
  AXIS,
  check_mesh,
  make_mesh,
  model_parallel,
  rank_row_mesh,
)
from kvr_jax.runtime.tensor_parallel import check_model_parallel, kv_heads_per_shard
from kvr_jax.strategies import STRATEGIES, get_strategy
from kvr_jax.strategies.base import AUTO, Strategy
from kvr_jax.strategies.by_kind import compile_plan
from models.kernels import AttentionKernel, kernels_where
from models.layer_kinds import past_kind


def _single_device_mesh(mesh):
  """This process's first device (of the mesh, if one is given), as a mesh of one: with
  jax.distributed every process can run the single-device oracle on its own device. On a
  ("ranks", "model") mesh: its first rank's row, a mesh of one rank (tensor parallelism
  alone)."""
  if mesh is not None and model_parallel(mesh) > 1:
    return rank_row_mesh(mesh, 0)
  devices = jax.local_devices() if mesh is None else mesh.devices.reshape(-1)
  local = [d for d in devices if d.process_index == jax.process_index()]
  if not local:
    raise ValueError("strategy='single': the mesh has no device of this process")
  return make_mesh(1, devices=local[:1])


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
  """What a prefill of one padded shape runs, decided and checked before anything compiles
  (`plan_prefill`); `run_prefill` runs it on any prompt of that shape (same bucket, batch).

  prompt_len: T, the rows' padded length (their bucket). batch: B. partition: the chunk
  lengths the user's partition resolved to (partitioned strategies), else None. chunks: each
  rank's token count as the program sees them (`Strategy.layout`). keep_last_hop: KV-Runahead's
  last rank keeps what its hops brought, so cache="last" needs no move (where memory allows; on a
  hybrid or latent model wherever cache="last" runs KV-Runahead with its hops static).
  timeline: the program carries phase probes (kvr_jax.tools.timeline).
  """

  strategy: Strategy
  mesh: Any
  kernel: AttentionKernel
  prompt_len: int
  batch: int
  partition: tuple[int, ...] | None
  chunks: tuple[int, ...]
  cache: str
  keep_last_hop: bool
  timeline: bool
  buckets: Any
  padded: bool  # planned for rows padded past their length (a bucket, a ragged batch)
  choice: StrategyChoice | None = None  # strategy="auto": what it picked and why (modelled)
  # KV-Runahead on a hybrid with a split per layer kind (partition={"linear": .., "full":
  # ..}, or what "search" or "auto" modelled faster): the full layers' chunks; `partition`
  # and `chunks` are then the linear layers'.
  full_chunks: tuple[int, ...] | None = None
  # What the model keeps of the prompt and how its program's outputs are placed
  # (`cache_form_of`: K,V, a hybrid's, a latent model's).
  cache_form: Any = kv_form.FORM
  # The model's layer kinds (`ModelConfig.kinds`): what its program is assembled from.
  kinds: tuple = ()

  @property
  def cache_layout(self) -> CacheLayout:
    return self.strategy.cache_layout(self.prompt_len, self.chunks)

  def program(self, model: Model):
    """The compiled program (cached by the strategy)."""
    return self.compile(model.graphdef)

  def compile(self, graphdef, padded: bool = False):
    """The program for a model of `graphdef` (a loaded model's, or one built from shapes),
    every model's (`strategies.by_kind.compile_plan`; padded: rows padded past their ends,
    which a linear layer's state stops at; a causal past takes padded rows as it takes any)."""
    return compile_plan(self, graphdef, padded, self.cache_form.also_kinds)


def plan_from_shape(
  shape: PrefillShape,
  strategy: str = "single",
  mesh=None,
  partition: Any = None,
  attention: str | None = None,
  cache: str = "auto",
  *,
  buckets=None,
  timeline: bool = False,
  device_memory: int | None = None,
) -> PrefillPlan:
  """The plan of a prefill of `shape` (a model's config and dtype, the prompt's padded length
  and batch): what `plan_prefill` makes for a model and its tokens, and what
  kvr_jax.tools.memory compiles from shapes. device_memory: the bytes of the device planned
  for (KV-Runahead's join of its last hops), default the mesh's own."""
  T, choice = shape.prompt_len, None
  form = cache_form_of(shape.config)  # what the model keeps of the prompt, how it is placed
  if isinstance(strategy, str) and strategy == AUTO:
    strategy, partition, choice = choose_auto_strategy(shape, mesh, partition, attention)
  spec = get_strategy(strategy)
  cache = check_cache(cache, allow_auto=True)
  kernel = _check_model_and_kernel(shape.config, spec, attention, timeline, form)
  if choice is not None and spec.max_ranks == 1:
    mesh, cache = auto_one_device(shape, mesh, cache)
  mesh = _plan_mesh(spec, mesh, T, elsewhere=choice is not None)
  if cache == AUTO:  # every layer kind's past counted as it is held (`plan_cache`)
    cache = plan_cache(shape, mesh)
  _check_layout(spec, partition, cache, T, shape.longest, shape.padded, buckets)
  form.check_plan(shape.config, spec, cache)
  if model_parallel(mesh) > 1:
    _check_tensor_parallel(shape.config, mesh)
  kernel = planned_kernel(shape, spec, kernel, mesh.devices.flat[0])
  user_chunks = full_chunks = None
  if isinstance(partition, Mapping):  # a split per layer kind (a hybrid's, KV-Runahead's)
    partition, full_partition = _split_by_kind(partition, form, spec)
    full_chunks = _plan_partition(shape, full_partition, mesh, kernel)
  elif spec.partitioned and searches_kind_split(partition, shape.config):
    user_chunks, full_chunks = _agreed_kind_split(shape, partition, mesh, kernel)
  if spec.partitioned and user_chunks is None:
    user_chunks = _plan_partition(shape, partition, mesh, kernel)
  chunks = spec.layout(T, mesh.shape[AXIS], user_chunks)
  if form.check_split is not None:
    form.check_split(shape.config, spec, T, mesh.shape[AXIS], full_chunks)
  hops = full_chunks or chunks  # the split a hybrid's full layers' hops follow
  keep_last_hop = _keeps_last_hop(shape, spec, cache, hops, mesh, device_memory)
  return PrefillPlan(
    spec,
    mesh,
    kernel,
    T,
    shape.batch,
    user_chunks,
    chunks,
    cache,
    keep_last_hop,
    timeline,
    buckets,
    shape.padded,
    choice,
    full_chunks,
    form,
    shape.config.kinds,
  )


def cache_form_of(config):
  """The cache form of `config`'s model (inference.cache_form): a hybrid's (any Gated
  DeltaNet layer: hybrid.FORM), a latent model's (latent.FORM), else K,V per layer
  (kv_form.FORM: a `KVWhole` / `KVParts` past)."""
  return {"hybrid": hybrid.FORM, "latent": latent.FORM, "kv": kv_form.FORM}[past_kind(config)]


def _check_model_and_kernel(config, spec, attention, timeline, form):
  """The model's layer kinds (what its cache form refuses of them), the probes and the kernel
  named (or "auto") against the strategy and the model's window."""
  form.check_layers(config)
  if timeline and not spec.timeline_probes:
    raise ValueError(
      f"strategy {spec.name!r} has no timeline probes; they are placed in "
      f"{[s for s in STRATEGIES if get_strategy(s).timeline_probes]}"
    )
  kernel = spec.check_attention(attention)
  window = config.narrowest_window  # any layer's
  if window is not None and kernel != AUTO and not kernel.takes_window:
    raise ValueError(
      f"this model attends through a sliding window of {window} tokens, which attention "
      f"{kernel.name!r} does not take; use one of {kernels_where(takes_window=True)}"
    )
  return kernel


def _check_layout(spec, partition, cache, T, longest, padded, buckets) -> None:
  """What the padded prompt allows: a sharded cache of padded rows in one process, a user's
  lengths summing to the bucket, a partition only for a partitioned strategy."""
  if spec.partitioned and T != longest and isinstance(partition, (list, tuple, np.ndarray)):
    total = sum(
      int(c) for c in partition if isinstance(c, (int, np.integer)) and not isinstance(c, bool)
    )
    if total != T:
      raise ValueError(
        f"partition {list(partition)} sums to {total}, but the prompt runs padded to its "
        f"bucket of {T} tokens (buckets={buckets!r}): give lengths summing to {T}, or "
        "buckets=None (launch.run: --buckets=none)"
      )
  check_partition_applies(spec, partition)


def check_partition_applies(spec, partition) -> None:
  """A partition (other than "even", or none) only for a partitioned strategy."""
  if not spec.partitioned and partition not in (None, "even"):
    raise ValueError(
      f"strategy {spec.name!r} lays the prompt out itself; `partition` applies only to "
      f"{[s for s in STRATEGIES if get_strategy(s).partitioned]}"
    )


def _plan_mesh(spec, mesh, T: int, elsewhere: bool = False):
  """The mesh the strategy runs on (the single device's of this process for the oracle; all
  local devices by default), checked, with at least one token per rank. elsewhere: a
  one-device mesh runs as given, also where another process holds its device (auto's pick of
  one device: this process then holds nothing of the result)."""
  if spec.max_ranks == 1:
    if mesh is not None:
      check_mesh(mesh, allow_model=True)
    if not elsewhere:
      mesh = _single_device_mesh(mesh)
  else:
    mesh = make_mesh() if mesh is None else mesh
  p = check_mesh(mesh, allow_model=True)
  if p > T:
    raise ValueError(
      f"{p} ranks but only {T} prompt tokens: every rank needs at least one "
      "token; use a smaller mesh"
    )
  return mesh


def planned_kernel(shape: PrefillShape, spec, kernel, device):
  """The kernel record a plan of `shape` runs (`kernel` checked by the strategy: a record or
  "auto"), what kvr_jax.tools.memory measures too: "auto" resolved for the device's platform
  (`Strategy.resolve_attention`: cuDNN on NVIDIA GPUs in bfloat16/float16 without a window)
  on every model, a hybrid's or latent model's too (their full and latent layers attend
  through the strategies' kernels: "fused", cuDNN's pieces in XLA, is exact on both);
  refused where it cannot run on this device and dtype."""
  kernel = spec.resolve_attention(kernel, device, shape.dtype, shape.config.narrowest_window)
  reason = kernel.why_not(device, shape.dtype, None)  # the window was checked by name
  if reason is not None:
    raise ValueError(f"attention {kernel.name!r} {reason}")
  return kernel


KIND_SPLIT_KEYS = ("linear", "full")


def _split_by_kind(partition: Mapping, form, spec) -> tuple[Any, Any]:
  """A split per layer kind, {"linear": .., "full": ..} (each a partition as `prefill` takes
  one), checked: KV-Runahead on a hybrid model (its linear and full layers balance on
  different splits: strategies.kind_program.KindSplit). Returns (linear, full)."""
  if not spec.partitioned or not form.splits_per_kind:
    raise ValueError(
      "a partition per layer kind ({'linear': .., 'full': ..}) is KV-Runahead's on a hybrid "
      f"model (linear and full-attention layers); this plan runs {spec.name!r}"
      + ("" if form.splits_per_kind else " on a model of one kind")
    )
  if sorted(partition) != sorted(KIND_SPLIT_KEYS):
    raise ValueError(
      f"a partition per layer kind names {list(KIND_SPLIT_KEYS)}, got {sorted(partition)}"
    )
  return partition["linear"], partition["full"]


def _plan_partition(shape: PrefillShape, partition, mesh, kernel) -> tuple[int, ...]:
  """The user's partition resolved to chunk lengths (the same on every process)."""
  T, B = shape.prompt_len, shape.batch
  chunks = resolve_partition(
    partition,
    T,
    mesh.shape[AXIS],
    config=shape.config,
    batch=B,
    dtype_bytes=shape.itemsize,
    model_name=shape.preset,
    model_parallel=model_parallel(mesh),
    **kernel_flags(kernel),
  )
  # Cost-model partitions use per-process measurements: every process takes process 0's.
  given = partition
  if partition is not None and not isinstance(partition, (str, PartitionPlan)):
    given = tuple(int(c) for c in partition)  # lengths (numpy's too), hashable
  return agreed("partition", (shape.model_key, given, T, B, kernel), mesh, chunks)


def _agreed_kind_split(shape: PrefillShape, partition, mesh, kernel) -> tuple:
  """KV-Runahead's modelled search on a hybrid (`resolve_kind_split`): (the linear layers'
  split, the full layers' or None), process 0's on every process."""
  linear, full = resolve_kind_split(
    partition,
    shape.prompt_len,
    mesh.shape[AXIS],
    config=shape.config,
    batch=shape.batch,
    dtype_bytes=shape.itemsize,
    model_parallel=model_parallel(mesh),
    **kernel_flags(kernel),
  )
  p = len(linear)
  key = (shape.model_key, partition, shape.prompt_len, shape.batch, kernel)
  row = agreed("kind split", key, mesh, (*linear, *(full or (0,) * p)))  # zeros: one split
  return row[:p], (row[p:] if any(row[p:]) else None)


def _keeps_last_hop(shape: PrefillShape, spec, cache, chunks, mesh, device_memory) -> bool:
  """cache="last" from what KV-Runahead's last rank received (no move), where it is whole and
  where memory allows it on the ranks that hold its zeros (kv_cache.join_affordable: rank
  0's device, or `device_memory`; across processes process 0's answer). On a 2-D mesh each
  device of the last rank's row joins its heads (kv_cache.join_on_model_group)."""
  if not spec.keeps_last_hop(cache, chunks, shape.config.kinds):
    return False
  # With padded rows whether the hop holds every row's window is known per run, from the
  # lengths (`kv_form.hop_holds_rows`): a run whose rows it does not hold moves its parts.
  return _join_affordable(shape, chunks, mesh, device_memory)


def _join_affordable(shape: PrefillShape, chunks, mesh, device_memory) -> bool:
  """Whether the last hops' zeros on the ranks before the last fit (kv_cache.join_affordable,
  each layer's hop as its kind keeps it: `last_hop_bytes`), process 0's answer."""
  config, B, m = shape.config, shape.batch, model_parallel(mesh)
  kv_heads = kv_heads_per_shard(config, m) if m > 1 else config.num_kv_heads
  hop_bytes = last_hop_bytes(config, chunks, B, shape.itemsize, kv_heads)
  if device_memory is None:
    device_memory = device_memory_bytes(mesh.devices.flat[0])
  joins = join_affordable(hop_bytes, device_memory=device_memory)
  return bool(agreed("join", (shape.model_key, chunks, B), mesh, int(joins)))


def _check_tensor_parallel(config, mesh) -> None:
  """What a ("ranks", "model") mesh runs: every prefill and decode (padded rows and timeline
  probes too), with the cache left where it was computed or moved onto the last rank's row
  (heads split over "model" either way), but for a rank whose devices live in several
  processes, refused by name before anything compiles."""
  m = model_parallel(mesh)
  check_model_parallel(config, m)
  processes = [sorted({d.process_index for d in row}) for row in mesh.devices]
  split = next(((rank, procs) for rank, procs in enumerate(processes) if len(procs) > 1), None)
  if split is not None:
    raise ValueError(
      f"rank {split[0]}'s {m} devices live in processes {split[1]}: on a ('ranks', 'model') "
      "mesh across processes every rank's devices must be one process's (JAX's one process "
      "per host; locally: devices per process a multiple of model_parallel)"
    )
