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

from kvr_jax.core.caches import kept_cache
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, split_dims
from kvr_jax.runtime.tensor_parallel import partition_specs, psum_over_model
from models import scan_layers
from models.attention import attend_static
from models.base import no_reduce, write_rows


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

  slots_L = jnp.asarray(layout.slot_of_layer, jnp.int32)  # each layer's row in its group

  def layer(block, at, carry):
    slot = slots_L[at.index]
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

  (x_B1D, caches), _ = scan_layers(model, layer, (model.embed(tokens_B[:, None]), tuple(caches)))
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
  heads = split_dims("LBSKH", K=MODEL_AXIS)
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
  the key `fold_in(key, index)`; what `generate` and the models with a cache of their own
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


@kept_cache(8)
def decode_step_of(graphdef):
  """The model's own `decode_step` (a hybrid's or latent model's cache, in its own form),
  jitted once per graphdef (not per call).
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
    return model.decode_step(tokens_B, positions_B, cache, reduce=psum_over_model)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def step(state, tokens_B, positions_B, cache):
    # check_vma=False: the psums make the logits (and a whole cache) whole on every shard.
    return jax.shard_map(
      shard_step,
      mesh=row_mesh,
      in_specs=(
        partition_specs(state, row_mesh.shape[MODEL_AXIS]),
        P(),
        P(),
        cache_spec,
      ),
      out_specs=(P(), cache_spec),
      check_vma=False,
    )(state, tokens_B, positions_B, cache)

  return step
