"""The timeline report (`launch.benchmark --mode=timeline`): every process's probed runs
(kvr_jax.tools.timeline.probe_run) beside the cost model's intervals of the same split, as a
table, JSON and a Gantt chart per strategy (matplotlib: the `harness` extra)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import jax

from kvr_jax.planning import costmodel, presets
from kvr_jax.runtime import distributed
from kvr_jax.tools.timeline import intervals, span_s
from launch.harness.report import Table, pyplot

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


def _colour(phase: str) -> str:
  for key, colour in COLOURS.items():
    if phase.startswith(key):
      return colour
  return "#cccccc"


def plot(panels: list[tuple[str, list]], path: str, title: str) -> list[str]:
  """A Gantt chart per panel (title, intervals): ranks by time, phases coloured, layers
  separated by thin gaps; hops drawn as arrows from the sender's row to the receiver's."""
  plt = pyplot()
  if plt is None:
    return []
  from matplotlib.patches import Patch

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
  handles = [Patch(color=c, label=k) for k, c in COLOURS.items() if k not in ("step",)]
  fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles))
  fig.suptitle(title, fontsize=10)
  fig.tight_layout(rect=(0, 0, 1, 0.95))
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return [path]


def phase_totals(items) -> dict[tuple[int, str], float]:
  """Seconds per (rank, phase kind) summed over layers: where each rank's time went."""
  out: dict[tuple[int, str], float] = {}
  for rank, _, phase, start, end in items:
    kind = phase.rstrip("0123456789")
    out[rank, kind] = out.get((rank, kind), 0.0) + end - start
  return out


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
  return written[:1] + plot(panels, written[1], title)


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
