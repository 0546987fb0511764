"""Where kvr-jax finds its shipped data and keeps its per-machine caches.

Presets and KVR-P tables are package data of the `configs` package (configs/ at the top of
the repository, installed with the wheel), found with importlib.resources so that an
installed kvr-jax works from any directory. Per-machine results (the `local` calibration,
KVR-P tables built on this machine) go to a cache directory: $KVR_JAX_CACHE_DIR, else
$XDG_CACHE_HOME/kvr_jax, else ~/.cache/kvr_jax.
"""

from __future__ import annotations

import importlib.resources
import os
import pathlib


def config_dir() -> pathlib.Path:
  """configs/: model presets (<name>.json)."""
  return pathlib.Path(str(importlib.resources.files("configs")))


def partition_dir() -> pathlib.Path:
  """configs/partitions/: the shipped KVR-P tables."""
  return config_dir() / "partitions"


def cache_dir() -> pathlib.Path:
  """This machine's cache (created on first use)."""
  base = os.environ.get("KVR_JAX_CACHE_DIR")
  if not base:
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    base = os.path.join(xdg, "kvr_jax")
  path = pathlib.Path(base)
  path.mkdir(parents=True, exist_ok=True)
  return path
