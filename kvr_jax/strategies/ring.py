"""Zigzag ring attention (pass-KV context parallelism, ring-flash-attention's zigzag).

Zigzag layout (kvr_jax.strategies.zigzag): rank r holds chunks r and 2p-1-r of c tokens. Per
layer every rank projects its 2c tokens, then p steps: at step s it holds the K,V of rank
src = (r - s) mod p (both of src's chunks, own KV heads) and, before attending to them,
already sends them on to rank r+1 (one `ppermute` around the ring per step, p-1 in all), so
that XLA can overlap the transfer with the attention. Each step's attention is a partial
(output, log-sum-exp) merged exactly into the running result (`zigzag.zigzag_attention`):

  step 0      own K,V: chunk r causal for the first chunk; the second chunk sees chunk r
              in its past and its own chunk causally.
  src < r     both query chunks see src's first chunk (src < r) whole, its second not at all.
  src > r     only the second query chunk sees anything, and sees both of src's chunks whole.

Both cases are two c x c blocks wholly in the past: the same work on every rank and step (the
point of zigzag). With flash each partial is a call at the relative offset of its query and
key chunks, so a sliding window masks (and skips) by true positions; the ring still passes
every rank's K,V, whatever the window. With the two-piece kernels (fused, cudnn: no window)
each piece is a whole block or a causal diagonal, known statically.

Each rank outputs only its own two chunks' K,V ([L, 2, B, 2c, K, H]); the parts are brought
onto the last rank in prompt order after the program (cache="last") or stay where they are
(cache="sharded"), see kvr_jax.inference.kv_cache.
"""

from __future__ import annotations

import jax

from kvr_jax.runtime.mesh import AXIS
from kvr_jax.runtime.roofline import Compute, ModelledLayer, Work, phase_work, work_kwargs
from kvr_jax.strategies import latent_modelled, linear_modelled, zigzag
from kvr_jax.strategies.base import KindLayers, Strategy, refuse
from models.attention import attend_partial
from models.layer_kinds import GatedDeltaNetKind, LatentAttentionKind


def ring_attention(
  q_B2cNH,
  kv_own,
  rank,
  c: int,
  p: int,
  window: int | None,
  timeline: bool = False,
  layer=-1,
  attention="flash",
  sinks_N=None,
):
  """Rank's two query chunks against every rank's K,V, passed around the ring: at step s it
  receives the K,V of rank (r - s) mod p, and sends them on before attending to them (one
  `ppermute` around the ring per step), so that XLA can overlap the transfer with the
  attention (`zigzag.zigzag_attention`'s pieces). Returns [B, 2c, N, H] in q's dtype."""
  ring = [(i, (i + 1) % p) for i in range(p)]

  def passed_on(kv, step):
    del step
    return jax.lax.ppermute(kv, AXIS, perm=ring)

  return zigzag.zigzag_attention(
    q_B2cNH, kv_own, rank, c, p, window, attention, passed_on, timeline, layer, sinks_N
  )


def ring_body(graphdef, chunks, attention, timeline, keep_last_hop):
  """Ring attention's rank: its two zigzag chunks, K,V passed around the ring."""
  del graphdef
  refuse("ring", keep_last_hop=keep_last_hop)
  p = len(chunks)
  c = zigzag.chunk_len(sum(chunks), p)

  def attend_chunks(block, q_B2cNH, own_2B2cKH, rank, l):
    window = block.config.sliding_window
    return ring_attention(
      q_B2cNH, own_2B2cKH, rank, c, p, window, timeline, l, attention, block.sinks_N
    )

  return zigzag.peer_body(chunks, timeline, attend_chunks)


def modelled_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  """qkv on 2c tokens; p attention steps of 2c^2 visible scores each (own chunks causally at
  step 0, then a c x 2c or 2c x c unmasked block), the K,V of 2c tokens for step s+1 sent
  while step s computes, so each step takes the longer of the two (their sum when sends hold
  their sender, `Links.held_send`); the rest. With a window most blocks are skipped; the
  visible work is spread over the p steps (an approximation: the real steps are uneven),
  and every message still travels."""
  p = len(chunks)
  costs = zigzag.peer_costs(config, context_len, setup, p)
  per_step = costs.chunk if config.sliding_window is None else costs.visible / p
  c, kw = costs.chunk, work_kwargs(setup)
  step = phase_work(config, 2 * c, c, **kw, scored_keys=per_step)
  step_seconds = step["attention"].time(setup.hardware)
  message = costs.message_seconds
  if setup.links.held_send:
    overlapped = step_seconds + message
  else:
    overlapped = max(step_seconds, message)
  middle = (Compute("step", (p - 1) * overlapped + step_seconds),)
  attention = step["attention"]
  return zigzag.peer_layer(
    config, context_len, setup, costs, middle, Work(attention.flops * p, attention.bytes * p)
  )


def latent_layer(block, x_B2cD, rank, context_len: int, num_ranks: int, attention, reduce, probe):
  """Ring attention on a latent layer (`KindLayers.rank_layer`): its two zigzag chunks'
  latents passed around the ring (one ppermute per step of [B, 2c, C], the headless
  latent), and at each step the received chunks expanded into its heads' K,V and attended
  as ring attention does with K,V (`zigzag.zigzag_attention` over one-head entries; the
  kernel must return its log-sum-exp): (x [B, 2c, D], its own latents). probe: the
  timeline's marks, as on K,V layers ("qkv", "step1" .. "step{p-1}" after each step's
  merge, "attention", "rest")."""
  B, p = x_B2cD.shape[0], num_ranks
  c = zigzag.chunk_len(context_len, p)
  positions_B2c = zigzag.positions(rank, c, p, B)
  (q_nope, q_rope), own_1B2c1C = probe("qkv", block.project_entries(x_B2cD, positions_B2c))
  ring = [(i, (i + 1) % p) for i in range(p)]

  def passed_on(latents, step):
    del step
    return jax.lax.ppermute(latents, AXIS, perm=ring)

  def attend(q_BcNh, latents_1Bc1C, offset, kernel):
    k_BcNh, v_BcNh = block.expanded_keys_values(latents_1Bc1C[0, :, :, 0])
    return attend_partial(q_BcNh, k_BcNh, v_BcNh, offset, kernel)

  q_B2cNh = block.expanded_queries(q_nope, q_rope)
  attn = zigzag.zigzag_attention(
    q_B2cNh, own_1B2c1C, rank, c, p, None, attention, passed_on, attend=attend, probe=probe
  )
  attn = probe("attention", attn[..., : block.config.v_head_dim])
  return probe("rest", block.finish(x_B2cD, attn, reduce=reduce)), own_1B2c1C[0, :, :, 0]


STRATEGY = Strategy(
  name="ring",
  auto_candidate=True,
  description="zigzag ring attention: 2p chunks, K,V passed around the ring, flash partials",
  attention_kinds=("flash", "fused", "cudnn"),
  modelled_layer=modelled_layer,
  **zigzag.PEER_FIELDS,
  attention_note="ring attention merges partials by their log-sum-exp",
  merges_by_lse=True,
  rank_body=ring_body,
  kind_layers={
    LatentAttentionKind: KindLayers(latent_modelled.ring_latent_layer, latent_layer),
    # Each rank's linear maps gathered: two zigzag chunks per rank.
    GatedDeltaNetKind: KindLayers(linear_modelled.gathered_maps_layer(2)),
  },
)
