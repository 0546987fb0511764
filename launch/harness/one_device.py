"""One device's measured tables: long prompts with each kernel (`launch.benchmark --mode=long`)
and KV-Runahead's per-rank compute phases (`--mode=phases`). MEASURED."""

from __future__ import annotations

import dataclasses
import resource

from kvr_jax.runtime.loading import Model
from kvr_jax.tools.phases import rank_phase_times
from kvr_jax.tools.timing import synthetic_prompt, time_prefill
from launch.harness.report import Table


def long_prefill_table(model: Model, model_name: str, context_lens, kernels, repeats: int) -> Table:
  """Single-device prefill of long prompts with each kernel: TTFT, compile time and the
  process's peak RSS so far (launch.benchmark --mode=long)."""
  lines, records = [], []
  for C in context_lens:
    for kernel in kernels:
      tokens = synthetic_prompt(model.config.vocab_size, C)
      timing = time_prefill(model, tokens, repeats, attention=kernel)
      rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
      compile_s = timing.first_s - timing.median_s
      lines.append(
        f"{kernel:<8}{C:>7}  {timing.median_s:>8.3f}s  {compile_s:>7.2f}s  {rss:.2f} GiB"
      )
      records.append(
        dict(kernel=kernel, context_len=C, ttft_s=timing.median_s, compile_s=compile_s, rss_gib=rss)
      )
      del timing
  return Table(
    title=(f"MEASURED single-device prefill, {model_name}, float32:",),
    header=f"{'kernel':<8}{'C':>7}  {'TTFT':>9}  {'compile':>8}  peak RSS of the process so far",
    lines=tuple(lines),
    records=tuple(records),
  )


def phase_table(model: Model, model_name: str, partitions, kernels, repeats: int, threads: int):
  """Each rank's compute phases of KV-Runahead for each partition ("2048/2048") and kernel, on
  one device (launch.benchmark --mode=phases); communication not included."""
  lines, records = [], []
  for text in partitions:
    chunks = tuple(int(x) for x in text.split("/"))
    for kernel in kernels:  # every kernel asked for, each row naming its own
      for r in rank_phase_times(model, chunks, kernel, repeats=repeats):
        lines.append(
          f"{text:<16}{kernel:<8}{r.rank:>5}{r.chunk:>7}{r.prefix:>7}  {r.qkv_s:>7.3f}s"
          f"{r.attention_s:>10.3f}s{r.rest_s:>7.3f}s{r.total_s:>8.3f}s"
        )
        records.append(dict(partition=text, kernel=kernel, **dataclasses.asdict(r)))
  return Table(
    title=(
      f"MEASURED per-rank compute of KV-Runahead, {model_name}, all layers, one device with "
      f"{threads} thread(s); communication not included:",
    ),
    header=(
      f"{'partition':<16}{'kernel':<8}{'rank':>5}{'c_i':>7}{'S_i':>7}  {'qkv':>8}"
      f"{'attention':>11}{'rest':>8}{'total':>9}"
    ),
    lines=tuple(lines),
    records=tuple(records),
  )
