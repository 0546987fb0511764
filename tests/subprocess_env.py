"""Environments for the processes the tests start."""

import os

# LLVM's optimisation of the tests' tiny programs costs more than running them: conftest.py
# sets these flags for the test processes, and the processes they start take them too. They
# change how XLA's backend emits and optimises code, not the HLO programs.
# --xla_backend_optimization_level=0: most of a test's time is XLA compiling, and most of
# that is LLVM. Every test passes at level 0 with the tolerances unchanged (2026-11-29: 1309
# of 1311 in both tiers, the two trained checkpoints not installed, and the 8 serial tests),
# and the end-to-end tier's tests took 1,471 worker-seconds instead of 2,993 at level 1 (2
# cores, `--durations=0`, the two runs the same day). On 2026-11-28, before the elemental
# emitter below was chosen, level 0 had moved the Qwen3-Next fixture's one-device K,V by
# 1.2e-5 (relative) from the optimised code's, more than the 1e-5 the strategies are held to.
# --xla_cpu_use_fusion_emitters=false: XLA:CPU's elemental emitter for fusions instead of the
# newer fusion emitters, the same HLO: it compiles a 3-layer hybrid's prefill programs in
# 17.8 s instead of 22.9 s at level 1; the logits it gives differ from the fusion emitters'
# by 4e-7 of their largest (2026-11-29).
SPEED_ONLY_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def launcher_env() -> dict:
  """This environment for a launcher that sets its own device count (the workers of
  `launch.multiprocess`, the `launch.*` command lines): no emulated-device count, only the
  speed-only flag, as a user's shell with that flag would be."""
  return {**os.environ, "XLA_FLAGS": SPEED_ONLY_XLA_FLAGS}
