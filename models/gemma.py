"""Gemma 3 (text) in Flax NNX.

Legend: B batch, T tokens, D d_model, N query heads, K KV heads, H head dim, F MLP dim,
L layers. Block parameters carry a leading [L] axis (see models/base.py). What differs from
Llama: RMSNorms of the form x (1 + w) computed in float32 (before and after attention and the
MLP, and of each q and k head), GeGLU with tanh GELU, the embedding times sqrt(D), the
softmax scaled by query_pre_attn_scalar^-1/2 (folded into q), a tied head, and a window and
a RoPE per layer kind (`GemmaConfig.with_window`, what `scan_blocks` gives each layer).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.base import Block, CausalLM, no_reduce, normal_param, zeros_param
from models.config import GemmaConfig
from models.rope import apply_rope


def gemma_rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) * (1 + scale), in float32, cast back after the scale (Gemma's order)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (y * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


class GemmaBlock(Block):
  """Pre- and post-norm attention, pre- and post-norm GeGLU MLP, each with a residual."""

  def __init__(self, config: GemmaConfig, *, num_layers: int, dtype, rngs: nnx.Rngs):
    self.config = config
    L, D, F, H = num_layers, config.d_model, config.mlp_dim, config.head_dim
    self.init_attention(num_layers, dtype, rngs)  # wq, wk, wv, wo, q_norm, k_norm
    self.q_norm = zeros_param((L, H), dtype)  # x (1 + w): zero is the identity
    self.k_norm = zeros_param((L, H), dtype)
    for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"):
      setattr(self, name, zeros_param((L, D), dtype))
    self.w_gate = normal_param(rngs, (L, D, F), dtype)
    self.w_up = normal_param(rngs, (L, D, F), dtype)
    self.w_down = normal_param(rngs, (L, F, D), dtype)

  def attention_input(self, x_BTD: jax.Array) -> jax.Array:
    return gemma_rms_norm(x_BTD, self.attn_norm[...], self.config.norm_eps)

  def project_qkv(self, x_BTD: jax.Array, positions_BT: jax.Array):
    """Norm, projections, q/k norms, RoPE of this layer's kind; q carries the softmax scale
    query_pre_attn_scalar^-1/2 in place of the kernels' H^-1/2."""
    cfg = self.config
    h_BTD = self.attention_input(x_BTD)
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", h_BTD, self.wq[...])
    k_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, self.wk[...])
    v_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, self.wv[...])
    q_BTNH = gemma_rms_norm(q_BTNH, self.q_norm[...], cfg.norm_eps)
    k_BTKH = gemma_rms_norm(k_BTKH, self.k_norm[...], cfg.norm_eps)
    q_BTNH = apply_rope(q_BTNH, positions_BT, cfg.rope)
    k_BTKH = apply_rope(k_BTKH, positions_BT, cfg.rope)
    scale = math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar)
    return (q_BTNH * scale).astype(q_BTNH.dtype), k_BTKH, v_BTKH

  def finish_rows(self, x_BTD: jax.Array, attn_BTNH: jax.Array, reduce=no_reduce) -> jax.Array:
    eps = self.config.norm_eps
    attn_BTD = reduce(self.attention_output(attn_BTNH))
    x_BTD = x_BTD + gemma_rms_norm(attn_BTD, self.post_attn_norm[...], eps)
    h_BTD = gemma_rms_norm(x_BTD, self.mlp_norm[...], eps)
    gate_BTF = jax.nn.gelu(jnp.einsum("BTD,DF->BTF", h_BTD, self.w_gate[...]), approximate=True)
    up_BTF = jnp.einsum("BTD,DF->BTF", h_BTD, self.w_up[...])
    mlp_BTD = reduce(jnp.einsum("BTF,FD->BTD", gate_BTF * up_BTF, self.w_down[...]))
    return x_BTD + gemma_rms_norm(mlp_BTD, self.post_mlp_norm[...], eps)


class Gemma(CausalLM):
  block_class = GemmaBlock

  def __init__(self, config: GemmaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    super().__init__(config, dtype=dtype, rngs=rngs)
    self.norm = zeros_param((config.d_model,), dtype)

  def embed(self, tokens_BT: jax.Array) -> jax.Array:
    """The embedding times sqrt(D), the scale rounded to the weights' dtype first."""
    scale = jnp.asarray(math.sqrt(self.config.d_model), jnp.float32).astype(self.dtype)
    return super().embed(tokens_BT) * scale

  def final_norm(self, x_BTD: jax.Array) -> jax.Array:
    return gemma_rms_norm(x_BTD, self.norm[...], self.config.norm_eps)
