"""The per-rank program: every phase a `lax.switch` on the rank whose branch i has rank i's
static shapes (c_i rows, S_i keys). For the kernels whose bounds must be static (dense,
blocked, fused, cudnn), and the reference the one body is measured against."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvr_jax.core.chunks import chunk_starts
from kvr_jax.runtime.cache_layout import fold_batch
from kvr_jax.strategies.base import RankBody, ordered_after
from kvr_jax.strategies.probe import mark
from kvr_jax.strategies.runahead.hops import hop_chain, varying_axes
from kvr_jax.strategies.runahead.schedule import (
  attends_diagonal_first,
  buffer_len,
  check_keep_last_hop,
  rows_before_hop,
)
from models.attention import merge_partials
from models.base import no_reduce


def project_own_chunk(block, x_BcD, i: int, chunks: tuple[int, ...]):
  """Rank i, static shapes: q [B, c_max, N, H] of its c_i tokens and its own K,V
  [2, B, c_max, K, H] (this rank's part of the cache), rows past c_i zero."""
  c, start = chunks[i], chunk_starts(chunks)[i]
  B, c_max, _ = x_BcD.shape
  positions_Bc = jnp.broadcast_to(start + jnp.arange(c), (B, c))
  q_BcNH, k_BcKH, v_BcKH = block.project_qkv(x_BcD[:, :c], positions_Bc)
  own_2BcKH = jnp.stack([k_BcKH, v_BcKH])  # K and V travel as one message
  q_pad = jnp.pad(q_BcNH, ((0, 0), (0, c_max - c), (0, 0), (0, 0)))
  own_pad = jnp.pad(own_2BcKH, ((0, 0), (0, 0), (0, c_max - c), (0, 0), (0, 0)))
  return q_pad, own_pad


def attend_diagonal(
  block, q_BcNH, own_2BcKH, i: int, chunks: tuple[int, ...], attention, rows: int, pad_to: int
):
  """Rank i > 0 before its hop: its first `rows` queries against its own keys (causal, offset
  0; they see only keys [0, rows)), a float32 partial (out [B, pad_to, N, H], lse [B, pad_to,
  N]) padded to `pad_to` rows, the most any rank attends early (every switch branch returns
  one shape; c_max rows cost the long rank 0, which attends nothing early, a zero buffer of
  its whole chunk per layer). Rank 0, or rows = 0, returns zeros: it attends after the hop."""
  if i == 0 or rows == 0:  # built from q so that they carry its type (varying over the ranks)
    zeros_BrNH = jnp.zeros_like(q_BcNH[:, :pad_to], jnp.float32)
    return zeros_BrNH, zeros_BrNH[..., 0]
  out_BrNH, lse_BrN = block.attend_partial(
    q_BcNH[:, :rows], own_2BcKH[0, :, :rows], own_2BcKH[1, :, :rows], 0, attention
  )
  pad = pad_to - rows
  return (
    jnp.pad(out_BrNH, ((0, 0), (0, pad), (0, 0), (0, 0))),
    jnp.pad(lse_BrN, ((0, 0), (0, pad), (0, 0))),
  )


def finish_diagonal(block, q_BcNH, own_2BcKH, diagonal, rows: int, attention):
  """The diagonal's rows [rows, c) after the hop (queries at offset `rows` against the chunk's
  c keys), appended to the `rows` attended before it: (out [B, c, N, H], lse [B, c, N])."""
  c = q_BcNH.shape[1]
  early_out, early_lse = diagonal[0][:, :rows], diagonal[1][:, :rows]
  if rows == c:
    return early_out, early_lse
  late_out, late_lse = block.attend_partial(
    q_BcNH[:, rows:], own_2BcKH[0], own_2BcKH[1], rows, attention
  )
  return (
    jnp.concatenate([early_out, late_out], axis=1),
    jnp.concatenate([early_lse, late_lse], axis=1),
  )


def attend_rank(
  block, q_BcNH, own_2BcKH, prefix_2BsKH, i, chunks, attention, diagonal=None, rows=0
):
  """Rank i's attention: its c_i queries against the prefix [first, start) (the keys it
  received: from its window start, or from 0) and its own chunk.

  diagonal: the partial of the first `rows` rows of its own chunk computed before the hop
  (attend_diagonal); the rest of the diagonal and the prefix are attended here and the
  partials merge by log-sum-exp. Without it (dense, blocked: the paper's c_i x S_i rectangle)
  prefix and own keys are attended in one call."""
  c, start = chunks[i], chunk_starts(chunks)[i]
  first = block.config.kind.first_key(start)  # the first key its queries see (this layer's kind)
  q_BcNH, own_2BcKH = q_BcNH[:, :c], own_2BcKH[:, :, :c]
  if first == start:  # rank 0, or a window of one key: no prefix
    return block.attend(q_BcNH, own_2BcKH[0], own_2BcKH[1], 0, attention)
  if diagonal is not None:
    out_BcNH, lse_BcN = block.attend_partial(
      q_BcNH, prefix_2BsKH[0], prefix_2BsKH[1], start - first, attention
    )
    own_out_BcNH, own_lse_BcN = finish_diagonal(block, q_BcNH, own_2BcKH, diagonal, rows, attention)
    merged_BcNH, _ = merge_partials(out_BcNH, lse_BcN, own_out_BcNH, own_lse_BcN)
    return merged_BcNH.astype(q_BcNH.dtype)
  keys_2BsKH = jnp.concatenate([prefix_2BsKH, own_2BcKH], axis=2)
  return block.attend(q_BcNH, keys_2BsKH[0], keys_2BsKH[1], start - first, attention)


def attend_and_finish(
  block,
  x_BcD,
  q_BcNH,
  own_2BcKH,
  prefixes,
  diagonal,
  i: int,
  chunks: tuple[int, ...],
  attention="dense",
  timeline: bool = False,
  layer=-1,
  rows: int = 0,
  reduce=no_reduce,
):
  """Rank i after the hops: attention (attend_rank) over the prefix it received and the rest
  of its diagonal (rows past `rows`), then the block's rest (out-proj, MLP) of its c_i rows,
  padded back to c_max; `reduce` adds the tensor-parallel shards' partial sums.

  prefixes: (accumulation buffer, last hop's message); a forwarding rank's prefix sits in
  its buffer at [first, start), the last rank's is the last hop's message itself."""
  c, start = chunks[i], chunk_starts(chunks)[i]
  first = block.config.kind.first_key(start)  # the first key its queries see (this layer's kind)
  buffer_2BSKH, last_message = prefixes
  p, c_max = len(chunks), x_BcD.shape[1]
  if i == 0:
    prefix_2BsKH = None
  elif i == p - 1:
    prefix_2BsKH = last_message
  else:
    prefix_2BsKH = buffer_2BSKH[:, :, first:start]
  attn_BcNH = attend_rank(
    block, q_BcNH, own_2BcKH, prefix_2BsKH, i, chunks, attention, diagonal, rows
  )
  attn_BcNH = mark(timeline, "attention", layer, attn_BcNH)
  out_BcD = block.finish(x_BcD[:, :c], attn_BcNH, reduce=reduce)
  return jnp.pad(out_BcD, ((0, 0), (0, c_max - c), (0, 0)))


def rank_layer(block, x_BcD, kv_prefix, i: int, chunks: tuple[int, ...], attention="dense"):
  """Rank i's whole layer given the K,V it receives ([2, B, >= start_i, K, H], prompt order):
  the unit of per-rank cost. Used only to measure one rank's compiled cost in isolation (cost
  analysis); the SPMD program runs the same functions with the hop chain between them."""
  start = chunk_starts(chunks)[i]
  first = block.config.kind.first_key(start)  # the first key its queries see (this layer's kind)
  q_BcNH, own_2BcKH = project_own_chunk(block, x_BcD, i, chunks)
  prefix = None if i == 0 else kv_prefix[:, :, first:start]
  attn_BcNH = attend_rank(block, q_BcNH, own_2BcKH, prefix, i, chunks, attention)
  return block.finish(x_BcD[:, : chunks[i]], attn_BcNH)


def per_rank_body(
  graphdef,
  chunks: tuple[int, ...],
  attention="dense",
  timeline: bool = False,
  keep_last_hop: bool = False,
) -> Callable:
  """The program of one `lax.switch` branch per rank, each with rank i's own static shapes
  (c_i rows, S_i keys), for the kernels whose bounds must be static (dense, blocked, fused,
  cudnn) and as the reference the one-body program is measured against (`body="per-rank"`).
  Compiles every branch: the program grows with p, and every split is a new program.

  The per-rank body that shard_map runs: (state, tokens [1, B, c_max]) -> outputs.
  timeline: probes at every phase boundary (kvr_jax.strategies.probe). keep_last_hop: also
  output every layer's last-hop message (see the module docstring). model_axis: each rank
  is a tensor-parallel group over the mesh's "model" axis (its state a shard: K,V and the
  hops are the shard's own heads, the partial sums are psummed)."""
  del graphdef

  def make_body(model, rank, tokens_Bc, reduce):
    cfg = model.config
    check_keep_last_hop(keep_last_hop, chunks, cfg.kinds)
    diagonal_first = attends_diagonal_first(attention, len(chunks))
    rows = rows_before_hop(cfg, chunks) if diagonal_first else (0,) * len(chunks)
    ranks = _PerRankBranches(chunks, attention, timeline, keep_last_hop, reduce, cfg, rank, rows)
    # Allocated once and carried across layers; varying over the ranks like what it holds.
    kv_heads = model.blocks.wk[...].shape[2]  # [L, D, K, H]: this shard's K
    buffer_2BSKH = jax.lax.pcast(
      jnp.zeros(
        (2, tokens_Bc.shape[0], buffer_len(chunks), kv_heads, cfg.head_dim),
        model.blocks.wk[...].dtype,
      ),
      varying_axes(reduce),
      to="varying",
    )
    return RankBody(tokens_Bc, ranks.layer, ranks.last_row, len(chunks) - 1, buffer_2BSKH)

  return make_body


@dataclasses.dataclass(frozen=True)
class _PerRankBranches:
  """The per-rank program's rank: every phase a `lax.switch` on the (traced) rank whose
  branch i has rank i's static shapes."""

  chunks: tuple[int, ...]
  attention: Any
  timeline: bool
  keep_last_hop: bool
  reduce: Callable
  config: Any
  rank: Any
  early_rows: tuple[int, ...]  # r_i (0 where the kernel does not attend the diagonal first)

  def switch(self, branch, *operands, **kwargs):
    """`branch(..., i=i, **kwargs)` for this rank's i."""
    p = len(self.chunks)
    return jax.lax.switch(
      self.rank, [functools.partial(branch, i=i, **kwargs) for i in range(p)], *operands
    )

  def early_diagonal(self, block, q_BcNH, own_2BcKH, l):
    """Rank i's first r_i diagonal rows before its hop."""
    diagonal = jax.lax.switch(
      self.rank,
      [
        functools.partial(
          attend_diagonal,
          block,
          i=i,
          chunks=self.chunks,
          attention=self.attention,
          rows=self.early_rows[i],
          pad_to=max(1, *self.early_rows),  # never empty: probes and ordered_after read it
        )
        for i in range(len(self.chunks))
      ],
      q_BcNH,
      own_2BcKH,
    )
    # The hops' messages are computed after the diagonal (hop_chain's `after`), and after
    # its probe, so that the probes record in program order.
    return mark(self.timeline, "diagonal", l, diagonal)

  def layer(self, block, x_BcD, buffer_2BSKH, l):
    chunks, timeline, rank, p = self.chunks, self.timeline, self.rank, len(self.chunks)
    q_BcNH, own_2BcKH = self.switch(
      functools.partial(project_own_chunk, block), x_BcD, chunks=chunks
    )
    if p > 2:  # own K,V after the received prefix: what this rank forwards
      starts = jnp.asarray(chunk_starts(chunks), jnp.int32)
      buffer_2BSKH = jax.lax.dynamic_update_slice_in_dim(
        buffer_2BSKH, own_2BcKH, starts[rank], axis=2
      )
    q_BcNH, own_2BcKH = mark(timeline, "qkv", l, (q_BcNH, own_2BcKH))
    diagonal = None
    if attends_diagonal_first(self.attention, p):
      diagonal = self.early_diagonal(block, q_BcNH, own_2BcKH, l)
    kind = block.config.kind  # this layer's (layers may differ)
    prefixes = hop_chain(buffer_2BSKH, own_2BcKH, rank, chunks, kind, timeline, l, after=diagonal)
    # The attention (and so the rest of the layer) waits for the hops, on every rank: rank
    # 0's reads only its own keys, and XLA may otherwise run it before the send, holding its
    # receiver back by a whole attention. Only q carries the dependence (one fused select).
    q_BcNH = ordered_after(q_BcNH, prefixes)
    x_BcD = jax.lax.switch(
      rank,
      [
        functools.partial(
          attend_and_finish,
          block,
          i=i,
          chunks=chunks,
          attention=self.attention,
          timeline=timeline,
          layer=l,
          rows=self.early_rows[i],
          reduce=self.reduce,
        )
        for i in range(p)
      ],
      x_BcD,
      q_BcNH,
      own_2BcKH,
      prefixes,
      diagonal,
    )
    x_BcD = mark(timeline, "rest", l, x_BcD)
    # Only this rank's chunk leaves the layer (and, kept, what the last hop brought).
    own_out = fold_batch(own_2BcKH)  # R = B * c_max rows
    kept = (own_out, fold_batch(prefixes[1])) if self.keep_last_hop else own_out  # B * S_{p-2}
    return x_BcD, prefixes[0], kept

  def last_row(self, x_BcD):
    """The rank's last real row; on rank p-1 that is the prompt's last position."""
    chunks = self.chunks
    return jax.lax.switch(
      self.rank, [lambda x, i=i: x[:, chunks[i] - 1] for i in range(len(chunks))], x_BcD
    )
