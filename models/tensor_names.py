"""Hugging Face tensor names: the shared pieces of each family's `tensor_targets`.

Each Hugging Face tensor maps to one or more stacked model parameters (Falcon's fused
query_key_value feeds wq, wk and wv). A target names the parameter, its layer (or (layer,
expert)), the transform of the Hugging Face array into ours, and the shape the Hugging Face
tensor must have.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# (parameter path in the NNX state, layer index (or (layer, expert)) or None, transform of the
# HF array, the shape the HF tensor must have). The shape is checked before any transform: a
# transposed or reshaped tensor with the right element count would otherwise load, silently
# wrong.
Target = tuple[
  tuple[str, ...], int | tuple[int, int] | None, Callable[[np.ndarray], np.ndarray], tuple[int, ...]
]


def linear(*shape: int) -> Callable[[np.ndarray], np.ndarray]:
  """torch Linear weight [out, in] -> ours [in, *out_split] (x @ W form)."""
  return lambda w: w.T.reshape(shape)


def linear_entry(param: str, in_dims: tuple[int, ...], out_dims: tuple[int, ...]):
  """(param, transform, HF shape) of a torch Linear weight [prod(out), prod(in)] that becomes
  our [*in_dims, *out_dims]."""
  hf_shape = (int(np.prod(out_dims)), int(np.prod(in_dims)))
  return param, linear(*in_dims, *out_dims), hf_shape


def same(w: np.ndarray) -> np.ndarray:
  return w
