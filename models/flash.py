"""The flash kernel: online softmax over key blocks, visiting only the blocks some query
sees, with lengths as data (`Lengths`) for inputs padded to one static shape.

Dimension legend as models/attention.py (R = rows of a query block times G)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from models.kernels import KERNELS
from models.masks import MASK_VALUE
from models.sinks import add_sinks


def even_block(length: int, largest: int) -> int:
  """The block size that cuts `length` into as many blocks as `largest` would, but of equal
  size (a multiple of 8): 2588 queries in blocks of at most 512 are 6 blocks of 432 (4 padded
  rows) rather than 5 of 512 and a sixth of 28 padded to 512 (484 wasted rows)."""
  blocks = -(-length // largest)
  size = -(-length // blocks)
  return min(-(-size // 8) * 8, max(length, 1)) if size < length else length


def window_anchor(first_q, window: int | None):
  """Where the flash kernel's key blocks start for a query block whose first query sits at
  `first_q` (maybe traced): 0 without a window, else that query's window start.

  Why not block edges from 0: the keys a windowed query block sees span W + bq - 1
  positions, which blocks counted from 0 cover with one block more, all masked, wherever the
  block's offset is not a block multiple (KV-Runahead's uneven chunks, a prefix of W - 1
  keys). Counted from the window start they take ceil((W + bq - 1) / bk) blocks at any
  offset, the middle ones unmasked."""
  return 0 if window is None else jnp.maximum(first_q - window + 1, 0)


def window_key_block(num_keys: int, largest: int, window: int, query_block: int) -> int:
  """The key block that cuts the span a windowed query block sees, W + bq - 1 keys, into as
  few blocks as `largest` would with the least left over (`even_block` of the span): W=1024
  and 472-row query blocks take 3 blocks of 504 keys, not 3 of 512 plus 1 (or 4 of 496)."""
  return even_block(min(window + query_block - 1, num_keys), largest)


def key_block_bounds(
  first_q, last_q, bk: int, nk: int, num_keys, window: int | None, fewest_keys=None
):
  """The key blocks (of `bk` keys, `nk` of them) that queries at positions [first_q, last_q]
  visit: (lo, full_lo, full_hi, hi), lo <= full_lo <= full_hi <= hi (ints, maybe traced).

  Blocks [lo, hi) hold every key some query sees (none in its future, none before its window
  start q - W + 1, none at or past `num_keys`) and no block that nobody sees; of them,
  [full_lo, full_hi) are seen whole by every query and run unmasked, the rest are masked.
  fewest_keys: where the queries' key ends differ (`Lengths.short_rows`), the
  smallest of them (default num_keys, then the largest): a block past it is masked."""
  fewest_keys = num_keys if fewest_keys is None else fewest_keys
  hi = jnp.clip(jnp.minimum(last_q // bk + 1, -(-num_keys // bk)), 0, nk)
  if window is None:
    lo = jnp.zeros_like(hi)
  else:
    lo = jnp.clip((first_q - window + 1) // bk, 0, hi)
    # Queries whose window starts past the last key see nothing (the rows of a prefix piece
    # beyond the window, KV-Runahead's later rows): no block, not the last one masked whole.
    hi = jnp.where(first_q - window + 1 >= num_keys, lo, hi)
  full_hi = jnp.clip(jnp.minimum((first_q + 1) // bk, fewest_keys // bk), lo, hi)
  if window is None:
    return lo, lo, full_hi, hi
  full_lo = jnp.clip(-((window - 1 - last_q) // bk), lo, full_hi)  # ceil((last_q-W+1)/bk)
  return lo, full_lo, full_hi, hi


class Lengths(NamedTuple):
  """The real extent of inputs padded to one static shape, for a kernel with
  `lengths_as_data` (each length may be traced, so one program serves every extent).

  query_rows: (lo, hi), the only query rows computed (blocks outside come back as out 0, lse
    -inf: a partial that weighs nothing in a merge; rows inside a visited block but outside
    [lo, hi) are computed and are the caller's to ignore).
  key_end: the keys at index >= it do not exist (as if S were key_end).
  short_rows: (rows, end), the query rows below `rows` see only the keys below `end` too
    (rows whose other keys a separate call attends, e.g. a causal diagonal attended before
    the rest of the keys arrived)."""

  query_rows: tuple | None = None
  key_end: Any = None
  short_rows: tuple | None = None


@dataclasses.dataclass(frozen=True)
class _FlashLayout:
  """The queries and keys of one `attend_flash` call laid out in blocks, and what each
  block's walk reads: static sizes, and the positions and lengths (maybe traced)."""

  q_blocks: Any  # [nq, B, K, bq*G, H]: query block i's rows r = t*G + g, under their KV head
  k_BKSH: Any  # keys laid out once, so that every key block is one contiguous slice
  v_BKSH: Any
  bq: int
  bk: int
  nk: int
  G: int
  scale: float
  prescale: bool  # float32 queries are scaled once, lower precision ones score first
  window: int | None
  query_offset: Any
  num_keys: Any  # S, or fewer where the keys are padded (Lengths.key_end)
  short_rows: tuple | None  # (rows, their key end at most num_keys)

  @property
  def row_t(self):
    return jnp.arange(self.bq * self.G) // self.G  # query index inside the block, per row


def attend_flash(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  query_offset,
  *,
  window: int | None = None,
  query_block: int = KERNELS["flash"].query_block,
  key_block: int = KERNELS["flash"].key_block,
  softmax_scale: float | None = None,
  out_dtype=None,
  lengths: Lengths | None = None,
  sinks_N=None,
) -> tuple[jax.Array, jax.Array]:
  """Flash-style attention: returns (out [B, T, N, H] in `out_dtype`, default q's dtype; lse
  [B, T, N] float32). A partial that will be merged keeps float32 (out_dtype=jnp.float32):
  rounding it to bfloat16 first would cost the merge a bfloat16 step.

  Queries in blocks of `query_block` (a `lax.scan`), keys in blocks of `key_block` (a
  `fori_loop` whose bounds come from the block's offset), with a running max m, sum l and
  output o in float32: per key block s = q k^T * scale, m' = max(m, rowmax s),
  o = o e^{m-m'} + e^{s-m'} v, l = l e^{m-m'} + rowsum e^{s-m'}; at the end o / l and
  lse = m + log l. Memory is O(query_block x key_block) per head, and the compiled program does
  not grow with T or S.

  Query t sits at position query_offset + t counted from the first key (the offset may be
  traced). It sees key s iff s <= its position and, with a sliding `window` W, s > its
  position - W. Key blocks nobody in a query block sees (the future, and the past beyond the
  window) are never visited; blocks every query sees whole run unmasked; only the blocks that
  straddle an edge (the diagonal, the window's start, the padded end) are masked. A prefix
  that lies wholly in the past (offset >= S) is attended whole.

  lengths: the real extent of padded inputs as data (`Lengths`): only the query blocks that
  hold its rows are visited (a `fori_loop` whose trip count is data), so padded blocks cost
  nothing.

  sinks_N: each head's sink logit (gpt-oss), added once to the final sum of the rows whose
  own key is among the keys they see here (models.sinks.add_sinks): never per key block.
  """
  lengths = lengths or Lengths()
  B, T, N, H = q_BTNH.shape
  layout = _lay_out(q_BTNH, k_BSKH, v_BSKH, query_offset, window, query_block, key_block, lengths)
  if softmax_scale is not None:
    layout = dataclasses.replace(layout, scale=softmax_scale)
  nq, bq, K, G = layout.q_blocks.shape[0], layout.bq, k_BSKH.shape[2], layout.G
  if lengths.query_rows is None:
    _, (o_blocks, lse_blocks) = jax.lax.scan(
      lambda _, inputs: (None, _attend_query_block(layout, *inputs)),
      None,
      (jnp.arange(nq), layout.q_blocks),
    )
  else:
    o_blocks, lse_blocks = _visit_query_rows(layout, *lengths.query_rows)
  # [nq, B, K, bq*G, H] -> [B, T, N, H]
  out = o_blocks.reshape(nq, B, K, bq, G, H).transpose(1, 0, 3, 2, 4, 5).reshape(B, nq * bq, N, H)
  lse = lse_blocks.reshape(nq, B, K, bq, G).transpose(1, 0, 3, 2, 4).reshape(B, nq * bq, N)
  out, lse = out[:, :T], lse[:, :T]
  if sinks_N is not None:
    out, lse = _add_sinks(out, lse, sinks_N, layout, lengths, T)
  return out.astype(out_dtype or q_BTNH.dtype), lse


def _add_sinks(out_BTNH, lse_BTN, sinks_N, layout: _FlashLayout, lengths: Lengths, T: int):
  """The sinks of the rows that see their own key in this call: inside `query_rows`, their
  position before their key end (the short rows' end, or `num_keys`)."""
  t = jnp.arange(T)
  key_end_T = jnp.broadcast_to(layout.num_keys, (T,))
  if layout.short_rows is not None:
    key_end_T = jnp.where(t < layout.short_rows[0], layout.short_rows[1], key_end_T)
  rows_T = layout.query_offset + t < key_end_T
  if lengths.query_rows is not None:  # rows outside are out 0, lse -inf: they stay so
    rows_T &= (t >= lengths.query_rows[0]) & (t < lengths.query_rows[1])
  return add_sinks(out_BTNH, lse_BTN, sinks_N, rows_T)


def _lay_out(q_BTNH, k_BSKH, v_BSKH, query_offset, window, query_block, key_block, lengths):
  """The blocks of `attend_flash`: equal query and key blocks (`even_block`; with a window the
  key blocks fitted to its span), the queries padded to whole blocks (dropped at the end) and
  the keys padded and masked (positions >= S). With a window the key blocks start at each
  query block's window start (`window_anchor`), up to bk - 1 keys past a block edge: one
  block more of padding keeps every slice in bounds."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G = N // K
  bq = even_block(T, query_block)
  bk = even_block(S, key_block) if window is None else window_key_block(S, key_block, window, bq)
  nq, nk = -(-T // bq), -(-S // bk)
  q_pad = jnp.pad(q_BTNH, ((0, 0), (0, nq * bq - T), (0, 0), (0, 0)))
  key_pad = ((0, 0), (0, nk * bk - S + (0 if window is None else bk)), (0, 0), (0, 0))
  q_blocks = (q_pad.reshape(B, nq, bq, K, G, H).transpose(1, 0, 3, 2, 4, 5)).reshape(
    nq, B, K, bq * G, H
  )
  num_keys = S if lengths.key_end is None else jnp.minimum(lengths.key_end, S)
  short_rows = lengths.short_rows
  if short_rows is not None:
    short_rows = (short_rows[0], jnp.minimum(short_rows[1], num_keys))
  return _FlashLayout(
    q_blocks=q_blocks,
    k_BKSH=jnp.pad(k_BSKH, key_pad).transpose(0, 2, 1, 3),
    v_BKSH=jnp.pad(v_BSKH, key_pad).transpose(0, 2, 1, 3),
    bq=bq,
    bk=bk,
    nk=nk,
    G=G,
    scale=1.0 / math.sqrt(H),
    # q * scale rounded to bfloat16 moves a score of 30 by up to 0.06, and its softmax weight
    # by 6%: lower precision queries score first and scale in float32.
    prescale=jnp.dtype(q_BTNH.dtype) == jnp.float32,
    window=window,
    query_offset=query_offset,
    num_keys=num_keys,
    short_rows=short_rows,
  )


def _attend_query_block(layout: _FlashLayout, i, q_BKRH):
  """Query block i against the key blocks its queries see (`key_block_bounds`): masked walks
  at the edges, an unmasked one between. Returns (out [B, K, R, H], lse [B, K, R]) float32."""
  bq, window, num_keys = layout.bq, layout.window, layout.num_keys
  if layout.prescale:
    q_BKRH = q_BKRH * jnp.asarray(layout.scale, q_BKRH.dtype)
  first_q = layout.query_offset + i * bq  # position of the block's first query
  anchor = window_anchor(first_q, window)  # key blocks are counted from it
  row_key_end = most_keys = fewest_keys = num_keys
  if layout.short_rows is not None:
    # Each row's key end, and the most and the fewest of the block's (the short rows' end is
    # at most num_keys): a block of short rows only, of other rows only, or of both.
    split_row, short_end = layout.short_rows
    row_key_end = jnp.where(i * bq + layout.row_t < split_row, short_end, num_keys)[:, None]
    most_keys = jnp.where(i * bq + bq <= split_row, short_end, num_keys)
    fewest_keys = jnp.where(i * bq < split_row, short_end, num_keys)
  lo, full_lo, full_hi, hi = key_block_bounds(
    first_q - anchor,
    first_q + bq - 1 - anchor,
    layout.bk,
    layout.nk,
    most_keys - anchor,
    window,
    fewest_keys - anchor,
  )
  # Built from q (not from shapes) so that they carry q's type everywhere, also where q
  # varies over a shard_map axis: a loop carry must keep one type.
  zero_BKRH = jnp.zeros_like(q_BKRH, jnp.float32)
  carry = (
    zero_BKRH[..., 0] - jnp.inf,  # running max [B, K, R]
    zero_BKRH[..., 0],  # running sum [B, K, R]
    zero_BKRH,  # running output [B, K, R, H]
  )
  step = functools.partial(_key_block_step, layout, q_BKRH, first_q, anchor, row_key_end)
  carry = jax.lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
  carry = jax.lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
  m, l, o = jax.lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)
  l_safe = jnp.where(l > 0, l, 1.0)
  return o / l_safe[..., None], jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)


def _key_block_step(layout: _FlashLayout, q_BKRH, first_q, anchor, row_key_end, j, carry, masked):
  """One key block j (counted from `anchor`) of a query block's walk: the online softmax
  update of (running max, sum, output); `masked` where the block straddles an edge."""
  m, l, o = carry
  bk, window = layout.bk, layout.window
  k_BKbH = jax.lax.dynamic_slice_in_dim(layout.k_BKSH, anchor + j * bk, bk, axis=2)
  v_BKbH = jax.lax.dynamic_slice_in_dim(layout.v_BKSH, anchor + j * bk, bk, axis=2)
  s_BKRb = jnp.einsum("BKRH,BKbH->BKRb", q_BKRH, k_BKbH, preferred_element_type=jnp.float32)
  if not layout.prescale:
    s_BKRb = s_BKRb * layout.scale
  if masked:
    k_pos = (anchor + j * bk + jnp.arange(bk))[None, :]
    q_pos = (first_q + layout.row_t)[:, None]
    visible = (k_pos <= q_pos) & (k_pos < row_key_end)  # [R, b]
    if window is not None:
      visible &= k_pos > q_pos - window
    s_BKRb = jnp.where(visible, s_BKRb, MASK_VALUE)
  m_new = jnp.maximum(m, s_BKRb.max(axis=-1))
  p_BKRb = jnp.exp(s_BKRb - m_new[..., None])
  # A row that has seen only masked keys so far keeps weight 0 (its m is still -inf or the
  # mask value, and exp(mask - mask) must not count).
  if masked:
    p_BKRb = jnp.where(visible, p_BKRb, 0.0)
  correction = jnp.exp(m - m_new)
  l = l * correction + p_BKRb.sum(axis=-1)
  o = o * correction[..., None] + jnp.einsum(
    "BKRb,BKbH->BKRH", p_BKRb.astype(v_BKbH.dtype), v_BKbH, preferred_element_type=jnp.float32
  )
  return m_new, l, o


def _visit_query_rows(layout: _FlashLayout, lo, hi):
  """Only the query blocks that hold rows [lo, hi) (a trip count that is data); the others
  are out 0, lse -inf."""
  q_blocks, bq = layout.q_blocks, layout.bq
  nq = q_blocks.shape[0]
  first_block = jnp.clip(lo // bq, 0, nq)
  # No rows asked for (hi <= lo): no block, not the one that holds lo.
  last_block = jnp.where(hi > lo, jnp.clip(-(-hi // bq), first_block, nq), first_block)
  zero_blocks = jnp.zeros_like(q_blocks, jnp.float32)  # q's type (see _attend_query_block)

  def visit(i, outputs):
    o_blocks, lse_blocks = outputs
    o, lse = _attend_query_block(layout, i, q_blocks[i])
    return o_blocks.at[i].set(o), lse_blocks.at[i].set(lse)

  return jax.lax.fori_loop(
    first_block, last_block, visit, (zero_blocks, zero_blocks[..., 0] - jnp.inf)
  )
