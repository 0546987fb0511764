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
    high -= high % multiple
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

  The grid step starts coarse (about C/2p tokens) and halves down to one `multiple`. At each
  step, every transfer of `step` tokens from one chunk to another (adjacent or not: moving the
  run of boundaries between them) is tried, best improvement first, until none improves; then
  the step halves around the best point. Each partition is evaluated once (memoised).
  """
  _check_search_args(context_len, num_ranks, multiple)
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

  def smallest(i: int) -> int:  # the last chunk only needs one token; the others a multiple
    return 1 if i == p - 1 else multiple

  starts = [round_to_multiple(even_partition(context_len, p), context_len, multiple)]
  if start is not None:
    starts.append(round_to_multiple(start, context_len, multiple))
  best = min(starts, key=cost)
  units = max(context_len // (2 * p * multiple), 1)
  step = 1 << (units.bit_length() - 1)
  while step >= 1:
    delta = step * multiple
    while True:
      candidates = []
      for donor in range(p):
        if best[donor] - delta < smallest(donor):
          continue
        for taker in range(p):
          if taker != donor:
            moved = list(best)
            moved[donor] -= delta
            moved[taker] += delta
            candidates.append(tuple(moved))
      better = min(candidates, key=cost, default=best)
      if cost(better) < cost(best):
        best = better
      else:
        break
    step //= 2
  return best


def modelled_objective(
  config: ModelConfig, context_len: int, num_ranks: int, **sim_kwargs
) -> Objective:
  """Modelled KVR TTFT of a partition (seconds; see kvr_jax.costmodel)."""
  return lambda chunks: (
    costmodel.simulate(
      config, "kvr", context_len, num_ranks=num_ranks, partition=chunks, **sim_kwargs
    ).ttft
  )


def modelled_search(
  config: ModelConfig,
  context_len: int,
  num_ranks: int,
  *,
  multiple: int = 1,
  start: Sequence[int] | None = None,
  **sim_kwargs,
) -> tuple[int, ...]:
  """KVR-S over the modelled TTFT, started from the balanced split unless `start` is given.

  sim_kwargs go to costmodel.simulate (batch, hardware, links, dtype_bytes, ...)."""
  if start is None:
    start = balanced_partition(config, context_len, num_ranks, multiple=multiple, **sim_kwargs)
  objective = modelled_objective(config, context_len, num_ranks, **sim_kwargs)
  return search_partition(objective, context_len, num_ranks, multiple=multiple, start=start)


def _compute_time_fn(config: ModelConfig, hw: costmodel.Hardware, **kw):
  """t(c, S): one layer's modelled compute time for c queries over S keys, fast.

  Every phase's FLOPs and bytes are bilinear in (c, S), so four evaluations of
  costmodel.phase_work give exact coefficients; the roofline max is then taken per phase.
  """
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
  bandwidth the chain of hops dominates and `search` does clearly better. For a target time
  T, rank 0 takes the largest chunk whose compute fits in T, rank 1 likewise given S_0, and so
  on; the last rank takes the rest. Bisection on T makes the last rank's time equal T too.
  """
  _check_search_args(context_len, num_ranks, multiple)
  p, C = num_ranks, context_len
  if p == 1:
    return (C,)
  del links  # communication is not part of the balance (see docstring)
  hw = costmodel.hardware_preset(hardware)
  compute = _compute_time_fn(
    config, hw, batch=batch, dtype_bytes=dtype_bytes, scores_in_memory=scores_in_memory
  )

  def chunks_for(target: float) -> list[float] | None:
    """Greedy chunks for time `target`; None when the first p-1 ranks already take all C."""
    out, start = [], 0.0
    for _ in range(p - 1):
      lo, hi = 0.0, C - start
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
  return round_to_multiple(chunks, C, multiple)


# --- KVR-P: tables of searched partitions ------------------------------------------------------


def table_path(
  model: str, hardware: str, links: str, num_ranks: int, directory: str = PARTITION_DIR
) -> str:
  return os.path.join(directory, f"{model}__{hardware}__{links}__p{num_ranks}.json")


def load_table(
  model: str, hardware: str, links: str, num_ranks: int, directory: str = PARTITION_DIR
) -> dict:
  """The KVR-P table for (model, hardware, links, p); checks it is the table it claims."""
  path = table_path(model, hardware, links, num_ranks, directory)
  if not os.path.exists(path):
    have = sorted(f[:-5] for f in os.listdir(directory)) if os.path.isdir(directory) else []
    raise ValueError(
      f"no partition table for model={model!r}, hardware={hardware!r}, "
      f"links={links!r}, p={num_ranks} ({path}); tables: {have}. Regenerate with "
      "`python -m launch.partition_tables`"
    )
  try:
    with open(path) as f:
      table = json.load(f)
    entries_ok = all(len(e["partition"]) == num_ranks for e in table["entries"])
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise ValueError(f"{path}: corrupt partition table ({e!r})") from None
  if not entries_ok or not table["entries"]:
    raise ValueError(f"{path}: corrupt partition table (entries must have {num_ranks} chunks)")
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


# --- KVR-S with a measured objective -----------------------------------------------------------


def measured_objective(
  model, tokens, mesh, *, repeats: int = 3, cache_path: str | None = None
) -> Objective:
  """Measured KVR TTFT of a partition on `mesh` (median of `repeats` warm runs, seconds).

  Every result is appended to `cache_path` (JSON) as soon as it is measured, so an interrupted
  search resumes where it stopped. The file records what was measured (model, shape, devices)
  and is refused if it belongs to another setup.
  """
  import jax
  import numpy as np

  from kvr_jax.demo import time_prefill  # only the measured objective needs the inference stack

  tokens = np.asarray(tokens)
  setup = {
    "model": model.source,
    "config": model.config.to_dict(),
    "shape": list(tokens.shape),
    "devices": [str(d) for d in mesh.devices.reshape(-1)],
    "device_kind": mesh.devices.reshape(-1)[0].device_kind,
  }
  results: dict[str, float] = {}
  if cache_path and os.path.exists(cache_path):
    try:
      with open(cache_path) as f:
        stored = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{cache_path}: corrupt measured-search cache ({e}); delete it") from None
    if stored.get("setup") != json.loads(json.dumps(setup)):
      raise ValueError(
        f"{cache_path} holds measurements of another setup (model, prompt shape "
        "or devices); use another cache path"
      )
    results = stored["results"]

  def measure(chunks: tuple[int, ...], times_to_run: int) -> float:
    """Median of `times_to_run` warm runs; the same value in every process."""
    elapsed = time_prefill(
      model, tokens, times_to_run, strategy="kvr", mesh=mesh, partition=list(chunks)
    ).median_s
    if jax.process_count() > 1:
      # The last rank's process sees the true TTFT; every process must take the same value
      # or their searches (and so their compiled programs) would diverge.
      from jax.experimental import multihost_utils

      last = jax.process_index() == jax.process_count() - 1
      elapsed = float(multihost_utils.broadcast_one_to_all(np.float64(elapsed), is_source=last))
    return elapsed

  def objective(chunks: tuple[int, ...]) -> float:
    key = ",".join(map(str, chunks))
    if key not in results:
      results[key] = measure(chunks, repeats)
      if cache_path and jax.process_index() == jax.process_count() - 1:
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        tmp = cache_path + ".tmp"
        with open(tmp, "w") as f:
          json.dump({"setup": setup, "results": results}, f, indent=1)
        os.replace(tmp, cache_path)  # atomic: an interruption never leaves half a file
    return results[key]

  objective.results = results  # for the final check in measured_search
  objective.measure = measure
  return objective


def measured_search(
  model,
  tokens,
  mesh,
  *,
  multiple: int = 1,
  repeats: int = 3,
  cache_path: str | None = None,
  start: Sequence[int] | None = None,
  show_progress: bool = True,
  verify_top: int = 3,
) -> tuple[int, ...]:
  """KVR-S over measured TTFT on the actual mesh, with a progress bar; resumable from disk.

  Measurements are noisy and XLA's times depend on shapes unevenly, so the `verify_top` best
  partitions seen are measured again with twice the repeats and the fastest is returned.
  """
  from tqdm.auto import tqdm

  from kvr_jax.mesh import check_mesh

  p = check_mesh(mesh)
  context_len = int(tokens.shape[-1])
  objective = measured_objective(model, tokens, mesh, repeats=repeats, cache_path=cache_path)
  bar = tqdm(
    desc=f"measured KVR-S (C={context_len}, p={p})", unit=" partitions", disable=not show_progress
  )
  try:
    best = search_partition(
      objective,
      context_len,
      p,
      multiple=multiple,
      start=start,
      progress=lambda n: bar.update(n - bar.n),
    )
  finally:
    bar.close()
  ranked = sorted(objective.results.items(), key=lambda item: (item[1], item[0]))[:verify_top]
  if len(ranked) > 1:
    candidates = [tuple(int(c) for c in key.split(",")) for key, _ in ranked]
    best = min(candidates, key=lambda chunks: objective.measure(chunks, 2 * repeats))
  return best
