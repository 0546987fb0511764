"""The Hugging Face reader: a directory of config.json, safetensors (one file or a sharded
index) and a tokenizer -> `Model`, whole or every tensor cut straight into its
tensor-parallel shards (`mesh=`), never more than about one tensor on the host."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvr_jax.core.caches import kept_cache
from kvr_jax.runtime import checkpoints, tensor_parallel
from kvr_jax.runtime.mesh import model_parallel
from kvr_jax.runtime.model import (
  Model,
  _check_split_mesh,
  abstract_model,
)
from models.families import config_from_hf

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _load_tokenizer(directory: str):
  if not any(os.path.exists(os.path.join(directory, f)) for f in _TOKENIZER_FILES):
    return None
  import transformers  # only when there is a tokenizer: the import is slow

  return transformers.AutoTokenizer.from_pretrained(directory)


_EMBEDDING_NAMES = ("model.embed_tokens.weight", "transformer.word_embeddings.weight")


def _stores_its_own_head(files: list[str]) -> bool:
  """A checkpoint whose config ties the head to the embedding but which stores an
  `lm_head.weight` that differs from it (read only in that case)."""
  head = embedding = None
  for path in files:
    for name, array in checkpoints.iter_safetensors(path):
      if name == "lm_head.weight":
        head = array
      elif name in _EMBEDDING_NAMES:
        embedding = array
  return head is not None and (
    embedding is None or head.shape != embedding.shape or not np.array_equal(head, embedding)
  )


def load_hf_model(directory: str, dtype=jnp.float32, progress: bool = False, *, mesh=None) -> Model:
  """Reads config.json and the safetensors weights of a Hugging Face directory.

  progress: show a progress bar over the tensors read (for large checkpoints).
  mesh: a ("ranks", "model") mesh to read every tensor straight into its shards (load_model).
  """
  config = config_from_hf(_read_config_json(directory))
  files = checkpoints.safetensors_files(directory)
  if config.tie_embeddings and _stores_its_own_head(files):
    # What transformers does with such a checkpoint: it does not tie (and says so).
    config = dataclasses.replace(config, tie_embeddings=False)
  if mesh is not None:
    _check_split_mesh(mesh, config)
  graphdef, abstract_state = nnx.split(abstract_model(config, dtype))
  flat_abstract = dict(nnx.to_flat_state(abstract_state))
  np_dtype = np.dtype(dtype)
  params = (
    _WholeParams(flat_abstract, np_dtype)
    if mesh is None
    else _SplitParams(flat_abstract, np_dtype, config, mesh)
  )
  filled, origin = _read_tensors(files, config, flat_abstract, params, progress)
  _check_complete(directory, flat_abstract, filled, origin)
  state = nnx.from_flat_state([(path, params.finish(path)) for path in flat_abstract])
  module = nnx.merge(graphdef, state)
  return Model(module, tokenizer=_load_tokenizer(directory), source=f"hf:{directory}")


def _read_config_json(directory: str) -> dict:
  with open(os.path.join(directory, "config.json")) as f:
    try:
      hf_config = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{directory}/config.json is not valid JSON: {e}") from None
  if not isinstance(hf_config, dict):
    raise ValueError(
      f"{directory}/config.json holds a JSON {type(hf_config).__name__}, not an object "
      "of config fields"
    )
  return hf_config


def _read_tensors(files, config, flat_abstract, params, progress: bool):
  """Every tensor of the files into `params`, each checked against its place; returns which
  layers of each parameter were filled and a tensor name each came from."""
  from tqdm.auto import tqdm

  filled: dict[tuple[str, ...], np.ndarray] = {}  # one flag per layer (or one for unstacked)
  origin: dict[tuple[str, ...], str] = {}
  bar = tqdm(desc="reading tensors", unit=" tensors", disable=not progress)
  skipped: dict[str, int] = {}  # why -> how many tensors the family does not load
  for path in files:
    for name, array in checkpoints.iter_safetensors(path):
      bar.update()
      targets = checkpoints.hf_targets(config, name)
      if targets is None:
        why = checkpoints.family_ignores(config, name)
        if why is not None:
          skipped[why] = skipped.get(why, 0) + 1
        if checkpoints.ignored_hf_tensor(config, name):
          continue
        raise ValueError(
          f"{path}: tensor {name!r} has no place in a {config.architecture} "
          f"model with this config.json (unknown tensor)"
        )
      for param_path, layer, transform, hf_shape in targets:
        value = _fitted_tensor(
          path, name, array, flat_abstract[param_path], layer, transform, hf_shape, param_path
        )
        if param_path not in filled:  # a flag per stacked index ((layer, expert) for experts)
          spec = flat_abstract[param_path]
          stacked = () if layer is None else spec.shape[: _stacked_axes(layer)]
          filled[param_path] = np.zeros(stacked or (1,), bool)
        origin[param_path] = name
        params.put(param_path, layer, value)
        filled[param_path][0 if layer is None else layer] = True
  bar.close()
  for why, count in skipped.items():
    warnings.warn(f"not loaded: {count} tensors of {why}", IgnoredTensorsWarning, stacklevel=3)
  return filled, origin


class IgnoredTensorsWarning(UserWarning):
  """A checkpoint holds tensors this model does not load (a vision tower): said, not hidden."""


def _stacked_axes(index) -> int:
  """The leading axes a target's index fills: 1 for a layer, 2 for an expert of a layer."""
  return len(index) if isinstance(index, tuple) else 1


def _fitted_tensor(path, name, array, spec, layer, transform, hf_shape, param_path):
  """The tensor transformed into its parameter's layout, or a refusal naming both shapes."""
  if tuple(array.shape) != hf_shape:  # before any reshape (see checkpoints.Target)
    raise ValueError(
      f"{path}: tensor {name!r} has shape {tuple(array.shape)}, but this config.json "
      f"needs {hf_shape}"
    )
  shape = spec.shape if layer is None else spec.shape[_stacked_axes(layer) :]
  try:
    value = transform(array)
  except ValueError:
    value = None
  if value is None or value.shape != tuple(shape):
    raise ValueError(
      f"{path}: tensor {name!r} has shape {tuple(array.shape)}, which "
      f"does not fit parameter {'.'.join(param_path)} of shape "
      f"{tuple(shape)} (per layer) for this config.json"
    )
  return value


def _check_complete(directory, flat_abstract, filled, origin) -> None:
  """Every parameter, every layer of it, came from some tensor; else one error naming them."""
  missing = []
  for param_path in flat_abstract:
    if _no_layers(flat_abstract[param_path].shape):
      continue  # a stack of a layer kind the model does not use (Qwen3.5 all linear)
    if param_path not in filled:
      missing.append(".".join(param_path))
    elif not filled[param_path].all():
      indices = np.argwhere(~filled[param_path]).tolist()  # [layer] or [layer, expert]
      layers_missing = [i[0] if len(i) == 1 else tuple(i) for i in indices]
      missing.append(
        f"{'.'.join(param_path)} (layers {layers_missing}, from tensors like "
        f"{origin[param_path]!r})"
      )
  if missing:
    raise ValueError(f"{directory}: the checkpoint lacks tensors for: {missing}")


def _no_layers(shape) -> bool:
  """A parameter with no elements: the stack of a layer kind with no layer in this model."""
  return 0 in tuple(shape)


class _WholeParams:
  """Each parameter assembled in one host buffer, then sent to the default device one
  parameter at a time (freeing its buffer): peak host memory about one copy of the weights
  plus the largest parameter."""

  def __init__(self, flat_abstract, np_dtype):
    self.flat_abstract, self.np_dtype = flat_abstract, np_dtype
    self.buffers: dict[tuple[str, ...], np.ndarray] = {}

  def put(self, param_path, layer, value) -> None:
    if param_path not in self.buffers:
      self.buffers[param_path] = np.empty(self.flat_abstract[param_path].shape, self.np_dtype)
    self.buffers[param_path][... if layer is None else layer] = value

  def finish(self, param_path) -> jax.Array:
    if param_path not in self.buffers:  # `_no_layers`: nothing to read
      return jnp.zeros(self.flat_abstract[param_path].shape, self.np_dtype)
    return jnp.asarray(self.buffers.pop(param_path))


class _SplitParams:
  """Each tensor sent straight to its shards (its tensor-parallel pieces, one per device of
  the mesh: `jax.device_put` of a host array with a sharding cuts it on the host and sends
  each device only its piece), so the host holds about one tensor at a time and no device
  more than its shard. A stacked parameter's layers are joined on the devices at the end."""

  def __init__(self, flat_abstract, np_dtype, config, mesh):
    self.np_dtype = np_dtype
    self.shapes = {path: spec.shape for path, spec in flat_abstract.items()}
    # A layer's experts stored one tensor each (Qwen3-MoE, Mixtral): gathered on the host
    # until the layer is whole, then sent split like the layer (each device its experts).
    self.expert_layers: dict[tuple, tuple[np.ndarray, set]] = {}
    whole_kv = tensor_parallel.stores_kv_whole(config, model_parallel(mesh))
    self.shardings = {
      path: jax.sharding.NamedSharding(
        mesh, tensor_parallel.param_spec(path, spec.shape, model_parallel(mesh), whole_kv=whole_kv)
      )
      for path, spec in flat_abstract.items()
    }
    self.layers: dict[tuple[str, ...], dict[int, jax.Array]] = collections.defaultdict(dict)
    self.unstacked: dict[tuple[str, ...], jax.Array] = {}

  def put(self, param_path, layer, value) -> None:
    sharding = self.shardings[param_path]
    value = np.asarray(value, self.np_dtype)
    if isinstance(layer, tuple):  # (layer, expert): one expert of a stacked [L, E, ...]
      layer, value = self._expert_layer(param_path, layer, value)
      if value is None:  # the layer still lacks experts
        return
    if layer is None:
      self.unstacked[param_path] = jax.device_put(value, sharding)
    else:  # one layer of a stacked [L, ...] parameter: its spec without the layer axis
      one_layer = jax.sharding.NamedSharding(sharding.mesh, jax.P(*sharding.spec[1:]))
      self.layers[param_path][layer] = jax.device_put(value, one_layer)

  def _expert_layer(self, param_path, index, value):
    """(layer, the layer's [E, ...] experts) once all of them have come, else (layer, None)."""
    layer, expert = index
    key = (param_path, layer)
    if key not in self.expert_layers:
      self.expert_layers[key] = (np.empty(self.shapes[param_path][1:], self.np_dtype), set())
    experts, seen = self.expert_layers[key]
    experts[expert] = value
    seen.add(expert)
    if len(seen) < experts.shape[0]:
      return layer, None
    del self.expert_layers[key]
    return layer, experts

  def finish(self, param_path) -> jax.Array:
    shape = self.shapes[param_path]
    if _no_layers(shape) and param_path not in self.layers:  # nothing to read
      return jax.device_put(np.zeros(shape, self.np_dtype), self.shardings[param_path])
    if param_path in self.unstacked:
      return self.unstacked.pop(param_path)
    layers = self.layers.pop(param_path)
    return _layer_stacker(self.shardings[param_path])(*(layers[i] for i in range(len(layers))))


@kept_cache(32)
def _layer_stacker(sharding: jax.sharding.NamedSharding):
  """A program joining one parameter's per-layer shards into its stacked [L, ...] array on
  each device (no communication: every layer is split the same way)."""
  return jax.jit(lambda *layers: jnp.stack(layers), out_shardings=sharding)


# ---------------------------------------------------------------------------------------------
# Orbax
