"""All-gather context parallelism (Llama 3, MaxText's default, Transformer Engine all_gather).

Zigzag layout (kvr_jax.strategies.zigzag): rank r holds chunks r and 2p-1-r. Per layer every
rank projects its 2c tokens, one tiled `all_gather` of K,V (own KV heads, a barrier) gives
every rank the whole prompt's K,V, which is put in prompt order, and each rank attends its two
chunks causally with the flash kernel (key blocks past a chunk's last query are never
visited, so both chunks together cost the same on every rank). The gathered K,V live one
layer; each rank outputs only its own two chunks' K,V (see kvr_jax.inference.kv_cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies import zigzag
from kvr_jax.strategies.base import (
  Strategy,
  fold_batch,
  last_rank,
  refuse,
  strategy_compiler,
)
from kvr_jax.strategies.probe import mark


def allgather_body(graphdef, chunks, attention, timeline, keep_last_hop):
  """All-gather CP's rank: its two zigzag chunks against the gathered, reordered K,V."""
  del graphdef
  refuse("allgather", keep_last_hop=keep_last_hop)
  context_len, p = sum(chunks), len(chunks)
  c = zigzag.chunk_len(context_len, p)

  def make_body(model, rank, tokens_B2c, reduce):
    positions_B2c = zigzag.positions(rank, c, p, tokens_B2c.shape[0])

    def layer(block, x_B2cD, carry, l):
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
      return x_B2cD, carry, fold_batch(own_2B2cKH)

    return zigzag.rank_body(tokens_B2c, layer, context_len, p)

  return make_body


# f(state, tokens [p, B, 2c]) -> (logits [p, B, V], kv parts [p, L, 2, B*2c, K, H]).
compile_program = strategy_compiler("allgather", allgather_body, "flash")


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
