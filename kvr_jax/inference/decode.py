"""Decode: one jitted step per token, and token sampling.

Two steps, one per cache layout (kvr_jax.inference.kv_cache):
* cache="last": the model's own `decode_step` over its own cache (a K,V model's
  `models.kv_cache.KVCache`, a hybrid's, a latent model's), one program for every model, on
  the last rank's device where the cache lies (`decode_step_of`). On a ("ranks", "model")
  mesh the last rank is a row of devices holding the cache split by head:
  `group_decode_step` runs the same step there as tensor-parallel shards (a psum after each
  partial sum).
* `sharded_decode.sharded_decode_program`: the cache left in the ranks' parts
  (cache="sharded"). Every rank runs the new token's projections and MLP (the weights are
  replicated, so no hidden state is sent), attends the token's queries to its own part
  only, and the partial outputs are
  merged exactly by log-sum-exp in float32 across the ranks (flash-decoding across devices,
  pass-Q: only [B, 1, N, H] outputs and [B, 1, N] statistics travel, never K,V). The decoded
  tokens' own K,V (the "tail", max_new_tokens long) are computed identically on every rank
  and attended by the last rank only, where the new tokens are appended. On a ("ranks",
  "model") mesh every rank's row runs the step as tensor-parallel shards: each shard merges
  its own heads across the ranks, and a psum over "model" follows each partial sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvr_jax.core.caches import kept_cache
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS
from kvr_jax.runtime.tensor_parallel import partition_specs, psum_over_model
from models.kv_cache import DecodeLayout, KVCache


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


def decode_step(graphdef, state, tokens_B, positions_B, k_cache, v_cache):
  """One token per row over a whole K,V cache, every layer keeping every position: (logits
  [B, V], k_cache, v_cache), the caches [L, B, S_max, K, H] donated (the model's
  `decode_step`, `decode_step_of`; with a sliding window W keys before position - W + 1 are
  masked, where a windowed KV-Runahead prefill may have left zeros). A ring per window:
  `decode_caches`, then `decode_step_of`."""
  cache = KVCache(DecodeLayout.whole(k_cache.shape[0]), ((k_cache, v_cache),))
  logits, cache = decode_step_of(graphdef)(state, tokens_B, positions_B, cache)
  ((k_cache, v_cache),) = cache.groups
  return logits, k_cache, v_cache


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def decode_caches(
  k_LBCKH, v_LBCKH, lengths_B, layout: DecodeLayout, capacity: int, kept=None, rings=()
) -> KVCache:
  """A prompt's cache as the model's decode step reads it (a `KVCache` of `layout`) with room
  for `capacity` positions: per
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
  return KVCache(layout, tuple(caches))


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


@kept_cache(8)
def decode_step_of(graphdef):
  """The model's own `decode_step` over its own cache (a K,V model's `KVCache`, a hybrid's
  `HybridCache`, a latent model's latents), jitted once per graphdef (not per call).
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
  (a PartitionSpec, or a pytree of them: a latent cache whole on every shard, a hybrid's and a
  K,V cache split by head), donated) -> (logits [B, V] replicated, the cache moved on). Each
  shard runs its heads and experts; the psums over "model" add their partial sums."""
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
