"""Rotary position embeddings: inverse frequencies (default, linear, llama3, yarn) and their
application to the rotated part of each head."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import RopeConfig


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
