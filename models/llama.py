"""Llama 2 / Llama 3 in Flax NNX.

Legend: B batch, T tokens, D d_model, N query heads, K KV heads, H head dim, F MLP dim,
L layers. Block parameters carry a leading [L] axis (see models/base.py).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models.base import (
  Block,
  CausalLM,
  first_local_expert,
  no_reduce,
  normal_param,
  ones_param,
)
from models.config import ModelConfig
from models.experts import route_softmax_top_k, run_experts
from models.family import Family
from models.hf_config import (
  HEAD_DIM_DEFAULTS,
  WINDOW_DEFAULTS,
  kv_heads_from_hf,
  or_default,
  refuse,
  rope_from_hf,
)
from models.norms import rms_norm
from models.tensor_names import Target, linear_entry, same


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(ModelConfig):
  """Llama 2 / Llama 3: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

  The same decoder is Mistral (sliding_window), Qwen2/2.5 (qkv_bias) and Qwen3 (qk_norm, a
  head_dim that need not be d_model / num_heads): switches of this config, not other models.
  """

  architecture: ClassVar[str] = "llama"
  # The block's shape as the cost model counts it: SwiGLU's gate, up and down matrices; two
  # partial sums reduced per layer under tensor parallelism (after attention, after the MLP).
  mlp_matrices: ClassVar[int] = 3
  reductions_per_layer: ClassVar[int] = 2
  # A mixture of experts in place of the MLP (Qwen3-MoE, Mixtral): `num_experts` SwiGLU
  # experts of `mlp_dim` columns each, a router [D, E], each token through its
  # `experts_per_token` most probable experts, weighted by their router probabilities
  # (renormalised over the chosen ones when `normalize_expert_weights`). 0: a dense MLP.
  num_experts: int = 0
  experts_per_token: int = 0
  normalize_expert_weights: bool = True

  def __post_init__(self):
    super().__post_init__()
    E, k = self.num_experts, self.experts_per_token
    for name, value in (("num_experts", E), ("experts_per_token", k)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config field `{name}` must be an integer >= 0, got {value!r}")
    if E and not 1 <= k <= E:
      raise ValueError(f"`experts_per_token` must be in [1, num_experts={E}], got {k}")
    if not E and k:
      raise ValueError(f"`experts_per_token`={k} needs `num_experts` > 0 (a dense MLP has none)")

  @property
  def router_dim(self) -> int:
    return self.num_experts

  @property
  def active_mlp_dim(self) -> int:
    """MLP columns a token runs through: its experts' (k F) or the dense MLP's (F)."""
    return self.mlp_dim * (self.experts_per_token if self.num_experts else 1)

  def mlp_weight_dim(self, num_tokens: float) -> float:
    """MLP columns whose weights `num_tokens` tokens read: every expert some token routes to
    (at most E, at most T k; the router's choice is data, so the bound), or the dense F."""
    if not self.num_experts:
      return self.mlp_dim
    return self.mlp_dim * min(self.num_experts, num_tokens * self.experts_per_token)

  def num_params(self) -> int:
    D, F = self.d_model, self.mlp_dim
    mlp = self.mlp_matrices * D * F * max(self.num_experts, 1) + D * self.num_experts  # router
    per_layer = self.attention_params() + mlp + 2 * D
    head = 0 if self.tie_embeddings else self.vocab_size * D
    return self.vocab_size * D + self.num_layers * per_layer + D + head


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

  def route(self, h_BTD):
    """The router's choice for the MLP's input: (weights [B, T, k] float32, experts [B, T, k])."""
    cfg = self.config
    return route_softmax_top_k(
      h_BTD, self.router[...], None, cfg.experts_per_token, cfg.normalize_expert_weights
    )

  def routed_experts(self, x_BTD, attn_BTNH) -> jax.Array:
    """The experts [B, T, k] each token of this layer routes to, from the layer's input and its
    attention (what `finish_rows` computes before its MLP; a whole model's, no shards)."""
    x_BTD = self.attention_residual(x_BTD, attn_BTNH)
    return self.route(rms_norm(x_BTD, self.mlp_norm[...], self.config.norm_eps))[1]

  def attention_residual(self, x_BTD, attn_BTNH, reduce=no_reduce) -> jax.Array:
    """The residual stream after attention: the shards' output projections summed, added."""
    return x_BTD + reduce(self.attention_output(attn_BTNH))

  def first_local_expert(self, reduce):
    """`models.base.first_local_expert` of this block's experts."""
    return first_local_expert(self.w_gate[...].shape[0], self.config.num_experts, reduce)

  def finish_rows(self, x_BTD: jax.Array, attn_BTNH: jax.Array, reduce=no_reduce) -> jax.Array:
    x_BTD = self.attention_residual(x_BTD, attn_BTNH, reduce)
    h_BTD = rms_norm(x_BTD, self.mlp_norm[...], self.config.norm_eps)
    cfg = self.config
    if cfg.num_experts:
      weights_BTk, experts_BTk = self.route(h_BTD)
      mlp_BTD = run_experts(
        h_BTD,
        weights_BTk,
        experts_BTk,
        self.w_gate[...],
        self.w_up[...],
        self.w_down[...],
        self.first_local_expert(reduce),
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


# --- Hugging Face config.json and tensor names

# Hugging Face model types that are this decoder with switches (see LlamaConfig), and those
# whose MLP is a mixture of experts (`_experts_from_hf`).
LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


def llama_from_hf(hf: dict[str, Any], model_type: str, common: dict[str, Any]):
  """Llama and the families that are its decoder with switches, as transformers reads them."""
  refuse(hf, "attention_bias", True, f"{model_type} attention without bias on o_proj only")
  refuse(hf, "mlp_bias", True, f"{model_type} MLP without bias only")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: `hidden_act`={hf['hidden_act']!r} is not supported (silu)")
  num_heads = hf["num_attention_heads"]
  return LlamaConfig(
    **common,
    num_kv_heads=kv_heads_from_hf(hf, model_type, num_heads),
    head_dim=hf.get("head_dim")
    or HEAD_DIM_DEFAULTS.get(model_type, hf["hidden_size"] // num_heads),
    mlp_dim=(
      or_default(hf, "moe_intermediate_size", model_type)
      if model_type == "qwen3_moe"
      else hf["intermediate_size"]
    ),
    norm_eps=or_default(hf, "rms_norm_eps", model_type, 1e-6),
    rope=rope_from_hf(hf, common["max_position_embeddings"], model_type),
    tie_embeddings=hf.get("tie_word_embeddings", False),
    qkv_bias=model_type == "qwen2",  # Qwen2's q/k/v projections always carry a bias
    qk_norm=model_type in ("qwen3", "qwen3_moe"),
    **windows_from_hf(hf, model_type),
    **_experts_from_hf(hf, model_type),
  )


def windows_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
  """{"sliding_window": W or None} (one window for every layer, or none), or
  {"layer_windows": (...)} where the layers differ, as transformers reads them.

  Mistral: `sliding_window` (null: none). Llama: never (transformers ignores the field there).
  Qwen2/Qwen3: a window only if `use_sliding_window`,
  and then only on layers >= `max_window_layers`. transformers >= 4.54 also writes
  `layer_types`, which decides when present.
  """
  window = hf.get("sliding_window", WINDOW_DEFAULTS.get(model_type))
  if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
    window = None
  if model_type == "llama":  # transformers' Llama has no window and ignores the field
    window = None
  num_layers = hf["num_hidden_layers"]
  # Qwen3-MoE and Mixtral have no layer kinds: one mask for every layer, `layer_types` (a key
  # their config classes keep but never read) is ignored, as transformers ignores it.
  layer_types = None if model_type in MOE_MODEL_TYPES else hf.get("layer_types")
  if layer_types is None:
    # transformers' Qwen2/Qwen3 config classes default max_window_layers to 28 when absent.
    first_windowed = (
      hf.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS) if model_type in ("qwen2", "qwen3") else 0
    )
    layer_types = [
      "sliding_attention" if window is not None and i >= first_windowed else "full_attention"
      for i in range(num_layers)
    ]
  kinds = set(layer_types)
  if not kinds <= {"full_attention", "sliding_attention"}:
    raise ValueError(
      f"config.json: `layer_types` {sorted(kinds)} are not supported "
      "(full_attention or sliding_attention only)"
    )
  if len(layer_types) != num_layers:
    raise ValueError(
      f"config.json: `layer_types` has {len(layer_types)} entries for {num_layers} layers"
    )
  if "sliding_attention" in kinds and (
    not isinstance(window, int) or isinstance(window, bool) or window <= 0
  ):
    raise ValueError(
      f"config.json: sliding_attention layers need a positive `sliding_window`, got {window!r}"
    )
  if kinds == {"full_attention", "sliding_attention"}:  # a window on some layers
    return {
      "layer_windows": tuple(window if t == "sliding_attention" else None for t in layer_types)
    }
  return {"sliding_window": window if kinds == {"sliding_attention"} else None}


QWEN_MAX_WINDOW_LAYERS = 28  # Qwen2Config / Qwen3Config's default


def _experts_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
  """The mixture of experts of a MoE family, as transformers reads it: Qwen3-MoE's
  `num_experts` (or `num_local_experts`, as transformers 5 writes it), `moe_intermediate_size`
  per expert, `norm_topk_prob`; Mixtral's `num_local_experts`, weights always renormalised.
  Qwen3-MoE layers with a dense MLP (`mlp_only_layers`, `decoder_sparse_step` > 1) are
  refused by name: every layer of a stacked model has one MLP shape."""
  if model_type not in MOE_MODEL_TYPES:
    return {}
  if model_type == "qwen3_moe":
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
      raise ValueError(
        "config.json: dense MLP layers among the experts (`mlp_only_layers`="
        f"{hf.get('mlp_only_layers')!r}, `decoder_sparse_step`={hf.get('decoder_sparse_step')!r})"
        " are not supported: every layer a mixture of experts"
      )
    # transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`.
    experts = hf.get("num_experts", or_default(hf, "num_local_experts", model_type))
    experts = or_default(hf, "num_experts", model_type) if experts is None else experts
  else:
    if "num_experts" in hf and hf.get("num_local_experts") != hf["num_experts"]:
      raise ValueError(
        f"config.json: Mixtral reads its expert count from `num_local_experts` "
        f"({hf.get('num_local_experts')!r}), not `num_experts` ({hf['num_experts']!r}, which "
        "transformers ignores); rename the key"
      )
    experts = or_default(hf, "num_local_experts", model_type)
  top_k = or_default(hf, "num_experts_per_tok", model_type)
  check_expert_counts(experts, top_k, model_type)
  normalize = True if model_type == "mixtral" else or_default(hf, "norm_topk_prob", model_type)
  return {
    "num_experts": experts,
    "experts_per_token": top_k,
    "normalize_expert_weights": bool(normalize),
  }


def check_expert_counts(experts, top_k, model_type: str, experts_key="num_experts") -> None:
  """config.json's expert count and experts per token: integers >= 1, top_k <= experts."""
  for name, value in ((experts_key, experts), ("num_experts_per_tok", top_k)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"config.json: `{name}` must be an integer >= 1, got {value!r}")
  if top_k > experts:
    raise ValueError(
      f"config.json: `num_experts_per_tok`={top_k} (absent: {model_type}'s default) exceeds "
      f"the {experts} experts"
    )


def llama_targets(cfg: LlamaConfig, name: str) -> list[Target] | None:
  """Llama and the families that share its tensor names (Mistral, Qwen2, Qwen3)."""
  D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  V = cfg.vocab_size
  fixed = {
    "model.embed_tokens.weight": [(("embedding",), None, same, (V, D))],
    "model.norm.weight": [(("norm",), None, same, (D,))],
  }
  if not cfg.tie_embeddings:
    fixed["lm_head.weight"] = [(("lm_head",), None, lambda w: w.T, (V, D))]
  if name in fixed:
    return fixed[name]
  m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
  if not m:
    return None
  layer, rest = int(m.group(1)), m.group(2)
  per_layer = {
    "input_layernorm.weight": ("attn_norm", same, (D,)),
    "self_attn.q_proj.weight": linear_entry("wq", (D,), (N, H)),
    "self_attn.k_proj.weight": linear_entry("wk", (D,), (K, H)),
    "self_attn.v_proj.weight": linear_entry("wv", (D,), (K, H)),
    "self_attn.o_proj.weight": linear_entry("wo", (N, H), (D,)),
    "post_attention_layernorm.weight": ("mlp_norm", same, (D,)),
    "mlp.gate_proj.weight": linear_entry("w_gate", (D,), (F,)),
    "mlp.up_proj.weight": linear_entry("w_up", (D,), (F,)),
    "mlp.down_proj.weight": linear_entry("w_down", (F,), (D,)),
  }
  if cfg.qkv_bias:  # Qwen2: [out] biases -> [heads, H]
    per_layer["self_attn.q_proj.bias"] = ("bq", lambda b: b.reshape(N, H), (N * H,))
    per_layer["self_attn.k_proj.bias"] = ("bk", lambda b: b.reshape(K, H), (K * H,))
    per_layer["self_attn.v_proj.bias"] = ("bv", lambda b: b.reshape(K, H), (K * H,))
  if cfg.qk_norm:  # Qwen3: one [H] scale shared by the heads
    per_layer["self_attn.q_norm.weight"] = ("q_norm", same, (H,))
    per_layer["self_attn.k_norm.weight"] = ("k_norm", same, (H,))
  if layer >= cfg.num_layers:
    return None
  if cfg.router_dim:  # a mixture of experts
    for dense in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
      del per_layer[dense]
    expert = _expert_target(cfg, rest, layer)
    if expert is not None:
      return expert
  if rest not in per_layer:
    return None
  param, fn, hf_shape = per_layer[rest]
  return [(("blocks", param), layer, fn, hf_shape)]


# A mixture of experts' tensors, per family: the router, and each expert's gate, up and down
# projections (Mixtral's w1, w3, w2).
_EXPERT_NAMES = {
  "mlp": ("gate", {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}),
  "block_sparse_moe": ("gate", {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}),
}


def _expert_target(cfg: LlamaConfig, rest: str, layer: int) -> list[Target] | None:
  """The router [E, D] -> router [D, E] of the layer, or expert e's [F, D] / [D, F] Linear
  weight -> its [D, F] / [F, D] slice of w_gate, w_up or w_down [L, E, ...] (index (l, e))."""
  D, F, E = cfg.d_model, cfg.mlp_dim, cfg.num_experts
  for prefix, (router, projections) in _EXPERT_NAMES.items():
    if rest == f"{prefix}.{router}.weight":
      return [(("blocks", "router"), layer, lambda w: w.T, (E, D))]
    m = re.fullmatch(rf"{re.escape(prefix)}\.experts\.(\d+)\.(\w+)\.weight", rest)
    if m and int(m.group(1)) < E and m.group(2) in projections:
      param = projections[m.group(2)]
      hf_shape = (D, F) if param == "w_down" else (F, D)
      return [(("blocks", param), (layer, int(m.group(1))), lambda w: w.T, hf_shape)]
  return None


FAMILY = Family(
  architecture="llama",
  model_types=LLAMA_MODEL_TYPES,
  config_class=LlamaConfig,
  module_class=Llama,
  from_hf=llama_from_hf,
  tensor_targets=llama_targets,
  required_hf_fields=("intermediate_size",),
)
