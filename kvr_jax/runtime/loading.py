"""`load_model`: a preset name, a Hugging Face directory or an Orbax checkpoint -> `Model`.

Nothing half-loaded is ever returned: every error is raised before the model is assembled.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
from kvr_jax.core import resources
from kvr_jax.core.caches import kept_cache
from kvr_jax.runtime import checkpoints, tensor_parallel
from kvr_jax.runtime.mesh import MODEL_AXIS, check_mesh, model_parallel
from kvr_jax.runtime.tensor_parallel import check_model_parallel
from models.config import ModelConfig, config_from_dict, config_from_hf

PRESET_SEED = 0
# Weight copies a Model keeps, one per placement (a device or a replicated mesh sharding).
MAX_PLACEMENTS = 4
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
AUTO_DTYPE = "auto"
ORBAX_CONFIG = "kvr_config.json"
ORBAX_STATE = "state"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclasses.dataclass(eq=False)
class Model:
  """A loaded model: the NNX module split once into a static graph and its weights.

  `graphdef` is hashable and identifies the architecture for compiled-program caches;
  `state` holds the weights. `tokenizer` is a transformers tokenizer or None.
  """

  module: models.CausalLM
  tokenizer: Any = None
  source: str = ""
  # The preset's name where the weights are a preset's (random) ones: its shipped KVR-P
  # tables and partition defaults apply; None for a checkpoint.
  preset: str | None = None

  def __post_init__(self):
    self.graphdef, self.state = nnx.split(self.module)
    # The ("ranks", "model") mesh the weights were loaded split over (load_model(mesh=)), or
    # None when they are whole on one device.
    self.split_mesh = next(
      (
        leaf.sharding.mesh
        for leaf in jax.tree.leaves(self.state)
        if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding)
        and MODEL_AXIS in leaf.sharding.mesh.axis_names
        and not leaf.sharding.is_fully_replicated
      ),
      None,
    )
    # Weight copies per placement, least recently used first; bounded so that a notebook
    # trying many meshes does not keep every copy of the weights alive.
    self._placed: collections.OrderedDict[Any, Any] = collections.OrderedDict()

  @property
  def config(self) -> ModelConfig:
    return self.module.config

  @property
  def dtype(self):
    return self.module.dtype

  def state_on(self, sharding_or_device) -> Any:
    """The weights placed on a device or replicated with a sharding; cached per placement.

    At most one copy of the weights per device, whatever was placed before: every placement
    is assembled from the buffers that already live on its devices (`self.state` on the
    default device, other placements' replicas) and copies device to device only where a
    device holds none. A sharding may span other processes' devices (jax.distributed): each
    process fills only its own devices. Weights loaded split over a mesh are gathered whole
    onto the placement's devices (what a one-device baseline of a model that fits needs).
    """
    if sharding_or_device not in self._placed:
      sharding = sharding_or_device
      if not isinstance(sharding, jax.sharding.Sharding):
        sharding = jax.sharding.SingleDeviceSharding(sharding_or_device)
      if not sharding.is_fully_replicated:
        raise ValueError(f"weights are placed replicated; got the sharding {sharding}")
      # Whole copies only (a split placement, keyed by its mesh, holds pieces per device).
      whole = [v for k, v in self._placed.items() if not isinstance(k, jax.sharding.Mesh)]
      sources = [self.state, *whole]
      self._placed[sharding_or_device] = jax.tree.map(
        lambda *leaves: _replicate(leaves, sharding), *sources
      )
    return self._remember(sharding_or_device)

  def state_split_over(self, mesh) -> Any:
    """The weights split over a ("ranks", "model") mesh Megatron-style (every rank's row
    holds the same split: kvr_jax.runtime.tensor_parallel), cached per mesh like `state_on`.
    Weights loaded split over this mesh (`load_model(mesh=)`) are used where they lie (KV
    heads repeated on the shards first where K < m); otherwise placed from `self.state`. A
    mesh whose devices another split placement already holds at the same model index
    (decode's last-rank row after the prefill's mesh) is assembled from those shards: one
    weight copy per device."""
    if mesh not in self._placed:
      m = model_parallel(mesh)
      ready = jax.eval_shape(
        lambda state: tensor_parallel.shard_ready_state(self.config, state, m), self.state
      )
      specs = tensor_parallel.partition_specs(ready)
      held = self._split_holding(mesh)

      def place(leaf, ready_leaf, spec, held_leaf=None):
        sharding = jax.sharding.NamedSharding(mesh, spec)
        if held_leaf is not None:
          pieces = {s.device: s.data for s in held_leaf.addressable_shards}
          buffers = [pieces[d] for d in sharding.addressable_devices]
          return jax.make_array_from_single_device_arrays(ready_leaf.shape, sharding, buffers)
        if leaf.shape == ready_leaf.shape:
          return jax.device_put(leaf, sharding)  # the leaf itself if already placed so
        # KV heads repeated to m (K < m): from a copy on this mesh (loaded split) inside one
        # program that outputs only each device's head; else repeated, then placed.
        axis = list(spec).index(MODEL_AXIS)
        repeats = ready_leaf.shape[axis] // leaf.shape[axis]
        if getattr(leaf.sharding, "mesh", None) == mesh:
          return _head_repeater(sharding, repeats, axis)(leaf)
        return jax.device_put(jnp.repeat(leaf, repeats, axis=axis), sharding)

      args = (self.state, ready, specs) if held is None else (self.state, ready, specs, held)
      self._placed[mesh] = jax.tree.map(place, *args)
    return self._remember(mesh)

  def _split_holding(self, mesh):
    """A kept split placement that holds every device of `mesh` at the same model index."""
    wanted = {d: j for row in mesh.devices for j, d in enumerate(row)}
    for key, state in self._placed.items():
      if isinstance(key, jax.sharding.Mesh) and model_parallel(key) == model_parallel(mesh):
        index = {d: j for row in key.devices for j, d in enumerate(row)}
        if all(index.get(d) == j for d, j in wanted.items()):
          return state
    return None

  def _remember(self, key) -> Any:
    """The placement under `key`, now the most recently used; the oldest beyond
    MAX_PLACEMENTS are dropped."""
    self._placed.move_to_end(key)
    while len(self._placed) > MAX_PLACEMENTS:
      self._placed.popitem(last=False)
    return self._placed[key]

  @property
  def placements(self) -> tuple[Any, ...]:
    """The placements whose weight copies are kept (least recently used first)."""
    return tuple(self._placed)

  def __repr__(self):
    cfg = self.config
    switches = [name for name in ("qkv_bias", "qk_norm") if getattr(cfg, name)]
    if cfg.sliding_window is not None:
      switches.append(f"sliding_window={cfg.sliding_window}")
    if self.split_mesh is not None:
      ranks, m = self.split_mesh.devices.shape
      switches.append(f"split over {ranks} ranks x {m} model shards")
    return (
      f"Model({', '.join([cfg.architecture, *switches])}, {cfg.num_params() / 1e6:.2f}M params, "
      f"dtype={jnp.dtype(self.dtype).name}, source={self.source!r})"
    )


def auto_dtype(platform: str | None = None) -> Any:
  """dtype="auto": bfloat16 on GPUs and TPUs (twice the speed, half the memory of float32),
  float32 on CPUs (where the parity tests run, and where XLA's bfloat16 matmuls are slower).
  platform: default JAX's default backend."""
  platform = platform or jax.default_backend()
  return jnp.bfloat16 if platform in ("gpu", "tpu") else jnp.float32


def _replicate(sources: tuple[jax.Array, ...], sharding: jax.sharding.Sharding) -> jax.Array:
  """One weight replicated with `sharding`, built from the buffers `sources` (the same weight,
  placed elsewhere) already hold on its devices; a device that holds none gets a device-to-
  device copy of the first local buffer (no host round trip). Sources that hold only pieces
  (split over a mesh) are gathered by JAX when no whole copy exists."""
  on_device = {}
  for source in sources:
    if not source.sharding.is_fully_replicated:
      continue
    for shard in source.addressable_shards:
      on_device.setdefault(shard.device, shard.data)
  if not on_device:
    return jax.device_put(sources[0], sharding)
  first = next(iter(on_device.values()))
  buffers = [
    on_device[d] if d in on_device else jax.device_put(first, d)
    for d in sharding.addressable_devices
  ]
  return jax.make_array_from_single_device_arrays(first.shape, sharding, buffers)


def resolve_dtype(dtype) -> Any:
  """A dtype name ("auto", "float32", "bfloat16", "float16") or dtype -> the jnp dtype."""
  if isinstance(dtype, str):
    if dtype == AUTO_DTYPE:
      return auto_dtype()
    if dtype not in DTYPES:
      raise ValueError(
        f"unknown dtype {dtype!r}; expected {AUTO_DTYPE!r} or one of {sorted(DTYPES)}"
      )
    return DTYPES[dtype]
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES.values()]:
    raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
  return dtype


def preset_names() -> list[str]:
  return sorted(p.stem for p in resources.config_dir().glob("*.json"))


def preset_config(name: str) -> ModelConfig:
  path = resources.config_dir() / f"{name}.json"
  if not isinstance(name, str) or not path.is_file():
    raise ValueError(
      f"unknown preset {name!r}; presets: {preset_names()} "
      "(or pass a Hugging Face or Orbax directory)"
    )
  with open(path) as f:
    return config_from_dict(json.load(f))


def config_of(model: str) -> ModelConfig:
  """The architecture of what `load_model(model)` would load, without its weights: a preset
  name, a Hugging Face directory (its config.json) or a kvr-jax Orbax directory."""
  if not (isinstance(model, str) and os.path.isdir(model)):
    return preset_config(model)
  for name, read in (
    (ORBAX_CONFIG, lambda d: config_from_dict(d["config"])),
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


def build_model(config: ModelConfig, dtype=jnp.float32, seed: int = PRESET_SEED) -> models.CausalLM:
  """A model with random weights from a fixed seed (the presets)."""
  return models.model_class(config)(config, dtype=resolve_dtype(dtype), rngs=nnx.Rngs(seed))


def abstract_model(config: ModelConfig, dtype=jnp.float32) -> models.CausalLM:
  """The model's structure with ShapeDtypeStructs instead of arrays (no memory used)."""
  return nnx.eval_shape(lambda: build_model(config, dtype))


def load_model(name_or_path: str, dtype=AUTO_DTYPE, *, mesh=None) -> Model:
  """Loads a preset (random weights, fixed seed), a Hugging Face directory or an Orbax dir.

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
  config = preset_config(name_or_path)
  dtype = auto_dtype() if dtype is None else dtype
  if mesh is None:
    return Model(build_model(config, dtype), source=f"preset:{name_or_path}", preset=name_or_path)
  return Model(
    _build_split(config, dtype, mesh), source=f"preset:{name_or_path}", preset=name_or_path
  )


def _check_split_mesh(mesh, config: ModelConfig | None = None) -> None:
  """A mesh weights can be loaded split over: 2-D ("ranks", "model"), and (with the config)
  its model axis splitting the model's heads and MLP columns."""
  check_mesh(mesh, allow_model=True)
  m = model_parallel(mesh)
  if MODEL_AXIS not in mesh.axis_names:
    raise ValueError(
      "load_model(mesh=) splits the weights over a ('ranks', 'model') mesh "
      "(kvr_jax.make_mesh(p, model=m)); on a 1-D mesh every rank holds the whole weights, "
      "which prefill places itself: load without a mesh"
    )
  if config is not None:
    check_model_parallel(config, m)


def split_shardings(config: ModelConfig, state, mesh) -> Any:
  """A NamedSharding per leaf of the model's own state (or its abstract shapes) split over
  `mesh`'s "model" axis and replicated over its ranks (tensor_parallel.own_state_specs)."""
  specs = tensor_parallel.own_state_specs(config, state, model_parallel(mesh))
  return jax.tree.map(
    lambda spec: jax.sharding.NamedSharding(mesh, spec),
    specs,
    is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
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
  config = config_from_hf(hf_config)
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
  filled: dict[tuple[str, ...], np.ndarray] = {}  # one flag per layer (or one for unstacked)
  origin: dict[tuple[str, ...], str] = {}
  from tqdm.auto import tqdm

  bar = tqdm(desc="reading tensors", unit=" tensors", disable=not progress)
  for path in files:
    for name, array in checkpoints.iter_safetensors(path):
      bar.update()
      targets = checkpoints.hf_targets(config, name)
      if targets is None:
        if checkpoints.ignored_hf_tensor(config, name):
          continue
        raise ValueError(
          f"{path}: tensor {name!r} has no place in a {config.architecture} "
          f"model with this config.json (unknown tensor)"
        )
      for param_path, layer, transform, hf_shape in targets:
        if tuple(array.shape) != hf_shape:  # before any reshape (see checkpoints.Target)
          raise ValueError(
            f"{path}: tensor {name!r} has shape {tuple(array.shape)}, but this config.json "
            f"needs {hf_shape}"
          )
        spec = flat_abstract[param_path]
        shape = spec.shape[1:] if layer is not None else spec.shape
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
        if param_path not in filled:
          filled[param_path] = np.zeros(spec.shape[0] if layer is not None else 1, bool)
        origin[param_path] = name
        params.put(param_path, layer, value)
        filled[param_path][0 if layer is None else layer] = True

  bar.close()
  missing = []
  for param_path in flat_abstract:
    if param_path not in filled:
      missing.append(".".join(param_path))
    elif not filled[param_path].all():
      layers_missing = np.flatnonzero(~filled[param_path]).tolist()
      missing.append(
        f"{'.'.join(param_path)} (layers {layers_missing}, from tensors like "
        f"{origin[param_path]!r})"
      )
  if missing:
    raise ValueError(f"{directory}: the checkpoint lacks tensors for: {missing}")

  state = nnx.from_flat_state([(path, params.finish(path)) for path in flat_abstract])
  module = nnx.merge(graphdef, state)
  return Model(module, tokenizer=_load_tokenizer(directory), source=f"hf:{directory}")


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
    return jnp.asarray(self.buffers.pop(param_path))


class _SplitParams:
  """Each tensor sent straight to its shards (its tensor-parallel pieces, one per device of
  the mesh: `jax.device_put` of a host array with a sharding cuts it on the host and sends
  each device only its piece), so the host holds about one tensor at a time and no device
  more than its shard. A stacked parameter's layers are joined on the devices at the end."""

  def __init__(self, flat_abstract, np_dtype, config, mesh):
    self.np_dtype = np_dtype
    whole_kv = tensor_parallel.stores_kv_whole(config, model_parallel(mesh))
    self.shardings = {
      path: jax.sharding.NamedSharding(
        mesh, tensor_parallel.param_spec(path, len(spec.shape), whole_kv=whole_kv)
      )
      for path, spec in flat_abstract.items()
    }
    self.layers: dict[tuple[str, ...], dict[int, jax.Array]] = collections.defaultdict(dict)
    self.unstacked: dict[tuple[str, ...], jax.Array] = {}

  def put(self, param_path, layer, value) -> None:
    sharding = self.shardings[param_path]
    value = np.asarray(value, self.np_dtype)
    if layer is None:
      self.unstacked[param_path] = jax.device_put(value, sharding)
    else:  # one layer of a stacked [L, ...] parameter: its spec without the layer axis
      one_layer = jax.sharding.NamedSharding(sharding.mesh, jax.P(*sharding.spec[1:]))
      self.layers[param_path][layer] = jax.device_put(value, one_layer)

  def finish(self, param_path) -> jax.Array:
    if param_path in self.unstacked:
      return self.unstacked.pop(param_path)
    layers = self.layers.pop(param_path)
    return _layer_stacker(self.shardings[param_path])(*(layers[i] for i in range(len(layers))))


@kept_cache(32)
def _head_repeater(sharding: jax.sharding.NamedSharding, repeats: int, axis: int):
  """A program repeating each KV head `repeats` times along `axis` whose output is split by
  `sharding`: each device computes only its own head (no whole repeated copy anywhere)."""
  return jax.jit(lambda kv: jnp.repeat(kv, repeats, axis=axis), out_shardings=sharding)


@kept_cache(32)
def _layer_stacker(sharding: jax.sharding.NamedSharding):
  """A program joining one parameter's per-layer shards into its stacked [L, ...] array on
  each device (no communication: every layer is split the same way)."""
  return jax.jit(lambda *layers: jnp.stack(layers), out_shardings=sharding)


# ---------------------------------------------------------------------------------------------
# Orbax


def check_save_directory(directory: str) -> str:
  """`directory` (absolute) if `save_model` can write a checkpoint there, else one ValueError:
  called by save_model, and by launchers before they load anything."""
  directory = os.path.abspath(directory)
  if os.path.exists(os.path.join(directory, ORBAX_STATE)):
    raise ValueError(f"{directory} already holds a checkpoint; choose an empty directory")
  if os.path.exists(os.path.join(directory, "config.json")):
    # load_model(directory) would then restore the Orbax copy instead of the HF weights.
    raise ValueError(
      f"{directory} holds a Hugging Face checkpoint (config.json); save into another directory"
    )
  # Checked before Orbax starts: its writer threads, failing, keep the interpreter alive.
  return resources.writable_directory(directory, directory)


def save_model(model: Model, directory: str) -> None:
  """Saves weights (Orbax), config and tokenizer, so `load_model(directory)` restores them."""
  import orbax.checkpoint as ocp

  directory = check_save_directory(directory)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(directory, ORBAX_STATE), nnx.to_pure_dict(model.state))
  checkpointer.wait_until_finished()
  if model.tokenizer is not None:
    model.tokenizer.save_pretrained(os.path.join(directory, "tokenizer"))
  # Written last: its presence marks a complete checkpoint.
  meta = {
    "config": model.config.to_dict(),
    "dtype": jnp.dtype(model.dtype).name,
    "source": model.source,
  }
  with open(os.path.join(directory, ORBAX_CONFIG), "w") as f:
    json.dump(meta, f, indent=2)


def restore_model(directory: str, dtype=None, *, mesh=None) -> Model:
  """Restores a checkpoint written by `save_model` (optionally casting to `dtype`).

  mesh: a ("ranks", "model") mesh: each device reads only its shard's slices (load_model)."""
  import orbax.checkpoint as ocp

  directory = os.path.abspath(directory)
  try:
    with open(os.path.join(directory, ORBAX_CONFIG)) as f:
      meta = json.load(f)
    config = config_from_dict(meta["config"])
    saved_dtype = DTYPES[meta["dtype"]]
  except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
    raise ValueError(
      f"{directory}: corrupt kvr-jax checkpoint metadata ({ORBAX_CONFIG}): {e!r}"
    ) from None
  if mesh is not None:
    _check_split_mesh(mesh, config)
  graphdef, abstract_state = nnx.split(abstract_model(config, saved_dtype))
  target = nnx.to_pure_dict(abstract_state)
  if mesh is not None:
    # Orbax reads each device's slices of the arrays (and casts them): nothing whole anywhere.
    restored_dtype = saved_dtype if dtype is None else dtype
    target = jax.tree.map(
      lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, restored_dtype, sharding=sharding),
      target,
      split_shardings(config, target, mesh),
    )
  else:
    # Whole on this process's first device, whatever sharding it was saved with (a model
    # loaded split saves its shards' layout, which another device count cannot honour).
    whole = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=whole), target
    )
  state_dir = os.path.join(directory, ORBAX_STATE)
  if not os.path.isdir(state_dir):
    raise ValueError(f"{directory}: checkpoint is incomplete: no {ORBAX_STATE}/ directory")
  try:
    restored = _quiet_restore(ocp, state_dir, target)
  except Exception as e:  # orbax raises many types for truncated or corrupt files
    raise ValueError(
      f"{directory}: cannot restore the Orbax checkpoint, it is corrupt or "
      f"partial ({type(e).__name__}: {str(e)[:300]})"
    ) from None
  nnx.replace_by_pure_dict(abstract_state, restored)
  module = nnx.merge(graphdef, abstract_state)
  if dtype is not None and jnp.dtype(dtype) != jnp.dtype(saved_dtype):
    module = _cast(module, dtype)  # on a mesh, Orbax has cast the arrays; the module learns it
  tok_dir = os.path.join(directory, "tokenizer")
  tokenizer = _load_tokenizer(tok_dir) if os.path.isdir(tok_dir) else None
  return Model(module, tokenizer=tokenizer, source=f"orbax:{directory}")


def _quiet_restore(ocp, state_dir: str, target):
  """Orbax restore whose failure is one exception, not pages of asyncio and absl logging from
  its background threads (the caller turns the exception into one line)."""
  import logging

  quiet = [logging.getLogger(name) for name in ("asyncio", "absl", "orbax")]
  levels = [logger.level for logger in quiet]
  for logger in quiet:
    logger.setLevel(logging.CRITICAL)
  try:
    checkpointer = ocp.StandardCheckpointer()
    try:
      return checkpointer.restore(state_dir, target)
    finally:
      checkpointer.close()
  finally:
    for logger, level in zip(quiet, levels, strict=True):
      logger.setLevel(level)


def _cast(module: models.CausalLM, dtype) -> models.CausalLM:
  graphdef, state = nnx.split(module)
  state = jax.tree.map(lambda a: a.astype(dtype), state)
  module = nnx.merge(graphdef, state)
  module.dtype = jnp.dtype(dtype)
  return module
