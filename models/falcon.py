"""Falcon (rotary, parallel attention + MLP) in Flax NNX.

Covers the Falcon-7B form (one KV head, one input LayerNorm feeding both branches) and the
Falcon-40B form (`new_decoder_architecture`: K KV heads, separate `ln_attn` and `ln_mlp`).
Legend: B batch, T tokens, D d_model, N query heads, K KV heads, H head dim, F MLP dim,
L layers. Block parameters carry a leading [L] axis (see models/base.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.base import Block, CausalLM, no_reduce, normal_param, ones_param, zeros_param
from models.config import ModelConfig
from models.family import Family
from models.hf_config import refuse, rope_from_hf
from models.norms import layer_norm
from models.tensor_names import Target, linear_entry, same


@dataclasses.dataclass(frozen=True, kw_only=True)
class FalconConfig(ModelConfig):
  """Falcon with rotary embeddings and a parallel attention + MLP block.

  `separate_mlp_norm` is the Falcon-40B form (`ln_attn` and `ln_mlp`); without it one input
  LayerNorm feeds both branches (Falcon-7B).
  """

  architecture: ClassVar[str] = "falcon"
  # Up and down matrices; attention and MLP run in parallel, so one reduction per layer.
  mlp_matrices: ClassVar[int] = 2
  reductions_per_layer: ClassVar[int] = 1
  separate_mlp_norm: bool = False
  # How the fused query_key_value weight is laid out in Hugging Face checkpoints:
  # "grouped" (new_decoder_architecture), "multi_query" (Falcon-7B) or "interleaved" (MHA).
  qkv_layout: Literal["grouped", "multi_query", "interleaved"] = "multi_query"
  tie_embeddings: bool = True

  def num_params(self) -> int:
    D, F = self.d_model, self.mlp_dim
    norms = (4 if self.separate_mlp_norm else 2) * D
    per_layer = self.attention_params() + self.mlp_matrices * D * F + norms
    head = 0 if self.tie_embeddings else self.vocab_size * D
    return self.vocab_size * D + self.num_layers * per_layer + 2 * D + head


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


# --- Hugging Face config.json and tensor names


def falcon_from_hf(hf: dict[str, Any], model_type: str, common: dict[str, Any]):
  """Rotary Falcon, the 7B (multi-query) and 40B (grouped, two norms) forms; ALiBi and
  biased linears refused by name."""
  refuse(hf, "alibi", True, "ALiBi Falcon models are not implemented; rotary Falcon only")
  refuse(hf, "bias", True, "Falcon linear layers without bias only")
  new_arch = bool(hf.get("new_decoder_architecture", False))
  if not new_arch and not hf.get("parallel_attn", True):
    raise ValueError(
      "config.json: `parallel_attn`=False is not supported (parallel "
      "attention + MLP Falcon blocks only)"
    )
  if hf.get("activation", "gelu") != "gelu":
    raise ValueError(f"config.json: `activation`={hf['activation']!r} is not supported (gelu)")
  num_heads = hf["num_attention_heads"]
  multi_query = bool(hf.get("multi_query", True))
  if new_arch:
    layout, num_kv = "grouped", hf.get("num_kv_heads") or num_heads
    separate = (hf.get("num_ln_in_parallel_attn") or 2) == 2
  elif multi_query:
    layout, num_kv, separate = "multi_query", 1, False
  else:
    layout, num_kv, separate = "interleaved", num_heads, False
  return FalconConfig(
    **common,
    num_kv_heads=num_kv,
    head_dim=hf["hidden_size"] // num_heads,
    mlp_dim=hf.get("ffn_hidden_size") or 4 * hf["hidden_size"],
    norm_eps=hf.get("layer_norm_epsilon", 1e-5),
    rope=rope_from_hf(hf, common["max_position_embeddings"], model_type),
    tie_embeddings=hf.get("tie_word_embeddings", True),
    separate_mlp_norm=separate,
    qkv_layout=layout,
  )


def _split_falcon_qkv(cfg: FalconConfig) -> list[Callable[[np.ndarray], np.ndarray]]:
  """Three views of the fused query_key_value weight [(N + 2K) H, D] -> wq, wk, wv."""
  D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  G = N // K
  if cfg.qkv_layout == "grouped":  # per KV group: G queries, then one key, then one value

    def view(w):
      return w.T.reshape(D, K, G + 2, H)

    return [
      lambda w: view(w)[:, :, :G].reshape(D, N, H),
      lambda w: view(w)[:, :, G],
      lambda w: view(w)[:, :, G + 1],
    ]
  if cfg.qkv_layout == "multi_query":  # N queries, then the one key, then the one value

    def view(w):
      return w.T.reshape(D, N + 2, H)

    return [
      lambda w: view(w)[:, :N],
      lambda w: view(w)[:, N : N + 1],
      lambda w: view(w)[:, N + 1 : N + 2],
    ]

  def view(w):  # interleaved: per head, (q, k, v)
    return w.T.reshape(D, N, 3, H)

  return [lambda w: view(w)[:, :, 0], lambda w: view(w)[:, :, 1], lambda w: view(w)[:, :, 2]]


def falcon_targets(cfg: FalconConfig, name: str) -> list[Target] | None:
  D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  V = cfg.vocab_size
  fixed = {
    "transformer.word_embeddings.weight": [(("embedding",), None, same, (V, D))],
    "transformer.ln_f.weight": [(("norm_scale",), None, same, (D,))],
    "transformer.ln_f.bias": [(("norm_bias",), None, same, (D,))],
  }
  if not cfg.tie_embeddings:
    fixed["lm_head.weight"] = [(("lm_head",), None, lambda w: w.T, (V, D))]
  if name in fixed:
    return fixed[name]
  m = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)", name)
  if not m:
    return None
  layer, rest = int(m.group(1)), m.group(2)
  if layer >= cfg.num_layers:
    return None
  if rest == "self_attention.query_key_value.weight":
    q, k, v = _split_falcon_qkv(cfg)
    fused = ((N + 2 * K) * H, D)
    return [
      (("blocks", "wq"), layer, q, fused),
      (("blocks", "wk"), layer, k, fused),
      (("blocks", "wv"), layer, v, fused),
    ]
  norms = (
    {"ln_attn": "attn_norm", "ln_mlp": "mlp_norm"}
    if cfg.separate_mlp_norm
    else {"input_layernorm": "attn_norm"}
  )
  per_layer = {
    "self_attention.dense.weight": linear_entry("wo", (N, H), (D,)),
    "mlp.dense_h_to_4h.weight": linear_entry("w_in", (D,), (F,)),
    "mlp.dense_4h_to_h.weight": linear_entry("w_out", (F,), (D,)),
  }
  for hf_norm, ours in norms.items():
    per_layer[f"{hf_norm}.weight"] = (f"{ours}_scale", same, (D,))
    per_layer[f"{hf_norm}.bias"] = (f"{ours}_bias", same, (D,))
  if rest not in per_layer:
    return None
  param, fn, hf_shape = per_layer[rest]
  return [(("blocks", param), layer, fn, hf_shape)]


FAMILY = Family(
  architecture="falcon",
  model_types=("falcon",),
  config_class=FalconConfig,
  module_class=Falcon,
  from_hf=falcon_from_hf,
  tensor_targets=falcon_targets,
)
