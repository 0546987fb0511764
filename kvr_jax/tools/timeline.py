"""Measured per-rank timelines of a prefill, and the cost model's timeline of the same run.

`probe_run` (every process of a run calls it) compiles the strategy with timeline probes
(kvr_jax.strategies.probe), runs it, and returns this process's records: when each of its
ranks finished each phase of each layer, on the host's CLOCK_MONOTONIC, and the TTFT of the
same prefill without probes (the perturbation is the difference). `intervals` turns the
records of every process into (rank, layer, phase, start, end) intervals: a phase starts
where the rank's previous mark was; `kvr_jax.planning.costmodel.simulate(..., intervals=)`
gives the cost model's intervals of the same strategy and partition, and `plot` draws both, ranks by
time, the paper's kind of figure. The probed run prefills into cache "sharded" unless told
"last" (then the move onto the last rank, or KV-Runahead's kept last hops, is in the run).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import jax

from kvr_jax.inference.prefill import plan_prefill, prefill_arguments, run_prefill
from kvr_jax.planning import costmodel, presets
from kvr_jax.runtime import distributed
from kvr_jax.runtime.loading import Model
from kvr_jax.strategies import probe
from kvr_jax.tools.report import Table
from kvr_jax.tools.timing import time_prefill

# Phases drawn in a fixed colour each; hops and ring steps share one.
COLOURS = {
  "embed": "#bbbbbb",
  "qkv": "#4c72b0",
  "wait": "#eeeeee",
  "hop": "#dd8452",
  "allgather": "#dd8452",
  "step": "#dd8452",
  "diagonal": "#8fd19e",  # KVR: a rank's own chunk, attended while it waits for the prefix
  "attention": "#55a868",
  "rest": "#8172b3",
  "logits": "#937860",
}


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


def _colour(phase: str) -> str:
  for key, colour in COLOURS.items():
    if phase.startswith(key):
      return colour
  return "#cccccc"


def plot(panels: list[tuple[str, list]], path: str, title: str) -> None:
  """A Gantt chart per panel (title, intervals): ranks by time, phases coloured, layers
  separated by thin gaps; hops drawn as arrows from the sender's row to the receiver's."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(len(panels), 1, figsize=(14, 2.2 * len(panels) + 1), squeeze=False)
  for ax, (name, items) in zip(axes[:, 0], panels, strict=True):
    ranks = sorted({i[0] for i in items})
    for rank, _, phase, start, end in items:
      if phase.startswith("hop") and name.startswith("MODELLED"):
        sender = int(phase[3:])
        ax.annotate(
          "",
          xy=(end * 1e3, sender + 1),
          xytext=(start * 1e3, sender),
          arrowprops=dict(arrowstyle="->", color=COLOURS["hop"], lw=0.8),
        )
        continue
      ax.barh(rank, (end - start) * 1e3, left=start * 1e3, color=_colour(phase), height=0.7)
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("ms")
  handles = [
    matplotlib.patches.Patch(color=c, label=k) for k, c in COLOURS.items() if k not in ("step",)
  ]
  fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles))
  fig.suptitle(title, fontsize=10)
  fig.tight_layout(rect=(0, 0, 1, 0.95))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def phase_totals(items) -> dict[tuple[int, str], float]:
  """Seconds per (rank, phase kind) summed over layers: where each rank's time went."""
  out: dict[tuple[int, str], float] = {}
  for rank, _, phase, start, end in items:
    kind = phase.rstrip("0123456789")
    out[rank, kind] = out.get((rank, kind), 0.0) + end - start
  return out


# --- the timeline report (launch.benchmark --mode=timeline) ----------------------------------


def rank_summary(measured) -> str:
  """Per rank, ms over all layers: qkv / hops + waits / attention / rest. A ring step is its
  partial attention (the send to the next rank overlaps it), and KVR's diagonal the part of
  its attention done before the prefix arrives."""
  totals = phase_totals(measured)
  out = []
  for rank in sorted({item[0] for item in measured}):
    attention = sum(totals.get((rank, k), 0.0) for k in ("attention", "step", "diagonal"))
    exchange = sum(totals.get((rank, k), 0.0) for k in ("hop", "allgather", "wait"))
    qkv, rest = totals.get((rank, "qkv"), 0.0), totals.get((rank, "rest"), 0.0)
    out.append(
      f"r{rank}: {qkv * 1e3:.0f} / {exchange * 1e3:.0f} / {attention * 1e3:.0f} / {rest * 1e3:.0f}"
    )
  return "; ".join(out)


def modelled_setup(reports: list[dict], dtype) -> costmodel.Setup:
  """The cost model's setup for the modelled panels: the hardware the split was chosen with
  (fitted to the model's phases, where a process reports it, else this machine's `local`),
  the flash kernel, `dtype`'s bytes."""
  fitted = next((r["hardware"] for r in reports if r.get("hardware")), None)
  return presets.make_setup(
    costmodel.Hardware(**fitted) if fitted else presets.LOCAL,
    dtype_bytes=jax.numpy.dtype(dtype).itemsize,
    **costmodel.kernel_flags("flash"),
  )


def timeline_report(reports: list[dict], strategies, config, context_len: int, setup) -> list:
  """Every process's probed runs (`jobs.timeline_job`) -> per strategy {strategy, runs,
  measured, modelled, summary}: the measured intervals of every rank, and the cost model's
  intervals of the same split on `setup` (MODELLED)."""
  out = []
  for strategy in strategies:
    runs = [run for r in reports for run in r["runs"] if run["strategy"] == strategy]
    owner = max(runs, key=lambda run: run["process_index"])
    measured = intervals(runs)
    modelled: list = []
    split = owner["partition"]
    by_kind = isinstance(split, Mapping)
    costmodel.simulate(
      config,
      strategy,
      context_len,
      setup,
      num_ranks=len(runs),
      partition=split["linear"] if by_kind else split,
      full_partition=split["full"] if by_kind else None,
      intervals=modelled,
    )
    line = (
      f"{strategy:<10}{owner['ttft_s']:>8.3f}s{owner['probed_ttft_s']:>8.3f}s"
      f"{span_s(runs):>8.3f}s  {rank_summary(measured)}"
      + (f"  partition {owner['partition']}" if owner["partition"] else "")
    )
    out.append(
      {"strategy": strategy, "runs": runs, "measured": measured, "modelled": modelled, "line": line}
    )
  return out


def write_timeline_report(report: list, setup, output_dir: str, title: str, stem: str):
  """`stem`.json (runs, measured and modelled intervals) and `stem`.png (each strategy's
  measured Gantt chart above its modelled one) in `output_dir`; returns the paths."""
  os.makedirs(output_dir, exist_ok=True)
  written = [os.path.join(output_dir, f"{stem}.{ext}") for ext in ("json", "png")]
  with open(written[0], "w") as f:
    json.dump([{k: v for k, v in item.items() if k != "line"} for item in report], f)
  panels = []
  for item in report:
    panels.append((f"MEASURED {item['strategy']}", item["measured"]))
    name = f"MODELLED {item['strategy']} ({setup.hardware.name} hardware)"
    panels.append((name, item["modelled"]))
  plot(panels, written[1], title)
  return written


def run_timelines(worker: str, worker_flags: list[str], num_processes: int) -> list[dict]:
  """Every process's probed runs (`timeline_job`), each process pinned to its own core;
  worker: the module the processes run (`launch.benchmark --mode=timeline`)."""
  outcomes = distributed.launch_local(
    worker, worker_flags, num_processes, pin_cores=True, timeout=3600
  )
  return [r for o in outcomes for r in o.results()]


def timeline_table(report: list, model_name: str, context_len: int, num_processes: int):
  """`timeline_report`'s lines as launch.benchmark --mode=timeline prints them."""
  cache = report[0]["runs"][0].get("cache", "sharded") if report else "sharded"
  where = {
    "sharded": "the cache stays sharded, its move is not in the span",
    "last": "cache last: the move onto the last rank is in the TTFT, after the span",
  }[cache]
  return Table(
    title=(
      f"\nMEASURED timelines, {model_name}, C={context_len}, {num_processes} processes x 1 "
      f"core (probes at every phase boundary; {where})",
    ),
    header=(
      f"{'strategy':<10}{'TTFT':>9}{'probed':>9}{'span':>9}  per rank: qkv / hops+waits / "
      "attention / rest (ms, all layers)"
    ),
    lines=tuple(item["line"] for item in report),
  )
