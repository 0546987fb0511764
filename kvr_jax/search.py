"""Context-level load balancing: KVR-S (search), KVR-P (predict) and a direct balance.

search    hierarchical grid search over the p-1 chunk boundaries: moves of a coarse step
          first, refined by halving the step around the best point (what the paper does
          offline over measured TTFT). The objective is the modelled TTFT (seconds to run)
          or the measured TTFT on a mesh (`measured_objective`, results kept on disk).
predict   linear interpolation of searched boundaries, as fractions of C, between the
          entries of a table stored under configs/partitions/.
balanced  no search: chunk sizes that equalise every rank's modelled per-layer compute
          time (c_i tokens of projections and MLP, c_i x S_i attention), so that all ranks
          would finish together if communication were free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

from kvr_jax import costmodel
from kvr_jax.partition import even_partition, prefix_ends
from models.config import ModelConfig

PARTITION_DIR = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "partitions"
)

Objective = Callable[[tuple[int, ...]], float]


def _to_chunks(bounds: Sequence[int], context_len: int) -> tuple[int, ...]:
  edges = (0, *bounds, context_len)
  return tuple(edges[i + 1] - edges[i] for i in range(len(edges) - 1))


def _check_search_args(context_len: int, num_ranks: int, multiple: int):
  if not isinstance(multiple, int) or multiple < 1:
    raise ValueError(f"`multiple` must be a positive integer, got {multiple!r}")
  if num_ranks < 1:
    raise ValueError(f"number of ranks must be >= 1, got {num_ranks}")
  if num_ranks > context_len:
    raise ValueError(
      f"p={num_ranks} ranks but only C={context_len} tokens: every rank needs at least one token"
    )
  if (num_ranks - 1) * multiple >= context_len:
    raise ValueError(
      f"C={context_len} is too short for {num_ranks} chunks that are multiples of "
      f"{multiple} (need more than {(num_ranks - 1) * multiple} tokens)"
    )


def round_to_multiple(chunks: Sequence[float], context_len: int, multiple: int = 1):
  """Rounds boundaries to multiples of `multiple` (the last chunk takes the remainder),
  keeping every chunk at least one multiple (the last at least one token)."""
  p = len(chunks)
  bounds, total = [], 0.0
  for c in chunks[:-1]:
    total += c
    bounds.append(int(round(total / multiple)) * multiple)
  for k in range(p - 1):  # strictly increasing, room left for the later chunks
    low = (bounds[k - 1] if k else 0) + multiple
    high = context_len - 1 - (p - 2 - k) * multiple
    high -= (high - 0) % multiple if multiple > 1 else 0
    bounds[k] = min(max(bounds[k], low), high)
  return _to_chunks(bounds, context_len)


def search_partition(
  objective: Objective,
  context_len: int,
  num_ranks: int,
  *,
  multiple: int = 1,
  start: Sequence[int] | None = None,
  progress: Callable[[int], None] | None = None,
) -> tuple[int, ...]:
  """Hierarchical grid search for the chunk lengths that minimise `objective`.

  Boundaries move on a grid of `step` multiples, from a coarse step (about C/2p) halving to
  one multiple. At each step every move of a contiguous run of boundaries by +-step (moving
  tokens from one chunk to another, possibly non-adjacent) is tried, best-improvement, until
  none improves; then the step halves. Each partition is evaluated once (memoised).
  """
  _check_search_args(context_len, num_ranks, multiple)
  p = num_ranks
  if p == 1:
    return (context_len,)
  cache: dict[tuple[int, ...], float] = {}

  def cost(bounds: tuple[int, ...]) -> float:
    if bounds not in cache:
      cache[bounds] = objective(_to_chunks(bounds, context_len))
      if progress is not None:
        progress(len(cache))
    return cache[bounds]

  def valid(bounds) -> bool:
    edges = (0, *bounds, context_len)
    return all(edges[i + 1] - edges[i] >= 1 for i in range(p)) and all(
      b % multiple == 0 for b in bounds
    )

  starts = [round_to_multiple(even_partition(context_len, p), context_len, multiple)]
  if start is not None:
    starts.append(round_to_multiple(start, context_len, multiple))
  best = min((tuple(prefix_ends(s)[:-1]) for s in starts), key=cost)
  units = max(context_len // (2 * p * multiple), 1)
  step = 1 << (units.bit_length() - 1)
  while step >= 1:
    delta = step * multiple
    while True:
      candidates = []
      for lo in range(p - 1):
        for hi in range(lo, p - 1):
          for sign in (-1, 1):
            moved = list(best)
            for k in range(lo, hi + 1):
              moved[k] += sign * delta
            moved = tuple(moved)
            if valid(moved):
              candidates.append(moved)
      better = min(candidates, key=cost, default=best)
      if cost(better) < cost(best):
        best = better
      else:
        break
    step //= 2
  return _to_chunks(best, context_len)


def modelled_objective(
  config: ModelConfig, context_len: int, num_ranks: int, **sim_kwargs
) -> Objective:
  """Modelled KVR TTFT of a partition (seconds; see kvr_jax.costmodel)."""
  return lambda chunks: (
    costmodel.simulate(
      config, "kvr", context_len, num_ranks=num_ranks, partition=chunks, **sim_kwargs
    ).ttft
  )


def balanced_partition(
  config: ModelConfig,
  context_len: int,
  num_ranks: int,
  *,
  multiple: int = 1,
  batch: int = 1,
  hardware="a100-80gb",
  links="300GBps",
  dtype_bytes: int = 2,
  scores_in_memory: bool = True,
) -> tuple[int, ...]:
  """Chunks that equalise each rank's modelled per-layer compute time (no search).

  Communication is ignored (sends are asynchronous and, at high bandwidth, hidden); at low
  bandwidth the chain of hops dominates and `search` does clearly better.

  For a target time T, rank 0 takes the largest chunk whose compute fits in T, rank
  1 likewise given S_0, and so on; the last rank takes the rest. Bisection on T makes the last
  rank's time equal T too.
  """
  _check_search_args(context_len, num_ranks, multiple)
  p, C = num_ranks, context_len
  if p == 1:
    return (C,)
  hw = costmodel.hardware_preset(hardware) if isinstance(hardware, str) else hardware
  del links  # communication is not part of the balance (see docstring)
  kw = dict(batch=batch, dtype_bytes=dtype_bytes, scores_in_memory=scores_in_memory)

  def busy(rank: int, c: float, start: float) -> float:
    t = sum(w.time(hw) for w in costmodel.phase_work(config, c, start + c, **kw).values())
    return t

  def chunks_for(target: float) -> list[float]:
    out, start = [], 0.0
    for rank in range(p - 1):
      lo, hi = 0.0, C - start
      for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if busy(rank, mid, start) <= target else (lo, mid)
      out.append(lo)
      start += lo
    out.append(C - start)
    return out

  lo, hi = 0.0, busy(p - 1, C, 0.0) * 2
  for _ in range(80):
    mid = (lo + hi) / 2
    chunks = chunks_for(mid)
    last_start = C - chunks[-1]
    if busy(p - 1, chunks[-1], last_start) > mid:
      lo = mid
    else:
      hi = mid
  return round_to_multiple(chunks_for(hi), C, multiple)


# --- KVR-P: tables of searched partitions ------------------------------------------------------


def table_path(model: str, hardware: str, links: str, num_ranks: int) -> str:
  return os.path.join(PARTITION_DIR, f"{model}__{hardware}__{links}__p{num_ranks}.json")


def load_table(model: str, hardware: str, links: str, num_ranks: int) -> dict:
  path = table_path(model, hardware, links, num_ranks)
  if not os.path.exists(path):
    have = sorted(f[:-5] for f in os.listdir(PARTITION_DIR)) if os.path.isdir(PARTITION_DIR) else []
    raise ValueError(
      f"no partition table for model={model!r}, hardware={hardware!r}, "
      f"links={links!r}, p={num_ranks} ({path}); tables: {have}. Regenerate with "
      "`python -m launch.partition_tables`"
    )
  with open(path) as f:
    table = json.load(f)
  expected = {"model": model, "hardware": hardware, "links": links, "num_ranks": num_ranks}
  for key, value in expected.items():
    if table.get(key) != value:
      raise ValueError(f"{path}: table is for {key}={table.get(key)!r}, not {value!r}")
  return table


def predict_partition(table: dict, context_len: int, multiple: int = 1) -> tuple[int, ...]:
  """KVR-P: boundaries as fractions of C, linearly interpolated between the two table
  entries around C. Outside the table's range the nearest entry's fractions are used
  (clamped, not extrapolated). Exact at table points."""
  p = table["num_ranks"]
  _check_search_args(context_len, p, multiple)
  entries = sorted(table["entries"], key=lambda e: e["context_len"])
  for e in entries:
    if e["context_len"] == context_len:
      return round_to_multiple(e["partition"], context_len, multiple)

  def fractions(e):
    return [b / e["context_len"] for b in prefix_ends(e["partition"])[:-1]]

  if context_len <= entries[0]["context_len"]:
    frac = fractions(entries[0])
  elif context_len >= entries[-1]["context_len"]:
    frac = fractions(entries[-1])
  else:
    hi = next(i for i, e in enumerate(entries) if e["context_len"] > context_len)
    a, b = entries[hi - 1], entries[hi]
    w = (context_len - a["context_len"]) / (b["context_len"] - a["context_len"])
    frac = [(1 - w) * x + w * y for x, y in zip(fractions(a), fractions(b), strict=True)]
  bounds = [f * context_len for f in frac]
  edges = [0.0, *bounds, float(context_len)]
  return round_to_multiple([edges[i + 1] - edges[i] for i in range(p)], context_len, multiple)
