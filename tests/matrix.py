"""Pairwise test matrices: the default tier runs a subset of a parameter product in which
every pair of values of any two factors that the product holds appears at least once; the
other cases run in the end-to-end tier (`-m e2e`). Nothing of the product is dropped."""

import itertools

import pytest


def _pairs(factors: tuple) -> set:
  return {
    ((i, a), (j, b)) for (i, a), (j, b) in itertools.combinations(enumerate(map(repr, factors)), 2)
  }


def pairwise_cover(cases: list, factors_of=lambda case: case) -> list[int]:
  """Indices of a small subset of `cases` (greedy, in order of first appearance) that covers
  every pair of factor values any case holds; factors_of(case) -> a tuple of its factors."""
  pairs = [_pairs(tuple(factors_of(case))) for case in cases]
  uncovered = set().union(*pairs)
  chosen = []
  while uncovered:
    best = max(range(len(cases)), key=lambda i: (len(pairs[i] & uncovered), -i))
    chosen.append(best)
    uncovered -= pairs[best]
  return sorted(chosen)


def pairwise(cases: list, factors_of=lambda case: case) -> list:
  """`cases` as pytest params: the pairwise cover in the default tier, the rest marked e2e."""
  keep = set(pairwise_cover(cases, factors_of))
  as_tuple = [case if isinstance(case, tuple) else (case,) for case in cases]
  return [
    pytest.param(*case, marks=() if i in keep else pytest.mark.e2e)
    for i, case in enumerate(as_tuple)
  ]
