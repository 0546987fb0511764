"""Which keys a query sees: causal masks, sliding windows, and the masked score value.

Positions are absolute token indices counted from the first key given, so the same code
masks a whole prompt, one rank's chunk of it, or one decode step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# A large finite negative rather than -inf: a fully masked row (a padded query) then gives a
# uniform softmax instead of NaNs that would poison reductions downstream.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def window_start(first_query: int, window: int | None) -> int:
  """The first key position any query at or after `first_query` can see (0 without a window)."""
  return 0 if window is None else max(0, first_query - window + 1)


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
