"""Timing a prefill, and synthetic prompts: what search, jobs, benchmark and demo share."""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

from kvr_jax.inference.prefill import PrefillResult, prefill
from kvr_jax.runtime.loading import Model


def synthetic_prompt(vocab_size: int, context_len: int, batch: int = 1, seed: int = 0):
  """Random token ids [batch, context_len] from a fixed seed."""
  return np.random.RandomState(seed).randint(0, vocab_size, (batch, context_len)).astype(np.int32)


@dataclasses.dataclass
class PrefillTiming:
  first_s: float  # the first call: trace and compile (unless cached), then run
  runs_s: list[float]  # the warm runs after it
  result: PrefillResult

  @property
  def median_s(self) -> float:
    return statistics.median(self.runs_s)


def time_prefill(model: Model, tokens, repeats: int, **kwargs) -> PrefillTiming:
  """One call, then `repeats` timed warm calls of `prefill(model, tokens, **kwargs)`.

  A call ends when the logits and KV cache are ready. With a mesh spanning processes only the
  last rank's process holds them, so its clock is the TTFT; the others time their own part.
  """

  def run():
    start = time.perf_counter()
    result = prefill(model, tokens, **kwargs)
    if result.is_local:
      jax.block_until_ready((result.logits, result.k_cache, result.v_cache, result.kv_parts))
    return result, time.perf_counter() - start

  result, first = run()
  return PrefillTiming(first, [run()[1] for _ in range(repeats)], result)
