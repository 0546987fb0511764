"""Test setup: 8 emulated CPU devices, configured before jax is first imported."""

import os
import tempfile

from tests.subprocess_env import SPEED_ONLY_XLA_FLAGS

# SPEED_ONLY_XLA_FLAGS (tests/subprocess_env.py: why level 1): the tests prove correctness,
# not speed, and LLVM's full optimisation of their tiny programs costs more than running
# them. It changes how XLA's LLVM backend optimises the emitted code, not the HLO programs:
# every HLO, FLOP-count and memory-analysis test passes unchanged under it.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + f" --xla_force_host_platform_device_count=8 {SPEED_ONLY_XLA_FLAGS}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The `local` calibration and other per-machine caches go to one directory of this run,
# never to the user's ~/.cache: made once by the first process that loads this file, the
# pytest-xdist workers and the launchers the tests start inherit it, so the calibration is
# measured once per run, not once per worker (its files are written atomically).
if "KVR_JAX_TEST_RUN_CACHE_DIR" not in os.environ:
  os.environ["KVR_JAX_TEST_RUN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvr_jax_test_cache_")
os.environ["KVR_JAX_CACHE_DIR"] = os.environ["KVR_JAX_TEST_RUN_CACHE_DIR"]

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """After each test file, drop every compiled program this worker keeps (JAX's caches and
  kvr_jax's own). Each XLA:CPU executable holds memory mappings of its code; a worker that
  kept every file's programs reached the kernel's limit of 65,530 mappings (one test file of
  19 tests leaves about 7,600) and segfaulted inside XLA's compiler. Programs are shared
  within a file; files build their own models, so few programs are compiled twice."""
  yield
  from kvr_jax.core.caches import clear_caches

  clear_caches()
  jax.clear_caches()
  gc.collect()
