"""Hardware and link presets for the cost model, and the `local` ones measured on this machine.

`local` times a float32 matmul (FLOP/s), a large elementwise pass (memory bandwidth), the flash
kernel and the chunked linear-attention rule (their own rates beside the matmul's) and a
ppermute between two devices (link bandwidth and latency). On emulated CPU devices the "link"
is a memory copy inside one process; across processes (launch.multiprocess) it is gloo over
TCP. Measurements move by 5-10% from run to run, and a searched partition moves with them, so
the first calibration of a machine setup is kept on disk (kvr_jax.core.resources.cache_dir)
and reused: the same command gives the same chunks run after run. `calibrate()` (or
`python -m launch.calibrate`) measures again and replaces the stored figures.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from kvr_jax.core import resources
from kvr_jax.planning.costmodel import Hardware, Links, Setup
from kvr_jax.runtime.mesh import AXIS, global_array, make_mesh
from kvr_jax.strategies.linear_modelled import rule_flops_per_token
from models import gated_deltanet as gdn
from models.flash import attend_flash

HARDWARE = {
  # Peaks from the NVIDIA data sheets; 60% of the tensor-core peak and 80% of HBM
  # bandwidth are typical of large fp16 GEMMs and streaming kernels (an assumption).
  "a100-80gb": Hardware(
    "a100-80gb",
    312e12,
    2.039e12,
    0.6,
    0.8,
    "A100 80GB SXM: 312 TFLOP/s dense fp16/bf16, 2.04 TB/s HBM2e",
    memory_bytes=80e9,
  ),
  "h100-sxm": Hardware(
    "h100-sxm",
    989e12,
    3.35e12,
    0.6,
    0.8,
    "H100 SXM: 989 TFLOP/s dense fp16/bf16, 3.35 TB/s HBM3",
    memory_bytes=80e9,
  ),
}

LINKS = {
  "300GBps": Links(300e9, 10e-6),  # NVLink-class, as the paper's high-bandwidth setting
  "10GBps": Links(10e9, 10e-6),  # the paper's low-bandwidth setting
}

LOCAL = "local"
# Part of the cache key: a new version (what is measured changed) measures again.
CALIBRATION_VERSION = 3


def check_preset_names(hardware: str | Hardware, links: str | Links) -> None:
  """Refuses unknown preset names without measuring anything."""
  if not isinstance(hardware, Hardware) and hardware != LOCAL and hardware not in HARDWARE:
    raise ValueError(f"unknown hardware preset {hardware!r}; presets: {sorted(HARDWARE) + [LOCAL]}")
  if not isinstance(links, Links) and links != LOCAL and links not in LINKS:
    raise ValueError(f"unknown link preset {links!r}; presets: {sorted(LINKS) + [LOCAL]}")


def hardware_preset(name: str | Hardware) -> Hardware:
  """A preset by name ("local" is measured here, once per machine); a Hardware passes through."""
  check_preset_names(name, LOCAL)
  if isinstance(name, Hardware):
    return name
  return local_calibration()[0] if name == LOCAL else HARDWARE[name]


def links_preset(name: str | Links) -> Links:
  """A preset by name ("local" is measured here, once per machine); a Links passes through."""
  check_preset_names(LOCAL, name)
  if isinstance(name, Links):
    return name
  return local_calibration()[1] if name == LOCAL else LINKS[name]


def make_setup(
  hardware: str | Hardware = LOCAL,
  links: str | Links = LOCAL,
  *,
  dtype_bytes: int,
  batch: int = 1,
  scores_in_memory: bool = True,
  causal_skip: bool = False,
  model_parallel: int = 1,
  expert_imbalance: float = 1.0,
) -> Setup:
  """A cost-model Setup from preset names (the one default: this machine, `local`).
  model_parallel: devices per rank (a 2-D mesh), whose group all-reduces over the same links
  preset as the ranks' hops (a mesh of one kind of link; `cluster_links` models nodes).
  expert_imbalance: see Setup."""
  check_preset_names(hardware, links)
  links = links_preset(links)
  return Setup(
    hardware_preset(hardware),
    links,
    dtype_bytes=dtype_bytes,
    batch=batch,
    scores_in_memory=scores_in_memory,
    causal_skip=causal_skip,
    model_parallel=model_parallel,
    model_links=links if model_parallel > 1 else None,
    expert_imbalance=expert_imbalance,
  )


def cluster_links(
  num_ranks: int,
  model_parallel: int,
  *,
  devices_per_node: int,
  inside: float,
  between: float,
  latency: float = 10e-6,
) -> tuple[Links, Links]:
  """The links of a ranks x model mesh laid out rank-major over nodes of `devices_per_node`
  devices (device d = rank * m + shard, node d // devices_per_node; bandwidths per device, in
  bytes/s: `inside` a node, NVLink-class; `between` nodes, each device's own NIC).

  Returns (links between ranks: link k at `between` where ranks k and k+1 sit on different
  nodes, `inside` elsewhere; links inside a rank's model group). Ranks' hops run shard to
  shard, each over its own device's link, so either every shard of link k crosses a node
  boundary or none does. A model group that spans nodes all-reduces as NCCL does, in as many
  rings as a node has devices, each crossing the boundary through a different device's NIC:
  every NIC carries 1/devices_per_node of the data, so the group's links run at
  min(inside, devices_per_node * between) (not at one NIC's rate)."""
  m, G = model_parallel, devices_per_node
  for name, value in (("num_ranks", num_ranks), ("model_parallel", m), ("devices_per_node", G)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
  if G % m and m % G:
    raise ValueError(
      f"model_parallel={m} must divide devices_per_node={G} or be a multiple of it (a model "
      "group either fits inside a node or spans whole nodes)"
    )
  crossing = [k for k in range(num_ranks - 1) if ((k + 1) * m) % G == 0 or m >= G]
  ranks = Links(inside, latency, slow=tuple((k, between) for k in crossing))
  return ranks, Links(min(inside, G * between) if m > G else inside, latency)


# --- the local calibration ---------------------------------------------------------------------


def machine_key() -> str:
  """What the local figures depend on: host, devices, processes, XLA's threading flags and
  the JAX (XLA) version that compiles the measured programs."""
  devices = jax.devices()
  facts = {
    "calibration": CALIBRATION_VERSION,
    "jax": jax.__version__,
    "host": platform.node(),
    "machine": platform.machine(),
    "cpus": os.cpu_count(),
    "platform": devices[0].platform,
    "device_kind": devices[0].device_kind,
    "devices": len(devices),
    "processes": jax.process_count(),
    "xla_flags": " ".join(sorted(os.environ.get("XLA_FLAGS", "").split())),
  }
  return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def calibration_path() -> str | None:
  """Where this machine's figures are kept; None when the cache directory cannot be used
  (then they are measured in every process that needs them)."""
  directory = resources.cache_dir()
  return None if directory is None else str(directory / f"calibration-{machine_key()}.json")


def _read(path: str | None) -> tuple[Hardware, Links] | None:
  if path is None:
    return None
  try:
    with open(path) as f:
      stored = json.load(f)
    links = dict(stored["links"])
    links["slow"] = tuple(tuple(x) for x in links.get("slow", ()))
    # Measured links are ppermutes, which hold their sender (a file from before the field).
    links["held_send"] = True
    hardware, links = Hardware(**stored["hardware"]), Links(**links)
  except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
    return None
  # Figures that would model nonsense (a zero or NaN rate divides by zero, or by nothing)
  # make the file count as absent: it is measured again and replaced.
  rates = [hardware.peak_flops, hardware.memory_bandwidth, links.bandwidth]
  rates += [hardware.flops_fraction]
  # A kernel's own fraction may be absent (None: the matmul's), never zero or NaN.
  rates += [
    fraction
    for fraction in (hardware.fused_attention_fraction, hardware.linear_rule_fraction)
    if fraction is not None
  ]
  if not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in rates):
    return None
  if not (isinstance(links.latency, (int, float)) and math.isfinite(links.latency)):
    return None
  return hardware, links


@functools.cache
def local_calibration() -> tuple[Hardware, Links]:
  """The `local` presets: read from this machine's cache, measured (and stored) if absent.

  With several processes (jax.distributed) the link measurement needs all of them, so they
  measure together unless every one of them has the figures on disk.
  """
  path = calibration_path()
  stored = _read(path)
  if jax.process_count() > 1:
    everyone_has = multihost_utils.process_allgather(np.int32(stored is not None)).all()
    if not everyone_has:
      stored = None
  return stored if stored is not None else _measure_and_store(path)


def calibrate() -> tuple[Hardware, Links]:
  """Measures this machine again and replaces the stored `local` presets."""
  local_calibration.cache_clear()
  result = _measure_and_store(calibration_path())
  local_calibration.cache_clear()
  return result


def _measure_and_store(path: str | None) -> tuple[Hardware, Links]:
  hardware = measure_hardware()
  links = measure_links(hardware)
  if jax.process_count() > 1:
    # Every process must model the same machine (or their searches, and so their compiled
    # programs, would differ): all take process 0's figures.
    figures = np.asarray(
      [
        hardware.peak_flops,
        hardware.memory_bandwidth,
        hardware.fused_attention_fraction,
        hardware.linear_rule_fraction,
        links.bandwidth,
        links.latency,
      ]
    )
    f, m, a, r, b, lat = (float(x) for x in multihost_utils.broadcast_one_to_all(figures))
    hardware = dataclasses.replace(
      hardware,
      peak_flops=f,
      memory_bandwidth=m,
      fused_attention_fraction=a,
      linear_rule_fraction=r,
    )
    links = Links(b, lat, held_send=True)
  if jax.process_index() == 0 and path is not None:
    payload = {"hardware": dataclasses.asdict(hardware), "links": dataclasses.asdict(links)}
    payload["links"]["slow"] = list(links.slow)
    resources.write_json_atomically(path, payload)
  return hardware, links


def best_time(fn, *args, repeats: int = 5) -> float:
  """The fastest of `repeats` timed calls of fn(*args), after one that compiles."""
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return min(times)


def measure_hardware() -> Hardware:
  """Measured matmul FLOP/s and memory bandwidth of the first device (fractions are 1: the
  measurement already is what is achievable)."""
  n = 1024
  a = jnp.ones((n, n), jnp.float32)
  matmul = jax.jit(lambda x, y: x @ y)
  flops = 2 * n**3 / best_time(matmul, a, a)
  big = jnp.ones((16 * 1024 * 1024,), jnp.float32)  # 64 MB
  scale = jax.jit(lambda x: x * 1.5)
  bandwidth = 2 * big.nbytes / best_time(scale, big)  # one read and one write
  # The flash kernel's own throughput: causal self-attention of 2048 tokens, 4 heads x 64.
  C, N, H = 2048, 4, 64
  qkv = jnp.ones((1, C, N, H), jnp.float32)
  flash = jax.jit(lambda x: attend_flash(x, x, x, 0)[0])
  attention_flops = 4 * N * H * C * (C + 1) / 2 / best_time(flash, qkv)
  rule_flops = _linear_rule_flops()
  return Hardware(
    LOCAL,
    flops,
    bandwidth,
    1.0,
    1.0,
    f"measured on {jax.devices()[0].device_kind}: {flops / 1e9:.1f} GFLOP/s, "
    f"{bandwidth / 1e9:.1f} GB/s, flash attention {attention_flops / 1e9:.1f} GFLOP/s, "
    f"linear-attention rule {rule_flops / 1e9:.1f} GFLOP/s",
    fused_attention_fraction=attention_flops / flops,
    linear_rule_fraction=rule_flops / flops,
  )


def _linear_rule_flops() -> float:
  """The chunked Gated DeltaNet rule's FLOP/s (as linear_modelled counts its FLOPs): 2048
  tokens, 4 value heads of 64 x 64 (bench-qwen3.5's), a slow decay."""
  T, h, d = 2048, 4, 64
  q_BThk = gdn.l2_normalize(jnp.ones((1, T, h, d), jnp.float32)) * d**-0.5
  g_BTh, beta_BTh = jnp.full((1, T, h), -0.01), jnp.full((1, T, h), 0.5)
  state_Bhkv = jnp.zeros((1, h, d, d), jnp.float32)
  rule = jax.jit(lambda q, g, beta, s: gdn.chunked(q, q, q, g, beta, s)[0])
  seconds = best_time(rule, q_BThk, g_BTh, beta_BTh, state_Bhkv)
  return T * rule_flops_per_token(h, d, d, entry_map=False) / seconds


def measure_links(hardware: Hardware) -> Links:
  """Measured ppermute bandwidth and latency between the first two devices."""
  if jax.device_count() < 2:
    return Links(hardware.memory_bandwidth / 2, 1e-6, held_send=True)
  # The whole mesh takes part (with jax.distributed every process must run the program); only
  # the first pair exchanges data: on processes pinned to cores that is the real link.
  mesh = make_mesh()

  def hop(x):
    return jax.lax.ppermute(x, AXIS, perm=[(0, 1)])

  fn = jax.jit(jax.shard_map(hop, mesh=mesh, in_specs=jax.P(AXIS), out_specs=jax.P(AXIS)))
  sharding = jax.sharding.NamedSharding(mesh, jax.P(AXIS))
  p = mesh.devices.size
  small = global_array(np.zeros((p, 8), np.float32), sharding)
  large = global_array(np.zeros((p, 4 * 1024 * 1024), np.float32), sharding)  # 16 MB per rank
  latency = best_time(fn, small)
  seconds = max(best_time(fn, large) - latency, 1e-9)
  # A ppermute completes on both ends together (gloo on CPU holds the send until the receive
  # is posted; the per-rank timelines showed it): the `local` links are rendezvous.
  return Links(large.nbytes / p / seconds, latency, held_send=True)
