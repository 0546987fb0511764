"""KV-Runahead's rank layer, written once: rank i's phases (project its chunk, attend the
first rows of its diagonal, pass the hops, attend, finish) as functions of its lengths
(`RankLengths`: its real rows c, its start, its early rows).

The two program bodies (kvr_jax.strategies.runahead.bodies) are this layer with the lengths
given two ways:
  per-rank  every phase is a `lax.switch` on the rank whose branch i runs the phase at rank i's
            lengths as Python ints: static shapes, exactly c_i rows and S_i keys, for the
            kernels whose bounds must be static (dense, blocked, fused, cudnn). Each branch is
            compiled, so the program grows with p.
  one body  every phase runs once at lengths that are traced scalars (read from the split's
            table at the rank index): row loops whose trip count is c, and one flash call whose
            lengths are data (`models.flash.Lengths`). The program does not grow with p.
A phase whose maths differs between static and traced lengths says so in one `if` (how rows
are visited, and how the kernel is told the bounds); everything else (the order of phases,
the buffer, the hops, the probes, the outputs) is the same code for both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvr_jax.core.chunks import chunk_starts
from kvr_jax.runtime.cache_layout import fold_batch
from kvr_jax.strategies.base import ordered_after
from kvr_jax.strategies.probe import mark
from kvr_jax.strategies.runahead.hops import hop_chain, hop_chain_as_data, varying_axes
from kvr_jax.strategies.runahead.schedule import buffer_len, rows_before_hop
from models.attention import merge_partials
from models.base import finish_one_row
from models.flash import Lengths


@dataclasses.dataclass(frozen=True)
class RankLengths:
  """Rank i's lengths: Python ints (`index` set: one per-rank switch branch) or traced int32
  scalars (`index` None: the one body). c: its real rows; start: the prompt position of its
  first row (its prefix's length); early_rows: the rows of its own diagonal it attends before
  its hop."""

  index: int | None
  c: Any
  start: Any
  early_rows: Any

  @property
  def static(self) -> bool:
    return self.index is not None


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


def pad_rows(x, rows: int, axis: int = 1):
  """x padded with zero rows on `axis` to `rows`."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, rows - x.shape[axis])
  return jnp.pad(x, widths)


@dataclasses.dataclass(frozen=True)
class RankLayer:
  """One rank's layer, built inside the trace (`bodies` builds it). With `lengths` None every
  phase is a switch over the split's static lengths (`chunks` then must be given); with
  traced `lengths` every phase runs once at them.

  chunks: the split where it is static (the hops' sizes then are too), else None (the split
    is the program's operand and the hops are sized as data: `ends`, `context_len`).
  rows: every rank's padded row count (c_max, or the one body's whole blocks); part_len: the
    rows of the K,V part it outputs; buffer_len: its K,V buffer's rows (0: none); keys: the
    buffer rows a traced attention reads; block: the row loops' block (traced lengths).
  early_pad: the most early rows any rank attends (every switch branch returns that shape).
  last_into_buffer: the last hop is written into the buffer (the traced attention reads every
    prefix from there); otherwise the last rank attends the message where it arrived."""

  chunks: tuple[int, ...] | None
  num_ranks: int
  kernel: Any
  timeline: bool
  reduce: Callable
  config: Any
  rank: Any
  lengths: RankLengths | None
  static_early_rows: tuple[int, ...]
  diagonal_first: bool
  rows: int
  part_len: int
  buffer_len: int
  keys: int
  block: int
  last_into_buffer: bool
  keep_last_hop: bool
  ends: Any  # every rank's S_i (traced), where the hops are sized as data
  context_len: int
  dtype: Any
  q_heads: int  # this shard's N (the traced project's queries)
  # What a position's cache entry is (`Block.project_entries`): [entries, heads, width];
  # K and V [2, K, H] on softmax layers, one headless latent [1, 1, C] on latent ones.
  entry_shape: tuple[int, int, int]

  @classmethod
  def at_static_lengths(
    cls, chunks, kernel, config, rank, reduce, *, diagonal_first, timeline, keep_last_hop, **heads
  ) -> RankLayer:
    """The per-rank program's layer: every phase a switch over the split's static lengths,
    the last hop attended where it arrives. heads: dtype, q_heads, entry_shape."""
    p = len(chunks)
    return cls(
      chunks=chunks,
      num_ranks=p,
      kernel=kernel,
      timeline=timeline,
      reduce=reduce,
      config=config,
      rank=rank,
      lengths=None,
      static_early_rows=rows_before_hop(config, chunks) if diagonal_first else (0,) * p,
      diagonal_first=diagonal_first,
      rows=max(chunks),
      part_len=max(chunks),
      buffer_len=buffer_len(chunks),
      keys=0,
      block=0,
      last_into_buffer=False,
      keep_last_hop=keep_last_hop,
      ends=None,
      context_len=sum(chunks),
      **heads,
    )

  # The rank's lengths, and running a phase at them.

  def static_lengths(self, i: int) -> RankLengths:
    start = chunk_starts(self.chunks)[i]
    return RankLengths(i, self.chunks[i], start, self.static_early_rows[i])

  def each_rank(self, phase, *operands):
    """phase(lengths, *operands) at this rank's lengths: once at the traced ones, or a switch
    whose branch i runs it at rank i's static ones."""
    if self.lengths is not None:
      return phase(self.lengths, *operands)
    branches = [functools.partial(phase, self.static_lengths(i)) for i in range(self.num_ranks)]
    return jax.lax.switch(self.rank, branches, *operands)

  def zeros(self, shape):  # varying over the ranks, like what it will hold
    return jax.lax.pcast(jnp.zeros(shape, self.dtype), varying_axes(self.reduce), to="varying")

  def empty_buffer(self, batch: int):
    """[M, B, buffer_len, K, H] (`entry_shape`): the received prefix, then the rank's own
    chunk at its start; carried over layers, never zero-filled again (each layer overwrites
    what it reads)."""
    M, heads, width = self.entry_shape
    return self.zeros((M, batch, self.buffer_len, heads, width))

  # The phases.

  def project(self, lengths: RankLengths, block, x_BcD):
    """The queries [B, rows, ...] of its c real rows and its own cache entries [M, B, rows,
    K, H] (K and V stacked: they travel as one message; or a latent layer's latents): what
    `Block.project_entries` gives. Rows past c zero (the part and the buffer hold only real
    keys). Traced lengths: in row blocks of `block` rows, a loop of ceil(c / block) steps."""
    B, c = x_BcD.shape[0], lengths.c
    if lengths.static:
      positions_Bc = jnp.broadcast_to(lengths.start + jnp.arange(c), (B, c))
      queries, own_MBcKH = block.project_entries(x_BcD[:, :c], positions_Bc)
      queries = jax.tree.map(lambda q: pad_rows(q, self.rows), queries)
      return queries, pad_rows(own_MBcKH, self.rows, 2)
    R = self.block

    def project_block(first_row, x_BRD):
      """A block's queries (each leaf [B, R, ...]) and entries moved to [B, R, M, K, H]."""
      positions_BR = jnp.broadcast_to(lengths.start + first_row + jnp.arange(R), (B, R))
      queries, entries_MBRKH = block.project_entries(x_BRD, positions_BR)
      return (*jax.tree.leaves(queries), jnp.moveaxis(entries_MBRKH, 0, 2))

    queries, entries_MBRKH = jax.eval_shape(
      lambda x: block.project_entries(x, jnp.zeros((B, R), jnp.int32)), x_BcD[:, :R]
    )
    structure = jax.tree.structure(queries)
    M, _, _, K, H = entries_MBRKH.shape
    zeros = tuple(self.zeros((B, self.rows, *q.shape[2:])) for q in jax.tree.leaves(queries))
    zeros = (*zeros, self.zeros((B, self.rows, M, K, H)))
    *query_leaves, own_BcMKH = map_row_blocks(project_block, c, R, (x_BcD,), zeros)
    real_rows_c = jnp.arange(self.rows) < c
    own_BcMKH = jnp.where(real_rows_c[:, None, None, None], own_BcMKH, 0)
    return jax.tree.unflatten(structure, query_leaves), jnp.moveaxis(own_BcMKH, 2, 0)

  def early_diagonal(self, lengths: RankLengths, block, q_BcNH, own_2BcKH):
    """Its first early_rows queries against its own keys (causal, offset 0), before the hop:
    a float32 partial (out, lse). Static: those rows only, padded to `early_pad` rows (rank 0,
    or none early: zeros built from q, so that they carry its type); traced: every row, the
    kernel visiting only the early ones."""
    rows = lengths.early_rows
    if not lengths.static:
      return block.attend_entries_partial(
        q_BcNH, own_2BcKH, 0, self.kernel, lengths=Lengths(query_rows=(0, rows), key_end=lengths.c)
      )
    pad_to = max(1, *self.static_early_rows)  # never empty: probes and ordered_after read it
    first_rows = lambda n: jax.tree.map(lambda q: q[:, :n], q_BcNH)  # noqa: E731
    if lengths.index == 0 or rows == 0:
      return _zero_partial(block, first_rows(pad_to), own_2BcKH, self.kernel)
    out_BrNH, lse_BrN = block.attend_entries_partial(
      first_rows(rows), own_2BcKH[:, :, :rows], 0, self.kernel
    )
    return pad_rows(out_BrNH, pad_to), pad_rows(lse_BrN, pad_to)

  def attend(self, lengths: RankLengths, block, q_BcNH, own_2BcKH, buffer_2BSKH, message, diag):
    """Its rows against the prefix it received and its own chunk, the early rows' diagonal
    (`diag`, or None) merged in by lse: [B, rows, N, H] in the layer's dtype."""
    if lengths.static:
      prefix_2BsKH = self._static_prefix(block, lengths, buffer_2BSKH, message)
      attn_BcNH = attend_static(block, q_BcNH, own_2BcKH, prefix_2BsKH, lengths, self.kernel, diag)
      return pad_rows(attn_BcNH, self.rows)
    c, start, early_rows = lengths.c, lengths.start, lengths.early_rows
    # The buffer holds the prefix and, at `start`, the rank's own chunk: one flash call, not a
    # prefix call and a diagonal call (one kernel walk and one merge less per layer). The early
    # rows' own keys were attended before the hop: they see only the prefix.
    keys_2BSKH = buffer_2BSKH[:, :, : self.keys] if self.num_ranks > 1 else own_2BcKH
    late_BcNH, late_lse_BcN = block.attend_entries_partial(
      q_BcNH,
      keys_2BSKH,
      start,
      self.kernel,
      lengths=Lengths(query_rows=(0, c), key_end=start + c, short_rows=(early_rows, start)),
    )
    early = jnp.arange(self.rows) < early_rows
    early_lse_BcN = jnp.where(early[:, None], diag[1], -jnp.inf)
    attn_BcNH, _ = merge_partials(late_BcNH, late_lse_BcN, diag[0], early_lse_BcN)
    return attn_BcNH.astype(self.dtype)

  def _static_prefix(self, block, lengths: RankLengths, buffer_2BSKH, message):
    """Rank i's received keys [first, start): none on rank 0; the last hop's message on the
    last rank where it was not written into the buffer; else the buffer's."""
    i, start = lengths.index, lengths.start
    first = block.config.kind.first_key(start)  # the first key its queries see (this layer's)
    if i == 0:
      return None
    if i == self.num_ranks - 1 and not self.last_into_buffer:
      return message
    return buffer_2BSKH[:, :, first:start]

  def finish(self, lengths: RankLengths, block, x_BcD, attn_BcNH):
    """The block's rest (out-proj, MLP) of its c rows; `reduce` adds the tensor-parallel
    shards' partial sums. Rows past c keep what they held (static: zero)."""
    c = lengths.c
    if lengths.static:
      out_BcD = block.finish(x_BcD[:, :c], attn_BcNH[:, :c], reduce=self.reduce)
      return pad_rows(out_BcD, self.rows)
    (x_BcD,) = map_row_blocks(
      lambda _, x_BRD, attn_BRNH: (block.finish(x_BRD, attn_BRNH, None, reduce=self.reduce),),
      c,
      self.block,
      (x_BcD, attn_BcNH),
      (x_BcD,),
    )
    return x_BcD

  @staticmethod
  def last_row_of(lengths: RankLengths, x_BcD):
    return jax.lax.dynamic_index_in_dim(x_BcD, lengths.c - 1, axis=1, keepdims=False)

  def last_row(self, x_BcD):
    """The rank's last real row; on rank p-1 that is the prompt's last position."""
    return self.each_rank(self.last_row_of, x_BcD)

  # The layer.

  def own_start(self):
    """The prompt position of this rank's first row, traced (from the split's starts where
    they are static: one write for every rank, no switch over the buffer)."""
    if self.lengths is not None:
      return self.lengths.start
    return jnp.asarray(chunk_starts(self.chunks), jnp.int32)[self.rank]

  def hops(self, buffer_2BSKH, own_2BcKH, kind, l, after):
    """The hop chain of this layer's `kind`: sizes static (the split's) or data."""
    if self.chunks is None:
      buffer_2BSKH = hop_chain_as_data(
        buffer_2BSKH, self.rank, self.ends, kind, self.context_len, after=after
      )
      return buffer_2BSKH, None
    return hop_chain(
      buffer_2BSKH,
      own_2BcKH,
      self.rank,
      self.chunks,
      kind,
      self.timeline,
      l,
      self.last_into_buffer,
      after,
    )

  def layer(self, block, x_BcD, buffer_2BSKH, at):
    """One layer of the rank (`at`: the scan's models.base.Layer, l its index in the model):
    project, early diagonal, hops, attend, finish (each phase at its lengths); returns (x,
    buffer, what the layer outputs: its own K,V part, and the last hop's message where it is
    kept)."""
    l = at.index
    timeline = self.timeline
    q_BcNH, own_2BcKH = self.each_rank(self.project, block, x_BcD)
    q_BcNH, own_2BcKH = mark(timeline, "qkv", l, (q_BcNH, own_2BcKH))
    diagonal = None
    if self.diagonal_first:
      early = self.each_rank(self.early_diagonal, block, q_BcNH, own_2BcKH)
      # own K,V passes through the probe too: every hop's message is built from it, so no
      # hop is recorded before the diagonal (an optimization barrier alone did not order them).
      diagonal, own_2BcKH = mark(timeline, "diagonal", l, (early, own_2BcKH))
    message = None
    if self.num_ranks > 1:
      if self.buffer_len:
        # Own K,V after the received prefix: what this rank forwards (and, traced, attends).
        buffer_2BSKH = jax.lax.dynamic_update_slice_in_dim(
          buffer_2BSKH, own_2BcKH, self.own_start(), axis=2
        )
      # The hops' messages are computed after the early rows (their receivers wait less).
      kind = block.config.kind  # this layer's (layers may differ)
      buffer_2BSKH, message = self.hops(buffer_2BSKH, own_2BcKH, kind, l, diagonal)
      # The attention (and so the rest of the layer) waits for the hops, on every rank: rank
      # 0's reads only its own keys, and XLA may otherwise run it before the send, holding its
      # receiver back by a whole attention. Only q carries the dependence (one fused select).
      q_BcNH = ordered_after(q_BcNH, buffer_2BSKH, message)
    x_BcD = self.attend_and_finish(
      block, l, q_BcNH, own_2BcKH, buffer_2BSKH, message, diagonal, x_BcD
    )
    # Only this rank's chunk leaves the layer (and, kept, what the last hop brought), in
    # parts of part_len rows whichever body ran (one cache layout).
    own_out = fold_batch(own_2BcKH[:, :, : self.part_len])  # R = B * part_len rows
    if not self.keep_last_hop:
      return x_BcD, buffer_2BSKH, own_out
    # A windowed layer's last hop carries only [S_{p-2} - W + 1, S_{p-2}): kept at those
    # positions, zeros before (no query from the prompt's end on reads them), so that every
    # layer's kept message has the prefix's S_{p-2} rows.
    hop_start = chunk_starts(self.chunks)[-1] - message.shape[2]
    message = jnp.pad(message, ((0, 0), (0, 0), (hop_start, 0), (0, 0), (0, 0)))
    kept = (own_out, fold_batch(message))  # B * S_{p-2} rows
    return x_BcD, buffer_2BSKH, kept

  def attend_and_finish(self, block, l, q_BcNH, own_2BcKH, buffer_2BSKH, message, diag, x_BcD):
    """The rank's attention and the rest of its layer: its layer's output. In the model's last
    layer only the prompt's last row is read (its logits; every cache layout needs only this
    layer's K,V, already made and sent): a rank before the last skips both, so its part of
    the call ends with its hops, not a whole layer later (the next prompt's prefill starts
    sooner), and the last rank attends and finishes its last real row alone
    (`last_row_layer`), so no rank runs a chunk's attention after the last hop."""
    timeline = self.timeline

    def live(x_BcD):
      attn = self.each_rank(self.attend, block, q_BcNH, own_2BcKH, buffer_2BSKH, message, diag)
      attn = mark(timeline, "attention", l, attn.astype(x_BcD.dtype))
      return mark(timeline, "rest", l, self.each_rank(self.finish, block, x_BcD, attn))

    def last_row(x_BcD):
      x_BcD = self.each_rank(
        self.last_row_layer, block, q_BcNH, own_2BcKH, buffer_2BSKH, message, x_BcD
      )
      return mark(timeline, "rest", l, x_BcD)

    def dead(x_BcD):
      return x_BcD

    last_layer = l == self.config.num_layers - 1
    if self.num_ranks == 1:
      return jax.lax.cond(last_layer, last_row, live, x_BcD)
    # 0: every row (a layer before the last); 1: the last rank's last row; 2: nothing.
    branch = jnp.where(last_layer, jnp.where(self.rank == self.num_ranks - 1, 1, 2), 0)
    return jax.lax.switch(branch, [live, last_row, dead], x_BcD)

  def last_row_layer(
    self, lengths: RankLengths, block, q_BcNH, own_2BcKH, buffer_2BSKH, message, x_BcD
  ):
    """The rank's last real row through the model's last layer (`models.base.finish_one_row`):
    its query over the prefix it received and its own keys. Only the last rank's branch runs
    (`attend_and_finish`); the others are traced for the switch's shapes."""
    c, start = lengths.c, lengths.start
    if not lengths.static:  # the buffer holds the prefix and, at `start`, the own chunk
      keys_2BSKH = buffer_2BSKH[:, :, : self.keys] if self.num_ranks > 1 else own_2BcKH
      return finish_one_row(block, x_BcD, q_BcNH, keys_2BSKH, c - 1, start + c - 1, self.reduce)
    first = block.config.kind.first_key(start)
    prefix_2BsKH = self._static_prefix(block, lengths, buffer_2BSKH, message)
    keys_2BSKH = own_2BcKH[:, :, :c]
    if prefix_2BsKH is not None and first < start:
      keys_2BSKH = jnp.concatenate([prefix_2BsKH, keys_2BSKH], axis=2)
    return finish_one_row(
      block, x_BcD, q_BcNH, keys_2BSKH, c - 1, start - first + c - 1, self.reduce
    )


def _zero_partial(block, q_BrNH, entries_MBcKH, kernel):
  """A partial (out, lse) of zeros for the queries q (rank 0's, or a rank with no early rows:
  never merged), shaped as the block's partial is (its out width: H, or a latent layer's
  value width) and built from q, so that it carries q's type."""
  out_shape = jax.eval_shape(
    lambda q, e: block.attend_entries_partial(q, e, 0, kernel)[0],
    jax.tree.map(lambda q: q[:, :1], q_BrNH),
    entries_MBcKH[:, :, :1],
  ).shape
  q0_BrN1 = jax.tree.leaves(q_BrNH)[0][..., :1]
  zeros_BrN1 = jnp.zeros_like(q0_BrN1, jnp.float32)
  return zeros_BrN1 + jnp.zeros(out_shape[-1], jnp.float32), zeros_BrN1[..., 0]


def attend_static(block, q_BcNH, own_2BcKH, prefix_2BsKH, lengths: RankLengths, kernel, diag):
  """Rank i's attention at static lengths: its c queries against the prefix [first, start)
  it received and its own chunk. With `diag` (the partial of its first early_rows rows
  against its own keys, attended before the hop) the prefix and the rest of the diagonal are
  attended here and the partials merge by log-sum-exp; without it (dense, blocked: the
  paper's c x S rectangle) prefix and own keys are attended in one call."""
  c, start = lengths.c, lengths.start
  first = block.config.kind.first_key(start)  # the first key its queries see (this layer's)
  q_BcNH, own_2BcKH = jax.tree.map(lambda q: q[:, :c], q_BcNH), own_2BcKH[:, :, :c]
  if first == start:  # rank 0, or a window of one key: no prefix
    return block.attend_entries(q_BcNH, own_2BcKH, 0, kernel)
  if diag is None:  # a layer's cache entries: K and V, or its latents
    keys_2BsKH = jnp.concatenate([prefix_2BsKH, own_2BcKH], axis=2)
    return block.attend_entries(q_BcNH, keys_2BsKH, start - first, kernel)
  out_BcNH, lse_BcN = block.attend_entries_partial(q_BcNH, prefix_2BsKH, start - first, kernel)
  # The diagonal's rows [rows, c) after the hop (offset `rows` against the chunk's c keys),
  # appended to the `rows` attended before it.
  rows = lengths.early_rows
  own_out_BcNH, own_lse_BcN = diag[0][:, :rows], diag[1][:, :rows]
  if rows < c:
    late_queries = jax.tree.map(lambda q: q[:, rows:], q_BcNH)
    late_BcNH, late_lse_BcN = block.attend_entries_partial(late_queries, own_2BcKH, rows, kernel)
    own_out_BcNH = jnp.concatenate([own_out_BcNH, late_BcNH], axis=1)
    own_lse_BcN = jnp.concatenate([own_lse_BcN, late_lse_BcN], axis=1)
  merged_BcNH, _ = merge_partials(out_BcNH, lse_BcN, own_out_BcNH, own_lse_BcN)
  return merged_BcNH.astype(jax.tree.leaves(q_BcNH)[0].dtype)


def rank_layer(block, x_BcD, kv_prefix, i: int, chunks: tuple[int, ...], attention="dense"):
  """Rank i's whole layer given the K,V it receives ([2, B, >= start_i, K, H], prompt order),
  the paper's rectangle (no early diagonal): the unit of per-rank cost. Used only to measure
  one rank's compiled cost in isolation (cost analysis); the SPMD program runs the same
  phases with the hop chain between them."""
  start = chunk_starts(chunks)[i]
  lengths = RankLengths(i, chunks[i], start, 0)
  first = block.config.kind.first_key(start)  # the first key its queries see (this layer's)
  B, c = x_BcD.shape[0], chunks[i]
  positions_Bc = jnp.broadcast_to(start + jnp.arange(c), (B, c))
  q_BcNH, own_2BcKH = block.project_entries(x_BcD[:, :c], positions_Bc)
  prefix = None if i == 0 else kv_prefix[:, :, first:start]
  attn_BcNH = attend_static(block, q_BcNH, own_2BcKH, prefix, lengths, attention, None)
  return block.finish(x_BcD[:, :c], attn_BcNH)
