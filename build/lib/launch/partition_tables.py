"""Regenerates the KVR-P partition tables in configs/partitions/ (modelled KVR-S searches).

  python -m launch.partition_tables

Intentionally kept short: the logic is kvr_jax.planning.tables.write_all_tables.
"""

from absl import app, flags

from kvr_jax.planning import tables

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", None, "Where to write (default: configs/partitions).")


def main(argv):
  del argv
  tables.write_all_tables(FLAGS.output_dir or tables.PARTITION_DIR)


if __name__ == "__main__":
  app.run(main)
