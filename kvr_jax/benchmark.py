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

import numpy as np

from kvr_jax import demo
from kvr_jax.loading import Model, load_hf_model
from kvr_jax.mesh import make_mesh


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
  return f"process peak RSS {rss_kib / 1024:.0f}MiB (backend reports no per-device memory)"


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
  from tqdm.auto import tqdm

  mesh = make_mesh(num_devices)
  p = mesh.devices.size
  rows = []
  with tqdm(total=len(context_lens) * len(strategies), desc="sweep", disable=not progress) as bar:
    for C in context_lens:
      tokens = demo.synthetic_prompt(model.config.vocab_size, C, batch)
      for strategy in strategies:
        kwargs = {"strategy": strategy}
        if strategy != "single":
          kwargs["mesh"] = mesh
        if strategy == "kvr":
          kwargs["partition"] = partition
        timing = demo.time_prefill(model, tokens, repeats, **kwargs)
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
  ours_dense_tokens_per_s: float  # attention="dense" (the paper's single-device baseline)
  ours_blocked_tokens_per_s: float  # attention="blocked" (masked blocks skipped)
  transformers_tokens_per_s: float
  max_logit_diff: float

  @property
  def ratio_dense(self) -> float:
    return self.ours_dense_tokens_per_s / self.transformers_tokens_per_s

  @property
  def ratio_blocked(self) -> float:
    return self.ours_blocked_tokens_per_s / self.transformers_tokens_per_s


def compare_with_transformers(
  config,
  context_lens,
  *,
  repeats: int = 3,
  threads: int | None = None,
  seed: int = 0,
  progress: bool = True,
) -> list[HFComparison]:
  """Prefill tokens/s of our single-device path (dense and blocked attention) and of
  transformers (its default attention, SDPA) on the same weights.

  The transformers model is built from the same shapes, saved with save_pretrained and read
  back through our loader, so both run identical weights on identical tokens. PyTorch gets
  `threads` threads (default: all cores, as XLA's CPU backend uses); transformers computes
  only the last position's logits (`logits_to_keep=1`), as we do, and builds its KV cache.
  """
  try:
    import torch
    import transformers
  except ImportError:
    raise ValueError(
      "the transformers comparison needs PyTorch: pip install -e '.[test]'"
    ) from None
  from tqdm.auto import tqdm

  threads = threads or os.cpu_count()
  torch.set_num_threads(threads)
  torch.manual_seed(seed)
  hf_model = transformers.LlamaForCausalLM(hf_config_for(config)).eval()
  with tempfile.TemporaryDirectory() as tmp:
    hf_model.save_pretrained(tmp)
    ours = load_hf_model(tmp)
  out = []
  for C in tqdm(context_lens, desc="vs transformers", disable=not progress):
    tokens = demo.synthetic_prompt(config.vocab_size, C, 1, seed)
    dense = demo.time_prefill(ours, tokens, repeats)
    dense_s, result = dense.median_s, dense.result
    blocked_s = demo.time_prefill(ours, tokens, repeats, attention="blocked").median_s
    input_ids = torch.as_tensor(tokens, dtype=torch.long)
    with torch.inference_mode():
      hf_logits = hf_model(input_ids, logits_to_keep=1, use_cache=True).logits  # warm-up
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        hf_model(input_ids, logits_to_keep=1, use_cache=True)
        times.append(time.perf_counter() - start)
    diff = float(np.abs(np.asarray(result.logits) - hf_logits[:, -1].float().numpy()).max())
    out.append(
      HFComparison(C, threads, C / dense_s, C / blocked_s, C / statistics.median(times), diff)
    )
  return out
