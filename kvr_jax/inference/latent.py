"""Placing a latent-attention model's prefill (DeepSeek-V3, Kimi K2, Moonlight; its program is
kvr_jax/strategies/latent.py: KV-Runahead, ring, all-gather CP or TSP) and decoding from its
latent cache: `prefill_planned` runs a `PrefillPlan`'s program (`kvr_jax.prefill` plans it and
checks every argument; 1-D mesh, or a 2-D one whose ranks are model groups: heads and experts
split over "model", kvr_jax.runtime.tensor_parallel, the latent whole on every shard) and
places its outputs: the cache joined on the last rank (cache="last": KV-Runahead's last hop
and own chunk where they lie, the peers' parts moved), or left in the ranks' parts
(cache="sharded": `latent_sharded_step` attends every part where it lies in the absorbed form
and merges the partials across the ranks, pass-Q as for K,V caches; the decoded tokens'
latents on every rank, counted on the last; `sharded_latent_stepper` is `decode_from`'s loop
over it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.core.caches import kept_cache
from kvr_jax.inference import decode, sharded_decode
from kvr_jax.inference.cache_form import CacheForm, padded_positions
from kvr_jax.inference.rank_moves import (
  stacked_on_last_rank,
)
from kvr_jax.inference.sharded_decode import merge_across_ranks
from kvr_jax.runtime.loading import Model
from kvr_jax.runtime.mesh import (
  AXIS,
  global_array,
  rank_device,
  shard_on,
  spans_processes,
)
from kvr_jax.strategies import family_program, runahead
from kvr_jax.strategies.latent import STRATEGIES, compile_latent
from models.attention import merge_partials

CACHES = ("last", "sharded")


def prefill_planned(model: Model, plan, tokens_BT, room: int = 0, ends_B=None, join=True) -> dict:
  """kvr_jax.prefill's run of a latent model's plan (a PrefillPlan, checked when it was
  made: plan_from_shape): the plan's program (`PrefillPlan.compile`) on tokens_BT [B, T], its
  cache joined with room for `room` more positions or left in its parts (join=False:
  neither, `run_prefill(move_cache=False)`; KV-Runahead's last hop kept where cache="last"
  joins it). The `ModelCache` fields it made: logits [B, V] on the last rank's device (None in
  another process); model_cache, the latent cache there [L, B, T + room, C]; moved (the
  peers' parts moved there, KV-Runahead's last hop and own chunk there already); or for
  cache="sharded" each rank's latents where the program left them, [p, L, B, T_rank, C]
  (parts), the prompt position of each of their rows [p, T_rank] (part_positions, -1:
  padding) and, across processes, the logits replicated everywhere. ends_B: unused (a
  causal past takes padded rows as they are)."""
  del ends_B
  mesh, chunks, spec, keep_last = plan.mesh, plan.chunks, plan.strategy, plan.keep_last_hop
  p, T = len(chunks), tokens_BT.shape[1]
  program = plan.compile(model.graphdef)
  tokens_pBc = global_array(spec.arrange(tokens_BT, chunks), NamedSharding(mesh, jax.P(AXIS)))
  logits_pBV, out = program(model.state_for(mesh), tokens_pBc)
  owner = rank_device(mesh, p - 1)
  logits_BV = shard_on(logits_pBV, owner)  # None in the other processes
  if logits_BV is None:  # another process's rank is last: this one returns when its part is done
    jax.block_until_ready(out)
  capacity = T + room
  if plan.cache == "sharded":  # nothing moves: each rank keeps its own latents
    positions = spec.cache_layout(T, chunks).positions()
    # Across processes every process decodes (its ranks' parts): the last rank's logits
    # replicated everywhere, so that each samples the same first token.
    replicated = None
    if spans_processes(mesh):
      replicated = decode.from_last_rank(mesh, ranked=True)(logits_pBV)
    return dict(
      logits=logits_BV, parts=out["own"], part_positions=positions, replicated_logits=replicated
    )
  if not join or (logits_BV is None and keep_last):
    return dict(logits=logits_BV)
  if keep_last:  # the last rank holds every position: its last hop and its own chunk
    last, own = shard_on(out["last"], owner), shard_on(out["own"], owner)
    cache = join_last_hop(last, own, chunks[-1], capacity)
  else:  # every rank's parts move to the last rank (every process sends), into prompt order
    pieces = stacked_on_last_rank(out["own"], mesh)
    if pieces is None:  # another process's rank is last: it received the parts
      return dict(logits=None, moved=True)
    rows = spec.cache_layout(T, chunks).rows_in_prompt_order()
    cache = join_in_prompt_order(pieces, rows, capacity)
  return dict(logits=logits_BV, model_cache=cache, moved=not keep_last)


def compiled(plan, graphdef, padded: bool = False):
  """The plan's program (`PrefillPlan.compile`): (state, tokens [p, B, T_rank]) ->
  `compile_latent`'s outputs for the plan's strategy, split, kernel and probes (KV-Runahead's
  last hop kept where cache="last" joins it: a latent layer's hop carries the whole prefix),
  or a split as data's one program bound to the plan's split (`runahead.on_split`). A causal
  past takes padded rows as they are (padded unused)."""
  del padded
  spec, body, split_shape = family_program(plan.strategy, None, None)
  mesh, kernel, timeline = plan.mesh, plan.kernel, plan.timeline
  if split_shape is None:
    return compile_latent(
      spec, graphdef, mesh, plan.chunks, kernel, plan.keep_last_hop, timeline, body
    )
  program = compile_latent(spec, graphdef, mesh, None, kernel, False, timeline, body, split_shape)
  config = plan.strategy.options.config
  return runahead.on_split(program, mesh, config, split_shape, plan.chunks)


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
# and what compiled_memory lowers from shapes for its move figures (tools.own_memory).
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


def sharded_latent_stepper(model, result, max_new_tokens: int, seed: int):
  """cache="sharded" (latent models): every operand replicated over the prefill's mesh but the
  parts, which stay put; the new tokens' latents in a replicated tail. Across processes every
  operand is a global array that every process builds alike, and every process decodes."""
  mesh = result.mesh
  replicated = NamedSharding(mesh, jax.P())
  program = latent_sharded_step(model.graphdef, mesh)
  state = model.state_for(mesh)
  positions = global_array(result.part_positions, NamedSharding(mesh, jax.P(AXIS)))
  L, B, _, C = result.parts.shape[1:]
  tail = decode.zeros_on((L, B, max_new_tokens, C), model.dtype, replicated)
  prompt_lens_B = global_array(np.asarray(result.lengths, np.int32), replicated)

  def step(token_B, index, tail):
    return program(state, token_B, prompt_lens_B, result.parts, positions, tail, index)

  return step, tail, *sharded_decode.first_draw(result, seed)


def one_rank_latent_parts(cache_LBSC, T: int, mesh) -> dict:
  """A one-rank prefill's latent cache as that rank's part [1, L, B, T, C]."""
  parts = jax.device_put(cache_LBSC[None, :, :, :T], NamedSharding(mesh, jax.P(AXIS)))
  return dict(parts=parts, part_positions=np.arange(T, dtype=np.int32)[None])


@functools.partial(jax.jit, static_argnums=1)
def grown(cache_LBSC, capacity: int):
  """The latent cache [L, B, S, C] with room for `capacity` positions, a fresh buffer."""
  return padded_positions(cache_LBSC, 2, capacity)


FORM = CacheForm(
  "latent",
  ("single", *STRATEGIES),
  CACHES,
  jax.P(),  # headless: whole on every shard
  prefill_planned,
  grown,
  lambda config, cache, m: cache,
  lambda cache, T: cache[:, :, :T],
  sharded_latent_stepper,
  one_rank_latent_parts,
  compiled,
  takes_split_as_data=True,
)
