"""Decode over the cache left in the ranks' parts (cache="sharded"; kvr_jax.inference.decode's
module docstring): `sharded_decode_program`, the step every rank runs over its own part, its
partial outputs merged by log-sum-exp across the ranks; `sharded_rings_program`, a windowed
layer's ring taken out of the parts once the prompt outgrew its window; and the logits of
padded rows' last real tokens over the parts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from kvr_jax.core.caches import kept_cache
from kvr_jax.inference.decode import DecodeLayout, ring_positions, take_slots, zeros_on
from kvr_jax.runtime.cache_layout import CacheLayout, parts_spec, unfold_batch
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, global_array, model_parallel, split_dims
from kvr_jax.runtime.tensor_parallel import partition_specs, psum_over_model
from models import scan_layers
from models.attention import attend_with_lse, merge_partials
from models.base import no_reduce, window_ring_attention
from models.flash import attend_flash


@kept_cache(32)
def sharded_rings_program(mesh, layout: CacheLayout, kept: DecodeLayout):
  """f(kv_parts [p, L, 2, B*P, K, H], lengths_B) -> (parts [p, L_f, 2, B*P, K, H], rings): the
  prefill's parts (`layout`) as the sharded decode keeps them (`kept`, `DecodeLayout.of` the
  prompt): the layers of its every-position group stay in the parts; a windowed layer whose
  window the prompt outgrew keeps only its ring, (k, v) [L_g, B, W, K, H] per ring group,
  each row's last W prompt positions at slot position mod W (zeros where the row is shorter
  than the window), replicated over the ranks (heads split over "model" on a 2-D mesh).
  The ranks holding those positions contribute them, one psum of the window-sized rings:
  nothing else moves."""
  P = jax.P
  p, C = layout.num_ranks, layout.context_len
  # Which row of a rank's part holds each prompt position (-1: another rank's).
  part_row_pC = np.full((p, C), -1, np.int32)
  for rank, runs in enumerate(layout.segments):
    for position, length, row in runs:
      part_row_pC[rank, position : position + length] = np.arange(row, row + length)
  full_layers = kept.every_position_layers

  def body(parts_1L2RKH, lengths_B):
    part_row_C = jnp.asarray(part_row_pC)[jax.lax.axis_index(AXIS)]
    part_L2BPKH = unfold_batch(parts_1L2RKH[0], layout.part_len)
    rings = []
    for group, ring in enumerate(kept.rings):
      if ring is None:
        rings.append(None)
        continue
      position_BW = ring_positions(lengths_B, ring)
      row_BW = jnp.where(position_BW >= 0, part_row_C[jnp.clip(position_BW, 0, C - 1)], -1)
      ring_L2BWKH = take_slots(part_L2BPKH[kept.layers_of(group)], row_BW, axis=3)
      # Each position is one rank's: the sum over ranks is each slot's own K,V, exactly.
      ring_L2BWKH = jax.lax.psum(ring_L2BWKH, AXIS)
      rings.append((ring_L2BWKH[:, 0], ring_L2BWKH[:, 1]))
    return parts_1L2RKH[:, full_layers], tuple(rings)

  split = model_parallel(mesh) > 1
  ring_spec = split_dims("LBWKH", K=MODEL_AXIS) if split else P()
  rings_spec = tuple(None if w is None else (ring_spec, ring_spec) for w in kept.rings)
  return jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(parts_spec(mesh), P()),
      out_specs=(parts_spec(mesh), rings_spec),
      check_vma=not split,
    )
  )


@functools.partial(jax.jit, static_argnums=(3,))
def prompt_order_of_rings(k_LBWKH, v_LBWKH, lengths_B, context_len: int):
  """A ring group ((k, v) [L_g, B, W, K, H], `sharded_rings_program`) in prompt order,
  [L_g, B, C, K, H]: row b's positions [lengths_B[b] - W, lengths_B[b]) from their slots,
  zeros elsewhere (what the ring no longer holds, and a padded row's padding)."""
  W = k_LBWKH.shape[2]
  position_C = jnp.arange(context_len)
  lengths_B1 = jnp.asarray(lengths_B, jnp.int32)[:, None]
  held_BC = (position_C >= lengths_B1 - W) & (position_C < lengths_B1)
  index = jnp.broadcast_to(position_C % W, held_BC.shape)[None, :, :, None, None]
  held = held_BC[None, :, :, None, None]
  return tuple(
    jnp.where(held, jnp.take_along_axis(x, index, axis=2), 0).astype(x.dtype)
    for x in (k_LBWKH, v_LBWKH)
  )


def part_attention(q_B1NH, part_2BPKH, positions_B, prompt_lens_B, runs, window: int | None):
  """One rank's partial attention of the new tokens (row b at `positions_B[b]`) over its
  part: every run (prompt position, length, row) at its own offset, only the keys before the
  row's `prompt_lens_B[b]` (past it, a padded row holds padding), merged. A rank with no
  run, or whose runs lie wholly before the window, returns out 0 and an lse at the mask
  value (weight 0). One query per row: dense scores, [B, N, run length], are small.
  Returns (out float32 [B, 1, N, H], lse float32 [B, 1, N])."""
  out = jnp.zeros_like(q_B1NH, jnp.float32)
  lse = out[..., 0] - jnp.inf
  for position_0, length, row in runs:
    keys = part_2BPKH[:, :, row : row + length]
    partial = attend_with_lse(
      q_B1NH,
      keys[0],
      keys[1],
      positions_B - position_0,
      window=window,
      num_valid_keys=prompt_lens_B - position_0,
    )
    out, lse = merge_partials(out, lse, *partial)
  return out, lse


def merge_across_ranks(out_B1NH, lse_B1N):
  """Exact merge of every rank's partial (same queries, disjoint keys), in float32:
  sum_r e^{lse_r - m} out_r / sum_r e^{lse_r - m}, m = max_r lse_r.

  One collective per layer: every rank's (out, lse), a few KB, gathered and merged on each
  rank alike. Across processes a collective's latency, not its bytes, is the decode step's
  cost (a pmax and two psums took three)."""
  both_B1NX = jnp.concatenate([out_B1NH, lse_B1N[..., None]], axis=-1)
  # An all-gather as one psum of [p, ...] with each rank's own row filled: its result is the
  # same on every rank (typed invariant, as the hidden state it feeds must be).
  p, rank = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
  own_pB1NX = jnp.zeros((p, *both_B1NX.shape), both_B1NX.dtype).at[rank].set(both_B1NX)
  gathered_pB1NX = jax.lax.psum(own_pB1NX, AXIS)
  out_pB1NH, lse_pB1N = gathered_pB1NX[..., :-1], gathered_pB1NX[..., -1]
  m = jnp.max(lse_pB1N, axis=0)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  weight_pB1N = jnp.exp(lse_pB1N - m)
  numerator = jnp.sum(weight_pB1N[..., None] * out_pB1NH, axis=0)
  denominator = jnp.sum(weight_pB1N, axis=0)
  return numerator / jnp.where(denominator > 0, denominator, 1.0)[..., None]


class StepInputs(NamedTuple):
  """What every layer of a sharded decode step reads beside its block and carry:
  positions_B (each row's new token's position: prompt_lens_B + tail_index), prompt_lens_B,
  tail_index (the decoded tokens' slot), inputs (the step's read-only operands as this rank
  holds them: a part [1, ...] where they lie by rank), reduce (a model group's sum)."""

  positions_B: jax.Array
  prompt_lens_B: jax.Array
  tail_index: jax.Array
  inputs: tuple
  reduce: Callable


def sharded_step_program(graphdef, mesh, layer, input_specs: tuple, cache_specs: tuple):
  """The decode step over cache="sharded" of every model, jitted over `mesh`: f(state,
  tokens_B, prompt_lens_B, *inputs, *caches, tail_index) -> (logits [B, V], *caches): one
  token per row at position prompt_lens_B[b] + tail_index. layer(block, at, x_B1D, caches,
  step: StepInputs) -> (x_B1D, caches): one layer (`models.scan_layers`' Layer `at`: one
  compiled body per kind), attending what each rank holds (the inputs: the prompt's parts)
  and writing the caches it carries (the decoded tokens' tail, a ring, a linear layer's
  state: donated, written where they lie). input_specs, cache_specs: how each operand lies
  over the mesh. Tokens, lengths, tail_index and the logits are replicated; on a 1-D mesh
  the weights too, on a ("ranks", "model") mesh they are split as the prefill split them
  (`Model.state_split_over(mesh)`; the psums over "model" make the logits whole on every
  shard, which the type check cannot see: check_vma off there, as in strategies.base.spmd)."""
  P, m = jax.P, model_parallel(mesh)
  reduce = psum_over_model if m > 1 else no_reduce
  n_inputs = len(input_specs)

  def step(state, tokens_B, prompt_lens_B, *operands):
    model = nnx.merge(graphdef, state)
    inputs, caches, tail_index = operands[:n_inputs], operands[n_inputs:-1], operands[-1]
    at_step = StepInputs(prompt_lens_B + tail_index, prompt_lens_B, tail_index, inputs, reduce)

    def body(block, at, carry):
      return layer(block, at, *carry, at_step), None

    x_B1D = model.embed(tokens_B[:, None])
    (x_B1D, caches), _ = scan_layers(model, body, (x_B1D, tuple(caches)))
    return model.logits(x_B1D)[:, 0], *caches

  def program(state, tokens_B, prompt_lens_B, *operands):
    weights = partition_specs(state, m) if m > 1 else P()
    return jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(weights, P(), P(), *input_specs, *cache_specs, P()),
      out_specs=(P(), *cache_specs),
      check_vma=m == 1,
    )(state, tokens_B, prompt_lens_B, *operands)

  first_cache = 3 + n_inputs
  return jax.jit(program, donate_argnums=tuple(range(first_cache, first_cache + len(cache_specs))))


@kept_cache(32)
def sharded_decode_program(graphdef, mesh, layout: CacheLayout, kept: DecodeLayout):
  """f(state, tokens_B, prompt_lens_B, kv_parts [p, L_f, 2, B*P, K, H], caches, tail_index)
  -> (logits [B, V], caches): one token per sequence from a sharded cache, row b at position
  prompt_lens_B[b] + tail_index (`sharded_step_program`). `kept` (`sharded_rings`) says what
  each layer keeps: the L_f layers of its every-position group have parts (rank r's holding
  each row's prompt positions `layout.segments[r]`, padding after a ragged row's length) and
  a tail [L_f, 2, B, M, K, H] of the decoded tokens' K,V, this one's written at
  `tail_index`; a windowed layer whose window the prompt outgrew keeps a ring of it ((k, v)
  [L_g, B, W, K, H], replicated: every rank attends it alike, no merge). `caches` (donated):
  per group of `kept`, the tail or the ring. The parts stay sharded by rank; on a
  ("ranks", "model") mesh every cache's heads are split over "model"."""
  slots_L = kept.slot_of_layer  # each layer's row in its group

  def layer(block, at, x_B1D, caches, step):
    # Each cache is carried and written where it lies (this token's row of the layer's slot,
    # by index), the parts read a layer at a time: no second copy of either.
    (caches,) = caches
    slot = jnp.asarray(slots_L, jnp.int32)[at.index]
    window = block.config.kind.window  # this layer's kind (they may differ)
    group = kept.group_of_window(window)
    q_B1NH, k_B1KH, v_B1KH = block.project_qkv(x_B1D, step.positions_B[:, None])
    if kept.rings[group] is not None:
      attn_B1NH, written = window_ring_attention(
        block, q_B1NH, k_B1KH, v_B1KH, caches[group], slot, step.positions_B, kept.rings[group]
      )
    else:
      part_2BPKH = unfold_batch(step.inputs[0][0, slot], layout.part_len)
      attn_B1NH, written = attend_parts_and_tail(
        (q_B1NH, k_B1KH, v_B1KH), part_2BPKH, caches[group], slot, layout, step.positions_B,
        step.prompt_lens_B, step.tail_index, window, block.sinks_N,
      )  # fmt: skip
    caches = (*caches[:group], written, *caches[group + 1 :])
    return block.finish(x_B1D, attn_B1NH, reduce=step.reduce), (caches,)

  split = model_parallel(mesh) > 1
  tail = split_dims("L2BTKH", K=MODEL_AXIS) if split else jax.P()
  ring = split_dims("LBWKH", K=MODEL_AXIS) if split else jax.P()
  caches_spec = tuple(tail if w is None else (ring, ring) for w in kept.rings)
  return sharded_step_program(graphdef, mesh, layer, (parts_spec(mesh),), (caches_spec,))


def attend_parts_and_tail(
  qkv, part_2BPKH, tail_L2BMKH, slot, layout: CacheLayout, positions_B, prompt_lens_B,
  tail_index, window, sinks_N=None,
):  # fmt: skip
  """One layer's attention of the new token (row b at `positions_B[b]`) from a sharded cache,
  inside the sharded step: its K,V written into the layer's `slot` of the tail at
  `tail_index`; every rank attends its own part where it lies (`part_attention`, rank r's runs
  `layout.segments[r]`), the last rank also the tail, and the partials merge across the ranks
  (one collective). Returns (attention [B, 1, N, H], the tail)."""
  q_B1NH, k_B1KH, v_B1KH = qkv
  rank, p = jax.lax.axis_index(AXIS), layout.num_ranks
  new_2B1KH = jnp.stack([k_B1KH, v_B1KH]).astype(tail_L2BMKH.dtype)
  tail_L2BMKH = jax.lax.dynamic_update_slice(
    tail_L2BMKH, new_2B1KH[None], (slot, 0, 0, tail_index, 0, 0)
  )
  tail_2BMKH = tail_L2BMKH[slot]
  out, lse = jax.lax.switch(
    rank,
    [functools.partial(part_attention, runs=layout.segments[r], window=window) for r in range(p)],
    # The same queries on every rank, typed as varying like the parts they meet.
    jax.lax.pcast(q_B1NH, (AXIS,), to="varying"),
    part_2BPKH,
    positions_B,
    prompt_lens_B,
  )
  # The decoded tokens sit at positions prompt_len + [0, M): the query at tail_index.
  # The new token's own key is in the tail: its sink (gpt-oss) is added here, once.
  tail_out, tail_lse = attend_flash(
    q_B1NH, tail_2BMKH[0], tail_2BMKH[1], tail_index, window=window, sinks_N=sinks_N
  )
  tail_lse = jnp.where(rank == p - 1, tail_lse, -jnp.inf)  # counted once, on the last rank
  out, lse = merge_partials(out, lse, tail_out, tail_lse)
  return merge_across_ranks(out, lse).astype(q_B1NH.dtype), tail_L2BMKH


def tail_sharding(mesh) -> NamedSharding:
  """Where the decoded tokens' K,V [L, 2, B, M, K, H] lie for the sharded step: on every
  device, their KV heads split over "model" on a 2-D mesh (as the parts' are)."""
  split = model_parallel(mesh) > 1
  return NamedSharding(mesh, split_dims("L2BTKH", K=MODEL_AXIS) if split else jax.P())


def last_real_logits_sharded(model, state, mesh, layout, kv_parts, last_tokens_B, lengths_B):
  """[B, V] replicated over `mesh`: each row's last real token decoded once from the sharded
  parts (the parts' copy of its K,V hidden, a one-token tail holding it), as `generate`
  decodes (in every process: the parts are every process's)."""
  replicated = NamedSharding(mesh, jax.P())
  L, K, H = kv_parts.shape[1], *kv_parts.shape[4:]
  B = last_tokens_B.shape[0]
  tail = zeros_on((L, 2, B, 1, K, H), kv_parts.dtype, tail_sharding(mesh))
  program = sharded_decode_program(model.graphdef, mesh, layout, DecodeLayout.whole(L))
  logits, _ = program(
    state,
    global_array(np.asarray(last_tokens_B, np.int32), replicated),
    global_array(np.asarray(lengths_B - 1, np.int32), replicated),
    kv_parts,
    (tail,),
    global_array(np.int32(0), replicated),
  )
  return logits


def first_draw(result, seed: int):
  """What every process's first decode step from cache="sharded" starts from, replicated over
  the prefill's mesh: the prompt's last logits (across processes the program's replicated
  copy; in one process the owner's, copied to every device) and the sampling key (every
  process builds it alike, so that each samples the same tokens)."""
  replicated = NamedSharding(result.mesh, jax.P())
  logits = result.replicated_logits
  if logits is None:
    logits = jax.device_put(result.logits, replicated)
  key_data = np.asarray(jax.random.key_data(jax.random.key(seed)))
  return logits, jax.random.wrap_key_data(global_array(key_data, replicated))
