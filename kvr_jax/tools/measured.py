"""KVR-S over *measured* TTFT: the search engine with prefills on the actual mesh as objective.

It runs prefills, so it sits above kvr_jax.inference (the modelled search sits below it, in
kvr_jax.planning). Results are kept on disk as they are measured, so an interrupted search
resumes; `measured_partition` also keeps each answer for the rest of the process.

Per-rank phase times and the hardware fitted to them: kvr_jax.tools.phases.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import statistics
import weakref
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from kvr_jax.core import resources
from kvr_jax.inference.prefill import plan_prefill
from kvr_jax.inference.prefill_plan import cache_form_of
from kvr_jax.planning.partition import PartitionPlan
from kvr_jax.planning.search import Compare, descend_by_comparison
from kvr_jax.runtime.loading import Model
from kvr_jax.runtime.mesh import check_mesh
from kvr_jax.strategies import get_strategy, runahead
from kvr_jax.tools.timing import interval_verdict, time_interleaved
from models.kernels import get_kernel

# Answers of measured_partition, per model (weakly: a model that is gone takes its answers
# with it, and a new model never inherits an old one's by a reused id), at most
# MAX_REMEMBERED per model, least recently used dropped first.
MAX_REMEMBERED = 16
_ANSWERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _partitions(key: str, context_len: int) -> list[tuple[int, ...]] | None:
  """The partitions a batch key names ("a,b;c,d": the best first), or None if it names
  anything but partitions of `context_len` into positive chunks."""
  try:
    partitions = [tuple(int(c) for c in part.split(",")) for part in key.split(";")]
  except ValueError:
    return None
  if any(not chunks or min(chunks) < 1 or sum(chunks) != context_len for chunks in partitions):
    return None
  return partitions


def _valid_samples(samples) -> bool:
  return (
    isinstance(samples, list)
    and bool(samples)
    and all(isinstance(s, (int, float)) and np.isfinite(s) and s > 0 for s in samples)
  )


def _read_measured_cache(cache_path: str | None, setup: dict, context_len: int) -> dict:
  """The batches a measured-search cache holds for `setup`, checked: {} when there is none;
  ValueError (one line, naming the file) when it is corrupt, of another setup, or of the
  older search (one median per partition)."""
  if not cache_path or not os.path.exists(cache_path):
    return {}
  try:
    with open(cache_path) as f:
      stored = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{cache_path}: unreadable measured-search cache ({e}); delete it") from None
  if isinstance(stored, dict) and "results" in stored and "batches" not in stored:
    raise ValueError(
      f"{cache_path} holds the older measured search's medians (one per partition), not "
      "interleaved batches of samples; delete it or use another cache path"
    )
  if not isinstance(stored, dict) or not isinstance(stored.get("batches"), dict):
    raise ValueError(f"{cache_path}: not a measured-search cache (no batches object); delete it")
  if stored.get("setup") != json.loads(json.dumps(setup)):
    raise ValueError(
      f"{cache_path} holds measurements of another setup (model, prompt shape "
      "or devices); use another cache path"
    )
  for key, batch in stored["batches"].items():
    partitions = _partitions(key, context_len)
    names = None if partitions is None else [",".join(map(str, c)) for c in partitions]
    if (
      names is None
      or not isinstance(batch, dict)
      or sorted(batch) != sorted(names)
      or not all(_valid_samples(batch[name]) for name in names)
    ):
      raise ValueError(
        f"{cache_path}: bad batch {key!r} (partitions summing to {context_len}, each with "
        "positive times); delete the file"
      )
  return dict(stored["batches"])


def _stored_batches(cache_path: str | None, setup: dict, context_len: int) -> dict:
  """The batches the file holds, as the last process reads it, on every process.

  Why: the last process writes the file (`measured_comparison`), and every process must make
  the same decisions or their searches, and so their programs, diverge. Across hosts without
  a shared filesystem the other processes would read another file, or none. A refusal of the
  file (corrupt, another setup) reaches every process too, so none waits for the others."""
  if jax.process_count() == 1:
    return _read_measured_cache(cache_path, setup, context_len)
  payload = b""
  if jax.process_index() == jax.process_count() - 1:
    try:
      stored = {"batches": _read_measured_cache(cache_path, setup, context_len)}
    except ValueError as e:
      stored = {"error": str(e)}
    payload = json.dumps(stored).encode()
  stored = json.loads(_broadcast_bytes(payload).decode())
  if "error" in stored:
    raise ValueError(stored["error"])
  return stored["batches"]


def _broadcast_bytes(payload: bytes) -> bytes:
  """The last process's `payload` on every process (its length first: the arrays a broadcast
  takes have one shape everywhere)."""
  last = jax.process_index() == jax.process_count() - 1
  size = multihost_utils.broadcast_one_to_all(np.int32(len(payload)), is_source=last)
  buffer = np.zeros(int(size), np.uint8)
  if last:
    buffer[:] = np.frombuffer(payload, np.uint8)
  return np.asarray(multihost_utils.broadcast_one_to_all(buffer, is_source=last)).tobytes()


# Candidates timed with the best in one interleaved batch, at most: each keeps its latest
# result (a whole KV cache) while the batch runs.
BATCH = 4


def measured_comparison(
  model, tokens, mesh, *, repeats: int = 3, cache_path: str | None = None, progress=None
) -> Compare:
  """`descend_by_comparison`'s compare on `mesh`: the best and its candidates timed together,
  `repeats` interleaved rounds (`time_interleaved`: a drift of the machine's speed hits them
  alike), at most BATCH candidates a batch; a candidate is "ahead" of the best only where
  their min-max intervals separate (`interval_verdict`).

  Every batch's samples are written to `cache_path` (JSON) as soon as they are measured, so
  an interrupted search resumes where it stopped, making the same decisions. The file records
  what was measured (model, shape, devices) and is refused if it belongs to another setup.
  progress(n): called with the number of partitions timed so far.
  """
  tokens = np.asarray(tokens)
  setup = _measured_setup(model, tokens, mesh)
  batches: dict[str, dict] = _stored_batches(cache_path, setup, tokens.shape[-1])
  timed = [0]
  runs_on = _candidates_program(model, mesh, setup)

  def time_batch(partitions: list[tuple[int, ...]]) -> dict[str, list[float]]:
    key = ";".join(",".join(map(str, c)) for c in partitions)
    if key not in batches:
      batches[key] = _time_together(model, tokens, mesh, partitions, repeats, runs_on(partitions))
      if cache_path and jax.process_index() == jax.process_count() - 1:
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        # Another search may share the file: keep what it wrote meanwhile, then add ours.
        merged = _read_measured_cache(cache_path, setup, tokens.shape[-1])
        merged.update(batches)
        resources.write_json_atomically(cache_path, {"setup": setup, "batches": merged})
    timed[0] += len(partitions)
    if progress is not None:
      progress(timed[0])
    return batches[key]

  def compare(best: tuple[int, ...], candidates: list[tuple[int, ...]]) -> list:
    verdicts = []
    for first in range(0, len(candidates), BATCH):
      batch = [best, *candidates[first : first + BATCH]]
      samples = time_batch(batch)
      best_s = samples[",".join(map(str, best))]
      for chunks in batch[1:]:
        chunk_s = samples[",".join(map(str, chunks))]
        verdicts.append((interval_verdict(chunk_s, best_s), statistics.median(chunk_s)))
    return verdicts

  return compare


# The candidates' program holds chunks up to the longest one asked for plus this share of the
# prompt (the search moves a few steps of at most C/16p from its start), so that a search
# compiles once; a candidate past it gets a larger program.
ENVELOPE_SHARE = 8


def _candidates_program(model, mesh, setup: dict):
  """partitions -> the strategy a batch is timed with: KV-Runahead with the split as data
  (`runahead.split_as_data_strategy`) on one program for every candidate that fits its shape,
  where the kernel takes lengths as data and p > 1; else "kvr" (a program per split)."""
  latest = {}  # the shape in use and its strategy

  def runs_on(partitions):
    if setup["program"] != runahead.SPLIT_AS_DATA:
      return "kvr"
    longest = max(max(chunks) for chunks in partitions)
    if not latest or latest["shape"].chunk_len < longest:
      context_len = sum(partitions[0])
      reach = min(context_len, longest + context_len // ENVELOPE_SHARE)
      kernel = get_kernel(setup["kernel"])
      shape = runahead.OneBodyShape.envelope(model.config, partitions[0], kernel, reach)
      latest.update(shape=shape, strategy=runahead.split_as_data_strategy(model.config, shape))
    return latest["strategy"]

  return runs_on


def _measured_setup(model, tokens, mesh) -> dict:
  """Everything that changes a measured time, which keys the file: what runs (model, weights'
  dtype, the kernel the prefills resolve to, the program, the prompt's shape) and where
  (devices, kind)."""
  first_device = mesh.devices.reshape(-1)[0]
  kernel = get_strategy("kvr").resolve_attention(
    None, first_device, model.dtype, model.config.narrowest_window
  )
  # A model takes the split as data where its cache form runs it.
  takes_data = cache_form_of(model.config).takes_split_as_data
  one_program = kernel.lengths_as_data and check_mesh(mesh) > 1 and takes_data
  return {
    "program": runahead.SPLIT_AS_DATA if one_program else "kvr",
    "model": model.source,
    "config": model.config.to_dict(),
    "dtype": jnp.dtype(model.dtype).name,
    "kernel": kernel.name,
    "kernel_blocks": [kernel.query_block, kernel.key_block],
    "shape": list(tokens.shape),
    "devices": [str(d) for d in mesh.devices.reshape(-1)],
    "device_kind": first_device.device_kind,
  }


def _time_together(
  model, tokens, mesh, partitions, repeats: int, strategy="kvr"
) -> dict[str, list[float]]:
  """Each partition's warm KVR TTFTs, `repeats` interleaved rounds; the same samples in every
  process (the last rank's process sees the true TTFT, and every process must decide alike or
  their searches, and so their compiled programs, would diverge). strategy: "kvr" (each
  split its program, cache="last" as prefill's default) or a split-as-data strategy (one
  program; its parts left where they are: the TTFT, no move)."""
  one_program = get_strategy(strategy).options.split_shape is not None
  cache = "sharded" if one_program else "last"
  variants = {
    ",".join(map(str, chunks)): {
      "strategy": strategy,
      "mesh": mesh,
      "partition": list(chunks),
      "cache": cache,
    }
    for chunks in partitions
  }
  # On one program only the first candidate's first call compiles; the others' would only
  # run it once more untimed (a shared program's candidates are all warm after it).
  first_calls = list(variants)[:1] if one_program else None
  timings = time_interleaved(model, tokens, variants, repeats, first_calls)
  samples = np.array([timings[name].runs_s for name in variants], np.float64)
  if jax.process_count() > 1:
    last = jax.process_index() == jax.process_count() - 1
    samples = np.asarray(multihost_utils.broadcast_one_to_all(samples, is_source=last))
  return {name: [float(s) for s in row] for name, row in zip(variants, samples, strict=True)}


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
  max_chunk: int | None = None,
  first_step: int | None = None,
) -> tuple[int, ...]:
  """KVR-S over measured TTFT on the actual mesh (`descend_by_comparison` with
  `measured_comparison`), with a progress bar; resumable from disk. start, first_step: where
  the grid starts and its first step. The answer is a split no neighbour was shown faster
  than, at the finest step the measurements could still tell apart."""
  p = check_mesh(mesh)
  context_len = int(tokens.shape[-1])
  bar = tqdm(
    desc=f"measured KVR-S (C={context_len}, p={p})", unit=" partitions", disable=not show_progress
  )
  compare = measured_comparison(
    model,
    tokens,
    mesh,
    repeats=repeats,
    cache_path=cache_path,
    progress=lambda n: bar.update(n - bar.n),
  )
  try:
    return descend_by_comparison(
      compare,
      context_len,
      p,
      multiple=multiple,
      start=start,
      max_chunk=max_chunk,
      first_step=first_step,
    )
  finally:
    bar.close()


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
    p, context_len = check_mesh(mesh), tokens.shape[-1]
    answers[key] = measured_search(
      model,
      tokens,
      mesh,
      multiple=plan.multiple,
      cache_path=plan.cache_path,
      max_chunk=plan.max_chunk,
      # From the modelled search's split, with steps of at most C/16p tokens: the model's
      # split lies that close to the measured best (bench-llama, 8k on two processes:
      # [5555, 2637] modelled, [5573, 2619] measured), so the coarse steps would only
      # measure splits the model already ruled out, each a compile and 4 prefills.
      start=_modelled_start(model, tokens, mesh, plan),
      first_step=max(context_len // (16 * p), plan.multiple),
    )
    while len(answers) > MAX_REMEMBERED:
      answers.popitem(last=False)
  return answers[key]


def _modelled_start(model: Model, tokens, mesh, plan: PartitionPlan) -> tuple[int, ...]:
  """The modelled KVR-S split a measured search starts from: the split `prefill` would run
  for the plan's hardware, links, multiple and cap (its plan: the kernel KV-Runahead runs
  here, and across processes process 0's answer)."""
  modelled = dataclasses.replace(plan, objective="modelled", cache_path=None)
  return plan_prefill(model, tokens, "kvr", mesh=mesh, partition=modelled, cache="sharded").chunks
