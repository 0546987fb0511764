"""What each process runs under launch.multiprocess (the same code on every process).

Each job returns a dict on the process that holds the last rank (the owner) and None
elsewhere. Kept in the library so that a process joined to a cluster by hand, or a test, can
call them directly.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from kvr_jax.inference.generate import decode_from, generate
from kvr_jax.inference.prefill import prefill, prefill_arguments
from kvr_jax.planning import presets
from kvr_jax.planning.partition import PartitionPlan, resolve_partition
from kvr_jax.runtime import faults
from kvr_jax.runtime.agreement import agreed
from kvr_jax.runtime.links import UNTHROTTLED, rate_bits
from kvr_jax.runtime.loading import load_model
from kvr_jax.runtime.mesh import make_mesh, mesh_of_ranks
from kvr_jax.strategies import get_strategy, runahead
from kvr_jax.tools import timeline
from kvr_jax.tools.measured import measured_partition
from kvr_jax.tools.phases import fitted_model_hardware
from kvr_jax.tools.timing import synthetic_prompt, time_interleaved
from launch.harness.variants import NAMES, Variant, get_variant


def check_job(
  model_name: str,
  context_len: int,
  partition,
  *,
  strategies=("kvr",),
  caches=("auto",),
  batch: int = 1,
  row_lengths=None,
  max_new_tokens: int = 8,
  temperature: float = 0.0,
  seed: int = 0,
  sampling_seed: int = 0,
  dtype: str = "auto",
  model_parallel: int = 1,
  before_decode=None,
) -> dict | None:
  """Each of `strategies` over every process's devices against the single-device oracle
  (computed again on the owner's own device): logits and tokens (greedy, or sampled at
  `temperature` with `sampling_seed`; `seed` makes the prompt). `partition` is
  KV-Runahead's (the others lay the prompt out themselves).

  model_parallel: devices per rank (a ("ranks", "model") mesh over all processes' devices,
  rank-major; the weights loaded straight into their shards), so a process with m devices is
  one rank. The oracle then loads its own whole copy on the owner.
  Each strategy runs under each of `caches` (keyed "kvr, cache=sharded" when there are
  several). cache="sharded": every process decodes; the tokens are gathered from every
  process and compared (`tokens_on_every_process`). before_decode(strategy): called on every
  process between a strategy's prefill and its decode (the launcher's fault injection).
  row_lengths: a ragged batch instead of `batch` rows of `context_len` tokens (the rows
  padded to the longest, each decoding from its own length)."""
  mesh = mesh_of_ranks(None, model_parallel)
  with faults.stage("loading the model"):
    model = load_model(model_name, dtype=dtype, mesh=mesh if model_parallel > 1 else None)
  tokens = _check_prompt(model.config.vocab_size, context_len, batch, row_lengths, seed)
  owner = jax.process_index() == mesh.devices.flat[-1].process_index
  decoding = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=sampling_seed)
  runs = {}
  for name, cache in itertools.product(strategies, caches):
    run = _prefill_and_decode(model, tokens, mesh, name, partition, cache, before_decode, decoding)
    runs[name if len(caches) == 1 else f"{name}, cache={cache}"] = run
  if not owner:
    return None
  whole = model if model_parallel == 1 else load_model(model_name, dtype=dtype)
  single = generate(whole, tokens, max_new_tokens, temperature, seed=sampling_seed)
  return {
    "process_index": jax.process_index(),
    "process_count": jax.process_count(),
    "num_ranks": int(mesh.shape["ranks"]),
    "model_parallel": model_parallel,
    "single_tokens": single.tokens.tolist(),
    "strategies": {name: _checked(*run, single) for name, run in runs.items()},
  }


def _prefill_and_decode(model, tokens, mesh, name, partition, cache, before_decode, decoding):
  """One strategy's prefill and decode on every process, each a named stage: (its
  GenerationResult, whether every process decoded the same tokens: None where one process
  or one holder decodes)."""
  with faults.stage(f"prefill {name}, cache={cache}"):
    ran = prefill(
      model, tokens, **prefill_arguments(name, mesh=mesh, partition=partition), cache=cache
    )
  if before_decode is not None:
    before_decode(name)
  with faults.stage(f"decode {name}, cache={cache}"):
    out = decode_from(
      model, ran, decoding["max_new_tokens"], decoding["temperature"], seed=decoding["seed"]
    )
  everywhere = None
  if out.tokens is not None and jax.process_count() > 1 and ran.cache == "sharded":
    gathered = multihost_utils.process_allgather(out.tokens)  # [processes, B, n]
    everywhere = bool((gathered == gathered[0]).all())
  return out, everywhere


def _check_prompt(vocab_size: int, context_len: int, batch: int, row_lengths, seed: int):
  """`batch` rows of `context_len` tokens, or a ragged batch of rows of `row_lengths`."""
  if not row_lengths:
    return synthetic_prompt(vocab_size, context_len, batch, seed)
  longest = synthetic_prompt(vocab_size, max(row_lengths), len(row_lengths), seed)
  return [row[:n] for row, n in zip(longest, row_lengths, strict=True)]


def _checked(out, everywhere, single) -> dict:
  """One strategy's generation against single's: the partition, the layout, the errors of
  the prefill's logits and of the last decode step's, and the tokens."""
  return {
    "partition": None if out.prefill.partition is None else list(out.prefill.partition),
    "cache": out.prefill.cache,
    "relative_logit_error": _relative_error(out.prefill.logits, single.prefill.logits),
    # the logits of the last token drawn: every decode step's cache and tail behind them
    "relative_last_step_error": _relative_error(out.last_logits, single.last_logits),
    "tokens": out.tokens.tolist(),
    "tokens_on_every_process": everywhere,
  }


def _relative_error(logits, reference) -> float:
  reference = np.asarray(reference)
  return float(np.abs(np.asarray(logits) - reference).max() / np.abs(reference).max())


def bench_job(
  model_name: str,
  context_lens,
  variants=NAMES,  # every variant (launch.harness.variants)
  *,
  repeats: int = 3,
  measured_multiple: int = 64,
  seed: int = 0,
  dtype: str = "auto",
  decode_tokens: int = 0,
  link_rate: str = UNTHROTTLED,
) -> dict | None:
  """Median TTFT of each variant at each context length, on every process's devices.

  link_rate: what the launcher throttled the loopback to (`runtime.links`); the cost-model
  variants (kvr-*-search, auto) plan for that bandwidth (the `local` calibration's latency),
  as a user names the link they run on: the calibration measured the link unthrottled.

  A variant named "<variant>:sharded" runs with cache="sharded" (the parts stay where they
  were computed), the others with cache="last" (the move onto the last rank in the TTFT).
  decode_tokens > 0: after the prefills, each variant's greedy decode of that many tokens
  from its cache, timed warm (`decode_tokens_per_s`; every process decodes from a sharded
  cache, only the last rank's from a whole one).

  single is the best single process (its default kernel, flash); single-dense is the paper's
  single-device baseline (dense masked scores); single-blocked skips masked blocks with the
  older blocked kernel. Every kvr and single variant runs its default kernel. kvr-search uses
  the cost model with the `local` presets measured here (this process's core, the real link
  between processes); kvr-measured runs KVR-S over measured TTFT once (its duration is
  reported as search_s) and then times the partition it found; kvr-fitted is KVR-S from the
  cost model with phase rates fitted to this model here (`fitted_plan`; fitting in search_s).
  """
  variants = [get_variant(v) for v in variants]  # names refused before anything loads
  model = load_model(model_name, dtype=dtype)
  mesh = make_mesh()
  rows = []
  # The process holding the last rank reports (one table, not one per process; auto's pick
  # of single runs there alone).
  owner = jax.process_index() == jax.process_count() - 1
  search = PartitionPlan("search", links=_links_at(link_rate))
  fitted: dict = {}  # length -> its fitted plan, one fitting for every variant that runs it
  for C in context_lens:
    tokens = synthetic_prompt(model.config.vocab_size, C, 1, seed)
    arguments, searches = {}, {}
    for variant in variants:
      arguments[variant.name], searches[variant.name] = _variant_arguments(
        variant, model, tokens, mesh, measured_multiple, search, fitted
      )
    # Interleaved: every variant compiled, then `repeats` rounds of one call each (ABCABC).
    timings = time_interleaved(model, tokens, arguments, repeats)
    for variant, timing in timings.items():
      rate = _decode_rate(model, timing.result, decode_tokens)
      rows.append(_bench_row(variant, C, timing, searches[variant], rate))
  if not owner:
    return None
  return {
    "process_count": jax.process_count(),
    "num_ranks": int(mesh.devices.size),
    "model": model_name,
    "rows": rows,
  }


def _bench_row(variant: str, context_len: int, timing, search_s: float, decode_rate) -> dict:
  result = timing.result
  return {
    "variant": variant,
    "cache": result.cache,
    "decode_tokens_per_s": decode_rate,
    "context_len": context_len,
    "ttft_s": timing.median_s,
    "samples_s": timing.runs_s,  # every warm run, in round order
    # the cache's move onto the last rank (in ttft_s; None: inside the call, not apart)
    "move_s": timing.move_median_s,
    # until every process had finished its part (a rank before the last still attends)
    "done_s": statistics.median(timing.done_s),
    "search_s": search_s,
    "strategy": result.strategy,  # what ran (auto: its pick)
    "kernel": result.attention,  # the attention kernel it ran (a fair fight says so)
    "partition": None if result.partition is None else list(result.partition),
    # KV-Runahead on a hybrid with a split per layer kind: the full layers' (`partition`
    # then the linear layers')
    "full_partition": None if result.full_partition is None else list(result.full_partition),
  }


def _decode_rate(model, result, tokens: int) -> float | None:
  """Greedy tokens per second decoded from `result`'s cache (a first call compiles; the
  second is timed); None when not asked for or where this process does not decode."""
  if tokens <= 0:
    return None
  decode_from(model, result, tokens)
  start = time.perf_counter()
  out = decode_from(model, result, tokens)
  seconds = time.perf_counter() - start
  return None if out.tokens is None else out.tokens.shape[1] / seconds


def _links_at(link_rate: str):
  """The links the cost model plans with: the `local` calibration, at `link_rate` where the
  loopback is throttled."""
  if link_rate == UNTHROTTLED:
    return presets.LOCAL
  local = presets.links_preset(presets.LOCAL)
  return dataclasses.replace(local, bandwidth=rate_bits(link_rate) / 8)  # bytes/s


def _variant_arguments(
  variant: str | Variant,
  model,
  tokens,
  mesh,
  measured_multiple: int,
  search: PartitionPlan,
  fitted: dict | None = None,
):
  """(prefill keyword arguments, seconds spent choosing its split) of one bench variant (a
  `Variant` or its name). search: the modelled plan of the "search" splits (kvr and auto).
  fitted: the "fitted" plans already made, by length (each variant's own fitting without):
  the layouts and forms of one length then compare on one split."""
  variant = get_variant(variant)
  if variant.one_process and jax.process_count() > 1:
    raise ValueError(f"variant {variant.name!r} runs in a one-process launch")
  start = time.perf_counter()
  partition = {"search": search, "even": "even", None: None}.get(variant.split)
  if variant.split == "measured":  # search once, timed apart from TTFT
    plan = PartitionPlan("search", objective="measured", multiple=measured_multiple)
    partition = list(measured_partition(model, tokens, mesh, plan))
  elif variant.split == "fitted":  # the cost model with this model's measured phase rates
    fitted = {} if fitted is None else fitted
    if tokens.shape[1] not in fitted:
      fitted[tokens.shape[1]] = fitted_plan(model, tokens.shape[1], int(mesh.devices.size))
    partition = fitted[tokens.shape[1]]
  if variant.one_split and isinstance(partition, PartitionPlan):
    partition = _one_split(partition, model.config, tokens.shape[1], mesh)
  search_s = time.perf_counter() - start if variant.split in ("measured", "fitted") else 0.0
  where = {} if variant.one_process else {"mesh": mesh}
  kwargs = prefill_arguments(
    variant.strategy, **where, partition=partition, attention=variant.attention
  )
  if variant.body is not None:  # one of KV-Runahead's program bodies, outside the registry
    kwargs["strategy"] = runahead.with_body(variant.body)
  if variant.cache is not None:
    kwargs["cache"] = variant.cache
  return kwargs, search_s


def _one_split(plan: PartitionPlan, config, context_len: int, mesh) -> list[int]:
  """The modelled search's one split for every layer kind: on a hybrid, what `plan` runs
  before it gives the full layers their own split where that models faster. Process 0's on
  every process (a fitted plan's rates are each process's own; every process must compile
  the same program)."""
  num_ranks = int(mesh.devices.size)
  split = resolve_partition(plan, context_len, num_ranks, config=config)
  return list(agreed("bench one split", (config, context_len), mesh, tuple(split)))


def fitted_plan(model, context_len: int, num_ranks: int) -> PartitionPlan:
  """KVR-S from the cost model, everything it plans with measured here: its FLOP/s fitted
  to this model's layers on this device (kvr_jax.tools.phases.fitted_model_hardware: a
  hybrid's, a latent model's or a K,V model's phases) and the link between the ranks as it
  is now (`presets.measure_links`, every process taking part: a throttled loopback at the
  rate this run gives it; a split searched for the stored unthrottled link loads the first
  rank's hops on a slow one). With several processes process 0's split wins (prefill
  broadcasts it)."""
  hardware = fitted_model_hardware(model, context_len, num_ranks)
  return PartitionPlan("search", hardware=hardware, links=presets.measure_links(hardware))


def timeline_job(
  model_name: str,
  context_len: int,
  strategies=("kvr", "allgather"),
  *,
  partition="search",
  repeats: int = 3,
  seed: int = 0,
  dtype: str = "auto",
  cache: str = "sharded",
) -> dict:
  """Every process: its measured timeline of each strategy (kvr_jax.tools.timeline), with
  `partition` for kvr (a method, lengths, or "fitted": `fitted_plan`), prefilling into
  `cache`; the launcher merges the processes' answers."""
  model = load_model(model_name, dtype=dtype)
  mesh = make_mesh()
  tokens = synthetic_prompt(model.config.vocab_size, context_len, 1, seed)
  hardware = None
  if partition == "fitted":
    partition = fitted_plan(model, context_len, int(mesh.devices.size))
    hardware = dataclasses.asdict(partition.hardware)
  runs = [
    timeline.probe_run(
      model,
      tokens,
      strategy,
      mesh=mesh,
      partition=partition if get_strategy(strategy).partitioned else None,
      repeats=repeats,
      cache=cache,
    )
    for strategy in strategies
  ]
  return {
    "process_index": jax.process_index(),
    "num_ranks": int(mesh.devices.size),
    "model": model_name,
    "context_len": context_len,
    "runs": runs,
    "hardware": hardware,  # the fitted cost-model hardware (partition="fitted"), else None
  }
