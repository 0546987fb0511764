"""The TSP baseline as the paper runs it: even split, all-gather K,V, dense masked scores.

Every rank projects its own C/p tokens, an `all_gather` (a global barrier) gives every rank
all C keys and values, and each rank computes the dense (C/p) x C score block, masking the
future afterwards: no causal skipping. A prompt length not divisible by p is padded to
p * ceil(C/p); padded keys sit after every real query, so the causal mask hides them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies.base import (
  Strategy,
  contiguous_layout,
  count_trace,
  fold_batch,
  last_rank,
  logits_to_last_rank,
  model_reduce,
  spmd,
)
from models import scan_blocks
from models.base import no_reduce


def shard_len(context_len: int, num_ranks: int) -> int:
  return math.ceil(context_len / num_ranks)


def rank_program(graphdef, context_len: int, num_ranks: int, reduce=no_reduce):
  c = shard_len(context_len, num_ranks)
  last_rank, last_row = divmod(context_len - 1, c)

  def program(state, tokens_1Bc):
    count_trace("tsp")
    model = nnx.merge(graphdef, state)
    rank = jax.lax.axis_index(AXIS)
    tokens_Bc = tokens_1Bc[0]
    B = tokens_Bc.shape[0]
    offset = rank * c
    positions_Bc = jnp.broadcast_to(offset + jnp.arange(c), (B, c))

    def layer(block, x_BcD, _):
      q_BcNH, k_BcKH, v_BcKH = block.project_qkv(x_BcD, positions_Bc)
      # [2, B, p*c, K, H]: every rank gets every rank's K,V
      kv = jax.lax.all_gather(jnp.stack([k_BcKH, v_BcKH]), AXIS, axis=2, tiled=True)
      # Dense masked scores over all p*c keys (with a sliding window too: TSP skips nothing).
      attn_BcNH = block.attend(q_BcNH, kv[0], kv[1], offset, "dense")
      # The rank keeps its own shard of the cache; the gathered K,V live one layer.
      out_BcD = block.finish(x_BcD, attn_BcNH, reduce=reduce)
      return out_BcD, fold_batch(jnp.stack([k_BcKH, v_BcKH]))

    x_BcD, kv_L2RKH = scan_blocks(model.blocks, layer, model.embed(tokens_Bc))
    # Row `last_row` of rank `last_rank` is the prompt's last position.
    logits_BV = model.logits(x_BcD[:, last_row : last_row + 1])[:, 0]
    # Position C-1 lives on `last_rank` when C is not a multiple of p.
    logits_BV = logits_to_last_rank(logits_BV, last_rank, num_ranks)
    return logits_BV[None], kv_L2RKH[None]

  return program, last_rank


def layout(context_len: int, num_ranks: int, chunks=None) -> tuple[int, ...]:
  """Real tokens per rank: ceil(C/p) each from the start, so the last ranks may hold fewer
  (or none: C=13 on 8 ranks is 2,2,2,2,2,2,1,0); their padding is masked."""
  del chunks  # TSP always splits evenly
  c = shard_len(context_len, num_ranks)
  return tuple(max(0, min(c, context_len - r * c)) for r in range(num_ranks))


@functools.lru_cache(maxsize=64)
def compile_program(
  graphdef, mesh, chunks: tuple[int, ...], attention="dense", timeline: bool = False
):
  """Jitted TSP prefill: f(state, tokens [p, B, c]) -> (logits [p,B,V], kv [p,L,2,B*c,K,H]).

  The logits of the prompt's last position are moved to rank p-1 (see rank_program).
  """
  del attention  # dense masked scores by definition
  if timeline:
    raise ValueError("strategy 'tsp' has no timeline probes")
  program, _ = rank_program(graphdef, sum(chunks), len(chunks), model_reduce(mesh))
  return spmd(program, mesh)


def pad_shards(tokens_BC, num_ranks: int):
  """[B, C] -> [p, B, ceil(C/p)], zero-padded at the end."""
  tokens_BC = np.asarray(tokens_BC)
  B, C = tokens_BC.shape
  c = shard_len(C, num_ranks)
  padded = np.zeros((B, c * num_ranks), tokens_BC.dtype)
  padded[:, :C] = tokens_BC
  return padded.reshape(B, num_ranks, c).transpose(1, 0, 2)


STRATEGY = Strategy(
  name="tsp",
  description="the paper's baseline: even split, all-gather K,V, dense masked scores",
  partitioned=False,
  attention_kinds=("dense",),
  layout=layout,
  arrange=lambda tokens_BC, chunks: pad_shards(tokens_BC, len(chunks)),
  compile=compile_program,
  cache_rank=last_rank,
  cache_layout=lambda context_len, chunks: contiguous_layout(
    layout(context_len, len(chunks)), part_len=shard_len(context_len, len(chunks))
  ),
  attention_note="TSP computes dense masked scores by definition",
)
