"""launch.benchmark's flags (what --help lists), kept apart from its modes."""

from absl import flags

from launch.harness import multiprocess_report

# Timeline mode's own partition: KVR-S with the cost model fitted to this model's phases.
FITTED = ("fitted",)
# The modes, as --help lists them (MODES at the end maps each to its function).
MODE_NAMES = ("devices", "multiprocess", "kernels", "long", "phases", "memory", "timeline")
MODE_NAMES += ("accelerator", "buckets", "hybrid", "links")
flags.DEFINE_bool(
  "hybrid_measured",
  False,
  "Hybrid mode: also time KV-Runahead on the split a measured search picks on this mesh and "
  "link (kvr-measured; the search times candidate splits, minutes per length).",
)
flags.DEFINE_enum("mode", "devices", list(MODE_NAMES), "What to measure.")
flags.DEFINE_integer(
  "threads", None, "XLA and PyTorch threads (devices, kernels, long modes; default: all cores)."
)
flags.DEFINE_list(
  "flash_blocks", ["512x512"], "Kernels mode: flash query x key block sizes to try."
)
flags.DEFINE_list(
  "partitions", [], "Phases mode: KV-Runahead partitions, lengths joined by '/' (2048/2048)."
)
flags.DEFINE_list("kernels", ["flash", "blocked", "dense"], "Attention kernels to time.")
flags.DEFINE_integer(
  "kernel_prefix_len",
  0,
  "Kernels mode: keys before the queries (a later rank's chunk after the prefix it received).",
)
flags.DEFINE_integer("kernel_head_dim", 64, "Kernels mode: the head width (latent: nope + rope).")
flags.DEFINE_string("model", "bench-llama", "Preset, Hugging Face or Orbax directory.")
flags.DEFINE_string(
  "dtype", "auto", "Weights: auto (bfloat16 on GPUs, float32 on CPUs), float32, bfloat16, float16."
)
flags.DEFINE_list("context_lens", ["1024", "2048", "4096"], "Prompt lengths to sweep.")
flags.DEFINE_list("strategy", ["single", "tsp", "kvr"], "Strategies (devices mode).")
flags.DEFINE_list(
  "variants",
  ["tsp", "kvr-even", "kvr-search", "kvr-measured"],
  "Multi-process variants (single always runs as the baseline); a variant ending ':sharded' "
  "(ring:sharded, kvr-search:sharded) keeps the cache where it was computed. Hybrid mode "
  "without it: the peers and KV-Runahead in both layouts, kvr-fitted, kvr-one-fitted, kvr-even.",
)
flags.DEFINE_integer(
  "decode_tokens",
  0,
  "Multi-process mode: also time a greedy decode of this many tokens from each variant's "
  "cache. Memory mode: also XLA's analysis of one decode step with room for that many tokens.",
)
flags.DEFINE_list(
  "single_variants",
  ["single", "single-dense"],
  "Multi-process mode: the one-process baselines (single = flash, single-dense, single-blocked).",
)
flags.DEFINE_string(
  "partition",
  "search",
  "KVR partition in devices and timeline modes; timeline mode also takes 'fitted' (KVR-S with "
  "the cost model's FLOP/s fitted to this model's measured phases).",
)
flags.DEFINE_string(
  "full_partition",
  None,
  "Timeline mode, a hybrid model under kvr: the full layers' own split (comma-separated "
  "lengths); --partition (lengths) is then the linear layers'.",
)
flags.DEFINE_integer(
  "num_devices",
  None,
  "Devices in devices, buckets and memory modes (default: all; memory mode: 8), as ranks of "
  "--model_parallel devices each.",
)
flags.DEFINE_integer(
  "model_parallel",
  1,
  "Devices and memory modes: devices per rank, each rank's model split over them (tensor "
  "parallelism on a ('ranks', 'model') mesh; devices mode loads the weights split).",
)
flags.DEFINE_integer("num_processes", 2, "Processes in multiprocess, hybrid and links modes.")
flags.DEFINE_float("megabytes", 16.0, "Links mode: megabytes per rank in each exchange.")
flags.DEFINE_integer("repeats", 3, "Timed runs after a warm-up; the median is reported.")
flags.DEFINE_bool("compare_transformers", True, "Devices mode: also time transformers.")
flags.DEFINE_integer("measured_multiple", 64, "kvr-measured: chunk lengths multiple.")
flags.DEFINE_string("output_dir", "results/benchmark", "Where CSV, PNG and JSON go.")
# Worker role (set by the multiprocess launcher).
flags.DEFINE_enum(
  "cache",
  None,
  ["last", "sharded"],
  "Memory mode: the cache layout (default last). Timeline mode: the layout the probed runs "
  "prefill into (default sharded: every part where computed; last joins it on the last rank, "
  "KV-Runahead keeping its last hops).",
)
flags.DEFINE_integer(
  "max_chunk", None, "Memory mode: KVR's balanced split with no chunk above this many tokens."
)
flags.DEFINE_list(
  "timeline_strategies", ["kvr", "allgather"], "Timeline mode: strategies (kvr, ring, allgather)."
)
UNTHROTTLED = multiprocess_report.UNTHROTTLED
flags.DEFINE_list(
  "link_rates",
  [UNTHROTTLED],
  "Multiprocess and hybrid modes: link rates to run the processes over, e.g. "
  "unthrottled,2gbit,500mbit (as root; each throttled rate under each --link_duplex; "
  "removed after each run, also on failure or interrupt).",
)
flags.DEFINE_list(
  "link_duplex",
  ["full"],
  "Multiprocess and hybrid modes: how a throttled rate is shaped, one run per kind: full "
  "(each process in its own network namespace, its link shaped at the rate each way: "
  "real NICs) or half (one tc bucket on the loopback for both directions: a two-way "
  "exchange takes twice a one-way send, which favours one-way chains; what the benchmarks "
  "measured before full existed).",
)
flags.DEFINE_list("ranks", ["2", "4", "8"], "Accelerator mode: modelled device counts.")
flags.DEFINE_list(
  "stream_lengths", ["1000", "4096"], "Buckets mode: the range [lo, hi] of prompt lengths."
)
flags.DEFINE_integer("stream_prompts", 20, "Buckets mode: prompts in the stream.")
flags.DEFINE_list(
  "ladders",
  ["8", "4"],
  "Buckets mode: ladders to compare with exact shapes, as buckets per doubling (8 is auto).",
)
flags.DEFINE_list(
  "links", ["300GBps", "10GBps"], "Accelerator mode: link presets of the modelled devices."
)
