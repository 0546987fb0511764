"""Layer 2: the device mesh every strategy runs on, and placing arrays on it.

The mesh is 1-D ("ranks") or, with tensor parallelism inside each rank, 2-D ("ranks",
"model"): rank i is then the group of devices in row i (kvr_jax.runtime.tensor_parallel).

All device logic lives in kvr_jax/; models/ knows nothing of this.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

# The mesh axis of the prompt: chunks (KV-Runahead ranks, TSP sequence shards) live along it.
AXIS = "ranks"
# The axis of a 2-D mesh along which each rank's model is split (tensor parallelism).
MODEL_AXIS = "model"


def split_dims(dims: str, **mesh_axis_of) -> jax.sharding.PartitionSpec:
  """The partition spec of an array named by its dimension letters (those of its variable
  names and einsum strings), each letter given in `mesh_axis_of` split over that mesh axis,
  every other replicated: split_dims("LBSKH", K=MODEL_AXIS) is the K,V cache [L, B, S, K, H]
  with its KV heads split over "model". Axes are named once, not by position."""
  if len(set(dims)) != len(dims) or set(mesh_axis_of) - set(dims):
    raise ValueError(
      f"split_dims({dims!r}, {sorted(mesh_axis_of)}): each dimension is one distinct letter and "
      "only those letters are split"
    )
  return jax.P(*(mesh_axis_of.get(d) for d in dims))


def make_mesh(num_devices: int | None = None, devices=None, *, model: int = 1) -> Mesh:
  """A 1-D mesh with axis `ranks` over the first `num_devices` devices (default: all).

  Rank i is the i-th device; rank 0 gets the earliest tokens. With `jax.distributed`
  initialised, `jax.devices()` spans all processes, so the mesh does too.

  model > 1: a 2-D mesh ("ranks", "model") of `num_devices` ranks (default: as many as the
  devices allow) of `model` devices each, rank-major (rank i holds devices [i*m, (i+1)*m)):
  every rank's model is split over its row (tensor parallelism).
  """
  devices = list(jax.devices() if devices is None else devices)
  if isinstance(model, bool) or not isinstance(model, numbers.Integral) or model < 1:
    raise ValueError(f"`model` must be a positive integer, got {model!r}")
  if model > 1:
    return _make_2d_mesh(num_devices, devices, int(model))
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


def mesh_of_ranks(num_devices: int | None = None, model_parallel: int = 1) -> Mesh:
  """`num_devices` devices (default: all) as ranks of `model_parallel` devices each: a 1-D
  mesh when model_parallel is 1, else num_devices / model_parallel ranks of a ("ranks",
  "model") mesh. What the launchers' --num_devices and --model_parallel mean (and the mesh to
  load weights split over: load_model(mesh=))."""
  if model_parallel == 1:
    return make_mesh(num_devices)
  if isinstance(model_parallel, bool) or not isinstance(model_parallel, int) or model_parallel < 1:
    raise ValueError(f"model_parallel must be a positive integer, got {model_parallel!r}")
  total = jax.device_count() if num_devices is None else num_devices
  if total % model_parallel:
    raise ValueError(
      f"{total} devices do not split into ranks of model_parallel={model_parallel} devices"
    )
  return make_mesh(total // model_parallel, model=model_parallel)


def _make_2d_mesh(num_ranks: int | None, devices: list, model: int) -> Mesh:
  if num_ranks is None:
    num_ranks = len(devices) // model
  if isinstance(num_ranks, bool) or not isinstance(num_ranks, numbers.Integral) or num_ranks < 1:
    raise ValueError(
      f"`num_devices` (the ranks of a model={model} mesh) must be a positive integer, got "
      f"{num_ranks!r} ({len(devices)} devices present)"
    )
  needed = int(num_ranks) * model
  if needed > len(devices):
    raise ValueError(
      f"{num_ranks} ranks x model={model} needs {needed} devices but only {len(devices)} are "
      "present"
    )
  _check_distinct(devices[:needed])
  grid = np.asarray(devices[:needed], dtype=object).reshape(int(num_ranks), model)
  return Mesh(grid, (AXIS, MODEL_AXIS), axis_types=(AxisType.Explicit,) * 2)


def model_parallel(mesh: Mesh) -> int:
  """Devices per rank: the size of the mesh's "model" axis, 1 on a 1-D mesh."""
  return mesh.shape[MODEL_AXIS] if MODEL_AXIS in mesh.axis_names else 1


def rank_row_mesh(mesh: Mesh, rank: int) -> Mesh:
  """Rank `rank`'s devices as a mesh of one rank (its "model" row on a 2-D mesh)."""
  m = model_parallel(mesh)
  row = list(mesh.devices.reshape(mesh.shape[AXIS], -1)[rank])
  return make_mesh(1, devices=row, model=m) if m > 1 else make_mesh(1, devices=row)


def rank_device(mesh: Mesh, rank: int):
  """The first device of rank `rank` (where its logits are read; the rank's only device on a
  1-D mesh)."""
  return mesh.devices.reshape(mesh.shape[AXIS], -1)[rank, 0]


def check_mesh(mesh, allow_model: bool = False) -> int:
  """Validates a user-supplied mesh; returns its number of ranks p. allow_model: a 2-D
  ("ranks", "model") mesh is accepted too (only where the caller runs tensor-parallel
  programs; everything else refuses it by name)."""
  if not isinstance(mesh, Mesh):
    raise ValueError(
      f"`mesh` must be a jax.sharding.Mesh (see kvr_jax.make_mesh), got {type(mesh).__name__}"
    )
  if tuple(mesh.axis_names) == (AXIS, MODEL_AXIS):
    if not allow_model:
      raise ValueError(
        f"this runs on a 1-D mesh (axis {AXIS!r}); a ({AXIS!r}, {MODEL_AXIS!r}) mesh runs "
        "only in prefill and generate so far"
      )
    _check_distinct(list(mesh.devices.reshape(-1)))
    return mesh.shape[AXIS]
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


def spans_processes(mesh: Mesh) -> bool:
  """Whether the mesh's devices belong to more than one process (jax.distributed): what runs
  on it is then a collective program that every one of them must run alike."""
  return len({d.process_index for d in mesh.devices.flat}) > 1


def shard_on(array: jax.Array, device) -> jax.Array | None:
  """The single-device piece of a rank-sharded output ([p, ...]) that lives on `device`,
  without its leading rank axis; None when that device belongs to another process."""
  for shard in array.addressable_shards:
    if shard.device == device:
      # A plain single-device array: the shard of a mesh array keeps the mesh's axis type.
      return jax.device_put(shard.data[0], jax.sharding.SingleDeviceSharding(device))
  return None


def piece_on(array: jax.Array, device) -> jax.Array | None:
  """`device`'s copy of a replicated array (a model group's logits) as a plain single-device
  array; None where `device` is another process's."""
  piece = next((s.data for s in array.addressable_shards if s.device == device), None)
  if piece is None:
    return None
  return jax.device_put(piece, jax.sharding.SingleDeviceSharding(device))


def placements(mesh, specs):
  """A NamedSharding on `mesh` for each PartitionSpec of a pytree of them."""
  return jax.tree.map(
    lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, jax.P)
  )
