"""DeepSeek-V3 in Flax NNX (model_type `deepseek_v3`: DeepSeek-V3 / R1, Kimi K2, Moonlight), as
transformers 5 computes it (`DeepseekV3ForCausalLM`).

Legend: B batch, T tokens, S cache positions, D d_model, N heads, F the dense MLP's columns,
E routed experts, f an expert's columns, C the latent cache entry (kv_lora_rank + rope dim).

Every layer is multi-head latent attention (models/latent_attention.py) then an MLP: the first
`first_dense_layers` layers a dense SwiGLU, the rest a mixture of experts: DeepSeek's router
(sigmoid scores, a correction bias for the choice only, group-limited top-k, renormalised and
scaled: models.experts.route_grouped_sigmoid), the routed SwiGLU experts and `shared_experts`
shared ones (one SwiGLU of shared_experts x f columns, ungated). The two MLP kinds have
different weights, so the layers are two stacks run one after the other (`layer_stacks`:
`models.base.scan_layers` runs one scan each): `dense_blocks` then `blocks` (either may be
empty: None). Plain RMSNorms (w x). The cache is one latent per token
per layer, [L, B, S, C]: prefill writes it, decode attends it in the absorbed form and writes
the new token's entry in place.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import nnx

from models.base import (
  ROW_BLOCK,
  CausalLM,
  LayerStack,
  finish_one_row,
  first_local_expert,
  in_row_blocks,
  no_reduce,
  normal_param,
  ones_param,
  scan_layers,
  write_rows,
  zeros_param,
)
from models.deepseek_v3_config import MODEL_TYPES, DeepseekV3Config, deepseek_v3_from_hf
from models.experts import route_grouped_sigmoid, run_experts, swiglu
from models.family import Family
from models.kernels import get_kernel
from models.latent_attention import LatentAttention
from models.norms import rms_norm
from models.tensor_names import Target, linear_entry, same


class DeepseekV3Block(LatentAttention):
  """Stacked layers of one MLP kind: latent attention, then a dense SwiGLU (`experts` False)
  or the mixture of experts."""

  def __init__(self, config: DeepseekV3Config, *, num_layers: int, experts: bool, dtype, rngs):
    self.config = config
    self.experts = experts
    L, D = num_layers, config.d_model
    self.init_attention(L, dtype, rngs)
    self.mlp_norm = ones_param((L, D), dtype)
    if not experts:
      F = config.mlp_dim
      self.w_gate = normal_param(rngs, (L, D, F), dtype)
      self.w_up = normal_param(rngs, (L, D, F), dtype)
      self.w_down = normal_param(rngs, (L, F, D), dtype)
      return
    E, f, Fs = config.num_experts, config.expert_dim, config.expert_dim * config.shared_experts
    self.router = normal_param(rngs, (L, D, E), dtype)
    self.choice_bias = zeros_param((L, E), jnp.float32)  # e_score_correction_bias
    self.w_gate = normal_param(rngs, (L, E, D, f), dtype)
    self.w_up = normal_param(rngs, (L, E, D, f), dtype)
    self.w_down = normal_param(rngs, (L, E, f, D), dtype)
    if Fs:
      self.w_shared_gate = normal_param(rngs, (L, D, Fs), dtype)
      self.w_shared_up = normal_param(rngs, (L, D, Fs), dtype)
      self.w_shared_down = normal_param(rngs, (L, Fs, D), dtype)

  def attention_input(self, x_BTD):
    return rms_norm(x_BTD, self.attn_norm[...], self.config.norm_eps)

  def finish_rows(self, x_BTD, attn_BTNv, reduce=no_reduce):
    """Output projection, MLP and residuals of every row: the shards' output projections
    summed by `reduce` (a tensor-parallel group's heads)."""
    return self.mlp(x_BTD + reduce(self.attention_output(attn_BTNv)), reduce)

  def finish(self, x_BTD, attn_BTNv, row_block=ROW_BLOCK, reduce=no_reduce):
    """`finish_rows` over blocks of at most `row_block` rows (`Block.finish`'s signature: a
    rank's 131k rows of a 1M-token prompt route 1M (token, expert) rows of D; a block's at a
    time)."""
    return in_row_blocks(self.finish_rows, x_BTD, attn_BTNv, row_block, reduce)

  def mlp(self, x_BTD, reduce=no_reduce):
    cfg = self.config
    h_BTD = rms_norm(x_BTD, self.mlp_norm[...], cfg.norm_eps)
    if not self.experts:
      return x_BTD + reduce(swiglu(h_BTD, self.w_gate[...], self.w_up[...], self.w_down[...]))
    weights_BTk, experts_BTk = route_grouped_sigmoid(
      h_BTD,
      self.router[...],
      self.choice_bias[...],
      cfg.experts_per_token,
      cfg.num_expert_groups,
      cfg.groups_per_token,
      cfg.normalize_expert_weights,
      cfg.routed_scaling_factor,
    )
    w_gate = self.w_gate[...]
    first = first_local_expert(w_gate.shape[0], cfg.num_experts, reduce)  # experts split
    out_BTD = run_experts(
      h_BTD, weights_BTk, experts_BTk, w_gate, self.w_up[...], self.w_down[...], first
    )
    if cfg.shared_experts:
      shared = (self.w_shared_gate[...], self.w_shared_up[...], self.w_shared_down[...])
      out_BTD = out_BTD + swiglu(h_BTD, *shared)
    return x_BTD + reduce(out_BTD)


class DeepseekV3(CausalLM):
  """Token embedding -> the dense layers, then the mixture-of-experts layers -> RMSNorm ->
  logits."""

  def __init__(self, config: DeepseekV3Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.dtype = jnp.dtype(dtype)
    V, D = config.vocab_size, config.d_model
    self.embedding = normal_param(rngs, (V, D), dtype)
    dense, moe = config.first_dense_layers, config.moe_layers
    self.dense_blocks = (
      DeepseekV3Block(config, num_layers=dense, experts=False, dtype=dtype, rngs=rngs)
      if dense
      else None
    )
    self.blocks = (
      DeepseekV3Block(config, num_layers=moe, experts=True, dtype=dtype, rngs=rngs) if moe else None
    )
    self.lm_head = None if config.tie_embeddings else normal_param(rngs, (D, V), dtype)
    self.norm = ones_param((D,), dtype)

  def final_norm(self, x_BTD):
    return rms_norm(x_BTD, self.norm[...], self.config.norm_eps)

  def layer_stacks(self) -> tuple[LayerStack, ...]:
    """The dense layers' stack, then the experts' (`scan_layers` runs one scan each)."""
    dense, L = self.config.first_dense_layers, self.config.num_layers
    stacks = ((self.dense_blocks, range(dense)), (self.blocks, range(dense, L)))
    return tuple(LayerStack(blocks, tuple(layers)) for blocks, layers in stacks if layers)

  def empty_cache(self, batch: int, capacity: int) -> jax.Array:
    """A zero latent cache [L, B, capacity, C]."""
    cfg = self.config
    return jnp.zeros((cfg.num_layers, batch, capacity, cfg.cache_width), self.dtype)

  def forward(
    self, tokens_BT, attention="dense", reduce=no_reduce, capacity=None, last_row_only=False
  ):
    """The whole prompt on one device: (final hidden states [B, T, D], the latent cache
    [L, B, capacity (default T), C] with the prompt's entries). Every head's keys and values
    are expanded from the latents and attended with the kernel `attention`
    (`attend_expanded`). last_row_only: the last layer attends and finishes the last row
    alone (a prefill's: its other rows' hidden states are then not the model's)."""
    get_kernel(attention)  # an unknown kernel is refused by name before anything traces
    B, T = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))

    def layer(block, at, carry):
      l, (x_BTD, cache) = at.index, carry
      h_BTD = block.attention_input(x_BTD)
      q_nope, q_rope = block.queries(h_BTD, positions_BT)
      entry_BTC = block.latents(h_BTD, positions_BT)

      def every_row(x_BTD):
        attn_BTNv = block.attend_expanded(q_nope, q_rope, entry_BTC, 0, attention)
        return block.mlp(x_BTD + reduce(block.attention_output(attn_BTNv)), reduce)

      def last_row(x_BTD):
        entries_1BT1C = entry_BTC[None, :, :, None]
        return finish_one_row(block, x_BTD, (q_nope, q_rope), entries_1BT1C, T - 1, T - 1, reduce)

      if last_row_only:
        x_BTD = jax.lax.cond(l == self.config.num_layers - 1, last_row, every_row, x_BTD)
      else:
        x_BTD = every_row(x_BTD)
      cache = jax.lax.dynamic_update_slice(cache, entry_BTC[None].astype(cache.dtype), (l, 0, 0, 0))
      return (x_BTD, cache), None

    cache = self.empty_cache(B, T if capacity is None else capacity)
    return scan_layers(self, layer, (self.embed(tokens_BT), cache))[0]

  def __call__(self, tokens_BT):
    """Logits of every position, [B, T, V] float32."""
    x_BTD, _ = self.forward(tokens_BT)
    return self.logits(x_BTD)

  def decode_step(self, tokens_B, positions_B, cache, reduce=no_reduce):
    """One token per row, row b at `positions_B[b]` (its length so far): (logits [B, V], the
    cache with the token's latent written at its position), attending in the absorbed form.
    reduce: a tensor-parallel shard's sum over its group (its heads and experts; the latent
    cache is whole on every shard)."""
    B = tokens_B.shape[0]
    positions_B = jnp.broadcast_to(jnp.asarray(positions_B, jnp.int32), (B,))

    def layer(block, at, carry):
      l, (x_B1D, cache) = at.index, carry
      h_B1D = block.attention_input(x_B1D)
      q_nope, q_rope = block.queries(h_B1D, positions_B[:, None])
      entry_BC = block.latents(h_B1D, positions_B[:, None])[:, 0]
      cache = write_rows(cache, (l,), positions_B, entry_BC[:, None])
      attn_BNv = block.attend_absorbed(q_nope[:, 0], q_rope[:, 0], cache[l], positions_B)
      return (block.finish(x_B1D, attn_BNv[:, None], reduce=reduce), cache), None

    x_B1D, cache = scan_layers(self, layer, (self.embed(tokens_B[:, None]), cache))[0]
    return self.logits(x_B1D)[:, 0], cache


# --- Hugging Face config.json and tensor names


def ignored_tensor(cfg: DeepseekV3Config, name: str) -> str | None:
  """The multi-token-prediction layers a checkpoint may hold past the model's layers."""
  m = re.fullmatch(r"model\.layers\.(\d+)\..+", name)
  if m and int(m.group(1)) >= cfg.num_layers:
    return "a multi-token-prediction layer (not used by prefill or greedy decoding)"
  return None


_PROJECTIONS = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


def deepseek_v3_targets(cfg: DeepseekV3Config, name: str) -> list[Target] | None:
  D, V = cfg.d_model, cfg.vocab_size
  if name == "lm_head.weight" and not cfg.tie_embeddings:
    return [(("lm_head",), None, lambda w: w.T, (V, D))]
  if name == "model.embed_tokens.weight":
    return [(("embedding",), None, same, (V, D))]
  if name == "model.norm.weight":
    return [(("norm",), None, same, (D,))]
  m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
  if not m or int(m.group(1)) >= cfg.num_layers:
    return None
  layer, rest = int(m.group(1)), m.group(2)
  dense = layer < cfg.first_dense_layers
  stack = "dense_blocks" if dense else "blocks"
  row = layer if dense else layer - cfg.first_dense_layers
  if rest == "self_attn.kv_b_proj.weight":  # per head: n key rows, then v value rows
    R, N, n = cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim
    per_head = lambda w: w.T.reshape(R, N, n + cfg.v_head_dim)  # noqa: E731
    hf_shape = (N * (n + cfg.v_head_dim), R)
    return [
      ((stack, "wk_b"), row, lambda w: per_head(w)[..., :n], hf_shape),
      ((stack, "wv_b"), row, lambda w: per_head(w)[..., n:], hf_shape),
    ]
  entry = _attention_entry(cfg, rest) or _mlp_entry(cfg, rest, dense)
  if entry is None:
    return _expert_target(cfg, stack, row, rest) if not dense else None
  param, fn, hf_shape = entry
  return [((stack, param), row, fn, hf_shape)]


def _attention_entry(cfg: DeepseekV3Config, rest: str):
  D, N, Q, R = cfg.d_model, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
  n, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  entries = {
    "input_layernorm.weight": ("attn_norm", same, (D,)),
    "post_attention_layernorm.weight": ("mlp_norm", same, (D,)),
    "self_attn.kv_a_proj_with_mqa.weight": linear_entry("wkv_a", (D,), (R + r,)),
    "self_attn.kv_a_layernorm.weight": ("kv_a_norm", same, (R,)),
    "self_attn.o_proj.weight": linear_entry("wo", (N, v), (D,)),
  }
  if Q:
    entries.update(
      {
        "self_attn.q_a_proj.weight": linear_entry("wq_a", (D,), (Q,)),
        "self_attn.q_a_layernorm.weight": ("q_a_norm", same, (Q,)),
        "self_attn.q_b_proj.weight": linear_entry("wq_b", (Q,), (N, n + r)),
      }
    )
  else:
    entries["self_attn.q_proj.weight"] = linear_entry("wq", (D,), (N, n + r))
  return entries.get(rest)


def _mlp_entry(cfg: DeepseekV3Config, rest: str, dense: bool):
  D = cfg.d_model
  if dense:
    F = cfg.mlp_dim
    entries = {
      "mlp.gate_proj.weight": linear_entry("w_gate", (D,), (F,)),
      "mlp.up_proj.weight": linear_entry("w_up", (D,), (F,)),
      "mlp.down_proj.weight": linear_entry("w_down", (F,), (D,)),
    }
    return entries.get(rest)
  E, Fs = cfg.num_experts, cfg.expert_dim * cfg.shared_experts
  entries = {
    "mlp.gate.weight": ("router", lambda w: w.T, (E, D)),
    "mlp.gate.e_score_correction_bias": ("choice_bias", same, (E,)),
  }
  if Fs:
    entries.update(
      {
        "mlp.shared_experts.gate_proj.weight": linear_entry("w_shared_gate", (D,), (Fs,)),
        "mlp.shared_experts.up_proj.weight": linear_entry("w_shared_up", (D,), (Fs,)),
        "mlp.shared_experts.down_proj.weight": linear_entry("w_shared_down", (Fs,), (D,)),
      }
    )
  return entries.get(rest)


def _expert_target(cfg: DeepseekV3Config, stack: str, row: int, rest: str) -> list[Target] | None:
  """Routed expert e's gate, up or down [f, D] / [D, f] -> its slice (row, e) of the stack."""
  m = re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)\.weight", rest)
  if not m or int(m.group(1)) >= cfg.num_experts or m.group(2) not in _PROJECTIONS:
    return None
  param = _PROJECTIONS[m.group(2)]
  D, f = cfg.d_model, cfg.expert_dim
  hf_shape = (D, f) if param == "w_down" else (f, D)
  return [((stack, param), (row, int(m.group(1))), lambda w: w.T, hf_shape)]


FAMILY = Family(
  architecture="deepseek_v3",
  model_types=MODEL_TYPES,
  config_class=DeepseekV3Config,
  module_class=DeepseekV3,
  from_hf=deepseek_v3_from_hf,
  tensor_targets=deepseek_v3_targets,
  ignores=ignored_tensor,
)
