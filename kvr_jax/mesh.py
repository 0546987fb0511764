"""The 1-D device mesh every parallel strategy runs on. All device logic lives in kvr_jax/."""

from __future__ import annotations

import jax
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
  if not isinstance(num_devices, int) or num_devices < 1:
    raise ValueError(f"`num_devices` must be a positive integer, got {num_devices!r}")
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
  return mesh.shape[AXIS]


def last_rank_device(mesh: Mesh):
  """The device of rank p-1: after KV-Runahead it holds the whole KV cache."""
  return mesh.devices.reshape(-1)[-1]
