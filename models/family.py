"""A model family as one record: what a family file declares and `models.families` registers.

A family is a config class (its architecture's fields), a Flax NNX module class, the
translation of the Hugging Face `config.json` of each `model_type` it loads, and where each of
its Hugging Face tensors goes (`tensor_targets`, models/tensor_names.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family (see the module docstring)."""

  architecture: str  # the config's `architecture`: presets and kvr-jax checkpoints name it
  model_types: tuple[str, ...]  # the Hugging Face `model_type`s it loads
  config_class: type
  module_class: type
  # (config.json dict, model_type, the fields every family reads) -> its config
  from_hf: Callable[[dict[str, Any], str, dict[str, Any]], Any]
  # (config, Hugging Face tensor name) -> [Target] (models.tensor_names), or None: no place
  tensor_targets: Callable[[Any, str], list | None]
  # config.json fields it needs beyond every family's (models.hf_config.REQUIRED_FIELDS)
  required_hf_fields: tuple[str, ...] = ()
  # its own config.json field checks, run before any is read (None: none)
  check_hf: Callable[[dict[str, Any]], None] | None = None
  # a multimodal checkpoint's config.json -> its language model's (None: the file is it)
  text_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None
  # (config, tensor name) -> why a tensor it holds is not loaded (a vision tower), or None
  ignores: Callable[[Any, str], str | None] | None = None

  def __post_init__(self):
    if not self.model_types:
      raise ValueError(f"family {self.architecture!r} loads no Hugging Face model_type")
    if getattr(self.config_class, "architecture", None) != self.architecture:
      raise ValueError(
        f"family {self.architecture!r}: its config class {self.config_class.__name__} says "
        f"architecture {getattr(self.config_class, 'architecture', None)!r}"
      )
