"""Chunk arithmetic: how many prompt tokens each rank takes, and the checks every layer shares.

Pure Python, no JAX: the bottom layer of kvr_jax. Rank 0 takes the earliest tokens; chunk i
holds c_i tokens; S_i = c_0 + ... + c_i is the prefix rank i ends with.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def check_ranks(context_len: int, num_ranks: int) -> None:
  """The one check for "p ranks but only C tokens" (and for nonsense p): every rank needs at
  least one token."""
  if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
    raise ValueError(f"the number of ranks must be a positive integer, got {num_ranks!r}")
  if num_ranks > context_len:
    raise ValueError(
      f"p={num_ranks} ranks but only C={context_len} prompt tokens: every rank needs at least "
      "one token; use fewer devices"
    )


def check_multiple(context_len: int, num_ranks: int, multiple: int) -> None:
  """Boundaries held to multiples of `multiple` must leave every chunk at least one multiple."""
  if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
    raise ValueError(f"`multiple` must be a positive integer, got {multiple!r}")
  check_ranks(context_len, num_ranks)
  if (num_ranks - 1) * multiple >= context_len:
    raise ValueError(
      f"C={context_len} is too short for {num_ranks} chunks that are multiples of "
      f"{multiple} (need more than {(num_ranks - 1) * multiple} tokens)"
    )


def even_partition(context_len: int, num_ranks: int) -> tuple[int, ...]:
  """C/p tokens each; the first C mod p ranks take one more (earlier ranks do less attention)."""
  check_ranks(context_len, num_ranks)
  base, extra = divmod(context_len, num_ranks)
  return tuple(base + (1 if i < extra else 0) for i in range(num_ranks))


def check_chunks(partition: Sequence[int], context_len: int, num_ranks: int) -> tuple[int, ...]:
  """Validates explicit chunk lengths: p positive integers summing to C."""
  check_ranks(context_len, num_ranks)
  if isinstance(partition, np.ndarray) and partition.ndim == 1:
    partition = partition.tolist()  # numpy integers become ints; floats stay floats (refused)
  if isinstance(partition, str) or not isinstance(partition, Sequence):
    raise ValueError(
      f"`partition` must be a list of {num_ranks} chunk lengths or a method name, got {partition!r}"
    )
  chunks = tuple(partition)
  if len(chunks) != num_ranks:
    raise ValueError(f"`partition` has {len(chunks)} chunks but the mesh has {num_ranks} ranks")
  for i, c in enumerate(chunks):
    if isinstance(c, bool) or not isinstance(c, int) and not hasattr(c, "__index__"):
      raise ValueError(f"`partition`[{i}] must be an integer, got {c!r}")
    if c <= 0:
      raise ValueError(f"`partition`[{i}] = {c}: every chunk must hold at least one token")
  chunks = tuple(int(c) for c in chunks)
  if sum(chunks) != context_len:
    raise ValueError(
      f"`partition` {list(chunks)} sums to {sum(chunks)}, but the prompt has {context_len} tokens"
    )
  return chunks


def prefix_ends(chunks: Sequence[int]) -> tuple[int, ...]:
  """S_i = c_0 + ... + c_i: the prefix length rank i ends with."""
  ends, total = [], 0
  for c in chunks:
    total += c
    ends.append(total)
  return tuple(ends)


def chunk_starts(chunks: Sequence[int]) -> tuple[int, ...]:
  """S_{i-1}: the absolute position of rank i's first token."""
  return (0,) + prefix_ends(chunks)[:-1]


def moved_rows(from_chunks: Sequence[int], to_chunks: Sequence[int]) -> list[tuple[int, ...]]:
  """What laying contiguous chunks out again moves: (sender, receiver, first row on the
  sender, first row on the receiver, rows) for every pair of different ranks whose old and
  new spans overlap; a rank's own overlap stays (not listed)."""
  pieces = []
  from_starts, to_starts = chunk_starts(from_chunks), chunk_starts(to_chunks)
  for s, (fs, fc) in enumerate(zip(from_starts, from_chunks, strict=True)):
    for d, (ts, tc) in enumerate(zip(to_starts, to_chunks, strict=True)):
      lo, hi = max(fs, ts), min(fs + fc, ts + tc)
      if s != d and hi > lo:
        pieces.append((s, d, lo - fs, lo - ts, hi - lo))
  return pieces


def chunks_from_bounds(bounds: Sequence[int], context_len: int) -> tuple[int, ...]:
  """p-1 increasing boundaries -> p chunk lengths."""
  edges = (0, *bounds, context_len)
  return tuple(edges[i + 1] - edges[i] for i in range(len(edges) - 1))


def round_to_multiple(chunks: Sequence[float], context_len: int, multiple: int = 1):
  """Rounds boundaries to multiples of `multiple` (the last chunk takes the remainder),
  keeping every chunk at least one multiple (the last at least one token)."""
  p = len(chunks)
  check_multiple(context_len, p, multiple)
  bounds, total = [], 0.0
  for c in chunks[:-1]:
    total += c
    bounds.append(int(round(total / multiple)) * multiple)
  for k in range(p - 1):  # strictly increasing, room left for the later chunks
    low = (bounds[k - 1] if k else 0) + multiple
    high = context_len - 1 - (p - 2 - k) * multiple
    high -= high % multiple
    bounds[k] = min(max(bounds[k], low), high)
  return chunks_from_bounds(bounds, context_len)
