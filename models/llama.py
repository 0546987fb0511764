"""Llama 2 / Llama 3 in Flax NNX.

Legend: B batch, T tokens, D d_model, N query heads, K KV heads, H head dim, F MLP dim,
L layers. Block parameters carry a leading [L] axis (see models/base.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.base import Block, CausalLM, no_reduce, normal_param, ones_param
from models.config import LlamaConfig
from models.experts import mixture_of_experts
from models.norms import rms_norm


class LlamaBlock(Block):
  """Pre-norm attention then pre-norm SwiGLU MLP (or a mixture of SwiGLU experts), each with
  a residual."""

  def __init__(self, config: LlamaConfig, *, num_layers: int, dtype, rngs: nnx.Rngs):
    self.config = config
    L, D, F = num_layers, config.d_model, config.mlp_dim
    self.attn_norm = ones_param((L, D), dtype)
    self.init_attention(num_layers, dtype, rngs)
    self.mlp_norm = ones_param((L, D), dtype)
    if config.num_experts:  # a mixture of experts: a router and E SwiGLU experts
      E = config.num_experts
      self.router = normal_param(rngs, (L, D, E), dtype)
      self.w_gate = normal_param(rngs, (L, E, D, F), dtype)
      self.w_up = normal_param(rngs, (L, E, D, F), dtype)
      self.w_down = normal_param(rngs, (L, E, F, D), dtype)
    else:
      self.w_gate = normal_param(rngs, (L, D, F), dtype)
      self.w_up = normal_param(rngs, (L, D, F), dtype)
      self.w_down = normal_param(rngs, (L, F, D), dtype)

  def attention_input(self, x_BTD: jax.Array) -> jax.Array:
    return rms_norm(x_BTD, self.attn_norm[...], self.config.norm_eps)

  def finish_rows(self, x_BTD: jax.Array, attn_BTNH: jax.Array, reduce=no_reduce) -> jax.Array:
    x_BTD = x_BTD + reduce(self.attention_output(attn_BTNH))
    h_BTD = rms_norm(x_BTD, self.mlp_norm[...], self.config.norm_eps)
    cfg = self.config
    if cfg.num_experts:
      expert_weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
      mlp_BTD = mixture_of_experts(
        h_BTD,
        self.router[...],
        *expert_weights,
        cfg.experts_per_token,
        cfg.normalize_expert_weights,
      )
      return x_BTD + reduce(mlp_BTD)
    gate_BTF = jax.nn.silu(jnp.einsum("BTD,DF->BTF", h_BTD, self.w_gate[...]))
    up_BTF = jnp.einsum("BTD,DF->BTF", h_BTD, self.w_up[...])
    return x_BTD + reduce(jnp.einsum("BTF,FD->BTD", gate_BTF * up_BTF, self.w_down[...]))


class Llama(CausalLM):
  block_class = LlamaBlock

  def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    super().__init__(config, dtype=dtype, rngs=rngs)
    self.norm = ones_param((config.d_model,), dtype)

  def final_norm(self, x_BTD: jax.Array) -> jax.Array:
    return rms_norm(x_BTD, self.norm[...], self.config.norm_eps)
