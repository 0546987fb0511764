"""Placing a latent-attention model's prefill (DeepSeek-V3, Kimi K2, Moonlight; its program is
kvr_jax/strategies/latent.py: KV-Runahead, ring, all-gather CP or TSP) and decoding from its
latent cache, its cache form `FORM`: `kvr_jax.prefill` plans and runs its program as any
model's (`prefill.run_prefill`; 1-D mesh, or a 2-D one whose ranks are model groups: heads
and experts split over "model", kvr_jax.runtime.tensor_parallel, the latent whole on every
shard) and this module places its outputs: the cache joined on the last rank (cache="last":
KV-Runahead's last hop and own chunk where they lie, the peers' parts moved), or left in the
ranks' parts
(cache="sharded": `latent_sharded_step` attends every part where it lies in the absorbed form
and merges the partials across the ranks, pass-Q as for K,V caches; the decoded tokens'
latents on every rank, counted on the last; `sharded_latent_decode` gives it to the one
sharded stepper).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.core.caches import kept_cache
from kvr_jax.inference import decode, sharded_decode
from kvr_jax.inference.cache_form import ModelCacheForm, padded_positions
from kvr_jax.inference.rank_moves import (
  stacked_on_last_rank,
)
from kvr_jax.inference.sharded_decode import merge_across_ranks
from kvr_jax.runtime.mesh import (
  AXIS,
  global_array,
  rank_device,
  shard_on,
)
from kvr_jax.strategies.latent import runs_latent
from models.attention import merge_partials

CACHES = ("last", "sharded")


def operands(tokens_BT, ends_B):
  """The program's tokens operand (`CacheForm.operands`): the tokens as they are, padded
  rows too (a causal past is written per position; ends_B unused)."""
  del ends_B
  return tokens_BT


def left_in_parts(out: dict, plan) -> dict:
  """cache="sharded"'s `OwnParts` fields (`ModelCacheForm.left_in_parts`): each rank's latents
  where the program left them, [p, L, B, T_rank, C] (parts), and the prompt position of each
  of their rows [p, T_rank] (part_positions, -1: padding)."""
  positions = plan.strategy.cache_layout(plan.prompt_len, plan.chunks).positions()
  return dict(parts=out["own"], part_positions=positions)


def joined_from_last_hop(out: dict, plan, capacity: int):
  """The latent cache [L, B, capacity, C] from the last rank's outputs alone
  (`CacheForm.joined_from_last_hop`): its last hop (the whole prefix) and its own chunk, on
  its device, without a move."""
  owner = rank_device(plan.mesh, len(plan.chunks) - 1)
  last, own = shard_on(out["last"], owner), shard_on(out["own"], owner)
  return join_last_hop(last, own, plan.chunks[-1], capacity)


def joined_from_parts(out: dict, plan, capacity: int):
  """Every rank's latents moved onto the last rank (every process sends) and put in prompt
  order there (`CacheForm.joined_from_parts`); None in a process that does not hold the
  last rank."""
  pieces = stacked_on_last_rank(out["own"], plan.mesh)
  if pieces is None:
    return None
  rows = plan.strategy.cache_layout(plan.prompt_len, plan.chunks).rows_in_prompt_order()
  return join_in_prompt_order(pieces, rows, capacity)


def _joined(last_LBsC, own_LBcC, c_last: int, capacity: int):
  cache = jnp.concatenate([last_LBsC, own_LBcC[:, :, :c_last]], axis=2)
  return jnp.pad(cache, ((0, 0), (0, 0), (0, capacity - cache.shape[2]), (0, 0)))


def _ranks_in_turn(pieces_pLBcC):
  """Every rank's rows in turn, [L, B, p*c, C]."""
  p, L, B, c, C = pieces_pLBcC.shape
  return jnp.moveaxis(pieces_pLBcC, 0, 2).reshape(L, B, p * c, C)


def _in_prompt_order(pieces, rows_S, capacity: int):
  """The ranks' parts [p, L, B, c, C] as the cache [L, B, capacity, C]: the prompt's rows in
  order (`CacheLayout.rows_in_prompt_order`), room for decoding after them."""
  cache = jnp.take(_ranks_in_turn(pieces), rows_S, axis=2)
  return jnp.pad(cache, ((0, 0), (0, 0), (0, capacity - cache.shape[2]), (0, 0)))


# The joins on the last rank's device, jitted once (their lengths static): what prefill runs
# and what compiled_memory lowers from shapes for its move figures (tools.past_memory).
join_last_hop = jax.jit(_joined, static_argnums=(2, 3))
join_in_prompt_order = jax.jit(_in_prompt_order, static_argnums=2)


@kept_cache(8)
def latent_sharded_step(graphdef, mesh):
  """f(state, tokens_B, prompt_lens_B, parts [p, L, B, T_rank, C], part positions [p, T_rank],
  tail [L, B, M, C], tail_index) -> (logits [B, V], tail): one token per row, row b's at
  position prompt_lens_B[b] + tail_index (`sharded_decode.sharded_step_program`), its latent
  written into the (donated, replicated) tail at `tail_index`; row b reads the parts'
  positions before prompt_lens_B[b] (a padded row's padding, or the copy of a token the tail
  holds again, hidden). Each layer, every rank attends the token's absorbed query to its own
  part (`LatentAttention.absorbed_partial`) and, the last rank only, to the tail; the
  latent-space partials merge across the ranks (`merge_across_ranks`, one collective per
  layer) and go through kv_b_proj's value half once. On a ("ranks", "model") mesh each
  rank's group splits the heads and experts (its shards' sums over "model"); the parts and
  tail are whole on every shard of a rank."""

  def layer(block, at, x_B1D, caches, step):
    (tail_LBMC,), (parts_1LBTC, positions_1T) = caches, step.inputs
    l, rank, p = at.index, jax.lax.axis_index(AXIS), jax.lax.axis_size(AXIS)
    B, M = x_B1D.shape[0], tail_LBMC.shape[2]
    positions_B1, part_T = step.positions_B[:, None], positions_1T[0]
    part_visible_BT = (part_T >= 0)[None] & (part_T[None] < step.prompt_lens_B[:, None])
    tail_visible_BM = jnp.broadcast_to(jnp.arange(M) <= step.tail_index, (B, M))
    h_B1D = block.attention_input(x_B1D)
    q_nope, q_rope = block.queries(h_B1D, positions_B1)
    entry_B11C = block.latents(h_B1D, positions_B1)[None].astype(tail_LBMC.dtype)
    tail_LBMC = jax.lax.dynamic_update_slice(tail_LBMC, entry_B11C, (l, 0, step.tail_index, 0))
    q_BNC = block.absorbed_query(q_nope[:, 0], q_rope[:, 0])
    part = block.absorbed_partial(
      jax.lax.pcast(q_BNC, (AXIS,), to="varying"), parts_1LBTC[0, l], part_visible_BT[:, None]
    )
    tail_out, tail_lse = block.absorbed_partial(q_BNC, tail_LBMC[l], tail_visible_BM[:, None])
    tail_lse = jnp.where(rank == p - 1, tail_lse, -jnp.inf)  # counted once, on the last rank
    out_BNR = merge_across_ranks(*merge_partials(*part, tail_out, tail_lse))
    attn_BNv = block.expand_values(out_BNR.astype(x_B1D.dtype))
    return block.finish(x_B1D, attn_BNv[:, None], reduce=step.reduce), (tail_LBMC,)

  specs = ((jax.P(AXIS), jax.P(AXIS)), (jax.P(),))
  return sharded_decode.sharded_step_program(graphdef, mesh, layer, *specs)


def sharded_latent_decode(model, result, max_new_tokens: int):
  """cache="sharded"'s step of a latent model (`latent_sharded_step`), its inputs (the parts,
  which stay put, and their rows' prompt positions, by rank) and its cache: the new tokens'
  latents in a replicated tail."""
  mesh = result.mesh
  program = latent_sharded_step(model.graphdef, mesh)
  positions = global_array(result.past.part_positions, NamedSharding(mesh, jax.P(AXIS)))
  L, B, _, C = result.past.parts.shape[1:]
  tail = decode.zeros_on((L, B, max_new_tokens, C), model.dtype, NamedSharding(mesh, jax.P()))
  return program, (result.past.parts, positions), (tail,)


def one_rank_latent_parts(cache_LBSC, T: int, mesh) -> dict:
  """A one-rank prefill's latent cache as that rank's part [1, L, B, T, C]."""
  parts = jax.device_put(cache_LBSC[None, :, :, :T], NamedSharding(mesh, jax.P(AXIS)))
  return dict(parts=parts, part_positions=np.arange(T, dtype=np.int32)[None])


@functools.partial(jax.jit, static_argnums=1)
def grown(cache_LBSC, capacity: int):
  """The latent cache [L, B, S, C] with room for `capacity` positions, a fresh buffer."""
  return padded_positions(cache_LBSC, 2, capacity)


FORM = ModelCacheForm(
  name="latent",
  runs=runs_latent,
  caches=CACHES,
  group_cache_spec=jax.P(),  # headless: whole on every shard
  operands=operands,
  left_in_parts=left_in_parts,
  joined_from_last_hop=joined_from_last_hop,
  joined_from_parts=joined_from_parts,
  grown=grown,
  one_device_layout=lambda config, cache, m: cache,
  prompt_part=lambda cache, T: cache[:, :, :T],
  sharded_decode=sharded_latent_decode,
  one_rank_parts=one_rank_latent_parts,
)
