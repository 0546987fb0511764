"""The one body: every rank runs one program body whose real length, start and early rows
are data (read from the split's table at its rank index), with row loops whose trip count is
the rank's length and a flash kernel that visits only the blocks inside it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvr_jax.runtime.cache_layout import fold_batch
from kvr_jax.strategies.base import RankBody, ordered_after
from kvr_jax.strategies.probe import mark
from kvr_jax.strategies.runahead.hops import hop_chain, hop_chain_as_data, varying_axes
from kvr_jax.strategies.runahead.schedule import OneBodyShape, check_keep_last_hop
from models.attention import merge_partials
from models.flash import Lengths
from models.kernels import get_kernel


def map_row_blocks(fn, num_rows, block: int, inputs, outputs):
  """For the blocks [j*block, (j+1)*block) that hold rows [0, num_rows) (num_rows may be
  traced: a data-dependent trip count), writes fn(first_row, *input blocks) into `outputs` at
  the same rows; rows of later blocks keep what `outputs` held. Every array has its rows on
  axis 1, a whole number of blocks long."""

  def step(j, outputs):
    first_row = j * block
    blocks = [jax.lax.dynamic_slice_in_dim(x, first_row, block, axis=1) for x in inputs]
    results = fn(first_row, *blocks)
    return tuple(
      jax.lax.dynamic_update_slice_in_dim(out, result.astype(out.dtype), first_row, axis=1)
      for out, result in zip(outputs, results, strict=True)
    )

  return jax.lax.fori_loop(0, -(-num_rows // block), step, tuple(outputs))


def one_body(
  graphdef,
  chunks: tuple[int, ...],
  attention="flash",
  timeline: bool = False,
  keep_last_hop: bool = False,
) -> Callable:
  """Every rank runs this one body; what differs between ranks is data: its real length c,
  its start (prefix length) and its early diagonal rows, read from constant tables at its
  rank index. Shapes are the split's padded chunk (`padded_chunk_len`) and buffer, so the
  compiled program does not grow with p; only the hops' static sizes follow the split.

  Per layer, rank i:
    qkv       its c rows in blocks of R rows (`one_body_block`: a loop of ceil(c / R) steps)
    diagonal  its first r_i rows against its own keys (before the hop, as data)
    hops      the same chain as the per-rank program; rank k+1 writes hop k into its buffer
              at the prefix's positions, so every rank's buffer holds [first, start) then its
              own chunk
    attend    its rows against the buffer's keys [first, start + c) in one flash call (the
              early rows [0, r_i) see only [first, start)), merged by lse with the early rows
    finish    out-proj and MLP of its c rows in row blocks (a loop of ceil(c / R) steps)
  Padding costs at most one row block of projections and MLP and one query block of
  attention per rank. Rows past c of its part are zero; the parts have c_max rows, as the
  per-rank program's (one cache layout)."""
  del graphdef
  kernel = get_kernel(attention)

  def make_body(model, rank, tokens_Bc, reduce):
    check_keep_last_hop(keep_last_hop, chunks, model.config.kinds)
    shape = OneBodyShape.of_split(model.config, chunks, kernel)
    table = shape.table(model.config, chunks)
    one = _OneBodyRank.build(
      model, rank, tokens_Bc, reduce, shape, kernel, timeline, keep_last_hop, table, chunks
    )
    return RankBody(one.tokens_Bc, one.layer, one.last_row, len(chunks) - 1, one.empty_buffer())

  return make_body


def one_body_as_data(shape: OneBodyShape, attention="flash") -> Callable:
  """The one body with the split as data (the program's third operand, `OneBodyShape.table`)
  and hops sized as data (`hop_chain_as_data`): one program for every split that fits
  `shape`. No timeline probes, no kept last hop (its size would be data): the parts are
  moved for cache="last"."""
  kernel = get_kernel(attention)

  def make_body(model, rank, tokens_Bc, reduce, table_3p):
    one = _OneBodyRank.build(model, rank, tokens_Bc, reduce, shape, kernel, False, False, table_3p)
    return RankBody(one.tokens_Bc, one.layer, one.last_row, shape.num_ranks - 1, one.empty_buffer())

  return make_body


def _one_body_kernel(kernel, block: int, window: int | None):
  """The flash kernel of the one body: query blocks of `block` rows (whole blocks of c_pad),
  and without a window key blocks of as many (the buffer is whole blocks of it): a rank whose
  chunk starts on a block edge (rank 0, on the critical path) then has one masked block per
  query block, its diagonal, not two straddling it. Measured on rank 0 of [5555, 2637]
  (block 440, one layer, one core, kernel alone): 257 ms with the kernel's 512-key blocks,
  236 ms aligned. With a window the key blocks stay fitted to its span (`window_key_block`)."""
  key_block = block if window is None else kernel.key_block
  return dataclasses.replace(kernel, query_block=block, key_block=key_block)


@dataclasses.dataclass(frozen=True)
class _OneBodyRank:
  """One rank of the one body, built inside the trace: the program's static shape, and the
  rank's own real length c, start and early rows as traced data (read at its rank index from
  the split's table: constants, or the program's operand where the split is data)."""

  chunks: tuple[int, ...] | None  # the split, where it is static (its hops then are too)
  shape: OneBodyShape
  kernel: Any  # its query block is the shape's block
  timeline: bool
  reduce: Callable
  config: Any
  tokens_Bc: Any  # padded to c_pad
  rank: Any
  c: Any
  start: Any
  early_rows: Any
  ends: Any  # every rank's S_i, traced (the hops' ends where they are data)
  dtype: Any
  q_heads: int  # this shard's N and K
  kv_heads: int
  keep_last_hop: bool

  @classmethod
  def build(
    cls, model, rank, tokens_Bc, reduce, shape, kernel, timeline, keep_last_hop, table, chunks=None
  ) -> _OneBodyRank:
    """table: [3, p] lengths, starts, early rows (`OneBodyShape.table`); chunks: the split
    where it is static (None: the table is the program's operand)."""
    cfg = model.config
    c_p, start_p, early_p = (jnp.asarray(row, jnp.int32) for row in table)
    return cls(
      chunks=chunks,
      shape=shape,
      kernel=_one_body_kernel(kernel, shape.block, cfg.narrowest_window),
      timeline=timeline,
      reduce=reduce,
      config=cfg,
      tokens_Bc=jnp.pad(tokens_Bc, ((0, 0), (0, shape.chunk_len - tokens_Bc.shape[1]))),
      rank=rank,
      c=c_p[rank],
      start=start_p[rank],
      early_rows=early_p[rank],
      ends=start_p + c_p,
      dtype=model.blocks.wk[...].dtype,
      q_heads=model.blocks.wq[...].shape[2],  # [L, D, N, H]
      kv_heads=model.blocks.wk[...].shape[2],
      keep_last_hop=keep_last_hop,
    )

  @property
  def c_pad(self) -> int:
    return self.tokens_Bc.shape[1]

  @property
  def block(self) -> int:
    return self.shape.block

  def zeros(self, shape):  # varying over the ranks, like what it will hold
    return jax.lax.pcast(jnp.zeros(shape, self.dtype), varying_axes(self.reduce), to="varying")

  def empty_buffer(self):
    """[2, B, S, K, H]: the received prefix, then the rank's own chunk (carried over layers)."""
    B, H = self.tokens_Bc.shape[0], self.config.head_dim
    return self.zeros((2, B, self.shape.buffer_len, self.kv_heads, H))

  def project(self, block, x_BcD):
    """q [B, c_pad, N, H] and own K,V [2, B, c_pad, K, H] of the c real rows, in row blocks;
    rows past c zero (the part and the buffer hold only real keys)."""
    B, H, R = x_BcD.shape[0], self.config.head_dim, self.block

    def project_block(first_row, x_BRD):
      positions_BR = jnp.broadcast_to(self.start + first_row + jnp.arange(R), (B, R))
      return block.project_qkv(x_BRD, positions_BR)

    zeros = tuple(
      self.zeros((B, self.c_pad, heads, H))
      for heads in (self.q_heads, self.kv_heads, self.kv_heads)
    )
    q_BcNH, k_BcKH, v_BcKH = map_row_blocks(project_block, self.c, R, (x_BcD,), zeros)
    real_rows_c = jnp.arange(self.c_pad) < self.c
    return q_BcNH, jnp.where(real_rows_c[:, None, None], jnp.stack([k_BcKH, v_BcKH]), 0)

  def attend(self, block, q_BcNH, own_2BcKH, buffer_2BSKH, diagonal):
    """Its rows against the buffer's keys [first, start + c) in one flash call: the prefix
    and the rest of its diagonal, except that the early rows (block-aligned, their diagonal
    attended before the hop) see only the prefix; merged by lse with the early rows'
    `diagonal`. One call, not a prefix call and a diagonal call: one kernel walk and one
    merge less per layer, and a flash loop nest less to compile."""
    c, start, early_rows = self.c, self.start, self.early_rows
    # The buffer holds the prefix and, at `start`, the rank's own chunk (see `layer`).
    keys = self.shape.keys
    keys_2BSKH = buffer_2BSKH[:, :, :keys] if self.shape.num_ranks > 1 else own_2BcKH
    late_BcNH, late_lse_BcN = block.attend_partial(
      q_BcNH,
      keys_2BSKH[0],
      keys_2BSKH[1],
      start,
      self.kernel,
      # The early rows' own keys were attended before the hop: they see only the prefix.
      lengths=Lengths(query_rows=(0, c), key_end=start + c, short_rows=(early_rows, start)),
    )
    early = jnp.arange(self.c_pad) < early_rows
    early_lse_BcN = jnp.where(early[:, None], diagonal[1], -jnp.inf)
    attn_BcNH, _ = merge_partials(late_BcNH, late_lse_BcN, diagonal[0], early_lse_BcN)
    return attn_BcNH

  def layer(self, block, x_BcD, buffer_2BSKH, l):
    """One layer of the rank (the phases in `one_body`'s docstring)."""
    timeline, c = self.timeline, self.c
    q_BcNH, own_2BcKH = mark(timeline, "qkv", l, self.project(block, x_BcD))
    early = block.attend_partial(
      q_BcNH,
      own_2BcKH[0],
      own_2BcKH[1],
      0,
      self.kernel,
      lengths=Lengths(query_rows=(0, self.early_rows), key_end=c),
    )
    # own K,V passes through the probe too: every hop's message is built from it, so no hop
    # is recorded before the diagonal (an optimization barrier alone did not order them).
    diagonal, own_2BcKH = mark(timeline, "diagonal", l, (early, own_2BcKH))
    last_message = None
    if self.shape.num_ranks > 1:
      # Own K,V after the received prefix: what this rank forwards and attends.
      buffer_2BSKH = jax.lax.dynamic_update_slice_in_dim(
        buffer_2BSKH, own_2BcKH, self.start, axis=2
      )
      # The hops' messages are computed after the early rows (their receivers wait less).
      kind = block.config.kind  # this layer's (layers may differ)
      if self.chunks is None:  # hops sized as data: the split is the program's operand
        buffer_2BSKH = hop_chain_as_data(
          buffer_2BSKH, self.rank, self.ends, kind, self.shape.context_len, after=diagonal
        )
      else:
        buffer_2BSKH, last_message = hop_chain(
          buffer_2BSKH, own_2BcKH, self.rank, self.chunks, kind, timeline, l, True, diagonal
        )
      # The attention waits for the hops (see _PerRankBranches.layer).
      q_BcNH = ordered_after(q_BcNH, buffer_2BSKH, last_message)
    attn_BcNH = self.attend(block, q_BcNH, own_2BcKH, buffer_2BSKH, diagonal)
    attn_BcNH = mark(timeline, "attention", l, attn_BcNH.astype(x_BcD.dtype))
    (x_BcD,) = map_row_blocks(
      lambda _, x_BRD, attn_BRNH: (block.finish(x_BRD, attn_BRNH, None, reduce=self.reduce),),
      c,
      self.block,
      (x_BcD, attn_BcNH),
      (x_BcD,),
    )
    x_BcD = mark(timeline, "rest", l, x_BcD)
    # Only this rank's chunk leaves the layer (and, kept, what the last hop brought), in
    # parts of c_max rows as from the per-rank program (one cache layout for both bodies).
    own_out = fold_batch(own_2BcKH[:, :, : self.shape.part_len])
    kept = (own_out, fold_batch(last_message)) if self.keep_last_hop else own_out
    return x_BcD, buffer_2BSKH, kept

  def last_row(self, x_BcD):
    """The rank's last real row; on rank p-1 that is the prompt's last position."""
    return jax.lax.dynamic_index_in_dim(x_BcD, self.c - 1, axis=1, keepdims=False)
