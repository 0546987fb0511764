"""Pure per-layer maths shared by every model and every parallel strategy.

Dimension legend: B batch, T query tokens in this slice, S keys in the prefix (cache) the
queries attend to, N query heads, K key/value heads, G = N // K query heads per KV head,
H head dim, D model dim.

Nothing here knows about devices. Positions are absolute token indices, so the same code
computes a whole prompt, one rank's chunk of it, or one decode step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import RopeConfig

# A large finite negative rather than -inf: a fully masked row (a padded query) then gives a
# uniform softmax instead of NaNs that would poison reductions downstream.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# Query block of the "blocked" attention (see attend_blocked): measured fastest of 64/128/256/512
# on this 2-core CPU for T = 2048 and 4096.
ATTENTION_BLOCK = 128
ATTENTION_KINDS = ("dense", "blocked")


def attend_static(q_BTNH, k_BSKH, v_BSKH, query_offset: int, attention: str) -> jax.Array:
  """`attend` ("dense": every score of the [T, S] rectangle, masked afterwards) or
  `attend_blocked` ("blocked": masked-out query-key blocks skipped); the offset is static."""
  if attention == "blocked":
    return attend_blocked(q_BTNH, k_BSKH, v_BSKH, query_offset, ATTENTION_BLOCK)
  return attend(q_BTNH, k_BSKH, v_BSKH, query_offset)


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
  """Inverse frequencies [H/2] of rotary embeddings, with linear or llama3 scaling.

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
  return inv_freq.astype(np.float32)


def apply_rope(x_BTnH: jax.Array, positions_BT: jax.Array, rope: RopeConfig) -> jax.Array:
  """Rotates query or key heads by their absolute positions (Hugging Face `rotate_half` form).

  x: [B, T, n, H] for any head count n; positions: [B, T] int.
  """
  head_dim = x_BTnH.shape[-1]
  inv_freq = jnp.asarray(rope_inv_freq(head_dim, rope))
  angles_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq
  angles_BTH = jnp.concatenate([angles_BTh, angles_BTh], axis=-1)
  cos = jnp.cos(angles_BTH)[:, :, None, :]
  sin = jnp.sin(angles_BTH)[:, :, None, :]
  x32 = x_BTnH.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * cos + rotated * sin).astype(x_BTnH.dtype)


def causal_mask(num_queries: int, num_keys: int, query_offset) -> jax.Array:
  """[T, S] bool: query t (absolute position query_offset + t) may see key s iff s <= that.

  With query_offset = S - T this is the usual lower-triangular block at the end of the prefix;
  keys past the last query's position are masked, which is also what hides the unused tail of
  a preallocated decode cache.
  """
  q_pos = query_offset + jnp.arange(num_queries)[:, None]
  k_pos = jnp.arange(num_keys)[None, :]
  return k_pos <= q_pos


def attend(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  query_offset,
  *,
  softmax_scale: float | None = None,
) -> jax.Array:
  """Causal attention of T queries to an S-key prefix; returns [B, T, N, H].

  The queries sit at absolute positions query_offset + [0, T). Grouped-query attention is done
  by folding the N query heads into [K, G] so that the K key/value heads are never repeated.
  Scores and softmax are in float32 whatever the input dtype.
  """
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G = N // K
  scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(H)
  q_BTKGH = q_BTNH.reshape(B, T, K, G, H)
  scores_BKGTS = (
    jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32) * scale
  )
  mask_TS = causal_mask(T, S, query_offset)
  scores_BKGTS = jnp.where(mask_TS, scores_BKGTS, _MASK_VALUE)
  # Softmax with the normalisation deferred to the [T, H] output: one pass fewer over the
  # [T, S] scores than normalising the probabilities themselves.
  max_BKGT1 = jnp.max(scores_BKGTS, axis=-1, keepdims=True)
  unnormalised_BKGTS = jnp.exp(scores_BKGTS - max_BKGT1)
  denominator_BTKG1 = jnp.einsum("BKGTS->BTKG", unnormalised_BKGTS)[..., None]
  out_BTKGH = jnp.einsum(
    "BKGTS,BSKH->BTKGH",
    unnormalised_BKGTS.astype(v_BSKH.dtype),
    v_BSKH,
    preferred_element_type=jnp.float32,
  )
  out_BTKGH = out_BTKGH / denominator_BTKG1
  return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


def attend_blocked(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  query_offset: int,
  block_size: int,
  *,
  softmax_scale: float | None = None,
) -> jax.Array:
  """`attend` that skips the masked-out future: queries in static blocks of `block_size`, each
  attending only to the keys up to its last query's position.

  The offset must be static (a Python int). For T queries over S = offset + T keys this costs
  T * offset + about T^2 / 2 score entries instead of T * S, and never materialises the whole
  [T, S] score matrix. Same results as `attend` (each block still sees all of its keys).
  """
  T, S = q_BTNH.shape[1], k_BSKH.shape[1]
  if T <= block_size:
    return attend(q_BTNH, k_BSKH, v_BSKH, query_offset, softmax_scale=softmax_scale)
  outputs = []
  for start in range(0, T, block_size):
    stop = min(start + block_size, T)
    visible = min(query_offset + stop, S)  # keys past the block's last query are all masked
    outputs.append(
      attend(
        q_BTNH[:, start:stop],
        k_BSKH[:, :visible],
        v_BSKH[:, :visible],
        query_offset + start,
        softmax_scale=softmax_scale,
      )
    )
  return jnp.concatenate(outputs, axis=1)
