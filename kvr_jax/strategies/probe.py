"""Timeline probes: host timestamps taken from inside a compiled program, per rank and layer.

A program compiled with `timeline=True` (part of the compile cache key of the strategies that
take probes) calls `mark(label, layer, value)` at its phase boundaries. The mark is an
`io_callback` that records (rank, layer, label, CLOCK_MONOTONIC ns) in this process once
`value` has been computed (it reads one element of every array in `value`), and returns
`value` through a conditional on the callback's result, so that nothing after the mark
starts before the record. (Optimization barriers did neither on XLA:CPU across processes:
records came out of program order.) The marks keep XLA from fusing across a phase boundary
and copy what passes through the conditional, which is the perturbation (`launch.benchmark
--mode=timeline` prints TTFT with and without the probes). CLOCK_MONOTONIC is one clock for
every process on a host, so the processes' records line up.

`EVENTS` is this process's list of records; `kvr_jax.tools.timeline` reads and clears it.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS

# (rank, layer, label, ns): appended by the callbacks of probed programs.
EVENTS: list[tuple[int, int, str, int]] = []
# Labels by index: the callback receives the index (an array), not the string.
_LABELS: list[str] = []


def _label_id(label: str) -> int:
  if label not in _LABELS:
    _LABELS.append(label)
  return _LABELS.index(label)


def _record(label_id, rank, shard, layer, _element):
  if int(shard) == 0:  # one record per rank: its first device's (a model group's run together)
    EVENTS.append((int(rank), int(layer), _LABELS[int(label_id)], time.monotonic_ns()))
  return np.zeros((), np.float32)


def _shard_index():
  """This device's index in its rank's model group: on a ("ranks", "model") mesh every device
  of a rank runs the mark, and only the first records; 0 on a 1-D mesh (no "model" axis)."""
  try:
    return jax.lax.axis_index(MODEL_AXIS)
  except NameError:  # the program's mesh has no "model" axis
    return jnp.int32(0)


def now_ns() -> int:
  """The probes' clock, for the host side of a timed call."""
  return time.monotonic_ns()


def mark(enabled: bool, label: str, layer, value):
  """Records when `value` is ready on this rank (no-op unless `enabled`); returns `value`,
  on which later work then depends. `layer` may be traced (the scan's index) or -1."""
  if not enabled:
    return value
  # One element of every non-empty leaf is read (a buffer may be empty), so the record waits
  # for every part of the value (an optimization barrier around it did not hold on XLA:CPU:
  # a phase's last output was still computed after its record).
  leaves = [x for x in jax.tree.leaves(value) if x.size]
  elements = jnp.stack([x.reshape(-1)[0].astype(jnp.float32) for x in leaves])
  done = io_callback(
    _record,
    jax.ShapeDtypeStruct((), jnp.float32),
    jnp.int32(_label_id(label)),
    jax.lax.axis_index(AXIS),
    _shard_index(),
    jnp.asarray(layer, jnp.int32),
    elements,
  )
  # A real dependence of what follows on the record: the value passes through a conditional
  # on the callback's result (always 0), whose other branch differs so that XLA cannot fold
  # it away. An optimization barrier tying the value to the result did not hold the order on
  # XLA:CPU across processes (later phases recorded before a hop), nor a conditional whose
  # branches are both the identity.
  return jax.lax.cond(done == 0, lambda v: v, lambda v: jax.tree.map(jnp.zeros_like, v), value)
