"""One device (any backend): single-device prefill with every exact kernel there, beside
transformers on the same device, with MFU, and the modelled p-device TTFT from the per-rank
programs timed on it. MEASURED, except the modelled column (labelled)."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
from tqdm.auto import tqdm

from kvr_jax.core.chunks import check_ranks
from kvr_jax.planning import costmodel, presets
from kvr_jax.planning.partition import PartitionPlan, resolve_partition
from kvr_jax.runtime.loading import Model, build_model, resolve_dtype
from kvr_jax.strategies import get_strategy
from kvr_jax.strategies.base import AUTO_KERNELS
from kvr_jax.tools.phases import fitted_hardware
from kvr_jax.tools.timing import synthetic_prompt, time_prefill
from launch.harness.report import Table
from launch.harness.transformers_baseline import time_transformers, twin_models
from models.kernels import KERNELS, get_kernel


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
  kernels = _check_arguments(config, context_lens, kernels, ranks, links, device, dtype)
  compare = compare_transformers and config.architecture == "llama"
  torch_device = "cuda" if device.platform == "gpu" else "cpu"
  if compare:
    hf_model, model = twin_models(config, dtype, torch_device, seed)
  else:
    hf_model, model = None, Model(build_model(config, dtype, seed), source="random")
  hardware = device_hardware(device)
  rows, modelled = [], []
  for C in tqdm(context_lens, desc="accelerator", disable=not progress):
    tokens = synthetic_prompt(config.vocab_size, C, 1, seed)
    flops = prefill_flops(config, C)

    def row(implementation, seconds, logit_diff=None, C=C, flops=flops):
      mfu = None if hardware is None else flops / seconds / hardware.peak_flops
      return AcceleratorRow(C, implementation, seconds, flops / seconds / 1e12, mfu, logit_diff)

    hf_logits = None
    if hf_model is not None:
      hf_s, hf_logits = time_transformers(hf_model, tokens, repeats, torch_device)
      rows.append(row("transformers/sdpa", hf_s))
    single_s = {}
    for kernel in kernels:
      timing = time_prefill(model, tokens, repeats, attention=kernel)
      single_s[kernel] = timing.median_s
      logits = np.asarray(timing.result.logits, np.float32)
      diff = None if hf_logits is None else float(np.abs(logits - hf_logits).max())
      rows.append(row(f"kvr-jax/{kernel}", timing.median_s, diff))
    best_kernel = min(single_s, key=single_s.get)
    for p in ranks:
      fitted = fitted_hardware(model, C, p, best_kernel, repeats=repeats, base=hardware)
      for name in links:
        best_s, dtype_bytes = single_s[best_kernel], np.dtype(dtype).itemsize
        modelled += _modelled_rows(config, C, p, fitted, name, best_kernel, best_s, dtype_bytes)
  return rows, modelled


def _check_arguments(config, context_lens, kernels, ranks, links, device, dtype):
  """accelerator_benchmark's arguments checked before anything runs; the kernels to time."""
  for C in context_lens:
    if C > config.max_position_embeddings:
      raise ValueError(f"context length {C} exceeds max_position_embeddings")
    for p in ranks:
      check_ranks(C, p)
  for name in links:
    presets.check_preset_names(presets.LOCAL, name)
  kernels = tuple(kernels or platform_kernels(device, dtype, config.narrowest_window))
  for kernel in kernels:
    reason = get_kernel(kernel).why_not(device, dtype, config.narrowest_window)
    if reason is not None:
      raise ValueError(
        f"kernel {kernel!r} does not run on {device.platform} in {np.dtype(dtype).name}: it "
        f"{reason}"
      )
  return kernels


def _modelled_rows(config, C, p, fitted, links_name, kernel, single_s, dtype_bytes):
  """MODELLED TTFT of KVR-S, ring and all-gather on p devices of the fitted hardware over
  the links preset named, against the measured single-device TTFT."""
  flags = costmodel.kernel_flags(kernel)
  setup = costmodel.Setup(
    fitted,
    presets.links_preset(links_name),
    dtype_bytes=dtype_bytes,
    **flags,
  )
  chunks = resolve_partition(
    PartitionPlan("search", hardware=fitted, links=setup.links),
    C,
    p,
    config=config,
    dtype_bytes=setup.dtype_bytes,
    **flags,
  )
  rows = []
  for strategy in ("kvr", "ring", "allgather"):
    kvr = get_strategy(strategy).partitioned
    sim = costmodel.simulate(
      config, strategy, C, setup, num_ranks=p, partition=chunks if kvr else None
    )
    layout = "/".join(map(str, sim.partition)) if kvr else "zigzag"
    rows.append(ModelledRankRow(C, p, links_name, strategy, layout, sim.ttft, single_s / sim.ttft))
  return rows


# --- length buckets: a stream of prompts of new lengths ----------------------------------------


def report_tables(rows, modelled, model_name: str, dtype, repeats: int) -> tuple[Table, Table]:
  """The MEASURED rows (TTFT, TFLOP/s, MFU, logits against transformers) and the MODELLED
  p-device TTFT of `accelerator_benchmark`, as two tables."""
  device = jax.local_devices()[0]
  dtype_name = jax.numpy.dtype(resolve_dtype(dtype)).name
  measured_title = (
    f"\nMEASURED single-device prefill, {model_name} ({dtype_name}), "
    f"{device.device_kind} ({device.platform}), median of {repeats} warm runs; MFU "
    "against the device's data-sheet peak (CPU: its measured matmul rate):"
  )
  lines = []
  for r in rows:
    mfu = "-" if r.mfu is None else f"{r.mfu:.0%}"
    diff = "-" if r.max_logit_diff is None else f"{r.max_logit_diff:.2e}"
    lines.append(
      f"{r.context_len:>7}  {r.implementation:<20}{r.ttft_s * 1e3:>9.1f}ms"
      f"{r.achieved_tflops:>9.2f}{mfu:>7}  {diff}"
    )
  measured = Table(
    (measured_title,),
    f"{'C':>7}  {'implementation':<20}{'TTFT':>11}{'TFLOP/s':>9}{'MFU':>7}  max |dlogit|",
    tuple(lines),
    tuple(dataclasses.asdict(r) for r in rows),
  )
  modelled_title = (
    "\nMODELLED p-device TTFT: per-rank compute fitted to KV-Runahead's per-rank programs timed "
    "one at a time on this device (fitted_hardware), links from the preset named; speed-up "
    "against the MEASURED best single-device TTFT above:"
  )
  lines = [
    f"{r.context_len:>7}{r.num_ranks:>4}  {r.links:<9}{r.strategy:<11}{r.ttft_s * 1e3:>9.1f}ms"
    f"{r.speedup_vs_measured_single:>9.2f}x  {r.partition}"
    for r in modelled
  ]
  header = f"{'C':>7}{'p':>4}  {'links':<9}{'strategy':<11}{'TTFT':>11}{'speed-up':>10}  partition"
  table = Table(
    (modelled_title,), header, tuple(lines), tuple(dataclasses.asdict(r) for r in modelled)
  )
  return measured, table


def write_report(rows, modelled, model_name: str, dtype, path: str) -> None:
  """Both tables as JSON, with the device and the dtype they ran on."""
  device = jax.local_devices()[0]
  report = {
    "model": model_name,
    "device": device.device_kind,
    "platform": device.platform,
    "dtype": jax.numpy.dtype(resolve_dtype(dtype)).name,
    "measured": [dataclasses.asdict(r) for r in rows],
    "modelled": [dataclasses.asdict(r) for r in modelled],
  }
  with open(path, "w") as f:
    json.dump(report, f, indent=1)
