"""Reading a Hugging Face `config.json` as transformers (5.x) reads it: the pieces every family
shares. The field types and required fields, the defaults transformers' config classes take
for an absent key (per model type), the KV heads, and RoPE in both layouts (the older
`rope_theta`/`rope_scaling` and the current `rope_parameters`). Each family's own translation
is its record's `from_hf` (models/llama.py, falcon.py, gemma.py); `models.families` runs it.
"""

from __future__ import annotations

from typing import Any

from models.config import ROPE_TYPES, RopeConfig


def _yarn_from_hf(hf: dict[str, Any], merged: dict[str, Any], max_positions: int) -> dict:
  """YaRN's fields as transformers reads them: the pretraining context from a top-level
  `original_max_position_embeddings` first (Phi-3's layout, which transformers lets win), then
  the rope parameters', else the model's `max_position_embeddings`; beta_fast / beta_slow
  given as null take their defaults (transformers' `or 32`, `or 1`)."""
  original = hf.get("original_max_position_embeddings")
  if original is None:
    original = merged.get("original_max_position_embeddings", max_positions)
  out = {"original_max_position_embeddings": int(original)}
  out["beta_fast"] = float(merged.get("beta_fast") or 32.0)
  out["beta_slow"] = float(merged.get("beta_slow") or 1.0)
  out["truncate"] = bool(merged.get("truncate", True))
  for key in ("attention_factor", "mscale", "mscale_all_dim"):
    if merged.get(key) is not None:
      out[key] = float(merged[key])
  return out


# The numbers a RoPE dict may hold (a string or a boolean there is refused by name, as
# transformers' validation refuses it).
ROPE_NUMBER_FIELDS = (
  "rope_theta",
  "factor",
  "low_freq_factor",
  "high_freq_factor",
  "original_max_position_embeddings",
  "attention_factor",
  "beta_fast",
  "beta_slow",
  "mscale",
  "mscale_all_dim",
)


def rope_from_hf(hf: dict[str, Any], max_positions: int, model_type: str) -> RopeConfig:
  """Reads RoPE settings from either config layout.

  transformers < 5 wrote `rope_theta` and `rope_scaling` ({"type" or "rope_type": ...});
  transformers >= 5 writes `rope_parameters` = {"rope_type", "rope_theta", ...}.
  max_positions: the model's position limit (YaRN's pretraining context when none is given).
  """
  merged = _merged_rope_layouts(hf)
  for key in ROPE_NUMBER_FIELDS:
    value = merged.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
      raise ValueError(f"config.json: rope `{key}` must be a number, got {value!r}")
  theta = merged.get("rope_theta", or_default(hf, "rope_theta", model_type, 10000.0))
  rope_type = merged.get("rope_type", merged.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise ValueError(
      f"config.json: rope type {rope_type!r} (in `rope_parameters`/`rope_scaling`)"
      f" is not supported; supported: {ROPE_TYPES}"
    )
  kwargs: dict[str, Any] = {"theta": float(theta), "type": rope_type}
  if rope_type in ("linear", "llama3", "yarn"):
    if merged.get("factor") is None:
      raise ValueError(f"config.json: rope type {rope_type!r} needs a `factor`")
    kwargs["factor"] = float(merged["factor"])
  if rope_type == "yarn":
    kwargs.update(_yarn_from_hf(hf, merged, max_positions))
  if rope_type == "llama3":
    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
      if key not in merged:
        raise ValueError(f"config.json: rope type 'llama3' needs `{key}`")
      kwargs[key] = merged[key]
  # transformers 5 moves a top-level `partial_rotary_factor` into rope_parameters (and its
  # Llama then ignores it): a model that asks for partial rotary is refused either way.
  if merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError("config.json: `partial_rotary_factor` != 1 is not supported")
  return RopeConfig(**kwargs)


def _merged_rope_layouts(hf: dict[str, Any]) -> dict[str, Any]:
  """The RoPE settings of `rope_parameters` and `rope_scaling` as one dict, as transformers
  combines them; where both name a scaling and disagree, refused by name."""
  for key in ("rope_parameters", "rope_scaling"):
    if hf.get(key) is not None and not isinstance(hf[key], dict):
      raise ValueError(f"config.json: `{key}` must be a dict, got {hf[key]!r}")
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  params_type = params.get("rope_type", params.get("type", "default"))
  if scaling and params_type == "default" and set(params) <= {"rope_type", "type", "rope_theta"}:
    # A transformers-5 config without scaling (`rope_parameters` holds the default type and
    # the base) and a `rope_scaling` added as Qwen's model cards say, for YaRN: transformers
    # honours the scaling, and so does this reader (on the base the parameters give).
    # transformers takes the card in place of the parameters: a `rope_theta` inside the card
    # wins over the parameters' base (which is kept only where the card has none).
    params = (
      {} if "rope_theta" in scaling else {k: v for k, v in params.items() if k == "rope_theta"}
    )
  elif params and scaling:
    # Both layouts naming a scaling: which one a reader honours differs, so a disagreement
    # is refused by name, never resolved quietly.
    scaling_type = scaling.get("rope_type", scaling.get("type", "default"))
    shared = set(params) & set(scaling) - {"rope_type", "type"}
    differing = sorted(k for k in shared if params[k] != scaling[k])
    if params_type != scaling_type or differing:
      raise ValueError(
        f"config.json: `rope_scaling` ({scaling_type!r}) and `rope_parameters` "
        f"({params_type!r}) disagree{' on ' + ', '.join(differing) if differing else ''}; "
        "keep one of them"
      )
  return {**scaling, **params}


def refuse(hf: dict[str, Any], field: str, bad: Any, why: str) -> None:
  if hf.get(field, None) == bad:
    raise ValueError(f"config.json: `{field}`={bad!r} is not supported ({why})")


# Defaults transformers (5.x) takes when config.json leaves a key out, where they are not the
# generic ones: Qwen3's head_dim is a fixed 128 (not hidden_size / heads), Mistral's window is
# 4096 (`sliding_window` absent is not `null`), and the position limits per family.
HEAD_DIM_DEFAULTS = {"qwen3": 128, "gpt_oss": 64}


WINDOW_DEFAULTS = {"mistral": 4096, "gpt_oss": 128}


# What transformers' config classes fill in for a key a config.json does not have, per family
# (tests/test_config_fidelity.py removes every key in turn and compares with the classes).
# num_key_value_heads absent: Llama repeats num_attention_heads, the others have a number.
FAMILY_DEFAULTS = {
  "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
  "mistral": {
    "max_position_embeddings": 131072,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "num_key_value_heads": 8,
  },
  "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
  "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
  "qwen3_moe": {
    "max_position_embeddings": 32768,
    "num_key_value_heads": 4,
    "norm_topk_prob": False,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
  },
  "mixtral": {
    "max_position_embeddings": 131072,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
  },
  "falcon": {"max_position_embeddings": 2048, "bos_token_id": 11, "eos_token_id": 11},
  "gpt_oss": {
    "max_position_embeddings": 131072,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 2880,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_limit": 7.0,
    "swiglu_alpha": 1.702,
  },
  "deepseek_v3": {
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rms_norm_eps": 1e-6,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "rope_interleave": True,
    "num_key_value_heads": 128,
  },
  "qwen3_5_text": {"max_position_embeddings": 32768, "num_key_value_heads": 4},
  "qwen3_5_moe_text": {
    "max_position_embeddings": 32768,
    "num_key_value_heads": 2,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
  },
  "qwen3_next": {
    "max_position_embeddings": 32768,
    "num_key_value_heads": 2,
    "intermediate_size": 5632,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
  },
  "gemma3_text": {
    "max_position_embeddings": 131072,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
    "tie_word_embeddings": True,
    "rope_theta": 1e6,
    "rope_local_base_freq": 10000.0,
  },
}


MAX_POSITION_DEFAULTS = {k: v["max_position_embeddings"] for k, v in FAMILY_DEFAULTS.items()}


def kv_heads_from_hf(hf: dict[str, Any], model_type: str, num_heads: int) -> int:
  """num_key_value_heads, or the family's default where absent (Llama: num_heads); an absent
  key whose default does not divide num_attention_heads is refused naming it (transformers
  would build a model that cannot run)."""
  kv_heads = or_default(hf, "num_key_value_heads", model_type) or num_heads
  if "num_key_value_heads" not in hf and isinstance(num_heads, int) and num_heads % kv_heads:
    raise ValueError(
      f"config.json has no `num_key_value_heads`: {model_type}'s default is {kv_heads}, which "
      f"does not divide num_attention_heads={num_heads}; give num_key_value_heads"
    )
  return kv_heads


def or_default(hf: dict[str, Any], key: str, model_type: str, fallback=None):
  """`hf[key]`, or where config.json has no such key what the family's transformers class
  fills in (FAMILY_DEFAULTS), else `fallback`."""
  if key in hf:
    return hf[key]
  return FAMILY_DEFAULTS.get(model_type, {}).get(key, fallback)


# What config.json must hold, per family, and the types of the fields read from it: a missing
# or mistyped field is refused by name at load (not a KeyError, nor a TypeError inside a
# traced program).
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


POSITIVE_INT_FIELDS = (
  "vocab_size",
  "hidden_size",
  "num_hidden_layers",
  "num_attention_heads",
  "intermediate_size",
  "num_key_value_heads",
  "num_kv_heads",
  "head_dim",
  "max_position_embeddings",
  "ffn_hidden_size",
)


NON_NEGATIVE_INT_FIELDS = ("max_window_layers",)


POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "rope_theta")


# Booleans of transformers' config classes (typed `bool`, so its strict validation refuses a
# string or null there); present, they must be true or false.
BOOL_FIELDS = (
  "tie_word_embeddings",
  "use_sliding_window",
  "norm_topk_prob",
  "attention_bias",
  "mlp_bias",
  "new_decoder_architecture",
  "multi_query",
  "parallel_attn",
  "alibi",
  "bias",
)


def _is_number_text(value) -> bool:
  try:
    float(value)
  except (TypeError, ValueError):
    return False
  return True


def check_no_number_as_text(hf: dict[str, Any]) -> None:
  """No field (nor a key of a nested dict such as `rope_parameters`) holds a number written as
  a string ("2.5"): every number transformers' config classes read is typed int or float,
  and their validation refuses a string there, whichever family's field it is."""
  for name, value in hf.items():
    if name.startswith("_") or name == "transformers_version":  # bookkeeping, not the model's
      continue
    if isinstance(value, dict):
      check_no_number_as_text(value)
    elif isinstance(value, str) and _is_number_text(value):
      raise ValueError(f"config.json: `{name}` must be a number, got the string {value!r}")


def check_fields(hf: dict[str, Any], model_type: str, family_required=()) -> None:
  """Required fields present (every family's and `family_required`), every field read of the
  right type (null = absent), no number written as a string."""
  check_no_number_as_text(hf)
  required = REQUIRED_FIELDS + tuple(family_required)
  missing = [name for name in required if hf.get(name) is None]
  if missing:
    raise ValueError(f"config.json lacks the required field(s) {missing} ({model_type})")
  for name in POSITIVE_INT_FIELDS + NON_NEGATIVE_INT_FIELDS:
    value = hf.get(name)
    smallest = 0 if name in NON_NEGATIVE_INT_FIELDS else 1
    if value is not None and (
      isinstance(value, bool) or not isinstance(value, int) or value < smallest
    ):
      raise ValueError(f"config.json: `{name}` must be an integer >= {smallest}, got {value!r}")
  for name in POSITIVE_FLOAT_FIELDS:
    value = hf.get(name)
    if value is not None and (
      isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
    ):
      raise ValueError(f"config.json: `{name}` must be a positive number, got {value!r}")
  for name in BOOL_FIELDS:
    if name in hf and not isinstance(hf[name], bool):
      raise ValueError(f"config.json: `{name}` must be true or false, got {hf[name]!r}")
  for name in ("eos_token_id", "bos_token_id"):
    value = hf.get(name)
    ids = value if isinstance(value, list) and name == "eos_token_id" else [value]
    if value is not None and any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
      form = "an integer, a list of integers or null" if name == "eos_token_id" else "an integer"
      raise ValueError(f"config.json: `{name}` must be {form}, got {value!r}")
