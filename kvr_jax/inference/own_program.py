"""What the models with their own context-parallel programs share (kvr_jax.inference.hybrid:
Qwen3.5's hybrid layers; kvr_jax.inference.latent: DeepSeek-V3's latent attention): their
prompt check and decoding (greedy or sampled, as `kvr_jax.generate`) from the cache their
prefill leaves on the last rank, with the model's own `decode_step`."""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from kvr_jax.core.caches import kept_cache
from kvr_jax.inference.kv_cache import send_to_last_program
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, model_parallel, rank_row_mesh


def _is_integer(value) -> bool:
  """Python and numpy integers, not bools."""
  return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


# Sampling divides float32 logits by the temperature: below float32's smallest normal number
# the division is no longer a temperature (it underflows), so such values are refused.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


def check_sampling(model, max_new_tokens, temperature, top_k, top_p, seed) -> None:
  """The decoding arguments `generate` takes, refused by name (also called by the command
  lines before anything compiles)."""
  if not _is_integer(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"`max_new_tokens` must be a positive integer, got {max_new_tokens!r}")
  if not _is_real(temperature) or not temperature >= 0 or not np.isfinite(temperature):
    raise ValueError(f"`temperature` must be a finite number >= 0, got {temperature!r}")
  if 0 < temperature < MIN_TEMPERATURE:
    raise ValueError(
      f"`temperature`={temperature!r} is below float32's smallest normal number "
      f"({MIN_TEMPERATURE:.3g}); use temperature=0 for greedy decoding"
    )
  vocab = model.config.vocab_size
  if top_k is not None and (not _is_integer(top_k) or not 1 <= top_k <= vocab):
    raise ValueError(f"`top_k` must be an integer in [1, {vocab}], got {top_k!r}")
  if top_p is not None and (not _is_real(top_p) or not 0 < top_p <= 1):
    raise ValueError(f"`top_p` must be in (0, 1], got {top_p!r}")
  if not _is_integer(seed) or not -(2**63) <= seed < 2**63:
    raise ValueError(f"`seed` must be an integer in [-2**63, 2**63), got {seed!r}")


@kept_cache(8)
def decode_step_of(graphdef):
  """The jitted decode step of a model's structure, made once per graphdef (not per call).
  The cache is donated: each step writes the new token into it where it lies (without, XLA
  outputs a second cache every step: bench-qwen3.5 at 16k, 65.1 MiB beside its 64 MiB)."""

  @functools.partial(jax.jit, donate_argnums=(3,))
  def step(state, tokens_B, positions_B, cache):
    return nnx.merge(graphdef, state).decode_step(tokens_B, positions_B, cache)

  return step


@kept_cache(8)
def group_decode_step(graphdef, row_mesh, cache_spec):
  """The model's decode step on one rank's model group (a ("ranks", "model") mesh of one
  rank): (state split over "model", tokens [B], positions [B], cache placed by `cache_spec`
  (a PartitionSpec, or a pytree of them: a latent cache whole on every shard, a hybrid's split
  by head), donated) -> (logits [B, V] replicated, the cache moved on). Each shard runs its
  heads and experts; the psums over "model" add their partial sums."""
  P = jax.P

  def shard_step(state, tokens_B, positions_B, cache):
    model = nnx.merge(graphdef, state)
    return model.decode_step(tokens_B, positions_B, cache, reduce=tensor_parallel.psum_over_model)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def step(state, tokens_B, positions_B, cache):
    # check_vma=False: the psums make the logits (and a whole cache) whole on every shard.
    return jax.shard_map(
      shard_step,
      mesh=row_mesh,
      in_specs=(
        tensor_parallel.partition_specs(state, model_parallel(row_mesh)),
        P(),
        P(),
        cache_spec,
      ),
      out_specs=(P(), cache_spec),
      check_vma=False,
    )(state, tokens_B, positions_B, cache)

  return step


def stacked_on_last_rank(array, mesh):
  """Every rank's piece of a rank-sharded output [p, ...], stacked [p, ...] on the last rank:
  on its device (a 1-D mesh, or an output whole on every shard of a rank: a latent), or on its
  model group split over "model" as `array` is (each device stacks what every rank's same
  device held). Copied there in one process; across processes sent by one ppermute per rank
  (`kv_cache.send_to_last_program`: one piece-sized output at a time; every process runs
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
