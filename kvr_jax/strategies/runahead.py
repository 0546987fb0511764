"""KV-Runahead prefill under `jax.shard_map`: uneven chunks, a point-to-point K,V hop chain.

One jitted SPMD program; every rank runs the layer loop below on its own chunk. Per layer:

  rank:        0            1                 2                    3
  own chunk  [0,S0)      [S0,S1)           [S1,S2)              [S2,C)
  project    q,k,v       q,k,v             q,k,v                q,k,v       (switch: c_i rows)
  hop 0      kv[0,S0) ─────▶ kv[0,S0)
  hop 1                  kv[0,S1) ───────────▶ kv[0,S1)
  hop 2                                    kv[0,S2) ──────────────▶ kv[0,C)
  attend     c0 x S0     c1 x S1           c2 x S2              c3 x C      (switch: static)
  finish     MLP c0      MLP c1            MLP c2               MLP c3

Every rank holds a [B, c_max] padded chunk because SPMD needs one static shape, but the
per-rank work is a `lax.switch` on the rank index whose branch i slices exactly c_i rows and
S_i keys: no FLOP is spent on padding. Hop k is a `ppermute` with the single pair (k, k+1)
that sends the static prefix [0, S_k) of the accumulation buffer, K and V stacked in one
message, with their own K heads (never repeated to the N query heads).

The last rank ends with the whole KV cache of every layer in its accumulation buffer, but the
program keeps only one layer of it at a time: each rank outputs its own chunk's K,V
([L, 2, B, c_max, K, H], padded to the largest chunk), never a prompt-long stack. The parts
are brought onto the last rank in prompt order after the program (cache="last", the paper's
layout) or stay where they were computed (cache="sharded"; kvr_jax.inference.kv_cache).

Sliding window W (Mistral): query q sees only keys (q - W, q], so hop k carries only the last
W-1 keys of [0, S_k) and each rank attends to [start - W + 1, S_i): hop bytes and attention
are bounded by W whatever the prompt length. The last rank then holds the K,V decode needs,
positions [C - W + 1, C) and more; positions no rank passed on stay zero in its cache, and
decode masks by the window, so it never reads them. The cache parts hold every position
(each rank keeps its whole chunk).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvr_jax.core.chunks import chunk_starts, prefix_ends
from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies.base import (
  CAUSAL_KERNELS,
  Strategy,
  count_trace,
  fold_batch,
  last_rank,
  spmd,
)
from kvr_jax.strategies.probe import mark
from models import layers, scan_blocks


def project_own_chunk(block, x_BcD, i: int, chunks: tuple[int, ...], cache_len: int):
  """Rank i, static shapes: Q of its c_i tokens, and an accumulation buffer with its own K,V.

  Returns q [B, c_max, N, H] (rows past c_i are zero), kv [2, B, cache_len, K, H] holding
  K,V at [S_{i-1}, S_i) and zeros elsewhere, and own [2, B, c_max, K, H]: this rank's part of
  the cache (rows past c_i zero).
  """
  c, start = chunks[i], chunk_starts(chunks)[i]
  B, c_max, _ = x_BcD.shape
  positions_Bc = jnp.broadcast_to(start + jnp.arange(c), (B, c))
  q_BcNH, k_BcKH, v_BcKH = block.project_qkv(x_BcD[:, :c], positions_Bc)
  K, H = k_BcKH.shape[2:]
  # [2, B, cache_len, K, H]: K and V travel as one message
  kv = jnp.zeros((2, B, cache_len, K, H), k_BcKH.dtype)
  own_2BcKH = jnp.stack([k_BcKH, v_BcKH])
  kv = jax.lax.dynamic_update_slice_in_dim(kv, own_2BcKH, start, axis=2)
  q_pad = jnp.pad(q_BcNH, ((0, 0), (0, c_max - c), (0, 0), (0, 0)))
  own_pad = jnp.pad(own_2BcKH, ((0, 0), (0, 0), (0, c_max - c), (0, 0), (0, 0)))
  return q_pad, kv, own_pad


def attend_and_finish(
  block,
  x_BcD,
  q_BcNH,
  kv,
  i: int,
  chunks: tuple[int, ...],
  attention: str = "dense",
  timeline: bool = False,
  layer=-1,
):
  """Rank i, static shapes: its c_i queries against the S_i-key prefix, then the block's rest.

  attention "dense" computes the c_i x S_i rectangle (the paper's count); "blocked" and
  "flash" also skip the masked upper triangle of the rank's own diagonal block. With a sliding
  window the prefix starts at the chunk's window start.
  """
  c, start, end = chunks[i], chunk_starts(chunks)[i], prefix_ends(chunks)[i]
  c_max = x_BcD.shape[1]
  # With a sliding window W the chunk's first query sees nothing before start - W + 1.
  first = layers.window_start(start, block.config.sliding_window)
  attn_BcNH = block.attend(
    q_BcNH[:, :c], kv[0, :, first:end], kv[1, :, first:end], start - first, attention
  )
  attn_BcNH = mark(timeline, "attention", layer, attn_BcNH)
  out_BcD = block.finish(x_BcD[:, :c], attn_BcNH)
  return jnp.pad(out_BcD, ((0, 0), (0, c_max - c), (0, 0)))


def rank_layer(block, x_BcD, kv_prefix, i: int, chunks: tuple[int, ...], attention="dense"):
  """Rank i's whole layer given the prefix it received: the unit of per-rank cost.

  Used only to measure one rank's compiled cost in isolation (cost analysis); the SPMD program
  runs the same two functions with the hop chain between them.
  """
  q, kv, _ = project_own_chunk(block, x_BcD, i, chunks, kv_prefix.shape[2])
  kv = kv + kv_prefix
  return attend_and_finish(block, x_BcD, q, kv, i, chunks, attention), kv


def hop_span(k: int, chunks: tuple[int, ...], window: int | None) -> tuple[int, int]:
  """The key positions [a, S_k) hop k carries: the whole prefix, or with a sliding window W
  only the last W-1 keys of it (all that any later query can see): bounded by W, not by C."""
  end = prefix_ends(chunks)[k]
  return layers.window_start(end, window), end


def hop_chain(
  kv, rank, chunks: tuple[int, ...], window: int | None = None, timeline: bool = False, layer=-1
):
  """p-1 hops: hop k sends kv[:, :, a:S_k] (hop_span) from rank k to rank k+1, one pair per
  ppermute. A rank whose chunk is shorter than the window forwards part of what it received
  (it sits in its buffer beside its own keys)."""
  for k in range(len(chunks) - 1):
    a, end = hop_span(k, chunks, window)
    received = jax.lax.ppermute(kv[:, :, a:end], AXIS, perm=[(k, k + 1)])
    # ppermute gives zeros to ranks outside the pair: only rank k+1 takes the message.
    prefix = jnp.where(rank == k + 1, received, kv[:, :, a:end])
    kv = jax.lax.dynamic_update_slice_in_dim(kv, prefix, a, axis=2)
    kv = mark(timeline, f"hop{k}", layer, kv)
  return kv


def rank_program(
  graphdef,
  chunks: tuple[int, ...],
  cache_len: int,
  attention: str = "dense",
  timeline: bool = False,
) -> Callable:
  """The per-rank body that shard_map runs: (state, tokens [1, B, c_max]) -> outputs.
  timeline: probes at every phase boundary (kvr_jax.strategies.probe)."""
  p = len(chunks)

  def program(state, tokens_1Bc):
    count_trace("kvr")
    model = nnx.merge(graphdef, state)
    rank = jax.lax.axis_index(AXIS)
    x_BcD = mark(timeline, "embed", -1, model.embed(tokens_1Bc[0]))

    def layer(block, x_BcD, l):
      q_BcNH, kv, own_2BcKH = jax.lax.switch(
        rank,
        [
          functools.partial(project_own_chunk, block, i=i, chunks=chunks, cache_len=cache_len)
          for i in range(p)
        ],
        x_BcD,
      )
      q_BcNH, kv, own_2BcKH = mark(timeline, "qkv", l, (q_BcNH, kv, own_2BcKH))
      kv = hop_chain(kv, rank, chunks, model.config.sliding_window, timeline, l)
      x_BcD = jax.lax.switch(
        rank,
        [
          functools.partial(
            attend_and_finish,
            block,
            i=i,
            chunks=chunks,
            attention=attention,
            timeline=timeline,
            layer=l,
          )
          for i in range(p)
        ],
        x_BcD,
        q_BcNH,
        kv,
      )
      x_BcD = mark(timeline, "rest", l, x_BcD)
      # Only this rank's chunk leaves the layer: the prompt-long buffer lives one layer.
      return x_BcD, fold_batch(own_2BcKH)

    layers_L = jnp.arange(model.config.num_layers)
    x_BcD, kv_L2RKH = scan_blocks(model.blocks, layer, x_BcD, layers_L)  # R = B * c_max rows
    # Each rank's last real row; on rank p-1 that is the prompt's last position.
    last_BD = jax.lax.switch(rank, [lambda x, i=i: x[:, chunks[i] - 1] for i in range(p)], x_BcD)
    logits_BV = mark(timeline, "logits", -1, model.logits(last_BD[:, None])[:, 0])
    return logits_BV[None], kv_L2RKH[None]

  return program


@functools.lru_cache(maxsize=64)
def compile_program(
  graphdef, mesh, chunks: tuple[int, ...], attention: str = "dense", timeline: bool = False
):
  """The jitted KV-Runahead prefill for one (model graph, mesh, partition, attention); cached.

  Returns f(state, tokens [p, B, c_max]) -> (logits [p, B, V], kv parts [p, L, 2, B*c_max,
  K, H]); rank p-1's logits are the answer, rank i's part is its chunk's K,V.
  """
  return spmd(rank_program(graphdef, chunks, sum(chunks), attention, timeline), mesh)


def pad_chunks(tokens_BC, chunks: tuple[int, ...]):
  """[B, C] -> [p, B, c_max]: rank i's tokens, zero-padded to the largest chunk."""
  tokens_BC = np.asarray(tokens_BC)
  c_max = max(chunks)
  out = np.zeros((len(chunks), tokens_BC.shape[0], c_max), tokens_BC.dtype)
  for i, (start, c) in enumerate(zip(chunk_starts(chunks), chunks, strict=True)):
    out[i, :, :c] = tokens_BC[:, start : start + c]
  return out


def layout(context_len: int, num_ranks: int, chunks: tuple[int, ...]) -> tuple[int, ...]:
  return chunks  # the user's (validated) partition, rank 0 the earliest tokens


STRATEGY = Strategy(
  name="kvr",
  description="KV-Runahead: uneven chunks, point-to-point K,V hop chain, causal skipping",
  partitioned=True,
  attention_kinds=CAUSAL_KERNELS,
  layout=layout,
  arrange=pad_chunks,
  compile=compile_program,
  cache_rank=last_rank,
  timeline_probes=True,
)
