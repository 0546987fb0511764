"""What a throttled link does with the exchanges the strategies make: one process's timing job
and the launcher's runs over each link (`python -m launch.benchmark --mode=links`).

Three exchanges of `megabytes` per rank, each a jitted `ppermute` over every process's one
device, best of `repeats` after a warm-up:

  one-way   rank 0 to rank 1 (KV-Runahead's hop);
  two-way   rank 0 to rank 1 and rank 1 to rank 0 at once (ring's step on two ranks; an
            all-gather's exchange);
  ring      every rank to the next (ring's step on p ranks: every pair at once).

On a full-duplex link the three take one one-way time; a two-way exchange that takes twice as
long says the pair's directions take turns (the transport or the link), a ring that takes p
times as long says every pair shares one link (the "half" loopback bucket). Why it matters:
the multi-process benchmarks compare KV-Runahead's one-way chain against peers whose steps
are two-way, so what the link does with a two-way exchange decides their slow-link verdicts.
"""

from __future__ import annotations

import jax
import numpy as np

from kvr_jax.planning.presets import best_time, global_array
from kvr_jax.runtime import distributed, links
from kvr_jax.runtime.mesh import AXIS, make_mesh
from launch.harness.report import Table

EXCHANGES = ("one-way", "two-way", "ring")


def exchange_perms(num_ranks: int) -> dict[str, list[tuple[int, int]]]:
  """Each exchange's (source, target) pairs."""
  return {
    "one-way": [(0, 1)],
    "two-way": [(0, 1), (1, 0)],
    "ring": [(r, (r + 1) % num_ranks) for r in range(num_ranks)],
  }


def exchange_job(megabytes: float, repeats: int) -> dict:
  """One process's part: the best seconds of each exchange (`EXCHANGES`) as this process saw
  them (every process reports; an exchange took the slowest of its processes' times)."""
  mesh = make_mesh()
  p = mesh.devices.size
  if p < 2:
    raise ValueError(f"the link probe needs at least 2 devices, got {p}")
  sharding = jax.sharding.NamedSharding(mesh, jax.P(AXIS))
  floats = int(megabytes * 1e6 / 4)
  x = global_array(np.zeros((p, floats), np.float32), sharding)
  seconds = {}
  for name, perm in exchange_perms(p).items():
    fn = jax.jit(
      jax.shard_map(
        lambda x, perm=perm: jax.lax.ppermute(x, AXIS, perm=perm),
        mesh=mesh,
        in_specs=jax.P(AXIS),
        out_specs=jax.P(AXIS),
      )
    )
    seconds[name] = best_time(fn, x, repeats=repeats)
  return {"seconds": seconds}


def run_over_links(
  worker: str, worker_flags: list[str], num_processes: int, link_rates, duplexes
) -> list[dict]:
  """The probe over `num_processes` processes (not pinned: it measures the link) at each of
  `link_rates` under each of `duplexes` (`runtime.links`): rows {link, seconds}, each
  exchange's seconds the slowest process's."""
  runs = links.checked_runs(link_rates, duplexes, num_processes)
  rows = []
  for rate, duplex, label in runs:
    print(f"{num_processes} processes, link {label} ...", flush=True)
    with links.throttled(rate, duplex, num_processes) as network:
      outcomes = distributed.launch_local(
        worker, worker_flags, num_processes, timeout=600, network=network
      )
    seen = [r["seconds"] for o in outcomes for r in o.results()]
    slowest = {name: max(s[name] for s in seen) for name in EXCHANGES}
    rows.append({"link": label, "seconds": slowest})
  return rows


def links_table(rows: list[dict], megabytes: float, num_processes: int) -> Table:
  """Seconds of each exchange per link, and the two-way and ring times over the one-way."""
  lines, records = [], []
  for row in rows:
    s = row["seconds"]
    one = s["one-way"]
    lines.append(
      f"{row['link']:>14} {one:>9.3f} {s['two-way']:>9.3f} {s['ring']:>9.3f}"
      f" {s['two-way'] / one:>9.2f}x {s['ring'] / one:>7.2f}x"
    )
    records.append(dict(row, megabytes=megabytes, num_processes=num_processes))
  title = (
    f"MEASURED: {megabytes:g} MB per rank, {num_processes} processes, best of the repeats, "
    "seconds (one-way: rank 0 to 1; two-way: 0 to 1 and 1 to 0 at once; ring: every rank to "
    "the next at once)"
  )
  header = f"{'link':>14} {'one-way':>9} {'two-way':>9} {'ring':>9} {'two/one':>10} {'ring/one':>8}"
  return Table((title,), header, tuple(lines), tuple(records))
