"""The paper's TTFT figures, MODELLED with kvr_jax.planning.costmodel (8x A100, fp16, batch 1).

Nothing here is measured: every number is the cost model's simulated TTFT, and every output
says so. `launch.paper` prints the table and writes CSV and PNG plots.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import os

from kvr_jax.core.chunks import even_partition
from kvr_jax.planning import costmodel, presets, search, tables
from kvr_jax.runtime.loading import preset_config
from kvr_jax.strategies import get_strategy
from launch.harness.report import pyplot

MODELS = ("llama-2-7b", "falcon-7b")
RANKS = (2, 4, 8)
CONTEXT_LENS = (1024, 2048, 4096, 8192, 12288, 16384)
LINK_PRESETS = ("300GBps", "10GBps")
HARDWARE = "a100-80gb"
# What the paper reports (from its abstract and secondary summaries; DESIGN.md section 3).
PAPER = {
  "llama-2-7b": "1.4x headline; best cell 1.42x (4 GPUs, 12k, 300 GB/s)",
  "falcon-7b": "1.6x headline; best cell 1.63x (8 GPUs, 8k)",
  "10GBps": "larger gains at 10 GB/s, up to 1.79x",
  "slow link": "TSP loses up to 11.8%, KVR 2.7%",
}


@dataclasses.dataclass
class Cell:
  model: str
  num_ranks: int
  context_len: int
  links: str
  tsp_s: float
  kvr_even_s: float
  kvr_search_s: float
  kvr_predict_s: float
  kvr_balanced_s: float
  lower_bound_s: float
  search_partition: tuple[int, ...]
  predict_partition: tuple[int, ...]
  predicted_by_interpolation: bool
  # Against the peers, every strategy with a flash kernel (no score matrix in memory,
  # masked blocks skipped): KVR-S searched for that kernel, zigzag ring, all-gather CP.
  kvr_flash_s: float = float("nan")
  ring_s: float = float("nan")
  allgather_s: float = float("nan")

  @property
  def speedup_vs_peers(self) -> float:
    """KVR-S over the faster of ring and all-gather CP (flash kernels throughout)."""
    return min(self.ring_s, self.allgather_s) / self.kvr_flash_s

  @property
  def speedup(self) -> float:
    return self.tsp_s / self.kvr_search_s

  @property
  def predict_gap(self) -> float:
    return self.kvr_predict_s / self.kvr_search_s - 1


def model_cell(
  model: str, num_ranks: int, context_len: int, links: str, hardware: str = HARDWARE
) -> Cell:
  config = preset_config(model)
  setup = presets.make_setup(hardware, links, dtype_bytes=2)  # fp16, as the paper ran

  def kvr(chunks):
    return costmodel.simulate(
      config, "kvr", context_len, setup, num_ranks=num_ranks, partition=chunks
    ).ttft

  balanced = search.balanced_partition(config, context_len, num_ranks, setup)
  searched = search.modelled_search(config, context_len, num_ranks, setup, start=balanced)
  table = tables.load_table(model, hardware, links, num_ranks)
  predicted = tables.predict_partition(table, context_len)
  in_table = any(e["context_len"] == context_len for e in table["entries"])
  flash = presets.make_setup(hardware, links, dtype_bytes=2, **costmodel.kernel_flags("flash"))
  kvr_flash = search.modelled_search(config, context_len, num_ranks, flash)

  def peer(strategy):
    return costmodel.simulate(config, strategy, context_len, flash, num_ranks=num_ranks).ttft

  return Cell(
    model,
    num_ranks,
    context_len,
    links,
    tsp_s=costmodel.simulate(config, "tsp", context_len, setup, num_ranks=num_ranks).ttft,
    kvr_even_s=kvr(even_partition(context_len, num_ranks)),
    kvr_search_s=kvr(searched),
    kvr_predict_s=kvr(predicted),
    kvr_balanced_s=kvr(balanced),
    lower_bound_s=costmodel.lower_bound(config, context_len, num_ranks, setup),
    search_partition=searched,
    predict_partition=predicted,
    predicted_by_interpolation=not in_table,
    kvr_flash_s=search.modelled_objective(config, context_len, num_ranks, flash)(kvr_flash),
    ring_s=peer("ring"),
    allgather_s=peer("allgather"),
  )


def all_cells(
  models=MODELS, ranks=RANKS, context_lens=CONTEXT_LENS, link_presets=LINK_PRESETS, progress=None
) -> list[Cell]:
  cells = []
  for links in link_presets:
    for model in models:
      for p in ranks:
        for C in context_lens:
          cells.append(model_cell(model, p, C, links))
          if progress:
            progress(cells[-1])
  return cells


@dataclasses.dataclass
class SlowLinkCase:
  model: str
  num_ranks: int
  context_len: int
  slow_link: int
  slow_bandwidth: float
  tsp_loss: float  # TTFT increase over all links fast
  kvr_loss: float  # searched with the slow link known, against searched with uniform links
  kvr_unaware_loss: float  # the uniform-links partition run on the slow link
  ring_loss: float = float("nan")  # flash kernels: ring attention's TTFT increase
  allgather_loss: float = float("nan")  # flash kernels: all-gather CP's TTFT increase


def slow_link_case(
  model: str,
  num_ranks: int,
  context_len: int,
  slow_link: int,
  slow_bandwidth: float = 10e9,
  hardware: str = HARDWARE,
) -> SlowLinkCase:
  """One link of a 300 GB/s mesh at `slow_bandwidth` (the paper's non-uniform case)."""
  config = preset_config(model)
  fast = presets.links_preset("300GBps")
  slow = fast.with_slow_link(slow_link, slow_bandwidth)

  def setup(links):
    return presets.make_setup(hardware, links, dtype_bytes=2)

  def best(links):
    chunks = search.modelled_search(config, context_len, num_ranks, setup(links))
    return chunks, search.modelled_objective(config, context_len, num_ranks, setup(links))(chunks)

  def tsp(links):
    return costmodel.simulate(config, "tsp", context_len, setup(links), num_ranks=num_ranks).ttft

  def peer_loss(strategy):
    def ttft(links):
      flash = presets.make_setup(hardware, links, dtype_bytes=2, **costmodel.kernel_flags("flash"))
      return costmodel.simulate(config, strategy, context_len, flash, num_ranks=num_ranks).ttft

    return ttft(slow) / ttft(fast) - 1

  fast_chunks, fast_kvr = best(fast)
  _, slow_kvr = best(slow)
  unaware = costmodel.simulate(
    config, "kvr", context_len, setup(slow), num_ranks=num_ranks, partition=fast_chunks
  ).ttft
  return SlowLinkCase(
    model,
    num_ranks,
    context_len,
    slow_link,
    slow_bandwidth,
    tsp(slow) / tsp(fast) - 1,
    slow_kvr / fast_kvr - 1,
    unaware / fast_kvr - 1,
    peer_loss("ring"),
    peer_loss("allgather"),
  )


def write_csv(cells: list[Cell], path: str) -> None:
  fields = [f.name for f in dataclasses.fields(Cell)] + ["speedup_search_over_tsp", "predict_gap"]
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["# MODELLED with kvr_jax.planning.costmodel, not measured"])
    writer.writerow(fields)
    for c in cells:
      row = [getattr(c, n) for n in fields[:-2]]
      row = [" ".join(map(str, v)) if isinstance(v, tuple) else v for v in row]
      writer.writerow(row + [f"{c.speedup:.4f}", f"{c.predict_gap:.5f}"])


def plot(cells: list[Cell], directory: str) -> list[str]:
  """One PNG per bandwidth: a panel per (model, p), a bar per method at each context length."""
  import numpy as np

  plt = pyplot()
  if plt is None:
    return []

  paths = []
  methods = [
    ("TSP", "tsp_s"),
    ("KVR-E", "kvr_even_s"),
    ("KVR-S", "kvr_search_s"),
    ("KVR-P", "kvr_predict_s"),
    ("lower bound", "lower_bound_s"),
  ]
  for links in sorted({c.links for c in cells}):
    models = sorted({c.model for c in cells if c.links == links})
    ranks = sorted({c.num_ranks for c in cells if c.links == links})
    fig, axes = plt.subplots(
      len(models), len(ranks), figsize=(5 * len(ranks), 3.6 * len(models)), squeeze=False
    )
    for r, model in enumerate(models):
      for k, p in enumerate(ranks):
        ax = axes[r][k]
        group = sorted(
          (c for c in cells if (c.links, c.model, c.num_ranks) == (links, model, p)),
          key=lambda c: c.context_len,
        )
        x = np.arange(len(group))
        width = 0.8 / len(methods)
        for j, (label, field) in enumerate(methods):
          ax.bar(
            x + (j - len(methods) / 2 + 0.5) * width,
            [getattr(c, field) * 1e3 for c in group],
            width,
            label=label,
          )
        ax.set_xticks(x, [f"{c.context_len // 1024}k" for c in group])
        ax.set_title(f"{model}, {p} GPUs, {links}")
        ax.set_ylabel("TTFT (ms, modelled)")
        ax.set_xlabel("context length")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"MODELLED TTFT (kvr_jax cost model, A100 fp16), links {links}")
    fig.tight_layout()
    path = os.path.join(directory, f"paper_ttft_{links}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)
  return paths


def print_summary(cells) -> bool:
  """KVR-S against TSP and KVR-P against KVR-S over the grid, beside the paper's figures;
  True when KVR-S is faster than TSP in every cell. MODELLED."""
  ok_faster = all(c.kvr_search_s < c.tsp_s for c in cells)
  # Two-sided: a KVR-P much *faster* than KVR-S would mean the search missed its optimum.
  worst = max(cells, key=lambda c: abs(c.predict_gap))
  worst_gap = worst.predict_gap
  print(f"KVR-S faster than TSP in every cell: {'yes' if ok_faster else 'NO'}")
  print(
    f"KVR-P within 2% of KVR-S (either way) in every cell: "
    f"{'yes' if abs(worst_gap) <= 0.02 else 'NO'} (worst {worst_gap * 100:+.2f}%)"
  )
  worst_bal = max(c.kvr_balanced_s / c.kvr_search_s - 1 for c in cells if c.links == "300GBps")
  print(
    f"balanced vs KVR-S at 300 GB/s: worst {worst_bal * 100:.2f}% slower; at 10 GB/s: worst "
    f"{max(c.kvr_balanced_s / c.kvr_search_s - 1 for c in cells if c.links == '10GBps') * 100:.1f}%"
  )
  for links in LINK_PRESETS:
    for model in MODELS:
      group = [c for c in cells if (c.model, c.links) == (model, links)]
      best = max(group, key=lambda c: c.speedup)
      print(
        f"modelled KVR-S over TSP, {model}, {links}: {min(c.speedup for c in group):.2f}x to "
        f"{best.speedup:.2f}x (best {best.num_ranks} GPUs, {best.context_len // 1024}k)  | "
        f"paper: {PAPER[model] if links == '300GBps' else PAPER['10GBps']}"
      )
  return ok_faster


def print_against_peers(cells) -> None:
  """KVR-S against ring and all-gather CP in every cell, each with the flash kernel."""
  print(
    "Against the peers, MODELLED, every strategy with a flash kernel (no score matrix in "
    "memory, masked blocks skipped):"
  )
  print(
    f"{'links':<8}{'model':<12}{'p':>2}{'C':>7} {'KVR-S':>9}{'ring':>9}{'allgath.':>9}  vs best"
  )
  for c in cells:
    print(
      f"{c.links:<8}{c.model:<12}{c.num_ranks:>2}{c.context_len:>7} "
      f"{c.kvr_flash_s * 1e3:>7.1f}ms{c.ring_s * 1e3:>7.1f}ms{c.allgather_s * 1e3:>7.1f}ms"
      f"  {c.speedup_vs_peers:>5.2f}x"
    )
  beats_peers = [c for c in cells if c.speedup_vs_peers > 1]
  print(
    f"KVR-S faster than both peers in {len(beats_peers)} of {len(cells)} cells; "
    f"KVR-S over the faster peer: {min(c.speedup_vs_peers for c in cells):.2f}x to "
    f"{max(c.speedup_vs_peers for c in cells):.2f}x"
  )
  for c in cells:
    if c.speedup_vs_peers <= 1:
      print(
        f"  KVR-S loses: {c.model} p={c.num_ranks} C={c.context_len} {c.links} "
        f"({c.speedup_vs_peers:.3f}x)"
      )


def print_slow_links() -> None:
  """One slow link among fast ones: what it costs each strategy (and KVR with the split
  chosen for uniform links)."""
  print("One slow link among 300 GB/s links, MODELLED (TTFT increase over all links fast):")
  for model in MODELS:
    for (p, C, k), slow in itertools.product(((8, 8192, 3), (4, 8192, 1)), (100e9, 10e9)):
      s = slow_link_case(model, p, C, k, slow)
      print(
        f"  {model} p={p} C={C} link {k}<->{k + 1} at {slow / 1e9:.0f} GB/s: "
        f"TSP +{s.tsp_loss * 100:.1f}%, KVR-S "
        f"(re-searched) +{s.kvr_loss * 100:.1f}%, KVR with the uniform-link partition "
        f"+{s.kvr_unaware_loss * 100:.1f}%; ring +{s.ring_loss * 100:.1f}%, all-gather CP "
        f"+{s.allgather_loss * 100:.1f}% (flash)"
      )
  print(f"  paper: {PAPER['slow link']}")


# --- Windowed models: hops bounded by the window on their windowed layers (MODELLED) -----------

WINDOWED_RANKS = 8
WINDOWED_LINKS = ("300GBps", "10GBps")
WINDOWED_CONTEXT_LENS = (32768, 65536, 131072)
# The windowed models of `--grids`: preset, and how its layers mix (for the table's title).
WINDOWED_MODELS = {
  "gemma": ("gemma-3-27b", "Gemma 3 27B", "five windowed layers of 1024 keys to one full"),
  "gpt-oss": (
    "gpt-oss-120b",
    "gpt-oss-120b",
    "windowed layers of 128 keys alternating with full ones, attention sinks, 128 experts",
  ),
}


@dataclasses.dataclass(frozen=True)
class WindowedCell:
  """One MODELLED cell: TTFT of KVR-S, ring and all-gather CP (flash kernels, bf16, H100s)
  and the bytes each rank sends per layer kind (a windowed layer, a full one)."""

  model: str
  links: str
  context_len: int
  ttft_s: dict
  sent_windowed: dict  # bytes per layer: KVR the largest hop, the peers each rank's sends
  sent_full: dict


def windowed_cell(
  model: str, context_len: int, links: str, num_ranks: int = WINDOWED_RANKS
) -> WindowedCell:
  config = preset_config(model)
  setup = presets.make_setup("h100-sxm", links, dtype_bytes=2, **costmodel.kernel_flags("flash"))
  chunks = search.modelled_search(config, context_len, num_ranks, setup)
  ttft, windowed, full = {}, {}, {}
  for strategy in ("kvr", "ring", "allgather"):
    kw = dict(num_ranks=num_ranks, partition=chunks if get_strategy(strategy).partitioned else None)
    ttft[strategy] = costmodel.simulate(config, strategy, context_len, setup, **kw).ttft
    for window, out in ((config.narrowest_window, windowed), (None, full)):
      layer = costmodel.modelled_layer(
        config.with_window(window), strategy, context_len, setup, **kw
      )
      out[strategy] = max(layer.link_bytes)
  return WindowedCell(model, links, context_len, ttft, windowed, full)


def print_windowed_grid(
  grid: str, context_lens=WINDOWED_CONTEXT_LENS, links=WINDOWED_LINKS
) -> list[WindowedCell]:
  """A windowed model of WINDOWED_MODELS (`grid`: "gemma" or "gpt-oss") on 8 H100s, MODELLED."""
  model, title, layers = WINDOWED_MODELS[grid]
  print(
    f"{title} on {WINDOWED_RANKS} H100s ({layers}), bf16, "
    "flash kernels, MODELLED: TTFT, and MB each rank sends per layer (KVR: its largest hop; "
    "ring, all-gather: every rank's K,V to the others) on a windowed / a full layer"
  )
  print(
    f"{'links':<8}{'C':>7} {'KVR-S':>9}{'ring':>9}{'allgath.':>9}  vs best peer   "
    f"{'KVR MB':>12}{'ring MB':>14}{'allg. MB':>14}"
  )
  cells = []
  for name in links:
    for C in context_lens:
      c = windowed_cell(model, C, name)
      cells.append(c)
      t = c.ttft_s
      peer = min(t["ring"], t["allgather"])
      sent = "".join(
        f"{c.sent_windowed[s] / 1e6:>7.1f}/{c.sent_full[s] / 1e6:<6.0f}"
        for s in ("kvr", "ring", "allgather")
      )
      print(
        f"{name:<8}{C:>7} {t['kvr'] * 1e3:>7.0f}ms{t['ring'] * 1e3:>7.0f}ms"
        f"{t['allgather'] * 1e3:>7.0f}ms  {peer / t['kvr']:>6.2f}x       {sent}"
      )
  return cells
