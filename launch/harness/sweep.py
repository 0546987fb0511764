"""TTFT sweeps over the devices present, and the files they write (CSV, plot). Figures here
are MEASURED on this machine.

On emulated CPU devices (one process) all ranks share the CPU: such sweeps check that the
programs run and what they cost in total, not parallel speed-up; launch.multiprocess measures
that (launch.harness.multiprocess_report prints its table).
"""

from __future__ import annotations

import csv
import dataclasses
import os
import resource

from tqdm.auto import tqdm

from kvr_jax.inference.prefill import prefill_arguments
from kvr_jax.runtime.loading import Model
from kvr_jax.runtime.mesh import AXIS, mesh_of_ranks
from kvr_jax.strategies import get_strategy
from kvr_jax.tools.timing import synthetic_prompt, time_prefill
from launch.harness.report import Table, pyplot


@dataclasses.dataclass
class SweepRow:
  strategy: str
  context_len: int
  num_ranks: int
  partition: str
  ttft_median_s: float
  prompt_tokens_per_s: float
  peak_memory: str  # per device when the backend reports it, else the process peak RSS
  model_parallel: int = 1  # devices per rank (tensor parallelism inside each rank)


def peak_memory(devices) -> str:
  stats = [d.memory_stats() for d in devices]
  if all(s is not None and "peak_bytes_in_use" in s for s in stats):
    return " ".join(f"{s['peak_bytes_in_use'] / 2**20:.0f}MiB" for s in stats)
  rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return f"{rss_kib / 1024:.0f}MiB (process peak RSS)"


def reports_device_memory(devices) -> bool:
  """Whether the backend reports per-device peak memory (GPUs do; CPU devices do not)."""
  return all((s := d.memory_stats()) is not None and "peak_bytes_in_use" in s for d in devices)


def sweep(
  model: Model,
  context_lens,
  strategies=("single", "tsp", "kvr"),
  *,
  num_devices: int | None = None,
  partition="search",
  repeats: int = 3,
  batch: int = 1,
  progress: bool = True,
  model_parallel: int = 1,
) -> list[SweepRow]:
  """Each strategy's TTFT at each context length on `num_devices` devices (default: all) as
  ranks of `model_parallel` devices (a ("ranks", "model") mesh when > 1; load the model split
  over the same mesh, load_model(mesh=), so that its weights are not placed twice)."""
  mesh = mesh_of_ranks(num_devices, model_parallel)
  p = mesh.shape[AXIS]
  rows = []
  with tqdm(total=len(context_lens) * len(strategies), desc="sweep", disable=not progress) as bar:
    for C in context_lens:
      tokens = synthetic_prompt(model.config.vocab_size, C, batch)
      for strategy in strategies:
        kwargs = prefill_arguments(strategy, mesh=mesh, partition=partition)
        timing = time_prefill(model, tokens, repeats, **kwargs)
        median, result = timing.median_s, timing.result
        one = get_strategy(result.strategy).max_ranks == 1  # what ran (auto's pick) on one device
        devices = [result.device] if one else list(mesh.devices.reshape(-1))
        part = "-" if result.partition is None else " ".join(map(str, result.partition))
        rows.append(
          SweepRow(
            strategy,
            C,
            1 if one else p,
            part,
            median,
            batch * C / median,
            peak_memory(devices),
            1 if one else model_parallel,
          )
        )
        bar.update()
  return rows


def write_csv(rows, path: str, note: str) -> None:
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow([f"# {note}"])
    fields = [fl.name for fl in dataclasses.fields(rows[0])]
    writer.writerow(fields)
    for row in rows:
      writer.writerow([getattr(row, n) for n in fields])


def plot_sweep(rows: list[SweepRow], path: str, title: str) -> list[str]:
  """TTFT against context length, a line per strategy, in `path`; [path], or [] where
  matplotlib is not installed."""
  plt = pyplot()
  if plt is None:
    return []
  fig, ax = plt.subplots(figsize=(6, 4))
  for strategy in dict.fromkeys(r.strategy for r in rows):
    group = [r for r in rows if r.strategy == strategy]
    ax.plot(
      [r.context_len for r in group], [r.ttft_median_s * 1e3 for r in group], "o-", label=strategy
    )
  ax.set_xlabel("context length")
  ax.set_ylabel("TTFT (ms, measured)")
  ax.set_title(title, fontsize=9)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return [path]


# --- against Hugging Face transformers ---------------------------------------------------------


def sweep_table(rows: list[SweepRow], note: str, device_memory_reported: bool) -> Table:
  """The sweep as launch.benchmark --mode=devices prints it."""
  title = [note]
  if not device_memory_reported:
    title.append(
      "peak memory: the backend reports no per-device memory; the process peak RSS instead"
    )
  lines = []
  for r in rows:
    ranks = f"{r.num_ranks}" if r.model_parallel == 1 else f"{r.num_ranks}x{r.model_parallel}"
    lines.append(
      f"{r.strategy:<10}{r.context_len:>7}{ranks:>8}  {r.ttft_median_s * 1e3:>8.1f}ms"
      f"  {r.prompt_tokens_per_s:>10.0f}  {r.peak_memory}"
    )
  return Table(
    title=tuple(title),
    header=f"{'strategy':<10}{'C':>7}{'ranks':>8}  {'TTFT':>10}  {'tokens/s':>10}  peak memory",
    lines=tuple(lines),
    records=tuple(dataclasses.asdict(r) for r in rows),
  )


def write_sweep(rows: list[SweepRow], output_dir: str, model_name: str, note: str) -> list[str]:
  """The sweep as devices.csv and its chart devices.png in `output_dir`; the paths written."""
  os.makedirs(output_dir, exist_ok=True)
  csv_path, png_path = (os.path.join(output_dir, name) for name in ("devices.csv", "devices.png"))
  write_csv(rows, csv_path, note)
  return [csv_path, *plot_sweep(rows, png_path, f"{model_name}: {note}")]
