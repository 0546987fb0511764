"""Timing a prefill, and synthetic prompts: what search, jobs, benchmark and demo share."""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from kvr_jax.inference.prefill import plan_prefill, run_prefill
from kvr_jax.inference.results import PrefillResult
from kvr_jax.runtime.loading import Model


def synthetic_prompt(vocab_size: int, context_len: int, batch: int = 1, seed: int = 0):
  """Random token ids [batch, context_len] from a fixed seed."""
  return np.random.RandomState(seed).randint(0, vocab_size, (batch, context_len)).astype(np.int32)


@dataclasses.dataclass
class PrefillTiming:
  first_s: float | None  # the first call: trace and compile (unless cached), then run
  runs_s: list[float]  # the warm runs after it (the whole TTFT, the cache move included)
  result: PrefillResult
  moves_s: list[float] = dataclasses.field(default_factory=list)  # cache="last": the move
  # Each warm run from its start until every process had finished its part (`_all_done`):
  # a rank before the last still attends its own rows after the last rank's logits.
  done_s: list[float] = dataclasses.field(default_factory=list)

  @property
  def median_s(self) -> float:
    return statistics.median(self.runs_s)

  @property
  def move_median_s(self) -> float | None:
    """The median time of moving the parts onto the last rank (0 for cache="sharded"; None
    where the move is inside the call, not timed apart: a hybrid's or a latent model's join)."""
    if self.moves_s:
      return statistics.median(self.moves_s)
    return None if self.result.cache == "last" else 0.0


def _timed_call(model: Model, tokens, cache: str, kwargs: dict):
  """One prefill call, timed: (result, seconds, seconds of the move onto the last rank)."""
  start = time.perf_counter()
  # prefill's plan and its run, the cache left where it was computed until it is timed apart
  plan = plan_prefill(model, tokens, cache=cache, **kwargs)
  cache = plan.cache  # "auto" resolved
  # A hybrid or latent model: its join is part of its call (its figures as prefill's).
  result = run_prefill(
    model, plan, tokens, move_cache=cache != "last" or not plan.cache_form.joins_apart
  )
  jax.block_until_ready((result.logits, result.past))  # the past: its form's pytree
  if not plan.cache_form.joins_apart:  # its join inside the call: no move timed apart
    return result, time.perf_counter() - start, None
  moved = time.perf_counter()
  if cache == "last":
    result = result.moved_to_last_rank()
    jax.block_until_ready(result.past)
  end = time.perf_counter()
  return result, end - start, end - moved


def time_prefill(model: Model, tokens, repeats: int, **kwargs) -> PrefillTiming:
  """One call, then `repeats` timed warm calls of `prefill(model, tokens, **kwargs)`.

  A call ends when the logits and KV cache are ready. With cache="last" (the default) the
  program and the move of the cache onto the last rank are timed apart (`moves_s`): the call
  is `run_prefill(..., move_cache=False)` then `gather_cache()`, which is what
  prefill(cache="last") runs (for KV-Runahead the "move" only joins, on the last rank, what
  its last hops brought with its own part). With a
  mesh spanning processes only the last rank's process holds the cache, so its clock is the
  TTFT; the others time their own part.
  """
  return time_interleaved(model, tokens, {"_": kwargs}, repeats)["_"]


def _all_done() -> None:
  """Across processes: wait, untimed, until every process has finished its part of the call
  (a barrier), so that no rank's leftover work (KV-Runahead's ranks before the last still
  attend their own rows in the last layer, which the last rank's logits do not wait for)
  runs into the next call and slows it, or rewards a split that leaves more of it."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("time_interleaved call")


def time_interleaved(
  model: Model, tokens, variants: dict[str, dict], rounds: int, first_calls=None
) -> dict[str, PrefillTiming]:
  """Every variant (name -> prefill keyword arguments) called once (its compile), then
  `rounds` rounds that time one warm call of each variant in turn, so that a drift of the
  machine's speed hits every variant alike, in `round_order`: no variant always runs first,
  or always right after the same one. Every sample's
  time is kept (`runs_s`), and of its results only the last: a variant's previous result is
  freed before it runs again. first_calls: the variants called once before the rounds
  (default every one); variants that share one compiled program need only one of them
  (their `first_s` is then None).

  Why both: keeping every result (each with its whole cache) grew a process by gigabytes
  over a run, and the move onto the last rank, which writes fresh memory, then cost up to 4x
  more in a round's later places than in its first (bench-mistral, 16k, two processes).
  Across processes every call ends with a barrier (`_all_done`): not in the time, which
  ends where this process's part of the result is ready, but in each sample's `done_s`."""
  setup, latest = {}, {}
  first_calls = set(variants) if first_calls is None else set(first_calls)
  for name, kwargs in variants.items():
    kwargs = dict(kwargs)
    cache = kwargs.pop("cache", "last")
    first_s = None
    if name in first_calls:
      latest[name], first_s, _ = _timed_call(model, tokens, cache, kwargs)
      _all_done()
    setup[name] = (cache, kwargs, first_s)
  samples: dict[str, list] = {name: [] for name in variants}
  names = list(variants)
  for r in range(rounds):
    for name in round_order(names, r):
      cache, kwargs, _ = setup[name]
      latest[name] = None  # its buffers freed before the next call allocates its own
      start = time.perf_counter()
      latest[name], seconds, move_s = _timed_call(model, tokens, cache, kwargs)
      _all_done()
      samples[name].append((seconds, move_s, time.perf_counter() - start))
  return {
    name: PrefillTiming(
      first_s,
      [seconds for seconds, _, _ in samples[name]],
      latest[name],
      [move_s for _, move_s, _ in samples[name] if move_s is not None]
      if latest[name].cache == "last"
      else [],
      [done_s for _, _, done_s in samples[name]],
    )
    for name, (_, _, first_s) in setup.items()
  }


def round_order(names: list, r: int) -> list:
  """The order of round r of an interleaved timing: the variants rotated by r (each round
  starts one later), the rest of every odd round reversed (ABCD, BADC, CDAB, DCBA). A plain
  rotation keeps every variant right after the same one in every round it does not start
  (ABCD, BCDA, CDAB: C always after B), so whatever a variant leaves behind (memory to free,
  a straggling process) would always land on the same next one."""
  n = len(names)
  rotated = list(names[r % n :]) + list(names[: r % n])
  return rotated[:1] + rotated[:0:-1] if r % 2 else rotated


def interval_verdict(samples_s, other_samples_s) -> str:
  """ "ahead" (faster) or "behind" where the two sets of samples' min-max intervals do not
  overlap, else "tie": a verdict that survives the noise of this machine's runs (10-30%
  between runs), as far as the samples show it. Both need at least one sample."""
  if not len(samples_s) or not len(other_samples_s):
    raise ValueError("interval_verdict needs samples on both sides")
  if max(samples_s) < min(other_samples_s):
    return "ahead"
  if min(samples_s) > max(other_samples_s):
    return "behind"
  return "tie"
