"""Config fidelity as a rule: one config.json, two readers, the same model or a refusal by name.

Every variant below is a tiny checkpoint written by transformers (`save_pretrained`) whose
config.json is then edited as users and older tools write them (the other RoPE layout, keys
left out so that defaults decide, windows per model type, tied or untied heads with and
without a stored head, biases, head_dim). transformers reads the edited directory with
`from_pretrained`, and so does the loader here: either its logits match transformers' within
MODEL_TOL, or it refuses with a ValueError that names the field. Which of the two is part of
the table: a refusal where a match is expected fails, and so does a match where the table
says transformers does something the project does not implement.

The rules follow transformers 5.x (5.23 when written; `transformers>=5` in pyproject):
older versions read some of these fields differently (transformers 4 tied a stored head to
the embedding under `tie_word_embeddings: true`, for one).
"""

import json
import os
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
import transformers

import kvr_jax
from tests import hf_fixtures
from tests.tolerance import assert_close

MODEL_TOL = 1e-4  # whole models against transformers, float32
TOKENS = np.random.RandomState(5).randint(0, 64, (1, 12))  # longer than every window below

CLASSES = {
  "llama": "Llama",
  "mistral": "Mistral",
  "qwen2": "Qwen2",
  "qwen3": "Qwen3",
  "qwen3_moe": "Qwen3Moe",
  "mixtral": "Mixtral",
  "gemma3_text": "Gemma3Text",
  "falcon": "Falcon",
}
MODEL_CLASSES = {"gemma3_text": "Gemma3ForCausalLM"}  # where not f"{CLASSES[...]}ForCausalLM"
# Four experts, two per token: small, and every expert routed to by some token of TOKENS.
EXPERTS = {
  "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
  "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def base_kwargs(model_type: str) -> dict:
  common = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  if model_type == "falcon":
    return dict(common, alibi=False, bias=False, ffn_hidden_size=48, new_decoder_architecture=True)
  if model_type == "gemma3_text":
    return dict(
      common,
      intermediate_size=48,
      num_key_value_heads=2,
      head_dim=8,
      sliding_window=4,
      layer_types=["sliding_attention", "full_attention"],
      query_pre_attn_scalar=12,
    )
  return dict(
    common,
    intermediate_size=48,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    **EXPERTS.get(model_type, {}),
  )


def drop(*keys: str) -> Callable[[dict], None]:
  def edit(config: dict) -> None:
    for key in keys:
      config.pop(key, None)

  return edit


def put(**values) -> Callable[[dict], None]:
  return lambda config: config.update(values)


def both(*edits) -> Callable[[dict], None]:
  def edit(config: dict) -> None:
    for e in edits:
      e(config)

  return edit


def old_rope_layout(config: dict) -> None:
  """transformers < 5 wrote `rope_theta` and `rope_scaling` with "type"."""
  params = dict(config.pop("rope_parameters"))
  config["rope_theta"] = params.pop("rope_theta")
  if params.get("rope_type", "default") != "default":
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params


def scaling_beside_parameters(**overrides) -> Callable[[dict], None]:
  """`rope_scaling` added to a transformers-5 config (as model cards say to do for YaRN)."""

  def edit(config: dict) -> None:
    params = dict(config["rope_parameters"])
    params.pop("rope_theta")
    config["rope_scaling"] = {**params, **overrides}

  return edit


LLAMA3 = {
  "rope_type": "llama3",
  "rope_theta": 10000.0,
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 16,
}
LINEAR = {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}
# Short original contexts, so that the 12-token prompt's positions pass them.
YARN = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=4)
YARN_CARD = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}
YARN_EVERY_KEY = dict(
  YARN, attention_factor=1.3, beta_fast=16.0, beta_slow=2.0, truncate=False, rope_theta=500.0
)
YARN_MSCALE = dict(YARN, mscale=0.8, mscale_all_dim=0.5)

# name: (model_type, build kwargs, edit of config.json, None = same model | field refused).
VARIANTS = {
  # RoPE: both layouts, every supported type, their precedence, and types refused by name.
  "llama-default-rope": ("llama", {}, None, None),
  "llama-theta-only-old-layout": ("llama", {"rope_theta": 500.0}, old_rope_layout, None),
  "llama-no-rope-keys": ("llama", {}, drop("rope_parameters", "rope_theta"), None),
  "llama-linear": ("llama", {"rope_parameters": LINEAR}, None, None),
  "llama-linear-old-layout": ("llama", {"rope_parameters": LINEAR}, old_rope_layout, None),
  "llama-llama3": ("llama", {"rope_parameters": LLAMA3}, None, None),
  "llama-llama3-old-layout": ("llama", {"rope_parameters": LLAMA3}, old_rope_layout, None),
  "llama-llama3-scaling-agrees": (
    "llama",
    {"rope_parameters": LLAMA3},
    scaling_beside_parameters(),
    None,
  ),
  "llama-scaling-disagrees": (
    "llama",
    {"rope_parameters": LLAMA3},
    scaling_beside_parameters(factor=4.0),
    "rope_scaling",
  ),
  # YaRN: as Qwen's model cards tell users to add it (the old layout beside a transformers-5
  # config), every optional key, and the pretraining context from each place it can come.
  "llama-yarn": ("llama", {"rope_parameters": YARN}, None, None),
  "qwen2-yarn-model-card": ("qwen2", {}, put(rope_scaling=YARN_CARD), None),
  "qwen3-yarn-old-layout": ("qwen3", {"rope_parameters": YARN}, old_rope_layout, None),
  "mistral-yarn-every-key": ("mistral", {"rope_parameters": YARN_EVERY_KEY}, None, None),
  "llama-yarn-mscale": ("llama", {"rope_parameters": YARN_MSCALE}, None, None),
  "llama-yarn-no-original": (
    "llama",
    {"rope_parameters": YARN},
    lambda config: config["rope_parameters"].pop("original_max_position_embeddings"),
    None,
  ),
  "llama-yarn-original-top-level": (
    "llama",
    {"rope_parameters": YARN},
    put(original_max_position_embeddings=8),
    None,
  ),
  "llama-yarn-no-factor": (
    "llama",
    {"rope_parameters": YARN},
    lambda config: config["rope_parameters"].pop("factor"),
    "needs a `factor`",
  ),
  "llama-longrope": (
    "llama",
    {},
    put(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}),
    "rope type 'longrope'",
  ),
  "llama-dynamic": (
    "llama",
    {},
    put(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
    "rope type 'dynamic'",
  ),
  "llama-partial-rotary": ("llama", {}, put(partial_rotary_factor=0.5), "partial_rotary_factor"),
  "llama-partial-rotary-in-parameters": (
    "llama",
    {},
    lambda config: config["rope_parameters"].update(partial_rotary_factor=0.5),
    "partial_rotary_factor",
  ),
  # Mixtures of experts: the router's renormalisation both ways, a window, and dense layers
  # among the experts (refused: one MLP shape per stacked model).
  "qwen3_moe-experts": ("qwen3_moe", {}, None, None),
  "qwen3_moe-normalized": ("qwen3_moe", {"norm_topk_prob": True}, None, None),
  "qwen3_moe-no-norm-key": ("qwen3_moe", {"norm_topk_prob": True}, drop("norm_topk_prob"), None),
  "qwen3_moe-dense-layers": ("qwen3_moe", {"mlp_only_layers": [0]}, None, "mlp_only_layers"),
  "qwen3_moe-sparse-step": ("qwen3_moe", {"decoder_sparse_step": 2}, None, "decoder_sparse_step"),
  "mixtral-experts": ("mixtral", {}, None, None),
  "mixtral-window": ("mixtral", {"sliding_window": 4}, None, None),
  "mixtral-no-eps": ("mixtral", {"rms_norm_eps": 1e-5}, drop("rms_norm_eps"), None),
  # Gemma 3: layer kinds from layer_types or the older sliding_window_pattern, a RoPE per
  # kind in either layout, soft-capping refused.
  "gemma3-local-global": ("gemma3_text", {}, None, None),
  "gemma3-old-pattern": (
    "gemma3_text",
    {},
    both(drop("layer_types"), put(sliding_window_pattern=2)),
    None,
  ),
  "gemma3-old-rope-layout": (
    "gemma3_text",
    {},
    both(
      drop("rope_parameters"),
      put(
        rope_theta=5e5,
        rope_local_base_freq=500.0,
        rope_scaling=dict(rope_type="linear", factor=4.0),
      ),
    ),
    None,
  ),
  "gemma3-old-rope-type-key": (
    "gemma3_text",
    {},
    both(
      drop("rope_parameters"), put(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0})
    ),
    "`rope_scaling` names its type as `type`",
  ),
  "gemma3-softcapping": ("gemma3_text", {}, put(final_logit_softcapping=30.0), "softcapping"),
  # Norms, head_dim, activations, biases.
  "llama-rms-eps": ("llama", {"rms_norm_eps": 1e-2}, None, None),
  "llama-no-rms-eps": ("llama", {"rms_norm_eps": 1e-6}, drop("rms_norm_eps"), None),
  "llama-head-dim-16": ("llama", {"head_dim": 16}, None, None),
  "llama-no-head-dim": ("llama", {}, drop("head_dim"), None),
  "llama-gelu": ("llama", {}, put(hidden_act="gelu"), "hidden_act"),
  "llama-attention-bias": ("llama", {"attention_bias": True}, None, "attention_bias"),
  "llama-mlp-bias": ("llama", {"mlp_bias": True}, None, "mlp_bias"),
  "llama-no-kv-heads": ("llama", {"num_key_value_heads": 4}, drop("num_key_value_heads"), None),
  # Heads: tied, untied, tied with its own stored head, untied with none stored.
  "llama-tied": ("llama", {"tie_word_embeddings": True}, None, None),
  "llama-tied-but-head-stored": ("llama", {}, put(tie_word_embeddings=True), None),
  "llama-no-tie-key": ("llama", {}, drop("tie_word_embeddings"), None),
  "llama-untied-no-head-stored": (
    "llama",
    {"tie_word_embeddings": True},
    put(tie_word_embeddings=False),
    "lacks tensors for: ['lm_head']",
  ),
  # Windows per model type and their defaults.
  "llama-sliding-window-key": ("llama", {}, put(sliding_window=4), None),
  "mistral-window-4": ("mistral", {"sliding_window": 4}, None, None),
  "mistral-window-null": ("mistral", {"sliding_window": None}, None, None),
  "mistral-no-window-key": ("mistral", {"sliding_window": 4}, drop("sliding_window"), None),
  "qwen2-window-off": ("qwen2", {"sliding_window": 4, "use_sliding_window": False}, None, None),
  "qwen2-window-every-layer": (
    "qwen2",
    {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 0},
    None,
    None,
  ),
  # A window on some layers: layer 0 full, layer 1 windowed (each layer its own window).
  "qwen2-window-from-layer-1": (
    "qwen2",
    {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1},
    None,
    None,
  ),
  "qwen3-layer-types-mixed": (
    "qwen3",
    {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 0},
    put(layer_types=["sliding_attention", "full_attention"]),
    None,
  ),
  "qwen2-no-layer-types": (
    "qwen2",
    {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 0},
    drop("layer_types"),
    None,
  ),
  # Absent, transformers' class default decides (28): with 2 layers no layer is windowed.
  "qwen2-no-max-window-layers": (
    "qwen2",
    {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 0},
    drop("max_window_layers", "layer_types"),
    None,
  ),
  "qwen3-no-max-window-layers": (
    "qwen3",
    {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 0},
    drop("max_window_layers", "layer_types"),
    None,
  ),
  "qwen3-head-dim-16": ("qwen3", {"head_dim": 16, "use_sliding_window": False}, None, None),
  "qwen3-no-head-dim": ("qwen3", {"head_dim": 128}, drop("head_dim"), None),
  "qwen3-window-every-layer": (
    "qwen3",
    {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 0},
    None,
    None,
  ),
  # Falcon: the three block forms, defaults, and what is refused.
  "falcon-40b-form": ("falcon", {"num_kv_heads": 2}, None, None),
  "falcon-40b-one-norm": ("falcon", {"num_kv_heads": 2, "num_ln_in_parallel_attn": 1}, None, None),
  "falcon-7b-form": (
    "falcon",
    {"new_decoder_architecture": False, "multi_query": True, "parallel_attn": True},
    None,
    None,
  ),
  "falcon-rw-form": (
    "falcon",
    {"new_decoder_architecture": False, "multi_query": False, "parallel_attn": True},
    None,
    None,
  ),
  "falcon-untied": ("falcon", {"tie_word_embeddings": False}, None, None),
  "falcon-no-tie-key": ("falcon", {}, drop("tie_word_embeddings"), None),
  "falcon-rope-theta": ("falcon", {"rope_theta": 500.0}, old_rope_layout, None),
  "falcon-sequential": (
    "falcon",
    {"new_decoder_architecture": False, "parallel_attn": False},
    None,
    "parallel_attn",
  ),
  "falcon-alibi": ("falcon", {}, put(alibi=True), "alibi"),
  "falcon-bias": ("falcon", {"bias": True}, None, "bias"),
  # The position limit a family takes when config.json has none (transformers' default).
  **{
    f"{family}-no-max-positions": (family, {}, drop("max_position_embeddings"), None)
    for family in ("llama", "mistral", "qwen2", "qwen3", "falcon")
  },
  # Reliability round 5: shapes transformers 5.24 reads one way and this loader
  # read another (silent wrong logits), or refuses where this loader loaded.
  "qwen3_moe-window-unused": (
    "qwen3_moe",
    {},
    put(sliding_window=4, use_sliding_window=False),
    None,
  ),
  "qwen3_moe-window-no-use-key": (
    "qwen3_moe",
    {"sliding_window": 4, "use_sliding_window": True},
    drop("use_sliding_window"),
    None,
  ),
  "qwen3_moe-layer-types-ignored": (
    "qwen3_moe",
    {"sliding_window": 4, "use_sliding_window": True},
    put(layer_types=["full_attention", "sliding_attention"]),
    None,
  ),
  "mixtral-layer-types-ignored": (
    "mixtral",
    {"sliding_window": 4},
    put(layer_types=["sliding_attention", "full_attention"]),
    None,
  ),
  "gemma3-local-rope-no-theta": (
    "gemma3_text",
    {},
    put(
      rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 5e5},
        "sliding_attention": {"rope_type": "default"},
      }
    ),
    None,
  ),
  "gemma3-local-rope-no-theta-top-level-freq": (
    "gemma3_text",
    {},
    put(
      rope_local_base_freq=300.0,
      rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 5e5},
        "sliding_attention": {"rope_type": "default"},
      },
    ),
    None,
  ),
  "gemma3-local-rope-null": (
    "gemma3_text",
    {},
    put(
      rope_local_base_freq=300.0,
      rope_parameters={
        "full_attention": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0},
        "sliding_attention": None,
      },
    ),
    None,
  ),
  "gemma3-local-rope-absent": (
    "gemma3_text",
    {},
    put(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5}}),
    None,
  ),
  "gemma3-full-rope-no-theta-top-level-theta": (
    "gemma3_text",
    {},
    put(
      rope_theta=5e4,
      rope_parameters={
        "full_attention": {"rope_type": "default"},
        "sliding_attention": {"rope_type": "default", "rope_theta": 300.0},
      },
    ),
    None,
  ),
  "gemma3-flat-rope-default": (
    "gemma3_text",
    {},
    put(rope_parameters={"rope_type": "default", "rope_theta": 5e4}),
    "rope_parameters",
  ),
  "gemma3-flat-rope-linear": (
    "gemma3_text",
    {},
    put(rope_parameters={"rope_type": "linear", "rope_theta": 5e4, "factor": 2.0}),
    "rope_parameters",
  ),
  "gemma3-rope-as-list": ("gemma3_text", {}, put(rope_parameters=[1e4]), "rope_parameters"),
  "qwen2-yarn-card-theta-inside": (
    "qwen2",
    {},
    put(rope_scaling=dict(YARN_CARD, rope_theta=500.0)),
    None,
  ),
  "gemma3-pattern-zero": (
    "gemma3_text",
    {},
    both(drop("layer_types"), put(sliding_window_pattern=0)),
    "sliding_window_pattern",
  ),
  "gemma3-pattern-text": (
    "gemma3_text",
    {},
    both(drop("layer_types"), put(sliding_window_pattern="6")),
    "sliding_window_pattern",
  ),
  "gemma3-pre-attn-scalar-zero": (
    "gemma3_text",
    {},
    put(query_pre_attn_scalar=0),
    "query_pre_attn_scalar",
  ),
  "gemma3-pre-attn-scalar-null": (
    "gemma3_text",
    {},
    put(query_pre_attn_scalar=None),
    "query_pre_attn_scalar",
  ),
  "gemma3-pre-attn-scalar-text": (
    "gemma3_text",
    {},
    put(query_pre_attn_scalar="256"),
    "query_pre_attn_scalar",
  ),
  "gemma3-window-null": ("gemma3_text", {}, put(sliding_window=None), "sliding_window"),
  # Booleans and numbers as strings or null, which transformers' strict config classes refuse.
  "qwen3_moe-norm-topk-text": ("qwen3_moe", {}, put(norm_topk_prob="true"), "norm_topk_prob"),
  "qwen3_moe-norm-topk-null": ("qwen3_moe", {}, put(norm_topk_prob=None), "norm_topk_prob"),
  "llama-tie-text": ("llama", {}, put(tie_word_embeddings="false"), "tie_word_embeddings"),
  "llama-tie-null": ("llama", {}, put(tie_word_embeddings=None), "tie_word_embeddings"),
  "qwen2-use-window-text": (
    "qwen2",
    {"sliding_window": 4},
    put(use_sliding_window="true"),
    "use_sliding_window",
  ),
  "qwen3-use-window-null": (
    "qwen3",
    {"sliding_window": 4},
    put(use_sliding_window=None),
    "use_sliding_window",
  ),
  "llama-yarn-factor-text": (
    "llama",
    {"rope_parameters": YARN},
    lambda config: config["rope_parameters"].update(factor="4.0"),
    "factor",
  ),
  "llama-theta-text-in-parameters": (
    "llama",
    {},
    lambda config: config["rope_parameters"].update(rope_theta="10000"),
    "rope_theta",
  ),
  "llama-eos-text": ("llama", {}, put(eos_token_id="2"), "eos_token_id"),
  "mixtral-num-experts-key": (
    "mixtral",
    {},
    both(drop("num_local_experts"), put(num_experts=4)),
    "num_experts",
  ),
  "qwen2-yarn-card-no-factor": (
    "qwen2",
    {},
    put(rope_scaling={"type": "yarn", "original_max_position_embeddings": 4}),
    "factor",
  ),
  # Malformed files: a required field missing, a field of the wrong type or range.
  "llama-no-vocab-size": ("llama", {}, drop("vocab_size"), "vocab_size"),
  "llama-no-intermediate-size": ("llama", {}, drop("intermediate_size"), "intermediate_size"),
  "qwen2-no-layers": ("qwen2", {}, drop("num_hidden_layers"), "num_hidden_layers"),
  "falcon-no-hidden-size": ("falcon", {}, drop("hidden_size"), "hidden_size"),
  "llama-eps-as-text": ("llama", {}, put(rms_norm_eps="1e-5"), "rms_norm_eps"),
  "llama-heads-as-float": ("llama", {}, put(num_attention_heads=4.0), "num_attention_heads"),
  "mistral-negative-positions": ("mistral", {}, put(max_position_embeddings=-1), "max_position"),
}


# Variants refused for what their weights lack, not for a config.json field.
REFUSED_FOR_THEIR_WEIGHTS = {"llama-untied-no-head-stored"}


def write_variant(name: str, directory) -> None:
  """The variant's checkpoint; a variant the loader refuses for a config.json field gets its
  config.json alone (the loader reads and refuses it before any weight)."""
  model_type, kwargs, edit, refused_field = VARIANTS[name]
  config_class = getattr(transformers, f"{CLASSES[model_type]}Config")
  model_class = getattr(
    transformers, MODEL_CLASSES.get(model_type, f"{CLASSES[model_type]}ForCausalLM")
  )
  config = config_class(**{**base_kwargs(model_type), **kwargs})
  if refused_field is not None and name not in REFUSED_FOR_THEIR_WEIGHTS:
    config.save_pretrained(directory)
  else:
    torch.manual_seed(0)
    hf_fixtures.randomize(model_class(config), seed=0).save_pretrained(directory)
  if edit is not None:
    path = os.path.join(directory, "config.json")
    with open(path) as f:
      stored = json.load(f)
    edit(stored)
    with open(path, "w") as f:
      json.dump(stored, f)


def effective_windows(hf_config) -> tuple:
  """The window transformers applies on each layer (None: all keys)."""
  L = hf_config.num_hidden_layers
  layer_types = getattr(hf_config, "layer_types", None)
  if hf_config.model_type in ("mistral", "mixtral", "qwen3_moe"):  # every layer, by the field
    return (hf_config.sliding_window,) * L
  if hf_config.model_type in ("llama", "falcon") or layer_types is None:
    return (None,) * L
  return tuple(hf_config.sliding_window if t == "sliding_attention" else None for t in layer_types)


@pytest.mark.default_cases(
  "llama-theta-only-old-layout",
  "llama-no-rope-keys",
  "llama-linear",
  "llama-linear-old-layout",
  "llama-llama3",
  "llama-scaling-disagrees",
  "llama-yarn-mscale",
  "llama-yarn-no-original",
  "llama-yarn-original-top-level",
  "llama-yarn-no-factor",
  "llama-longrope",
  "llama-dynamic",
  "llama-partial-rotary",
  "llama-partial-rotary-in-parameters",
  "qwen3_moe-dense-layers",
  "qwen3_moe-sparse-step",
  "gemma3-old-rope-type-key",
  "gemma3-softcapping",
  "llama-no-rms-eps",
  "llama-no-head-dim",
  "llama-gelu",
  "llama-attention-bias",
  "llama-mlp-bias",
  "llama-no-kv-heads",
  "llama-tied",
  "llama-tied-but-head-stored",
  "llama-no-tie-key",
  "llama-untied-no-head-stored",
  "llama-sliding-window-key",
  "mistral-window-null",
  "mistral-no-window-key",
  "qwen2-window-off",
  "qwen2-window-every-layer",
  "qwen2-window-from-layer-1",
  "qwen2-no-layer-types",
  "qwen2-no-max-window-layers",
  "qwen3-no-max-window-layers",
  "qwen3-head-dim-16",
  "falcon-40b-one-norm",
  "falcon-7b-form",
  "falcon-rw-form",
  "falcon-untied",
  "falcon-no-tie-key",
  "falcon-rope-theta",
  "falcon-sequential",
  "falcon-alibi",
  "falcon-bias",
  "mistral-no-max-positions",
  "qwen2-no-max-positions",
  "qwen3-no-max-positions",
  "falcon-no-max-positions",
  "gemma3-local-rope-no-theta-top-level-freq",
  "gemma3-local-rope-null",
  "gemma3-local-rope-absent",
  "gemma3-full-rope-no-theta-top-level-theta",
  "gemma3-flat-rope-default",
  "gemma3-flat-rope-linear",
  "gemma3-rope-as-list",
  "qwen2-yarn-card-theta-inside",
  "gemma3-pattern-zero",
  "gemma3-pattern-text",
  "gemma3-pre-attn-scalar-zero",
  "gemma3-pre-attn-scalar-null",
  "gemma3-pre-attn-scalar-text",
  "gemma3-window-null",
  "qwen3_moe-norm-topk-text",
  "qwen3_moe-norm-topk-null",
  "llama-tie-text",
  "llama-tie-null",
  "qwen2-use-window-text",
  "qwen3-use-window-null",
  "llama-yarn-factor-text",
  "llama-theta-text-in-parameters",
  "llama-eos-text",
  "mixtral-num-experts-key",
  "qwen2-yarn-card-no-factor",
  "llama-no-vocab-size",
  "llama-no-intermediate-size",
  "qwen2-no-layers",
  "falcon-no-hidden-size",
  "llama-eps-as-text",
  "llama-heads-as-float",
  "mistral-negative-positions",
)
@pytest.mark.parametrize("name", VARIANTS)
def test_the_loader_reads_config_json_as_transformers_does_or_refuses_by_name(name, tmp_path):
  refused_field = VARIANTS[name][3]
  write_variant(name, tmp_path)
  if refused_field is not None:
    with pytest.raises(ValueError, match=re.escape(refused_field)):
      kvr_jax.load_model(str(tmp_path), dtype="float32")
    return
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path, attn_implementation="eager"
  )
  want = hf_fixtures.hf_logits(hf_model, TOKENS).astype(np.float64)
  ours = kvr_jax.load_model(str(tmp_path), dtype="float32")
  # Fields a 12-token prompt cannot show in the logits: the window and the position limit.
  assert ours.config.windows == effective_windows(hf_model.config)
  assert ours.config.max_position_embeddings == hf_model.config.max_position_embeddings
  assert_fields_agree(ours.config, hf_model.config)
  got = np.asarray(ours.module(TOKENS), np.float64)
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err <= MODEL_TOL, f"{name}: relative error {err:.2e} > {MODEL_TOL}"


def assert_fields_agree(ours, theirs) -> None:
  """transformers' own config object (read from the same file) and the project's config agree
  on what the project reads beyond the windows: the RoPE of each layer kind (its type, base
  and factor), each of the type transformers holds."""
  params = theirs.rope_parameters
  kinds = {"rope": params}
  if theirs.model_type == "gemma3_text":
    kinds = {"rope": params["full_attention"], "local_rope": params["sliding_attention"]}
  for field, rope in kinds.items():
    mine = getattr(ours, field)
    assert mine.type == rope["rope_type"], (field, mine, rope)
    assert isinstance(rope["rope_theta"], (int, float)) and mine.theta == rope["rope_theta"]
    assert mine.factor == rope.get("factor", 1.0), (field, mine, rope)
  # (The head itself the logits show: transformers keeps a stored head even when told to tie.)
  assert isinstance(theirs.tie_word_embeddings, bool)


# The families whose config.json rows are read without building a model: every family.
CONFIG_CLASSES = {
  **{t: f"{name}Config" for t, name in CLASSES.items()},
  "gpt_oss": "GptOssConfig",
  "qwen3_5_text": "Qwen3_5TextConfig",
  "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
  "qwen3_next": "Qwen3NextConfig",
  "deepseek_v3": "DeepseekV3Config",
}
HYBRID_EXPERTS = dict(
  head_dim=8,
  num_experts=4,
  num_experts_per_tok=2,
  moe_intermediate_size=16,
  shared_expert_intermediate_size=16,
)
# Their small shapes (the heads, experts and latent ranks each family's loader reads).
CONFIG_ONLY_KWARGS = {
  "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=4),
  "qwen3_5_text": dict(head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
  "qwen3_5_moe_text": HYBRID_EXPERTS,
  "qwen3_next": HYBRID_EXPERTS,
  "deepseek_v3": dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_group=2,
    topk_group=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    num_key_value_heads=4,
  ),
}


def _saved_config(model_type: str) -> dict:
  """What save_pretrained writes for the family's test config: every key its class has."""
  config_class = getattr(transformers, CONFIG_CLASSES[model_type])
  kwargs = base_kwargs(model_type)
  if model_type in CONFIG_ONLY_KWARGS:
    kwargs = {
      k: v for k, v in kwargs.items() if k not in ("tie_word_embeddings",)
    } | CONFIG_ONLY_KWARGS[model_type]
  return json.loads(config_class(**kwargs).to_json_string())


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_every_absent_key_reads_as_transformers_default_or_is_refused_by_name(model_type):
  """Each key of a saved config.json removed in turn: the loader's config equals the one it
  reads from transformers' own filling-in of that key (its config class's default and what
  the class derives from it), or the loader refuses the file naming the key."""
  from models.families import config_from_hf

  config_class = getattr(transformers, CONFIG_CLASSES[model_type])
  saved = _saved_config(model_type)
  wrong = []
  for key in sorted(saved):
    absent = {k: v for k, v in saved.items() if k != key}
    try:
      ours = config_from_hf(absent)
    except ValueError as e:
      if key not in str(e):
        wrong.append(f"{key}: refused without naming it ({e})")
      continue
    filled = json.loads(config_class.from_dict(absent).to_json_string())
    theirs = config_from_hf(filled)
    if ours != theirs:
      diff = {f: (getattr(ours, f), getattr(theirs, f)) for f in ours.__dataclass_fields__}
      diff = {f: v for f, v in diff.items() if v[0] != v[1]}
      wrong.append(f"{key}: ours != transformers' default {diff}")
  assert not wrong, "\n".join(wrong)


def test_yarn_positions_are_absolute_on_every_rank(tmp_path):
  """KV-Runahead's ranks rotate their chunks at their own offsets: with YaRN (its ramp and its
  attention factor) every strategy's logits and cache stay within 1e-5 of single's."""
  write_variant("llama-yarn", tmp_path)
  model = kvr_jax.load_model(str(tmp_path), dtype="float32")
  tokens = np.random.RandomState(9).randint(0, 64, (1, 24))
  want = kvr_jax.prefill(model, tokens, "single")
  mesh = kvr_jax.make_mesh(3)
  got = kvr_jax.prefill(model, tokens, "kvr", mesh, partition=[10, 8, 6])
  assert_close(got.logits, want.logits, "kvr logits, yarn")
  assert_close(got.k_cache, want.k_cache, "kvr K cache, yarn")


def _numbers(config: dict, path=()):
  """(path of keys, value) of every number in a config dict, nested dicts included."""
  for key, value in config.items():
    if key.startswith("_"):  # transformers' bookkeeping, not the model's
      continue
    if isinstance(value, dict):
      yield from _numbers(value, (*path, key))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      yield (*path, key), value


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_every_number_written_as_a_string_is_refused_by_name(model_type):
  """Each number of a saved config.json written as a string in turn ("2.5" for 2.5), as
  transformers' validation refuses it: the loader refuses the file naming the key."""
  from models.families import config_from_hf

  saved = _saved_config(model_type)
  wrong = []
  for path, value in _numbers(saved):
    edited = json.loads(json.dumps(saved))
    place = edited
    for key in path[:-1]:
      place = place[key]
    place[path[-1]] = str(value)
    try:
      config_from_hf(edited)
    except ValueError as e:
      if path[-1] not in str(e):
        wrong.append(f"{path}: refused without naming it ({e})")
      continue
    wrong.append(f"{path}: {str(value)!r} accepted")
  assert not wrong, "\n".join(wrong)
