"""Environments for the processes the tests start."""

import os

# LLVM's optimisation of the tests' tiny programs costs more than running them: conftest.py
# sets this for the test processes, and the processes they start take it too. It changes
# how XLA's backend optimises the emitted code, not the HLO programs. Level 1, not 0: at 0
# the reductions XLA emits run unvectorised, one long sequential float32 sum, and the
# one-device reference of the Qwen3-Next fixture moved 1.2e-5 (relative, its K,V) from the
# optimised code's, more than the 1e-5 the strategies are held to (at 1 it is the optimised
# code's to the bit). Level 0 compiled test_deepseek_v3.py and test_hybrid_chunk_lengths.py
# in 172 s, level 1 in 242 s (2026-11-28, 2 cores).
# --xla_cpu_use_fusion_emitters=false: XLA:CPU's elemental emitter for fusions instead of the
# newer fusion emitters, the same HLO: most of a test's time is XLA compiling (backend
# compile 210 of 273 s in the end-to-end cases of test_qwen3_5.py), and the elemental
# emitter compiles a 3-layer hybrid's prefill programs in 17.8 s instead of 22.9 s; the
# logits it gives differ from the fusion emitters' by 4e-7 of their largest (2026-11-29).
SPEED_ONLY_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"


def launcher_env() -> dict:
  """This environment for a launcher that sets its own device count (the workers of
  `launch.multiprocess`, the `launch.*` command lines): no emulated-device count, only the
  speed-only flag, as a user's shell with that flag would be."""
  return {**os.environ, "XLA_FLAGS": SPEED_ONLY_XLA_FLAGS}
