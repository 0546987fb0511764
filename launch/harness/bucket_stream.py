"""Length buckets measured: a stream of prompts of random new lengths through each strategy,
exact shapes against bucket ladders (programs compiled, the stream end to end, warm TTFT).
MEASURED."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from kvr_jax.core.caches import clear_caches
from kvr_jax.inference.buckets import BUCKETS_PER_OCTAVE, bucket_length, octave_ladder
from kvr_jax.inference.prefill import prefill, prefill_arguments
from kvr_jax.runtime.loading import Model
from kvr_jax.runtime.mesh import make_mesh
from kvr_jax.strategies import TRACE_COUNT
from kvr_jax.tools.timing import synthetic_prompt
from launch.harness.report import Table


@dataclasses.dataclass
class BucketStreamRow:
  """One strategy over one stream of prompts, with exact shapes or with one bucket ladder."""

  strategy: str
  ladder: str  # "exact", "auto" or "N/octave"
  prompts: int
  programs_traced: int  # the strategy's prefill programs traced over the stream
  stream_s: float  # the stream end to end: every prompt's first call (compiles included)
  warm_ratio: float  # median over prompts of warm TTFT with this ladder / with exact shapes
  warm_median_s: float  # median over prompts of each prompt's warm TTFT
  padding_fraction: float  # padded tokens / real tokens over the stream


def forget_compiled_programs() -> None:
  """Every compiled program and planned partition this process holds, dropped: the next
  call of any shape compiles (and plans) again, as in a new process."""
  jax.clear_caches()
  clear_caches()


def bucket_stream(
  model: Model,
  lengths,
  strategies=("single", "kvr", "ring", "allgather"),
  *,
  ladders: dict | None = None,
  num_devices: int | None = None,
  repeats: int = 3,
  seed: int = 0,
) -> list[BucketStreamRow]:
  """Prompts of the given lengths, one after another, per strategy with exact shapes and then
  with each ladder of `ladders` (name -> `buckets` argument; default {"auto": "auto"}): the
  programs traced (strategies.TRACE_COUNT), the stream's end-to-end time (each prompt's first
  call: what a server sees when prompts of new lengths arrive) and the warm TTFT against
  exact shapes (the cost of padding; `repeats` rounds over the prompts right after each
  stream). Every compiled program is dropped before each stream, so that ladders sharing
  buckets do not share programs. Every call ends at logits on the host."""
  ladders = {"auto": "auto"} if ladders is None else ladders
  mesh = make_mesh(num_devices)
  max_position = model.config.max_position_embeddings
  prompts = [
    synthetic_prompt(model.config.vocab_size, n, 1, seed + i)[0] for i, n in enumerate(lengths)
  ]
  shapes = {"exact": None, **ladders}
  rows = []
  for strategy in strategies:
    kwargs = prefill_arguments(strategy, mesh=mesh, partition="search")

    def call(tokens, buckets):
      start = time.perf_counter()
      np.asarray(prefill(model, tokens, buckets=buckets, **kwargs).logits)
      return time.perf_counter() - start

    streams, warm = {}, {}
    for name, buckets in shapes.items():
      forget_compiled_programs()  # ladders share buckets (4 per octave are among 8 per octave)
      traced = TRACE_COUNT[strategy]
      stream_s = sum(call(t, buckets) for t in tqdm(prompts, desc=f"{strategy} {name}"))
      streams[name] = (TRACE_COUNT[strategy] - traced, stream_s)
      # Warm, while this ladder's programs are compiled: `repeats` rounds over the prompts.
      rounds = [[call(t, buckets) for t in prompts] for _ in range(repeats)]
      warm[name] = [statistics.median(times) for times in zip(*rounds, strict=True)]
    for name, buckets in shapes.items():
      padded = sum(bucket_length(len(t), buckets, max_position) for t in prompts)
      ratios = [w / e for w, e in zip(warm[name], warm["exact"], strict=True)]
      rows.append(
        BucketStreamRow(
          strategy,
          name,
          len(prompts),
          streams[name][0],
          streams[name][1],
          statistics.median(ratios),
          statistics.median(warm[name]),
          padded / sum(lengths) - 1,
        )
      )
  return rows


def bucket_table(rows: list[BucketStreamRow], title: str) -> Table:
  """The stream against each ladder as launch.benchmark --mode=buckets prints it."""
  exact = {r.strategy: r for r in rows if r.ladder == "exact"}
  return Table(
    title=(
      title,
      "stream: every prompt's first call, compiles included (end to end, logits on the host);",
      "warm: median over prompts of the warm TTFT with the ladder / with exact shapes",
      "(--repeats rounds over the prompts after each stream; compiled programs dropped between).",
    ),
    header=(
      f"{'strategy':<10}{'shapes':<10}{'programs':>9}{'stream':>9}{'speed-up':>9}"
      f"{'warm vs exact':>14}{'padding':>8}"
    ),
    lines=tuple(
      f"{r.strategy:<10}{r.ladder:<10}{r.programs_traced:>9}{r.stream_s:>8.1f}s"
      f"{exact[r.strategy].stream_s / r.stream_s:>8.2f}x{r.warm_ratio:>13.2f}x"
      f"{r.padding_fraction:>8.1%}"
      for r in rows
    ),
    records=tuple(dataclasses.asdict(r) for r in rows),
  )


def named_ladders(per_octave: list[int], max_position: int) -> dict:
  """The ladders to compare, by name: "auto" (prefill's default, BUCKETS_PER_OCTAVE per
  doubling) or "n/octave" (`octave_ladder(n)` up to the model's last position)."""
  return {
    ("auto" if n == BUCKETS_PER_OCTAVE else f"{n}/octave"): (
      "auto" if n == BUCKETS_PER_OCTAVE else octave_ladder(n, max_position)
    )
    for n in per_octave
  }


def random_lengths(low: int, high: int, count: int, seed: int = 0) -> list[int]:
  """`count` prompt lengths drawn uniformly from [low, high] (seeded: the same stream)."""
  return [int(n) for n in np.random.RandomState(seed).randint(low, high + 1, count)]


def write_stream(path: str, lengths: list[int], rows: list[BucketStreamRow]) -> None:
  """The stream's lengths and rows as JSON."""
  with open(path, "w") as f:
    json.dump({"lengths": lengths, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
