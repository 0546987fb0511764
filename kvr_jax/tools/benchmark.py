"""Benchmarks on the devices present: TTFT sweeps, and the single-device path against
Hugging Face transformers (PyTorch, CPU). Figures here are MEASURED on this machine.

On emulated CPU devices (one process) all ranks share the CPU: such sweeps check that the
programs run and what they cost in total, not parallel speed-up; launch.multiprocess measures
that.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import resource
import statistics
import tempfile
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from kvr_jax.inference.prefill import prefill_arguments
from kvr_jax.runtime.loading import Model, load_hf_model
from kvr_jax.runtime.mesh import make_mesh
from kvr_jax.tools.timing import synthetic_prompt, time_prefill
from models.layers import attend_flash, attend_static


@dataclasses.dataclass
class SweepRow:
  strategy: str
  context_len: int
  num_ranks: int
  partition: str
  ttft_median_s: float
  prompt_tokens_per_s: float
  peak_memory: str  # per device when the backend reports it, else the process peak RSS


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
) -> list[SweepRow]:
  mesh = make_mesh(num_devices)
  p = mesh.devices.size
  rows = []
  with tqdm(total=len(context_lens) * len(strategies), desc="sweep", disable=not progress) as bar:
    for C in context_lens:
      tokens = synthetic_prompt(model.config.vocab_size, C, batch)
      for strategy in strategies:
        kwargs = prefill_arguments(strategy, mesh=mesh, partition=partition)
        timing = time_prefill(model, tokens, repeats, **kwargs)
        median, result = timing.median_s, timing.result
        devices = [result.device] if strategy == "single" else list(mesh.devices.reshape(-1))
        part = "-" if result.partition is None else " ".join(map(str, result.partition))
        rows.append(
          SweepRow(
            strategy,
            C,
            1 if strategy == "single" else p,
            part,
            median,
            batch * C / median,
            peak_memory(devices),
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


def plot_sweep(rows: list[SweepRow], path: str, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

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


# --- against Hugging Face transformers ---------------------------------------------------------


def hf_config_for(config):
  """A transformers config with the same shapes as one of our Llama configs."""
  import transformers

  if config.architecture != "llama":
    raise ValueError("the transformers comparison builds Llama models only")
  return transformers.LlamaConfig(
    vocab_size=config.vocab_size,
    hidden_size=config.d_model,
    intermediate_size=config.mlp_dim,
    num_hidden_layers=config.num_layers,
    num_attention_heads=config.num_heads,
    num_key_value_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    max_position_embeddings=config.max_position_embeddings,
    rms_norm_eps=config.norm_eps,
    rope_theta=config.rope.theta,
    tie_word_embeddings=config.tie_embeddings,
  )


@dataclasses.dataclass
class HFComparison:
  context_len: int
  threads: int
  kernel: str  # our attention kernel (flash, dense, blocked, ...)
  ours_tokens_per_s: float
  transformers_tokens_per_s: float
  max_logit_diff: float

  @property
  def ratio(self) -> float:
    return self.ours_tokens_per_s / self.transformers_tokens_per_s


def compare_with_transformers(
  config,
  context_lens,
  *,
  kernels=("flash", "blocked", "dense"),
  repeats: int = 3,
  threads: int | None = None,
  seed: int = 0,
  progress: bool = True,
) -> list[HFComparison]:
  """Prefill tokens/s of our single-device path (each attention kernel) and of transformers
  (its default attention, SDPA) on the same weights.

  The transformers model is built from the same shapes, saved with save_pretrained and read
  back through our loader, so both run identical weights on identical tokens. PyTorch gets
  `threads` threads (default: all cores, as XLA's CPU backend uses); transformers computes
  only the last position's logits (`logits_to_keep=1`), as we do, and builds its KV cache.
  XLA's threads are fixed when its backend starts (launch.benchmark --threads sets them).
  """
  try:
    import torch
    import transformers
  except ImportError:
    raise ValueError(
      "the transformers comparison needs PyTorch: pip install -e '.[test]'"
    ) from None
  threads = threads or os.cpu_count()
  torch.set_num_threads(threads)
  torch.manual_seed(seed)
  hf_model = transformers.LlamaForCausalLM(hf_config_for(config)).eval()
  with tempfile.TemporaryDirectory() as tmp:
    hf_model.save_pretrained(tmp)
    ours = load_hf_model(tmp)
  out = []
  for C in tqdm(context_lens, desc="vs transformers", disable=not progress):
    tokens = synthetic_prompt(config.vocab_size, C, 1, seed)
    ours_s, results = {}, {}
    for kernel in kernels:
      timing = time_prefill(ours, tokens, repeats, attention=kernel)
      ours_s[kernel], results[kernel] = timing.median_s, timing.result
    input_ids = torch.as_tensor(tokens, dtype=torch.long)
    with torch.inference_mode():
      hf_logits = hf_model(input_ids, logits_to_keep=1, use_cache=True).logits  # warm-up
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        hf_model(input_ids, logits_to_keep=1, use_cache=True)
        times.append(time.perf_counter() - start)
    hf_s = statistics.median(times)
    for kernel in kernels:
      logits = np.asarray(results[kernel].logits)
      diff = float(np.abs(logits - hf_logits[:, -1].float().numpy()).max())
      out.append(HFComparison(C, threads, kernel, C / ours_s[kernel], C / hf_s, diff))
  return out


# --- attention kernels alone -------------------------------------------------------------------


@dataclasses.dataclass
class KernelTiming:
  kernel: str
  context_len: int
  query_block: int | None
  key_block: int | None
  seconds: float  # median of warm runs
  compile_s: float


def time_attention_kernels(
  context_lens,
  kernels=("dense", "blocked", "flash"),
  flash_blocks=((256, 512),),
  *,
  num_heads: int = 4,
  num_kv_heads: int = 4,
  head_dim: int = 64,
  repeats: int = 5,
  progress: bool = True,
) -> list[KernelTiming]:
  """Causal self-attention alone on one device (batch 1, float32), per kernel and, for
  flash, per (query_block, key_block): what the block sizes are chosen from."""
  rows = []
  cases = [
    (C, kernel, blocks)
    for C in context_lens
    for kernel in kernels
    for blocks in (flash_blocks if kernel == "flash" else [(None, None)])
  ]
  for C, kernel, (bq, bk) in tqdm(cases, desc="kernels", disable=not progress):
    rng = np.random.RandomState(0)
    q = jax.device_put(rng.randn(1, C, num_heads, head_dim).astype(np.float32))
    k, v = (
      jax.device_put(rng.randn(1, C, num_kv_heads, head_dim).astype(np.float32)) for _ in range(2)
    )
    if kernel == "flash":
      fn = jax.jit(
        lambda q, k, v, bq=bq, bk=bk: attend_flash(q, k, v, 0, query_block=bq, key_block=bk)[0]
      )
    else:
      fn = jax.jit(lambda q, k, v, kernel=kernel: attend_static(q, k, v, 0, kernel))
    start = time.perf_counter()
    jax.block_until_ready(fn(q, k, v))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(q, k, v))
      times.append(time.perf_counter() - start)
    median = statistics.median(times)
    rows.append(KernelTiming(kernel, C, bq, bk, median, max(first - median, 0.0)))
  return rows


# Per-phase times of a KV-Runahead partition: kvr_jax.tools.measured.rank_phase_times.
