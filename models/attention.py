"""Attention kernels on arrays: dense (`attend`, `attend_with_lse`), blocked, fused or cuDNN
pieces, the exact merge of partials over disjoint keys, and the dispatch on a kernel record
(`attend_static`, `attend_partial`). The flash kernel is models/flash.py.

Dimension legend: B batch, T query tokens in this slice, S keys in the prefix (cache) the
queries attend to, N query heads, K key/value heads, G = N // K query heads per KV head,
H head dim.

Nothing here knows about devices."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from models.flash import Lengths, attend_flash
from models.kernels import KERNELS, AttentionKernel, get_kernel, kernels_where
from models.masks import MASK_VALUE, causal_mask, window_start
from models.sinks import add_sinks, sees_own_key


def attend_static(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  query_offset: int,
  attention,
  window: int | None = None,
  sinks_N=None,
) -> jax.Array:
  """Causal (optionally sliding-window) attention at a static offset with the kernel
  `attention` (a models.kernels record or its name). window=W: query q sees keys s with
  q - W < s <= q (Mistral's convention). sinks_N: each head's learned sink logit (gpt-oss,
  `add_sinks`), or None."""
  kernel = get_kernel(attention)
  _check_window(kernel, window)
  if kernel.computes == "blocked":
    return attend_blocked(
      q_BTNH, k_BSKH, v_BSKH, query_offset, kernel.query_block, window=window, sinks_N=sinks_N
    )
  if kernel.returns_lse:  # flash, two-piece: their float32 partial, cast as the queries
    out, _ = attend_partial(q_BTNH, k_BSKH, v_BSKH, query_offset, kernel, window, sinks_N=sinks_N)
    return out.astype(q_BTNH.dtype)
  return attend(q_BTNH, k_BSKH, v_BSKH, query_offset, window=window, sinks_N=sinks_N)


def attend_partial(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  query_offset: int,
  attention,
  window: int | None = None,
  lengths: Lengths | None = None,
  sinks_N=None,
) -> tuple[jax.Array, jax.Array]:
  """Like `attend_static`, for the kernels that return their log-sum-exp (`returns_lse`),
  so that attentions over disjoint key sets merge exactly (`merge_partials`): returns (out
  [B, T, N, H] float32, lse [B, T, N] float32). A key set wholly in the past of every query
  (query_offset >= S) is attended unmasked. lengths: the real extent of padded inputs as
  data (`flash.Lengths`), for the kernels with `lengths_as_data`. sinks_N: as `add_sinks`
  (only the rows whose own key is among these keys take theirs, so partials still merge)."""
  kernel = get_kernel(attention)
  if not kernel.returns_lse:
    raise ValueError(
      f"attention {kernel.name!r} returns no log-sum-exp; expected one of "
      f"{kernels_where(returns_lse=True)}"
    )
  if lengths is not None and not kernel.lengths_as_data:
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
      lengths=lengths,
      sinks_N=sinks_N,
    )
  out, lse = attend_fused(q_BTNH, k_BSKH, v_BSKH, query_offset, kernel.implementation)
  if sinks_N is None:
    return out, lse
  return add_sinks(out, lse, sinks_N, sees_own_key(q_BTNH.shape[1], query_offset, k_BSKH.shape[1]))


def _check_window(kernel: AttentionKernel, window: int | None) -> None:
  if window is not None and not kernel.takes_window:
    raise ValueError(
      f"attention {kernel.name!r} takes no sliding window; use one of "
      f"{kernels_where(takes_window=True)}"
    )


def attend(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  query_offset,
  *,
  window: int | None = None,
  softmax_scale: float | None = None,
  sinks_N=None,
) -> jax.Array:
  """Causal attention of T queries to an S-key prefix; returns [B, T, N, H] in q's dtype.

  The queries sit at positions query_offset + [0, T) counted from the first key; with a
  sliding `window` W each sees at most its W latest keys (itself included). Grouped-query
  attention is done by folding the N query heads into [K, G] so that the K key/value heads
  are never repeated.
  Scores and softmax are in float32 whatever the input dtype. sinks_N: as `add_sinks`.
  """
  out, _ = attend_with_lse(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    query_offset,
    window=window,
    softmax_scale=softmax_scale,
    sinks_N=sinks_N,
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
  sinks_N=None,
) -> tuple[jax.Array, jax.Array]:
  """`attend` that also returns the log-sum-exp: (out [B, T, N, H] float32, lse [B, T, N]
  float32), so that attentions over disjoint key sets merge exactly (`merge_partials`).
  `query_offset` and `num_valid_keys` may be per row ([B], see `causal_mask`); a row whose
  keys are all masked gets a finite lse near the mask value, so it weighs 0 in a merge.
  sinks_N: as `add_sinks`, for the rows whose own key is among the valid keys."""
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
  scores_BKGTS = jnp.where(mask, scores_BKGTS, MASK_VALUE)
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
  out_BTNH, lse_BTN = out_BTKGH.reshape(B, T, N, H), lse_BTKG.reshape(B, T, N)
  if sinks_N is None:
    return out_BTNH, lse_BTN
  key_end = S if num_valid_keys is None else jnp.minimum(jnp.asarray(num_valid_keys), S)
  return add_sinks(out_BTNH, lse_BTN, sinks_N, sees_own_key(T, query_offset, key_end))


def attend_blocked(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  query_offset: int,
  block_size: int,
  *,
  window: int | None = None,
  softmax_scale: float | None = None,
  sinks_N=None,
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
    return attend(
      q_BTNH, k_BSKH, v_BSKH, query_offset, softmax_scale=softmax_scale, sinks_N=sinks_N
    )
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
        sinks_N=sinks_N,  # per row, as any call: a row whose own key is given
      )
    )
  return jnp.concatenate(outputs, axis=1)


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
