"""Flax NNX Llama and Falcon. Device-agnostic per-layer maths; see models/base.py."""

from models.base import Block, CausalLM, scan_blocks
from models.config import (
  FalconConfig,
  GemmaConfig,
  LlamaConfig,
  ModelConfig,
  RopeConfig,
  config_from_dict,
  config_from_hf,
)
from models.falcon import Falcon
from models.gemma import Gemma
from models.llama import Llama

MODEL_CLASSES = {"llama": Llama, "falcon": Falcon, "gemma3": Gemma}


def model_class(config: ModelConfig) -> type[CausalLM]:
  return MODEL_CLASSES[config.architecture]


__all__ = [
  "Block",
  "CausalLM",
  "Falcon",
  "FalconConfig",
  "Gemma",
  "GemmaConfig",
  "Llama",
  "LlamaConfig",
  "ModelConfig",
  "RopeConfig",
  "config_from_dict",
  "config_from_hf",
  "model_class",
  "scan_blocks",
]
