"""The attention kernels as data: one frozen record per kernel, in one table.

Every question about a kernel (does it take a sliding window, return its log-sum-exp, skip
masked blocks, write scores to memory, run on this device and dtype, which block sizes) is a
field here; nothing else in the project tests a kernel's name. The maths lives in
models/layers.py (`attend_static`, `attend_partial` dispatch on `computes`).

A record is hashable and its block sizes are fields, so a compiled program keyed by the
kernel record is keyed by its block sizes too: `dataclasses.replace(KERNELS["flash"],
query_block=256)` is another program, never a module global changed under a cached one.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
  """One attention kernel.

  name: what `attention=` and the command lines take.
  computes: how (models.layers dispatches on it): "dense" the whole [T, S] rectangle masked
    afterwards (the paper's accounting); "blocked" query blocks, each over the keys up to its
    last query; "flash" online softmax over key blocks, masked blocks skipped, O(block^2)
    memory; "two-piece" the unmasked prefix and the causal diagonal as fused-attention calls
    merged by their float32 log-sum-exp.
  implementation: "xla", or "cudnn" (cuDNN's fused flash kernel, NVIDIA GPUs only).
  takes_window: takes a sliding window (the two-piece kernels cannot: the prefix piece is
    unmasked).
  returns_lse: returns its float32 log-sum-exp, so partials over disjoint keys merge exactly.
  skips_causal_blocks: never computes the masked future of a causal diagonal (the cost
    model's causal_skip).
  scores_in_memory: writes its score matrix to memory (the cost model's byte traffic).
  lengths_as_data: takes query rows and a key end as traced values (the one-body program).
  dtypes: the input dtypes it takes (None: any).
  platforms: the JAX platforms it runs on.
  query_block, key_block: its block sizes (None where it has none).
  """

  name: str
  computes: str
  implementation: str = "xla"
  takes_window: bool = True
  returns_lse: bool = False
  skips_causal_blocks: bool = False
  scores_in_memory: bool = True
  lengths_as_data: bool = False
  dtypes: tuple[str, ...] | None = None
  platforms: tuple[str, ...] = ("cpu", "gpu", "tpu")
  query_block: int | None = None
  key_block: int | None = None

  def runs_on(self, device, dtype, window: int | None) -> bool:
    """Whether this kernel runs on `device` for a model of `dtype` with sliding `window`."""
    return self.why_not(device, dtype, window) is None

  def why_not(self, device, dtype, window: int | None) -> str | None:
    """Why this kernel cannot run on `device` for a model of `dtype` with sliding `window`
    (the end of a sentence that starts with the kernel's name), or None where it can."""
    if window is not None and not self.takes_window:
      return f"takes no sliding window (this model's is {window} tokens)"
    if device.platform not in self.platforms:
      return f"runs on {self.platforms}, not {device.platform}"
    if self.dtypes is not None and np.dtype(dtype).name not in self.dtypes:
      return f"takes {self.dtypes} weights, not {np.dtype(dtype).name}"
    if self.implementation == "cudnn":
      version = str(getattr(getattr(device, "client", None), "platform_version", ""))
      if "rocm" in version.lower():  # cuDNN is NVIDIA's; ROCm GPUs report platform "gpu"
        return f"is NVIDIA's cuDNN; this GPU runs {version}"
      if not cudnn_available():
        return "needs cuDNN, which JAX does not find on this machine (install it, or use flash)"
    return None


KERNELS: dict[str, AttentionKernel] = {
  k.name: k
  for k in (
    AttentionKernel("dense", "dense"),
    # Query block measured fastest of 64/128/256/512 on this 2-core CPU for T = 2048, 4096.
    AttentionKernel("blocked", "blocked", skips_causal_blocks=True, query_block=128),
    # Blocks chosen by measurement (`python -m launch.benchmark --mode=kernels`).
    AttentionKernel(
      "flash",
      "flash",
      returns_lse=True,
      skips_causal_blocks=True,
      scores_in_memory=False,
      lengths_as_data=True,
      query_block=512,
      key_block=512,
    ),
    AttentionKernel(
      "fused",
      "two-piece",
      takes_window=False,
      returns_lse=True,
      skips_causal_blocks=True,
      scores_in_memory=False,
    ),
    # Measured 10x the flash kernel's speed on an H100 (docs/gpu.md).
    AttentionKernel(
      "cudnn",
      "two-piece",
      implementation="cudnn",
      takes_window=False,
      returns_lse=True,
      skips_causal_blocks=True,
      scores_in_memory=False,
      dtypes=("bfloat16", "float16"),
      platforms=("gpu",),
    ),
  )
}
KERNEL_NAMES = tuple(KERNELS)
# The default of strategies that skip masked work (single, kvr) where no platform choice
# applies: the fastest exact kernel on this machine's CPU benchmark from 1k tokens up.
DEFAULT_CAUSAL_KERNEL = KERNELS["flash"]


def cudnn_available() -> bool:
  """Whether JAX finds the cuDNN library (what its fused attention checks before it runs): a
  GPU machine without it gets the flash kernel from "auto" and a one-line refusal of
  "cudnn", not cuDNN's own error from inside a compile."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    cudnn.check_cudnn_version()
  except Exception:  # no such module in this JAX, or no cuDNN: either way not available
    return False
  return True


def get_kernel(kernel: str | AttentionKernel) -> AttentionKernel:
  """The record for a kernel name (a record is returned as it is: it may carry its own block
  sizes); refuses an unknown name with the known ones."""
  if isinstance(kernel, AttentionKernel):
    return kernel
  if kernel not in KERNELS:
    raise ValueError(f"unknown attention {kernel!r}; expected one of {KERNEL_NAMES}")
  return KERNELS[kernel]


def kernels_where(**fields) -> tuple[str, ...]:
  """The names of the kernels whose fields equal `fields` (for messages and choices)."""
  return tuple(
    k.name for k in KERNELS.values() if all(getattr(k, f) == v for f, v in fields.items())
  )
