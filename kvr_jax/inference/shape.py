"""What a prefill plan reads of the model and the prompt: shapes only, no weights and no
tokens, so that a plan is made the same way for a loaded model (`plan_prefill`) and for a
model that was never built (kvr_jax.tools.memory's programs compiled from shapes)."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvr_jax.runtime.loading import Model
from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class PrefillShape:
  """config: the architecture. dtype: the weights' dtype name. prompt_len: T, the rows'
  padded length (their bucket). batch: B. longest: the longest real row (T unless every row
  is padded). padded: some row is shorter than T. preset: the preset whose weights these are
  (its KVR-P tables), None for a checkpoint or a bare config."""

  config: ModelConfig
  dtype: str
  prompt_len: int
  batch: int
  longest: int
  padded: bool = False
  preset: str | None = None

  @classmethod
  def of_model(cls, model: Model, lengths_B, prompt_len: int) -> PrefillShape:
    """The shape of `model` prefilling rows of `lengths_B` padded to `prompt_len`."""
    lengths_B = np.asarray(lengths_B)
    return cls(
      config=model.config,
      dtype=np.dtype(model.dtype).name,
      prompt_len=int(prompt_len),
      batch=len(lengths_B),
      longest=int(lengths_B.max()),
      padded=bool((lengths_B < prompt_len).any()),
      preset=model.preset,
    )

  @property
  def itemsize(self) -> int:
    return np.dtype(self.dtype).itemsize

  @property
  def model_key(self) -> tuple:
    """What a plan's choices read of the model (not its weights): the key of an answer agreed
    across processes."""
    return (self.config, self.dtype, self.preset)
