"""The loaded model's handle: `Model` (the NNX module split once into its graph and weights,
the weights placed per device or sharding and cached), the weights' dtypes, building a
model from its config (random weights, or shapes only) and splitting its state over a
("ranks", "model") mesh. What `load_model` returns; it knows nothing of files.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import models
from kvr_jax.core.caches import kept_cache
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.mesh import MODEL_AXIS, check_mesh, model_parallel
from kvr_jax.runtime.tensor_parallel import check_model_parallel
from models.config import ModelConfig

# Weight copies a Model keeps, one per placement (a device or a replicated mesh sharding).
MAX_PLACEMENTS = 4
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
AUTO_DTYPE = "auto"
PRESET_SEED = 0


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

  def state_for(self, mesh) -> Any:
    """The weights where a program over `mesh` reads them: split over each rank's "model" row
    on a ("ranks", "model") mesh (`state_split_over`), else whole on every device (`state_on`)."""
    if model_parallel(mesh) > 1:
      return self.state_split_over(mesh)
    return self.state_on(jax.sharding.NamedSharding(mesh, jax.P()))

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
      specs = tensor_parallel.partition_specs(ready, m)
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
    if cfg.layer_windows is not None:
      windowed = sum(w is not None for w in cfg.layer_windows)
      switches.append(f"windows on {windowed} of {cfg.num_layers} layers")
    if getattr(cfg, "num_experts", 0):
      switches.append(f"{cfg.experts_per_token} of {cfg.num_experts} experts")
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


def build_model(config: ModelConfig, dtype=jnp.float32, seed: int = PRESET_SEED) -> models.CausalLM:
  """A model with random weights from a fixed seed (the presets)."""
  return models.model_class(config)(config, dtype=resolve_dtype(dtype), rngs=nnx.Rngs(seed))


def abstract_model(config: ModelConfig, dtype=jnp.float32) -> models.CausalLM:
  """The model's structure with ShapeDtypeStructs instead of arrays (no memory used)."""
  return nnx.eval_shape(lambda: build_model(config, dtype))


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


@kept_cache(32)
def _head_repeater(sharding: jax.sharding.NamedSharding, repeats: int, axis: int):
  """A program repeating each KV head `repeats` times along `axis` whose output is split by
  `sharding`: each device computes only its own head (no whole repeated copy anywhere)."""
  return jax.jit(lambda kv: jnp.repeat(kv, repeats, axis=axis), out_shardings=sharding)
