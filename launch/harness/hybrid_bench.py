"""The measured prefill of a model with its own context-parallel program
(`launch.benchmark --mode=hybrid`): a hybrid model (kvr_jax.inference.hybrid: KV-Runahead,
ring and all-gather CP) or a latent-attention one (kvr_jax.inference.latent: the same three).
KV-Runahead on its split from the cost model (rates fitted to the model's own layers on this
core: `phases.fitted_hybrid_hardware`, `phases.fitted_latent_hardware`; on a hybrid the full
layers on their own split where that models faster, as `partition="search"` runs it, with
the one split beside it as "kvr-one"), and even; the peers; the single device alone; every
figure MEASURED here.

Each variant is planned once (`kvr_jax.inference.prefill.plan_prefill`, as `kvr_jax.prefill`
plans it). A call runs that plan and ends when the last rank's logits of the prompt's last
position are ready, the cache left where the program put it (`run_prefill(move_cache=False)`):
KV-Runahead's last rank then
already holds the whole cache, the peers' is spread over their ranks (their move onto the
last rank is not in the figure: the comparison favours the peers). The variants of one
length are called once each (their compiles), then `rounds` rounds time one call of each in
`timing.round_order`, as kvr_jax.tools.timing does for `prefill`.
"""

from __future__ import annotations

import statistics
import time

import jax
from flax import nnx
from jax.experimental import multihost_utils

from kvr_jax.core.chunks import even_partition
from kvr_jax.inference.prefill import plan_prefill, run_prefill
from kvr_jax.planning import costmodel, presets, search
from kvr_jax.planning.partition import PartitionPlan
from kvr_jax.runtime.agreement import agreed
from kvr_jax.runtime.loading import load_model
from kvr_jax.runtime.mesh import make_mesh
from kvr_jax.tools.measured import measured_partition
from kvr_jax.tools.phases import fitted_model_hardware
from kvr_jax.tools.timing import round_order, synthetic_prompt
from launch.harness.report import Table
from models.layer_kinds import past_kind

PEERS = ("ring", "allgather")


def _variants(model, context_len: int, num_ranks: int, measured: bool = False) -> dict:
  """name -> a call of one prefill (no arguments), for this length. measured: also
  "kvr-measured", KV-Runahead on the split a measured search picks on this mesh and link
  (`tools.measured.measured_partition`: candidate splits timed against each other, kept only
  where their intervals separate)."""
  tokens = synthetic_prompt(model.config.vocab_size, context_len)
  if num_ranks == 1:
    graphdef = model.graphdef

    @jax.jit
    def single(state, tokens_BT):
      module = nnx.merge(graphdef, state)
      x_BTD, _ = module.forward(tokens_BT, "flash", last_row_only=True)
      return module.logits(x_BTD[:, -1:])[:, 0]

    state = model.state
    return {"single": lambda: single(state, tokens)}
  mesh = make_mesh(num_ranks)
  searched, kinds = _searched_split(model, context_len, num_ranks, mesh)
  even = even_partition(context_len, num_ranks)

  def call(strategy, partition=None, cache="last"):
    plan = plan_prefill(model, tokens, strategy, mesh, partition, "flash", cache)
    return lambda: run_prefill(model, plan, tokens, move_cache=False).logits

  # KVR-S is what partition="search" runs: on a hybrid the full layers on their own split
  # where that models faster ("kvr-one": the one split searched for both kinds, beside it).
  # ":sharded": KV-Runahead's parts left where computed, as the peers' are (the figure
  # without it has the last rank keep its last hops: the cache joined there).
  linear, full = kinds if kinds is not None and kinds[1] is not None else (searched, None)
  split = searched if full is None else (linear, full)
  by_kind = list(searched) if full is None else {"linear": list(linear), "full": list(full)}
  variants = {
    "kvr-search": call("kvr", by_kind),
    "kvr-search:sharded": call("kvr", by_kind, cache="sharded"),
    "kvr-even": call("kvr", list(even)),
    **{peer: call(peer) for peer in PEERS},
  }
  splits = {"kvr-search": split, "kvr-search:sharded": split, "kvr-even": even}
  if full is not None:
    variants["kvr-one:sharded"] = call("kvr", list(searched), cache="sharded")
    splits["kvr-one:sharded"] = searched
  if measured:
    plan = PartitionPlan("search", objective="measured")
    splits["kvr-measured"] = tuple(measured_partition(model, tokens, mesh, plan))
    variants["kvr-measured"] = call("kvr", list(splits["kvr-measured"]))
  return variants, splits


def _searched_split(model, context_len: int, num_ranks: int, mesh):
  """KVR-S's split: the cost model's search with rates fitted to the model's own layers on
  this process's core (`phases.fitted_hybrid_hardware`, `phases.fitted_latent_hardware`: the
  `local` calibration's large matmul misjudges a small model's narrow matmuls against its
  attention), and the link between the processes measured now (`presets.measure_links`, every
  process taking part: the loopback as this run throttles it; the stored `local` figures are
  the unthrottled machine's, and a split searched for a fast link loads the first rank's hops
  on a slow one). Process 0's split on every process (each fits its own core, and every
  process must compile the same program). A hybrid's also a split per layer kind
  (`search.kind_split_search`: (linear, full or None)); None for latent models."""
  hardware = fitted_model_hardware(model, context_len, num_ranks)
  link = presets.measure_links(hardware)
  setup = presets.make_setup(hardware, link, dtype_bytes=4, **costmodel.kernel_flags("flash"))
  searched = search.modelled_search(model.config, context_len, num_ranks, setup)
  linear, full = searched, None
  if search.splits_by_kind(model.config):
    linear, full = search.kind_split_search(model.config, context_len, num_ranks, setup, searched)
  # One flat row to agree on: the split, the linear layers', the full layers' (zeros: none).
  p = num_ranks
  row = (*searched, *linear, *(full or (0,) * p))
  row = agreed("hybrid-bench split", (model.config, context_len), mesh, row)
  searched, linear, full = row[:p], row[p : 2 * p], row[2 * p :]
  if past_kind(model.config) != "hybrid":
    return searched, None
  return searched, (linear, full if any(full) else None)


def _timed(call) -> tuple[float, float]:
  """(seconds to the last rank's logits, seconds until every process has finished its part).
  Every call ends with all processes idle (a barrier), so no rank's leftover work (a rank
  before the last still attends its own rows in the last layer, which the last rank's
  logits do not wait for) runs into the next call."""
  start = time.perf_counter()
  logits = call()
  if logits is not None:  # the last rank's process; the others finish their part
    logits.block_until_ready()
  first = time.perf_counter() - start
  multihost_utils.sync_global_devices("hybrid_bench call")
  return first, time.perf_counter() - start


def hybrid_bench_job(
  model_name: str, context_lens, rounds: int, measured: bool = False
) -> list[dict] | None:
  """Rows (variant, C, samples_s, split) on the process of the last rank; None elsewhere.
  measured: also kvr-measured (`_variants`)."""
  model = load_model(model_name, dtype="float32")
  p = jax.device_count()
  rows = []
  for C in context_lens:
    made = _variants(model, C, p, measured)
    variants, splits = (made, {}) if p == 1 else made
    for call in variants.values():
      _timed(call)  # compile
    samples = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
      for name in round_order(names, r):
        samples[name].append(_timed(variants[name]))
    for name in names:
      ttft, done = zip(*samples[name], strict=True)
      split = splits.get(name)
      rows.append(
        {"variant": name, "context_len": C, "samples_s": ttft, "done_s": done, "split": split}
      )
  last = jax.devices()[-1]
  return rows if last.process_index == jax.process_index() else None


def _split_text(split) -> str:
  """A split as "c0,c1,..."; a split per layer kind as "linear c0,c1 full c0,c1"."""
  if split is None:
    return ""
  if isinstance(split[0], (list, tuple)):
    linear, full = split
    return f"linear {_split_text(linear)} full {_split_text(full)}"
  return ",".join(str(c) for c in split)


def hybrid_table(rows: list[dict], model: str, num_processes: int) -> Table:
  """Median and min-max per variant, length and link, against the faster peer on the same
  link and single (one process, no link)."""
  by = {(r["context_len"], r.get("link", "-"), r["variant"]): r["samples_s"] for r in rows}
  lines, records = [], []
  # Each length's runs in the order they ran (single, then the links as given).
  runs = dict.fromkeys((r["context_len"], r.get("link", "-")) for r in rows)
  runs = sorted(runs, key=lambda run: run[0])
  for C, link in runs:
    peers = [statistics.median(by[C, link, s]) for s in PEERS if (C, link, s) in by]
    peer = min(peers, default=None)
    single = statistics.median(by[C, "-", "single"]) if (C, "-", "single") in by else None
    for r in (r for r in rows if r["context_len"] == C and r.get("link", "-") == link):
      median, low, high = (
        statistics.median(r["samples_s"]),
        min(r["samples_s"]),
        max(r["samples_s"]),
      )
      done = statistics.median(r.get("done_s") or r["samples_s"])
      vs_peer = "" if peer is None else f"{peer / median:.2f}x"
      vs_single = "" if single is None else f"{single / median:.2f}x"
      split = _split_text(r["split"])
      lines.append(
        f"{C:>7} {link:>11} {r['variant']:<19}{median:>9.3f} {low:>7.3f}-{high:<7.3f}"
        f"{vs_peer:>8} {vs_single:>9}{done:>10.3f}  {split}"
      )
      records.append(dict(r, link=link, median_s=median, done_median_s=done))
  title = (
    f"MEASURED, {model}: {num_processes} processes x 1 pinned core (single: 1 process, 1 "
    "core), seconds to the last rank's logits (cache left where computed), median of the "
    "rounds and min-max; all done: median seconds until every process finished its part",
  )
  header = (
    f"{'C':>7} {'link':>11} {'variant':<19}{'median s':>9} {'min-max s':<15}{'vs peer':>8} "
    f"{'vs single':>9}{'all done':>10}  split"
  )
  return Table(title, header, tuple(lines), tuple(records))
