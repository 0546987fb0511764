"""The multi-process benchmark's table: what every process returned (launch.harness.jobs), as
speed-ups against one process, against TSP, and a verdict against the faster zigzag peer that
survives the noise (`timing.interval_verdict`); printed, and written as JSON, CSV and a plot.
Every figure is MEASURED (processes pinned to cores, single-threaded XLA)."""

from __future__ import annotations

import json
import os

from kvr_jax.runtime import distributed, links
from kvr_jax.runtime.links import UNTHROTTLED
from kvr_jax.tools.timing import interval_verdict
from launch.harness import sweep
from launch.harness.report import Table

NOTES = (
  "single: one process with the flash kernel (the best single process); single-dense:",
  "dense masked scores (the paper's baseline). Speed-ups are against `single`.",
  "move: of TTFT, the time to bring the ranks' cache parts onto the last rank (-: inside",
  "the program's call, not timed apart: a hybrid's and a latent model's join).",
  "all done: until every process finished its part (ranks before the last still attend).",
  "min-max: of the warm runs, interleaved with the other variants' (round-robin).",
  "vs peer: KV-Runahead against the faster of ring and all-gather (by median), auto against",
  "the fastest variant it chose among (single included): ahead or behind only where the",
  "min-max intervals do not overlap, else tie. auto's partition column names its pick.",
  "A variant ending ':sharded' keeps the cache where it was computed (no move), judged",
  "against the peers with the same layout. decode: greedy tokens per second from the cache.",
  "kernel: the attention kernel each variant ran (each strategy's best exact one here).",
)


def process_rows(outcomes, link: str) -> list[dict]:
  """Every row the processes of one launch returned, tagged with the link they ran over."""
  return [dict(r, link=link) for o in outcomes for res in o.results() for r in res["rows"]]


def _samples(row: dict) -> list[float]:
  return row.get("samples_s") or [row["ttft_s"]]


def multiprocess_table(rows: list[dict]) -> list[dict]:
  """Each row with its speed-up against `single` (the one-process run of the same length),
  against TSP on the same link (None where TSP did not run) and, for KV-Runahead's variants,
  its verdict against the faster peer on the same link ("-" for the others)."""
  single = {r["context_len"]: r["ttft_s"] for r in rows if r["variant"] == "single"}
  tsp = {(r["context_len"], r["link"]): r["ttft_s"] for r in rows if r["variant"] == "tsp"}
  peers: dict = {}  # the faster peer per length, link and cache layout
  for r in rows:
    if _base(r) in ("ring", "allgather"):
      best = peers.get(_peer_key(r))
      if best is None or r["ttft_s"] < best["ttft_s"]:
        peers[_peer_key(r)] = r
  table = []
  for r in rows:
    key = (r["context_len"], r["link"])
    peer = peers.get(_peer_key(r))
    vs_peer = "-"
    if peer is not None and r["variant"].startswith("kvr"):
      vs_peer = f"{interval_verdict(_samples(r), _samples(peer))} {peer['variant']}"
    best = _best_other(rows, r) if r["variant"].startswith("auto") else None
    if best is not None:
      vs_peer = f"{interval_verdict(_samples(r), _samples(best))} {best['variant']}"
    table.append(
      dict(
        r,
        speedup_vs_single=single[r["context_len"]] / r["ttft_s"],
        speedup_vs_tsp=tsp[key] / r["ttft_s"] if key in tsp else None,
        vs_peer=vs_peer,
      )
    )
  return table


def _base(row: dict) -> str:
  """The variant without its ":sharded" (the cache layout is the row's `cache`)."""
  return row["variant"].partition(":")[0]


def _peer_key(row: dict):
  return row["context_len"], row["link"], row.get("cache", "last")


def _best_other(rows: list[dict], auto: dict) -> dict | None:
  """The fastest variant auto chose among, by median: the multi-process ones on its link and
  length, and one process alone (single) at its length."""
  candidates = [
    r
    for r in rows
    if r["context_len"] == auto["context_len"]
    and not r["variant"].startswith("auto")
    and (r["link"] == auto["link"] or r["variant"] == "single")
  ]
  return min(candidates, key=lambda r: r["ttft_s"], default=None)


def ttft_table(table: list[dict], model: str, num_processes: int) -> Table:
  """The rows of `run_over_links` as printed (median, min-max, move, speed-ups, verdict)."""
  title = (
    f"\nMEASURED TTFT, {model}, {num_processes} processes x 1 core vs 1 process "
    "x 1 core (median of warm runs):",
    *NOTES,
  )
  header = (
    f"{'variant':<20}{'link':>12}{'C':>7}  {'TTFT':>9}  {'min-max':>13}  {'move':>7}  "
    f"{'all done':>8}  {'vs single':>9}  {'vs tsp':>7}  {'decode':>9}  {'kernel':<7} "
    f"{'vs peer':<25}partition"
  )
  lines = []
  for r in table:
    samples, vs_tsp = _samples(r), r["speedup_vs_tsp"]
    lines.append(
      f"{r['variant']:<20}{r['link']:>12}{r['context_len']:>7}  {r['ttft_s']:>8.3f}s  "
      f"{min(samples):>6.3f}-{max(samples):.3f}  {_move(r):>7}  "
      f"{r.get('done_s', r['ttft_s']):>7.3f}s  "
      f"{r['speedup_vs_single']:>8.2f}x  {'n/a' if vs_tsp is None else f'{vs_tsp:.2f}x':>7}  "
      f"{_rate(r):>9}  {r.get('kernel') or '-':<7} {r['vs_peer']:<24} "
      + (f"{r['strategy']} " if r["variant"].startswith("auto") else "")
      + _partition_text(r)
      + (f" (choosing it took {r['search_s']:.0f}s)" if (r.get("search_s") or 0) >= 0.5 else "")
    )
  return Table(title, header, tuple(lines), tuple(table))


def _partition_text(row: dict) -> str:
  """The split a row ran: "-" for none, "linear a,b full c,d" for a split per layer kind."""
  split, full = row["partition"], row.get("full_partition")
  if full:
    return f"linear {','.join(map(str, split))} full {','.join(map(str, full))}"
  return str(split or "-")


def _move(row: dict) -> str:
  move = row.get("move_s", 0.0)
  return "-" if move is None else f"{move:.3f}s"


def _rate(row: dict) -> str:
  rate = row.get("decode_tokens_per_s")
  return "-" if rate is None else f"{rate:.1f}/s"


def write_files(table: list[dict], output_dir: str, model: str, num_processes: int) -> list[str]:
  """multiprocess.json (every row, samples included), .csv and .png in `output_dir`; the
  paths written."""
  os.makedirs(output_dir, exist_ok=True)
  names = ("multiprocess.json", "multiprocess.csv", "multiprocess.png")
  written = [os.path.join(output_dir, name) for name in names]
  with open(written[0], "w") as f:
    json.dump(table, f, indent=1)
  rows_for_plot = [
    sweep.SweepRow(
      r["variant"] + ("" if r["link"] in ("-", UNTHROTTLED) else f"@{r['link']}"),
      r["context_len"],
      num_processes,
      str(r["partition"]),
      r["ttft_s"],
      r["context_len"] / r["ttft_s"],
      "",
    )
    for r in table
  ]
  note = "MEASURED, processes pinned to cores, single-threaded XLA"
  sweep.write_csv(rows_for_plot, written[1], note)
  title = f"{model}: MEASURED, {num_processes} pinned processes"
  return written[:2] + sweep.plot_sweep(rows_for_plot, written[2], title)


def run_over_links(
  worker: str,
  worker_flags: list[str],
  variants,
  single_variants,
  num_processes: int,
  link_rates,
  timeout: float = 3600,
  duplexes=("full",),
) -> list[dict]:
  """The multiprocess benchmark's runs, each process pinned to its own core: the one-process
  baselines, then `variants` over `num_processes` processes at each of `link_rates`, each
  throttled rate under each of `duplexes` (`runtime.links`: "full", every process its own
  link shaped both ways; "half", one bucket on the loopback for both directions; made for
  each run, removed after). Every rate and kind is checked, and the tools tried, before
  anything runs. worker: the module the processes run (`launch.benchmark`), with
  `worker_flags`. Returns `process_rows` of every run (link: `links.link_label`), for
  `multiprocess_table`."""
  runs = links.checked_runs(link_rates, duplexes, num_processes)
  print("one process, one core (single-threaded XLA): single ...", flush=True)
  single = distributed.launch_local(
    worker,
    worker_flags + [f"--variants={','.join(single_variants)}", "--num_processes=1"],
    1,
    pin_cores=True,
    timeout=timeout,
  )
  rows = process_rows(single, "-")
  for rate, duplex, label in runs:
    print(
      f"{num_processes} processes, one core each, link {label}: {','.join(variants)} ...",
      flush=True,
    )
    with links.throttled(rate, duplex, num_processes) as network:
      multi = distributed.launch_local(
        worker,
        worker_flags
        + [
          f"--variants={','.join(variants)}",
          f"--num_processes={num_processes}",
          f"--link_rate={rate}",
        ],
        num_processes,
        pin_cores=True,
        timeout=timeout,
        network=network,
      )
    rows += process_rows(multi, label)
  return rows
