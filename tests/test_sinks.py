"""Attention sinks (gpt-oss, models/sinks.py) in every kernel: each equals transformers'
formulation (the sink a last logit column of the softmax, dropped after it), and attention
split over key sets (a prefix and a diagonal, padded lengths as data, a decode step's parts)
merges to the same result: the sink enters each query's sum once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import attend_partial, attend_static, attend_with_lse, merge_partials
from models.flash import Lengths, attend_flash
from models.kernels import KERNELS, get_kernel

TOL = 1e-5  # float32 kernels against each other and the reference


def reference(q, k, v, offset: int, window, sinks):
  """transformers' eager gpt-oss attention in float64: scores, causal (window) mask, the sink
  appended as a last column, softmax, the sink's column dropped."""
  q, k, v, sinks = (np.asarray(a, np.float64) for a in (q, k, v, sinks))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
  scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
  q_pos = offset + np.arange(T)[:, None]
  k_pos = np.arange(S)[None, :]
  visible = k_pos <= q_pos
  if window is not None:
    visible &= k_pos > q_pos - window
  scores = np.where(visible, scores, -np.inf)
  column = np.broadcast_to(sinks[None, :, None, None], (B, N, T, 1))
  logits = np.concatenate([scores, column], axis=-1)
  probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
  probs = probs / probs.sum(axis=-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", probs[..., :-1], v)


def inputs(T=37, S=None, N=4, K=2, H=8, B=2, seed=0):
  S = T if S is None else S
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, S, K, H)).astype(np.float32)
  v = rng.standard_normal((B, S, K, H)).astype(np.float32)
  sinks = (2.0 * rng.standard_normal(N)).astype(np.float32)  # some larger than the scores
  return q, k, v, sinks


def small_blocks(name):
  """The kernel with blocks smaller than the inputs, so that its block logic is exercised."""
  kernel = KERNELS[name]
  if kernel.computes == "flash":
    return kernel.__class__("flash-small", "flash", query_block=8, key_block=8)
  if kernel.computes == "blocked":
    return kernel.__class__("blocked-small", "blocked", query_block=8)
  return kernel


XLA_KERNELS = ("dense", "blocked", "flash", "fused")


# Every kernel without a window, and with one each kernel that takes a window (fused does not).
@pytest.mark.default_cases("flash-None", "fused-None", "dense-5", "flash-5")
@pytest.mark.parametrize(
  "name, window",
  [(n, w) for w in (None, 5) for n in XLA_KERNELS if w is None or get_kernel(n).takes_window],
)
def test_every_kernel_matches_transformers_formulation(name, window):
  kernel = small_blocks(name)
  q, k, v, sinks = inputs()
  out = attend_static(q, k, v, 0, kernel, window, sinks_N=jnp.asarray(sinks))
  np.testing.assert_allclose(out, reference(q, k, v, 0, window, sinks), atol=TOL, rtol=TOL)


def test_sinks_change_the_output():
  """The sinks are not a no-op (the tests above could pass on outputs without them)."""
  q, k, v, sinks = inputs()
  with_sinks = attend_static(q, k, v, 0, "dense", sinks_N=jnp.asarray(sinks))
  without = attend_static(q, k, v, 0, "dense")
  assert float(jnp.max(jnp.abs(with_sinks - without))) > 1e-2


@pytest.mark.default_cases("fused")
@pytest.mark.parametrize("name", ["flash", "fused"])
def test_prefix_and_diagonal_merge_to_the_whole(name):
  """KV-Runahead's split: rows [16, 37) against the prefix [0, 16) (no own key: no sink) and
  against their own diagonal (the sink), merged, equal attention over all keys at once."""
  kernel = small_blocks(name)
  q, k, v, sinks = inputs()
  start, sinks_N = 16, jnp.asarray(sinks)
  q_rows = q[:, start:]
  prefix = attend_partial(q_rows, k[:, :start], v[:, :start], start, kernel, sinks_N=sinks_N)
  diagonal = attend_partial(q_rows, k[:, start:], v[:, start:], 0, kernel, sinks_N=sinks_N)
  merged, _ = merge_partials(*prefix, *diagonal)
  expected = reference(q, k, v, 0, None, sinks)[:, start:]
  np.testing.assert_allclose(merged, expected, atol=TOL, rtol=TOL)


def test_flash_lengths_as_data_take_the_sink_once():
  """The one body's calls: padded rows and keys as data, the early rows (`short_rows`) seeing
  only the prefix (their diagonal attended apart, with its sink), merged: the reference."""
  q, k, v, sinks = inputs(T=24, S=40)
  kernel, sinks_N = small_blocks("flash"), jnp.asarray(sinks)
  start, c, early = 13, 20, 6  # a rank's chunk: positions [13, 33); its first 6 rows early
  keys_k, keys_v = k[:, : start + c], v[:, : start + c]
  late = attend_partial(
    q,
    k,
    v,
    start,
    kernel,
    lengths=Lengths(query_rows=(0, c), key_end=start + c, short_rows=(early, start)),
    sinks_N=sinks_N,
  )
  early_part = attend_partial(
    q,
    k[:, start:],
    v[:, start:],
    0,
    kernel,
    lengths=Lengths(query_rows=(0, early), key_end=c),
    sinks_N=sinks_N,
  )
  early_lse = jnp.where(jnp.arange(q.shape[1])[:, None] < early, early_part[1], -jnp.inf)
  merged, _ = merge_partials(late[0], late[1], early_part[0], early_lse)
  expected = reference(q[:, :c], keys_k, keys_v, start, None, sinks)
  np.testing.assert_allclose(merged[:, :c], expected, atol=TOL, rtol=TOL)


def test_decode_rows_at_their_own_offsets():
  """A decode step (one query per row, per-row positions and valid keys): the rows whose
  position is among their valid keys take the sink; a part of the prompt alone does not."""
  q, k, v, sinks = inputs(T=1, S=30, B=3)
  sinks_N = jnp.asarray(sinks)
  positions = jnp.asarray([29, 17, 8])
  out, _ = attend_with_lse(q, k, v, positions, num_valid_keys=positions + 1, sinks_N=sinks_N)
  for b, position in enumerate(np.asarray(positions)):
    expected = reference(
      q[b : b + 1],
      k[b : b + 1, : position + 1],
      v[b : b + 1, : position + 1],
      int(position),
      None,
      sinks,
    )
    np.testing.assert_allclose(out[b : b + 1], expected, atol=TOL, rtol=TOL)
  # The prompt [0, 8) without the new token's key (a sharded cache's part): no sink.
  part, part_lse = attend_with_lse(q, k[:, :8], v[:, :8], positions, sinks_N=sinks_N)
  plain, plain_lse = attend_with_lse(q, k[:, :8], v[:, :8], positions)
  np.testing.assert_allclose(part, plain, atol=TOL, rtol=TOL)
  np.testing.assert_allclose(part_lse, plain_lse, atol=TOL, rtol=TOL)


def test_flash_traced_offset_under_jit():
  """A traced offset (ring and zigzag's pieces): the sink follows the offset, not the shapes."""
  q, k, v, sinks = inputs(T=16, S=16)
  sinks_N = jnp.asarray(sinks)
  fn = jax.jit(
    lambda offset: attend_flash(
      q, k, v, offset, query_block=8, key_block=8, out_dtype=jnp.float32, sinks_N=sinks_N
    )
  )
  diagonal, _ = fn(0)
  np.testing.assert_allclose(diagonal, reference(q, k, v, 0, None, sinks), atol=TOL, rtol=TOL)
  past, _ = fn(16)  # keys wholly in the past: no own key, no sink
  plain, _ = attend_flash(q, k, v, 16, query_block=8, key_block=8, out_dtype=jnp.float32)
  np.testing.assert_allclose(past, plain, atol=TOL, rtol=TOL)
