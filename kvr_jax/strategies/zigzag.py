"""The zigzag layout the context-parallel peers share (ring attention, all-gather CP).

The prompt, padded to a multiple of 2p, is cut into 2p equal chunks of c tokens; rank r
holds chunks r and 2p-1-r, so every rank has the same causal work (an early chunk with little
past and a late one with much). Padding tokens sit at the end, after every real token: the
causal mask hides their keys from every real query, and their own outputs are dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvr_jax.runtime.cache_layout import CacheLayout, fold_batch
from kvr_jax.runtime.roofline import (
  Compute,
  ModelledLayer,
  Work,
  kv_message_bytes,
  phase_seconds,
  phase_work,
  visible_keys,
  work_kwargs,
)
from kvr_jax.strategies.base import RankBody, gather_to_owner, owner_last_row
from kvr_jax.strategies.probe import mark
from models.attention import attend_partial, merge_partials
from models.kernels import get_kernel


def chunk_len(context_len: int, num_ranks: int) -> int:
  """c: tokens per chunk, 2p chunks covering the prompt padded to a multiple of 2p."""
  return math.ceil(context_len / (2 * num_ranks))


def padded_len(context_len: int, num_ranks: int) -> int:
  return 2 * num_ranks * chunk_len(context_len, num_ranks)


def rank_chunks(rank: int, num_ranks: int) -> tuple[int, int]:
  return rank, 2 * num_ranks - 1 - rank


def layout(context_len: int, num_ranks: int, chunks=None) -> tuple[int, ...]:
  """Real (unpadded) tokens per rank."""
  del chunks  # the zigzag assignment is fixed
  c = chunk_len(context_len, num_ranks)

  def real(chunk):
    return max(0, min(c, context_len - chunk * c))

  return tuple(sum(real(a) for a in rank_chunks(r, num_ranks)) for r in range(num_ranks))


def cache_layout(context_len: int, chunks: tuple[int, ...]) -> CacheLayout:
  """Rank r's part [2c] holds chunk r in rows [0, c) and chunk 2p-1-r in rows [c, 2c); the
  padding at the end of the prompt is not part of any run."""
  p = len(chunks)
  c = chunk_len(context_len, p)
  segments = []
  for r in range(p):
    runs = []
    for half, chunk in enumerate(rank_chunks(r, p)):
      length = max(0, min(c, context_len - chunk * c))
      if length:
        runs.append((chunk * c, length, half * c))
    segments.append(tuple(runs))
  return CacheLayout(context_len, 2 * c, tuple(segments))


def rank_order(context_len: int, num_ranks: int) -> np.ndarray:
  """[2pc] prompt positions in rank order: rank 0's two chunks, then rank 1's, ..."""
  c = chunk_len(context_len, num_ranks)
  return np.concatenate(
    [np.arange(a * c, (a + 1) * c) for r in range(num_ranks) for a in rank_chunks(r, num_ranks)]
  )


def prompt_order(context_len: int, num_ranks: int) -> np.ndarray:
  """The inverse permutation: prompt position -> index in rank order."""
  return np.argsort(rank_order(context_len, num_ranks))


def arrange(tokens_BC, chunks) -> np.ndarray:
  """[B, C] -> [p, B, 2c]: each rank's two chunks, the prompt zero-padded to 2pc."""
  tokens_BC = np.asarray(tokens_BC)
  B, C = tokens_BC.shape
  p = len(chunks)
  padded = np.zeros((B, padded_len(C, p)), tokens_BC.dtype)
  padded[:, :C] = tokens_BC
  return padded[:, rank_order(C, p)].reshape(B, p, -1).transpose(1, 0, 2)


def positions(rank, c: int, num_ranks: int, batch: int):
  """[B, 2c] absolute positions of rank's two chunks (rank may be traced)."""
  first = rank * c + jax.numpy.arange(c)
  second = (2 * num_ranks - 1 - rank) * c + jax.numpy.arange(c)
  return jax.numpy.broadcast_to(jax.numpy.concatenate([first, second]), (batch, 2 * c))


def last_position_owner(context_len: int, num_ranks: int) -> tuple[int, int]:
  """(rank, row in that rank's [2c] tokens) of the prompt's last position."""
  c = chunk_len(context_len, num_ranks)
  chunk, offset = divmod(context_len - 1, c)
  if chunk < num_ranks:
    return chunk, offset
  return 2 * num_ranks - 1 - chunk, c + offset


def peer_body(chunks: tuple[int, ...], timeline: bool, attend_chunks) -> Callable:
  """Both peers' `make_body` (strategies.base.RankBody): each layer projects the rank's two
  chunks, attends them with the peer's own `attend_chunks(block, q_B2cNH, own_2B2cKH, rank,
  layer) -> attn_B2cNH` (own_2B2cKH: [2, B, 2c, K, H], K and V as one array, with their own
  K heads) and finishes them; the rank outputs its own two chunks' K,V. The prompt's last
  position is on the rank and row `last_position_owner` says."""
  context_len, p = sum(chunks), len(chunks)
  c = chunk_len(context_len, p)
  owner, row = last_position_owner(context_len, p)

  def make_body(model, rank, tokens_B2c, reduce):
    positions_B2c = positions(rank, c, p, tokens_B2c.shape[0])
    last_layer = model.config.num_layers - 1

    def layer(block, x_B2cD, carry, at):
      l = at.index
      q_B2cNH, k_B2cKH, v_B2cKH = block.project_qkv(x_B2cD, positions_B2c)
      own_2B2cKH = jnp.stack([k_B2cKH, v_B2cKH])
      q_B2cNH, own_2B2cKH = mark(timeline, "qkv", l, (q_B2cNH, own_2B2cKH))

      def every_row(x_B2cD):
        attn_B2cNH = mark(
          timeline, "attention", l, attend_chunks(block, q_B2cNH, own_2B2cKH, rank, l)
        )
        return mark(timeline, "rest", l, block.finish(x_B2cD, attn_B2cNH, reduce=reduce))

      def last_row(x_B2cD):  # the model's last layer: the prompt's last row alone is read
        # Every rank's K,V in prompt order on the owner alone (one-way sends into it: no
        # other rank reads them; an all-gather would send them to every rank).
        every_2BSKH = gather_to_owner(own_2B2cKH, owner, p, axis=2)
        every_2BSKH = mark(timeline, "gather", l, every_2BSKH)
        prompt_2BSKH = in_prompt_order(every_2BSKH, context_len, p, axis=2)
        x_B2cD = owner_last_row(
          block, x_B2cD, q_B2cNH, prompt_2BSKH, rank, (owner, row, context_len - 1), reduce
        )
        return mark(timeline, "rest", l, x_B2cD)

      x_B2cD = jax.lax.cond(l == last_layer, last_row, every_row, x_B2cD)
      return x_B2cD, carry, fold_batch(own_2B2cKH)

    return RankBody(tokens_B2c, layer, lambda x_B2cD: x_B2cD[:, row], owner)

  return make_body


def _chunk_partial(
  q_BcNH, query_chunk, kv, key_half, key_chunk, whole: bool, c, attention, window, sinks_N, attend
):
  """One c-token query chunk over one key chunk (half `key_half` of a rank's [2, B, 2c, K, H]
  K,V): (out, lse) float32. `whole`: the key chunk lies wholly in the queries' past, else it
  is their own chunk (a causal diagonal); the peers meet no other case. The flash kernel
  takes the true relative offset (traced: a sliding window masks by true positions); a
  two-piece kernel (static offsets, no window) takes the piece's kind: offset c (every key
  in the past) or 0 (the diagonal). sinks_N: the heads' sinks (gpt-oss), which the kernel adds
  to the diagonal's rows only (models/sinks.py). attend(q, entries, offset, kernel): the
  partial over other cache entries than K,V (a latent layer's), else None."""
  chunk = kv[:, :, key_half * c : (key_half + 1) * c]  # [M, B, c, K, H]: K,V or entries
  kernel = get_kernel(attention)
  static = kernel.computes == "two-piece"
  offset = (c if whole else 0) if static else (query_chunk - key_chunk) * c
  if attend is not None:
    return attend(q_BcNH, chunk, offset, kernel)
  # float32 partials: rounding each to bfloat16 before the merges cost ring a bfloat16
  # step against the other strategies.
  return attend_partial(q_BcNH, chunk[0], chunk[1], offset, kernel, window, sinks_N=sinks_N)


def zigzag_attention(
  q_B2cNH,
  kv_own,
  rank,
  c: int,
  p: int,
  window: int | None,
  attention,
  source_kv: Callable,
  timeline: bool = False,
  layer=-1,
  sinks_N=None,
  attend=None,
  probe=None,
):
  """Rank r's two query chunks (r and 2p-1-r) against every rank's K,V (or cache entries, with
  `attend`: `_chunk_partial`), one source rank per step, each piece a whole c x c block in the
  past or a causal diagonal, merged exactly by log-sum-exp (`merge_partials`):

    step 0      own K,V: chunk r causally; chunk 2p-1-r sees chunk r whole and itself causally
    src < r     both query chunks see src's first chunk whole, its second not at all
    src > r     only the second query chunk sees anything: both of src's chunks, whole

  At step s the source is src = (r - s) mod p, whose K,V [2, B, 2c, K, H] come from
  `source_kv(previous step's K,V, s)` (ring: a ppermute around the ring; all-gather: its slice
  of the gathered K,V). Returns [B, 2c, N, H] in q's dtype. Each step's merge is marked
  "step{s}" for the timeline: `mark(timeline, ..., layer)`, or probe(label, value) where
  given (a layer that marks its own phases: the latent ring)."""
  if probe is None:
    probe = functools.partial(_marked, timeline, layer)
  first_query_chunk, second_query_chunk = rank, 2 * p - 1 - rank  # chunk indices
  q_first, q_second = q_B2cNH[:, :c], q_B2cNH[:, c:]
  options = dict(c=c, attention=attention, window=window, sinks_N=sinks_N, attend=attend)
  partial = functools.partial(_chunk_partial, **options)

  out_first, lse_first = partial(q_first, first_query_chunk, kv_own, 0, first_query_chunk, False)
  out_second, lse_second = merge_partials(
    *partial(q_second, second_query_chunk, kv_own, 0, first_query_chunk, True),
    *partial(q_second, second_query_chunk, kv_own, 1, second_query_chunk, False),
  )
  out = jnp.concatenate([out_first.astype(jnp.float32), out_second], axis=1)
  lse = jnp.concatenate([lse_first, lse_second], axis=1)

  def earlier_rank(kv, src):  # src < r: both query chunks see src's first chunk only
    out_a, lse_a = partial(q_first, first_query_chunk, kv, 0, src, True)
    out_b, lse_b = partial(q_second, second_query_chunk, kv, 0, src, True)
    return jnp.concatenate([out_a, out_b], axis=1), jnp.concatenate([lse_a, lse_b], axis=1)

  def later_rank(kv, src):  # src > r: only the second query chunk sees anything, both chunks
    out_b, lse_b = merge_partials(
      *partial(q_second, second_query_chunk, kv, 0, src, True),
      *partial(q_second, second_query_chunk, kv, 1, 2 * p - 1 - src, True),
    )
    return (  # the first query chunk sees nothing: zeros, lse -inf
      jnp.concatenate([jnp.zeros_like(out_b), out_b], axis=1),
      jnp.concatenate([jnp.full_like(lse_b, -jnp.inf), lse_b], axis=1),
    )

  kv = kv_own
  for step in range(1, p):
    kv = source_kv(kv, step)
    src = (rank - step) % p
    step_out, step_lse = jax.lax.cond(src < rank, earlier_rank, later_rank, kv, src)
    out, lse = probe(f"step{step}", merge_partials(out, lse, step_out, step_lse))
  return out.astype(q_B2cNH.dtype)


def _marked(timeline: bool, layer, label: str, value):
  return mark(timeline, label, layer, value)


def in_prompt_order(kv_rank_order, context_len: int, num_ranks: int, axis: int):
  """K,V laid out in rank order along `axis` -> prompt order, padding dropped."""
  index = prompt_order(context_len, num_ranks)[:context_len]
  return jax.numpy.take(kv_rank_order, index, axis=axis)


# What both peers' Strategy records share: the zigzag layout of the prompt and of the cache
# parts, no user partition, probes at their phase boundaries.
PEER_FIELDS = dict(
  partitioned=False,
  layout=layout,
  arrange=arrange,
  cache_layout=cache_layout,
  timeline_probes=True,
  zigzag_chunks=True,
)


# --- the peers' modelled layer (kvr_jax.planning.costmodel) ------------------------------------


@dataclasses.dataclass(frozen=True)
class PeerCosts:
  """What both peers' modelled layers share: every rank has the same work, 2c tokens.

  own: the qkv and rest Work of 2c tokens; seconds: their times (the rest with its model
  all-reduces); message: bytes of one rank's 2c-token K,V per layer; message_seconds: one
  message over the slowest link; visible: keys each query of the busiest rank sees, on
  average (causally, within the window)."""

  num_ranks: int
  chunk: int
  own: dict
  seconds: dict
  message: int
  message_seconds: float
  visible: float


def peer_costs(config, context_len: int, setup, num_ranks: int) -> PeerCosts:
  p, links, window = num_ranks, setup.links, config.sliding_window
  c = chunk_len(context_len, p)
  own = phase_work(config, 2 * c, 2 * c, **work_kwargs(setup))
  message = kv_message_bytes(config, 2 * c, setup.batch, setup.dtype_bytes)
  message_seconds = message / links.slowest(p) + links.latency if p > 1 else 0.0
  visible = max(
    (visible_keys(r * c, c, window) + visible_keys((2 * p - 1 - r) * c, c, window)) / 2
    for r in range(p)
  )
  seconds = phase_seconds(config, own, 2 * c, setup)
  return PeerCosts(p, c, own, seconds, message, message_seconds, visible)


def peer_layer(
  config, context_len: int, setup, costs: PeerCosts, middle: tuple, attention: Work
) -> ModelledLayer:
  """A peer's modelled layer: qkv, its own `middle` steps (how its K,V travel and how it
  attends), the rest; the same on every rank. After the last layer, cache="last" moves every
  other rank's parts (2c tokens, L layers) onto the last rank (p-1 messages over the slowest
  link); KV-Runahead's last rank already holds them from its hops."""
  p, links = costs.num_ranks, setup.links
  steps = (Compute("qkv", costs.seconds["qkv"]), *middle, Compute("rest", costs.seconds["rest"]))
  move = (p - 1) * (config.num_layers * costs.message / links.slowest(p) + links.latency)
  total = costs.own["qkv"] + attention + costs.own["rest"]
  return ModelledLayer(
    (steps,) * p,
    layout(context_len, p),
    (total.flops,) * p,
    (total.bytes,) * p,
    (float(costs.message * (p - 1)),) * p,
    after_layers=move,
  )
