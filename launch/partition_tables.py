"""KVR-P partition tables (modelled KVR-S searches over a grid of context lengths).

  python -m launch.partition_tables          # regenerate the shipped tables in configs/partitions
  python -m launch.partition_tables --model=tiny-llama --hardware=local --links=local --num_ranks=8

With --model, builds that preset's tables on this machine into the local cache, where
`partition="predict"` finds them. Intentionally kept short: the logic is
kvr_jax.planning.tables.
"""

from absl import app, flags

from kvr_jax.planning import presets, tables
from kvr_jax.runtime.loading import preset_config
from launch import common

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "A preset to build tables for (default: the shipped set).")
flags.DEFINE_string("hardware", "local", "Cost-model hardware preset (with --model).")
flags.DEFINE_string("links", "local", "Cost-model links preset (with --model).")
flags.DEFINE_list("num_ranks", ["2", "4", "8"], "Rank counts, one table each (with --model).")
flags.DEFINE_integer("dtype_bytes", None, "Bytes per value (default: 4 on local, else 2).")
flags.DEFINE_string("output_dir", None, "Where to write (default: shipped or local cache).")


def main(argv):
  del argv
  if FLAGS.model is None:
    tables.write_all_tables(FLAGS.output_dir or tables.PARTITION_DIR)
    return
  with common.user_errors():
    preset_config(FLAGS.model)
    presets.check_preset_names(FLAGS.hardware, FLAGS.links)
    ranks = common.positive_ints(FLAGS.num_ranks, "--num_ranks")
  dtype_bytes = FLAGS.dtype_bytes or (4 if FLAGS.hardware == "local" else 2)
  directory = FLAGS.output_dir or tables.local_partition_dir()
  for p in ranks:
    table = tables.build_table(FLAGS.model, FLAGS.hardware, FLAGS.links, p, dtype_bytes=dtype_bytes)
    print(f"wrote {tables.write_table(table, directory)}")


if __name__ == "__main__":
  app.run(main)
