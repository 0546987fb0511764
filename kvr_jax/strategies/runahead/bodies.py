"""KV-Runahead's two program bodies: the one rank layer (`rank_layer.RankLayer`) with its
lengths static per switch branch ("per-rank") or traced ("one": the one body, its split
static or the program's operand). Each returns a `make_body` (`Strategy.rank_body`).

  per-rank  for the kernels whose bounds must be static (dense, blocked, fused, cudnn), and
            the reference the one body is measured against (`body="per-rank"`): no FLOP on
            padding, but every branch is compiled (the program grows with p, and every split
            is a new program).
  one       every rank runs one body; its real length c, start and early rows are data read
            from constant tables at its rank index (`OneBodyShape.table`). Shapes are the
            split's padded chunk and buffer, so the compiled program does not grow with p; only
            the hops' static sizes follow the split. Per layer, rank i projects its c rows in
            blocks of R rows (a loop of ceil(c / R) steps), attends its first r_i rows against
            its own keys before the hop, writes the hops into its buffer at the prefix's
            positions (every rank's buffer holds [first, start) then its own chunk), attends
            its rows against the buffer's keys [first, start + c) in one flash call (the early
            rows see only the prefix) and finishes in row blocks. Padding costs at most one row
            block of projections and MLP and one query block of attention per rank.
  as data   the one body with the split as the program's third operand and its hops sized as
            data (`hop_chain_as_data`): one program for every split that fits its shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from kvr_jax.strategies.base import RankBody
from kvr_jax.strategies.runahead.rank_layer import RankLayer, RankLengths
from kvr_jax.strategies.runahead.schedule import (
  OneBodyShape,
  attends_diagonal_first,
  check_keep_last_hop,
)
from models.kernels import get_kernel


def _heads_and_dtype(model) -> dict:
  """This shard's N and K (the stacked projections [L, D, N, H]) and the K,V dtype."""
  kv_heads = model.blocks.wk[...].shape[2]
  return dict(
    dtype=model.blocks.wk[...].dtype,
    q_heads=model.blocks.wq[...].shape[2],
    entry_shape=(2, kv_heads, model.config.head_dim),
  )


def per_rank_body(
  graphdef,
  chunks: tuple[int, ...],
  attention="dense",
  timeline: bool = False,
  keep_last_hop: bool = False,
) -> Callable:
  """The rank layer at static lengths, every phase a `lax.switch` on the rank (the module
  docstring). timeline: probes at every phase boundary (kvr_jax.strategies.probe);
  keep_last_hop: also output every layer's last-hop message; a rank on a ("ranks", "model")
  mesh is a tensor-parallel group (its K,V and hops are the shard's own heads)."""
  del graphdef
  p = len(chunks)

  def make_body(model, rank, tokens_Bc, reduce):
    cfg = model.config
    check_keep_last_hop(keep_last_hop, chunks, cfg.kinds)
    layer = RankLayer.at_static_lengths(
      chunks,
      attention,
      cfg,
      rank,
      reduce,
      diagonal_first=attends_diagonal_first(attention, p),
      timeline=timeline,
      keep_last_hop=keep_last_hop,
      **_heads_and_dtype(model),
    )
    buffer = layer.empty_buffer(tokens_Bc.shape[0])
    return RankBody(tokens_Bc, layer.layer, layer.last_row, p - 1, buffer)

  return make_body


def one_body(
  graphdef,
  chunks: tuple[int, ...],
  attention="flash",
  timeline: bool = False,
  keep_last_hop: bool = False,
) -> Callable:
  """The rank layer at traced lengths, the split static (the module docstring)."""
  del graphdef
  kernel = get_kernel(attention)

  def make_body(model, rank, tokens_Bc, reduce):
    check_keep_last_hop(keep_last_hop, chunks, model.config.kinds)
    shape = OneBodyShape.of_split(model.config, chunks, kernel)
    table = shape.table(model.config, chunks)
    return _one_body_rank(
      model, rank, tokens_Bc, reduce, shape, kernel, timeline, keep_last_hop, table, chunks
    )

  return make_body


def one_body_as_data(shape: OneBodyShape, attention="flash") -> Callable:
  """The one body with the split as data (the program's third operand, `OneBodyShape.table`)
  and hops sized as data: one program for every split that fits `shape`. No timeline probes,
  no kept last hop (its size would be data): the parts are moved for cache="last"."""
  kernel = get_kernel(attention)

  def make_body(model, rank, tokens_Bc, reduce, table_3p):
    return _one_body_rank(model, rank, tokens_Bc, reduce, shape, kernel, False, False, table_3p)

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


def _one_body_rank(
  model, rank, tokens_Bc, reduce, shape, kernel, timeline, keep_last_hop, table, chunks=None
) -> RankBody:
  """The one body's rank: `one_body_layer` with the model's K,V heads, its tokens padded to
  the shape's chunk."""
  layer = one_body_layer(
    model.config,
    rank,
    reduce,
    shape,
    kernel,
    timeline,
    keep_last_hop,
    table,
    chunks,
    **_heads_and_dtype(model),
  )
  tokens_Bc = jnp.pad(tokens_Bc, ((0, 0), (0, shape.chunk_len - tokens_Bc.shape[1])))
  buffer = layer.empty_buffer(tokens_Bc.shape[0])
  return RankBody(tokens_Bc, layer.layer, layer.last_row, shape.num_ranks - 1, buffer)


def one_body_layer(
  config, rank, reduce, shape, kernel, timeline, keep_last_hop, table, chunks=None, **heads
) -> RankLayer:
  """The one body's rank layer: its lengths read from `table` ([3, p]: lengths, starts,
  early rows) at its index, its rows `shape.chunk_len`; chunks: the split where it is static
  (None: the table is the program's operand and the hops are sized as data). heads: dtype,
  q_heads and entry_shape, what a position's cache entry is (K,V heads, or one latent)."""
  c_p, start_p, early_p = (jnp.asarray(row, jnp.int32) for row in table)
  return RankLayer(
    chunks=chunks,
    num_ranks=shape.num_ranks,
    kernel=_one_body_kernel(kernel, shape.block, config.narrowest_window),
    timeline=timeline,
    reduce=reduce,
    config=config,
    rank=rank,
    lengths=RankLengths(None, c_p[rank], start_p[rank], early_p[rank]),
    static_early_rows=(),
    diagonal_first=True,
    rows=shape.chunk_len,
    part_len=shape.part_len,
    buffer_len=shape.buffer_len,
    keys=shape.keys,
    block=shape.block,
    last_into_buffer=True,
    keep_last_hop=keep_last_hop,
    ends=start_p + c_p,
    context_len=shape.context_len,
    **heads,
  )
