"""The parts of a hybrid or latent model's cache that stay where each rank computed them
(cache="sharded"): a one-rank prefill's cache as that rank's part, and the decode steppers
that read the parts in place (`own_families.OwnFamily.sharded_stepper`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.core.caches import kept_cache
from kvr_jax.inference import decode, hybrid, latent
from kvr_jax.runtime.cache_layout import CacheLayout, parts_spec
from kvr_jax.runtime.mesh import AXIS, global_array, model_parallel
from models.qwen3_5 import HybridCache, LinearState


def _state_on(model, mesh):
  if model_parallel(mesh) > 1:
    return model.state_split_over(mesh)
  return model.state_on(NamedSharding(mesh, jax.P()))


def placements(mesh, specs):
  """A NamedSharding on `mesh` for each PartitionSpec of a pytree of them."""
  return jax.tree.map(
    lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, jax.P)
  )


def sharded_latent_stepper(model, result, max_new_tokens: int, seed: int):
  """cache="sharded" (latent models): every operand replicated over the prefill's mesh but the
  parts, which stay put; the new tokens' latents in a replicated tail. Across processes every
  operand is a global array that every process builds alike, and every process decodes."""
  mesh = result.mesh
  replicated = NamedSharding(mesh, jax.P())
  program = latent.latent_sharded_step(model.graphdef, mesh)
  state = _state_on(model, mesh)
  positions = global_array(result.part_positions, NamedSharding(mesh, jax.P(AXIS)))
  L, B, _, C = result.parts.shape[1:]
  tail = decode.zeros_on((L, B, max_new_tokens, C), model.dtype, replicated)
  prompt_lens_B = global_array(np.asarray(result.lengths, np.int32), replicated)

  def step(token_B, index, tail):
    return program(state, token_B, prompt_lens_B, result.parts, positions, tail, index)

  logits = result.replicated_logits
  if logits is None:  # one process: the owner's logits are every device's to copy
    logits = jax.device_put(result.logits, replicated)
  key_data = np.asarray(jax.random.key_data(jax.random.key(seed)))
  return step, tail, logits, jax.random.wrap_key_data(global_array(key_data, replicated))


def one_rank_latent_parts(cache_LBSC, T: int, mesh) -> dict:
  """A one-rank prefill's latent cache as that rank's part [1, L, B, T, C]."""
  parts = jax.device_put(cache_LBSC[None, :, :, :T], NamedSharding(mesh, jax.P(AXIS)))
  return dict(parts=parts, part_positions=np.arange(T, dtype=np.int32)[None])


def one_rank_hybrid_parts(cache: HybridCache, T: int, mesh) -> dict:
  """A one-rank prefill's hybrid cache as cache="sharded" holds it: the full layers' K,V as
  the rank's part [1, L, 2, B*T, K, H] (rows folded by batch), the linear pasts as they are."""
  L, _, B, _, K, H = cache.kv_2BSKH.shape
  fold = jax.jit(
    lambda kv: kv[:, :, :, :T].reshape(1, L, 2, B * T, K, H),
    out_shardings=NamedSharding(mesh, parts_spec(mesh)),
  )
  layout = CacheLayout(context_len=T, part_len=T, segments=(((0, T, 0),),))
  linear = jax.device_put(cache.linear, placements(mesh, _linear_specs(mesh)))
  return dict(parts=fold(cache.kv_2BSKH), cache_layout=layout, linear_state=linear)


def _linear_specs(mesh):
  return hybrid.CACHE_SPECS.linear if model_parallel(mesh) > 1 else LinearState(jax.P(), jax.P())


def sharded_hybrid_stepper(model, result, max_new_tokens: int, seed: int):
  """cache="sharded" (hybrid models): the full layers' parts stay put, the decoded tokens'
  K,V in a tail on every rank, the linear pasts on every rank (a copy: the steps write into
  theirs); every operand a global array that every process builds alike."""
  mesh = result.mesh
  m = model_parallel(mesh)
  replicated = NamedSharding(mesh, jax.P())
  program = hybrid.hybrid_sharded_step(model.graphdef, mesh, result.cache_layout)
  state = _state_on(model, mesh)
  L, _, rows, K, H = result.parts.shape[1:]
  B = rows // result.cache_layout.part_len
  tail_spec = hybrid.CACHE_SPECS.kv_2BSKH if m > 1 else jax.P()
  tail = decode.zeros_on(
    (L, 2, B, max_new_tokens, K, H), model.dtype, NamedSharding(mesh, tail_spec)
  )
  linear = _copied(result.linear_state)
  # Each row's own length: a padded row's parts are read up to it, its tokens follow it.
  prompt_lens_B = global_array(np.asarray(result.lengths, np.int32), replicated)

  def step(token_B, index, caches):
    logits, tail, linear = program(state, token_B, prompt_lens_B, result.parts, *caches, index)
    return logits, (tail, linear)

  logits = result.replicated_logits
  if logits is None:  # one process: the owner's logits are every device's to copy
    logits = jax.device_put(result.logits, replicated)
  key_data = np.asarray(jax.random.key_data(jax.random.key(seed)))
  return step, (tail, linear), logits, jax.random.wrap_key_data(global_array(key_data, replicated))


def after_hybrid_step(result, caches) -> dict:
  """What the sharded step of each padded row's last real token (at `result.lengths`, the
  prefill stopped before it) leaves for decoding: the linear pasts after it, and the token's
  K,V (the tail's first entry) written into the part that holds its position, in place of
  the prefill's, which came from the linear layers stopped before it."""
  tail_L2BMKH, linear = caches
  layout, mesh = result.cache_layout, result.mesh
  p, B = layout.num_ranks, len(result.lengths)
  beyond = B * layout.part_len  # a row index no part has: that rank writes nothing
  rows_pB = np.full((p, B), beyond, np.int32)
  for b, position in enumerate(np.asarray(result.lengths)):
    rank, row = layout.holder(int(position))
    rows_pB[rank, b] = b * layout.part_len + row  # the parts fold the batch into their rows
  rows_pB = global_array(rows_pB, NamedSharding(mesh, jax.P(AXIS)))
  return dict(
    parts=_written_into_parts(mesh)(result.parts, tail_L2BMKH, rows_pB), linear_state=linear
  )


@kept_cache(8)
def _written_into_parts(mesh):
  """(parts [p, L, 2, B*P, K, H], tail [L, 2, B, M, K, H], rows [p, B]) -> the parts with
  the tail's first entry of row b at rank r's row rows[r, b] (past the part: not written)."""

  def write(parts_1L2RKH, tail_L2BMKH, rows_1B):
    new_L2BKH = tail_L2BMKH[:, :, :, 0].astype(parts_1L2RKH.dtype)
    return parts_1L2RKH[0].at[:, :, rows_1B[0]].set(new_L2BKH, mode="drop")[None]

  specs = (parts_spec(mesh), jax.P(), jax.P(AXIS))
  return jax.jit(jax.shard_map(write, mesh=mesh, in_specs=specs, out_specs=parts_spec(mesh)))


# A fresh copy of arrays (global ones too), placed as they were, which a step then owns.
_copied = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))
