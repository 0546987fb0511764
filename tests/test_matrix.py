"""The pairwise cover the default tier runs (tests/matrix.py)."""

import itertools

import pytest

from tests.matrix import pairwise, pairwise_cover


def test_the_cover_holds_every_pair_and_is_smaller_than_the_product():
  product = list(itertools.product("ab", (1, 2, 3), ("x", "y"), (True, False)))
  chosen = [product[i] for i in pairwise_cover(product)]
  assert len(chosen) < len(product)
  for i, j in itertools.combinations(range(4), 2):
    want = {(case[i], case[j]) for case in product}
    assert {(case[i], case[j]) for case in chosen} == want, (i, j)


def test_the_rest_of_the_product_is_marked_end_to_end():
  product = list(itertools.product("ab", (1, 2, 3)))  # two factors: every case is a pair
  assert all(not p.marks for p in pairwise(product))
  product = list(itertools.product("ab", (1, 2), ("x", "y")))
  params = pairwise(product)
  assert [p.values for p in params] == product
  marked = [p for p in params if p.marks]
  assert marked and all(p.marks == (pytest.mark.e2e,) for p in marked)
