"""The single-device path against Hugging Face transformers (PyTorch) on the same weights and
tokens: twin models, transformers' own timing, and the CPU comparison. MEASURED."""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from kvr_jax.runtime.loading import load_hf_model
from kvr_jax.tools.timing import synthetic_prompt, time_prefill
from launch.harness.report import Table


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


def twin_models(config, dtype, torch_device: str, seed: int):
  """A transformers Llama with random weights on `torch_device` in `dtype`, and the same
  weights read through our loader (saved with save_pretrained, read memory-mapped)."""
  import torch
  import transformers

  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
  default = torch.get_default_dtype()
  torch.manual_seed(seed)
  torch.set_default_dtype(torch_dtype[np.dtype(dtype).name])
  try:
    with torch.device(torch_device):
      hf_model = transformers.LlamaForCausalLM(hf_config_for(config)).eval()
  finally:
    torch.set_default_dtype(default)
  with tempfile.TemporaryDirectory() as tmp:
    hf_model.save_pretrained(tmp)
    ours = load_hf_model(tmp, dtype)
    jax.block_until_ready(ours.state)  # read before the directory goes
  return hf_model, ours


def time_transformers(hf_model, tokens, repeats: int, torch_device: str):
  import torch

  input_ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long, device=torch_device)

  def run():
    out = hf_model(input_ids, logits_to_keep=1, use_cache=True)
    if torch_device != "cpu":
      torch.cuda.synchronize()
    return out.logits[:, -1].float().cpu().numpy()

  with torch.inference_mode():
    logits = run()  # warm-up
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      run()
      times.append(time.perf_counter() - start)
  return statistics.median(times), logits


def comparison_table(comparison: list[HFComparison]) -> Table:
  """Ours against transformers as launch.benchmark --mode=devices prints it."""
  return Table(
    title=(
      "\nsingle-device prefill vs Hugging Face transformers (PyTorch CPU, same weights, "
      "tokens and thread count), MEASURED:",
    ),
    header=(
      f"{'C':>7} {'threads':>7} {'kernel':>8} {'ours':>11} {'transformers':>13} {'ours/HF':>8}"
    ),
    lines=tuple(
      f"{c.context_len:>7} {c.threads:>7} {c.kernel:>8} {c.ours_tokens_per_s:>9.0f}/s "
      f"{c.transformers_tokens_per_s:>11.0f}/s {c.ratio:>7.2f}x"
      for c in comparison
    ),
    records=tuple(dataclasses.asdict(c) for c in comparison),
  )
