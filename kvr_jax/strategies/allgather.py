"""All-gather context parallelism (Llama 3, MaxText's default, Transformer Engine all_gather).

Zigzag layout (kvr_jax.strategies.zigzag): rank r holds chunks r and 2p-1-r. Per layer every
rank projects its 2c tokens, one tiled `all_gather` of K,V (own KV heads, a barrier) gives
every rank the whole prompt's K,V, which is put in prompt order, and each rank attends its two
chunks causally with the flash kernel (key blocks past a chunk's last query are never
visited, so both chunks together cost the same on every rank). The two-piece kernels (fused;
cudnn on GPUs), which take static offsets only, attend the gathered K,V in ring's pieces
instead (`zigzag.zigzag_attention`): per source rank, whole c x c blocks in the past or a
causal diagonal. The gathered K,V live one
layer; each rank outputs only its own two chunks' K,V (see kvr_jax.inference.kv_cache).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvr_jax.runtime.mesh import AXIS
from kvr_jax.runtime.roofline import Collective, Compute, ModelledLayer, phase_work, work_kwargs
from kvr_jax.strategies import latent_modelled, linear_modelled, zigzag
from kvr_jax.strategies.base import KindLayers, Strategy, refuse
from kvr_jax.strategies.probe import mark
from models.kernels import get_kernel
from models.layer_kinds import GatedDeltaNetKind, LatentAttentionKind


def allgather_body(graphdef, chunks, attention, timeline, keep_last_hop):
  """All-gather CP's rank: its two zigzag chunks against the gathered, reordered K,V."""
  del graphdef
  refuse("allgather", keep_last_hop=keep_last_hop)
  context_len, p = sum(chunks), len(chunks)
  c = zigzag.chunk_len(context_len, p)

  def attend_chunks(block, q_B2cNH, own_2B2cKH, rank, l):
    # [2, B, 2pc, K, H]: every rank's two chunks, in rank order, then in prompt order
    kv = jax.lax.all_gather(own_2B2cKH, AXIS, axis=2, tiled=True)
    kv = mark(timeline, "allgather", l, kv)
    if get_kernel(attention).computes == "two-piece":
      # A two-piece kernel (fused, cudnn) takes static offsets: ring's pieces (whole blocks
      # and causal diagonals), each source rank's K,V sliced from the gathered ones.
      def gathered(_, step):
        src = (rank - step) % p
        return jax.lax.dynamic_slice_in_dim(kv, src * 2 * c, 2 * c, axis=2)

      window = block.config.sliding_window
      return zigzag.zigzag_attention(
        q_B2cNH, own_2B2cKH, rank, c, p, window, attention, gathered, sinks_N=block.sinks_N
      )
    kv = zigzag.in_prompt_order(kv, zigzag.padded_len(context_len, p), p, axis=2)
    outs = []
    for half, chunk in enumerate((rank, 2 * p - 1 - rank)):
      q_BcNH = q_B2cNH[:, half * c : (half + 1) * c]
      # The offset is traced (it depends on the rank): the flash kernel's loop bounds take it
      # as they are, so masked key blocks (and those before a sliding window) are skipped on
      # every rank.
      outs.append(block.attend(q_BcNH, kv[0], kv[1], chunk * c, attention))
    return jnp.concatenate(outs, axis=1)

  return zigzag.peer_body(chunks, timeline, attend_chunks)


def modelled_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  """qkv; a barrier all-gather of 2c-token K,V in p-1 ring steps over the slowest link;
  attention of the two chunks over every visible key ((2pc+1)/2 per query on average with a
  causally skipping kernel, all 2pc with the dense one); the rest."""
  p = len(chunks)
  costs = zigzag.peer_costs(config, context_len, setup, p)
  keys = costs.visible if setup.causal_skip else zigzag.padded_len(context_len, p)
  kw = work_kwargs(setup)
  attention = phase_work(config, 2 * costs.chunk, keys, **kw, scored_keys=keys)["attention"]
  middle = (
    Collective("allgather", (p - 1) * costs.message_seconds),
    Compute("attention", attention.time(setup.hardware)),
  )
  return zigzag.peer_layer(config, context_len, setup, costs, middle, attention)


def latent_layer(block, x_B2cD, rank, context_len: int, num_ranks: int, attention, reduce, probe):
  """All-gather CP on a latent layer (`KindLayers.rank_layer`): its two zigzag chunks' latents
  all-gathered with every rank's, the whole prompt expanded, its queries attended causally
  (a `lax.switch` on the rank: each chunk's offset static, as every kernel takes): (x [B, 2c,
  D], its own latents). probe(label, value) -> value: the timeline's marks, as on K,V layers
  ("qkv", "allgather", "attention", "rest")."""
  B, p = x_B2cD.shape[0], num_ranks
  c = zigzag.chunk_len(context_len, p)
  positions_B2c = zigzag.positions(rank, c, p, B)
  (q_nope, q_rope), own_1B2c1C = probe("qkv", block.project_entries(x_B2cD, positions_B2c))
  own_B2cC = own_1B2c1C[0, :, :, 0]
  every_pB2cC = probe("allgather", jax.lax.all_gather(own_B2cC, AXIS))
  # Chunk j is rank j's first half (j < p) or rank 2p-1-j's second half.
  halves = [
    every_pB2cC[j, :, :c] if j < p else every_pB2cC[2 * p - 1 - j, :, c:] for j in range(2 * p)
  ]
  prompt_BSC = jnp.concatenate(halves, axis=1)  # the padded prompt's latents, in order

  def attend(q_nope, q_rope, prompt_BSC, r):
    pieces = []
    for rows, chunk in zip((slice(0, c), slice(c, 2 * c)), zigzag.rank_chunks(r, p), strict=True):
      keys_BSC = prompt_BSC[:, : (chunk + 1) * c]  # a chunk's queries see up to its own end
      pieces.append(
        block.attend_expanded(q_nope[:, rows], q_rope[:, rows], keys_BSC, chunk * c, attention)
      )
    return jnp.concatenate(pieces, axis=1)

  attn = jax.lax.switch(
    rank, [functools.partial(attend, r=r) for r in range(p)], q_nope, q_rope, prompt_BSC
  )
  attn = probe("attention", attn)
  return probe("rest", block.finish(x_B2cD, attn, reduce=reduce)), own_B2cC


STRATEGY = Strategy(
  name="allgather",
  auto_candidate=True,
  description="all-gather context parallelism: zigzag chunks, one all_gather of K,V per layer",
  attention_kinds=("flash", "dense", "fused", "cudnn"),
  modelled_layer=modelled_layer,
  **zigzag.PEER_FIELDS,
  attention_note="its chunks attend at a rank-dependent offset (flash, dense) or in ring's "
  "pieces (fused, cudnn)",
  rank_body=allgather_body,
  kind_layers={
    LatentAttentionKind: KindLayers(latent_modelled.allgather_latent_layer, latent_layer),
    # Each rank's linear maps gathered: two zigzag chunks per rank.
    GatedDeltaNetKind: KindLayers(linear_modelled.gathered_maps_layer(2)),
  },
)
