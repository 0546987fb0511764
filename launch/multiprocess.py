"""KV-Runahead across processes (jax.distributed, gloo CPU collectives).

Start N processes on this machine (the launcher supervises them):
  python -m launch.multiprocess --num_processes=2 --devices_per_process=2 \
      --partition=700,500,500,348
Two ranks of two devices each, the model split over each process's devices (tensor
parallelism inside a rank, KV-Runahead's hops between the processes):
  python -m launch.multiprocess --num_processes=2 --devices_per_process=2 --model_parallel=2 \
      --partition=1200,848
Join a cluster (run once per process, e.g. on each host):
  python -m launch.multiprocess --coordinator_address=host0:1234 --num_processes=4 --process_id=0

The job prefills with KV-Runahead over all processes' devices, generates on the last rank's
process, and compares with the single-device oracle there; it prints one summary table
(--json: the full result as JSON). Intentionally kept short: the logic is
kvr_jax.runtime.distributed and launch.harness.jobs.
"""

import json
import os
import sys

import jax
from absl import app, flags, logging

from kvr_jax.runtime import distributed, faults
from launch import common
from launch.harness import jobs

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_processes", 2, "Processes in the cluster.")
flags.DEFINE_integer(
  "process_id", None, "This process's id (joins a cluster; set by the launcher for its workers)."
)
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (cluster mode).")
flags.DEFINE_list(
  "local_device_ids", None, "Worker: this process's GPUs (set by the launcher on GPUs)."
)
flags.DEFINE_integer(
  "devices_per_process", 1, "Local mode: GPUs per process on a GPU node, else emulated CPU devices."
)
flags.DEFINE_integer(
  "model_parallel",
  1,
  "Devices per rank: each rank's model split over them (tensor parallelism; with "
  "--devices_per_process=m each process is one rank).",
)
flags.DEFINE_integer("port", None, "Coordinator port for local mode (default: a free one).")
flags.DEFINE_bool("pin_cores", False, "Pin process i to core i with single-threaded XLA.")
flags.DEFINE_integer("timeout", 600, "Seconds before the launcher stops everything.")
flags.DEFINE_integer("init_timeout", 60, "Seconds to wait for every process to arrive.")
flags.DEFINE_integer("heartbeat_timeout", 10, "Seconds before a silent process counts as dead.")
flags.DEFINE_string("model", "tiny-llama", "Preset, Hugging Face or Orbax directory.")
flags.DEFINE_integer("context_len", 2048, "Synthetic prompt length.")
flags.DEFINE_string(
  "dtype", "auto", "Weights: auto (bfloat16 on GPUs, float32 on CPUs), float32, bfloat16, float16."
)
flags.DEFINE_list(
  "strategy", ["kvr"], "Strategies to check against single, each its own prefill and decode."
)
flags.DEFINE_list(
  "cache",
  ["auto"],
  "KV cache layouts, each strategy run under each: last (moved or joined onto the last rank, "
  "which decodes alone), sharded (each rank keeps its part; every process runs each decode "
  "step) or auto (by memory).",
)
flags.DEFINE_list(
  "row_lengths",
  None,
  "A ragged batch: rows of these lengths (padded to the longest; --context_len unused).",
)
flags.DEFINE_string("partition", "even", "KVR partition: even, search, balanced or lengths.")
flags.DEFINE_integer("max_new_tokens", 8, "Tokens generated.")
flags.DEFINE_float("temperature", 0.0, "0: greedy; else sampled, the same seed as single's.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_bool("json", False, "Print the full result as JSON after the summary.")
flags.DEFINE_integer(
  "debug_crash_process", -1, "Testing: this process exits right after joining, as if it crashed."
)
flags.DEFINE_multi_integer("debug_skip_process", [], "Testing: do not start these processes.")
flags.DEFINE_integer(
  "debug_fail_decode_process", -1, "Testing: this process raises between prefill and decode."
)
flags.DEFINE_integer(
  "debug_other_seed_process",
  -1,
  "Testing: this process samples with another seed (cache=sharded: every process must still "
  "continue with the last rank's token).",
)


def _fail_before_decode(strategy: str) -> None:
  if jax.process_index() == FLAGS.debug_fail_decode_process:
    raise RuntimeError(f"injected failure before {strategy}'s decode (--debug_fail_decode_process)")


def worker():
  try:
    distributed.initialize(
      FLAGS.coordinator_address,
      FLAGS.num_processes,
      FLAGS.process_id,
      init_timeout=FLAGS.init_timeout,
      heartbeat_timeout=FLAGS.heartbeat_timeout,
      local_device_ids=FLAGS.local_device_ids,
    )
  except (ValueError, RuntimeError) as e:  # bad address, busy port, id out of range, no cluster
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if FLAGS.process_id == FLAGS.debug_crash_process:
    os._exit(3)
  with faults.worker_failures():
    result = jobs.check_job(
      FLAGS.model,
      FLAGS.context_len,
      common.parse_partition(FLAGS.partition),
      strategies=FLAGS.strategy,
      row_lengths=[int(n) for n in FLAGS.row_lengths or ()],
      caches=FLAGS.cache,
      max_new_tokens=FLAGS.max_new_tokens,
      temperature=FLAGS.temperature,
      sampling_seed=FLAGS.seed + (FLAGS.process_id == FLAGS.debug_other_seed_process),
      dtype=FLAGS.dtype,
      model_parallel=FLAGS.model_parallel,
      before_decode=_fail_before_decode,
    )
  if result is not None:
    distributed.owner_output(result)


def launcher():
  if FLAGS.model_parallel < 1 or FLAGS.devices_per_process % FLAGS.model_parallel:
    # Checked again by prefill in every worker (a cluster joined by hand has no launcher).
    print(
      f"error: --model_parallel={FLAGS.model_parallel} must be >= 1 and divide "
      f"--devices_per_process={FLAGS.devices_per_process}: a rank's devices live in one process",
      file=sys.stderr,
    )
    return 2
  passthrough = [
    f"--{name}={getattr(FLAGS, name)}"
    for name in (
      "model",
      "context_len",
      "dtype",
      "partition",
      "max_new_tokens",
      "temperature",
      "seed",
      "model_parallel",
      "init_timeout",
      "heartbeat_timeout",
      "debug_crash_process",
      "debug_fail_decode_process",
      "debug_other_seed_process",
    )
  ]
  passthrough += [f"--strategy={','.join(FLAGS.strategy)}", f"--cache={','.join(FLAGS.cache)}"]
  if FLAGS.row_lengths:
    passthrough.append(f"--row_lengths={','.join(FLAGS.row_lengths)}")
  with common.user_errors():
    try:
      outcomes = distributed.launch_local(
        "launch.multiprocess",
        passthrough,
        FLAGS.num_processes,
        devices_per_process=FLAGS.devices_per_process,
        port=FLAGS.port,
        pin_cores=FLAGS.pin_cores,
        timeout=FLAGS.timeout,
        skip_processes=tuple(FLAGS.debug_skip_process),
      )
    except RuntimeError as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
  results = [r for o in outcomes for r in o.results()]
  if not results:
    print("error: no process reported a result", file=sys.stderr)
    return 1
  r = results[0]
  all_same = print_summary(r)
  if FLAGS.json:
    print(json.dumps(r, indent=1))
  return 0 if all_same else 1


def print_summary(r: dict) -> bool:
  """The job's result as one table; whether every strategy's tokens were single's (and the
  same on every process)."""
  rows = [
    ("processes x ranks", f"{r['process_count']} x {r['num_ranks']}"),
    ("devices per rank (model)", str(r["model_parallel"])),
    ("tokens (single, row 0)", " ".join(map(str, r["single_tokens"][0]))),
  ]
  all_same = True
  for name, run in r["strategies"].items():
    same = run["tokens"] == r["single_tokens"] and run["tokens_on_every_process"] is not False
    all_same &= same
    if run["partition"] is not None:
      rows.append((f"{name}: partition", ",".join(map(str, run["partition"]))))
    rows += [
      (f"{name}: cache", run["cache"]),
      (f"{name}: relative logit error vs single", f"{run['relative_logit_error']:.1e}"),
      (f"{name}: the same, last decode step", f"{run['relative_last_step_error']:.1e}"),
      (f"{name}: tokens (row 0)", " ".join(map(str, run["tokens"][0]))),
    ]
    if run["tokens_on_every_process"] is not None:
      every = "yes" if run["tokens_on_every_process"] else "NO"
      rows.append((f"{name}: the same tokens on every process", every))
    rows.append((f"{name}: tokens identical to single", "yes" if same else "NO"))
  width = max(len(name) for name, _ in rows)
  for name, value in rows:
    print(f"{name:<{width}}  {value}")
  return all_same


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if FLAGS.num_processes < 1:
    print(f"error: --num_processes must be >= 1, got {FLAGS.num_processes}", file=sys.stderr)
    return 2
  if FLAGS.process_id is not None:
    if FLAGS.coordinator_address is None:
      print("error: --process_id needs --coordinator_address", file=sys.stderr)
      return 2
    if not faults.is_supervised():  # started by hand: a child does the work
      return faults.run_supervised(FLAGS.process_id, ["-m", "launch.multiprocess", *sys.argv[1:]])
    worker()
    return 0
  return launcher()


if __name__ == "__main__":
  sys.exit(app.run(main))
