"""The fixed tolerance of float32 strategies and kernels against each other, and its check;
the relative error the whole-model tests hold to their own tolerance (1e-4 against
transformers)."""

import numpy as np

REL_TOL = 1e-5  # relative to the largest magnitude of the reference tensor; never loosened


def assert_close(got, want, what):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err <= REL_TOL, f"{what}: relative error {err:.2e} > {REL_TOL}"


def relative_error(got, want) -> float:
  """The largest absolute difference over the reference's largest magnitude, in float64."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  return float(np.abs(got - want).max() / np.abs(want).max())
