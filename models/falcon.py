"""Falcon (rotary, parallel attention + MLP) in Flax NNX.

Covers the Falcon-7B form (one KV head, one input LayerNorm feeding both branches) and the
Falcon-40B form (`new_decoder_architecture`: K KV heads, separate `ln_attn` and `ln_mlp`).
Legend: B batch, T tokens, D d_model, N query heads, K KV heads, H head dim, F MLP dim,
L layers. Block parameters carry a leading [L] axis (see models/base.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.base import Block, CausalLM, no_reduce, normal_param, ones_param, zeros_param
from models.config import FalconConfig
from models.norms import layer_norm


class FalconBlock(Block):
  """x + attention(LN_a(x)) + MLP(LN_m(x)); LN_m is LN_a unless `separate_mlp_norm`."""

  def __init__(self, config: FalconConfig, *, num_layers: int, dtype, rngs: nnx.Rngs):
    self.config = config
    L, D, F = num_layers, config.d_model, config.mlp_dim
    self.attn_norm_scale = ones_param((L, D), dtype)
    self.attn_norm_bias = zeros_param((L, D), dtype)
    if config.separate_mlp_norm:
      self.mlp_norm_scale = ones_param((L, D), dtype)
      self.mlp_norm_bias = zeros_param((L, D), dtype)
    self.init_attention(num_layers, dtype, rngs)
    self.w_in = normal_param(rngs, (L, D, F), dtype)
    self.w_out = normal_param(rngs, (L, F, D), dtype)

  def attention_input(self, x_BTD):
    return layer_norm(
      x_BTD, self.attn_norm_scale[...], self.attn_norm_bias[...], self.config.norm_eps
    )

  def finish_rows(self, x_BTD: jax.Array, attn_BTNH: jax.Array, reduce=no_reduce) -> jax.Array:
    # The MLP input norm is recomputed here rather than carried from project_qkv: it costs
    # O(T*D), and keeping the two halves independent lets a strategy run them apart.
    if self.config.separate_mlp_norm:
      h_BTD = layer_norm(
        x_BTD, self.mlp_norm_scale[...], self.mlp_norm_bias[...], self.config.norm_eps
      )
    else:
      h_BTD = self.attention_input(x_BTD)
    attn_out_BTD = self.attention_output(attn_BTNH)
    hidden_BTF = jax.nn.gelu(jnp.einsum("BTD,DF->BTF", h_BTD, self.w_in[...]), approximate=False)
    mlp_out_BTD = jnp.einsum("BTF,FD->BTD", hidden_BTF, self.w_out[...])
    # The parallel block adds both branches' partial sums before one reduction.
    return x_BTD + reduce(attn_out_BTD + mlp_out_BTD)


class Falcon(CausalLM):
  block_class = FalconBlock

  def __init__(self, config: FalconConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    super().__init__(config, dtype=dtype, rngs=rngs)
    self.norm_scale = ones_param((config.d_model,), dtype)
    self.norm_bias = zeros_param((config.d_model,), dtype)

  def final_norm(self, x_BTD: jax.Array) -> jax.Array:
    return layer_norm(x_BTD, self.norm_scale[...], self.norm_bias[...], self.config.norm_eps)
