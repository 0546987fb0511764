"""gpt-oss (OpenAI, 2025: gpt-oss-20b and gpt-oss-120b) in Flax NNX.

Llama's decoder (models/llama.py) with four differences, as transformers 5 computes them:
- attention sinks: a learned logit per head in every query's softmax (models/sinks.py; the
  kernels add it once per query, so every strategy's partials still merge exactly);
- biases on q, k, v and o;
- layers alternating between a 128-token sliding window and full attention (`layer_types`);
- a mixture of experts whose router has a bias (softmax over the top-k logits) and whose
  experts are a clamped SwiGLU with biases (`swiglu_limit`, `swiglu_alpha`).
Its RoPE is YaRN (models/rope.py). The K,V cache is Llama's, so every strategy, cache layout
and decode of kvr_jax runs it.

Legend: B batch, T tokens, D d_model, N query heads, K KV heads, H head dim, E experts, F
expert MLP dim, L layers. Block parameters carry a leading [L] axis (see models/base.py).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models.base import no_reduce, shard_index, zeros_param
from models.experts import clamped_swiglu, route_softmax_top_k, run_expert_mlps
from models.family import Family
from models.hf_config import kv_heads_from_hf, or_default, refuse, rope_from_hf
from models.llama import (
  Llama,
  LlamaBlock,
  LlamaConfig,
  check_expert_counts,
  llama_targets,
  windows_from_hf,
)
from models.norms import rms_norm
from models.tensor_names import same

MODEL_TYPES = ("gpt_oss",)
# transformers' GptOssConfig RoPE when config.json has none: YaRN, 32x a 4096-token context.
DEFAULT_ROPE = {
  "rope_type": "yarn",
  "factor": 32.0,
  "beta_fast": 32.0,
  "beta_slow": 1.0,
  "truncate": False,
  "original_max_position_embeddings": 4096,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptOssConfig(LlamaConfig):
  """gpt-oss: LlamaConfig with biases on q, k, v and o, attention sinks, a router bias and
  clamped SwiGLU experts with biases (`swiglu_limit` clamps the gate above and up on both
  sides, `swiglu_alpha` is the gate's sigmoid gain)."""

  architecture: ClassVar[str] = "gpt_oss"
  qkv_bias: bool = True
  attention_sinks: bool = True
  swiglu_limit: float = 7.0
  swiglu_alpha: float = 1.702

  def __post_init__(self):
    super().__post_init__()
    if not (self.qkv_bias and self.attention_sinks and self.num_experts):
      raise ValueError(
        "a gpt_oss config has q/k/v biases, attention sinks and a mixture of experts "
        f"(qkv_bias={self.qkv_bias}, attention_sinks={self.attention_sinks}, "
        f"num_experts={self.num_experts})"
      )
    for name in ("swiglu_limit", "swiglu_alpha"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"config field `{name}` must be a positive number, got {value!r}")

  def num_params(self) -> int:
    D, F, E = self.d_model, self.mlp_dim, self.num_experts
    experts = E * (3 * D * F + 2 * F + D)  # gate, up, down and their biases
    per_layer = self.attention_params() + D + D * E + E + experts + 2 * D  # o bias, router
    head = 0 if self.tie_embeddings else self.vocab_size * D
    return self.vocab_size * D + self.num_layers * per_layer + D + head


class GptOssBlock(LlamaBlock):
  """Llama's block with an o_proj bias, a router bias and clamped SwiGLU experts with
  biases (the sinks and q/k/v biases are the shared attention's: models/base.Block)."""

  def __init__(self, config: GptOssConfig, *, num_layers: int, dtype, rngs: nnx.Rngs):
    super().__init__(config, num_layers=num_layers, dtype=dtype, rngs=rngs)
    L, D, F, E = num_layers, config.d_model, config.mlp_dim, config.num_experts
    self.bo = zeros_param((L, D), dtype)
    self.router_bias = zeros_param((L, E), dtype)
    self.b_gate = zeros_param((L, E, F), dtype)
    self.b_up = zeros_param((L, E, F), dtype)
    self.b_down = zeros_param((L, E, D), dtype)

  def route(self, h_BTD):
    """The router with its bias: the top k logits, softmaxed over themselves."""
    cfg = self.config
    bias_E = self.router_bias[...]
    return route_softmax_top_k(h_BTD, self.router[...], bias_E, cfg.experts_per_token, True)

  def attention_residual(self, x_BTD, attn_BTNH, reduce=no_reduce) -> jax.Array:
    # The o bias after the shards' sum: added once, not once per tensor-parallel shard.
    return x_BTD + reduce(self.attention_output(attn_BTNH)) + self.bo[...]

  def finish_rows(self, x_BTD: jax.Array, attn_BTNH: jax.Array, reduce=no_reduce) -> jax.Array:
    cfg = self.config
    x_BTD = self.attention_residual(x_BTD, attn_BTNH, reduce)
    h_BTD = rms_norm(x_BTD, self.mlp_norm[...], cfg.norm_eps)
    weights_BTk, experts_BTk = self.route(h_BTD)
    b_down_ED = self.b_down[...]
    if self.w_gate[...].shape[-1] < cfg.mlp_dim:
      # Each expert's columns split over a tensor-parallel group (m does not divide E): the
      # shards' partial sums add up to the expert's output, whose bias one shard adds.
      b_down_ED = jnp.where(shard_index(reduce) == 0, b_down_ED, 0)

    def expert(x_tD, e):
      return clamped_swiglu(
        x_tD,
        self.w_gate[...][e],
        self.b_gate[...][e],
        self.w_up[...][e],
        self.b_up[...][e],
        self.w_down[...][e],
        b_down_ED[e],
        cfg.swiglu_limit,
        cfg.swiglu_alpha,
      )

    first = self.first_local_expert(reduce)  # experts split over a tensor-parallel group
    local = self.w_gate[...].shape[0]
    mlp_BTD = run_expert_mlps(h_BTD, weights_BTk, experts_BTk, local, expert, first)
    return x_BTD + reduce(mlp_BTD)


class GptOss(Llama):
  block_class = GptOssBlock


# --- Hugging Face config.json and tensor names


def check_gpt_oss_hf(hf: dict[str, Any]) -> None:
  """What config.json may ask for that is not built, refused by name before anything loads."""
  quantization = hf.get("quantization_config")
  if quantization is not None:
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    raise ValueError(
      f"config.json: a quantized checkpoint (`quantization_config` {method!r}: the published "
      "gpt-oss experts are MXFP4 blocks and scales) is not loaded; dequantize it with "
      "transformers (`Mxfp4Config(dequantize=True)`), save it, and load that directory"
    )
  refuse(hf, "attention_bias", False, "gpt_oss attention with its q/k/v/o biases only")


def gpt_oss_from_hf(hf: dict[str, Any], model_type: str, common: dict[str, Any]):
  """gpt-oss as transformers' GptOssConfig reads it (absent keys: its defaults)."""
  num_heads = hf["num_attention_heads"]
  if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
    hf = {**hf, "rope_parameters": {**DEFAULT_ROPE, "rope_theta": 150000.0}}
  if hf.get("layer_types") is None:  # transformers: windowed layers at even indices
    layers = common["num_layers"]
    hf = {
      **hf,
      "layer_types": [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
      ],
    }
  experts = or_default(hf, "num_local_experts", model_type)
  top_k = or_default(hf, "num_experts_per_tok", model_type)
  check_expert_counts(experts, top_k, model_type, "num_local_experts")
  swiglu = {}
  for key in ("swiglu_limit", "swiglu_alpha"):
    value = or_default(hf, key, model_type)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
      raise ValueError(f"config.json: `{key}` must be a positive number, got {value!r}")
    swiglu[key] = float(value)
  return GptOssConfig(
    **common,
    num_kv_heads=kv_heads_from_hf(hf, model_type, num_heads),
    head_dim=or_default(hf, "head_dim", model_type),
    mlp_dim=or_default(hf, "intermediate_size", model_type),
    norm_eps=or_default(hf, "rms_norm_eps", model_type),
    rope=rope_from_hf(hf, common["max_position_embeddings"], model_type),
    tie_embeddings=hf.get("tie_word_embeddings", False),
    num_experts=experts,
    experts_per_token=top_k,
    normalize_expert_weights=True,  # a softmax over the top k logits
    **windows_from_hf(hf, model_type),
    **swiglu,
  )


def gpt_oss_targets(cfg: GptOssConfig, name: str):
  """Llama's names for the embeddings, norms and q/k/v/o, and gpt-oss's own: the sinks, the
  o bias, the router's weight and bias, and the experts stored whole per layer: gate_up_proj
  [E, D, 2F] with gate and up interleaved (gate the even columns), its bias [E, 2F],
  down_proj [E, F, D] and its bias [E, D]."""
  D, N, F, E = cfg.d_model, cfg.num_heads, cfg.mlp_dim, cfg.num_experts
  m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
  if m is None or int(m.group(1)) >= cfg.num_layers:
    return llama_targets(cfg, name) if m is None else None
  layer, rest = int(m.group(1)), m.group(2)
  per_layer = {
    "self_attn.sinks": [("sinks", same, (N,))],
    "self_attn.o_proj.bias": [("bo", same, (D,))],
    "mlp.router.weight": [("router", lambda w: w.T, (E, D))],
    "mlp.router.bias": [("router_bias", same, (E,))],
    "mlp.experts.gate_up_proj": [
      ("w_gate", lambda w: w[..., 0::2], (E, D, 2 * F)),
      ("w_up", lambda w: w[..., 1::2], (E, D, 2 * F)),
    ],
    "mlp.experts.gate_up_proj_bias": [
      ("b_gate", lambda b: b[..., 0::2], (E, 2 * F)),
      ("b_up", lambda b: b[..., 1::2], (E, 2 * F)),
    ],
    "mlp.experts.down_proj": [("w_down", same, (E, F, D))],
    "mlp.experts.down_proj_bias": [("b_down", same, (E, D))],
  }
  if rest in per_layer:
    return [(("blocks", param), layer, fn, shape) for param, fn, shape in per_layer[rest]]
  if rest.startswith("mlp."):  # not Llama's MLP names: a tensor gpt-oss does not have
    return None
  return llama_targets(cfg, name)


FAMILY = Family(
  architecture="gpt_oss",
  model_types=MODEL_TYPES,
  config_class=GptOssConfig,
  module_class=GptOss,
  from_hf=gpt_oss_from_hf,
  tensor_targets=gpt_oss_targets,
  check_hf=check_gpt_oss_hf,
)
