"""Where kvr-jax finds its shipped data and keeps its per-machine caches.

Presets and KVR-P tables are package data of the `configs` package (configs/ at the top of
the repository, installed with the wheel), found with importlib.resources so that an
installed kvr-jax works from any directory. Per-machine results (the `local` calibration,
KVR-P tables built on this machine) go to a cache directory: $KVR_JAX_CACHE_DIR, else
$XDG_CACHE_HOME/kvr_jax, else ~/.cache/kvr_jax.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import pathlib
import warnings


def config_dir() -> pathlib.Path:
  """configs/: model presets (<name>.json)."""
  return pathlib.Path(str(importlib.resources.files("configs")))


def partition_dir() -> pathlib.Path:
  """configs/partitions/: the shipped KVR-P tables."""
  return config_dir() / "partitions"


def configured_cache_dir() -> pathlib.Path:
  """Where this machine's cache is meant to be, whether or not it can be used."""
  base = os.environ.get("KVR_JAX_CACHE_DIR")
  if not base:
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    base = os.path.join(xdg, "kvr_jax")
  return pathlib.Path(base)


class CacheDirWarning(UserWarning):
  """The kvr-jax cache directory cannot be used: nothing is cached, results are measured again."""


def cache_dir() -> pathlib.Path | None:
  """This machine's cache (created on first use), or None when it cannot be used (a file, not
  creatable, not writable): then a warning says why and callers cache nothing, measuring
  again instead. A cache is an optimisation; an unusable one never stops a run."""
  path = configured_cache_dir()
  try:
    writable_directory(
      path, f"the kvr-jax cache directory {path} (KVR_JAX_CACHE_DIR or ~/.cache/kvr_jax)"
    )
  except ValueError as e:
    warnings.warn(f"{e}: nothing is cached (set KVR_JAX_CACHE_DIR)", CacheDirWarning, stacklevel=2)
    return None
  return path


def writable_directory(path, name: str) -> str:
  """`path` as a directory this process can write (created if absent), or one ValueError
  that starts with `name`: checked before work whose results would otherwise be lost."""
  path = os.fspath(path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"{name} is a file; give a directory")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"{name} cannot be created ({e.strerror})") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise ValueError(f"{name} is not writable")
  return path


def write_json_atomically(path: str | os.PathLike, payload, indent: int = 1) -> None:
  """Writes JSON through a per-process temporary file and os.replace.

  A reader (another process, a second pytest worker, a predict call) never sees half a
  file, and an interrupted write leaves the old one in place.
  """
  tmp = f"{path}.{os.getpid()}.tmp"
  try:
    with open(tmp, "w") as f:
      json.dump(payload, f, indent=indent)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):  # the write failed before the replace
      os.remove(tmp)
