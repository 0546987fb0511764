"""kvr-jax's own checkpoints (Orbax): `save_model` writes the weights, the config and the
tokenizer; `restore_model` reads them back whole on one device, or each device its own
slices of a split model (`mesh=`), casting on the way."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
from flax import nnx

import models
from kvr_jax.core import resources
from kvr_jax.runtime.hf_reader import _load_tokenizer
from kvr_jax.runtime.model import DTYPES, Model, _check_split_mesh, abstract_model, split_shardings
from models.families import config_from_dict

ORBAX_CONFIG = "kvr_config.json"
ORBAX_STATE = "state"


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
  try:
    checkpointer.save(os.path.join(directory, ORBAX_STATE), nnx.to_pure_dict(model.state))
    checkpointer.wait_until_finished()
  finally:
    # Its background threads and event loop end here, not when a later garbage collection
    # finds them (then "Event loop is closed", raised in whatever runs next).
    checkpointer.close()
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
    config = config_from_dict(meta["config"], complete=True)
    saved_dtype = DTYPES[meta["dtype"]]
  except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    raise ValueError(
      f"{directory}: corrupt kvr-jax checkpoint metadata ({ORBAX_CONFIG}): {e}"
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
