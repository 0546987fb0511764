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

from kvr_jax.runtime.cache_layout import contiguous_layout, fold_batch
from kvr_jax.runtime.mesh import AXIS
from kvr_jax.runtime.roofline import (
  Collective,
  Compute,
  ModelledLayer,
  kv_message_bytes,
  phase_seconds,
  phase_work,
  total_work,
  work_kwargs,
)
from kvr_jax.strategies import latent_modelled, linear_modelled
from kvr_jax.strategies.base import (
  KindLayers,
  RankBody,
  Strategy,
  owner_last_row,
  refuse,
)
from models.layer_kinds import GatedDeltaNetKind, LatentAttentionKind


def shard_len(context_len: int, num_ranks: int) -> int:
  return math.ceil(context_len / num_ranks)


def tsp_body(graphdef, chunks, attention, timeline, keep_last_hop):
  """TSP's rank: ceil(C/p) tokens from rank * c, all-gathered K,V, dense masked scores."""
  del graphdef, attention  # dense masked scores by definition
  refuse("tsp", timeline, keep_last_hop)
  context_len, p = sum(chunks), len(chunks)
  c = shard_len(context_len, p)
  owner, owner_row = divmod(context_len - 1, c)  # position C-1: on `owner` when p does not divide C

  def make_body(model, rank, tokens_Bc, reduce):
    B = tokens_Bc.shape[0]
    offset = rank * c
    positions_Bc = jnp.broadcast_to(offset + jnp.arange(c), (B, c))

    def layer(block, x_BcD, carry, at):
      l = at.index
      q_BcNH, k_BcKH, v_BcKH = block.project_qkv(x_BcD, positions_Bc)
      # [2, B, p*c, K, H]: every rank gets every rank's K,V
      kv = jax.lax.all_gather(jnp.stack([k_BcKH, v_BcKH]), AXIS, axis=2, tiled=True)

      def every_row(x_BcD):
        # Dense masked scores over all p*c keys (with a sliding window too: TSP skips nothing).
        attn_BcNH = block.attend(q_BcNH, kv[0], kv[1], offset, "dense")
        return block.finish(x_BcD, attn_BcNH, reduce=reduce)

      def last_row(x_BcD):  # the model's last layer: the prompt's last row alone is read
        last_position = (owner, owner_row, context_len - 1)
        return owner_last_row(block, x_BcD, q_BcNH, kv, rank, last_position, reduce)

      x_BcD = jax.lax.cond(l == model.config.num_layers - 1, last_row, every_row, x_BcD)
      # The rank keeps its own shard of the cache; the gathered K,V live one layer.
      return x_BcD, carry, fold_batch(jnp.stack([k_BcKH, v_BcKH]))

    return RankBody(tokens_Bc, layer, lambda x_BcD: x_BcD[:, owner_row], owner)

  return make_body


def layout(context_len: int, num_ranks: int, chunks=None) -> tuple[int, ...]:
  """Real tokens per rank: ceil(C/p) each from the start, so the last ranks may hold fewer
  (or none: C=13 on 8 ranks is 2,2,2,2,2,2,1,0); their padding is masked."""
  del chunks  # TSP always splits evenly
  c = shard_len(context_len, num_ranks)
  return tuple(max(0, min(c, context_len - r * c)) for r in range(num_ranks))


def pad_shards(tokens_BC, num_ranks: int):
  """[B, C] -> [p, B, ceil(C/p)], zero-padded at the end."""
  tokens_BC = np.asarray(tokens_BC)
  B, C = tokens_BC.shape
  c = shard_len(C, num_ranks)
  padded = np.zeros((B, c * num_ranks), tokens_BC.dtype)
  padded[:, :C] = tokens_BC
  return padded.reshape(B, num_ranks, c).transpose(1, 0, 2)


def modelled_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  """Identical ranks of c = ceil(C/p) tokens: qkv, the all-gather of every rank's chunk (a
  barrier; a ring all-gather, p-1 steps over the slowest link), dense attention over all pc
  keys, the rest."""
  p, links = len(chunks), setup.links
  c = shard_len(context_len, p)
  phases = phase_work(config, c, c * p, **work_kwargs(setup))
  seconds = phase_seconds(config, phases, c, setup)
  chunk_bytes = kv_message_bytes(config, c, setup.batch, setup.dtype_bytes)
  allgather = (p - 1) * (chunk_bytes / links.slowest(p) + links.latency) if p > 1 else 0.0
  steps = (
    Compute("qkv", seconds["qkv"]),
    Collective("allgather", allgather),
    Compute("attention", seconds["attention"]),
    Compute("rest", seconds["rest"]),
  )
  total = total_work(phases)
  return ModelledLayer(
    (steps,) * p, (c,) * p, (total.flops,) * p, (total.bytes,) * p, ((p - 1) * chunk_bytes,) * p
  )


def latent_layer(block, x_BcD, rank, context_len: int, num_ranks: int, attention, reduce, probe):
  """TSP on a latent layer (`KindLayers.rank_layer`): its contiguous chunk of c = ceil(C/p)
  rows (the last ranks' padded), every rank's latents all-gathered in prompt order, the whole
  padded prompt expanded, and its queries attended with dense masked scores over every key
  (a `lax.switch` on the rank: each offset static, as the kernels take it; TSP's kernel is
  part of its definition, so `attention` is not used): (x [B, c, D], its own latents). No
  probes: TSP's record places none (`timeline_probes`), on K,V layers or latents."""
  del attention, probe
  B, p = x_BcD.shape[0], num_ranks
  c = shard_len(context_len, p)
  positions_Bc = jnp.broadcast_to(rank * c + jnp.arange(c), (B, c))
  (q_nope, q_rope), own_1Bc1C = block.project_entries(x_BcD, positions_Bc)
  own_BcC = own_1Bc1C[0, :, :, 0]
  prompt_BSC = jax.lax.all_gather(own_BcC, AXIS, axis=1, tiled=True)  # [B, p c, C]

  def attend(q_nope, q_rope, prompt_BSC, r):
    return block.attend_expanded(q_nope, q_rope, prompt_BSC, r * c, "dense")

  attn = jax.lax.switch(
    rank, [functools.partial(attend, r=r) for r in range(p)], q_nope, q_rope, prompt_BSC
  )
  return block.finish(x_BcD, attn, reduce=reduce), own_BcC


STRATEGY = Strategy(
  name="tsp",
  fixed_kernel=True,
  description="the paper's baseline: even split, all-gather K,V, dense masked scores",
  partitioned=False,
  attention_kinds=("dense",),
  layout=layout,
  arrange=lambda tokens_BC, chunks: pad_shards(tokens_BC, len(chunks)),
  rank_body=tsp_body,
  cache_layout=lambda context_len, chunks: contiguous_layout(
    layout(context_len, len(chunks)), part_len=shard_len(context_len, len(chunks))
  ),
  modelled_layer=modelled_layer,
  attention_note="TSP computes dense masked scores by definition",
  kind_layers={
    LatentAttentionKind: KindLayers(latent_modelled.tsp_latent_layer, latent_layer),
    # Each rank's linear maps gathered: one contiguous chunk per rank.
    GatedDeltaNetKind: KindLayers(linear_modelled.gathered_maps_layer(1)),
  },
)
