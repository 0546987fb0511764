"""Decode from a KV cache: one jitted step per token, and token sampling.

Two steps, one per cache layout (kvr_jax.inference.kv_cache):
* `decode_step`: the whole cache on one device (cache="last": the last rank's device), where
  the step runs without moving the cache. On a ("ranks", "model") mesh the last rank is a
  row of devices holding the cache with its heads split: `model_group_decode_step` runs the
  same step there as tensor-parallel shards (a psum after each partial sum).
* `sharded_decode_program`: the cache left in the ranks' parts (cache="sharded"). Every rank
  runs the new token's projections and MLP (the weights are replicated, so no hidden state
  is sent), attends the token's queries to its own part only, and the partial outputs are
  merged exactly by log-sum-exp in float32 across the ranks (flash-decoding across devices,
  pass-Q: only [B, 1, N, H] outputs and [B, 1, N] statistics travel, never K,V). The decoded
  tokens' own K,V (the "tail", max_new_tokens long) are computed identically on every rank
  and attended by the last rank only, where the new tokens are appended. On a ("ranks",
  "model") mesh every rank's row runs the step as tensor-parallel shards: each shard merges
  its own heads across the ranks, and a psum over "model" follows each partial sum.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from kvr_jax.core.caches import kept_cache
from kvr_jax.runtime.cache_layout import CacheLayout, parts_spec, unfold_batch
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, global_array, model_parallel
from kvr_jax.runtime.tensor_parallel import partition_specs, psum_over_model
from models import scan_blocks
from models.attention import attend_static, attend_with_lse, merge_partials
from models.base import no_reduce, write_rows
from models.flash import attend_flash


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
  """How the whole-cache decode keeps each layer's K,V: layers stacked in groups, a group by
  the positions it keeps. `rings[g]` None: every position (a full layer, or a window that
  never binds within the cache's capacity), written at its position; W: a windowed layer's
  last W positions only, a ring buffer written at position mod W (its queries see exactly
  those W keys, so nothing before the window is kept or read). Layer l is slot
  `slot_of_layer[l]` of group `group_of_layer[l]`."""

  rings: tuple[int | None, ...]
  group_of_layer: tuple[int, ...]
  slot_of_layer: tuple[int, ...]

  @classmethod
  def whole(cls, num_layers: int) -> DecodeLayout:
    """Every layer keeps every position, in one stack [L, B, S, K, H] (layer l at slot l)."""
    return cls((None,), (0,) * num_layers, tuple(range(num_layers)))

  @classmethod
  def of(cls, config, capacity: int) -> DecodeLayout:
    """`config`'s layers for a cache of `capacity` positions (prompt and new tokens): a
    window shorter than the capacity keeps a ring of its size."""
    ring_L = [w if w is not None and w < capacity else None for w in config.windows]
    rings = tuple(dict.fromkeys(ring_L))
    group_L = [rings.index(r) for r in ring_L]
    slot_L = [group_L[:l].count(g) for l, g in enumerate(group_L)]
    return cls(rings, tuple(group_L), tuple(slot_L))

  def group_of_window(self, window: int | None) -> int:
    """The group of a layer whose window is `window` (static inside a layer's body)."""
    return self.rings.index(window if window in self.rings else None)

  def layers_of(self, group: int) -> np.ndarray:
    """The layers of `group`, in slot order."""
    return np.flatnonzero(np.asarray(self.group_of_layer) == group)

  @property
  def every_position_group(self) -> int | None:
    """The group of the layers that keep every position (None where every layer keeps a
    ring)."""
    return self.rings.index(None) if None in self.rings else None

  @property
  def every_position_layers(self) -> np.ndarray:
    """The layers that keep every position, in slot order (none where all keep rings)."""
    group = self.every_position_group
    return np.zeros(0, int) if group is None else self.layers_of(group)

  def in_layer_order(self, per_group: list) -> jax.Array:
    """Arrays per group [L_g, ...] (same trailing shape) stacked back into layer order."""
    order = np.concatenate([self.layers_of(g) for g in range(len(self.rings))])
    return jnp.concatenate(per_group)[np.argsort(order)]


def take_slots(x, index_BW, axis: int):
  """x's entries at index_BW[b, j] along its positions `axis` (the batch axis just before
  it), zeros where the index is negative: a ring's slots gathered from where their positions
  lie. Returns x with that axis W long."""
  shape = [1] * x.ndim
  shape[axis - 1 : axis + 1] = index_BW.shape
  index = jnp.clip(index_BW, 0, x.shape[axis] - 1).reshape(shape)
  taken = jnp.take_along_axis(x, index, axis=axis)
  return jnp.where((index_BW >= 0).reshape(shape), taken, 0).astype(x.dtype)


def ring_positions(lengths_B, ring: int):
  """[B, W]: the prompt position slot j of a ring of W holds after a row of lengths_B[b]
  positions, the latest p < length with p = j (mod W); negative where the row is shorter
  than the window (an empty slot)."""
  last_B1 = jnp.asarray(lengths_B, jnp.int32)[:, None] - 1
  return last_B1 - jnp.mod(last_B1 - jnp.arange(ring), ring)


def _step(graphdef, state, tokens_B, positions_B, caches, layout, reduce=no_reduce):
  """The decode step's body over the cache `caches` (per group of `layout`, (k, v) [L_g, B,
  S_g, K, H]); `reduce` adds tensor-parallel shards' partial sums."""
  model = nnx.merge(graphdef, state)
  B = tokens_B.shape[0]
  positions_B = jnp.broadcast_to(jnp.asarray(positions_B, jnp.int32), (B,))

  def layer(block, carry, slot):
    # The cache is carried through the layers and written where it lies (one token's row per
    # sequence, by index): with it donated, no second copy exists during the step; attention
    # reads this layer's [B, S_g, K, H] slice.
    x_B1D, caches = carry
    group = layout.group_of_window(block.config.kind.window)
    ring = layout.rings[group]
    q_B1NH, k_B1KH, v_B1KH = block.project_qkv(x_B1D, positions_B[:, None])
    if ring is None:
      k_LBSKH, v_LBSKH = caches[group]
      k_LBSKH = write_rows(k_LBSKH, (slot,), positions_B, k_B1KH)
      v_LBSKH = write_rows(v_LBSKH, (slot,), positions_B, v_B1KH)
      attn_B1NH = block.attend(q_B1NH, k_LBSKH[slot], v_LBSKH[slot], positions_B, "dense")
      kept = (k_LBSKH, v_LBSKH)
    else:
      attn_B1NH, kept = ring_attention(
        block, q_B1NH, k_B1KH, v_B1KH, caches[group], slot, positions_B, ring
      )
    caches = (*caches[:group], kept, *caches[group + 1 :])
    return (block.finish(x_B1D, attn_B1NH, reduce=reduce), caches), None

  slots_L = jnp.asarray(layout.slot_of_layer, jnp.int32)
  (x_B1D, caches), _ = scan_blocks(
    model.blocks, layer, (model.embed(tokens_B[:, None]), tuple(caches)), slots_L
  )
  return model.logits(x_B1D)[:, 0], caches


def ring_attention(block, q_B1NH, k_B1KH, v_B1KH, ring_kv, slot, positions_B, ring: int):
  """A windowed layer's decode attention over its ring (`DecodeLayout`): the new token's K,V
  written at position mod W of layer `slot` of ring_kv ((k, v) [L_g, B, W, K, H]), where the
  ring lies, then its queries attend the ring. Returns (attn [B, 1, N, H], ring_kv)."""
  k_LBWKH, v_LBWKH = ring_kv
  written_B = positions_B % ring
  k_LBWKH = write_rows(k_LBWKH, (slot,), written_B, k_B1KH)
  v_LBWKH = write_rows(v_LBWKH, (slot,), written_B, v_B1KH)
  # The ring holds exactly the window's positions once it is full, in slot order (the softmax
  # does not care which): nothing to mask then; before, slots past the token's position are
  # empty, hidden as a causal offset hides them.
  attn_B1NH = attend_static(
    q_B1NH,
    k_LBWKH[slot],
    v_LBWKH[slot],
    jnp.minimum(positions_B, ring - 1),
    "dense",
    sinks_N=block.sinks_N,
  )
  return attn_B1NH, (k_LBWKH, v_LBWKH)


@kept_cache(32)
def model_group_decode_step(graphdef, group_mesh, layout: DecodeLayout):
  """`ring_decode_step` on one rank's row of devices (a ("ranks", "model") mesh of one rank):
  the weights split as the prefill split them (`Model.state_split_over(group_mesh)`), the
  caches as `layout` keeps them (`decode_caches`) with their heads split over "model", tokens
  and positions replicated; returns (logits [B, V] replicated, caches)."""
  P = jax.P
  heads = P(None, None, None, MODEL_AXIS, None)
  caches_spec = tuple((heads, heads) for _ in layout.rings)

  def shard_step(state, tokens_B, positions_B, caches):
    return _step(graphdef, state, tokens_B, positions_B, caches, layout, psum_over_model)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def step(state, tokens_B, positions_B, caches):
    # check_vma=False as in strategies.base.spmd: the psummed logits are whole on every shard.
    return jax.shard_map(
      shard_step,
      mesh=group_mesh,
      in_specs=(partition_specs(state, group_mesh.shape[MODEL_AXIS]), P(), P(), caches_spec),
      out_specs=(P(), caches_spec),
      check_vma=False,
    )(state, tokens_B, positions_B, caches)

  return step


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(4, 5))
def decode_step(graphdef, state, tokens_B, positions_B, k_cache, v_cache):
  """Appends one token per sequence, row b at `positions_B[b]` (rows of a ragged batch sit at
  their own lengths; a scalar is every row's); returns (logits [B, V], k_cache, v_cache).

  k_cache, v_cache: [L, B, S_max, K, H] with each row's positions [0, positions_B[b]) filled.
  Keys past a row's position are hidden by its causal offset, so the unused tail of the cache
  (and a shorter row's padding, which its later tokens overwrite) needs no mask; with a
  sliding window W keys before position - W + 1 are masked (they may be zeros after a
  windowed KV-Runahead prefill). `ring_decode_step` keeps a windowed layer's window only.
  """
  caches = ((k_cache, v_cache),)
  logits, ((k_cache, v_cache),) = _step(
    graphdef, state, tokens_B, positions_B, caches, DecodeLayout.whole(k_cache.shape[0])
  )
  return logits, k_cache, v_cache


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(5,))
def ring_decode_step(graphdef, layout: DecodeLayout, state, tokens_B, positions_B, caches):
  """`decode_step` over a cache kept as `layout` says (`decode_caches`): per group (k, v)
  [L_g, B, S_g, K, H], a windowed layer's a ring of its window; returns (logits [B, V],
  caches)."""
  return _step(graphdef, state, tokens_B, positions_B, caches, layout)


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def decode_caches(
  k_LBCKH, v_LBCKH, lengths_B, layout: DecodeLayout, capacity: int, kept=None, rings=()
):
  """A prompt's cache as `ring_decode_step` keeps it with room for `capacity` positions: per
  group of `layout`, (k, v) [L_g, B, capacity, K, H] for layers that keep every position, and
  for a window W [L_g, B, W, K, H] holding each row's last W positions at slot position mod W
  (zeros where the row is shorter than the window).

  The prompt's cache as cache="last" holds it (`kept`, `DecodeLayout.of` the prompt: None for
  every layer in prompt order): k_LBCKH, v_LBCKH [L_f, B, C, K, H] the layers of its
  every-position group (row b's positions [0, lengths_B[b]) filled), `rings` per group of
  `kept` the (k, v) rings of its windows (None for that group). A ring it holds is taken as
  it is (copied: the steps donate theirs); a window that binds only once the new tokens come
  is cut from the every-position layers."""
  kept = kept or DecodeLayout.whole(k_LBCKH.shape[0])
  C = k_LBCKH.shape[2]
  row_of_layer = {int(layer): i for i, layer in enumerate(kept.every_position_layers)}
  caches = []
  for group, ring in enumerate(layout.rings):
    if ring is not None and ring in kept.rings:
      caches.append(tuple(jnp.copy(x) for x in rings[kept.rings.index(ring)]))
      continue
    rows = [row_of_layer[int(layer)] for layer in layout.layers_of(group)]
    k, v = k_LBCKH[np.asarray(rows, int)], v_LBCKH[np.asarray(rows, int)]
    if ring is None:
      grow = ((0, 0), (0, 0), (0, capacity - C), (0, 0), (0, 0))
      caches.append((jnp.pad(k, grow), jnp.pad(v, grow)))
      continue
    position_BW = ring_positions(lengths_B, ring)
    caches.append(tuple(take_slots(x, position_BW, axis=2) for x in (k, v)))
  return tuple(caches)


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
  ring_spec = P(None, None, None, MODEL_AXIS, None) if split else P()
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


@kept_cache(32)
def sharded_decode_program(graphdef, mesh, layout: CacheLayout, kept: DecodeLayout):
  """f(state, tokens_B, prompt_lens_B, kv_parts [p, L_f, 2, B*P, K, H], caches, tail_index)
  -> (logits [B, V], caches): one token per sequence from a sharded cache, row b at position
  prompt_lens_B[b] + tail_index. `kept` (`sharded_rings`) says what each layer keeps: the
  L_f layers of its every-position group have parts (rank r's holding each row's prompt
  positions `layout.segments[r]`, padding after a ragged row's length) and a tail [L_f, 2, B,
  M, K, H] of the decoded tokens' K,V, this one's written at `tail_index`; a windowed layer
  whose window the prompt outgrew keeps a ring of it ((k, v) [L_g, B, W, K, H], replicated:
  every rank attends it alike, no merge). `caches` (donated): per group of `kept`, the tail
  or the ring. Tokens, lengths and logits are replicated; the parts stay sharded by rank. On
  a 1-D mesh the weights are replicated; on a ("ranks", "model") mesh they are split as the
  prefill split them (`Model.state_split_over(mesh)`) and every cache's heads over
  "model"."""
  reduce = psum_over_model if model_parallel(mesh) > 1 else no_reduce

  def step(state, tokens_B, prompt_lens_B, kv_parts_1L2BPKH, caches, tail_index):
    model = nnx.merge(graphdef, state)
    positions_B = prompt_lens_B + tail_index

    def layer(block, carry, slot):
      # Each cache is carried and written where it lies (this token's row of the layer's
      # slot, by index), the parts read a layer at a time: no second copy of either.
      x_B1D, caches = carry
      window = block.config.kind.window  # this layer's kind (they may differ)
      group = kept.group_of_window(window)
      q_B1NH, k_B1KH, v_B1KH = block.project_qkv(x_B1D, positions_B[:, None])
      if kept.rings[group] is not None:
        attn_B1NH, written = ring_attention(
          block, q_B1NH, k_B1KH, v_B1KH, caches[group], slot, positions_B, kept.rings[group]
        )
        caches = (*caches[:group], written, *caches[group + 1 :])
        return (block.finish(x_B1D, attn_B1NH, reduce=reduce), caches), None
      part_2BPKH = unfold_batch(kv_parts_1L2BPKH[0, slot], layout.part_len)
      attn_B1NH, tail_L2BMKH = attend_parts_and_tail(
        (q_B1NH, k_B1KH, v_B1KH), part_2BPKH, caches[group], slot, layout, positions_B,
        prompt_lens_B, tail_index, window, block.sinks_N,
      )  # fmt: skip
      caches = (*caches[:group], tail_L2BMKH, *caches[group + 1 :])
      return (block.finish(x_B1D, attn_B1NH, reduce=reduce), caches), None

    slots_L = jnp.asarray(kept.slot_of_layer, jnp.int32)
    x_B1D = model.embed(tokens_B[:, None])
    (x_B1D, caches), _ = scan_blocks(model.blocks, layer, (x_B1D, tuple(caches)), slots_L)
    return model.logits(x_B1D)[:, 0], caches

  return _sharded_step_over(step, mesh, kept)


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


def _sharded_step_over(step, mesh, kept: DecodeLayout):
  """The jitted SPMD program of the sharded step on `mesh`: the parts by rank, everything
  else replicated on a 1-D mesh; on a 2-D mesh the weights split (their partition specs from
  the state at trace time) and the tail's and the rings' heads over "model"."""
  P = jax.P
  split = model_parallel(mesh) > 1
  tail = P(None, None, None, None, MODEL_AXIS, None) if split else P()
  ring = P(None, None, None, MODEL_AXIS, None) if split else P()
  caches_spec = tuple(tail if w is None else (ring, ring) for w in kept.rings)

  def body(state, tokens_B, prompt_lens_B, kv_parts, caches, tail_index):
    weights = partition_specs(state, model_parallel(mesh)) if split else P()
    return jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(weights, P(), P(), parts_spec(mesh), caches_spec, P()),
      out_specs=(P(), caches_spec),
      # As in strategies.base.spmd on a 2-D mesh: the psummed logits are whole on every shard.
      check_vma=not split,
    )(state, tokens_B, prompt_lens_B, kv_parts, caches, tail_index)

  return jax.jit(body, donate_argnums=(4,))


def zeros_on(shape, dtype, sharding) -> jax.Array:
  """Zeros made on the devices of `sharding` (every process makes its own pieces; nothing is
  sent from the host)."""
  return _zeros_program(tuple(shape), jnp.dtype(dtype), sharding)()


@kept_cache(32)
def _zeros_program(shape, dtype, sharding):
  return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


@kept_cache(32)
def from_last_rank(mesh, ranked: bool):
  """f(x) -> x as the last rank holds it, replicated on every device of `mesh` (every
  process's too): x is [p, ...] sharded by rank when `ranked` (a prefill program's output),
  else replicated already (a sampled token, which must be the same on every process for all
  of them to run the same next step: one small psum makes it so, whatever each computed)."""
  P = jax.P

  def pick(x):
    value = x[0] if ranked else x
    last = jax.lax.axis_index(AXIS) == mesh.shape[AXIS] - 1
    return jax.lax.psum(jnp.where(last, value, jnp.zeros_like(value)), AXIS)

  spec = P(AXIS) if ranked else P()
  # check_vma=False: a replicated input typed invariant becomes varying through axis_index.
  return jax.jit(jax.shard_map(pick, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False))


@jax.jit
def greedy(logits_BV):
  """Temperature 0: the most likely token of each row."""
  return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


def next_token(logits_BV, key, index: int, temperature, top_k, top_p):
  """Step `index`'s tokens [B]: the most likely at temperature 0, else drawn (`sample`) with
  the key `fold_in(key, index)`; what `generate` and the models with their own programs
  choose, so that the same logits and seed give the same tokens."""
  if temperature == 0:
    return greedy(logits_BV)
  top_p = None if top_p is None else float(top_p)
  step_key = jax.random.fold_in(key, index)
  return sample(logits_BV, step_key, float(temperature), top_k=top_k, top_p=top_p)


@functools.partial(jax.jit, static_argnames=("top_k", "top_p"))
def sample(logits_BV, key, temperature, *, top_k: int | None, top_p: float | None):
  """Temperature (> 0) scaling, then top-k, then top-p (nucleus) when given, then a draw.

  top_k and top_p are static: the vocabulary is sorted only when a nucleus is asked for.
  """
  # The row's largest logit is subtracted first: as the temperature goes to 0 the others go
  # to -inf and the draw becomes greedy, instead of overflowing to inf - inf = NaN.
  scaled = (logits_BV - jnp.max(logits_BV, axis=-1, keepdims=True)) / temperature
  if top_k is not None:
    kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
  if top_p is not None:
    # Keep the smallest prefix of the sorted distribution whose mass reaches top_p.
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(sorted_desc, axis=-1), axis=-1)
    cutoff_index = jnp.minimum(jnp.sum(cum < top_p, axis=-1, keepdims=True), cum.shape[-1] - 1)
    cutoff = jnp.take_along_axis(sorted_desc, cutoff_index, axis=-1)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
  return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


# --- the logits of padded rows' last real tokens (kvr_jax.inference.prefill)


def last_real_logits(model, layout: DecodeLayout, caches, last_tokens_B, lengths_B):
  """One decode step of each row's last real token at its own position, where the whole
  cache lies (per group of `layout`, as cache="last" keeps it): (its logits, the caches). Its
  K,V, already in the cache (a ring's slot holds it too), are written again identically."""
  cache_device = next(iter(caches[0][0].devices()))
  return ring_decode_step(
    model.graphdef,
    layout,
    model.state_on(cache_device),
    jax.device_put(last_tokens_B, cache_device),
    jax.device_put(lengths_B - 1, cache_device),
    caches,
  )


def last_real_logits_sharded(model, state, mesh, layout, kv_parts, last_tokens_B, lengths_B):
  """[B, V] replicated over `mesh`: each row's last real token decoded once from the sharded
  parts (the parts' copy of its K,V hidden, a one-token tail holding it), as `generate`
  decodes (in every process: the parts are every process's)."""
  replicated = NamedSharding(mesh, jax.P())
  L, K, H = kv_parts.shape[1], *kv_parts.shape[4:]
  B = last_tokens_B.shape[0]
  tail = zeros_on((L, 2, B, 1, K, H), kv_parts.dtype, replicated)
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
