"""Decode from a KV cache: one jitted step per token, and token sampling.

The step runs wherever its operands live: after KV-Runahead that is the last rank's device,
which holds the whole cache, so decoding starts there without moving the cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models import scan_blocks


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(4, 5))
def decode_step(graphdef, state, tokens_B, position, k_cache, v_cache):
  """Appends one token per sequence at `position`; returns (logits [B, V], k_cache, v_cache).

  k_cache, v_cache: [L, B, S_max, K, H] with positions [0, position) filled. Keys past
  `position` are hidden by the causal offset, so the unused tail of the cache needs no mask;
  with a sliding window W keys before position - W + 1 are masked (they may be zeros after a
  windowed KV-Runahead prefill).
  """
  model = nnx.merge(graphdef, state)
  B = tokens_B.shape[0]
  positions_B1 = jnp.full((B, 1), position, jnp.int32)

  def layer(block, x_B1D, cache_l):
    k_BSKH, v_BSKH = cache_l
    q_B1NH, k_B1KH, v_B1KH = block.project_qkv(x_B1D, positions_B1)
    # [B, S_max, K, H]: write this token's K,V at its position
    k_BSKH = jax.lax.dynamic_update_slice_in_dim(k_BSKH, k_B1KH, position, axis=1)
    v_BSKH = jax.lax.dynamic_update_slice_in_dim(v_BSKH, v_B1KH, position, axis=1)
    attn_B1NH = block.attend(q_B1NH, k_BSKH, v_BSKH, position, "dense")
    return block.finish(x_B1D, attn_B1NH), (k_BSKH, v_BSKH)

  x_B1D, (k_cache, v_cache) = scan_blocks(
    model.blocks, layer, model.embed(tokens_B[:, None]), (k_cache, v_cache)
  )
  return model.logits(x_B1D)[:, 0], k_cache, v_cache


@jax.jit
def greedy(logits_BV):
  """Temperature 0: the most likely token of each row."""
  return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


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
