"""Pure per-layer maths shared by every model and every parallel strategy.

Dimension legend: B batch, T query tokens in this slice, S keys in the prefix (cache) the
queries attend to, N query heads, K key/value heads, G = N // K query heads per KV head,
H head dim, D model dim.

Nothing here knows about devices. Positions are absolute token indices, so the same code
computes a whole prompt, one rank's chunk of it, or one decode step.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.config import RopeConfig
from models.kernels import KERNELS, AttentionKernel, get_kernel, kernels_where

# A large finite negative rather than -inf: a fully masked row (a padded query) then gives a
# uniform softmax instead of NaNs that would poison reductions downstream.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def attend_static(
  q_BTNH, k_BSKH, v_BSKH, query_offset: int, attention, window: int | None = None
) -> jax.Array:
  """Causal (optionally sliding-window) attention at a static offset with the kernel
  `attention` (a models.kernels record or its name). window=W: query q sees keys s with
  q - W < s <= q (Mistral's convention)."""
  kernel = get_kernel(attention)
  _check_window(kernel, window)
  if kernel.computes == "blocked":
    return attend_blocked(q_BTNH, k_BSKH, v_BSKH, query_offset, kernel.query_block, window=window)
  if kernel.returns_lse:  # flash, two-piece: their float32 partial, cast as the queries
    out, _ = attend_partial(q_BTNH, k_BSKH, v_BSKH, query_offset, kernel, window)
    return out.astype(q_BTNH.dtype)
  return attend(q_BTNH, k_BSKH, v_BSKH, query_offset, window=window)


def attend_partial(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  query_offset: int,
  attention,
  window: int | None = None,
  query_rows=None,
  key_end=None,
  first_rows_key_end=None,
) -> tuple[jax.Array, jax.Array]:
  """Like `attend_static`, for the kernels that return their log-sum-exp (`returns_lse`),
  so that attentions over disjoint key sets merge exactly (`merge_partials`): returns (out
  [B, T, N, H] float32, lse [B, T, N] float32). A key set wholly in the past of every query
  (query_offset >= S) is attended unmasked. query_rows, key_end: lengths as data, for the
  kernels with `lengths_as_data` (see `attend_flash`), as is first_rows_key_end."""
  kernel = get_kernel(attention)
  if not kernel.returns_lse:
    raise ValueError(
      f"attention {kernel.name!r} returns no log-sum-exp; expected one of "
      f"{kernels_where(returns_lse=True)}"
    )
  as_data = (query_rows, key_end, first_rows_key_end)
  if any(x is not None for x in as_data) and not kernel.lengths_as_data:
    raise ValueError(
      f"attention {kernel.name!r} takes static lengths only; use one of "
      f"{kernels_where(lengths_as_data=True)}"
    )
  _check_window(kernel, window)
  if kernel.computes == "flash":
    return attend_flash(
      q_BTNH,
      k_BSKH,
      v_BSKH,
      query_offset,
      window=window,
      query_block=kernel.query_block,
      key_block=kernel.key_block,
      out_dtype=jnp.float32,
      query_rows=query_rows,
      key_end=key_end,
      first_rows_key_end=first_rows_key_end,
    )
  return attend_fused(q_BTNH, k_BSKH, v_BSKH, query_offset, kernel.implementation)


def _check_window(kernel: AttentionKernel, window: int | None) -> None:
  if window is not None and not kernel.takes_window:
    raise ValueError(
      f"attention {kernel.name!r} takes no sliding window; use one of "
      f"{kernels_where(takes_window=True)}"
    )


def window_start(first_query: int, window: int | None) -> int:
  """The first key position any query at or after `first_query` can see (0 without a window)."""
  return 0 if window is None else max(0, first_query - window + 1)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in float32 (as Hugging Face Llama does), cast back to the input dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return scale * x32.astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
  """LayerNorm with statistics in float32."""
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps)
  return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
  """Inverse frequencies [H/2] of rotary embeddings, with linear, llama3 or yarn scaling.

  Computed in numpy at trace time: they are constants of the model.
  """
  inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if rope.type == "linear":
    inv_freq = inv_freq / rope.factor
  elif rope.type == "llama3":
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
      rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    inv_freq = np.where(is_medium, smoothed, scaled)
  elif rope.type == "yarn":
    inv_freq = _yarn_inv_freq(head_dim, rope)
  return inv_freq.astype(np.float32)


def _yarn_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
  """YaRN's frequencies (transformers' `_compute_yarn_parameters`, in float32 as it computes
  them): dimension pairs that turn more than beta_fast times over the original context keep
  their frequency, fewer than beta_slow times are divided by `factor`, a linear ramp between."""
  base, dim, original = rope.theta, head_dim, rope.original_max_position_embeddings

  def correction_dim(rotations: float) -> float:  # the pair that turns `rotations` times
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
  if rope.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # no division by zero (as transformers does)
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  keep = (1 - ramp).astype(np.float32)  # 1: the pair's own frequency, 0: interpolated
  pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
  extrapolated = np.float32(1.0) / pos_freqs
  interpolated = np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)
  return interpolated * (1 - keep) + extrapolated * keep


def apply_rope(x_BTnH: jax.Array, positions_BT: jax.Array, rope: RopeConfig) -> jax.Array:
  """Rotates query or key heads by their absolute positions (Hugging Face `rotate_half` form).

  x: [B, T, n, H] for any head count n; positions: [B, T] int.
  """
  head_dim = x_BTnH.shape[-1]
  inv_freq = jnp.asarray(rope_inv_freq(head_dim, rope))
  angles_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq
  angles_BTH = jnp.concatenate([angles_BTh, angles_BTh], axis=-1)
  # YaRN scales cos and sin (so every score by its square); 1 for every other type.
  scaling = rope.attention_scaling
  cos = jnp.cos(angles_BTH)[:, :, None, :] * scaling
  sin = jnp.sin(angles_BTH)[:, :, None, :] * scaling
  x32 = x_BTnH.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * cos + rotated * sin).astype(x_BTnH.dtype)


def causal_mask(
  num_queries: int, num_keys: int, query_offset, window=None, num_valid_keys=None
) -> jax.Array:
  """[T, S] bool: query t (position query_offset + t) may see key s iff s <= that position
  and, with a sliding window W, s > that position - W.

  Positions are relative to the first key given, so a caller that slices keys [a, b) passes
  query_offset - a: causality and windows depend only on differences of positions. With
  query_offset = S - T this is the usual lower-triangular block at the end of the prefix;
  keys past the last query's position are masked, which is also what hides the unused tail of
  a preallocated decode cache.

  Ragged rows (prompts of different lengths padded to one shape): `query_offset` may be [B],
  one offset per row, and `num_valid_keys` ([B] or a scalar) masks the keys at index >= it
  (a row's padding); the mask is then [B, T, S].
  """
  q_pos = jnp.asarray(query_offset)[..., None, None] + jnp.arange(num_queries)[:, None]
  k_pos = jnp.arange(num_keys)
  visible = k_pos <= q_pos
  if window is not None:
    visible &= k_pos > q_pos - window
  if num_valid_keys is not None:
    visible &= k_pos < jnp.asarray(num_valid_keys)[..., None, None]
  return visible


def attend(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  query_offset,
  *,
  window: int | None = None,
  softmax_scale: float | None = None,
) -> jax.Array:
  """Causal attention of T queries to an S-key prefix; returns [B, T, N, H] in q's dtype.

  The queries sit at positions query_offset + [0, T) counted from the first key; with a
  sliding `window` W each sees at most its W latest keys (itself included). Grouped-query
  attention is done by folding the N query heads into [K, G] so that the K key/value heads
  are never repeated.
  Scores and softmax are in float32 whatever the input dtype.
  """
  out, _ = attend_with_lse(
    q_BTNH, k_BSKH, v_BSKH, query_offset, window=window, softmax_scale=softmax_scale
  )
  return out.astype(q_BTNH.dtype)


def attend_with_lse(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  query_offset,
  *,
  window: int | None = None,
  softmax_scale: float | None = None,
  num_valid_keys=None,
) -> tuple[jax.Array, jax.Array]:
  """`attend` that also returns the log-sum-exp: (out [B, T, N, H] float32, lse [B, T, N]
  float32), so that attentions over disjoint key sets merge exactly (`merge_partials`).
  `query_offset` and `num_valid_keys` may be per row ([B], see `causal_mask`); a row whose
  keys are all masked gets a finite lse near the mask value, so it weighs 0 in a merge."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G = N // K
  scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(H)
  q_BTKGH = q_BTNH.reshape(B, T, K, G, H)
  scores_BKGTS = (
    jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32) * scale
  )
  mask = causal_mask(T, S, query_offset, window, num_valid_keys)
  if mask.ndim == 3:  # per row: [B, T, S] -> [B, 1, 1, T, S]
    mask = mask[:, None, None]
  scores_BKGTS = jnp.where(mask, scores_BKGTS, _MASK_VALUE)
  # Softmax with the normalisation deferred to the [T, H] output: one pass fewer over the
  # [T, S] scores than normalising the probabilities themselves.
  max_BKGT1 = jnp.max(scores_BKGTS, axis=-1, keepdims=True)
  unnormalised_BKGTS = jnp.exp(scores_BKGTS - max_BKGT1)
  denominator_BTKG = jnp.einsum("BKGTS->BTKG", unnormalised_BKGTS)
  out_BTKGH = jnp.einsum(
    "BKGTS,BSKH->BTKGH",
    unnormalised_BKGTS.astype(v_BSKH.dtype),
    v_BSKH,
    preferred_element_type=jnp.float32,
  )
  out_BTKGH = out_BTKGH / denominator_BTKG[..., None]
  lse_BTKG = jnp.einsum("BKGT->BTKG", max_BKGT1[..., 0]) + jnp.log(denominator_BTKG)
  return out_BTKGH.reshape(B, T, N, H), lse_BTKG.reshape(B, T, N)


def attend_blocked(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  query_offset: int,
  block_size: int,
  *,
  window: int | None = None,
  softmax_scale: float | None = None,
) -> jax.Array:
  """`attend` that skips the masked-out future: queries in static blocks of `block_size`, each
  attending only to the keys up to its last query's position.

  The offset must be static (a Python int). For T queries over S = offset + T keys this costs
  T * offset + about T^2 / 2 score entries instead of T * S, and never materialises the whole
  [T, S] score matrix. Same results as `attend` (each block still sees all of its keys). With
  a sliding window each block also starts at the first key its first query sees.
  """
  T, S = q_BTNH.shape[1], k_BSKH.shape[1]
  if T <= block_size and window is None:
    return attend(q_BTNH, k_BSKH, v_BSKH, query_offset, softmax_scale=softmax_scale)
  outputs = []
  for start in range(0, T, block_size):
    stop = min(start + block_size, T)
    visible = min(query_offset + stop, S)  # keys past the block's last query are all masked
    first = min(window_start(query_offset + start, window), visible)
    outputs.append(
      attend(
        q_BTNH[:, start:stop],
        k_BSKH[:, first:visible],
        v_BSKH[:, first:visible],
        query_offset + start - first,
        window=window,
        softmax_scale=softmax_scale,
      )
    )
  return jnp.concatenate(outputs, axis=1)


# --- flash attention: online softmax over key blocks, mergeable partials --------------------


def merge_partials(out1_BTNH, lse1_BTN, out2_BTNH, lse2_BTN):
  """Combines two attentions of the same queries over disjoint key sets, exactly.

  out = (e^{l1-m} o1 + e^{l2-m} o2) / (e^{l1-m} + e^{l2-m}), lse = m + log(e^{l1-m} + e^{l2-m})
  with m = max(l1, l2), in float32 (bf16 partials drift). A partial that saw no key has
  lse = -inf and weight 0. Returns (out float32 [B, T, N, H], lse float32 [B, T, N]).
  """
  lse1, lse2 = lse1_BTN.astype(jnp.float32), lse2_BTN.astype(jnp.float32)
  m = jnp.maximum(lse1, lse2)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)
  total = w1 + w2
  out = (w1[..., None] * out1_BTNH.astype(jnp.float32) + w2[..., None] * out2_BTNH) / jnp.where(
    total > 0, total, 1.0
  )[..., None]
  return out, m + jnp.log(total)


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
  fewest_keys: where the queries' key ends differ (`attend_flash`'s first_rows_key_end), the
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
  query_rows=None,
  key_end=None,
  first_rows_key_end=None,
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

  Lengths as data (one program for inputs padded to one shape, KV-Runahead's one body):
  `key_end` (may be traced) hides the keys at index >= it, as if S were key_end; `query_rows`
  = (lo, hi) (may be traced) computes only the query blocks that hold rows [lo, hi): a
  `fori_loop` whose trip count is data, so padded blocks cost nothing. Rows of blocks outside
  it come back as out 0, lse -inf (a partial that weighs nothing in a merge); rows inside a
  visited block but outside [lo, hi) are computed and are the caller's to ignore.
  `first_rows_key_end` = (rows, end) (may be traced): query rows below `rows` see only the
  keys below `end` too (KV-Runahead's early rows, whose own keys were attended before the
  hop: one call attends their prefix and the other rows' prefix and diagonal).
  """
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G = N // K
  scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(H)
  bq = even_block(T, query_block)
  bk = even_block(S, key_block) if window is None else window_key_block(S, key_block, window, bq)
  nq, nk = -(-T // bq), -(-S // bk)
  # Padded queries are dropped at the end; padded keys (at positions >= S) are masked. With a
  # window the key blocks start at each query block's window start (`window_anchor`), up to
  # bk - 1 keys past a block edge: one block more of padding keeps every slice in bounds.
  q_pad = jnp.pad(q_BTNH, ((0, 0), (0, nq * bq - T), (0, 0), (0, 0)))
  key_pad = ((0, 0), (0, nk * bk - S + (0 if window is None else bk)), (0, 0), (0, 0))
  # Keys laid out once: [B, K, S, H], so every key block is one contiguous slice.
  k_BKSH = jnp.pad(k_BSKH, key_pad).transpose(0, 2, 1, 3)
  v_BKSH = jnp.pad(v_BSKH, key_pad).transpose(0, 2, 1, 3)
  # [nq, B, K, bq*G, H]: query block i's rows r = t*G + g, grouped under their KV head
  q_blocks = (q_pad.reshape(B, nq, bq, K, G, H).transpose(1, 0, 3, 2, 4, 5)).reshape(
    nq, B, K, bq * G, H
  )
  row_t = jnp.arange(bq * G) // G  # query index inside the block, per row
  # The keys that exist: S, or fewer where the caller's are padded (key_end, maybe traced).
  num_keys = S if key_end is None else jnp.minimum(key_end, S)
  if first_rows_key_end is not None:  # each query row's key end: the first rows' own, or S'
    split_row, first_rows_end = first_rows_key_end
    first_rows_end = jnp.minimum(first_rows_end, num_keys)

  # float32 queries are scaled once (one multiply per query, not per score); lower precision
  # ones score first and scale in float32: q * scale rounded to bfloat16 moves a score of 30 by
  # up to 0.06, and its softmax weight by 6%.
  prescale = jnp.dtype(q_BTNH.dtype) == jnp.float32

  def query_block_fn(_, inputs):
    i, q_BKRH = inputs
    if prescale:
      q_BKRH = q_BKRH * jnp.asarray(scale, q_BKRH.dtype)
    first_q = query_offset + i * bq  # position of the block's first query
    last_q = first_q + bq - 1
    anchor = window_anchor(first_q, window)  # key blocks are counted from it
    row_key_end = most_keys = fewest_keys = num_keys
    if first_rows_key_end is not None:
      # Each row's key end, and the most and the fewest of the block's (first_rows_end is at
      # most num_keys): a block of first rows only, of other rows only, or of both.
      row_key_end = jnp.where(i * bq + row_t < split_row, first_rows_end, num_keys)[:, None]
      most_keys = jnp.where(i * bq + bq <= split_row, first_rows_end, num_keys)
      fewest_keys = jnp.where(i * bq < split_row, first_rows_end, num_keys)
    lo, full_lo, full_hi, hi = key_block_bounds(
      first_q - anchor, last_q - anchor, bk, nk, most_keys - anchor, window, fewest_keys - anchor
    )
    # Built from q (not from shapes) so that they carry q's type everywhere, also where q
    # varies over a shard_map axis: a loop carry must keep one type.
    zero_BKRH = jnp.zeros_like(q_BKRH, jnp.float32)
    init = (
      zero_BKRH[..., 0] - jnp.inf,  # running max [B, K, R]
      zero_BKRH[..., 0],  # running sum [B, K, R]
      zero_BKRH,  # running output [B, K, R, H]
    )

    def key_block_fn(j, carry, masked: bool):
      m, l, o = carry
      k_BKbH = jax.lax.dynamic_slice_in_dim(k_BKSH, anchor + j * bk, bk, axis=2)
      v_BKbH = jax.lax.dynamic_slice_in_dim(v_BKSH, anchor + j * bk, bk, axis=2)
      s_BKRb = jnp.einsum("BKRH,BKbH->BKRb", q_BKRH, k_BKbH, preferred_element_type=jnp.float32)
      if not prescale:
        s_BKRb = s_BKRb * scale
      if masked:
        k_pos = (anchor + j * bk + jnp.arange(bk))[None, :]
        q_pos = (first_q + row_t)[:, None]
        visible = (k_pos <= q_pos) & (k_pos < row_key_end)  # [R, b]
        if window is not None:
          visible &= k_pos > q_pos - window
        s_BKRb = jnp.where(visible, s_BKRb, _MASK_VALUE)
      m_new = jnp.maximum(m, s_BKRb.max(axis=-1))
      p_BKRb = jnp.exp(s_BKRb - m_new[..., None])
      # A row that has seen only masked keys so far keeps weight 0 (its m is still -inf or
      # the mask value, and exp(mask - mask) must not count).
      if masked:
        p_BKRb = jnp.where(visible, p_BKRb, 0.0)
      correction = jnp.exp(m - m_new)
      l = l * correction + p_BKRb.sum(axis=-1)
      o = o * correction[..., None] + jnp.einsum(
        "BKRb,BKbH->BKRH", p_BKRb.astype(v_BKbH.dtype), v_BKbH, preferred_element_type=jnp.float32
      )
      return m_new, l, o

    masked = functools.partial(key_block_fn, masked=True)
    unmasked = functools.partial(key_block_fn, masked=False)
    carry = jax.lax.fori_loop(lo, full_lo, masked, init)
    carry = jax.lax.fori_loop(full_lo, full_hi, unmasked, carry)
    m, l, o = jax.lax.fori_loop(full_hi, hi, masked, carry)
    l_safe = jnp.where(l > 0, l, 1.0)
    return None, (o / l_safe[..., None], jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf))

  if query_rows is None:
    _, (o_blocks, lse_blocks) = jax.lax.scan(query_block_fn, None, (jnp.arange(nq), q_blocks))
  else:  # only the blocks that hold rows [lo, hi): a trip count that is data
    lo, hi = query_rows
    first_block = jnp.clip(lo // bq, 0, nq)
    # No rows asked for (hi <= lo): no block, not the one that holds lo.
    last_block = jnp.where(hi > lo, jnp.clip(-(-hi // bq), first_block, nq), first_block)
    zero_blocks = jnp.zeros_like(q_blocks, jnp.float32)  # q's type (see query_block_fn)

    def visit(i, outputs):
      o_blocks, lse_blocks = outputs
      _, (o, lse) = query_block_fn(None, (i, q_blocks[i]))
      return o_blocks.at[i].set(o), lse_blocks.at[i].set(lse)

    o_blocks, lse_blocks = jax.lax.fori_loop(
      first_block, last_block, visit, (zero_blocks, zero_blocks[..., 0] - jnp.inf)
    )
  # [nq, B, K, bq*G, H] -> [B, T, N, H]
  out = o_blocks.reshape(nq, B, K, bq, G, H).transpose(1, 0, 3, 2, 4, 5).reshape(B, nq * bq, N, H)
  lse = lse_blocks.reshape(nq, B, K, bq, G).transpose(1, 0, 3, 2, 4).reshape(B, nq * bq, N)
  return out[:, :T].astype(out_dtype or q_BTNH.dtype), lse[:, :T]


try:  # cuDNN's fused attention with its float32 softmax statistics (see _cudnn_piece)
  from jax._src.cudnn import fused_attention_stablehlo as _cudnn_attention
except ImportError:  # a JAX without it: attention="cudnn" says so when it is asked for
  _cudnn_attention = None


def _cudnn_piece(q_BTNH, k_BSKH, v_BSKH, is_causal: bool):
  """cuDNN's fused flash attention (causal mask aligned at the top left): (out in q's dtype,
  lse [B, T, N] float32).

  Why the private entry point: `jax.nn.dot_product_attention(return_residual=True)` casts
  cuDNN's float32 softmax statistics to the inputs' dtype, and a bfloat16 log-sum-exp (steps
  of 0.125 at lse in [16, 32)) weighs merged pieces up to ~6% wrong.
  """
  if _cudnn_attention is None:
    raise ValueError(f"attention 'cudnn' needs JAX's cuDNN attention (jax {jax.__version__})")
  dtypes = KERNELS["cudnn"].dtypes
  if jnp.dtype(q_BTNH.dtype).name not in dtypes:
    raise ValueError(
      f"attention 'cudnn' takes {dtypes} inputs, not {jnp.dtype(q_BTNH.dtype).name}; "
      "use 'flash' (or load the model in bfloat16)"
    )
  mask = _cudnn_attention.MaskType
  out, stats_BNT = _cudnn_attention.dot_product_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    scale=1.0 / math.sqrt(q_BTNH.shape[-1]),
    mask_type=mask.CAUSAL if is_causal else mask.NO_MASK,
    return_residual=True,
  )
  return out, jnp.einsum("BNT->BTN", stats_BNT).astype(jnp.float32)


def _fused_piece(q_BTNH, k_BSKH, v_BSKH, is_causal: bool, implementation: str):
  """One piece of `attend_fused`: all keys visible, or causal with the queries and keys
  starting at the same position. (out, lse float32)."""
  if implementation == "cudnn":
    return _cudnn_piece(q_BTNH, k_BSKH, v_BSKH, is_causal)
  if implementation != "xla":
    raise ValueError(f"unknown implementation {implementation!r}; expected 'xla' or 'cudnn'")
  # XLA's maths (what jax.nn.dot_product_attention runs there), with a float32 lse.
  return attend_with_lse(q_BTNH, k_BSKH, v_BSKH, 0 if is_causal else k_BSKH.shape[1])


def attend_fused(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  query_offset: int,
  implementation: str = "xla",
) -> tuple[jax.Array, jax.Array]:
  """Causal attention at a static offset as fused-attention pieces whose causal mask is
  aligned at the top left: the rectangle splits into the unmasked prefix [0, offset) and the
  causal diagonal square [offset, offset + T), merged by their float32 log-sum-exp.
  `implementation`: "xla" or "cudnn" (cuDNN's fused flash kernel, NVIDIA GPUs).
  Returns (out [B, T, N, H] float32, lse [B, T, N] float32).
  """
  T, S = q_BTNH.shape[1], k_BSKH.shape[1]
  if query_offset >= S:  # a prefix wholly in every query's past: one unmasked piece
    out, lse = _fused_piece(q_BTNH, k_BSKH, v_BSKH, False, implementation)
    return out.astype(jnp.float32), lse
  if S < query_offset + T:
    raise ValueError(
      f"attend_fused needs the keys of every query: S={k_BSKH.shape[1]} < offset + T = "
      f"{query_offset + T}"
    )
  diagonal = slice(query_offset, query_offset + T)
  diag_out, diag_lse = _fused_piece(
    q_BTNH, k_BSKH[:, diagonal], v_BSKH[:, diagonal], True, implementation
  )
  if query_offset == 0:
    return diag_out.astype(jnp.float32), diag_lse
  prefix_out, prefix_lse = _fused_piece(
    q_BTNH, k_BSKH[:, :query_offset], v_BSKH[:, :query_offset], False, implementation
  )
  return merge_partials(prefix_out, prefix_lse, diag_out, diag_lse)


# --- mixture of experts -----------------------------------------------------------------------

# Rows per tile of the experts' grouped matmul: every (token, expert) pair is laid out in its
# expert's run of rows, each run padded to whole tiles, and one tile is one expert's matmul.
EXPERT_TILE = 128


def mixture_of_experts(
  h_BTD, router_DE, w_gate_EDF, w_up_EDF, w_down_EFD, top_k: int, normalize: bool
) -> jax.Array:
  """A mixture of SwiGLU experts, every token through its `top_k` experts, no token dropped.

  The router's softmax is in float32 over all E experts; the top k are kept (renormalised
  over themselves when `normalize`), as transformers' Qwen3-MoE and Mixtral routers compute.
  FLOPs follow the active experts: the T k (token, expert) pairs are sorted by expert, each
  expert's run padded to whole tiles of EXPERT_TILE rows, and a loop whose trip count is the
  number of tiles in use runs one [tile, D] x [D, F] matmul of one expert per step (at most
  E - 1 padded rows per expert run; `jax.lax.ragged_dot` computes every expert for every row
  on CPU). Returns [B, T, D] in h's dtype.
  """
  B, T, D = h_BTD.shape
  E = router_DE.shape[-1]
  h_SD = h_BTD.reshape(B * T, D)  # S = B T tokens
  logits_SE = jnp.einsum("SD,DE->SE", h_SD, router_DE).astype(jnp.float32)
  weights_Sk, experts_Sk = jax.lax.top_k(jax.nn.softmax(logits_SE, axis=-1), top_k)
  if normalize:
    weights_Sk = weights_Sk / weights_Sk.sum(axis=-1, keepdims=True)
  rows, tile = expert_rows(experts_Sk.reshape(-1), E, EXPERT_TILE)
  pairs = experts_Sk.size  # P = S k (token, expert) pairs
  token_P = jnp.arange(pairs) // top_k
  x_RD = jnp.zeros((rows.num_rows, D), h_SD.dtype).at[rows.row_P].set(h_SD[token_P])

  def one_tile(t, y_RD):
    x_tD = jax.lax.dynamic_slice_in_dim(x_RD, t * tile, tile)
    e = rows.expert_of_tile[t]
    gate_tF = jax.nn.silu(x_tD @ w_gate_EDF[e])
    y_tD = (gate_tF * (x_tD @ w_up_EDF[e])) @ w_down_EFD[e]
    return jax.lax.dynamic_update_slice_in_dim(y_RD, y_tD.astype(y_RD.dtype), t * tile, axis=0)

  y_RD = jax.lax.fori_loop(0, rows.tiles_used, one_tile, jnp.zeros_like(x_RD))
  weighted_PD = y_RD[rows.row_P] * weights_Sk.reshape(-1)[:, None].astype(y_RD.dtype)
  out_SD = jnp.zeros_like(h_SD).at[token_P].add(weighted_PD)
  return out_SD.reshape(B, T, D)


class ExpertRows(NamedTuple):
  """Where each (token, expert) pair sits in the experts' tiled rows (see `expert_rows`)."""

  row_P: jax.Array  # each pair's row
  expert_of_tile: jax.Array  # each tile's expert
  tiles_used: jax.Array  # tiles holding some pair (data: the loop's trip count)
  num_rows: int  # rows allocated (static)


def expert_rows(expert_P, num_experts: int, max_tile: int) -> tuple[ExpertRows, int]:
  """Pairs sorted by expert, each expert's run padded to whole tiles: each pair's row, each
  tile's expert, the tiles in use (data) and the rows allocated (static: enough for any
  routing, P/tile + E tiles). The tile is `max_tile` or, for few pairs, P rounded up to 8."""
  pairs = expert_P.shape[0]
  tile = min(max_tile, -(-pairs // 8) * 8)
  counts_E = jnp.zeros(num_experts, jnp.int32).at[expert_P].add(1)
  tiles_E = -(-counts_E // tile)
  first_tile_E = jnp.cumsum(tiles_E) - tiles_E
  first_pair_E = jnp.cumsum(counts_E) - counts_E
  order_P = jnp.argsort(expert_P, stable=True)
  sorted_expert_P = expert_P[order_P]
  rank_in_run = jnp.arange(pairs) - first_pair_E[sorted_expert_P]
  row_sorted = first_tile_E[sorted_expert_P] * tile + rank_in_run
  row_P = jnp.zeros(pairs, jnp.int32).at[order_P].set(row_sorted)
  num_tiles = -(-pairs // tile) + num_experts
  tile_ends_E = jnp.cumsum(tiles_E)
  expert_of_tile = jnp.searchsorted(tile_ends_E, jnp.arange(num_tiles), side="right")
  expert_of_tile = jnp.minimum(expert_of_tile, num_experts - 1)
  return ExpertRows(row_P, expert_of_tile, tile_ends_E[-1], num_tiles * tile), tile
