"""Benchmarks. Every figure printed here is MEASURED on this machine.

  python -m launch.benchmark                      # devices present + vs transformers
  python -m launch.benchmark --mode=multiprocess  # the real parallel speed-up on CPU cores

--mode=devices sweeps context lengths and strategies on the local devices (on a CPU-only
machine: emulated devices sharing the cores, which checks cost, not speed-up) and compares the
single-device path with Hugging Face transformers on the same weights and tokens.
--mode=multiprocess runs p processes, one device each, each pinned to its own core with
single-threaded XLA, against one such process alone. --mode=memory prints XLA's per-device
memory of each strategy's prefill program, compiled from shapes only (nothing allocated), e.g.
  python -m launch.benchmark --mode=memory --model=llama-3.1-8b --num_devices=8 \
    --context_lens=32768,131072,1048576 --strategy=kvr,ring,allgather,tsp
--mode=timeline runs p pinned processes with probes at every phase boundary and writes each
rank's per-layer timeline (JSON, and a Gantt chart beside the cost model's), e.g.
  python -m launch.benchmark --mode=timeline --context_lens=8192 --timeline_strategies=kvr,allgather
--mode=accelerator times single-device prefill on this process's first device (any backend)
with every exact kernel there beside transformers (PyTorch SDPA, same weights and tokens, same
device), with MFU, and models p-device TTFT from the per-rank programs timed on it, e.g.
  python -m launch.benchmark --mode=accelerator --model=llama-3.1-8b \
    --context_lens=4096,8192,16384,32768
--mode=buckets sends a stream of prompts of random new lengths through each strategy, with
exact shapes and with the default length buckets: programs compiled, the stream end to end,
warm TTFT (the cost of padding), e.g.
  python -m launch.benchmark --mode=buckets --model=tiny-llama --num_devices=4 \
    --stream_lengths=1000,4096 --stream_prompts=20
--mode=hybrid is --mode=multiprocess with the variants that compare a model with a past of
its own, a hybrid (bench-qwen3.5: Gated DeltaNet and full layers) or a latent-attention one
(bench-deepseek): ring and all-gather CP and KV-Runahead in both cache layouts, KV-Runahead on
the split fitted here and even (on a hybrid also its one split for both kinds), and single
alone; --hybrid_measured adds KV-Runahead on a measured search's split, e.g.
  python -m launch.benchmark --mode=hybrid --model=bench-qwen3.5 --context_lens=8192,16384
--link_rates (multiprocess, hybrid and links modes, as root) runs the processes over a
throttled link, under each of --link_duplex: full (a network namespace per process, its link
shaped both ways) or half (one bucket on the loopback for every direction), e.g.
  python -m launch.benchmark --mode=multiprocess --context_lens=8192 --link_rates=2gbit,500mbit
--mode=links times one-way, two-way and ring exchanges of --megabytes per rank over each link
(what the link and gloo do with the strategies' exchanges), e.g.
  python -m launch.benchmark --mode=links --num_processes=2 --link_rates=500mbit \
    --link_duplex=full,half
The flags are launch/benchmark_flags.py; the logic is launch/harness/ (a module per job:
sweep, transformers_baseline, kernel_timing, accelerator, bucket_stream, multiprocess_report,
timelines, memory_grid, jobs), kvr_jax.tools and kvr_jax.runtime.distributed.
"""

import os
import sys

import jax
from absl import app, flags, logging

import kvr_jax
from kvr_jax.core.chunks import check_chunks
from kvr_jax.runtime import distributed, loading
from kvr_jax.runtime.mesh import mesh_of_ranks
from kvr_jax.strategies import get_strategy
from kvr_jax.tools import expert_load
from kvr_jax.tools import timing as timing_lib
from launch import common
from launch.benchmark_flags import FITTED
from launch.harness import (
  accelerator,
  bucket_stream,
  kernel_timing,
  link_probe,
  memory_grid,
  multiprocess_report,
  one_device,
  sweep,
  timelines,
  transformers_baseline,
)
from launch.harness.variants import get_variant, own_past_variants
from models.kernels import KERNEL_NAMES

FLAGS = flags.FLAGS


def set_threads():
  """One thread for XLA (before its backend starts) and PyTorch when --threads=1."""
  if FLAGS.threads is None:
    return
  if FLAGS.threads < 1:
    raise ValueError(f"--threads must be >= 1, got {FLAGS.threads}")
  if FLAGS.threads == 1:
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " " + distributed.SINGLE_THREAD_XLA_FLAGS
    ).strip()
  elif FLAGS.threads != os.cpu_count():
    raise ValueError("--threads takes 1 or the number of cores (XLA's CPU backend uses all)")


def kernels_mode():
  with common.user_errors():
    blocks = []
    for text in FLAGS.flash_blocks:
      try:
        bq, bk = (int(x) for x in text.split("x"))
      except ValueError:
        raise ValueError(f"--flash_blocks takes QxK pairs like 256x512, got {text!r}") from None
      blocks.append((bq, bk))
    if FLAGS.kernel_prefix_len < 0:
      raise ValueError(f"--kernel_prefix_len must be >= 0, got {FLAGS.kernel_prefix_len}")
    if FLAGS.kernel_head_dim < 1:
      raise ValueError(f"--kernel_head_dim must be >= 1, got {FLAGS.kernel_head_dim}")
    rows = kernel_timing.time_attention_kernels(
      [int(c) for c in FLAGS.context_lens],
      FLAGS.kernels,
      blocks,
      repeats=FLAGS.repeats,
      head_dim=FLAGS.kernel_head_dim,
      prefix_len=FLAGS.kernel_prefix_len,
    )
  threads = FLAGS.threads or os.cpu_count()
  kernel_timing.kernel_table(rows, threads, head_dim=FLAGS.kernel_head_dim).print()
  return 0


def long_mode():
  """Single-device prefill of long prompts: time, compile time and the process's peak RSS."""
  with common.user_errors():
    model = kvr_jax.load_model(FLAGS.model, dtype=FLAGS.dtype)
    lens = [int(c) for c in FLAGS.context_lens]
    table = one_device.long_prefill_table(model, FLAGS.model, lens, FLAGS.kernels, FLAGS.repeats)
  table.print()
  return 0


def memory_mode():
  """XLA's memory analysis of each strategy's compiled prefill, per device (float32 shapes
  unless --dtype names another: "auto" is this machine's, which the shapes do not need)."""
  with common.user_errors():
    if FLAGS.num_devices is not None and FLAGS.num_devices < 1:
      raise ValueError(
        f"--num_devices={FLAGS.num_devices}: memory mode compiles for that many emulated "
        "devices; give at least 1 (default 8)"
      )
    rows = memory_grid.memory_grid(
      loading.config_of(FLAGS.model),
      FLAGS.strategy,
      [int(c) for c in FLAGS.context_lens],
      num_devices=8 if FLAGS.num_devices is None else FLAGS.num_devices,
      model_parallel=FLAGS.model_parallel,
      cache=FLAGS.cache or "last",
      dtype=FLAGS.dtype if FLAGS["dtype"].present else "float32",
      max_chunk=FLAGS.max_chunk,
      decode_tokens=FLAGS.decode_tokens,
    )
  memory_grid.memory_table(rows, FLAGS.model, FLAGS.cache or "last").print()
  return 0


def phases_mode():
  """Per-rank compute phases of KV-Runahead partitions (--partitions), on one device."""
  with common.user_errors():
    model = kvr_jax.load_model(FLAGS.model, dtype=FLAGS.dtype)
    if not FLAGS.partitions:
      raise ValueError("--mode=phases needs --partitions, e.g. --partitions=2048/2048,2588/1508")
    threads = FLAGS.threads or os.cpu_count()
    table = one_device.phase_table(
      model, FLAGS.model, FLAGS.partitions, FLAGS.kernels, FLAGS.repeats, threads
    )
  table.print()
  return 0


def devices_mode():
  emulated = common.setup_devices(FLAGS.num_devices)
  with common.user_errors():
    split_over = None
    if FLAGS.model_parallel > 1:
      split_over = mesh_of_ranks(FLAGS.num_devices, FLAGS.model_parallel)
    model = kvr_jax.load_model(FLAGS.model, dtype=FLAGS.dtype, mesh=split_over)
    lens = [int(c) for c in FLAGS.context_lens]
    partition = common.parse_partition(FLAGS.partition)
    rows = sweep.sweep(
      model,
      lens,
      FLAGS.strategy,
      num_devices=FLAGS.num_devices,
      partition=partition,
      repeats=FLAGS.repeats,
      model_parallel=FLAGS.model_parallel,
    )
  note = "MEASURED; " + (
    "emulated CPU devices sharing the cores: not a parallel speed-up"
    if emulated
    else "devices present"
  )
  sweep.sweep_table(rows, note, sweep.reports_device_memory(jax.devices())).print()
  # Experts split over the model axis: how evenly the longest prompt loads the devices.
  prompt = timing_lib.synthetic_prompt(model.config.vocab_size, max(lens))
  load = expert_load.expert_load_line(model, prompt, FLAGS.model_parallel)
  if load:
    print(load)
  written = sweep.write_sweep(rows, FLAGS.output_dir, FLAGS.model, note)
  if FLAGS.compare_transformers:
    with common.user_errors():
      comparison = transformers_baseline.compare_with_transformers(
        model.config, lens, kernels=FLAGS.kernels, repeats=FLAGS.repeats, threads=FLAGS.threads
      )
    transformers_baseline.comparison_table(comparison).print()
    written.append(os.path.join(FLAGS.output_dir, "vs_transformers.csv"))
    sweep.write_csv(comparison, written[-1], "MEASURED prefill tokens/s")
  print(f"wrote {', '.join(written)}")


def timeline_mode():
  """Per-rank timelines of a multi-process run (probed programs), beside the cost model's."""
  C = int(FLAGS.context_lens[0])
  with common.user_errors():
    if FLAGS.num_processes < 2:
      raise ValueError("--num_processes must be >= 2 in timeline mode")
    partition = common.parse_partition(FLAGS.partition, extra=FITTED)
    if isinstance(partition, list):  # explicit lengths: checked before any process starts
      check_chunks(partition, C, FLAGS.num_processes)
    if FLAGS.full_partition is not None:
      if not isinstance(partition, list):
        raise ValueError("--full_partition takes --partition as lengths (the linear layers')")
      full = common.parse_partition(FLAGS.full_partition)
      if not isinstance(full, list):
        raise ValueError(f"--full_partition takes lengths, got {FLAGS.full_partition!r}")
      check_chunks(full, C, FLAGS.num_processes)
    for s in FLAGS.timeline_strategies:
      if not get_strategy(s).timeline_probes:
        raise ValueError(f"--timeline_strategies: {s!r} has no probes; use kvr, ring, allgather")
    common.output_file_in(FLAGS.output_dir, f"timeline_{C}.json")
    model = kvr_jax.load_model(FLAGS.model, dtype=FLAGS.dtype)
    print(f"{FLAGS.num_processes} processes, one core each: timelines at C={C} ...", flush=True)
    worker_flags = [
      "--mode=timeline",
      f"--model={FLAGS.model}",
      f"--context_lens={C}",
      f"--repeats={FLAGS.repeats}",
      f"--dtype={FLAGS.dtype}",
      f"--partition={FLAGS.partition}",
      *([f"--full_partition={FLAGS.full_partition}"] if FLAGS.full_partition else []),
      f"--timeline_strategies={','.join(FLAGS.timeline_strategies)}",
      f"--cache={FLAGS.cache or 'sharded'}",
    ]
    try:
      reports = timelines.run_timelines("launch.bench_worker", worker_flags, FLAGS.num_processes)
    except RuntimeError as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
    setup = timelines.modelled_setup(reports, model.dtype)
  report = timelines.timeline_report(reports, FLAGS.timeline_strategies, model.config, C, setup)
  timelines.timeline_table(report, FLAGS.model, C, FLAGS.num_processes).print()
  title = f"{FLAGS.model}, C={C}, {FLAGS.num_processes} processes"
  written = timelines.write_timeline_report(report, setup, FLAGS.output_dir, title, f"timeline_{C}")
  print(f"wrote {', '.join(written)}")
  return 0


def multiprocess_mode(mode: str = "multiprocess", variants=None, single_variants=None):
  """The multiprocess job (`jobs.bench_job` on every process) over every link asked for:
  `variants` (default --variants) on --num_processes processes, `single_variants` (default
  --single_variants) on one."""
  common_flags = [
    f"--model={FLAGS.model}",
    f"--context_lens={','.join(FLAGS.context_lens)}",
    f"--repeats={FLAGS.repeats}",
    f"--measured_multiple={FLAGS.measured_multiple}",
    f"--dtype={FLAGS.dtype}",
    f"--decode_tokens={FLAGS.decode_tokens}",
  ]
  variants = FLAGS.variants if variants is None else variants
  single_variants = FLAGS.single_variants if single_variants is None else single_variants
  with common.user_errors():
    if FLAGS.num_processes < 2:
      raise ValueError(f"--num_processes must be >= 2 in {mode} mode")
    _check_variants(variants, single_variants)
    try:
      rows = multiprocess_report.run_over_links(
        "launch.bench_worker",
        common_flags,
        variants,
        single_variants,
        FLAGS.num_processes,
        FLAGS.link_rates,
        duplexes=FLAGS.link_duplex,
      )
    except RuntimeError as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
  table = multiprocess_report.multiprocess_table(rows)
  multiprocess_report.ttft_table(table, FLAGS.model, FLAGS.num_processes).print()
  written = multiprocess_report.write_files(
    table, FLAGS.output_dir, FLAGS.model, FLAGS.num_processes
  )
  print(f"wrote {', '.join(written)}")
  return 0


def _check_variants(variants, single_variants) -> None:
  """Every variant name known, and each run where it can, before any process starts."""
  records = [get_variant(name) for name in variants]
  for name in single_variants:
    get_variant(name)
  if not records:
    raise ValueError("--variants names no variant to run over several processes")
  alone = [r.name for r in records if r.one_process]
  if alone:
    raise ValueError(f"{alone} run in one process: give them in --single_variants")


def hybrid_mode():
  """The multiprocess job with the variants that compare a hybrid's or a latent model's
  programs (`variants.own_past_variants`) where --variants and --single_variants
  are not given."""
  with common.user_errors():
    config = loading.config_of(FLAGS.model)  # a bad name refused before anything launches
  variants = list(FLAGS.variants)
  if not FLAGS["variants"].present:
    variants = own_past_variants(config)
  if FLAGS.hybrid_measured and "kvr-measured" not in variants:
    variants.append("kvr-measured")
  singles = FLAGS.single_variants if FLAGS["single_variants"].present else ["single"]
  return multiprocess_mode("hybrid", variants, singles)


def links_mode():
  with common.user_errors():
    if FLAGS.num_processes < 2:
      raise ValueError("--num_processes must be >= 2 in links mode")
    if not FLAGS.megabytes > 0:
      raise ValueError(f"--megabytes must be positive, got {FLAGS.megabytes}")
    rows = link_probe.run_over_links(
      "launch.bench_worker",
      ["--mode=links", f"--megabytes={FLAGS.megabytes}", f"--repeats={FLAGS.repeats}"],
      FLAGS.num_processes,
      FLAGS.link_rates,
      FLAGS.link_duplex,
    )
  table = link_probe.links_table(rows, FLAGS.megabytes, FLAGS.num_processes)
  table.print()
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  path = os.path.join(FLAGS.output_dir, "links.json")
  table.write_json(path)
  print(f"wrote {path}")
  return 0


def buckets_mode():
  """A stream of prompts of random new lengths, exact shapes against bucket ladders."""
  emulated = common.setup_devices(FLAGS.num_devices)
  with common.user_errors():
    lengths = common.positive_ints(FLAGS.stream_lengths, "--stream_lengths")
    if len(lengths) != 2:
      raise ValueError(f"--stream_lengths takes lo,hi (two lengths), got {FLAGS.stream_lengths}")
    low, high = lengths
    if low > high:
      raise ValueError(f"--stream_lengths takes lo,hi with lo <= hi, got {low},{high}")
    (count,) = common.positive_ints([FLAGS.stream_prompts], "--stream_prompts")
    (repeats,) = common.positive_ints([FLAGS.repeats], "--repeats")
    per_octave = common.positive_ints(FLAGS.ladders, "--ladders")
    path = common.output_file_in(FLAGS.output_dir, "buckets.json")
    model = kvr_jax.load_model(FLAGS.model, dtype=FLAGS.dtype)
    max_position = model.config.max_position_embeddings
    if high > max_position:
      raise ValueError(f"--stream_lengths: {high} is past {FLAGS.model}'s {max_position} positions")
    ladders = bucket_stream.named_ladders(per_octave, max_position)
    strategies = FLAGS.strategy if FLAGS["strategy"].present else ["single", "kvr", "ring"]
    strategies += [] if FLAGS["strategy"].present else ["allgather"]
    lengths = bucket_stream.random_lengths(low, high, count)
    rows = bucket_stream.bucket_stream(
      model, lengths, strategies, ladders=ladders, num_devices=FLAGS.num_devices, repeats=repeats
    )
  title = (
    f"\nMEASURED, {FLAGS.model}, {jax.device_count()} {'emulated ' if emulated else ''}devices, "
    f"{count} prompts of random lengths in [{low}, {high}] (seed 0), each new to the process:"
  )
  bucket_stream.bucket_table(rows, title).print()
  bucket_stream.write_stream(path, lengths, rows)
  print(f"wrote {path}")
  return 0


def accelerator_mode():
  """Single-device prefill on this device per kernel vs transformers, MFU, and modelled TTFT."""
  with common.user_errors():
    config = loading.config_of(FLAGS.model)
    context_lens = common.positive_ints(FLAGS.context_lens, "--context_lens")
    ranks = common.positive_ints(FLAGS.ranks, "--ranks")
    (repeats,) = common.positive_ints([FLAGS.repeats], "--repeats")
    path = common.output_file_in(FLAGS.output_dir, "accelerator.json")
    rows, modelled = accelerator.accelerator_benchmark(
      config,
      context_lens,
      kernels=FLAGS.kernels if FLAGS["kernels"].present else None,
      dtype=FLAGS.dtype,
      repeats=repeats,
      compare_transformers=FLAGS.compare_transformers,
      ranks=ranks,
      links=FLAGS.links,
    )
  for table in accelerator.report_tables(rows, modelled, FLAGS.model, FLAGS.dtype, FLAGS.repeats):
    table.print()
  accelerator.write_report(rows, modelled, FLAGS.model, FLAGS.dtype, path)
  print(f"wrote {path}")
  return 0


# Modes that run ranks of several devices (tensor parallelism inside each rank).
MODEL_PARALLEL_MODES = ("devices", "memory")
# Modes that write files into --output_dir.
WRITING_MODES = ("devices", "multiprocess", "timeline", "accelerator", "buckets", "hybrid")
WRITING_MODES += ("links",)


def check_shared_flags():
  """The flags every mode reads, checked before anything is measured: a sweep never ends in a
  traceback that loses its results."""
  common.positive_ints(FLAGS.context_lens, "--context_lens")
  common.positive_ints([FLAGS.repeats], "--repeats")
  common.positive_ints([FLAGS.model_parallel], "--model_parallel")
  if FLAGS.model_parallel > 1 and FLAGS.mode not in MODEL_PARALLEL_MODES:
    raise ValueError(
      f"--model_parallel applies to --mode={' and '.join(MODEL_PARALLEL_MODES)}; "
      f"--mode={FLAGS.mode} runs one device per rank"
    )
  if FLAGS.mode in WRITING_MODES:
    common.check_output_dir(FLAGS.output_dir)
  if FLAGS.mode == "kernels":
    for text in FLAGS.flash_blocks:
      parts = text.split("x")
      if len(parts) != 2 or not all(x.isdigit() and int(x) > 0 for x in parts):
        raise ValueError(f"--flash_blocks takes positive QxK pairs like 256x512, got {text!r}")
  if FLAGS.mode in ("kernels", "phases", "long"):
    kinds = [k for k in FLAGS.kernels if k not in KERNEL_NAMES]
    if not FLAGS.kernels or kinds:
      raise ValueError(f"--kernels takes some of {KERNEL_NAMES}, got {FLAGS.kernels!r}")
  if FLAGS.mode == "phases":
    for text in FLAGS.partitions:
      parts = text.split("/")
      if not all(x.isdigit() and int(x) > 0 for x in parts):
        raise ValueError(f"--partitions takes positive lengths separated by '/', got {text!r}")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  with common.user_errors():
    check_shared_flags()
  if FLAGS.mode == "accelerator":
    # PyTorch shares the device: JAX takes memory as it needs it instead of 75% up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if FLAGS.mode not in ("multiprocess", "timeline", "links"):
    with common.user_errors():
      set_threads()  # before XLA's backend starts
  return MODES[FLAGS.mode]() or 0


# --mode -> what it runs (each prints its report; a nonzero return is the exit status).
MODES = {
  "devices": devices_mode,
  "multiprocess": multiprocess_mode,
  "kernels": kernels_mode,
  "long": long_mode,
  "phases": phases_mode,
  "memory": memory_mode,
  "timeline": timeline_mode,
  "accelerator": accelerator_mode,
  "buckets": buckets_mode,
  "hybrid": hybrid_mode,
  "links": links_mode,
}


if __name__ == "__main__":
  sys.exit(app.run(main))
