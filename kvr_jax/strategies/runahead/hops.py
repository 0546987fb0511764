"""The hop chain: rank k sends the prefix it holds to rank k+1, one `ppermute` pair per hop,
with the hops' sizes static (`hop_chain`) or data (`hop_chain_as_data`); and the mesh axes a
rank's carried buffers vary over."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS
from kvr_jax.strategies.base import ordered_after
from kvr_jax.strategies.probe import mark
from kvr_jax.strategies.runahead.schedule import HOP_GRANULE, hop_pieces, hop_span
from models.layer_kinds import FULL_ATTENTION, AttentionKind


def varying_axes(reduce) -> tuple[str, ...]:
  """The mesh axes a rank's zero-initialised buffers vary over: ("ranks",), and "model" where
  the rank is a tensor-parallel group (its `reduce` psums over "model")."""
  return (AXIS, MODEL_AXIS) if reduce is tensor_parallel.psum_over_model else (AXIS,)


def hop_chain(
  buffer_2BSKH,
  own_2BcKH,
  rank,
  chunks: tuple[int, ...],
  kind: AttentionKind = FULL_ATTENTION,
  timeline: bool = False,
  layer=-1,
  last_into_buffer: bool = False,
  after=None,
):
  """p-1 hops: hop k sends keys [a, S_k) (`hop_span` of this layer's `kind`) from rank k to
  rank k+1, one pair per
  ppermute. Hop 0's message is rank 0's own chunk; a forwarding rank k sends from its buffer
  (what it received, then its own chunk); the last hop's message is returned as it arrived,
  and written into the last rank's buffer too with `last_into_buffer` (the one body attends
  every prefix from its buffer). A rank whose chunk is shorter than the window forwards part
  of what it received. Every message is computed after `after` (a pytree: the sender's
  early diagonal rows, the work its receiver's wait should not include; `ordered_after`).

  Returns (buffer, last message [2, B, S_{p-2} - a, K, H])."""
  p = len(chunks)
  message = None
  for k in range(p - 1):
    a, end = hop_span(k, chunks, kind)
    source = own_2BcKH if k == 0 else buffer_2BSKH  # rank 0's prefix is its chunk
    message = ordered_after(source[:, :, a:end], after)
    message = jax.lax.ppermute(message, AXIS, perm=[(k, k + 1)])
    if k < p - 2 or last_into_buffer:
      # ppermute gives zeros to ranks outside the pair: only rank k+1 keeps the message.
      prefix = jnp.where(rank == k + 1, message, buffer_2BSKH[:, :, a:end])
      buffer_2BSKH = jax.lax.dynamic_update_slice_in_dim(buffer_2BSKH, prefix, a, axis=2)
    buffer_2BSKH, message = mark(timeline, f"hop{k}", layer, (buffer_2BSKH, message))
  return buffer_2BSKH, message


def hop_chain_as_data(buffer_2BSKH, rank, ends_p, kind: AttentionKind, max_rows: int, after):
  """The hop chain of `hop_chain` with the hops' spans as data: hop k carries keys [a, S_k)
  (ends_p[k] = S_k traced, a its window start on a windowed `kind`) from rank k's buffer into
  rank k+1's, in the pieces of `hop_pieces` whose bits its length sets. The bits are the same
  on every rank (the table is), so every rank takes the same branch and each ppermute is
  whole. Rows a piece carries past S_k are rank k+1's own chunk in its buffer: it keeps them.
  max_rows: the longest hop (the prompt; with a window, its last W-1 keys at most)."""
  window = kind.window
  max_rows = max_rows if window is None else min(max_rows, window - 1)
  for k in range(ends_p.shape[0] - 1):
    end = ends_p[k]
    first = 0 if window is None else jnp.maximum(0, end - window + 1)
    granules = (end - first + HOP_GRANULE - 1) // HOP_GRANULE
    offset = first
    for size in hop_pieces(max_rows):

      def send(operands, size=size, k=k, end=end):
        buffer, offset = operands
        piece = jax.lax.dynamic_slice_in_dim(buffer, offset, size, axis=2)
        message = jax.lax.ppermute(ordered_after(piece, after), AXIS, perm=[(k, k + 1)])
        kept = (rank == k + 1) & (offset + jnp.arange(size) < end)
        piece = jnp.where(kept[None, None, :, None, None], message, piece)
        return jax.lax.dynamic_update_slice_in_dim(buffer, piece, offset, axis=2)

      sent = (granules * HOP_GRANULE) & size  # size rows when this piece's bit is set
      buffer_2BSKH = jax.lax.cond(
        sent > 0, send, lambda operands: operands[0], (buffer_2BSKH, offset)
      )
      offset = offset + sent
  return buffer_2BSKH
