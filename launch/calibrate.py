"""Measures this machine again for the cost model's `local` presets and stores the figures.

  python -m launch.calibrate

`partition="search"`/"balanced" with the `local` presets read the stored figures, so the same
command picks the same chunks run after run; run this after changing the machine or its load.
Intentionally kept short: the logic is kvr_jax.planning.presets.calibrate.
"""

import sys

from absl import app, flags, logging

from kvr_jax.planning import presets
from launch import common

FLAGS = flags.FLAGS
flags.DEFINE_integer(
  "num_devices", None, "Emulated CPU devices (the link is measured between two)."
)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  common.setup_devices(FLAGS.num_devices)
  hardware, links = presets.calibrate()
  print(f"hardware: {hardware.note}")
  print(f"links: {links.bandwidth / 1e9:.2f} GB/s, latency {links.latency * 1e6:.1f} us")
  path = presets.calibration_path()
  print(f"stored in {path}" if path else "not stored: the cache directory cannot be used")
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
