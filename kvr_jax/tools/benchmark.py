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

from kvr_jax.core.caches import clear_caches
from kvr_jax.core.chunks import check_ranks
from kvr_jax.inference.buckets import bucket_length
from kvr_jax.inference.prefill import prefill, prefill_arguments
from kvr_jax.planning import costmodel, presets
from kvr_jax.planning.partition import PartitionPlan, resolve_partition
from kvr_jax.runtime.loading import Model, build_model, load_hf_model, resolve_dtype
from kvr_jax.runtime.mesh import AXIS, make_mesh, mesh_of_ranks
from kvr_jax.strategies import TRACE_COUNT
from kvr_jax.strategies.base import AUTO_KERNELS
from kvr_jax.tools.measured import fitted_hardware
from kvr_jax.tools.timing import synthetic_prompt, time_prefill
from models.kernels import KERNELS, get_kernel
from models.layers import attend_static


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
            1 if strategy == "single" else model_parallel,
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
    # the kernels with query and key blocks are timed at every block pair asked for
    for blocks in (flash_blocks if get_kernel(kernel).key_block else [(None, None)])
  ]
  for C, kernel, (bq, bk) in tqdm(cases, desc="kernels", disable=not progress):
    rng = np.random.RandomState(0)
    q = jax.device_put(rng.randn(1, C, num_heads, head_dim).astype(np.float32))
    k, v = (
      jax.device_put(rng.randn(1, C, num_kv_heads, head_dim).astype(np.float32)) for _ in range(2)
    )
    record = get_kernel(kernel)
    if bq is not None:
      record = dataclasses.replace(record, query_block=bq, key_block=bk)
    fn = jax.jit(lambda q, k, v, record=record: attend_static(q, k, v, 0, record))
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


# --- one accelerator: every kernel against transformers, MFU, modelled multi-device TTFT -------


@dataclasses.dataclass
class AcceleratorRow:
  """MEASURED single-device prefill on this process's first device."""

  context_len: int
  implementation: str  # "kvr-jax/<kernel>" or "transformers/sdpa"
  ttft_s: float  # median of warm runs (the whole prefill: logits and KV cache)
  achieved_tflops: float  # the prefill's model FLOPs (causal attention) / TTFT
  mfu: float | None  # achieved / the device's peak; None where the peak is unknown
  max_logit_diff: float | None  # against transformers on the same weights and tokens


@dataclasses.dataclass
class ModelledRankRow:
  """MODELLED p-device TTFT: per-rank compute fitted to this device's measured KVR phases
  (`fitted_hardware`), links from a preset, each strategy with a fused kernel."""

  context_len: int
  num_ranks: int
  links: str
  strategy: str  # kvr (KVR-S on the fitted model), ring, allgather
  partition: str
  ttft_s: float
  speedup_vs_measured_single: float


def device_hardware(device) -> costmodel.Hardware | None:
  """The cost-model preset of `device` (its data-sheet peak, for MFU and memory bandwidth):
  H100 SXM and A100 by name, the `local` calibration on a CPU, None where unknown."""
  kind = str(getattr(device, "device_kind", ""))
  if device.platform == "gpu":
    if "H100" in kind and "PCIe" not in kind:
      return presets.HARDWARE["h100-sxm"]
    if "A100" in kind:
      return presets.HARDWARE["a100-80gb"]
    return None
  if device.platform == "cpu":
    return presets.hardware_preset(presets.LOCAL)
  return None


def prefill_flops(config, context_len: int) -> float:
  """Model FLOPs of one prefill (projections, causal attention counted once, MLP, the last
  position's head): what MFU divides by the peak."""
  work = costmodel.phase_work(
    config, context_len, context_len, 1, 2, **costmodel.kernel_flags("flash")
  )
  head = costmodel.head_work(config, 1, 2).flops
  return config.num_layers * sum(w.flops for w in work.values()) + head


def platform_kernels(device, dtype, window) -> tuple[str, ...]:
  """The exact kernels worth timing on `device`: what attention="auto" chooses from there."""
  candidates = AUTO_KERNELS.get(device.platform, ("flash",))
  return tuple(k for k in candidates if KERNELS[k].runs_on(device, dtype, window))


def _twin_models(config, dtype, torch_device: str, seed: int):
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


def _time_transformers(hf_model, tokens, repeats: int, torch_device: str):
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


def accelerator_benchmark(
  config,
  context_lens,
  *,
  kernels=None,
  dtype="auto",
  repeats: int = 3,
  compare_transformers: bool = True,
  ranks=(2, 4, 8),
  links=("300GBps", "10GBps"),
  seed: int = 0,
  progress: bool = True,
) -> tuple[list[AcceleratorRow], list[ModelledRankRow]]:
  """Single-device prefill on this process's first device, any backend: TTFT of every
  kernel (`kernels`, default the platform's exact ones) beside transformers (PyTorch SDPA,
  same weights, same tokens, same device; Llama configs), with the achieved FLOP/s as a
  fraction of the device's peak (MFU). Then, for p in `ranks`, the per-rank programs of
  KV-Runahead timed one at a time on this device (`fitted_hardware`) feed the cost model:
  MODELLED p-device TTFT of KVR-S, ring and all-gather over each link preset.
  """
  device = jax.local_devices()[0]
  dtype = resolve_dtype(dtype)
  for C in context_lens:
    if C > config.max_position_embeddings:
      raise ValueError(f"context length {C} exceeds max_position_embeddings")
    for p in ranks:
      check_ranks(C, p)
  for name in links:
    presets.check_preset_names(presets.LOCAL, name)
  kernels = tuple(kernels or platform_kernels(device, dtype, config.sliding_window))
  for kernel in kernels:
    reason = get_kernel(kernel).why_not(device, dtype, config.sliding_window)
    if reason is not None:
      raise ValueError(
        f"kernel {kernel!r} does not run on {device.platform} in {np.dtype(dtype).name}: it "
        f"{reason}"
      )
  compare = compare_transformers and config.architecture == "llama"
  torch_device = "cuda" if device.platform == "gpu" else "cpu"
  if compare:
    hf_model, model = _twin_models(config, dtype, torch_device, seed)
  else:
    hf_model, model = None, Model(build_model(config, dtype, seed), source="random")
  hardware = device_hardware(device)
  rows, modelled = [], []
  for C in tqdm(context_lens, desc="accelerator", disable=not progress):
    tokens = synthetic_prompt(config.vocab_size, C, 1, seed)
    flops = prefill_flops(config, C)
    hf_logits = None
    if hf_model is not None:
      hf_s, hf_logits = _time_transformers(hf_model, tokens, repeats, torch_device)
      rows.append(
        AcceleratorRow(
          C,
          "transformers/sdpa",
          hf_s,
          flops / hf_s / 1e12,
          None if hardware is None else flops / hf_s / hardware.peak_flops,
          None,
        )
      )
    single_s = {}
    for kernel in kernels:
      timing = time_prefill(model, tokens, repeats, attention=kernel)
      single_s[kernel] = timing.median_s
      logits = np.asarray(timing.result.logits, np.float32)
      rows.append(
        AcceleratorRow(
          C,
          f"kvr-jax/{kernel}",
          timing.median_s,
          flops / timing.median_s / 1e12,
          None if hardware is None else flops / timing.median_s / hardware.peak_flops,
          None if hf_logits is None else float(np.abs(logits - hf_logits).max()),
        )
      )
    best_kernel = min(single_s, key=single_s.get)
    for p in ranks:
      fitted = fitted_hardware(model, C, p, best_kernel, repeats=repeats, base=hardware)
      for name in links:
        setup = costmodel.Setup(
          fitted,
          presets.links_preset(name),
          dtype_bytes=np.dtype(dtype).itemsize,
          **costmodel.kernel_flags(best_kernel),
        )
        chunks = resolve_partition(
          PartitionPlan("search", hardware=fitted, links=setup.links),
          C,
          p,
          config=config,
          dtype_bytes=setup.dtype_bytes,
          **costmodel.kernel_flags(best_kernel),
        )
        for strategy in ("kvr", "ring", "allgather"):
          sim = costmodel.simulate(
            config,
            strategy,
            C,
            setup,
            num_ranks=p,
            partition=chunks if strategy == "kvr" else None,
          )
          modelled.append(
            ModelledRankRow(
              C,
              p,
              name,
              strategy,
              "/".join(map(str, sim.partition)) if strategy == "kvr" else "zigzag",
              sim.ttft,
              single_s[best_kernel] / sim.ttft,
            )
          )
  return rows, modelled


# --- length buckets: a stream of prompts of new lengths ----------------------------------------


@dataclasses.dataclass
class BucketStreamRow:
  """One strategy over one stream of prompts, with exact shapes or with one bucket ladder."""

  strategy: str
  ladder: str  # "exact", "auto" or "N/octave"
  prompts: int
  programs_traced: int  # the strategy's prefill programs traced over the stream
  stream_s: float  # the stream end to end: every prompt's first call (compiles included)
  warm_ratio: float  # median over prompts of warm TTFT with this ladder / with exact shapes
  warm_median_s: float  # median over prompts of each prompt's warm TTFT
  padding_fraction: float  # padded tokens / real tokens over the stream


def forget_compiled_programs() -> None:
  """Every compiled program and planned partition this process holds, dropped: the next
  call of any shape compiles (and plans) again, as in a new process."""
  jax.clear_caches()
  clear_caches()


def bucket_stream(
  model: Model,
  lengths,
  strategies=("single", "kvr", "ring", "allgather"),
  *,
  ladders: dict | None = None,
  num_devices: int | None = None,
  repeats: int = 3,
  seed: int = 0,
) -> list[BucketStreamRow]:
  """Prompts of the given lengths, one after another, per strategy with exact shapes and then
  with each ladder of `ladders` (name -> `buckets` argument; default {"auto": "auto"}): the
  programs traced (strategies.TRACE_COUNT), the stream's end-to-end time (each prompt's first
  call: what a server sees when prompts of new lengths arrive) and the warm TTFT against
  exact shapes (the cost of padding; `repeats` rounds over the prompts right after each
  stream). Every compiled program is dropped before each stream, so that ladders sharing
  buckets do not share programs. Every call ends at logits on the host."""
  ladders = {"auto": "auto"} if ladders is None else ladders
  mesh = make_mesh(num_devices)
  max_position = model.config.max_position_embeddings
  prompts = [
    synthetic_prompt(model.config.vocab_size, n, 1, seed + i)[0] for i, n in enumerate(lengths)
  ]
  shapes = {"exact": None, **ladders}
  rows = []
  for strategy in strategies:
    kwargs = prefill_arguments(strategy, mesh=mesh, partition="search")

    def call(tokens, buckets):
      start = time.perf_counter()
      np.asarray(prefill(model, tokens, buckets=buckets, **kwargs).logits)
      return time.perf_counter() - start

    streams, warm = {}, {}
    for name, buckets in shapes.items():
      forget_compiled_programs()  # ladders share buckets (4 per octave are among 8 per octave)
      traced = TRACE_COUNT[strategy]
      stream_s = sum(call(t, buckets) for t in tqdm(prompts, desc=f"{strategy} {name}"))
      streams[name] = (TRACE_COUNT[strategy] - traced, stream_s)
      # Warm, while this ladder's programs are compiled: `repeats` rounds over the prompts.
      rounds = [[call(t, buckets) for t in prompts] for _ in range(repeats)]
      warm[name] = [statistics.median(times) for times in zip(*rounds, strict=True)]
    for name, buckets in shapes.items():
      padded = sum(bucket_length(len(t), buckets, max_position) for t in prompts)
      ratios = [w / e for w, e in zip(warm[name], warm["exact"], strict=True)]
      rows.append(
        BucketStreamRow(
          strategy,
          name,
          len(prompts),
          streams[name][0],
          streams[name][1],
          statistics.median(ratios),
          statistics.median(warm[name]),
          padded / sum(lengths) - 1,
        )
      )
  return rows
