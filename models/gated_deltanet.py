"""Gated DeltaNet linear attention (Yang, Kautz, Hatamizadeh, ICLR 2025), as transformers 5
computes it for Qwen3.5 and Qwen3-Next (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_fn`): pure functions, no devices.

Legend: B batch, T tokens, h value heads, k key dim per head, v value dim per head, C the
convolution's channels, W its kernel, w = W - 1 its halo.

Per value head the past is a state S [k, v]; a token t (its query, key, value, decay g_t <= 0
and learning rate beta_t in (0, 1)) does

  S <- exp(g_t) S
  S <- S + k_t (beta_t (v_t - S^T k_t))^T          (the delta rule: write the correction)
  o_t = S^T q_t

`recurrent` runs exactly that (decode, and the reference of the tests); `chunked` runs chunks
of 64 tokens in a few matmuls and one triangular solve each (prefill).

The map of a chunk of tokens on the state that enters it is affine, S_out = A S_in + B, and so
are its outputs, o = o_0 + Q_eff S_in (`chunked_with_entry_map`). A rank of KV-Runahead can
therefore run its whole chunk before the earlier ranks' state arrives, then pass A S + B on
and correct its outputs by one matmul: its hop is one state, whatever the prompt length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64  # transformers' chunk size (its outputs are computed in these blocks)
L2_EPS = 1e-6  # transformers' l2norm eps (the FLA library's)


def zeros_as(x, shape) -> jax.Array:
  """float32 zeros of `shape` typed as `x` is: under a `shard_map`, varying over the mesh axes
  `x` varies over, so that a scan may carry them into what it computes from `x`."""
  return jnp.broadcast_to(jnp.zeros_like(x, jnp.float32).ravel()[0], shape)


def causal_conv(x_BTC, kernel_WC, halo_BwC):
  """Depthwise causal convolution then SiLU (transformers' `causal_conv1d_fn`): output row t
  is silu(sum_j kernel[j] x[t - w + j]), where rows before the chunk come from `halo` (the
  w pre-convolution rows before it; zeros at the prompt's start).

  Returns (y [B, T, C], the next halo [B, w, C]: the last w rows of halo and x)."""
  T, w = x_BTC.shape[1], kernel_WC.shape[0] - 1
  full_BwTC = jnp.concatenate([halo_BwC.astype(x_BTC.dtype), x_BTC], axis=1)
  y_BTC = sum(full_BwTC[:, j : j + T] * kernel_WC[j] for j in range(w + 1))
  return jax.nn.silu(y_BTC), full_BwTC[:, full_BwTC.shape[1] - w :]


def l2_normalize(x, eps: float = L2_EPS):
  """x / sqrt(sum x^2 + eps) over the last axis, as transformers' `l2norm`."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare(q_BThk, k_BThk, g_BTh):
  """float32, l2-normalised q and k, q scaled by 1/sqrt(k): what both forms take. q and k
  arrive with h heads already (grouped value heads: repeated by the caller)."""
  q = l2_normalize(q_BThk.astype(jnp.float32)) * q_BThk.shape[-1] ** -0.5
  return q, l2_normalize(k_BThk.astype(jnp.float32)), g_BTh.astype(jnp.float32)


def recurrent(q_BThk, k_BThk, v_BThv, g_BTh, beta_BTh, state_Bhkv):
  """The rule token by token (a `lax.scan`): (o [B, T, h, v] float32, final state). q and k as
  `prepare` returns them."""

  def step(S_Bhkv, inputs):
    q_Bhk, k_Bhk, v_Bhv, g_Bh, beta_Bh = inputs
    S_Bhkv = S_Bhkv * jnp.exp(g_Bh)[..., None, None]
    predicted_Bhv = jnp.einsum("Bhkv,Bhk->Bhv", S_Bhkv, k_Bhk)
    delta_Bhv = (v_Bhv - predicted_Bhv) * beta_Bh[..., None]
    S_Bhkv = S_Bhkv + jnp.einsum("Bhk,Bhv->Bhkv", k_Bhk, delta_Bhv)
    return S_Bhkv, jnp.einsum("Bhkv,Bhk->Bhv", S_Bhkv, q_Bhk)

  inputs = (q_BThk, k_BThk, v_BThv.astype(jnp.float32), g_BTh, beta_BTh.astype(jnp.float32))
  inputs = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), inputs)
  final, o_TBhv = jax.lax.scan(step, state_Bhkv.astype(jnp.float32), inputs)
  return jnp.moveaxis(o_TBhv, 0, 1), final


def unit_lower_inverse(lower_NN):
  """The inverse of unit lower-triangular matrices [..., N, N] (N a power of two), by blocks
  in matmuls: with the inverses X_A, X_D of a block's two diagonal halves known, its
  lower-left block is -X_D C X_A (C the matrix's own lower-left block). Bottom up from the
  1 x 1 blocks (ones), log2(N) batched levels.

  Why not `jax.scipy.linalg.solve_triangular`: on CPU, jaxlib's batched LAPACK solve splits
  the batch over XLA's intra-op thread pool and waits for it from inside that pool; with as
  many pool threads as waiting solves (a 2-core machine, one device) the program hangs (seen
  with JAX 0.10.2: about one run in three of the chunked form never returned)."""
  N = lower_NN.shape[-1]
  if N & (N - 1):
    raise ValueError(f"unit_lower_inverse takes a power-of-two size, not {N}")
  batch = lower_NN.shape[:-2]
  inverse = jnp.broadcast_to(jnp.eye(1, dtype=lower_NN.dtype), (*batch, N, 1, 1))
  half = 1
  while half < N:
    blocks = N // (2 * half)
    # The matrix's diagonal blocks of size 2 * half: [..., blocks, 2 * half, 2 * half].
    diag = lower_NN.reshape(*batch, blocks, 2 * half, blocks, 2 * half)
    diag = jnp.diagonal(diag, axis1=-4, axis2=-2)  # [..., 2 * half, 2 * half, blocks]
    diag = jnp.moveaxis(diag, -1, -3)
    C = diag[..., half:, :half]
    pairs = inverse.reshape(*batch, blocks, 2, half, half)
    X_A, X_D = pairs[..., 0, :, :], pairs[..., 1, :, :]
    lower_left = -jnp.einsum("...ij,...jk,...kl->...il", X_D, C, X_A)
    zeros = jnp.zeros_like(lower_left)
    top = jnp.concatenate([X_A, zeros], axis=-1)
    bottom = jnp.concatenate([lower_left, X_D], axis=-1)
    inverse = jnp.concatenate([top, bottom], axis=-2)  # [..., blocks, 2 * half, 2 * half]
    half *= 2
  return inverse[..., 0, :, :]


def _chunk_terms(q_BThk, k_BThk, v_BThv, g_BTh, beta_BTh, chunk: int):
  """The within-chunk quantities of transformers' chunked form, chunks on axis 2 ([B, h, n,
  c, ...]; T padded to n c with g = beta = 0, which leave the state as it is):

    U, W   the solved values and decayed keys: (I + tril(beta k k^T decay, -1))^-1 applied
           to beta v and to beta k exp(cum g)
    intra  the chunk's causal q k^T with decays, diagonal included
    q_dec  q exp(cum g), k_dec  k exp(g_last - cum g), decay  exp(g_last)

  so that a chunk entered with state S gives o = q_dec S + intra (U - W S) and leaves
  decay S + k_dec^T (U - W S)."""
  T = q_BThk.shape[1]
  n = -(-T // chunk)
  pad = n * chunk - T

  def chunks(x):  # [B, T, h, ...] -> [B, h, n, c, ...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = jnp.moveaxis(x, 2, 1)
    return x.reshape(*x.shape[:2], n, chunk, *x.shape[3:])

  q, k, v = chunks(q_BThk), chunks(k_BThk), chunks(v_BThv.astype(jnp.float32))
  g, beta = chunks(g_BTh), chunks(beta_BTh.astype(jnp.float32))
  cum_g = jnp.cumsum(g, axis=-1)  # [B, h, n, c]
  lower = jnp.tril(jnp.ones((chunk, chunk), bool))
  # exp(cum_i - cum_j) for i >= j (<= 1); the upper triangle is masked before the exp.
  decay_cc = jnp.exp(jnp.where(lower, cum_g[..., :, None] - cum_g[..., None, :], -jnp.inf))
  k_beta = k * beta[..., None]
  system = jnp.einsum("Bhncd,Bhned->Bhnce", k_beta, k) * decay_cc
  system = jnp.where(jnp.tril(lower, -1), system, 0) + jnp.eye(chunk)
  inverse = unit_lower_inverse(system)
  U = jnp.einsum("...ce,...ed->...cd", inverse, v * beta[..., None])
  W = jnp.einsum("...ce,...ed->...cd", inverse, k_beta * jnp.exp(cum_g)[..., None])
  intra = jnp.einsum("Bhncd,Bhned->Bhnce", q, k) * decay_cc
  q_dec = q * jnp.exp(cum_g)[..., None]
  k_dec = k * jnp.exp(cum_g[..., -1:] - cum_g)[..., None]
  decay = jnp.exp(cum_g[..., -1])  # [B, h, n]
  return U, W, intra, q_dec, k_dec, decay


def _unchunk(o_BhncV, T: int):
  """[B, h, n, c, V] -> [B, T, h, V]."""
  B, h, n, c, V = o_BhncV.shape
  return jnp.moveaxis(o_BhncV.reshape(B, h, n * c, V), 1, 2)[:, :T]


def _over_chunks(step, carry, terms):
  """`lax.scan` of step(carry, one chunk's terms) over the chunk axis (2)."""
  return jax.lax.scan(step, carry, jax.tree.map(lambda x: jnp.moveaxis(x, 2, 0), terms))


def chunked(q_BThk, k_BThk, v_BThv, g_BTh, beta_BTh, state_Bhkv, chunk: int = CHUNK):
  """The rule over chunks of `chunk` tokens (transformers' `torch_chunk_gated_delta_rule`):
  (o [B, T, h, v] float32, final state [B, h, k, v]). q and k as `prepare` returns them."""
  T = q_BThk.shape[1]
  terms = _chunk_terms(q_BThk, k_BThk, v_BThv, g_BTh, beta_BTh, chunk)

  def step(S_Bhkv, t):
    U, W, intra, q_dec, k_dec, decay = t
    new_Bhcv = U - jnp.einsum("Bhck,Bhkv->Bhcv", W, S_Bhkv)
    o_Bhcv = jnp.einsum("Bhck,Bhkv->Bhcv", q_dec, S_Bhkv) + jnp.einsum(
      "Bhce,Bhev->Bhcv", intra, new_Bhcv
    )
    S_Bhkv = S_Bhkv * decay[..., None, None] + jnp.einsum("Bhck,Bhcv->Bhkv", k_dec, new_Bhcv)
    return S_Bhkv, o_Bhcv

  final, o_nBhcv = _over_chunks(step, state_Bhkv.astype(jnp.float32), terms)
  return _unchunk(jnp.moveaxis(o_nBhcv, 0, 2), T), final


def chunked_with_entry_map(q_BThk, k_BThk, v_BThv, g_BTh, beta_BTh, chunk: int = CHUNK):
  """The rule over a span of tokens whose entering state S is not known yet, as affine maps
  of it: (o_0 [B, T, h, v], Q_eff [B, T, h, k], A [B, h, k, k], B [B, h, k, v]) such that the
  span entered with S gives o = o_0 + Q_eff S and leaves the state A S + B.

  Chunk i is entered with S_i = P_i S + R_i (P_0 = I, R_0 = 0): R is the zero-state pass of
  `chunked`, and P_{i+1} = (decay_i I - k_dec_i^T W_i) P_i, a [k, k] matmul per chunk and
  head. Its outputs are (q_dec_i - intra_i W_i) S_i + intra_i U_i."""
  T = q_BThk.shape[1]
  terms = _chunk_terms(q_BThk, k_BThk, v_BThv, g_BTh, beta_BTh, chunk)
  (A, B_state), (o_n, q_eff_n) = _over_chunks(_entry_map_step, _no_map(q_BThk, v_BThv), terms)
  o_BThv = _unchunk(jnp.moveaxis(o_n, 0, 2), T)
  q_eff_BThk = _unchunk(jnp.moveaxis(q_eff_n, 0, 2), T)
  return o_BThv, q_eff_BThk, A, B_state


def chunked_with_entry_map_upto(
  q_BThk, k_BThk, v_BThv, g_BTh, beta_BTh, real_rows, chunk: int = CHUNK
):
  """`chunked_with_entry_map` of the first `real_rows` rows (traced) of T, the rest padding
  (g = beta = 0): a loop of ceil(real_rows / chunk) steps, each one chunk's terms and its
  step, so that padding costs at most one chunk (not T - real_rows rows of matmuls). The
  chunks past them would be the identity map; their outputs are zeros."""
  B, T, h, _ = q_BThk.shape
  n = -(-T // chunk)
  inputs = [
    jnp.pad(x, [(0, 0), (0, n * chunk - T)] + [(0, 0)] * (x.ndim - 2))
    for x in (q_BThk, k_BThk, v_BThv, g_BTh, beta_BTh)
  ]

  def one_chunk(j, carry):
    maps, o_BThv, q_eff_BThk = carry
    pieces = [jax.lax.dynamic_slice_in_dim(x, j * chunk, chunk, axis=1) for x in inputs]
    terms = jax.tree.map(lambda x: x[:, :, 0], _chunk_terms(*pieces, chunk))
    maps, (o_Bhcv, q_eff_Bhck) = _entry_map_step(maps, terms)
    o_BThv, q_eff_BThk = (
      jax.lax.dynamic_update_slice_in_dim(out, jnp.moveaxis(x, 1, 2), j * chunk, axis=1)
      for out, x in ((o_BThv, o_Bhcv), (q_eff_BThk, q_eff_Bhck))
    )
    return maps, o_BThv, q_eff_BThk

  maps = _no_map(q_BThk, v_BThv)
  o_BThv = zeros_as(q_BThk, (B, n * chunk, h, v_BThv.shape[3]))
  q_eff_BThk = zeros_as(q_BThk, (B, n * chunk, h, q_BThk.shape[3]))
  steps = (real_rows + chunk - 1) // chunk
  (A, B_state), o_BThv, q_eff_BThk = jax.lax.fori_loop(
    0, steps, one_chunk, (maps, o_BThv, q_eff_BThk)
  )
  return o_BThv[:, :T], q_eff_BThk[:, :T], A, B_state


def _no_map(q_BThk, v_BThv):
  """(P, R) of an empty span: the identity [B, h, k, k] and zeros [B, h, k, v]."""
  B, h, d_k, d_v = q_BThk.shape[0], q_BThk.shape[2], q_BThk.shape[3], v_BThv.shape[3]
  return zeros_as(q_BThk, (B, h, d_k, d_k)) + jnp.eye(d_k), zeros_as(q_BThk, (B, h, d_k, d_v))


def _entry_map_step(carry, t):
  """One chunk of `chunked_with_entry_map`: (P, R) -> (P, R) after it, (o_0, Q_eff) of its
  rows [B, h, c, ...]."""
  P_Bhkj, R_Bhkv = carry
  U, W, intra, q_dec, k_dec, decay = t
  identity = jnp.eye(P_Bhkj.shape[-1], dtype=P_Bhkj.dtype)
  reads_Bhck = q_dec - jnp.einsum("Bhce,Bhek->Bhck", intra, W)  # what o reads of S_i
  new_Bhcv = U - jnp.einsum("Bhck,Bhkv->Bhcv", W, R_Bhkv)
  o_Bhcv = jnp.einsum("Bhck,Bhkv->Bhcv", q_dec, R_Bhkv) + jnp.einsum(
    "Bhce,Bhev->Bhcv", intra, new_Bhcv
  )
  q_eff_Bhcj = jnp.einsum("Bhck,Bhkj->Bhcj", reads_Bhck, P_Bhkj)
  step_Bhkj = decay[..., None, None] * identity - jnp.einsum("Bhck,Bhcj->Bhkj", k_dec, W)
  R_Bhkv = R_Bhkv * decay[..., None, None] + jnp.einsum("Bhck,Bhcv->Bhkv", k_dec, new_Bhcv)
  return (jnp.einsum("Bhkj,Bhjl->Bhkl", step_Bhkj, P_Bhkj), R_Bhkv), (o_Bhcv, q_eff_Bhcj)


def apply_entry_state(o_BThv, q_eff_BThk, A_Bhkk, B_Bhkv, state_Bhkv):
  """The outputs and the leaving state of a span (`chunked_with_entry_map`) entered with
  `state`: (o_0 + Q_eff S, A S + B)."""
  o_BThv = o_BThv + jnp.einsum("BThk,Bhkv->BThv", q_eff_BThk, state_Bhkv)
  return o_BThv, jnp.einsum("Bhkj,Bhjv->Bhkv", A_Bhkk, state_Bhkv) + B_Bhkv
