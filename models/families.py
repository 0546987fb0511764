"""The model families, registered in one place: one `Family` record per family file
(models/llama.py, falcon.py, gemma.py, qwen3_5.py, deepseek_v3.py, gpt_oss.py), and what reads the
registry: a config from a dict (presets, checkpoints) or from a Hugging Face `config.json`, a
config's module class and its Hugging Face tensor names.

A new family is its file (config class, module, config.json translation, tensor names, its
`FAMILY` record), one line in FAMILIES and its tests.
"""

from __future__ import annotations

from typing import Any

from models import deepseek_v3, falcon, gemma, gpt_oss, llama, qwen3_5
from models.config import ModelConfig, RopeConfig, check_dict_fields
from models.family import Family
from models.hf_config import check_fields, or_default

FAMILIES: tuple[Family, ...] = (
  llama.FAMILY,
  falcon.FAMILY,
  gemma.FAMILY,
  qwen3_5.FAMILY,
  deepseek_v3.FAMILY,
  gpt_oss.FAMILY,
)

ARCHITECTURES: dict[str, type[ModelConfig]] = {f.architecture: f.config_class for f in FAMILIES}
FAMILY_OF_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILY_OF_MODEL_TYPE)


def family_of(config: ModelConfig) -> Family:
  """The family whose config class `config` is."""
  for family in FAMILIES:
    if family.architecture == config.architecture:
      return family
  raise ValueError(f"no family registered for architecture {config.architecture!r}")


def model_class(config: ModelConfig):
  """The Flax NNX module class of `config`'s family."""
  return family_of(config).module_class


def config_from_dict(data: dict[str, Any], *, complete: bool = False) -> ModelConfig:
  """Inverse of `ModelConfig.to_dict` (the format of the presets in `configs/` and of a
  kvr-jax checkpoint's metadata). Every value is checked against its field's type, and a
  wrong one refused by name; complete=True (a saved checkpoint, written whole by `to_dict`)
  also refuses a missing field, which would otherwise take a default and change the model."""
  if not isinstance(data, dict):
    raise ValueError(f"a config must be a dict of fields, got {type(data).__name__}")
  data = dict(data)
  arch = data.pop("architecture", None)
  if arch not in ARCHITECTURES:
    raise ValueError(
      f"config field `architecture` must be one of {sorted(ARCHITECTURES)}, got {arch!r}"
    )
  cls = ARCHITECTURES[arch]
  check_dict_fields(cls, data, complete, arch)
  for key in ("rope", "local_rope"):
    if isinstance(data.get(key), dict):
      check_dict_fields(RopeConfig, data[key], complete, f"{arch} `{key}`")
      data[key] = RopeConfig(**data[key])
  # JSON lists are the tuple fields (eos ids, windows, layer types): a config is hashable.
  data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
  return cls(**data)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
  """Builds a config from the dict of a Hugging Face `config.json`."""
  model_type = hf.get("model_type")
  family = FAMILY_OF_MODEL_TYPE.get(model_type)
  if family is None:
    raise ValueError(
      f"config.json: `model_type`={model_type!r} is not supported; supported: "
      f"{', '.join(repr(t) for t in SUPPORTED_MODEL_TYPES)}"
    )
  if family.text_config is not None:
    hf = family.text_config(hf)
    model_type = hf.get("model_type", model_type)
  check_fields(hf, model_type, family.required_hf_fields)
  if family.check_hf is not None:
    family.check_hf(hf)
  eos = or_default(hf, "eos_token_id", model_type)
  if isinstance(eos, list):
    eos = tuple(eos)
  common = dict(
    vocab_size=hf["vocab_size"],
    d_model=hf["hidden_size"],
    num_layers=hf["num_hidden_layers"],
    num_heads=hf["num_attention_heads"],
    eos_token_id=eos,
    bos_token_id=or_default(hf, "bos_token_id", model_type),
    max_position_embeddings=or_default(hf, "max_position_embeddings", model_type, 2048),
  )
  return family.from_hf(hf, model_type, common)
