"""Prompt-length buckets and ragged batches: any prompt length without a new compile.

Every strategy compiles one program per prompt shape (its chunks are static). With buckets
a prompt is padded at its end up to a bucket length, so that all lengths in one bucket share
one program per (strategy, bucket, partition, kernel, cache layout); the true lengths are
data. Padding never changes a real position's result (attention is causal); the logits of
each row's last real token come from one decode step at that token's position
(kvr_jax.inference.prefill), and decode continues from each row's own length.

The default ladder ("auto"): round up to a multiple of max(16, 2^(floor(log2 T) - 3)), i.e.
8 buckets per octave (1024, 1152, ..., 1920, 2048, 2304, ...): at most 12.5% padding, about
4.5% on average, and 8 programs per doubling of the prompt length (docs/buckets.md: measured by
`python -m launch.benchmark --mode=buckets`). `buckets` may also be an increasing sequence of
lengths (a prompt longer than the largest runs at its exact length) or None: exact shapes,
no padding unless rows of a batch differ in length (then the longest row is the shape).

The prompt rows themselves are checked here too (`check_prompts`): ids, lengths, emptiness.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence

import numpy as np

from kvr_jax.runtime.loading import Model

AUTO = "auto"
BUCKETS_PER_OCTAVE = 8
MIN_BUCKET_STEP = 16
PAD_ID = 0  # what fills a row past its length: any id does, nothing real attends it


def auto_bucket(length: int, buckets_per_octave: int = BUCKETS_PER_OCTAVE) -> int:
  """The default ladder's bucket for `length` tokens (see the module docstring)."""
  octave = 2 ** int(math.floor(math.log2(max(length, 1))))
  step = max(MIN_BUCKET_STEP, octave // buckets_per_octave)
  return -(-length // step) * step


def octave_ladder(per_octave: int, max_position: int) -> tuple[int, ...]:
  """The ladder with `per_octave` buckets per doubling (as `auto_bucket` with 8), every
  bucket up to max_position: for comparing ladders (launch.benchmark --mode=buckets)."""
  ladder = sorted({auto_bucket(t, per_octave) for t in range(1, max_position + 1)})
  return tuple(b for b in ladder if b <= max_position)


def check_buckets(buckets, max_position: int):
  """None, "auto" or a tuple of increasing positive lengths <= max_position; else one
  ValueError before anything compiles."""
  if buckets is None or (isinstance(buckets, str) and buckets == AUTO):
    return buckets
  if isinstance(buckets, str) or not isinstance(buckets, Sequence) or not buckets:
    raise ValueError(
      f"`buckets` must be None (exact shapes), {AUTO!r} or an increasing sequence of "
      f"prompt lengths, got {buckets!r}"
    )
  ladder = []
  for b in buckets:
    if not isinstance(b, numbers.Integral) or isinstance(b, bool) or b < 1:
      raise ValueError(f"`buckets` must hold positive integers, got {b!r} in {buckets!r}")
    ladder.append(int(b))
  if any(a >= b for a, b in itertools.pairwise(ladder)):
    raise ValueError(f"`buckets` must be strictly increasing, got {ladder}")
  if ladder[-1] > max_position:
    raise ValueError(
      f"bucket {ladder[-1]} is past the model's max_position_embeddings={max_position}"
    )
  return tuple(ladder)


def bucket_length(length: int, buckets, max_position: int) -> int:
  """The padded length of a batch whose longest row has `length` tokens."""
  if buckets is None:
    return length
  if buckets == AUTO:
    return max(length, min(auto_bucket(length), max_position))
  return next((b for b in buckets if b >= length), length)


def rows_of(tokens) -> list[np.ndarray]:
  """A [B, T] or [T] array, or a list of 1-D token sequences of any lengths, as rows;
  one ValueError for anything else."""
  if isinstance(tokens, (list, tuple)) and tokens and not np.isscalar(tokens[0]):
    rows = []
    for i, row in enumerate(tokens):
      try:
        array = np.asarray(row)
      except ValueError:
        array = np.asarray(row, dtype=object)
      if array.ndim != 1 or array.dtype == object:
        raise ValueError(f"prompt row {i} must be a 1-D sequence of token ids")
      rows.append(array)
    return rows
  try:
    array = np.asarray(tokens)
  except ValueError:
    raise ValueError("`tokens` must be token ids: [T], [B, T] or a list of rows") from None
  if array.dtype == object:
    raise ValueError("`tokens` must be token ids: [T], [B, T] or a list of rows")
  if array.ndim == 1:
    array = array[None]
  if array.ndim != 2:
    raise ValueError(f"`tokens` must be [B, T] token ids, got shape {array.shape}")
  if array.size == 0 or array.shape[1] == 0:
    raise ValueError(f"the prompt is empty (tokens of shape {array.shape})")
  return list(array)


def pad_rows(rows: Sequence[np.ndarray], length: int) -> np.ndarray:
  """[B, length] int32: each row followed by PAD_ID."""
  out = np.full((len(rows), length), PAD_ID, np.int32)
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
  return out


def check_prompts(model: Model, tokens) -> tuple[list[np.ndarray], np.ndarray]:
  """Prompt rows (a [B, T] or [T] array, or a list of 1-D sequences of any lengths), checked:
  (rows as int32 arrays, lengths [B] int32). One ValueError, naming the row, for an empty
  row, ids that are not integers or outside the vocabulary, or a row longer than
  max_position_embeddings."""
  rows = rows_of(tokens)
  vocab, limit = model.config.vocab_size, model.config.max_position_embeddings
  checked = []
  for i, row in enumerate(rows):
    where = f"prompt row {i}" if len(rows) > 1 else "the prompt"
    if row.size == 0:
      raise ValueError(f"{where} is empty")
    if not np.issubdtype(row.dtype, np.integer):
      raise ValueError(f"`tokens` must be integer token ids, got dtype {row.dtype} in {where}")
    bad = (row < 0) | (row >= vocab)
    if bad.any():
      first = int(np.argmax(bad))
      raise ValueError(
        f"token id {int(row[first])} at position {first} of {where} is outside the "
        f"vocabulary [0, {vocab})"
      )
    if row.size > limit:
      raise ValueError(f"{where}: {row.size} tokens exceeds max_position_embeddings={limit}")
    checked.append(row.astype(np.int32))
  return checked, np.asarray([len(r) for r in checked], np.int32)


def padded_prompts(model: Model, tokens, buckets):
  """The prompt rows checked (`check_prompts`) and the length every row is padded to:
  (rows, lengths [B], padded length T, the checked `buckets`)."""
  rows, lengths_B = check_prompts(model, tokens)
  max_position = model.config.max_position_embeddings
  buckets = check_buckets(buckets, max_position)
  T = bucket_length(int(lengths_B.max()), buckets, max_position)
  return rows, lengths_B, T, buckets
