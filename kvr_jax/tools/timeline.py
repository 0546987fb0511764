"""Measured per-rank timelines of a prefill.

`probe_run` (every process of a run calls it) compiles the strategy with timeline probes
(kvr_jax.strategies.probe), runs it, and returns this process's records: when each of its
ranks finished each phase of each layer, on the host's CLOCK_MONOTONIC, and the TTFT of the
same prefill without probes (the perturbation is the difference). `intervals` turns the
records of every process into (rank, layer, phase, start, end) intervals: a phase starts
where the rank's previous mark was; `kvr_jax.planning.costmodel.simulate(..., intervals=)`
gives the cost model's intervals of the same strategy and partition, and
launch/harness/timelines.py draws both, ranks by time, the paper's kind of figure. The probed
run prefills into cache "sharded" unless told "last" (then the move onto the last rank, or
KV-Runahead's kept last hops, is in the run).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax

from kvr_jax.inference.prefill import plan_prefill, prefill_arguments, run_prefill
from kvr_jax.runtime.loading import Model
from kvr_jax.strategies import probe
from kvr_jax.tools.timing import time_prefill


def probe_run(
  model: Model,
  tokens,
  strategy: str,
  *,
  mesh,
  partition=None,
  attention=None,
  repeats: int = 3,
  cache: str = "sharded",
) -> dict:
  """This process's measured timeline of `strategy` (the middle of `repeats` probed runs) and
  the TTFT without probes; the same call in every process of a multi-process run. cache: the
  layout both runs prefill into ("sharded": every part where computed; "last": joined on the
  last rank, KV-Runahead keeping its last hops, the move part of the call)."""
  kwargs = prefill_arguments(strategy, mesh=mesh, partition=partition, attention=attention)
  plain = time_prefill(model, tokens, repeats, cache=cache, **kwargs)
  if isinstance(partition, Mapping):  # a hybrid's split per layer kind, lengths as given
    partition = {kind: list(chunks) for kind, chunks in partition.items()}
  else:
    partition = plain.result.partition
    if partition is not None:
      partition = kwargs["partition"] = list(partition)  # the same split in the probed program

  def probed():
    probe.EVENTS.clear()
    start = probe.now_ns()
    plan = plan_prefill(model, tokens, cache=cache, timeline=True, **kwargs)
    result = run_prefill(model, plan, tokens)
    # Every array the result holds: a strategy's parts or joined cache, a model's own.
    arrays = [a for a in jax.tree.leaves(vars(result)) if isinstance(a, jax.Array)]
    jax.block_until_ready(arrays)
    return probe.now_ns() - start, start, list(probe.EVENTS)

  probed()  # compile
  runs = [probed() for _ in range(repeats)]
  # The same call in every process (their records must line up): the middle one in call
  # order, not each process's own median.
  duration, start, events = runs[len(runs) // 2]
  return {
    "strategy": strategy,
    "process_index": jax.process_index(),
    "partition": partition,  # lengths, or {"linear": .., "full": ..}
    "cache": cache,
    "ttft_s": plain.median_s,
    "probed_ttft_s": duration / 1e9,
    "probed_runs_s": [run[0] / 1e9 for run in runs],
    "start_ns": start,
    "events": [list(e) for e in events],
  }


def intervals(runs: list[dict]) -> list[tuple[int, int, str, float, float]]:
  """Every process's records of one strategy -> (rank, layer, phase, start s, end s), times
  from the earliest process's call. Each phase starts at its rank's previous mark."""
  origin = min(r["start_ns"] for r in runs)
  out = []
  for run in runs:
    by_rank: dict[int, list] = {}
    for rank, layer, label, ns in run["events"]:
      by_rank.setdefault(rank, []).append((ns, layer, label))
    for rank, events in by_rank.items():
      previous = run["start_ns"]
      for ns, layer, label in sorted(events):
        out.append((rank, layer, label, (previous - origin) / 1e9, (ns - origin) / 1e9))
        previous = ns
  return sorted(out, key=lambda i: (i[0], i[3]))


def span_s(runs: list[dict]) -> float:
  """From the call's start in the last process (whose clock is the TTFT: it holds the last
  rank) to the last rank's last mark (its logits: the answer). Other ranks may still be
  finishing work nobody waits for (their own unused logits)."""
  owner = max(runs, key=lambda r: r["process_index"])
  last_rank = max(e[0] for e in owner["events"])
  return (max(e[3] for e in owner["events"] if e[0] == last_rank) - owner["start_ns"]) / 1e9
