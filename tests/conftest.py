"""Test setup: 8 emulated CPU devices, configured before jax is first imported."""

import os
import shutil
import tempfile

from tests.subprocess_env import SPEED_ONLY_XLA_FLAGS

# SPEED_ONLY_XLA_FLAGS (tests/subprocess_env.py: why level 0 and the elemental emitter): the
# tests prove correctness, not speed, and LLVM's full optimisation of their tiny programs
# costs more than running them. They change how XLA's backend emits and optimises code, not
# the HLO programs: every HLO, FLOP-count and memory-analysis test passes unchanged under it.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + f" --xla_force_host_platform_device_count=8 {SPEED_ONLY_XLA_FLAGS}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The `local` calibration and other per-machine caches go to one directory of this run,
# never to the user's ~/.cache: made once by the first process that loads this file, the
# pytest-xdist workers and the launchers the tests start inherit it, so the calibration is
# measured once per run, not once per worker (its files are written atomically).
# The process that made it removes it when the run ends (`pytest_unconfigure`).
_RUN_CACHE_MADE_HERE = "KVR_JAX_TEST_RUN_CACHE_DIR" not in os.environ
if _RUN_CACHE_MADE_HERE:
  os.environ["KVR_JAX_TEST_RUN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvr_jax_test_cache_")
os.environ["KVR_JAX_CACHE_DIR"] = os.environ["KVR_JAX_TEST_RUN_CACHE_DIR"]
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# JAX's persistent compilation cache in the run's directory, for the processes the tests
# start (set after this process imported jax, which keeps compiling in memory): the launched
# command lines, the clusters' workers, the notebook and the README blocks run the same tiny
# flows again and again, and a program one of them compiled is read back by the others. JAX
# reads these variables when it starts; its key is the HLO, the devices, the XLA flags and
# the JAX version, so a program read back is the program that would have been compiled.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ["KVR_JAX_TEST_RUN_CACHE_DIR"], "xla")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


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


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks added here
def pytest_collection_modifyitems(items):
  """`@pytest.mark.default_cases(id, ...)` on a parametrized test: those cases run in the
  default tier, every other case of its product in the end-to-end tier (`-m e2e`). An id
  that names no case is an error, so that a renamed case cannot leave the default tier
  silently."""
  cases_of = {}
  for item in items:
    if item.get_closest_marker("default_cases") is not None:
      cases_of.setdefault(item.function, set()).add(item.callspec.id)
  for function, found in cases_of.items():
    named = set()
    for marker in getattr(function, "pytestmark", []):
      if marker.name == "default_cases":
        named.update(marker.args)
    if named - found:
      raise pytest.UsageError(
        f"{function.__module__}.{function.__name__}: default_cases names {sorted(named - found)}, "
        f"which are not among its cases"
      )
  for item in items:
    chosen = item.get_closest_marker("default_cases")
    if chosen is not None and item.callspec.id not in chosen.args:
      item.add_marker(pytest.mark.e2e)


def pytest_unconfigure(config):
  """The run's cache directory goes when the process that made it ends (the pytest-xdist
  controller, after its workers; or the one process of `-n 0`): after both tiers it holds
  over 100 MB of compiled programs, which every run would otherwise leave in the temporary
  directory."""
  if _RUN_CACHE_MADE_HERE:
    shutil.rmtree(os.environ["KVR_JAX_TEST_RUN_CACHE_DIR"], ignore_errors=True)
