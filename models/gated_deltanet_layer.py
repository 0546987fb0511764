"""The Gated DeltaNet layer of Qwen3.5 and Qwen3-Next, with its weights: (1 + w) RMSNorm, the
fused q/k/v projections through the causal convolution, the gated delta rule
(models/gated_deltanet.py), the gated RMSNorm and out_proj, then the (1 + w) RMSNorm and SwiGLU
MLP that every layer of these models ends with (`OnePlusNormMlp`, shared with the full layers).

Legend: B batch, T tokens, D d_model, F MLP dim, h value heads, k key dim, v value dim, C the
convolution's channels, W its kernel, w = W - 1.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models import gated_deltanet as gdn
from models.base import (
  ROW_BLOCK,
  first_local_expert,
  in_row_blocks,
  no_reduce,
  normal_param,
  ones_param,
  zeros_param,
)
from models.experts import route_softmax_top_k, run_experts, swiglu
from models.norms import rms_norm_one_plus


class OnePlusNormMlp:
  """The (1 + w) norm, MLP and residual every layer of Qwen3.5 and Qwen3-Next ends with: a
  SwiGLU MLP, or (`num_experts` > 0: Qwen3.5-MoE, Qwen3-Next) a mixture of SwiGLU experts
  (models/experts.py) plus a shared SwiGLU expert that every token runs through, scaled by
  sigmoid(h . shared_gate) (transformers' `shared_expert_gate`)."""

  def init_mlp(self, L: int, dtype, rngs: nnx.Rngs) -> None:
    cfg = self.config
    D, F, E = cfg.d_model, cfg.mlp_dim, cfg.num_experts
    self.mlp_norm = zeros_param((L, D), dtype)  # x (1 + w): zero is the identity
    experts = (L, E) if E else (L,)  # a dense MLP is one expert, without the axis
    self.w_gate = normal_param(rngs, (*experts, D, F), dtype)
    self.w_up = normal_param(rngs, (*experts, D, F), dtype)
    self.w_down = normal_param(rngs, (*experts, F, D), dtype)
    if E:
      Fs = cfg.shared_expert_dim
      self.router = normal_param(rngs, (L, D, E), dtype)
      self.w_shared_gate = normal_param(rngs, (L, D, Fs), dtype)
      self.w_shared_up = normal_param(rngs, (L, D, Fs), dtype)
      self.w_shared_down = normal_param(rngs, (L, Fs, D), dtype)
      self.shared_gate = normal_param(rngs, (L, D), dtype)

  def mlp(self, x_BTD, reduce=no_reduce):
    cfg = self.config
    h_BTD = rms_norm_one_plus(x_BTD, self.mlp_norm[...], cfg.norm_eps)
    if not cfg.num_experts:
      return x_BTD + reduce(swiglu(h_BTD, self.w_gate[...], self.w_up[...], self.w_down[...]))
    weights_BTk, experts_BTk = route_softmax_top_k(
      h_BTD, self.router[...], None, cfg.experts_per_token, cfg.normalize_expert_weights
    )
    w_gate = self.w_gate[...]
    first = first_local_expert(w_gate.shape[0], cfg.num_experts, reduce)  # experts split
    routed_BTD = run_experts(
      h_BTD, weights_BTk, experts_BTk, w_gate, self.w_up[...], self.w_down[...], first
    )
    shared_BTD = swiglu(
      h_BTD, self.w_shared_gate[...], self.w_shared_up[...], self.w_shared_down[...]
    )
    scale_BT1 = jax.nn.sigmoid(jnp.einsum("BTD,D->BT", h_BTD, self.shared_gate[...]))[..., None]
    return x_BTD + reduce(routed_BTD + scale_BT1.astype(shared_BTD.dtype) * shared_BTD)


class LinearState(NamedTuple):
  """A linear layer's past: the rule's state [B, h, k, v] (float32) and the last w rows of
  its convolution's input [B, w, C]."""

  state_Bhkv: jax.Array
  halo_BwC: jax.Array


class GatedDeltaNetBlock(nnx.Module, OnePlusNormMlp):
  """A linear-attention layer (see the module docstring); `config` a Qwen3.5 config (its
  linear_* fields, conv_channels, d_model, mlp_dim, norm_eps)."""

  def __init__(self, config, *, num_layers: int, dtype, rngs: nnx.Rngs):
    self.config = config
    L, D, W = num_layers, config.d_model, config.linear_conv_kernel
    h, v = config.linear_num_value_heads, config.linear_value_head_dim
    g, d_k = config.linear_num_key_heads, config.linear_key_head_dim
    self.attn_norm = zeros_param((L, D), dtype)
    # q, k, v (transformers' fused in_proj_qkv) and their depthwise convolution kept per head,
    # so that a model axis splits them by head like any projection (runtime.tensor_parallel);
    # `conv_input` and `conv_kernel` lay a shard's heads out as transformers' fused channels.
    self.w_q = normal_param(rngs, (L, D, g, d_k), dtype)
    self.w_k = normal_param(rngs, (L, D, g, d_k), dtype)
    self.w_v = normal_param(rngs, (L, D, h, v), dtype)
    self.conv_q = normal_param(rngs, (L, W, g, d_k), dtype)
    self.conv_k = normal_param(rngs, (L, W, g, d_k), dtype)
    self.conv_v = normal_param(rngs, (L, W, h, v), dtype)
    self.w_z = normal_param(rngs, (L, D, h, v), dtype)
    self.w_b = normal_param(rngs, (L, D, h), dtype)
    self.w_a = normal_param(rngs, (L, D, h), dtype)
    self.dt_bias = ones_param((L, h), dtype)
    self.A_log = zeros_param((L, h), dtype)
    self.out_norm = ones_param((L, v), dtype)
    self.w_out = normal_param(rngs, (L, h, v, D), dtype)
    self.init_mlp(L, dtype, rngs)

  def conv_kernel(self):
    """The convolution's kernel [W, C] over this layer's channels: its q, k, then v heads'."""
    W = self.conv_q.shape[0]
    parts = (self.conv_q[...], self.conv_k[...], self.conv_v[...])
    return jnp.concatenate([c.reshape(W, -1) for c in parts], axis=-1)

  def inputs(self, x_BTD):
    """(the convolution's input [B, T, C], z [B, T, h, v], decay g and beta [B, T, h] float32).
    C is this layer's q, k, then v channels (of every head, or of a shard's)."""
    cfg = self.config
    h_BTD = rms_norm_one_plus(x_BTD, self.attn_norm[...], cfg.norm_eps)
    D = h_BTD.shape[-1]
    w_qkv = (self.w_q[...], self.w_k[...], self.w_v[...])
    w_DC = jnp.concatenate([w.reshape(D, -1) for w in w_qkv], axis=-1)  # one matmul
    mixed_BTC = jnp.einsum("BTD,DC->BTC", h_BTD, w_DC)
    z_BThv = jnp.einsum("BTD,Dhv->BThv", h_BTD, self.w_z[...])
    a_BTh = jnp.einsum("BTD,Dh->BTh", h_BTD, self.w_a[...]).astype(jnp.float32)
    b_BTh = jnp.einsum("BTD,Dh->BTh", h_BTD, self.w_b[...]).astype(jnp.float32)
    A = jnp.exp(self.A_log[...].astype(jnp.float32))
    g_BTh = -A * jax.nn.softplus(a_BTh + self.dt_bias[...].astype(jnp.float32))
    return mixed_BTC, z_BThv, g_BTh, jax.nn.sigmoid(b_BTh)

  def heads(self, conv_BTC, g_BTh):
    """The convolved channels as q, k [B, T, h, k] (each key head repeated for its group of
    value heads, as transformers' repeat_interleave) and v [B, T, h, v], ready for the rule."""
    B, T, _ = conv_BTC.shape
    _, g_heads, d_k = self.w_q.shape  # this layer's heads (a shard's on a model axis)
    _, h, d_v = self.w_v.shape
    q, k, v = jnp.split(conv_BTC, [g_heads * d_k, 2 * g_heads * d_k], axis=-1)
    group = h // g_heads
    q_BThk = jnp.repeat(q.reshape(B, T, g_heads, d_k), group, axis=2)
    k_BThk = jnp.repeat(k.reshape(B, T, g_heads, d_k), group, axis=2)
    q_BThk, k_BThk, g_BTh = gdn.prepare(q_BThk, k_BThk, g_BTh)
    return q_BThk, k_BThk, v.reshape(B, T, h, d_v), g_BTh

  def output(self, x_BTD, o_BThv, z_BThv, reduce=no_reduce, row_block: int | None = ROW_BLOCK):
    """The gated RMSNorm, out_proj and residual, then the MLP, over blocks of at most
    `row_block` rows (`in_row_blocks`: one block's MLP intermediates, a mixture's routed rows,
    live at a time). reduce: a model group's sum of its shards' partial out_proj and MLP
    outputs (each shard holds some heads)."""
    return in_row_blocks(self._output_rows, x_BTD, (o_BThv, z_BThv), row_block, reduce)

  def _output_rows(self, x_BTD, oz, reduce):
    o_BThv, z_BThv = oz
    o32 = o_BThv.astype(jnp.float32)
    normed = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + self.config.norm_eps)
    normed = self.out_norm[...] * normed.astype(x_BTD.dtype)
    gated_BThv = (normed * jax.nn.silu(z_BThv.astype(jnp.float32))).astype(x_BTD.dtype)
    x_BTD = x_BTD + reduce(jnp.einsum("BThv,hvD->BTD", gated_BThv, self.w_out[...]))
    return self.mlp(x_BTD, reduce)

  def run(self, x_BTD, past: LinearState, lengths_B=None, chunk: int = gdn.CHUNK, reduce=no_reduce):
    """The layer over T tokens entered with `past` (chunked form): (x [B, T, D], the past
    it leaves). lengths_B: each row's real length (right padding past it); the rows past it
    leave the state as it is (g = beta = 0) and the halo is the last w real rows. reduce: see
    `output` (the past is the shard's heads' and channels')."""
    mixed_BTC, z_BThv, g_BTh, beta_BTh = self.inputs(x_BTD)
    B, T, _ = mixed_BTC.shape
    conv_BTC, halo_BwC = gdn.causal_conv(mixed_BTC, self.conv_kernel(), past.halo_BwC)
    if lengths_B is not None:
      real_BT = jnp.arange(T) < lengths_B[:, None]
      g_BTh, beta_BTh = (jnp.where(real_BT[..., None], x, 0) for x in (g_BTh, beta_BTh))
      w = past.halo_BwC.shape[1]
      full_BwTC = jnp.concatenate([past.halo_BwC.astype(mixed_BTC.dtype), mixed_BTC], axis=1)
      rows_Bw = lengths_B[:, None] + jnp.arange(w)  # the last w real rows of halo and x
      halo_BwC = jnp.take_along_axis(full_BwTC, rows_Bw[..., None], axis=1)
    q, k, v, g = self.heads(conv_BTC, g_BTh)
    o_BThv, state_Bhkv = gdn.chunked(q, k, v, g, beta_BTh, past.state_Bhkv, chunk)
    return self.output(x_BTD, o_BThv, z_BThv, reduce), LinearState(state_Bhkv, halo_BwC)

  def step(self, x_B1D, past: LinearState, reduce=no_reduce):
    """One token per row (the recurrent form): (x [B, 1, D], the past it leaves)."""
    mixed_B1C, z_B1hv, g_B1h, beta_B1h = self.inputs(x_B1D)
    conv_B1C, halo_BwC = gdn.causal_conv(mixed_B1C, self.conv_kernel(), past.halo_BwC)
    q, k, v, g = self.heads(conv_B1C, g_B1h)
    o_B1hv, state_Bhkv = gdn.recurrent(q, k, v, g, beta_B1h, past.state_Bhkv)
    return self.output(x_B1D, o_B1hv, z_B1hv, reduce), LinearState(state_Bhkv, halo_BwC)
