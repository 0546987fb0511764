"""KV-Runahead's schedule arithmetic, no JAX: how many rows each rank attends before its hop,
which keys each hop carries, and the one body's static shape (blocks, buffers, the split's
table). The cost model and the search call these per split they weigh; the programs read
the same numbers."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvr_jax.core.chunks import chunk_starts, prefix_ends
from models.kernels import get_kernel, kernels_where
from models.layer_kinds import AttentionKind


def rows_before_hop(config, chunks: tuple[int, ...]) -> tuple[int, ...]:
  """r_i: the rows of its own causal diagonal rank i attends before its hop (r_0 = 0).

  Every rank starts a layer together (the hops of the last layer synchronised them); rank 0
  can send after its qkv, rank i > 0 holds its prefix when hop i-1 lands (it forwards after
  that). Rank i's r_i is the most rows whose FLOPs (query j sees min(j + 1, W) keys) fit
  between its own qkv and its sender's readiness: never later than the sender, so a held send
  costs nothing. FLOPs, not seconds: a matmul and the attention kernel run at similar
  FLOP/s on the CPUs this was measured on; the link time is left out (a slow link only gives
  the receiver more time, which the rest of its diagonal then fills after the hop)."""
  D, N, K, H = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
  window = config.sliding_window
  qkv_per_token = 2 * D * (N + 2 * K) * H
  per_key = 4 * N * H  # scores and the weighted sum
  rows, sender_ready = [0], qkv_per_token * chunks[0]
  for c in chunks[1:]:
    spare = sender_ready - qkv_per_token * c
    r = _most_rows_within(spare, per_key, c, window or c)
    rows.append(r)
    early = qkv_per_token * c + per_key * _keys_of_first_rows(r, window or c)
    sender_ready = max(sender_ready, early)  # this rank forwards once it holds its prefix
  return tuple(rows)


def _keys_of_first_rows(r: int, window: int) -> int:
  """Keys the first r rows of a causal diagonal see together: row j sees min(j + 1, W)."""
  if r <= window:
    return r * (r + 1) // 2
  return window * (window + 1) // 2 + (r - window) * window


def _most_rows_within(flops: int, per_key: int, c: int, window: int) -> int:
  """The most rows r <= c whose diagonal (`_keys_of_first_rows`) costs at most `flops`: the
  quadratic's root, then exact in integers (the cost model's search calls this per rank for
  every split it weighs, so no array of c rows)."""
  if flops <= 0:
    return 0
  keys = flops / per_key
  if keys <= window * (window + 1) / 2:
    r = int((math.sqrt(8 * keys + 1) - 1) / 2)
  else:
    r = window + int((keys - window * (window + 1) / 2) / window)
  r = min(max(r, 0), c)
  while r < c and per_key * _keys_of_first_rows(r + 1, window) <= flops:
    r += 1
  while r > 0 and per_key * _keys_of_first_rows(r, window) > flops:
    r -= 1
  return r


def attends_diagonal_first(attention, num_ranks: int) -> bool:
  """Ranks i > 0 attend their own chunk before the prefix arrives: kernels whose partials
  merge (they return the log-sum-exp), and only where some rank waits for a prefix."""
  return get_kernel(attention).returns_lse and num_ranks > 1


def hop_span(k: int, chunks: tuple[int, ...], kind: AttentionKind) -> tuple[int, int]:
  """The positions [a, S_k) hop k carries on a layer of `kind` (`AttentionKind.hop_span`:
  the whole prefix, or with a sliding window W only its last W-1 keys)."""
  return kind.hop_span(prefix_ends(chunks)[k])


def last_hop_holds_cache(chunks: tuple[int, ...], kinds: tuple) -> bool:
  """The last hop's message and the last rank's own chunk hold every key that decode reads
  from the prompt's last position on, on every layer kind (each kind's `last_hop_holds`): the
  last rank can keep them as the cache (`by_kind.compile_by_kind(keep_last_hop=True)`), nothing
  moves. On a full layer the hop is the whole prefix; on a windowed one (W) its last W-1 keys
  [S_{p-2} - W + 1, S_{p-2}), whose window with the own chunk reaches back past the last
  position's (so the cache is zeros before them); a latent layer's is the latent prefix; a
  linear layer's past is the state the last rank computes. One rank has no hop."""
  if len(chunks) < 2:
    return False
  hop_end, last = prefix_ends(chunks)[-2], sum(chunks) - 1
  return all(kind.last_hop_holds(hop_end, last) for kind in kinds)


def check_keep_last_hop(keep_last_hop: bool, chunks: tuple[int, ...], kinds) -> None:
  """keep_last_hop only where the last hop holds the cache (`last_hop_holds_cache`)."""
  if keep_last_hop and not last_hop_holds_cache(chunks, kinds):
    raise ValueError(
      f"keep_last_hop: the last hop of {chunks} does not hold the cache (one rank receives no "
      "hop); move the parts instead"
    )


def buffer_len(chunks: tuple[int, ...]) -> int:
  """Rows of a forwarding rank's accumulation buffer: every rank writes its c_max padded rows
  at its chunk's start (one SPMD write), so the last start plus c_max (never clamped)."""
  return chunk_starts(chunks)[-1] + max(chunks) if len(chunks) > 2 else 0


# The one-body program runs the kernels whose bounds may be data (`lengths_as_data`:
# `models.flash.Lengths`); the others need the per-rank program's
# static shapes.
BODIES = ("one", "per-rank")


# Up to this many ranks the per-rank program is the default body even for the kernels that
# take lengths as data. Measured at 2 ranks (bench-llama, two processes x one core, the same
# split in one interleaved run; docs/measurements.md): the one body ties it at 4k (+0.4% by
# median), 8k (+2.9%) and 16k (-0.3%) but is 7-17% slower at 1k-2k, where its row blocks
# pad the long chunk by 3-8%; it compiles a little faster there (1.01 s against 1.11,
# tiny-llama's program alone). From 3 ranks the one body is the default: its compile stops
# growing with the ranks (8 ranks 0.82-0.97 s against the per-rank 2.3-2.4 s).
PER_RANK_UP_TO = 2


# The largest block of the one body's row loops (projections, MLP): a loop whose trip count
# is the rank's real length in blocks (its query blocks are at most the kernel's).
ROW_BLOCK = 512


# A block's fixed cost (a loop step; a query block's walk over its key blocks), counted in
# rows of its own work: what `one_body_block` weighs against padded rows.
BLOCK_OVERHEAD_ROWS = 16


def check_body(body: str | None, attention, num_ranks: int) -> str:
  """The program body for `attention` on `num_ranks` ranks: by default "one" where the kernel
  takes lengths as data and there are more than PER_RANK_UP_TO ranks, else "per-rank"."""
  kernel = get_kernel(attention)
  if body is None:
    return "one" if kernel.lengths_as_data and num_ranks > PER_RANK_UP_TO else "per-rank"
  if body not in BODIES:
    raise ValueError(f"unknown KV-Runahead body {body!r}; expected one of {BODIES}")
  if body == "one" and not kernel.lengths_as_data:
    raise ValueError(
      f"the one-body KV-Runahead program runs attention in "
      f"{kernels_where(lengths_as_data=True)}, not {kernel.name!r} (its bounds must be "
      "static: body='per-rank')"
    )
  return body


def one_body_block(config, chunks: tuple[int, ...], kernel) -> int:
  """The one body's block: rows per step of its row loops (projections, MLP) and per query
  block of its attention (one size, so a padded chunk is whole blocks of both). Rank i
  computes its c_i rows rounded up to a block edge, so a block fixed at the kernel's 512 cost
  a rank of 2637 tokens 3072 query rows against its whole prefix (16% more of the critical
  path's attention than the per-rank program's). This is the multiple of 8 up to the
  kernel's query block (and ROW_BLOCK) whose padded work is least: every rank's rows up to
  its block edge, plus BLOCK_OVERHEAD_ROWS per block, each row weighed by what it costs on
  that rank (the linear layers, the keys it sees, and half a block of masked keys: a query
  block's diagonal key block is computed whole, half of it in the future). Without that
  last term [2685, 1411] took 472-row blocks and padded rank 0 by 147 rows; with it, 208:
  both ranks' work on one core 1.012 s -> 0.935 s (bench-llama, blocks forced to 472 and 208)."""
  D, N, K, H = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
  window = config.narrowest_window
  linear_per_row = 2 * D * ((N + 2 * K) * H + N * H + config.mlp_matrices * config.active_mlp_dim)
  per_key = 4 * N * H
  cost_per_row = [linear_per_row + per_key * min(end, window or end) for end in prefix_ends(chunks)]
  longest = -(-max(chunks) // 8) * 8

  def padded_work(block: int) -> float:
    return sum(
      (-(-c // block)) * (block + BLOCK_OVERHEAD_ROWS) * (row + per_key * block / 2)
      for c, row in zip(chunks, cost_per_row, strict=True)
    )

  largest = min(ROW_BLOCK, get_kernel(kernel).query_block, longest)
  candidates = range(8, largest + 1, 8)
  return min(candidates, key=lambda block: (padded_work(block), -block))


def padded_chunk_len(chunks: tuple[int, ...], block: int) -> int:
  """The one body's static chunk length: the longest chunk rounded up to whole blocks (a
  block's slice never runs past the end, where `dynamic_slice` would clamp it)."""
  return -(-max(chunks) // block) * block


def one_body_buffer_len(chunks: tuple[int, ...], block: int) -> int:
  """Rows of every rank's K,V buffer in the one body, indexed by prompt position: the received
  prefix, then the rank's own padded chunk written at its start (never clamped); whole
  blocks, so that the flash kernel's key blocks are the query blocks (`one_body_keys`)."""
  return -(-(chunk_starts(chunks)[-1] + padded_chunk_len(chunks, block)) // block) * block


def one_body_keys(chunks: tuple[int, ...], block: int) -> int:
  """The buffer rows the one body attends: the prompt in whole blocks (no rank sees a key
  past it; the buffer runs a padded chunk further). The kernel lays out every key it is
  given, once per call: rank 0 of [5555, 2637] (block 440) attends in 236 ms over the whole
  buffer's 11,440 rows and 216 ms over 5720 (one layer, one core, kernel alone)."""
  return min(-(-sum(chunks) // block) * block, one_body_buffer_len(chunks, block))


def early_rows_in_blocks(config, chunks: tuple[int, ...], block: int) -> tuple[int, ...]:
  """The one body's early rows: each rank's r_i (`rows_before_hop`) moved to the nearest
  edge of its query blocks (at most its c_i). The early and the late pieces then visit
  disjoint query blocks; an r_i inside a block would have both compute it."""
  if len(chunks) == 1:
    return (0,)
  return tuple(
    min(int(round(r / block)) * block, c)
    for r, c in zip(rows_before_hop(config, chunks), chunks, strict=True)
  )


@dataclasses.dataclass(frozen=True)
class OneBodyShape:
  """What the one body's compiled program depends on besides the model and its kernel: the
  static shape every rank runs. Of one split (`of_split`: its padded chunk, buffer and parts)
  or an envelope of many (`envelope`), whose program takes the split as data (its table and
  its hops' lengths), so that every split that fits shares one program."""

  num_ranks: int
  context_len: int
  block: int  # rows per step of the row loops and per query block (one_body_block)
  chunk_len: int  # every rank's padded chunk, whole blocks
  buffer_len: int  # rows of every rank's K,V buffer (prompt positions)
  keys: int  # the buffer rows attention reads
  part_len: int  # rows of every rank's K,V part output

  @classmethod
  def of_split(cls, config, chunks: tuple[int, ...], kernel) -> OneBodyShape:
    block = one_body_block(config, chunks, kernel)
    return cls(
      num_ranks=len(chunks),
      context_len=sum(chunks),
      block=block,
      chunk_len=padded_chunk_len(chunks, block),
      buffer_len=one_body_buffer_len(chunks, block),
      keys=one_body_keys(chunks, block),
      part_len=max(chunks),
    )

  @classmethod
  def envelope(cls, config, chunks: tuple[int, ...], kernel, longest: int) -> OneBodyShape:
    """Every split of sum(chunks) tokens over len(chunks) ranks with no chunk above `longest`
    (blocks fitted to `chunks`). A rank's chunk starts before C and a hop's pieces end within
    HOP_GRANULE rows of C, so the buffer holds C plus one padded chunk."""
    if isinstance(longest, bool) or not isinstance(longest, (int, np.integer)):
      raise ValueError(f"an envelope's `longest` chunk must be an integer, got {longest!r}")
    if longest < max(chunks):
      raise ValueError(
        f"an envelope's `longest` chunk ({longest}) is shorter than the split's longest "
        f"({max(chunks)}): {tuple(chunks)}"
      )
    block = one_body_block(config, chunks, kernel)
    context_len = sum(chunks)
    # No chunk is longer than the prompt: a larger `longest` is clamped to it, not allocated.
    longest = min(int(longest), context_len)
    chunk_len = -(-longest // block) * block
    buffer_len = -(-(context_len + max(chunk_len, HOP_GRANULE)) // block) * block
    return cls(
      num_ranks=len(chunks),
      context_len=context_len,
      block=block,
      chunk_len=chunk_len,
      buffer_len=buffer_len,
      keys=min(-(-context_len // block) * block, buffer_len),
      part_len=chunk_len,
    )

  def check_split(self, chunks: tuple[int, ...]) -> None:
    if len(chunks) != self.num_ranks or sum(chunks) != self.context_len:
      raise ValueError(
        f"split {chunks} is not of {self.context_len} tokens over {self.num_ranks} ranks, "
        "the shape of this program"
      )
    if max(chunks) > self.chunk_len:
      raise ValueError(
        f"split {chunks}: a chunk of {max(chunks)} tokens is longer than this program's "
        f"{self.chunk_len}"
      )

  def table(self, config, chunks: tuple[int, ...]) -> np.ndarray:
    """The split as the program's data, int32 [3, p]: each rank's length, start, and early
    rows (`early_rows_in_blocks`, at this shape's block)."""
    self.check_split(chunks)
    early = early_rows_in_blocks(config, chunks, self.block)
    return np.array([chunks, chunk_starts(chunks), early], np.int32)


# A hop whose length is data is sent as pieces of HOP_GRANULE x 2^b rows, each under a
# `lax.cond` on bit b of its length in granules: at most HOP_GRANULE - 1 rows more than the
# prefix on the link. Measured (two processes, gloo, bench-llama's K,V, docs/measurements.md):
# no runtime cost against one static ppermute within the noise, about 1.1 s more compile per
# hop, so only the programs that serve many splits take it.
HOP_GRANULE = 64


def hop_pieces(max_rows: int) -> tuple[int, ...]:
  """Piece sizes, largest first, whose sums are every multiple of HOP_GRANULE to max_rows."""
  granules = -(-max_rows // HOP_GRANULE)
  return tuple(HOP_GRANULE << b for b in reversed(range(granules.bit_length())))
