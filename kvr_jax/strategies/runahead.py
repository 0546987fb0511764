"""KV-Runahead prefill under `jax.shard_map`: uneven chunks, a point-to-point K,V hop chain.

One jitted SPMD program; every rank runs the layer loop below on its own chunk. Per layer:

  rank:        0            1                 2                    3
  own chunk  [0,S0)      [S0,S1)           [S1,S2)              [S2,C)
  project    q,k,v       q,k,v             q,k,v                q,k,v       (switch: c_i rows)
  diagonal     .         c1 x c1 causal    c2 x c2              c3 x c3     (switch: flash)
  hop 0      kv[0,S0) ─────▶ kv[0,S0)
  hop 1                  kv[0,S1) ───────────▶ kv[0,S1)
  hop 2                                    kv[0,S2) ──────────────▶ kv[0,S2)
  attend     c0 x S0     c1 x S0 prefix    c2 x S1 prefix       c3 x S2     (switch: static,
                         + merge           + merge              + merge      lse merge)
  finish     MLP c0      MLP c1            MLP c2               MLP c3

Every rank holds a [B, c_max] padded chunk because SPMD needs one static shape. Two bodies
(`compile_program(body=)`):
  "one" (`one_body`; the flash kernel): every rank runs one body, its real length,
    start and early rows are data; the projections and the MLP run over row blocks in loops
    whose trip count is the rank's length, and the flash kernel visits only the query and
    key blocks inside the real lengths: at most one block of padding per rank, and a program
    that does not grow with p.
  "per-rank" (`per_rank_body`; dense, blocked, fused, cudnn, whose bounds are static): a
    `lax.switch` on the rank index whose branch i slices exactly c_i rows and S_i keys: no
    FLOP on padding, but every branch is compiled (the program grows with p).
Hop k is a `ppermute` with the single pair (k, k+1) that sends the static prefix [0, S_k) of
rank k's keys, K and V stacked in one message, with their own K heads (never repeated to the
N query heads): the hops' sizes follow the split in both bodies (SPMD collectives need static
shapes), so a new split is a new program.

Better than the paper: a rank does not idle while it waits for its prefix. With a kernel that
returns its log-sum-exp (flash, fused), rank i > 0 first attends the first r_i rows of its own
chunk (the causal diagonal square, which needs nothing from anyone), then receives the prefix
and attends its queries to it and the rest of the diagonal, and the partials merge exactly in
float32 (`layers.merge_partials`). An optimization barrier orders the early rows before the
hops, so that XLA cannot move them behind the receive; rank 0 has no prefix and attends after
it has sent hop 0.

How many rows go first (`rows_before_hop`): a hop is a rendezvous, not a fire-and-forget send.
Its sender's next work is ordered behind the hop (the barrier below), and the transfer itself
needs both ends (gloo on CPU holds the send until the receive is posted; NCCL does for large
messages). So rank i should reach hop i-1 when its sender does, no later: its qkv plus r_i
diagonal rows take as many FLOPs as the sender's work before that send. Whole diagonals first
(the previous order) held rank 0 back by rank 1's diagonal minus the qkv difference in the
first layer, and left rank 1 idle by as much after the last (the measured timelines showed
both); in the layers between, any r_i is as good when the split is balanced.

Buffers. Rank 0's message is its own chunk. A forwarding rank (0 < k < p-1) keeps an
accumulation buffer carried across layers (never zero-filled: each layer overwrites what it
reads, [window start, S_k)), its own K,V written at its chunk's start, the received prefix
before them. The last hop's message is attended where it arrives: the last rank forwards
nothing, so with p = 2 there is no prompt-long buffer at all. `ppermute` gives zeros to ranks
outside the pair, so only rank k+1 writes hop k into its buffer (`jnp.where`).

Each rank outputs its own chunk's K,V ([L, 2, B*c_max, K, H], padded to the largest chunk),
never a prompt-long stack; they stay where they were computed (cache="sharded";
kvr_jax.inference.kv_cache). For the paper's layout (cache="last": the whole cache on the
last rank) nothing needs to move: the last hop of every layer already carried [0, S_{p-2})
to the last rank, which attended it. With `keep_last_hop` the program also returns each
layer's last-hop message ([L, 2, B*S_{p-2}, K, H]; zeros on the ranks it did not reach, the
price of SPMD's one output shape) and the last rank's cache is that message and its own chunk,
joined where they lie. (Moving the parts after the program instead sent rank 0's chunk to the
last rank twice and cost KVR 0.3 s of 2.6 s at 8k on two processes.) Prefill asks for it only
where memory allows (kvr_jax.inference.kv_cache.join_affordable).

Sliding window W (Mistral): query q sees only keys (q - W, q], so hop k carries only the last
W-1 keys of [0, S_k) and each rank attends to [start - W + 1, S_i): hop bytes and attention
are bounded by W whatever the prompt length. The last rank then holds the K,V decode needs,
positions [C - W + 1, C) and more; positions no rank passed on stay zero in its cache, and
decode masks by the window, so it never reads them. The cache parts hold every position
(each rank keeps its whole chunk).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvr_jax.core.caches import kept_cache
from kvr_jax.core.chunks import chunk_starts, prefix_ends
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, global_array
from kvr_jax.strategies.base import (
  CAUSAL_KERNELS,
  RankBody,
  Strategy,
  contiguous_layout,
  fold_batch,
  model_reduce,
  ordered_after,
  rank_program,
  refuse,
  spmd,
  strategy_compiler,
)
from kvr_jax.strategies.probe import mark
from kvr_jax.strategies.roofline import (
  Compute,
  ModelledLayer,
  Receive,
  Send,
  kv_message_bytes,
  phase_seconds,
  phase_work,
  total_work,
  visible_keys,
  work_kwargs,
)
from models import layers
from models.base import no_reduce
from models.kernels import get_kernel, kernels_where


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
  first = layers.window_start(start, block.config.sliding_window)
  q_BcNH, own_2BcKH = q_BcNH[:, :c], own_2BcKH[:, :, :c]
  if first == start:  # rank 0, or a window of one key: no prefix
    return block.attend(q_BcNH, own_2BcKH[0], own_2BcKH[1], 0, attention)
  if diagonal is not None:
    out_BcNH, lse_BcN = block.attend_partial(
      q_BcNH, prefix_2BsKH[0], prefix_2BsKH[1], start - first, attention
    )
    own_out_BcNH, own_lse_BcN = finish_diagonal(block, q_BcNH, own_2BcKH, diagonal, rows, attention)
    merged_BcNH, _ = layers.merge_partials(out_BcNH, lse_BcN, own_out_BcNH, own_lse_BcN)
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
  first = layers.window_start(start, block.config.sliding_window)
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
  first = layers.window_start(start, block.config.sliding_window)
  q_BcNH, own_2BcKH = project_own_chunk(block, x_BcD, i, chunks)
  prefix = None if i == 0 else kv_prefix[:, :, first:start]
  attn_BcNH = attend_rank(block, q_BcNH, own_2BcKH, prefix, i, chunks, attention)
  return block.finish(x_BcD[:, : chunks[i]], attn_BcNH)


def hop_span(k: int, chunks: tuple[int, ...], window: int | None) -> tuple[int, int]:
  """The key positions [a, S_k) hop k carries: the whole prefix, or with a sliding window W
  only the last W-1 keys of it (all that any later query can see): bounded by W, not by C."""
  end = prefix_ends(chunks)[k]
  return layers.window_start(end, window), end


def whole_prefix_hops(chunks: tuple[int, ...], window: int | None) -> bool:
  """The last hop carries every earlier position [0, S_{p-2}) (no window cuts it): the last
  rank can then hold the whole cache without a move (`compile_program(keep_last_hop=True)`)."""
  return len(chunks) > 1 and hop_span(len(chunks) - 2, chunks, window)[0] == 0


def check_keep_last_hop(keep_last_hop: bool, chunks: tuple[int, ...], window) -> None:
  """keep_last_hop only where the last hop carries the whole prefix (`whole_prefix_hops`)."""
  if keep_last_hop and not whole_prefix_hops(chunks, window):
    raise ValueError(
      f"keep_last_hop: the last hop of {chunks} does not carry the whole prefix (one rank, "
      f"or a sliding window of {window} shorter than it); move the parts instead"
    )


def buffer_len(chunks: tuple[int, ...]) -> int:
  """Rows of a forwarding rank's accumulation buffer: every rank writes its c_max padded rows
  at its chunk's start (one SPMD write), so the last start plus c_max (never clamped)."""
  return chunk_starts(chunks)[-1] + max(chunks) if len(chunks) > 2 else 0


def hop_chain(
  buffer_2BSKH,
  own_2BcKH,
  rank,
  chunks: tuple[int, ...],
  window: int | None = None,
  timeline: bool = False,
  layer=-1,
  last_into_buffer: bool = False,
  after=None,
):
  """p-1 hops: hop k sends keys [a, S_k) (hop_span) from rank k to rank k+1, one pair per
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
    a, end = hop_span(k, chunks, window)
    source = own_2BcKH if k == 0 else buffer_2BSKH  # rank 0's prefix is its chunk
    message = ordered_after(source[:, :, a:end], after)
    message = jax.lax.ppermute(message, AXIS, perm=[(k, k + 1)])
    if k < p - 2 or last_into_buffer:
      # ppermute gives zeros to ranks outside the pair: only rank k+1 keeps the message.
      prefix = jnp.where(rank == k + 1, message, buffer_2BSKH[:, :, a:end])
      buffer_2BSKH = jax.lax.dynamic_update_slice_in_dim(buffer_2BSKH, prefix, a, axis=2)
    buffer_2BSKH, message = mark(timeline, f"hop{k}", layer, (buffer_2BSKH, message))
  return buffer_2BSKH, message


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
    check_keep_last_hop(keep_last_hop, chunks, cfg.narrowest_window)
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
    window = block.config.sliding_window  # this layer's (layers may differ)
    prefixes = hop_chain(buffer_2BSKH, own_2BcKH, rank, chunks, window, timeline, l, after=diagonal)
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


# --- one body for every rank: the chunk lengths as data -------------------------------------

# The one-body program runs the kernels whose bounds may be data (`lengths_as_data`:
# `layers.attend_flash`'s query_rows and key_end); the others need the per-rank program's
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


def hop_chain_as_data(buffer_2BSKH, rank, ends_p, window: int | None, max_rows: int, after):
  """The hop chain of `hop_chain` with the hops' spans as data: hop k carries keys [a, S_k)
  (ends_p[k] = S_k traced, a its window start) from rank k's buffer into rank k+1's, in the
  pieces of `hop_pieces` whose bits its length sets. The bits are the same on every rank (the
  table is), so every rank takes the same branch and each ppermute is whole. Rows a piece
  carries past S_k are rank k+1's own chunk in its buffer: it keeps them. max_rows: the
  longest hop (the prompt; with a window, its last W-1 keys at most)."""
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
    check_keep_last_hop(keep_last_hop, chunks, model.config.narrowest_window)
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
      query_rows=(0, c),
      key_end=start + c,
      first_rows_key_end=(early_rows, start),
    )
    early = jnp.arange(self.c_pad) < early_rows
    early_lse_BcN = jnp.where(early[:, None], diagonal[1], -jnp.inf)
    attn_BcNH, _ = layers.merge_partials(late_BcNH, late_lse_BcN, diagonal[0], early_lse_BcN)
    return attn_BcNH

  def layer(self, block, x_BcD, buffer_2BSKH, l):
    """One layer of the rank (the phases in `one_body`'s docstring)."""
    timeline, c = self.timeline, self.c
    q_BcNH, own_2BcKH = mark(timeline, "qkv", l, self.project(block, x_BcD))
    early = block.attend_partial(
      q_BcNH, own_2BcKH[0], own_2BcKH[1], 0, self.kernel, query_rows=(0, self.early_rows), key_end=c
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
      window = block.config.sliding_window  # this layer's (layers may differ)
      if self.chunks is None:  # hops sized as data: the split is the program's operand
        buffer_2BSKH = hop_chain_as_data(
          buffer_2BSKH, self.rank, self.ends, window, self.shape.context_len, after=diagonal
        )
      else:
        buffer_2BSKH, last_message = hop_chain(
          buffer_2BSKH, own_2BcKH, self.rank, self.chunks, window, timeline, l, True, diagonal
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


def kvr_body(graphdef, chunks, attention, timeline, keep_last_hop, body=None):
  """KV-Runahead's rank (`strategy_compiler`'s body_of). body: "one" (every rank runs one
  program body, lengths as data; the default for the kernels with `lengths_as_data` on more
  than PER_RANK_UP_TO ranks) or "per-rank" (a switch branch per rank, the default otherwise);
  part of the cache key.

  The compiled program: f(state, tokens [p, B, c_max]) -> (logits [p, B, V], kv parts [p, L,
  2, B*c_max, K, H]); rank p-1's logits are the answer, rank i's part is its chunk's K,V.
  keep_last_hop (only where `whole_prefix_hops`): the second output is (kv parts, last-hop
  messages [p, L, 2, B*S_{p-2}, K, H], batch folded), rank p-1's message being the prompt's
  first S_{p-2} positions."""
  body = check_body(body, attention, len(chunks))
  make = one_body if body == "one" else per_rank_body
  return make(graphdef, chunks, attention, timeline, keep_last_hop)


def varying_axes(reduce) -> tuple[str, ...]:
  """The mesh axes a rank's zero-initialised buffers vary over: ("ranks",), and "model" where
  the rank is a tensor-parallel group (its `reduce` psums over "model")."""
  return (AXIS, MODEL_AXIS) if reduce is tensor_parallel.psum_over_model else (AXIS,)


compile_program = strategy_compiler("kvr", kvr_body, "flash")


def pad_chunks(tokens_BC, chunks: tuple[int, ...]):
  """[B, C] -> [p, B, c_max]: rank i's tokens, zero-padded to the largest chunk."""
  tokens_BC = np.asarray(tokens_BC)
  c_max = max(chunks)
  out = np.zeros((len(chunks), tokens_BC.shape[0], c_max), tokens_BC.dtype)
  for i, (start, c) in enumerate(zip(chunk_starts(chunks), chunks, strict=True)):
    out[i, :, :c] = tokens_BC[:, start : start + c]
  return out


def layout(context_len: int, num_ranks: int, chunks: tuple[int, ...]) -> tuple[int, ...]:
  return chunks  # the user's (validated) partition, rank 0 the earliest tokens


# --- the modelled layer (kvr_jax.planning.costmodel) -------------------------------------------


def layer_work(config, chunks: tuple[int, ...], setup):
  """One layer of KV-Runahead: each rank's `RankWork`, and each hop's bytes and seconds.
  With a sliding window rank i attends from its window start and hop k carries the last W-1
  keys of [0, S_k): both bounded by W. With a kernel whose partials merge
  (`Setup.diagonal_first`) rank i > 0 has a "diagonal" phase (its first `rows_before_hop`
  rows, before the hop) and its "attention" is the prefix and the rest of its diagonal."""
  links = setup.links
  p, ends, window = len(chunks), prefix_ends(chunks), config.sliding_window
  keys = [ends[i] - layers.window_start(ends[i] - chunks[i], window) for i in range(p)]
  early_rows = rows_before_hop(config, chunks) if setup.diagonal_first else (0,) * p
  ranks = [rank_work(config, setup, chunks[i], keys[i], early_rows[i]) for i in range(p)]
  hop_tokens = [ends[k] - layers.window_start(ends[k], window) for k in range(p - 1)]
  hop_bytes = [kv_message_bytes(config, n, setup.batch, setup.dtype_bytes) for n in hop_tokens]
  hop_seconds = [hop_bytes[k] / links.link_bandwidth(k) + links.latency for k in range(p - 1)]
  return ranks, hop_bytes, hop_seconds


@dataclasses.dataclass(frozen=True)
class RankWork:
  """One rank's modelled layer: its phases' Work, their seconds on the setup, and the sum."""

  phases: dict
  seconds: dict
  total: Any  # roofline.Work


@kept_cache(8192)
def rank_work(config, setup, c: int, keys: int, early_rows: int) -> RankWork:
  """The `RankWork` of a rank with c queries over `keys` keys (its prefix: keys - c) whose
  first `early_rows` rows attend their diagonal before the hop (`layer_work`). Kept: a
  partition search weighs thousands of splits, and a transfer of tokens between two ranks
  leaves every rank before the donor and after the taker as it was (tiny-llama's modelled
  search on 16 ranks: 1.6 s -> 1.0 s). Its dicts are shared: read them, never change them."""
  kw = work_kwargs(setup)
  window = config.sliding_window
  phases = phase_work(config, c, keys, **kw)
  prefix = keys - c
  if setup.diagonal_first and prefix > 0:
    r = early_rows
    # Before the hop: rows [0, r) of the diagonal, a causal r x r square.
    diagonal = phase_work(config, r, r, **kw)["attention"]
    # The prefix lies wholly before the queries: the keys they see there, on average.
    seen = visible_keys(prefix, c, window) - visible_keys(0, c, window)
    unmasked = dict(kw, causal_skip=False)
    attention = phase_work(config, c, prefix, **unmasked, scored_keys=seen)["attention"]
    if r < c:  # after it: rows [r, c) at the end of the chunk's c keys
      attention = attention + phase_work(config, c - r, c, **kw)["attention"]
    phases = dict(phases, diagonal=diagonal, attention=attention)
  return RankWork(phases, phase_seconds(config, phases, c, setup), total_work(phases))


def hop_chain_steps(qkv, diagonal, attention, rest, hop_seconds) -> tuple[tuple, ...]:
  """Each rank's steps in the program's order, from per-rank seconds: its qkv, its early
  diagonal rows (where it has any), the prefix from rank i-1, the longer prefix on to rank
  i+1 (hop i), then attention and the rest."""
  p = len(qkv)
  ranks = []
  for i in range(p):
    steps = [Compute("qkv", qkv[i])]
    if diagonal[i] > 0:
      steps.append(Compute("diagonal", diagonal[i]))
    if i > 0:
      steps.append(Receive(i - 1))
    if i < p - 1:
      steps.append(Send(i + 1, hop_seconds[i], f"hop{i}"))
    steps += [Compute("attention", attention[i]), Compute("rest", rest[i])]
    ranks.append(tuple(steps))
  return tuple(ranks)


def modelled_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  """Ranks run independently; hop k couples only ranks k and k+1 (`hop_chain_steps`)."""
  del context_len  # sum(chunks)
  ranks, hop_bytes, hop_seconds = layer_work(config, chunks, setup)
  steps = hop_chain_steps(
    *(
      [rank.seconds.get(name, 0.0) for rank in ranks]
      for name in ("qkv", "diagonal", "attention", "rest")
    ),
    hop_seconds,
  )
  totals = [rank.total for rank in ranks]
  return ModelledLayer(
    steps,
    tuple(chunks),
    tuple(w.flops for w in totals),
    tuple(w.bytes for w in totals),
    tuple(float(b) for b in hop_bytes),
  )


STRATEGY = Strategy(
  name="kvr",
  description="KV-Runahead: uneven chunks, point-to-point K,V hop chain, causal skipping",
  partitioned=True,
  attention_kinds=CAUSAL_KERNELS,
  layout=layout,
  arrange=pad_chunks,
  compile=compile_program,
  modelled_layer=modelled_layer,
  timeline_probes=True,
  cache_from_last_hop=whole_prefix_hops,
)
# The per-rank program with every kernel, flash included: the reference the one body was
# measured against (launch.benchmark's kvr-per-rank-* variants); not in the registry.
PER_RANK_STRATEGY = dataclasses.replace(
  STRATEGY,
  name="kvr-per-rank",
  description="KV-Runahead's per-rank switch program (every kernel), for comparisons",
  compile=strategy_compiler("kvr", kvr_body, "flash", body="per-rank"),
)
# The one body on every rank count (the default only above PER_RANK_UP_TO ranks): the
# benchmark's kvr-one-body-* variants.
ONE_BODY_STRATEGY = dataclasses.replace(
  STRATEGY,
  name="kvr-one-body",
  description="KV-Runahead's one-body program (lengths as data) on every rank count",
  compile=strategy_compiler("kvr", kvr_body, "flash", body="one"),
)


SPLIT_AS_DATA = "kvr-split-as-data"


@kept_cache(16)
def _split_as_data_program(graphdef, mesh, shape: OneBodyShape, kernel):
  program = rank_program(
    SPLIT_AS_DATA,
    graphdef,
    one_body_as_data(shape, kernel),
    shape.num_ranks,
    False,
    model_reduce(mesh),
  )
  return spmd(program, mesh, with_table=True)


@kept_cache(64)
def _table_on(mesh, config, shape: OneBodyShape, chunks: tuple[int, ...]):
  """A split's table on every rank of `mesh`, made once per split (not on every call)."""
  return global_array(shape.table(config, chunks), jax.NamedSharding(mesh, jax.P()))


def split_as_data_strategy(config, shape: OneBodyShape) -> Strategy:
  """KV-Runahead on one program for every split of `config`'s model that fits `shape`
  (`OneBodyShape.envelope`): the split is the program's operand and its hops are sized as
  data, so a new split compiles nothing. What the measured search times its candidates on.
  Its parts are `shape.part_len` rows (the envelope's chunk); cache="last" moves them."""

  def layout(context_len: int, num_ranks: int, chunks) -> tuple[int, ...]:
    shape.check_split(tuple(chunks))
    return tuple(chunks)

  def arrange(tokens_BC, chunks):
    tokens_pBc = pad_chunks(tokens_BC, chunks)
    return np.pad(tokens_pBc, ((0, 0), (0, 0), (0, shape.chunk_len - tokens_pBc.shape[2])))

  def compile_program(
    graphdef, mesh, chunks, attention="flash", timeline=False, keep_last_hop=False
  ):
    refuse(SPLIT_AS_DATA, timeline, keep_last_hop)
    program = _split_as_data_program(graphdef, mesh, shape, get_kernel(attention))
    table = _table_on(mesh, config, shape, tuple(chunks))
    return lambda state, tokens_pBc: program(state, tokens_pBc, table)

  return dataclasses.replace(
    STRATEGY,
    name=SPLIT_AS_DATA,
    description="KV-Runahead on one program for every split that fits its shape",
    attention_kinds=tuple(k for k in CAUSAL_KERNELS if get_kernel(k).lengths_as_data),
    layout=layout,
    arrange=arrange,
    compile=compile_program,
    cache_layout=lambda C, chunks: contiguous_layout(chunks, shape.part_len),
    timeline_probes=False,
    cache_from_last_hop=None,
  )
