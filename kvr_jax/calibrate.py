"""The `local` hardware and link presets: measured on the machine at hand, once per process.

Times a float32 matmul (FLOP/s), a large elementwise pass (memory bandwidth) and a ppermute
between two devices (link bandwidth and latency). On emulated CPU devices the "link" is a
memory copy inside one process; across processes (launch.multiprocess) it is gloo over TCP.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvr_jax.costmodel import Hardware, Links
from kvr_jax.loading import global_array


def _best_time(fn, *args, repeats: int = 5) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return min(times)


@functools.cache
def local_hardware() -> Hardware:
  """Measured matmul FLOP/s and memory bandwidth of the first device (fractions are 1: the
  measurement already is what is achievable)."""
  n = 1024
  a = jnp.ones((n, n), jnp.float32)
  matmul = jax.jit(lambda x, y: x @ y)
  flops = 2 * n**3 / _best_time(matmul, a, a)
  big = jnp.ones((16 * 1024 * 1024,), jnp.float32)  # 64 MB
  scale = jax.jit(lambda x: x * 1.5)
  bandwidth = 2 * big.nbytes / _best_time(scale, big)  # one read and one write
  return Hardware(
    "local",
    flops,
    bandwidth,
    1.0,
    1.0,
    f"measured on {jax.devices()[0].device_kind}: {flops / 1e9:.1f} GFLOP/s, "
    f"{bandwidth / 1e9:.1f} GB/s",
  )


@functools.cache
def local_links() -> Links:
  """Measured ppermute bandwidth and latency between the first two devices."""
  if jax.device_count() < 2:
    hw = local_hardware()
    return Links(hw.memory_bandwidth / 2, 1e-6)
  from kvr_jax.mesh import AXIS, make_mesh

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
  latency = _best_time(fn, small)
  seconds = max(_best_time(fn, large) - latency, 1e-9)
  return Links(large.nbytes / p / seconds, latency)
