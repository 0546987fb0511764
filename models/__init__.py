"""Flax NNX decoders of the families in models.families (Llama and its switches, Falcon,
Gemma 3). Device-agnostic per-layer maths; see models/base.py."""

from models.base import Block, CausalLM, Layer, LayerStack, scan_layers
from models.config import ModelConfig, RopeConfig
from models.falcon import Falcon, FalconConfig
from models.families import (
  FAMILIES,
  config_from_dict,
  config_from_hf,
  family_of,
  model_class,
)
from models.gemma import Gemma, GemmaConfig
from models.llama import Llama, LlamaConfig

__all__ = [
  "FAMILIES",
  "Block",
  "CausalLM",
  "Falcon",
  "FalconConfig",
  "Gemma",
  "GemmaConfig",
  "Llama",
  "LlamaConfig",
  "ModelConfig",
  "Layer",
  "LayerStack",
  "RopeConfig",
  "config_from_dict",
  "config_from_hf",
  "family_of",
  "model_class",
  "scan_layers",
]
