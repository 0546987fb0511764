"""Zigzag ring attention (pass-KV context parallelism, ring-flash-attention's zigzag).

Zigzag layout (kvr_jax.strategies.zigzag): rank r holds chunks r and 2p-1-r of c tokens. Per
layer every rank projects its 2c tokens, then p steps: at step s it holds the K,V of rank
src = (r - s) mod p (both of src's chunks, own KV heads) and, before attending to them,
already sends them on to rank r+1 (one `ppermute` around the ring per step, p-1 in all), so
that XLA can overlap the transfer with the attention. Each step's attention is a flash
partial (output, log-sum-exp) merged exactly into the running result:

  step 0      own K,V: chunk r causal for the first chunk; the second chunk sees chunk r
              in its past and its own chunk causally.
  src < r     both query chunks see src's first chunk (src < r) whole, its second not at all.
  src > r     only the second query chunk sees anything, and sees both of src's chunks whole.

Both cases are two c x c blocks wholly in the past: the same work on every rank and step (the
point of zigzag). Each partial is a flash call at the relative offset of its query and key
chunks, so a sliding window masks (and skips) by true positions; the ring still passes
every rank's K,V, whatever the window.

Each rank outputs only its own two chunks' K,V ([L, 2, B, 2c, K, H]); the parts are brought
onto the last rank in prompt order after the program (cache="last") or stay where they are
(cache="sharded"), see kvr_jax.inference.kv_cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies import zigzag
from kvr_jax.strategies.base import (
  Strategy,
  refuse,
  strategy_compiler,
)
from kvr_jax.strategies.probe import mark
from kvr_jax.strategies.roofline import Compute, ModelledLayer, Work, phase_work, work_kwargs
from models import layers


def chunk_partial(q_BcNH, query_chunk, kv, key_half, key_chunk, *, c, attention, window):
  """Flash partial of one c-token query chunk over one key chunk (half `key_half` of a rank's
  [2, B, 2c, K, H] K,V), at their relative offset: (out, lse)."""
  k, v = kv[0, :, key_half * c : (key_half + 1) * c], kv[1, :, key_half * c : (key_half + 1) * c]
  # float32 partials: rounding each to bfloat16 before the merges cost ring a bfloat16
  # step against the other strategies.
  return layers.attend_partial(q_BcNH, k, v, (query_chunk - key_chunk) * c, attention, window)


def ring_attention(
  q_B2cNH,
  kv_own,
  rank,
  c: int,
  p: int,
  window: int | None,
  timeline: bool = False,
  layer=-1,
  attention="flash",
):
  """Rank's two query chunks against every rank's K,V, passed around the ring.

  kv_own: [2, B, 2c, K, H], this rank's K and V. Every partial is a flash call over one
  c-token key chunk at the relative offset (query chunk start - key chunk start), so
  causality and a sliding window come from positions alone; a chunk wholly in the past is
  an offset >= c (seen whole, or up to the window). Returns [B, 2c, N, H] in q's dtype.
  """
  first_query_chunk, second_query_chunk = rank, 2 * p - 1 - rank  # chunk indices
  q_first, q_second = q_B2cNH[:, :c], q_B2cNH[:, c:]
  partial = functools.partial(chunk_partial, c=c, attention=attention, window=window)

  # Step 0, own K,V: each query chunk causally over itself; the second also over the first,
  # which lies wholly in its past.
  out_first, lse_first = partial(q_first, first_query_chunk, kv_own, 0, first_query_chunk)
  out_second, lse_second = layers.merge_partials(
    *partial(q_second, second_query_chunk, kv_own, 0, first_query_chunk),
    *partial(q_second, second_query_chunk, kv_own, 1, second_query_chunk),
  )
  out = jnp.concatenate([out_first.astype(jnp.float32), out_second], axis=1)
  lse = jnp.concatenate([lse_first, lse_second], axis=1)

  def earlier_rank(kv, src):  # src < r: both query chunks see src's first chunk only
    out_a, lse_a = partial(q_first, first_query_chunk, kv, 0, src)
    out_b, lse_b = partial(q_second, second_query_chunk, kv, 0, src)
    return jnp.concatenate([out_a, out_b], axis=1), jnp.concatenate([lse_a, lse_b], axis=1)

  def later_rank(kv, src):  # src > r: only the second query chunk sees anything, both chunks
    out_b, lse_b = layers.merge_partials(
      *partial(q_second, second_query_chunk, kv, 0, src),
      *partial(q_second, second_query_chunk, kv, 1, 2 * p - 1 - src),
    )
    nothing = jnp.zeros_like(out_b), jnp.full_like(lse_b, -jnp.inf)
    return (
      jnp.concatenate([nothing[0], out_b], axis=1),
      jnp.concatenate([nothing[1], lse_b], axis=1),
    )

  ring = [(i, (i + 1) % p) for i in range(p)]
  kv = kv_own
  for step in range(1, p):
    # The send is issued before this step's attention so that the two can overlap.
    kv = jax.lax.ppermute(kv, AXIS, perm=ring)
    src = (rank - step) % p
    step_out, step_lse = jax.lax.cond(src < rank, earlier_rank, later_rank, kv, src)
    out, lse = mark(
      timeline, f"step{step}", layer, layers.merge_partials(out, lse, step_out, step_lse)
    )
  return out.astype(q_B2cNH.dtype)


def ring_body(graphdef, chunks, attention, timeline, keep_last_hop):
  """Ring attention's rank: its two zigzag chunks, K,V passed around the ring."""
  del graphdef
  refuse("ring", keep_last_hop=keep_last_hop)
  p = len(chunks)
  c = zigzag.chunk_len(sum(chunks), p)

  def attend_chunks(block, q_B2cNH, own_2B2cKH, rank, l):
    window = block.config.sliding_window
    return ring_attention(q_B2cNH, own_2B2cKH, rank, c, p, window, timeline, l, attention)

  return zigzag.peer_body(chunks, timeline, attend_chunks)


# f(state, tokens [p, B, 2c]) -> (logits [p, B, V], kv parts [p, L, 2, B*2c, K, H]).
compile_program = strategy_compiler("ring", ring_body, "flash")


def modelled_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  """qkv on 2c tokens; p attention steps of 2c^2 visible scores each (own chunks causally at
  step 0, then a c x 2c or 2c x c unmasked block), the K,V of 2c tokens for step s+1 sent
  while step s computes, so each step takes the longer of the two (their sum when sends hold
  their sender, `Links.held_send`); the rest. With a window most blocks are skipped; the
  visible work is spread over the p steps (an approximation: the real steps are uneven),
  and every message still travels."""
  p = len(chunks)
  costs = zigzag.peer_costs(config, context_len, setup, p)
  per_step = costs.chunk if config.sliding_window is None else costs.visible / p
  c, kw = costs.chunk, work_kwargs(setup)
  step = phase_work(config, 2 * c, c, **kw, scored_keys=per_step)
  step_seconds = step["attention"].time(setup.hardware)
  message = costs.message_seconds
  if setup.links.held_send:
    overlapped = step_seconds + message
  else:
    overlapped = max(step_seconds, message)
  middle = (Compute("step", (p - 1) * overlapped + step_seconds),)
  attention = step["attention"]
  return zigzag.peer_layer(
    config, context_len, setup, costs, middle, Work(attention.flops * p, attention.bytes * p)
  )


STRATEGY = Strategy(
  name="ring",
  description="zigzag ring attention: 2p chunks, K,V passed around the ring, flash partials",
  attention_kinds=("flash",),
  compile=compile_program,
  modelled_layer=modelled_layer,
  **zigzag.PEER_FIELDS,
  attention_note="ring attention merges flash partials (output and log-sum-exp)",
)
