"""Where a KV cache lies: which prompt positions each rank's part holds (`CacheLayout`), the
parts' sharding over the mesh, and the batch folded into the parts' rows. The vocabulary the
strategies write their parts in and prefill, decode and the cache moves read."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, model_parallel, split_dims


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """Which prompt positions each rank's part of the KV cache holds (static, hashable).

  segments[r]: rank r's runs (position, length, row): rows [row, row + length) of its part
  hold prompt positions [position, position + length). A rank may hold no run (TSP's last
  ranks on a short prompt), one (KV-Runahead's chunk) or two (the zigzag peers). part_len:
  the rows of every part (the longest rank's, so that SPMD has one shape); rows no run
  covers are padding.
  """

  context_len: int
  part_len: int
  segments: tuple[tuple[tuple[int, int, int], ...], ...]

  @property
  def num_ranks(self) -> int:
    return len(self.segments)

  def runs_in_prompt_order(self) -> list[tuple[int, int, int, int]]:
    """Every (rank, row, position, length), sorted by position: they tile [0, context_len)."""
    runs = [
      (rank, row, position, length)
      for rank, rank_runs in enumerate(self.segments)
      for position, length, row in rank_runs
    ]
    return sorted(runs, key=lambda run: run[2])

  def positions(self) -> np.ndarray:
    """[p, part_len] int32: the prompt position each row of each rank's part holds (-1:
    padding)."""
    table = np.full((self.num_ranks, self.part_len), -1, np.int32)
    for rank, row, position, length in self.runs_in_prompt_order():
      table[rank, row : row + length] = position + np.arange(length)
    return table

  def holder(self, position: int) -> tuple[int, int]:
    """(the rank whose part holds prompt `position`, its row there)."""
    for rank, row, start, length in self.runs_in_prompt_order():
      if start <= position < start + length:
        return rank, row + position - start
    raise ValueError(f"position {position} is outside the prompt of {self.context_len} tokens")

  def rows_in_prompt_order(self) -> np.ndarray:
    """[context_len] int32: each prompt position's row in the parts laid rank after rank
    (rank r's row i at r * part_len + i): what gathers the parts into prompt order."""
    return np.concatenate(
      [
        rank * self.part_len + row + np.arange(length)
        for rank, row, _, length in self.runs_in_prompt_order()
      ]
    ).astype(np.int32)

  def check(self) -> None:
    """The runs tile the prompt exactly and fit their parts (a strategy's own invariant)."""
    next_position = 0
    for rank, row, position, length in self.runs_in_prompt_order():
      if position != next_position or length < 1 or row < 0 or row + length > self.part_len:
        raise AssertionError(f"cache layout run {(rank, row, position, length)} in {self}")
      next_position = position + length
    if next_position != self.context_len:
      raise AssertionError(f"cache layout covers {next_position} of {self.context_len} tokens")


def contiguous_layout(chunks: tuple[int, ...], part_len: int | None = None) -> CacheLayout:
  """Rank r holds the r-th contiguous chunk (single, KV-Runahead, TSP's real tokens), in parts
  of `part_len` rows (default: the longest chunk)."""
  position, segments = 0, []
  for c in chunks:
    segments.append(((position, c, 0),) if c > 0 else ())
    position += c
  return CacheLayout(sum(chunks), max(chunks) if part_len is None else part_len, tuple(segments))


def fold_batch(kv_2BPKH):
  """[2, B, P, K, H] -> [2, B*P, K, H]: the per-layer part a program's layer scan emits.

  Why: with B = 1, XLA:CPU lays the scan's stacked [L, 2, B, P, K, H] buffer out with the
  size-1 batch axis out of place and then copies it to the output's default layout, a
  second copy of every rank's whole part among the temporaries (`compiled_memory` showed it
  growing with L by exactly the part size). With batch folded into the rows there is no
  size-1 axis to misplace and the loop writes the output buffer itself. Consumers unfold it
  (`unfold_batch`) inside their own programs, where the reshape is free.
  """
  return kv_2BPKH.reshape(kv_2BPKH.shape[0], -1, *kv_2BPKH.shape[3:])  # or [1, ...]: latents


def parts_spec(mesh):
  """Every K,V output (the parts, KV-Runahead's last hops) [p, L, 2, rows, K, H]: by rank, and
  on a ("ranks", "model") mesh its heads over "model"."""
  if model_parallel(mesh) == 1:
    return jax.P(AXIS)
  return split_dims("pL2RKH", p=AXIS, K=MODEL_AXIS)


def unfold_batch(kv_2BPKH_folded, part_len: int):
  """[..., 2, B*P, K, H] -> [..., 2, B, P, K, H] (the inverse of `fold_batch`)."""
  *lead, rows, K, H = kv_2BPKH_folded.shape
  return kv_2BPKH_folded.reshape(*lead, rows // part_len, part_len, K, H)
