"""Moving ranks' pieces of a program's rank-sharded outputs [p, ...] where a cache is read:
one rank's part onto the last rank (`send_to_last_program`: one ppermute, a part-sized
output; what kv_cache's cache="last" move runs per sender), every rank's onto the last rank
or its model group (`stacked_on_last_rank`: a hybrid's or latent model's cache pieces), and
one rank's onto every rank (`replicated_from_rank`: one psum, for what every rank's decode
step reads alike). Every process runs each program: a collective that one skips hangs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from kvr_jax.core.caches import kept_cache
from kvr_jax.runtime.cache_layout import parts_spec
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, rank_row_mesh


@kept_cache(64)
def send_to_last_program(mesh, sender: int, spec: tuple | None = None):
  """Rank `sender`'s part sent to rank p-1 (one ppermute; on a 2-D mesh each shard's heads to
  the same shard of rank p-1): parts [p, L, 2, B*P, K, H] in and out; the output is one
  part on every device (the received part on rank p-1, zeros elsewhere), never a
  prompt-long buffer. spec: another rank-sharded output's placement (a family's cache
  pieces: `stacked_on_last_rank`), default the K,V parts'."""
  p = mesh.shape[AXIS]

  def body(piece):
    return jax.lax.ppermute(piece, AXIS, perm=[(sender, p - 1)])

  placed = parts_spec(mesh) if spec is None else jax.P(*spec)
  # Another output's pieces unchecked (check_vma=False): a piece whole over "model" (a
  # latent) stays so, each shard sending its own copy.
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=placed, out_specs=placed, check_vma=spec is None)
  )


def stacked_on_last_rank(array, mesh):
  """Every rank's piece of a rank-sharded output [p, ...], stacked [p, ...] on the last rank:
  on its device (a 1-D mesh, or an output whole on every shard of a rank: a latent), or on its
  model group split over "model" as `array` is (each device stacks what every rank's same
  device held). Copied there in one process; across processes sent by one ppermute per rank
  (`send_to_last_program`: one piece-sized output at a time; every process runs
  each send).
  None in the processes that do not hold the last rank."""
  p = mesh.shape[AXIS]
  devices_pm = mesh.devices.reshape(p, -1)
  spec = tuple(array.sharding.spec)
  split = MODEL_AXIS in spec
  last_row = list(devices_pm[-1]) if split else [devices_pm[-1, 0]]
  pieces = {device: [] for device in last_row}
  for rank in range(p):
    if array.is_fully_addressable:  # one process: each piece copied from where it lies
      by_device = {shard.device: shard.data[0] for shard in array.addressable_shards}
      for j, device in enumerate(last_row):
        pieces[device].append(jax.device_put(by_device[devices_pm[rank, j]], device))
      continue
    received = array if rank == p - 1 else send_to_last_program(mesh, rank, spec)(array)
    for shard in received.addressable_shards:
      if shard.device in pieces:
        pieces[shard.device].append(shard.data[0])
  if last_row[0].process_index != jax.process_index():
    return None
  stacked = [jnp.stack(pieces[device]) for device in last_row]
  if not split:
    return stacked[0]
  out_spec = (None, *spec[1:])  # the rank axis now the stack's, whole on each device
  shape = list(stacked[0].shape)
  shape[out_spec.index(MODEL_AXIS)] *= len(last_row)
  row = NamedSharding(rank_row_mesh(mesh, p - 1), jax.P(*out_spec))
  return jax.make_array_from_single_device_arrays(tuple(shape), row, stacked)


@kept_cache(32)
def _from_rank_program(mesh, rank: int, spec: tuple):
  p_spec = jax.P(*spec)
  out_spec = jax.P(*spec[1:])

  def pick(piece):
    held = jax.lax.axis_index(AXIS) == rank
    return jax.lax.psum(jnp.where(held, piece[0], jnp.zeros_like(piece[0])), AXIS)

  # check_vma=False: a piece whole over "model" stays so.
  return jax.jit(
    jax.shard_map(pick, mesh=mesh, in_specs=p_spec, out_specs=out_spec, check_vma=False)
  )


def replicated_from_rank(array, mesh, rank: int):
  """Rank `rank`'s piece of a rank-sharded output [p, ...], on every rank (every process's
  too; on a 2-D mesh split over "model" as `array` is): one psum of a piece. For what every
  rank's decode step needs alike and is small (a linear layer's state and halo)."""
  return _from_rank_program(mesh, rank, tuple(array.sharding.spec))(array)
