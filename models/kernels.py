"""The attention kernels as data: one frozen record per kernel, in one table.

Every question about a kernel (does it take a sliding window, return its log-sum-exp, skip
masked blocks, write scores to memory, run on this device and dtype, which block sizes) is a
field here; nothing else in the project tests a kernel's name. The maths lives in
models/attention.py (`attend_static`, `attend_partial` dispatch on `computes`).

A record is hashable and its block sizes are fields, so a compiled program keyed by the
kernel record is keyed by its block sizes too: `dataclasses.replace(KERNELS["flash"],
query_block=256)` is another program, never a module global changed under a cached one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# What each way of computing attention can do, from its implementation in models/attention.py:
# (takes_window, returns_lse, skips_causal_blocks, scores_in_memory, lengths_as_data) and the
# block sizes it uses with their defaults. A record's capability fields follow from this table
# (a field given that disagrees is refused), so no record can claim what its maths does not do.
_Capabilities = tuple[bool, bool, bool, bool, bool]
CAPABILITIES: dict[str, tuple[_Capabilities, dict[str, int]]] = {
  "dense": ((True, False, False, True, False), {}),
  "blocked": ((True, False, True, True, False), {"query_block": 128}),
  "flash": ((True, True, True, False, True), {"query_block": 512, "key_block": 512}),
  # The prefix piece is unmasked: no window.
  "two-piece": ((False, True, True, False, False), {}),
}
_CAPABILITY_FIELDS = (
  "takes_window",
  "returns_lse",
  "skips_causal_blocks",
  "scores_in_memory",
  "lengths_as_data",
)
# Where each implementation runs: (platforms, dtypes; None = any) and what it computes.
IMPLEMENTATIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...] | None, tuple[str, ...]]] = {
  "xla": (("cpu", "gpu", "tpu"), None, tuple(CAPABILITIES)),
  "cudnn": (("gpu",), ("bfloat16", "float16"), ("two-piece",)),
}


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
  """One attention kernel.

  name: what `attention=` and the command lines take.
  computes: how (models.attention dispatches on it): "dense" the whole [T, S] rectangle masked
    afterwards (the paper's accounting); "blocked" query blocks, each over the keys up to its
    last query; "flash" online softmax over key blocks, masked blocks skipped, O(block^2)
    memory; "two-piece" the unmasked prefix and the causal diagonal as fused-attention calls
    merged by their float32 log-sum-exp.
  implementation: "xla", or "cudnn" (cuDNN's fused flash kernel, NVIDIA GPUs only).
  The next five follow from `computes` (CAPABILITIES; left out they are filled in, given they
  must agree):
  takes_window: takes a sliding window (the two-piece kernels cannot: the prefix piece is
    unmasked).
  returns_lse: returns its float32 log-sum-exp, so partials over disjoint keys merge exactly.
  skips_causal_blocks: never computes the masked future of a causal diagonal (the cost
    model's causal_skip).
  scores_in_memory: writes its score matrix to memory (the cost model's byte traffic).
  lengths_as_data: takes query rows and a key end as traced values (the one-body program).
  dtypes: the input dtypes it takes (None: any the implementation takes).
  platforms: the JAX platforms it runs on (None: every one the implementation runs on; a
    narrower tuple is kept, a wider one refused).
  query_block, key_block: its block sizes, positive integers, for the ways that have blocks
    (None: that way's default).
  """

  name: str
  computes: str
  implementation: str = "xla"
  takes_window: bool | None = None
  returns_lse: bool | None = None
  skips_causal_blocks: bool | None = None
  scores_in_memory: bool | None = None
  lengths_as_data: bool | None = None
  dtypes: tuple[str, ...] | None = None
  platforms: tuple[str, ...] | None = None
  query_block: int | None = None
  key_block: int | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"kernel `name` must be a non-empty string, got {self.name!r}")
    if self.computes not in CAPABILITIES:
      raise ValueError(
        f"kernel {self.name!r}: `computes`={self.computes!r} is unknown; expected one of "
        f"{tuple(CAPABILITIES)}"
      )
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(
        f"kernel {self.name!r}: `implementation`={self.implementation!r} is unknown; "
        f"expected one of {tuple(IMPLEMENTATIONS)}"
      )
    platforms, dtypes, computes = IMPLEMENTATIONS[self.implementation]
    if self.computes not in computes:
      raise ValueError(
        f"kernel {self.name!r}: `computes`={self.computes!r} is not what the "
        f"{self.implementation!r} implementation computes ({computes})"
      )
    capabilities, blocks = CAPABILITIES[self.computes]
    for field, can in zip(_CAPABILITY_FIELDS, capabilities, strict=True):
      given = getattr(self, field)
      if given is None:
        object.__setattr__(self, field, can)
      elif given is not can:
        raise ValueError(
          f"kernel {self.name!r}: `{field}`={given!r}, but what it computes "
          f"({self.computes!r}) has {field}={can}; leave the field out"
        )
    for field, allowed in (("platforms", platforms), ("dtypes", dtypes)):
      given = getattr(self, field)
      if given is None:
        object.__setattr__(self, field, allowed)
        continue
      given = (given,) if isinstance(given, str) else tuple(given)
      if not given or (allowed is not None and not set(given) <= set(allowed)):
        raise ValueError(
          f"kernel {self.name!r}: `{field}`={given!r}; the {self.implementation!r} "
          f"implementation takes {'any' if allowed is None else allowed}"
        )
      object.__setattr__(self, field, given)
    for field in ("query_block", "key_block"):
      given = getattr(self, field)
      if field not in blocks:
        if given is not None:
          raise ValueError(
            f"kernel {self.name!r}: `{field}`={given!r}, but {self.computes!r} has no such "
            "block; leave it out"
          )
      elif given is None:
        object.__setattr__(self, field, blocks[field])
      elif isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise ValueError(
          f"kernel {self.name!r}: `{field}` must be a positive integer, got {given!r}"
        )

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
    AttentionKernel("blocked", "blocked", query_block=128),
    # Blocks chosen by measurement (`python -m launch.benchmark --mode=kernels`).
    AttentionKernel("flash", "flash", query_block=512, key_block=512),
    AttentionKernel("fused", "two-piece"),
    # Measured 10x the flash kernel's speed on an H100 (docs/gpu.md).
    AttentionKernel("cudnn", "two-piece", implementation="cudnn"),
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
