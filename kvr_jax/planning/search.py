"""The KVR-S search engine, its modelled objective, and the direct balance.

search    hierarchical grid search over the p-1 chunk boundaries: moves of a coarse step
          first, refined by halving the step around the best point (what the paper does
          offline over measured TTFT). The objective is any function of the chunks: the
          modelled TTFT here (seconds to run), or the measured TTFT on a mesh
          (kvr_jax.tools.measured, which sits above prefill because it runs prefills).
descend   the same grid over an objective that can only be compared within its noise
          (measured TTFT): moves only to what the measurements show faster, and ends where
          they cannot tell the best from its neighbours.
balanced  no search: chunk sizes that equalise every rank's modelled per-layer compute
          time (c_i tokens of projections and MLP, c_i x S_i attention), so that all ranks
          would finish together if communication were free.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

from kvr_jax.core.chunks import check_multiple, even_partition, round_to_multiple
from kvr_jax.planning import costmodel
from kvr_jax.planning.costmodel import Setup
from kvr_jax.runtime.roofline import work_kwargs
from models.config import ModelConfig
from models.layer_kinds import FULL_ATTENTION

Objective = Callable[[tuple[int, ...]], float]


def search_partition(
  objective: Objective,
  context_len: int,
  num_ranks: int,
  *,
  multiple: int = 1,
  start: Sequence[int] | None = None,
  progress: Callable[[int], None] | None = None,
  max_chunk: int | None = None,
  first_step: int | None = None,
) -> tuple[int, ...]:
  """Hierarchical grid search for the chunk lengths that minimise `objective`.

  max_chunk: no chunk longer than this (a per-device memory cap: every rank's cache part and
  activations are as long as the longest chunk); at least ceil(C/p), so the even split fits.

  The grid step starts coarse (about C/2p tokens, or `first_step` tokens: a start known to be
  near the best needs no coarse steps) and halves down to one `multiple`. At each step the
  transfers of `step` tokens from one chunk to another (adjacent or not: moving the run of
  boundaries between them) are swept in order; a transfer that improves is taken and repeated
  while it improves (a line search along it), and the sweep goes on from the next one; sweeps
  repeat until one improves nothing, then the step halves around the best point. Each
  partition is evaluated once (memoised).

  Why not the best transfer of each sweep: it evaluates all p(p-1) transfers for every token
  moved, and a best point many steps away (a rank drained to one token on a slow link) took
  tens of thousands of evaluations at 16 ranks. Taking improvements as the sweep meets them
  ends in the same kind of point (no transfer of any step improves it) with 2-15x fewer
  evaluations; measured on the modelled objective it is as good on average (see
  docs/measurements.md).
  """
  check_multiple(context_len, num_ranks, multiple)
  p = num_ranks
  if p == 1:
    return (context_len,)
  cache: dict[tuple[int, ...], float] = {}

  def cost(chunks: tuple[int, ...]) -> float:
    if chunks not in cache:
      cache[chunks] = objective(chunks)
      if progress is not None:
        progress(len(cache))
    return cache[chunks]

  cap = context_len if max_chunk is None else max_chunk
  smallest, step = _grid(context_len, p, multiple, first_step)
  starts = [round_to_multiple(even_partition(context_len, p), context_len, multiple)]
  if start is not None:
    starts.append(round_to_multiple(start, context_len, multiple))
  best = min([s for s in starts if max(s) <= cap] or starts[:1], key=cost)
  while step >= multiple:
    best = _sweep_transfers(cost, best, step, cap, smallest)
    step //= 2
  return best


def _grid(context_len: int, p: int, multiple: int, first_step: int | None) -> tuple[list, int]:
  """Both searches' grid: each chunk's least length (a multiple; the last chunk one token)
  and the first step, about C/2p tokens or `first_step`, a power of two multiples."""
  first = context_len // (2 * p) if first_step is None else first_step
  units = max(first // multiple, 1)
  return [multiple] * (p - 1) + [1], (1 << (units.bit_length() - 1)) * multiple


def _moved(chunks: tuple[int, ...], donor: int, taker: int, delta: int) -> tuple[int, ...]:
  moved = list(chunks)
  moved[donor] -= delta
  moved[taker] += delta
  return tuple(moved)


def _sweep_transfers(cost, best: tuple[int, ...], delta: int, cap: int, smallest) -> tuple:
  """Sweeps of every transfer of `delta` tokens (donor, taker), each taken and repeated while
  it improves, until a whole sweep improves nothing."""
  improved = True
  while improved:
    improved = False
    for donor, taker in itertools.permutations(range(len(best)), 2):
      while best[donor] - delta >= smallest[donor] and best[taker] + delta <= cap:
        moved = _moved(best, donor, taker, delta)
        if cost(moved) >= cost(best):
          break
        best, improved = moved, True
  return best


# What a noisy objective's comparison says of a candidate against the best point: shown
# faster ("ahead": the measurements separate them), "tie" or shown slower ("behind"), and the
# candidate's typical value (its median), which ranks the ones shown faster.
Verdict = tuple[str, float]
Compare = Callable[[tuple[int, ...], list[tuple[int, ...]]], list[Verdict]]


def descend_by_comparison(
  compare: Compare,
  context_len: int,
  num_ranks: int,
  *,
  multiple: int = 1,
  start: Sequence[int] | None = None,
  max_chunk: int | None = None,
  first_step: int | None = None,
) -> tuple[int, ...]:
  """KVR-S over an objective that can only be compared, within its noise (measured TTFT):
  `compare(best, candidates)` times them together and says which are shown faster than best.

  From `start` (default: the even split), every round offers each transfer of `step` tokens
  from one chunk to another (the neighbours of `search_partition`'s grid) and moves to the
  fastest one shown faster. When none is:
    - every neighbour shown slower: the best lies within one step of the minimum, so the
      step halves (down to one `multiple`);
    - some neighbour ties: the measurements cannot tell the best from a point one step away,
      and a smaller step moves the time less: the search ends there.
  Why not `search_partition` on medians: it takes a move on any lower median, and at 8k on
  two processes neighbouring splits differ by less than the runs' spread, so it refined
  three step sizes and re-measured its top three (119 s) to return a split that tied the
  modelled start."""
  check_multiple(context_len, num_ranks, multiple)
  p = num_ranks
  cap = context_len if max_chunk is None else max_chunk
  best = round_to_multiple(even_partition(context_len, p), context_len, multiple)
  if start is not None:
    rounded = round_to_multiple(start, context_len, multiple)
    best = rounded if max(rounded) <= cap else best
  if p == 1:
    return best
  smallest, step = _grid(context_len, p, multiple, first_step)
  left = set()  # points moved away from are not offered again (noise cannot make a cycle)
  while step >= multiple:
    neighbours = [
      _moved(best, donor, taker, step)
      for donor, taker in itertools.permutations(range(p), 2)
      if best[donor] - step >= smallest[donor] and best[taker] + step <= cap
    ]
    neighbours = [n for n in neighbours if n not in left]
    if not neighbours:
      step //= 2
      continue
    verdicts = compare(best, neighbours)
    shown = zip(verdicts, neighbours, strict=True)
    faster = [(median, n) for (verdict, median), n in shown if verdict == "ahead"]
    if faster:
      left.add(best)
      best = min(faster)[1]
    elif all(verdict == "behind" for verdict, _ in verdicts):
      step //= 2
    else:
      break
  return best


def modelled_objective(
  config: ModelConfig, context_len: int, num_ranks: int, setup: Setup
) -> Objective:
  """Modelled KVR TTFT of a partition (seconds; see kvr_jax.planning.costmodel)."""
  return lambda chunks: (
    costmodel.simulate(
      config, "kvr", context_len, setup, num_ranks=num_ranks, partition=chunks
    ).ttft
  )


def modelled_search(
  config: ModelConfig,
  context_len: int,
  num_ranks: int,
  setup: Setup,
  *,
  multiple: int = 1,
  start: Sequence[int] | None = None,
  max_chunk: int | None = None,
) -> tuple[int, ...]:
  """KVR-S over the modelled TTFT, started from the balanced split unless `start` is given;
  no chunk longer than `max_chunk` (see search_partition)."""
  if start is None:
    start = balanced_partition(
      config, context_len, num_ranks, setup, multiple=multiple, max_chunk=max_chunk
    )
  objective = modelled_objective(config, context_len, num_ranks, setup)
  return search_partition(
    objective, context_len, num_ranks, multiple=multiple, start=start, max_chunk=max_chunk
  )


def splits_by_kind(config: ModelConfig) -> bool:
  """Whether KV-Runahead may give `config`'s layers a split per kind: a hybrid with both
  linear and full-attention layers (`kind_split_search`)."""
  linear = getattr(config, "linear_kind", None)
  return linear is not None and {linear, FULL_ATTENTION} <= set(config.kinds)


def kind_split_search(
  config: ModelConfig,
  context_len: int,
  num_ranks: int,
  setup: Setup,
  start=None,
  *,
  multiple: int = 1,
  max_chunk: int | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
  """KV-Runahead on a hybrid with a split per layer kind: (the linear layers' split, the
  full layers' own, or None where one split for both models as fast). A full layer's
  causal attention wants the earlier ranks longer, a linear layer's work is even per token;
  the moves between them (`costmodel.with_moves`) are priced, so a slow link keeps one
  split. Coordinate descent (the full layers' split with the linear one fixed, then the
  linear one, then the full once more; each a `search_partition`) from two starts: one
  split for both (`start`, else searched: any small step away from it pays a whole move,
  so it is a local optimum of its own) and each kind's own optimum (a model of that kind's
  layers alone). multiple, max_chunk: as `search_partition` holds both splits to them."""
  if not splits_by_kind(config):
    raise ValueError("a split per layer kind is a hybrid's, with linear and full layers")
  held = {"multiple": multiple, "max_chunk": max_chunk}
  one = (
    tuple(start)
    if start is not None
    else modelled_search(config, context_len, num_ranks, setup, **held)
  )

  def ttft(linear, full):
    return costmodel.simulate(
      config,
      "kvr",
      context_len,
      setup,
      num_ranks=num_ranks,
      partition=linear,
      full_partition=full,
    ).ttft

  def descend(linear, full):
    for fixed in ("linear", "full", "linear"):
      if fixed == "linear":
        objective = functools.partial(ttft, linear)
        full = search_partition(objective, context_len, num_ranks, start=full, **held)
      else:
        objective = functools.partial(lambda f, c: ttft(c, f), full)
        linear = search_partition(objective, context_len, num_ranks, start=linear, **held)
    return linear, full

  own = [
    modelled_search(config.of_kind(kind), context_len, num_ranks, setup, **held)
    for kind in (config.linear_kind, FULL_ATTENTION)
  ]
  best = min(descend(one, one), descend(*own), key=lambda pair: ttft(*pair))
  if ttft(*best) >= ttft(one, None):
    return one, None
  return best


def _compute_time_fn(config: ModelConfig, hw: costmodel.Hardware, **kw):
  """t(c, S): one layer's modelled compute time for c queries over S keys, fast.

  Every phase's FLOPs and bytes are bilinear in (c, S), so four evaluations of
  costmodel.phase_work give exact coefficients; the roofline max is then taken per phase.
  """
  if kw.get("causal_skip") or not kw.get("scores_in_memory", True):
    # S - (c-1)/2 visible keys is not bilinear in (c, S), and a fused kernel's attention runs
    # at its own FLOP/s: evaluate the phases directly.
    def direct(c: float, s: float) -> float:
      return sum(w.time(hw) for w in costmodel.phase_work(config, c, s, **kw).values())

    return direct
  coefficients = []
  for name in ("qkv", "attention", "rest"):

    def at(c, s, name=name):
      w = costmodel.phase_work(config, c, s, **kw)[name]
      return w.flops, w.bytes

    (f00, b00), (f10, b10), (f01, b01), (f11, b11) = at(0, 0), at(1, 0), at(0, 1), at(1, 1)
    coefficients.append(
      (
        (f00, f10 - f00, f01 - f00, f11 - f10 - f01 + f00),
        (b00, b10 - b00, b01 - b00, b11 - b10 - b01 + b00),
      )
    )

  def time(c: float, s: float) -> float:
    total = 0.0
    for (f0, fc, fs, fcs), (b0, bc, bs, bcs) in coefficients:
      total += max(
        (f0 + fc * c + fs * s + fcs * c * s) / hw.flops,
        (b0 + bc * c + bs * s + bcs * c * s) / hw.bandwidth,
      )
    return total

  return time


def balanced_partition(
  config: ModelConfig,
  context_len: int,
  num_ranks: int,
  setup: Setup,
  *,
  multiple: int = 1,
  max_chunk: int | None = None,
) -> tuple[int, ...]:
  """Chunks that equalise each rank's modelled per-layer compute time (no search); with
  `max_chunk`, no rank takes more than that (the later ones take what the cap leaves).

  Communication is ignored (sends are asynchronous and, at high bandwidth, hidden); at low
  bandwidth the chain of hops dominates and `search` does clearly better. For a target time
  T, rank 0 takes the largest chunk whose compute fits in T, rank 1 likewise given S_0, and so
  on; the last rank takes the rest. Bisection on T makes the last rank's time equal T too.
  """
  check_multiple(context_len, num_ranks, multiple)
  p, C = num_ranks, context_len
  if p == 1:
    return (C,)
  cap = float(C if max_chunk is None else max_chunk)
  # Communication between ranks (setup.links) is not part of the balance (see docstring); a
  # rank's own all-reduces over its model group are, being work on its chunk.
  shard = costmodel.model_shard(config, setup.model_parallel)
  shard_compute = _compute_time_fn(shard, setup.hardware, **work_kwargs(setup))

  def compute(c: float, s: float) -> float:
    return shard_compute(c, s) + costmodel.model_reduce_time(shard, c, setup)

  def chunks_for(target: float) -> list[float] | None:
    """Greedy chunks for time `target`; None when the first p-1 ranks already take all C."""
    out, start = [], 0.0
    for _ in range(p - 1):
      lo, hi = 0.0, min(C - start, cap)
      for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if compute(mid, start + mid) <= target else (lo, mid)
      out.append(lo)
      start += lo
      if start >= C:
        return None
    out.append(C - start)
    return out

  lo, hi = 0.0, compute(C, C) * 2
  for _ in range(50):
    mid = (lo + hi) / 2
    chunks = chunks_for(mid)
    if chunks is not None and compute(chunks[-1], C) > mid:
      lo = mid  # the last rank is left with more than T: raise T
    else:
      hi = mid
  chunks = chunks_for(lo) or even_partition(C, p)
  return within_cap(round_to_multiple(chunks, C, multiple), max_chunk)


def within_cap(chunks: Sequence[int], max_chunk: int | None) -> tuple[int, ...]:
  """Moves what rounding put above `max_chunk` onto the next chunks with room (a few tokens
  at most; the total and order are kept). `max_chunk` >= ceil(C/p) guarantees room."""
  chunks = list(chunks)
  if max_chunk is None:
    return tuple(chunks)
  for i in range(len(chunks)):
    excess = chunks[i] - max_chunk
    j = 0
    while excess > 0 and j < len(chunks):
      room = max_chunk - chunks[j]
      if j != i and room > 0:
        moved = min(room, excess)
        chunks[i] -= moved
        chunks[j] += moved
        excess -= moved
      j += 1
  return tuple(chunks)
