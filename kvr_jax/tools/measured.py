"""KVR-S over *measured* TTFT: the search engine with prefills on the actual mesh as objective.

It runs prefills, so it sits above kvr_jax.inference (the modelled search sits below it, in
kvr_jax.planning). Results are kept on disk as they are measured, so an interrupted search
resumes; `measured_partition` also keeps each answer for the rest of the process.
"""

from __future__ import annotations

import collections
import json
import os
import weakref
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from kvr_jax.core import resources
from kvr_jax.planning.partition import PartitionPlan
from kvr_jax.planning.search import Objective, search_partition
from kvr_jax.runtime.loading import Model
from kvr_jax.runtime.mesh import check_mesh
from kvr_jax.tools.timing import time_prefill

# Answers of measured_partition, per model (weakly: a model that is gone takes its answers
# with it, and a new model never inherits an old one's by a reused id), at most
# MAX_REMEMBERED per model, least recently used dropped first.
MAX_REMEMBERED = 16
_ANSWERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def measured_objective(
  model, tokens, mesh, *, repeats: int = 3, cache_path: str | None = None
) -> Objective:
  """Measured KVR TTFT of a partition on `mesh` (median of `repeats` warm runs, seconds).

  Every result is appended to `cache_path` (JSON) as soon as it is measured, so an interrupted
  search resumes where it stopped. The file records what was measured (model, shape, devices)
  and is refused if it belongs to another setup.
  """
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
      last = jax.process_index() == jax.process_count() - 1
      elapsed = float(multihost_utils.broadcast_one_to_all(np.float64(elapsed), is_source=last))
    return elapsed

  def objective(chunks: tuple[int, ...]) -> float:
    key = ",".join(map(str, chunks))
    if key not in results:
      results[key] = measure(chunks, repeats)
      if cache_path and jax.process_index() == jax.process_count() - 1:
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        resources.write_json_atomically(cache_path, {"setup": setup, "results": results})
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
  max_chunk: int | None = None,
) -> tuple[int, ...]:
  """KVR-S over measured TTFT on the actual mesh, with a progress bar; resumable from disk.

  Measurements are noisy and XLA's times depend on shapes unevenly, so the `verify_top` best
  partitions seen are measured again with twice the repeats and the fastest is returned.
  """
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
      max_chunk=max_chunk,
    )
  finally:
    bar.close()
  ranked = sorted(objective.results.items(), key=lambda item: (item[1], item[0]))
  candidates = [tuple(int(c) for c in key.split(",")) for key, _ in ranked]
  # The cache file may hold partitions of another search (another cap): only those that fit.
  candidates = [c for c in candidates if max_chunk is None or max(c) <= max_chunk][:verify_top]
  if len(candidates) > 1:
    best = min(candidates, key=lambda chunks: objective.measure(chunks, 2 * repeats))
  return best


def measured_partition(model: Model, tokens, mesh, plan: PartitionPlan | None = None):
  """The chunks of a measured KVR-S (PartitionPlan("search", objective="measured", ...)) for
  these prompt shapes on `mesh`, searched once per (model, mesh, shape, plan) in a process."""
  if plan is None:
    plan = PartitionPlan("search", objective="measured")
  if not isinstance(plan, PartitionPlan) or plan.objective != "measured":
    raise ValueError(f"measured_partition takes a measured PartitionPlan, got {plan!r}")
  tokens = np.asarray(tokens)
  if tokens.ndim == 1:
    tokens = tokens[None]
  answers = _ANSWERS.setdefault(model, collections.OrderedDict())
  key = (mesh, tokens.shape, plan)
  if key in answers:
    answers.move_to_end(key)
  else:
    answers[key] = measured_search(
      model,
      tokens,
      mesh,
      multiple=plan.multiple,
      cache_path=plan.cache_path,
      max_chunk=plan.max_chunk,
    )
    while len(answers) > MAX_REMEMBERED:
      answers.popitem(last=False)
  return answers[key]
