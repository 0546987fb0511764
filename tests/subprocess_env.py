"""Environments for the processes the tests start."""

import os

# LLVM's optimisation of the tests' tiny programs costs more than running them: conftest.py
# sets this for the test processes, and the processes they start take it too. It changes
# how XLA's backend optimises the emitted code, not the HLO programs. A two-process sharded
# decode of tiny-gemma: 36 s -> 26 s.
SPEED_ONLY_XLA_FLAGS = "--xla_backend_optimization_level=0"


def launcher_env() -> dict:
  """This environment for a launcher that sets its own device count (the workers of
  `launch.multiprocess`, the `launch.*` command lines): no emulated-device count, only the
  speed-only flag, as a user's shell with that flag would be."""
  return {**os.environ, "XLA_FLAGS": SPEED_ONLY_XLA_FLAGS}
