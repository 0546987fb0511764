"""Choices agreed across processes: a choice made from per-process measurements (a
calibration, a device's memory) must be the same everywhere, or the processes compile
different programs. Process 0's answer, broadcast once per question and kept."""

from __future__ import annotations

import numpy as np
from jax.experimental import multihost_utils

from kvr_jax.core.caches import kept_cache
from kvr_jax.runtime.mesh import (
  spans_processes,
)


@kept_cache(256)
def _agreement(kind: str, key, mesh) -> dict:
  """One slot per question (kind, its inputs, the mesh) for `agreed`."""
  return {}


def agreed(kind: str, key, mesh, answer):
  """Process 0's `answer` (an int or a tuple of ints) on every process, where `mesh` spans
  processes: a choice made from per-process measurements must be the same everywhere, or the
  processes compile different programs. Asked across processes once per question (`kind`
  and `key`, the inputs every process asks it with) and then kept: a broadcast per plan
  cost 2-3 ms on gloo, and a 1k-token prefill asked three (auto's pick, the split, the
  join). Every process asks the same questions in the same order, so all of them find an
  answer kept or none does. A mesh of this process's devices alone (the oracle's, run by one
  process) decides locally: a broadcast would wait for processes that never join it."""
  if not spans_processes(mesh):
    return answer
  slot = _agreement(kind, key, mesh)
  if "answer" not in slot:
    agreed = multihost_utils.broadcast_one_to_all(np.asarray(answer, np.int32))
    slot["answer"] = tuple(int(x) for x in agreed) if np.ndim(agreed) else int(agreed)
  return slot["answer"]
