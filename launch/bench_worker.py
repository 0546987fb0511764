"""The worker of `launch.benchmark`'s multiprocess, hybrid, timeline and links modes: one
process of the cluster those modes start (`distributed.launch_local` sets
--coordinator_address, --num_processes, --process_id). It joins the cluster and runs one job
(launch.harness.jobs.bench_job or timeline_job, or link_probe's exchange_job); the process
holding the last rank prints its result for the launcher to collect. Not meant to be run by
hand.
"""

import sys

from absl import app, flags, logging

from kvr_jax.runtime import distributed, faults
from launch import common
from launch.harness import jobs, link_probe

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "multiprocess", ["multiprocess", "timeline", "links"], "The job to run.")
flags.DEFINE_float("megabytes", 16.0, "Links mode: megabytes per rank in each exchange.")
flags.DEFINE_string("model", "bench-llama", "Preset, Hugging Face or Orbax directory.")
flags.DEFINE_string("dtype", "auto", "Weights' dtype.")
flags.DEFINE_list("context_lens", ["1024"], "Prompt lengths (timeline mode: the first).")
flags.DEFINE_integer("repeats", 3, "Timed runs after a warm-up.")
flags.DEFINE_list("variants", [], "Multiprocess mode: the variants (launch.harness.variants).")
flags.DEFINE_integer("measured_multiple", 64, "kvr-measured: chunk lengths multiple.")
flags.DEFINE_integer("decode_tokens", 0, "Multiprocess mode: greedy tokens decoded and timed.")
flags.DEFINE_string("link_rate", "unthrottled", "The rate the launcher set the loopback to.")
flags.DEFINE_string("partition", "search", "Timeline mode: KVR partition (or 'fitted').")
flags.DEFINE_string("full_partition", None, "Timeline mode: a hybrid's full layers' split.")
flags.DEFINE_list("timeline_strategies", ["kvr", "allgather"], "Timeline mode: strategies.")
flags.DEFINE_enum("cache", "sharded", ["last", "sharded"], "Timeline mode: the cache layout.")
flags.DEFINE_integer("num_processes", 2, "Processes in the cluster (set by the launcher).")
flags.DEFINE_integer("process_id", None, "This process's id (set by the launcher).")
flags.DEFINE_string("coordinator_address", None, "Coordinator host:port (set by the launcher).")
flags.DEFINE_list("local_device_ids", None, "This process's GPUs (set by the launcher on GPUs).")


def job():
  if FLAGS.mode == "links":  # every process reports
    return link_probe.exchange_job(FLAGS.megabytes, FLAGS.repeats)
  if FLAGS.mode == "timeline":  # every process reports its own ranks' records
    return jobs.timeline_job(
      FLAGS.model,
      int(FLAGS.context_lens[0]),
      FLAGS.timeline_strategies,
      partition=_timeline_partition(),
      repeats=FLAGS.repeats,
      dtype=FLAGS.dtype,
      cache=FLAGS.cache,
    )
  return jobs.bench_job(
    FLAGS.model,
    [int(c) for c in FLAGS.context_lens],
    FLAGS.variants,
    repeats=FLAGS.repeats,
    measured_multiple=FLAGS.measured_multiple,
    dtype=FLAGS.dtype,
    decode_tokens=FLAGS.decode_tokens,
    link_rate=FLAGS.link_rate,
  )


def _timeline_partition():
  """--partition, or with --full_partition a hybrid's split per layer kind."""
  partition = common.parse_partition(FLAGS.partition, extra=("fitted",))
  if FLAGS.full_partition is None:
    return partition
  return {"linear": partition, "full": common.parse_partition(FLAGS.full_partition)}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  distributed.initialize(
    FLAGS.coordinator_address,
    FLAGS.num_processes,
    FLAGS.process_id,
    local_device_ids=FLAGS.local_device_ids,
  )
  with faults.worker_failures():
    result = job()
    if result is not None:
      distributed.owner_output(result)
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
