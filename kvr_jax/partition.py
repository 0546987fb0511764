"""Context partitions: how many prompt tokens each rank takes (rank 0 the earliest)."""

from __future__ import annotations

from collections.abc import Sequence


def even_partition(context_len: int, num_ranks: int) -> tuple[int, ...]:
  """C/p tokens each; the first C mod p ranks take one more (earlier ranks do less attention)."""
  base, extra = divmod(context_len, num_ranks)
  return tuple(base + (1 if i < extra else 0) for i in range(num_ranks))


def check_partition(partition: Sequence[int], context_len: int, num_ranks: int) -> tuple[int, ...]:
  """Validates explicit chunk lengths: p positive integers summing to C."""
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


def resolve_partition(partition, context_len: int, num_ranks: int) -> tuple[int, ...]:
  """`"even"` or explicit lengths -> a validated tuple of p chunk lengths."""
  if num_ranks > context_len:
    raise ValueError(
      f"{num_ranks} ranks but only {context_len} prompt tokens: every rank needs "
      "at least one token; use fewer devices"
    )
  if partition is None or partition == "even":
    return even_partition(context_len, num_ranks)
  if isinstance(partition, str):
    raise ValueError(
      f"unknown partition {partition!r}; expected 'even' or a list of p chunk lengths"
    )
  return check_partition(partition, context_len, num_ranks)


def prefix_ends(chunks: Sequence[int]) -> tuple[int, ...]:
  """S_i = c_0 + ... + c_i: the prefix length rank i ends with."""
  ends, total = [], 0
  for c in chunks:
    total += c
    ends.append(total)
  return tuple(ends)
