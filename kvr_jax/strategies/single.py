"""The single-device oracle: the whole prompt on one device, as a one-rank SPMD program.

It runs under the same interface as the parallel strategies (a mesh of one device), so
`prefill` treats every strategy alike and the oracle's cache lands where decode runs.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from kvr_jax.strategies.base import (
  CAUSAL_KERNELS,
  Strategy,
  count_trace,
  last_rank,
  model_reduce,
  spmd,
)
from models.base import no_reduce


def layout(context_len: int, num_ranks: int, chunks=None) -> tuple[int, ...]:
  del num_ranks, chunks  # one rank, the whole prompt
  return (context_len,)


def arrange(tokens_BC, chunks) -> np.ndarray:
  return np.asarray(tokens_BC)[None]


def program(graphdef, attention, reduce=no_reduce):
  def run(state, tokens_1BC):
    count_trace("single")
    model = nnx.merge(graphdef, state)
    x_BCD, k_LBCKH, v_LBCKH = model.forward(tokens_1BC[0], attention, reduce=reduce)
    logits_BV = model.logits(x_BCD[:, -1:])[:, 0]
    # [L, 2, B*C, K, H]: K and V stacked, batch folded into the rows, as every strategy
    L, B, C, K, H = k_LBCKH.shape
    kv_L2RKH = jax.numpy.stack([k_LBCKH, v_LBCKH], axis=1).reshape(L, 2, B * C, K, H)
    return logits_BV[None], kv_L2RKH[None]

  return run


@functools.lru_cache(maxsize=32)
def compile_program(graphdef, mesh, chunks, attention="flash", timeline: bool = False):
  """f(state, tokens [1, B, C]) -> (logits [1, B, V], kv [1, L, 2, B*C, K, H])."""
  if timeline:
    raise ValueError("strategy 'single' has no timeline probes")
  return spmd(program(graphdef, attention, model_reduce(mesh)), mesh)


STRATEGY = Strategy(
  name="single",
  description="one device, the oracle (whole prompt, causal attention)",
  partitioned=False,
  attention_kinds=CAUSAL_KERNELS,
  layout=layout,
  arrange=arrange,
  compile=compile_program,
  cache_rank=last_rank,
  max_ranks=1,
)
