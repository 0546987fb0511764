"""Every command line's one-line refusals: a bad flag ends with one line on stderr naming it,
exit status 2 and no traceback, before any work. Each launcher runs all its cases in one
launched process (tests/launcher_driver.py), so that these checks cost one interpreter start
per launcher, not one per case."""

import pytest

from tests.launcher_driver import run_each

RUN_USER_ERRORS = [
  (["--model=tiny-gpt"], "unknown preset 'tiny-gpt'"),
  (["--model_parallel=3"], "8 devices do not split into ranks of model_parallel=3"),
  (["--nocompilation_cache", "--compilation_cache_dir=/tmp/x"], "--nocompilation_cache"),
  (["--strategy=ring,allgather", "--partition=1,2,3"], "partition lengths apply to ['kvr']"),
  (["--strategy=ring", "--attention=dense"], "'ring' runs attention in ('flash', 'fused'"),
  (["--compilation_cache_dir=/dev/null"], "is a file"),
  (["--model=./no/such/dir"], "no such directory"),
  (["--partition=3,3", "--context_len=12", "--num_devices=4"], "2 chunks but the mesh has 4"),
  (["--partition=fast"], "--partition must be one of"),
  (["--context_len=100000"], "exceeds the model's max_position_embeddings"),
  (["--strategy=single,ulysses"], "unknown strategy"),
  (["--num_devices=64"], "only 8 devices"),
  (["--output_json=/nonexistent-dir/x.json"], "/nonexistent-dir does not exist"),
  (["--temperature=-1"], "`temperature` must be a finite number >= 0"),
  (["--prompt=hello", "--context_len=500"], "--prompt and --context_len contradict"),
  (["--prompt_file=/no/such/file"], "--prompt_file /no/such/file: No such file or directory"),
  (["--prompt_file=/dev/null"], "--prompt_file /dev/null is empty"),
  (["--prompt_file=/dev/null", "--prompt=a", "--prompt=b"], "give at most one --prompt with it"),
  (["--top_k=0", "--temperature=1"], "`top_k` must be an integer in [1, 512]"),
  (["--top_p=1.5", "--temperature=1"], "`top_p` must be in (0, 1]"),
]

PARTITION_TABLES_USER_ERRORS = [
  (["--num_ranks=4"], "--num_ranks apply with --model"),
  (["--model=tiny-llama", "--dtype_bytes=0"], "--dtype_bytes must be 1, 2, 4 or 8"),
  (["--model=tiny-llama", "--output_dir=/dev/null"], "is a file"),
  (["--model=tiny-llama", "--num_ranks=0"], "--num_ranks must be"),
  (["--model=tiny-llama", "--num_ranks=2,4096"], "more ranks than tokens"),
  (["--shipped", "--output_dir=/tmp"], "--shipped rewrites the shipped set"),
]

BENCHMARK_USER_ERRORS = [
  (["--mode=kernels", "--context_lens=0"], "--context_lens must be"),
  (["--mode=kernels", "--flash_blocks=0x512"], "--flash_blocks takes"),
  (["--mode=kernels", "--kernel_prefix_len=-1"], "--kernel_prefix_len must be >= 0"),
  (["--mode=kernels", "--kernel_head_dim=0"], "--kernel_head_dim must be >= 1"),
  (["--mode=phases", "--partitions=32/0"], "--partitions takes positive"),
  (["--mode=phases", "--partitions=32/32", "--kernels="], "--kernels takes"),
  (["--mode=devices", "--output_dir=/dev/null"], "is a file"),
  (["--repeats=0"], "--repeats must be"),
  (["--mode=timeline", "--model_parallel=2"], "--mode=devices and memory"),
  (["--mode=memory", "--model_parallel=3"], "8 devices do not split"),
  (["--mode=accelerator", "--model=launch"], "holds neither a Hugging"),
  (["--mode=memory", "--num_devices=0"], "give at least 1"),
  (["--mode=buckets", "--stream_lengths=5"], "takes lo,hi"),
  (
    ["--mode=accelerator", "--model=tiny-mistral", "--kernels=fused", "--context_lens=64"],
    "takes no sliding window",
  ),
  (["--mode=hybrid", "--num_processes=1"], "must be >= 2 in hybrid mode"),
  (["--mode=hybrid", "--model=no-such-model"], "unknown preset 'no-such-model'"),
  (["--mode=multiprocess", "--variants=ring,nope"], "unknown variant 'nope'"),
  (["--mode=multiprocess", "--single_variants=single,kvr-serch"], "unknown variant 'kvr-serch'"),
  (["--mode=multiprocess", "--variants=ring,single"], "['single'] run in one process"),
  (["--mode=hybrid", "--variants="], "--variants names no variant"),
]

PAPER_USER_ERRORS = [
  (["--output_dir=/proc/self"], "not writable"),
  (["--grids=paper,2d"], "--grids takes paper, tp, gemma, gpt-oss, qwen3.5 and/or mla"),
  (["--tp_context_lens=32k"], "--tp_context_lens"),
  (["--tp_context_lens=1000"], "tp grid lengths must lie in [1921, 131072]"),
]

CONVERT_USER_ERRORS = [
  (["--hf_dir=/no/such/dir", "--output_dir=/tmp/unused"], "no such directory"),
  (["--hf_dir=/tmp"], "give --hf_dir and --output_dir"),
  (["--gemma_270m=/tmp/g", "--hf_dir=/tmp"], "--gemma_270m writes a Hugging Face directory"),
]

MULTIPROCESS_USER_ERRORS = [
  (["--process_id=0", "--coordinator_address=nohost", "--num_processes=2"], "host:port"),
  (
    ["--process_id=5", "--coordinator_address=localhost:1234", "--num_processes=2"],
    "process_id must be in [0, 2)",
  ),
  (["--port=70000"], "port must be in [1, 65535], got 70000"),
  (["--port=0"], "leave --port out to pick a free one"),
  (["--devices_per_process=0"], "devices_per_process must be >= 1"),
  (["--model_parallel=2"], "--model_parallel=2 must be >= 1 and divide --devices_per_process=1"),
]

CASES = {
  "launch.run": [(["--repeats=1", *flags], message) for flags, message in RUN_USER_ERRORS],
  "launch.partition_tables": PARTITION_TABLES_USER_ERRORS,
  "launch.benchmark": BENCHMARK_USER_ERRORS,
  "launch.paper": PAPER_USER_ERRORS,
  "launch.convert": CONVERT_USER_ERRORS,
  "launch.multiprocess": [
    ([*flags, "--context_len=64"], message) for flags, message in MULTIPROCESS_USER_ERRORS
  ],
}


@pytest.fixture(scope="module")
def outcome():
  """(launcher, argv) -> its Outcome; a launcher's cases all run in one process, the first
  time one of them is asked for (so that no one test carries every launcher's start)."""
  found = {}

  def get(module, flags):
    if (module, tuple(flags)) not in found:
      for done in run_each(module, [flags for flags, _ in CASES[module]]):
        found[module, tuple(done.argv)] = done
    return found[module, tuple(flags)]

  return get


@pytest.mark.parametrize(
  "module,flags,message",
  [(module, flags, message) for module, cases in CASES.items() for flags, message in cases],
)
def test_user_errors_are_one_line_before_any_work(outcome, module, flags, message):
  proc = outcome(module, flags)
  assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-1000:]
  assert message in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line
