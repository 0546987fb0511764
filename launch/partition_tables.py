"""KVR-P partition tables (modelled KVR-S searches over a grid of context lengths).

  python -m launch.partition_tables --model=tiny-llama --hardware=local --links=local --num_ranks=8
  python -m launch.partition_tables           # the shipped set, rebuilt into the local cache
  python -m launch.partition_tables --shipped # ... over configs/partitions (maintainers)

Tables go to this machine's kvr-jax cache (or --output_dir), where `partition="predict"`
finds them before the shipped ones; the package's own tables are rewritten only with
--shipped. Intentionally kept short: the logic is kvr_jax.planning.tables.
"""

import sys

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
flags.DEFINE_string("output_dir", None, "Where to write (default: the local cache).")
flags.DEFINE_bool("shipped", False, "Rewrite the shipped tables in configs/partitions.")


def output_dir() -> str:
  """--output_dir, --shipped or the local cache, checked before any table is built."""
  if FLAGS.shipped:
    if FLAGS.output_dir is not None or FLAGS.model is not None:
      raise ValueError("--shipped rewrites the shipped set; it takes no --output_dir or --model")
    return common.check_output_dir(str(tables.PARTITION_DIR))
  directory = FLAGS.output_dir or tables.local_partition_dir()
  if directory is None:
    raise ValueError("the kvr-jax cache directory cannot be used; give --output_dir")
  return common.check_output_dir(directory)


def main(argv):
  del argv
  with common.user_errors():
    if FLAGS.model is None:
      # The shipped set has its own models, presets and ranks: flags that would choose them
      # are refused rather than ignored.
      given = [
        f"--{n}" for n in ("hardware", "links", "num_ranks", "dtype_bytes") if FLAGS[n].present
      ]
      if given:
        raise ValueError(
          f"{', '.join(given)} apply with --model; without it the shipped tables are "
          "regenerated as they are defined (kvr_jax.planning.tables.write_all_tables)"
        )
      directory = output_dir()
      tables.write_all_tables(directory)
      print(f"wrote the shipped set of tables into {directory}")
      return 0
    preset_config(FLAGS.model)
    presets.check_preset_names(FLAGS.hardware, FLAGS.links)
    ranks = common.positive_ints(FLAGS.num_ranks, "--num_ranks")
    shortest = min(tables.TABLE_CONTEXT_LENS)
    if max(ranks) > shortest:
      raise ValueError(
        f"--num_ranks={max(ranks)}: more ranks than tokens in the grid's shortest prompt "
        f"({shortest}); at most {shortest}"
      )
    if FLAGS.dtype_bytes is not None and FLAGS.dtype_bytes not in (1, 2, 4, 8):
      raise ValueError(f"--dtype_bytes must be 1, 2, 4 or 8, got {FLAGS.dtype_bytes}")
    dtype_bytes = FLAGS.dtype_bytes or (4 if FLAGS.hardware == "local" else 2)
    directory = output_dir()
    for p in ranks:
      table = tables.build_table(
        FLAGS.model, FLAGS.hardware, FLAGS.links, p, dtype_bytes=dtype_bytes
      )
      print(f"wrote {tables.write_table(table, directory)}")
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
