"""Layer 2: the 1-D device mesh every strategy runs on, and placing arrays on it.

All device logic lives in kvr_jax/; models/ knows nothing of this.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

# The one mesh axis: prompt chunks (KV-Runahead ranks, TSP sequence shards) live along it.
AXIS = "ranks"


def make_mesh(num_devices: int | None = None, devices=None) -> Mesh:
  """A 1-D mesh with axis `ranks` over the first `num_devices` devices (default: all).

  Rank i is the i-th device; rank 0 gets the earliest tokens. With `jax.distributed`
  initialised, `jax.devices()` spans all processes, so the mesh does too.
  """
  devices = list(jax.devices() if devices is None else devices)
  if num_devices is None:
    num_devices = len(devices)
  if not isinstance(num_devices, numbers.Integral) or isinstance(num_devices, bool):
    raise ValueError(f"`num_devices` must be a positive integer, got {num_devices!r}")
  num_devices = int(num_devices)
  if num_devices < 1:
    raise ValueError(f"`num_devices` must be a positive integer, got {num_devices!r}")
  _check_distinct(devices[:num_devices])
  if num_devices > len(devices):
    raise ValueError(
      f"`num_devices`={num_devices} but only {len(devices)} devices are present "
      "(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
      "importing jax)"
    )
  return jax.make_mesh(
    (num_devices,), (AXIS,), axis_types=(AxisType.Explicit,), devices=devices[:num_devices]
  )


def check_mesh(mesh) -> int:
  """Validates a user-supplied mesh; returns its size p."""
  if not isinstance(mesh, Mesh):
    raise ValueError(
      f"`mesh` must be a jax.sharding.Mesh (see kvr_jax.make_mesh), got {type(mesh).__name__}"
    )
  if tuple(mesh.axis_names) != (AXIS,):
    raise ValueError(
      f"`mesh` must be 1-D with the axis {AXIS!r}, got axes "
      f"{tuple(mesh.axis_names)}; build it with kvr_jax.make_mesh(p)"
    )
  _check_distinct(list(mesh.devices.reshape(-1)))
  return mesh.shape[AXIS]


def _check_distinct(devices) -> None:
  """Every rank needs its own device: a device twice would hold two ranks' shards."""
  seen = set()
  for i, device in enumerate(devices):
    if device in seen:
      raise ValueError(
        f"device {device} appears twice in the mesh (again at rank {i}); every rank needs "
        "its own device"
      )
    seen.add(device)


def last_rank_device(mesh: Mesh):
  """The device of rank p-1: after KV-Runahead it holds the whole KV cache."""
  return mesh.devices.reshape(-1)[-1]


def global_array(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A jax.Array with `sharding` built from a host array that every process holds; each
  process transfers only the pieces of its own devices (works in one process too)."""
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_on(array: jax.Array, device) -> jax.Array | None:
  """The single-device piece of a rank-sharded output ([p, ...]) that lives on `device`,
  without its leading rank axis; None when that device belongs to another process."""
  for shard in array.addressable_shards:
    if shard.device == device:
      # A plain single-device array: the shard of a mesh array keeps the mesh's axis type.
      return jax.device_put(shard.data[0], jax.sharding.SingleDeviceSharding(device))
  return None
