"""All-gather context parallelism (Llama 3, MaxText's default, Transformer Engine all_gather).

Zigzag layout (kvr_jax.strategies.zigzag): rank r holds chunks r and 2p-1-r. Per layer every
rank projects its 2c tokens, one tiled `all_gather` of K,V (own KV heads, a barrier) gives
every rank the whole prompt's K,V, which is put in prompt order, and each rank attends its two
chunks causally with the flash kernel (key blocks past a chunk's last query are never
visited, so both chunks together cost the same on every rank). The gathered K,V live one
layer; each rank outputs only its own two chunks' K,V (see kvr_jax.inference.kv_cache).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies import zigzag
from kvr_jax.strategies.base import (
  Strategy,
  count_trace,
  fold_batch,
  last_rank,
  model_reduce,
  spmd,
)
from kvr_jax.strategies.probe import mark
from models.base import no_reduce


def rank_program(
  graphdef,
  context_len: int,
  num_ranks: int,
  attention,
  timeline: bool = False,
  reduce=no_reduce,
):
  c = zigzag.chunk_len(context_len, num_ranks)
  p = num_ranks

  def program(state, tokens_1B2c):
    count_trace("allgather")
    model = nnx.merge(graphdef, state)
    rank = jax.lax.axis_index(AXIS)
    tokens_B2c = tokens_1B2c[0]
    B = tokens_B2c.shape[0]
    positions_B2c = zigzag.positions(rank, c, p, B)

    def layer(block, x_B2cD, l):
      q_B2cNH, k_B2cKH, v_B2cKH = block.project_qkv(x_B2cD, positions_B2c)
      own_2B2cKH = jnp.stack([k_B2cKH, v_B2cKH])
      q_B2cNH, own_2B2cKH = mark(timeline, "qkv", l, (q_B2cNH, own_2B2cKH))
      # [2, B, 2pc, K, H]: every rank's two chunks, in rank order, then in prompt order
      kv = jax.lax.all_gather(own_2B2cKH, AXIS, axis=2, tiled=True)
      kv = mark(timeline, "allgather", l, kv)
      kv = zigzag.in_prompt_order(kv, zigzag.padded_len(context_len, p), p, axis=2)
      outs = []
      for half, chunk in enumerate((rank, 2 * p - 1 - rank)):
        q_BcNH = q_B2cNH[:, half * c : (half + 1) * c]
        # The offset is traced (it depends on the rank): the flash kernel's loop bounds take
        # it as they are, so masked key blocks (and those before a sliding window) are
        # skipped on every rank.
        outs.append(block.attend(q_BcNH, kv[0], kv[1], chunk * c, attention))
      attn_B2cNH = mark(timeline, "attention", l, jnp.concatenate(outs, axis=1))
      x_B2cD = mark(timeline, "rest", l, block.finish(x_B2cD, attn_B2cNH, reduce=reduce))
      return x_B2cD, fold_batch(own_2B2cKH)

    return zigzag.run_layers(model, layer, tokens_B2c, context_len, p, timeline)

  return program


@functools.lru_cache(maxsize=64)
def compile_program(
  graphdef, mesh, chunks: tuple[int, ...], attention="flash", timeline: bool = False
):
  """f(state, tokens [p, B, 2c]) -> (logits [p, B, V], kv parts [p, L, 2, B*2c, K, H])."""
  program = rank_program(
    graphdef, sum(chunks), len(chunks), attention, timeline, model_reduce(mesh)
  )
  return spmd(program, mesh)


STRATEGY = Strategy(
  name="allgather",
  description="all-gather context parallelism: zigzag chunks, one all_gather of K,V per layer",
  partitioned=False,
  attention_kinds=("flash", "dense"),
  layout=zigzag.layout,
  arrange=zigzag.arrange,
  compile=compile_program,
  cache_rank=last_rank,
  cache_layout=zigzag.cache_layout,
  timeline_probes=True,
  attention_note="its chunks attend at a rank-dependent offset (flash or dense)",
)
