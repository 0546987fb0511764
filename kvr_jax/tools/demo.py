"""The comparison the main job prints: each strategy on one prompt, timed and checked.

Lives in the library so a notebook calls the same function as `python -m launch.run`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from kvr_jax.core.chunks import check_chunks
from kvr_jax.inference.buckets import bucket_length, pad_rows, padded_prompts
from kvr_jax.inference.generate import decode_from
from kvr_jax.inference.kv_cache import check_cache
from kvr_jax.inference.prefill import plan_prefill, prefill_arguments
from kvr_jax.planning.partition import PartitionPlan
from kvr_jax.runtime.compilation import CacheUse
from kvr_jax.runtime.loading import Model
from kvr_jax.runtime.mesh import check_mesh, mesh_of_ranks
from kvr_jax.runtime.mesh import model_parallel as devices_per_rank
from kvr_jax.strategies import STRATEGIES, get_strategy
from kvr_jax.strategies.base import AUTO
from kvr_jax.tools.measured import measured_partition
from kvr_jax.tools.timing import synthetic_prompt, time_prefill

__all__ = ["StrategyReport", "compare_strategies", "format_table", "synthetic_prompt"]


@dataclasses.dataclass
class StrategyReport:
  strategy: str
  attention: str  # the kernel it ran
  partition: tuple[int, ...] | None
  # Planning before the first call (plan_prefill: the modelled search of a split, auto's
  # choice; kept, so the first call does not plan again): not a compile, shown apart.
  plan_s: float
  compile_s: float  # first call (trace + compile + run) minus a warm run
  # What the persistent compilation cache did for the prefill's programs (CacheUse.describe):
  # "cache" (read from disk), "compiled", "k/n" (k of n read), "-" (cache off or nothing compiled).
  compile_cache: str
  # The counts behind it: programs read from the cache, and programs compiled and written to it
  # (only those that compiled in at least compilation.MIN_COMPILE_SECONDS are written).
  compile_cache_hits: int
  compile_cache_written: int
  ttft_median_s: float
  ttft_runs_s: list[float]
  max_logit_diff_vs_single: float | None  # None when `single` did not run
  first_tokens: list[int]
  # Every row's new tokens (after a row's EOS, the EOS again) and, where the model has a
  # tokenizer, every row's answer as text.
  new_tokens: list[list[int]] = dataclasses.field(default_factory=list)
  text: list[str] | None = None
  # Whether every row's new tokens equal the first strategy's (None on the first itself).
  same_as_first: bool | None = None
  # strategy="auto": what the cost model picked, with every strategy's MODELLED TTFT.
  choice: str | None = None
  # KV-Runahead on a hybrid with its full layers on their own split (`partition` is then
  # the linear layers'): what "search" or "auto" picked, or the user's mapping.
  full_partition: tuple[int, ...] | None = None

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def compare_strategies(
  model: Model,
  tokens,
  strategies=("single", "tsp", "kvr"),
  *,
  num_devices: int | None = None,
  partition: Any = "even",
  attention: str | None = None,
  repeats: int = 3,
  max_new_tokens: int = 8,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  seed: int = 0,
  cache: str = "auto",
  buckets=None,
  model_parallel: int = 1,
  on_token=None,
) -> list[StrategyReport]:
  """Prefills `tokens` with each strategy; TTFT is the median of `repeats` warm runs; then
  decodes `max_new_tokens` from each one's cache (on_token: called with the first
  strategy's new tokens as they are drawn, see `generate`).

  tokens: [B, T] or rows of different lengths (padded, see kvr_jax.prefill's `buckets`).
  attention: the kernel for the strategies that run it (default "auto": each strategy's
    fastest on this platform; the report names the kernel that ran).
  cache: "last", "sharded" or "auto" (see kvr_jax.prefill); decode reads it where it lies.
  model_parallel: devices per rank (tensor parallelism inside each rank, a ("ranks",
    "model") mesh); num_devices counts all of them and must be a multiple of it."""
  check_cache(cache, allow_auto=True)
  rows, _, padded_len, buckets = padded_prompts(model, tokens, buckets)
  mesh = mesh_of_ranks(num_devices, model_parallel)
  strategies = _check_comparison(strategies, mesh, partition, attention, repeats, padded_len)
  search_s = 0.0
  if _is_measured(partition):
    # KVR-S over measured TTFT runs prefills, so it is resolved here, once, on the rows
    # padded to their bucket (the tokens themselves: a mixture of experts routes by them);
    # its time is the partitioned strategies' planning.
    started = time.perf_counter()
    padded = pad_rows(rows, padded_len)
    partition = list(measured_partition(model, padded, mesh, partition))
    search_s = time.perf_counter() - started
  reference = None
  reports = []
  for strategy in strategies:
    kwargs = prefill_arguments(strategy, mesh=mesh, partition=partition, attention=attention)
    started = time.perf_counter()
    plan_prefill(model, rows, cache=cache, buckets=buckets, **kwargs)
    plan_s = time.perf_counter() - started
    if search_s and get_strategy(strategy).partitioned:  # (auto is refused with a search)
      plan_s += search_s
    cache_use = CacheUse.now()
    timing = time_prefill(model, rows, repeats, cache=cache, buckets=buckets, **kwargs)
    cache_use = CacheUse.now().since(cache_use)
    logits = np.asarray(timing.result.logits)
    # The row of the one-device strategy named on the command line is the reference.
    if strategy != AUTO and get_strategy(strategy).max_ranks == 1:
      reference = logits
    gen = decode_from(
      model,
      timing.result,
      max_new_tokens,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      seed=seed,
      on_token=None if reports else on_token,
    )
    diff = None if reference is None else float(np.abs(logits - reference).max())
    report = _report(strategy, timing, plan_s, cache_use, diff, gen)
    if reports:
      report.same_as_first = report.new_tokens == reports[0].new_tokens
    reports.append(report)
  return reports


def _report(strategy: str, timing, plan_s: float, cache_use, diff, gen) -> StrategyReport:
  """One strategy's row: what ran, its planning, compile and median TTFT, how far its logits
  are from single's, and its first decoded tokens."""
  result, median = timing.result, timing.median_s
  return StrategyReport(
    strategy=strategy,
    attention=result.attention,
    partition=result.partition,
    plan_s=plan_s,
    compile_s=max(timing.first_s - median, 0.0),
    compile_cache=cache_use.describe(),
    compile_cache_hits=cache_use.hits,
    compile_cache_written=cache_use.written,
    ttft_median_s=median,
    ttft_runs_s=timing.runs_s,
    max_logit_diff_vs_single=diff,
    first_tokens=[int(t) for t in gen.tokens[0]],
    new_tokens=[[int(t) for t in row] for row in gen.tokens],
    text=gen.text,
    choice=None if result.choice is None else describe_choice(result.choice),
    full_partition=result.full_partition,
  )


def describe_choice(choice) -> str:
  """strategy="auto"'s pick and the MODELLED TTFT of each strategy it weighed."""
  split = f" {list(choice.chunks)}" if choice.chunks else ""
  if choice.full_chunks:
    split += f", its full layers on {list(choice.full_chunks)}"
  modelled = ", ".join(
    f"{name} {seconds * 1e3:.1f}ms" for name, seconds in choice.predicted_s.items()
  )
  return f"auto picked {choice.strategy}{split} (MODELLED TTFT: {modelled})"


def _check_comparison(strategies, mesh, partition, attention, repeats, padded_len) -> list:
  """Every argument checked before the first strategy compiles (not after it ran); the
  strategies with "single" first, so that the others are compared with it."""
  if repeats < 1:
    raise ValueError(f"`repeats` must be >= 1, got {repeats}")
  known = (*STRATEGIES, AUTO)
  unknown = [s for s in strategies if s not in known]
  if unknown or not strategies:
    raise ValueError(f"unknown strategy {unknown or strategies}; expected some of {known}")
  # The one-device strategy first (by its record): the others are compared with it.
  strategies = sorted(strategies, key=lambda s: s == AUTO or get_strategy(s).max_ranks != 1)
  if _is_measured(partition):
    if AUTO in strategies:
      raise ValueError(
        "strategy 'auto' chooses by the cost model; a measured partition applies to 'kvr' "
        "(name the strategies)"
      )
    if devices_per_rank(mesh) > 1:
      raise ValueError("a measured partition is searched on a 1-D mesh of ranks so far")
  if isinstance(partition, (list, tuple, np.ndarray)):
    partitioned = [s for s in STRATEGIES if get_strategy(s).partitioned]
    if not any(s in partitioned for s in strategies):
      raise ValueError(
        f"partition lengths apply to {partitioned}; the strategies {list(strategies)} lay the "
        "prompt out themselves"
      )
    check_chunks(partition, padded_len, check_mesh(mesh, allow_model=True))
  for strategy in strategies:  # a kernel named explicitly is refused, not swapped, up front
    if strategy == AUTO and attention not in (None, AUTO):
      raise ValueError(
        f"strategy 'auto' runs each strategy's own kernel; attention={attention!r} names one "
        "(leave it auto, or name the strategies)"
      )
    prefill_arguments(strategy, mesh=mesh, partition=partition, attention=attention)
  return strategies


def _is_measured(partition) -> bool:
  return isinstance(partition, PartitionPlan) and partition.objective == "measured"


def format_table(reports: list[StrategyReport]) -> str:
  """One row per strategy; the partition in full (the column is as wide as the longest; a
  split per layer kind as "linear / full"); "same": whether its new tokens, every row's, are
  the first strategy's."""
  parts = [_split_text(r.partition, r.full_partition) for r in reports]
  width = max([len("partition"), *map(len, parts)])
  header = (
    f"{'strategy':<9} {'kernel':<6} {'partition':<{width}} {'TTFT median':>12} {'plan':>7} "
    f"{'compile':>9} "
    f"{'from':<9} {'max |dlogit|':>13} {'same':>4}  first tokens"
  )
  lines = [header, "-" * len(header)]
  for r, part in zip(reports, parts, strict=True):
    diff = r.max_logit_diff_vs_single
    lines.append(
      f"{r.strategy:<9} {r.attention:<6} {part:<{width}} {r.ttft_median_s * 1e3:>10.1f}ms "
      f"{r.plan_s:>6.2f}s {r.compile_s:>8.2f}s {r.compile_cache:<9} "
      f"{'n/a' if diff is None else f'{diff:.2e}':>13} {_same_text(r.same_as_first):>4}  "
      f"{' '.join(map(str, r.first_tokens))}"
    )
  lines += [r.choice for r in reports if r.choice]
  return "\n".join(lines)


def _same_text(same: bool | None) -> str:
  """The "same" column: every row's new tokens those of the first strategy ("-": the first)."""
  return "-" if same is None else ("yes" if same else "NO")


def _split_text(partition, full_partition) -> str:
  if partition is None:
    return "-"
  text = ",".join(map(str, partition))
  return text if full_partition is None else f"{text} / {','.join(map(str, full_partition))}"


def describe_run(model, tokens, buckets, num_devices: int | None, model_parallel: int = 1) -> str:
  """One line: the model, the prompt's shape (and its padding under `buckets`), the ranks."""
  lengths = sorted({len(row) for row in tokens})
  shape = f"prompt {lengths[0]} tokens x batch {len(tokens)}"
  if len(lengths) > 1:
    shape = f"{len(tokens)} prompts of {'/'.join(str(len(row)) for row in tokens)} tokens"
  padded = bucket_length(max(lengths), buckets, model.config.max_position_embeddings)
  if padded != lengths[0] or len(lengths) > 1:
    shape += f", padded to {padded} (buckets={buckets})"
  devices, m = num_devices or jax.device_count(), model_parallel
  ranks = f"{devices} ranks" if m == 1 else f"{devices // m} ranks x {m} devices (model)"
  return f"{model}; {shape}; {ranks} on {jax.devices()[0].platform}"
