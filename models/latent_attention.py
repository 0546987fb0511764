"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, Moonlight) with its weights, as
transformers 5 computes it (`DeepseekV3Attention`).

Legend: B batch, T tokens, S cache positions, D d_model, N heads, Q the q low-rank dim, R the
latent dim (kv_lora_rank), r the rope dim, n the no-rope key dim, v the value dim, C = R + r
(one cache entry per token, shared by every head).

A token's past is one latent: kv_a_proj_with_mqa gives R numbers (RMS-normed) and r numbers of
a rope key every head shares (RoPE applied). Prefill expands the latent into each head's key
(its n no-rope numbers from kv_b_proj, then the shared rope key) and value and attends as
multi-head attention. Decode attends in the absorbed form: each head's no-rope query is taken
into the latent space through kv_b_proj's key half, so the new token's query attends the C-wide
cache as one key head shared by all N (an MQA over C = 576 numbers for DeepSeek-V3), and the
latent-space output goes back through kv_b_proj's value half. Both forms are the same sums.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from models.attention import attend_partial, attend_static
from models.base import normal_param, ones_param
from models.masks import MASK_VALUE
from models.norms import rms_norm
from models.rope import apply_rope


class LatentAttention(nnx.Module):
  """The attention half of an MLA layer (weights stacked over L layers); `config` a
  DeepSeek-V3 config (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
  v_head_dim, rope, rope_interleave, softmax_scale)."""

  def init_attention(self, L: int, dtype, rngs: nnx.Rngs) -> None:
    cfg = self.config
    D, N, Q, R = cfg.d_model, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    n, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    self.attn_norm = ones_param((L, D), dtype)
    if Q:  # q through a low-rank bottleneck with its own norm
      self.wq_a = normal_param(rngs, (L, D, Q), dtype)
      self.q_a_norm = ones_param((L, Q), dtype)
      self.wq_b = normal_param(rngs, (L, Q, N, n + r), dtype)
    else:
      self.wq = normal_param(rngs, (L, D, N, n + r), dtype)
    self.wkv_a = normal_param(rngs, (L, D, R + r), dtype)  # kv_a_proj_with_mqa
    self.kv_a_norm = ones_param((L, R), dtype)
    self.wk_b = normal_param(rngs, (L, R, N, n), dtype)  # kv_b_proj's key half
    self.wv_b = normal_param(rngs, (L, R, N, v), dtype)  # and its value half
    self.wo = normal_param(rngs, (L, N, v, D), dtype)

  def queries(self, h_BTD, positions_BT):
    """(no-rope queries [B, T, N, n], rope queries [B, T, N, r]) of the normed input."""
    cfg = self.config
    if cfg.q_lora_rank:
      low_BTQ = jnp.einsum("BTD,DQ->BTQ", h_BTD, self.wq_a[...])
      low_BTQ = rms_norm(low_BTQ, self.q_a_norm[...], cfg.norm_eps)
      q_BTNh = jnp.einsum("BTQ,QNh->BTNh", low_BTQ, self.wq_b[...])
    else:
      q_BTNh = jnp.einsum("BTD,DNh->BTNh", h_BTD, self.wq[...])
    q_nope, q_rope = jnp.split(q_BTNh, [cfg.qk_nope_head_dim], axis=-1)
    return q_nope, rope(q_rope, positions_BT, cfg)

  def latents(self, h_BTD, positions_BT):
    """Each token's cache entry [B, T, C]: its normed latent, then its rope key (RoPE'd)."""
    cfg = self.config
    entry_BTC = jnp.einsum("BTD,DC->BTC", h_BTD, self.wkv_a[...])
    latent_BTR, k_rope_BTr = jnp.split(entry_BTC, [cfg.kv_lora_rank], axis=-1)
    latent_BTR = rms_norm(latent_BTR, self.kv_a_norm[...], cfg.norm_eps)
    k_rope_BTr = rope(k_rope_BTr[:, :, None], positions_BT, cfg)[:, :, 0]
    return jnp.concatenate([latent_BTR, k_rope_BTr], axis=-1)

  def attend_expanded(
    self, q_nope_BTNn, q_rope_BTNr, cache_BSC, query_offset: int = 0, attention="dense"
  ):
    """Prefill: the latents (of positions 0..S-1) expanded into every head's keys (no-rope
    part from kv_b_proj, then the shared rope key) and values, and causal attention of the T
    queries at positions query_offset + t (static) over them with the kernel `attention` (a
    models.kernels record or name: dense, blocked, flash, ...); [B, T, N, v]. The kernels
    take one head width, so the values are zero-padded to the keys' (an exact pad, cut from
    the output), and the queries carry the model's softmax scale over the kernel's
    1/sqrt(width)."""
    q_BTNh = self.expanded_queries(q_nope_BTNn, q_rope_BTNr)
    k_BSNh, v_BSNh = self.expanded_keys_values(cache_BSC)
    out_BTNh = attend_static(q_BTNh, k_BSNh, v_BSNh, query_offset, attention)
    return out_BTNh[..., : self.config.v_head_dim]

  def expanded_queries(self, q_nope_BTNn, q_rope_BTNr):
    """Each head's query as the kernels take it: no-rope then rope part [B, T, N, n + r],
    scaled by the model's softmax scale over the kernel's 1/sqrt(n + r)."""
    q_BTNh = jnp.concatenate([q_nope_BTNn, q_rope_BTNr], axis=-1)
    width = q_BTNh.shape[-1]
    return q_BTNh * jnp.asarray(self.config.softmax_scale * width**0.5, q_BTNh.dtype)

  def expanded_keys_values(self, cache_BSC):
    """Latents [B, S, C] expanded into every head's keys [B, S, N, n + r] (kv_b_proj's key
    half, then the shared rope key) and values zero-padded to the keys' width (an exact pad:
    cut the attention's output to v_head_dim)."""
    cfg = self.config
    latent_BSR, k_rope_BSr = jnp.split(cache_BSC, [cfg.kv_lora_rank], axis=-1)
    k_nope_BSNn = jnp.einsum("BSR,RNn->BSNn", latent_BSR, self.wk_b[...])
    v_BSNv = jnp.einsum("BSR,RNv->BSNv", latent_BSR, self.wv_b[...])
    N, v = v_BSNv.shape[2:]
    k_rope_BSNr = jnp.broadcast_to(
      k_rope_BSr[:, :, None], (*k_rope_BSr.shape[:2], N, k_rope_BSr.shape[-1])
    )
    k_BSNh = jnp.concatenate([k_nope_BSNn, k_rope_BSNr], axis=-1)
    width = k_BSNh.shape[-1]
    if v > width:
      raise ValueError(f"latent attention's kernels need v_head_dim <= nope + rope, got {v}")
    return k_BSNh, jnp.pad(v_BSNv, ((0, 0), (0, 0), (0, 0), (0, width - v)))

  def project_entries(self, x_BTD, positions_BT):
    """((no-rope queries, rope queries), cache entries [1, B, T, 1, C]): the latents as a
    one-head entry, so that a strategy passes them as it passes K,V (`Block.project_entries`)."""
    h_BTD = self.attention_input(x_BTD)
    return self.queries(h_BTD, positions_BT), self.latents(h_BTD, positions_BT)[None, :, :, None]

  def attend_entries(self, queries, entries_1BS1C, query_offset, attention):
    """`attend_expanded` of `queries` over latents as `project_entries` gives them."""
    q_nope_BTNn, q_rope_BTNr = queries
    return self.attend_expanded(
      q_nope_BTNn, q_rope_BTNr, entries_1BS1C[0, :, :, 0], query_offset, attention
    )

  def attend_entries_partial(self, queries, entries_1BS1C, query_offset, attention, lengths=None):
    """`attend_entries` for the kernels that return their log-sum-exp (flash): (out [B, T,
    N, v] float32, lse [B, T, N] float32) over the latents given (expanded here), to merge
    with the same queries' partial over other latents (KV-Runahead's early diagonal).
    lengths: the inputs' real extent as data (`models.flash.Lengths`; the one body)."""
    q_nope_BTNn, q_rope_BTNr = queries
    q_BTNh = self.expanded_queries(q_nope_BTNn, q_rope_BTNr)
    k_BSNh, v_BSNh = self.expanded_keys_values(entries_1BS1C[0, :, :, 0])
    out_BTNh, lse_BTN = attend_partial(
      q_BTNh, k_BSNh, v_BSNh, query_offset, attention, lengths=lengths
    )
    return out_BTNh[..., : self.config.v_head_dim], lse_BTN

  def attend_absorbed(self, q_nope_BNn, q_rope_BNr, cache_BSC, positions_B):
    """Decode: one query per row (row b at positions_B[b]) against the C-wide cache, each
    head's query taken into the latent space; [B, N, v]."""
    q_BNC = self.absorbed_query(q_nope_BNn, q_rope_BNr)
    visible_BS = jnp.arange(cache_BSC.shape[1])[None, :] <= positions_B[:, None]
    out_BNR, _ = self.absorbed_partial(q_BNC, cache_BSC, visible_BS[:, None])
    return self.expand_values(out_BNR.astype(cache_BSC.dtype))

  def attend_absorbed_chunk(self, q_nope_BTNn, q_rope_BTNr, cache_BSC, query_offset: int = 0):
    """The absorbed form for T queries at positions query_offset + t (static) over the latents
    of positions 0..S-1, causal: each head's no-rope query taken into the latent space, dense
    float32 scores against the C-wide latents (an MQA), the output back through kv_b_proj's
    value half; [B, T, N, v]. The same sums as `attend_expanded`, with no per-head keys or
    values built: it costs N (R + r + R) multiply-adds per query and key against the expanded
    form's N (n + r + v), but nothing per key beyond that, where expanding costs R N (n + v)
    per key. What a rank with few queries over a long prefix might run instead of expanding
    (launch.harness.latent_forms measures which is faster; prefill expands, docs/models.md)."""
    q_BTNC = self.absorbed_query(q_nope_BTNn, q_rope_BTNr)
    B, T, N, C = q_BTNC.shape
    visible_TS = jnp.arange(cache_BSC.shape[1])[None, :] <= query_offset + jnp.arange(T)[:, None]
    # The T queries as T x N heads of one row, each (t, n) seeing query t's keys.
    visible_1XS = jnp.repeat(visible_TS, N, axis=0)[None]
    out_BXR, _ = self.absorbed_partial(q_BTNC.reshape(B, T * N, C), cache_BSC, visible_1XS)
    return self.expand_values(out_BXR.reshape(B, T, N, -1).astype(cache_BSC.dtype))

  def absorbed_query(self, q_nope_BNn, q_rope_BNr):
    """Each head's query in the latent space, then its rope part: [B, N, C] (any leading
    axes before the heads: [B, T, N, C] for a chunk)."""
    q_latent_BNR = jnp.einsum("...Nn,RNn->...NR", q_nope_BNn, self.wk_b[...])
    return jnp.concatenate([q_latent_BNR, q_rope_BNr], axis=-1)

  def absorbed_partial(self, q_BNC, cache_BSC, visible_BNS):
    """The absorbed attention over the `visible_BNS` positions of `cache_BSC` alone (a mask
    broadcast over the heads: [B, 1, S] for a row's positions): (its
    latent-space output [B, N, R] float32, its log-sum-exp [B, N] float32; a row that sees
    nothing: 0 and -inf), so that attentions over disjoint positions merge exactly
    (models.attention.merge_partials; a sharded cache's parts)."""
    cfg = self.config
    scores_BNS = jnp.einsum("BNC,BSC->BNS", q_BNC, cache_BSC).astype(jnp.float32)
    scores_BNS = jnp.where(visible_BNS, scores_BNS * cfg.softmax_scale, MASK_VALUE)
    max_BN = jnp.max(scores_BNS, axis=-1)
    weights_BNS = jnp.where(visible_BNS, jnp.exp(scores_BNS - max_BN[..., None]), 0.0)
    total_BN = weights_BNS.sum(axis=-1)
    latent_BSR = cache_BSC[..., : cfg.kv_lora_rank]
    out_BNR = jnp.einsum(
      "BNS,BSR->BNR",
      weights_BNS.astype(latent_BSR.dtype),
      latent_BSR,
      preferred_element_type=jnp.float32,
    )
    seen_BN = total_BN > 0
    total_BN = jnp.where(seen_BN, total_BN, 1.0)
    return out_BNR / total_BN[..., None], jnp.where(seen_BN, max_BN + jnp.log(total_BN), -jnp.inf)

  def expand_values(self, out_BNR):
    """A latent-space attention output through kv_b_proj's value half: [B, N, v]."""
    return jnp.einsum("...NR,RNv->...Nv", out_BNR, self.wv_b[...])

  def attention_output(self, attn_BTNv):
    return jnp.einsum("BTNv,NvD->BTD", attn_BTNv, self.wo[...])


def rope(x_BTnr, positions_BT, config):
  """RoPE on the rope part of each head. With `rope_interleave` (DeepSeek's checkpoints) the
  pairs are adjacent features (x0, x1), (x2, x3), ...: transformers rotates them and returns
  the even features' results then the odd ones', which is the `rotate_half` RoPE of the
  de-interleaved vector (evens, then odds)."""
  if config.rope_interleave:
    x_BTnr = jnp.concatenate([x_BTnr[..., 0::2], x_BTnr[..., 1::2]], axis=-1)
  return apply_rope(x_BTnr, positions_BT, config.rope)
