"""KV-Runahead across processes (jax.distributed, gloo), and its failure modes, end to end."""

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvr_jax.runtime import distributed, faults
from tests.subprocess_env import launcher_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_launcher(*flags, timeout=240):
  env = launcher_env()  # workers set their own device count
  start = time.monotonic()
  proc = subprocess.run(
    [sys.executable, "-m", "launch.multiprocess", *flags],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  return proc, time.monotonic() - start


def test_two_processes_four_ranks_match_single_device():
  proc, _ = run_launcher(
    "--num_processes=2",
    "--devices_per_process=2",
    "--model=tiny-llama",
    "--context_len=200",
    "--partition=80,50,40,30",
    "--strategy=kvr,ring",
    "--max_new_tokens=8",
    "--json",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1])
  # The summary table shows the same numbers as the result (no 30-line blob by default).
  summary = dict(
    line.split("  ", 1) for line in proc.stdout[: proc.stdout.index("{")].strip().splitlines()
  )
  assert summary["kvr: partition"].strip() == "80,50,40,30"
  err = float(summary["kvr: relative logit error vs single"])
  assert err == pytest.approx(result["strategies"]["kvr"]["relative_logit_error"], rel=0.06)
  assert summary["kvr: tokens identical to single"].strip() == "yes"
  kvr = result["strategies"]["kvr"]
  assert summary["kvr: cache"].strip() == kvr["cache"] == "last"
  assert result["process_count"] == 2 and result["num_ranks"] == 4
  assert kvr["partition"] == [80, 50, 40, 30]
  assert result["process_index"] == 1  # the last rank's process holds the cache and generates
  assert kvr["relative_logit_error"] <= 1e-5 and kvr["relative_last_step_error"] <= 1e-5
  assert kvr["tokens"] == result["single_tokens"]
  assert kvr["tokens_on_every_process"] is None  # only the last rank's process decodes
  assert len(kvr["tokens"][0]) >= 1
  # ring's parts move onto the last rank, one sender at a time (kv_cache.send_onto_last_rank)
  ring = result["strategies"]["ring"]
  assert ring["cache"] == "last" and ring["tokens"] == result["single_tokens"]
  assert ring["relative_logit_error"] <= 1e-5 and ring["relative_last_step_error"] <= 1e-5


@pytest.mark.e2e  # a launched cluster
def test_both_layouts_decode_a_windowed_models_ragged_rows_like_single():
  """One cluster of two processes of two ranks each, a model with windowed (64) and full
  layers, a ragged batch (300 and 211 tokens), sampled tokens, 70 of them (past the window),
  KV-Runahead's contiguous chunks and all-gather CP's zigzag pairs (which ring shares; ring
  across processes is test_two_processes_four_ranks_match_single_device), in both layouts:
  cache="last": KV-Runahead joins its rings from its last hop and its chunk (50 tokens,
  shorter than the window) in the last rank's process, all-gather CP sums each ring over the
  ranks and sends only the full layer's parts across; cache="sharded": every process runs
  every decode step over the parts where they lie. Process 0 samples with another seed, so
  only taking the last rank's token each step keeps the processes together (and equal to
  single); the last step's logits agree (every decode step read the cache)."""
  proc, _ = run_launcher(
    "--num_processes=2",
    "--devices_per_process=2",
    "--model=tiny-gemma",
    "--row_lengths=300,211",
    "--partition=110,80,60,50",
    "--strategy=kvr,allgather",
    "--cache=last,sharded",
    "--temperature=1",
    "--debug_other_seed_process=0",
    "--max_new_tokens=70",
    "--json",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1])
  assert result["num_ranks"] == 4 and len(result["strategies"]) == 4, sorted(result["strategies"])
  assert {run["cache"] for run in result["strategies"].values()} == {"last", "sharded"}
  for name, run in result["strategies"].items():
    assert run["relative_logit_error"] <= 1e-5, name
    assert run["relative_last_step_error"] <= 1e-5, name
    assert run["tokens"] == result["single_tokens"], name
    assert [len(row) for row in run["tokens"]] == [70, 70], name
    every = True if run["cache"] == "sharded" else None  # "last": the last rank's process alone
    assert run["tokens_on_every_process"] is every, name


@pytest.mark.e2e  # a launched cluster
@pytest.mark.parametrize(
  "model, strategies, caches, partition",
  [
    # the hybrid's last chunk of 5 tokens: between its convolution's halo (3) and twice it
    ("bench-qwen3.5", "kvr,ring", "last", [195, 5]),
    # one launch, one prompt and split: cache="last" under KV-Runahead and all-gather CP,
    # cache="sharded" under KV-Runahead and ring
    ("bench-deepseek", "kvr,allgather,ring", "last,sharded", [120, 80]),
  ],
)
def test_hybrid_and_latent_models_sample_singles_tokens_across_processes(
  model, strategies, caches, partition
):
  """A hybrid (Gated DeltaNet layers passing a state) and a latent-attention model across two
  processes of one rank, through kvr_jax.prefill and decode_from. cache="last": under
  KV-Runahead the last rank's process holds the cache its last hop and chunk make (no move);
  under a peer the other process sends its parts there (rank by rank). cache="sharded" (the
  latent model): each process keeps its rank's latents, and both decode every step over them
  (the partials merged across the processes). Each samples exactly the tokens the model's own
  one-device forward and decode step sample (single), and the last step's logits agree (every
  decode step read the cache)."""
  proc, _ = run_launcher(
    "--num_processes=2",
    "--devices_per_process=1",
    f"--model={model}",
    "--context_len=200",
    f"--partition={','.join(map(str, partition))}",
    f"--strategy={strategies}",
    f"--cache={caches}",
    "--temperature=1",
    "--max_new_tokens=6",
    "--json",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1])
  assert result["process_index"] == 1 and result["num_ranks"] == 2
  runs = result["strategies"]
  assert len(runs) == len(strategies.split(",")) * len(caches.split(",")), sorted(runs)
  kvr = [run for name, run in runs.items() if name.startswith("kvr")]
  assert kvr and all(run["partition"] == partition for run in kvr)
  for name, run in runs.items():
    assert run["cache"] in caches.split(","), name
    assert run["relative_logit_error"] <= 1e-5 and run["relative_last_step_error"] <= 1e-5, name
    assert run["tokens"] == result["single_tokens"] and len(run["tokens"][0]) == 6, name
    assert run["tokens_on_every_process"] is (True if run["cache"] == "sharded" else None), name


@pytest.mark.serial  # waits on timeouts or times a span: run alone
@pytest.mark.e2e  # a launched cluster
def test_a_process_whose_decode_fails_ends_every_process_with_its_error():
  """Process 0 fails between its prefill and its decode while process 1 waits for it in a
  sharded decode step's collective: the launcher names process 0 and its error, promptly
  (before: minutes of JAX's shutdown barrier, then an abort that hid the cause)."""
  proc, seconds = run_launcher(
    "--num_processes=2",
    "--context_len=64",
    "--partition=40,24",
    "--max_new_tokens=4",
    "--cache=sharded",
    "--debug_fail_decode_process=0",
  )
  assert proc.returncode == 1
  assert "process 0 exited with code 1; the other processes were stopped" in proc.stderr
  assert "RuntimeError: injected failure before kvr's decode" in proc.stderr
  assert seconds < 60


@pytest.mark.e2e  # a launched cluster
def test_two_processes_as_two_tensor_parallel_ranks_match_single_device():
  """--model_parallel=2 with two devices per process: each process is one rank whose model is
  split over its two devices (loaded straight into the shards), KV-Runahead hops between the
  processes; cache="last": the last rank's process decodes as model shards; cache="sharded":
  both processes decode, each over its own part as model shards. Single's greedy tokens."""
  proc, _ = run_launcher(
    "--num_processes=2",
    "--devices_per_process=2",
    "--model_parallel=2",
    "--context_len=64",
    "--partition=40,24",
    "--max_new_tokens=4",
    "--cache=last,sharded",
    "--json",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1])
  assert result["process_count"] == 2 and result["num_ranks"] == 2
  assert result["model_parallel"] == 2 and result["process_index"] == 1
  assert set(result["strategies"]) == {"kvr, cache=last", "kvr, cache=sharded"}
  for name, kvr in result["strategies"].items():
    assert kvr["relative_logit_error"] <= 1e-5 and kvr["relative_last_step_error"] <= 1e-5, name
    assert kvr["tokens"] == result["single_tokens"], name
  # cache="sharded": every process ran each step as model shards over its rank's part
  assert result["strategies"]["kvr, cache=sharded"]["tokens_on_every_process"] is True


@pytest.mark.e2e  # a launched cluster
@pytest.mark.parametrize(
  "model, strategies, caches",
  [
    ("bench-qwen3.5", "kvr,ring", "last,sharded"),
    ("bench-deepseek", "kvr,allgather", "last,sharded"),
  ],
)
def test_hybrid_and_latent_models_on_two_processes_of_two_model_shards(model, strategies, caches):
  """A hybrid and a latent model on a ("ranks", "model") mesh of two processes, each one rank
  split over its two devices (loaded straight into the shards): cache="last": KV-Runahead's
  cache stays on the last rank's group, the peer's parts are sent there shard by shard;
  cache="sharded": every rank keeps its part (a hybrid's linear pasts on every rank) and both
  processes decode as model shards. Single's sampled tokens."""
  proc, _ = run_launcher(
    "--num_processes=2",
    "--devices_per_process=2",
    "--model_parallel=2",
    f"--model={model}",
    "--context_len=96",
    "--partition=56,40",
    f"--strategy={strategies}",
    f"--cache={caches}",
    "--temperature=1",
    "--max_new_tokens=4",
    "--json",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1])
  assert result["model_parallel"] == 2 and result["num_ranks"] == 2
  assert len(result["strategies"]) == len(strategies.split(",")) * len(caches.split(","))
  for name, run in result["strategies"].items():
    assert run["relative_logit_error"] <= 1e-5 and run["relative_last_step_error"] <= 1e-5, name
    assert run["tokens"] == result["single_tokens"], name
    assert run["tokens_on_every_process"] is (True if run["cache"] == "sharded" else None), name


def start_by_hand(*flags, num_processes=2):
  """A cluster of launch.multiprocess processes started by hand (no launcher), one device
  each, with their stderr piped."""
  port = distributed.free_port()
  return [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "launch.multiprocess",
        f"--process_id={i}",
        f"--num_processes={num_processes}",
        f"--coordinator_address=localhost:{port}",
        *flags,
      ],
      cwd=ROOT,
      env=launcher_env(),  # one device per process
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(num_processes)
  ]


@pytest.mark.e2e  # a launched cluster
def test_a_rank_split_across_processes_is_refused_by_name():
  """A cluster of one-device processes with model_parallel=2 would put a rank's model shards
  in two processes: every worker's prefill refuses it with the rule (not a JAX resharding
  error mid-decode). The launcher refuses it before starting anything
  (test_bad_launcher_flags_are_one_line); the workers are started here by hand."""
  procs = start_by_hand("--model_parallel=2", "--context_len=64", "--partition=64")
  errors = [p.communicate(timeout=120)[1] for p in procs]
  assert [p.returncode for p in procs] == [2, 2], errors
  assert all("rank 0's 2 devices live in processes [0, 1]" in e for e in errors), errors


@pytest.mark.serial  # waits on timeouts or times a span: run alone
@pytest.mark.e2e  # a launched cluster
def test_a_process_that_dies_stops_the_others_with_a_clear_error():
  proc, seconds = run_launcher(
    "--num_processes=2", "--context_len=64", "--debug_crash_process=1", "--heartbeat_timeout=5"
  )
  assert proc.returncode == 1
  assert "process 1 exited with code 3; the other processes were stopped" in proc.stderr
  assert seconds < 60


@pytest.mark.serial  # waits on timeouts or times a span: run alone
@pytest.mark.e2e  # a launched cluster
def test_in_a_cluster_joined_by_hand_a_lost_process_is_one_line_on_the_survivor():
  """Processes started by hand (no launcher): the one that crashes right after joining is
  named by the survivor in one line, status 4 (EXIT_PEER_LOST), whether it was the
  coordinator (the survivor's JAX client would abort from C++: `run_supervised` turns that
  into the line) or not (the survivor's wait ends at the heartbeat timeout)."""
  for crashed, survivor, lost in (
    (0, 1, "lost process 0 (the coordinator)"),
    (1, 0, "lost process 1"),
  ):
    procs = start_by_hand(
      "--context_len=64", f"--debug_crash_process={crashed}", "--heartbeat_timeout=5"
    )
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert procs[survivor].returncode == faults.EXIT_PEER_LOST, errors
    lines = errors[survivor].strip().splitlines()
    assert len(lines) == 1 and lost in lines[0], errors[survivor]
    assert lines[0].startswith(f"error: process {survivor}: "), lines


@pytest.mark.serial  # waits on timeouts or times a span: run alone
@pytest.mark.e2e  # a launched cluster
def test_a_process_that_never_arrives_gives_a_clear_error_in_bounded_time():
  proc, seconds = run_launcher(
    "--num_processes=2", "--context_len=64", "--init_timeout=5", "--debug_skip_process=1"
  )
  assert proc.returncode == 1
  assert "did not form within 5s" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert seconds < 60


@pytest.mark.e2e  # a launched cluster
def test_port_already_in_use():
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    proc, _ = run_launcher(f"--port={port}", "--context_len=64")
  assert proc.returncode == 2
  assert f"coordinator port {port} is already in use" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_bad_cluster_arguments():
  with pytest.raises(ValueError, match="host:port"):
    distributed.initialize("localhost", 2, 0)
  with pytest.raises(ValueError, match="process_id must be in"):
    distributed.initialize("localhost:1234", 2, 2)


def test_a_suspended_process_is_named_not_the_abort_it_causes():
  """Process 1 suspended (SIGSTOP): the survivor aborts (SIGABRT) after the heartbeat timeout
  with a native stack trace; the report names the suspended process and no stack frames."""
  from kvr_jax.runtime import distributed

  abort_trace = "F0000 coordination error\n*** SIGABRT received ***\nPC: @ 0x1\n    @ 0x2 foo"
  text = distributed.describe_failure(0, -signal.SIGABRT, abort_trace, stopped={1})
  assert "process 0 was killed by SIGABRT" in text and "[1] had been suspended" in text
  assert "@ 0x" not in text
  # Without a suspended peer the failed process's own last lines are shown, frames dropped.
  text = distributed.describe_failure(1, 3, "ValueError: bad chunk\n    @ 0x2 frame")
  assert "exited with code 3" in text and "ValueError: bad chunk" in text and "@ 0x" not in text


# --- the launcher keeps the user's platform and XLA flags ---------------------------------------


def test_worker_env_keeps_the_users_platform_and_xla_flags():
  user = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_gpu_autotune_level=0"}
  env, args = distributed.worker_env(1, user, platform="gpu", devices_per_process=2, pin_cores=True)
  assert env["JAX_PLATFORMS"] == "cuda"
  assert env["XLA_FLAGS"].split() == [
    "--xla_dump_to=/tmp/d",
    "--xla_gpu_autotune_level=0",
    "--xla_gpu_enable_latency_hiding_scheduler=true",
  ]
  assert args == ["--local_device_ids=2,3"]  # process 1's own two GPUs
  # CPU: the user's flags kept, the device count the launcher was asked for replaces theirs.
  user = {"XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8"}
  env, args = distributed.worker_env(
    0, user, platform="cpu", devices_per_process=2, pin_cores=False
  )
  assert env["JAX_PLATFORMS"] == "cpu" and args == []
  assert env["XLA_FLAGS"].split() == [
    "--xla_dump_to=/tmp/d",
    "--xla_force_host_platform_device_count=2",
  ]
  env, _ = distributed.worker_env(
    0, {"JAX_PLATFORMS": "cpu,cuda"}, platform="cpu", devices_per_process=1, pin_cores=True
  )
  assert env["JAX_PLATFORMS"] == "cpu,cuda"
  assert "--xla_cpu_multi_thread_eigen=false" in env["XLA_FLAGS"]


# Run in a worker's environment: a 64 MiB block malloc'd, touched and freed twice; prints the
# page faults of the second time (glibc maps a block that large anew each time by default).
_SECOND_TOUCH_FAULTS = """
import ctypes, resource
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
for _ in range(2):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  block = libc.malloc(64 << 20)
  libc.memset(block, 1, 64 << 20)
  libc.free(block)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.serial  # waits on timeouts or times a span: run alone
@pytest.mark.e2e  # a launched cluster
def test_pinned_cpu_workers_reuse_freed_memory_without_page_faults():
  """Timing runs (pinned CPU workers) keep what a call frees for the next, as a GPU's caching
  allocator does; the user's other tunables stay, and nothing else changes."""
  user = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.arena_max=4"}
  pinned, _ = distributed.worker_env(0, user, platform="cpu", devices_per_process=1, pin_cores=True)
  tunables = pinned["GLIBC_TUNABLES"].split(":")
  assert "glibc.malloc.tcache_count=0" in tunables and "glibc.malloc.arena_max=1" in tunables
  assert "glibc.malloc.arena_max=4" not in tunables
  for unpinned in (
    distributed.worker_env(0, user, platform="cpu", devices_per_process=1, pin_cores=False),
    distributed.worker_env(0, user, platform="gpu", devices_per_process=1, pin_cores=True),
    distributed.worker_env(
      0, user, platform="cpu", devices_per_process=1, pin_cores=True, retain_memory=False
    ),
  ):
    assert unpinned[0]["GLIBC_TUNABLES"] == user["GLIBC_TUNABLES"]
  if platform.libc_ver()[0] != "glibc":
    pytest.skip("the tunables are glibc's")

  def second_touch_faults(env):
    run = subprocess.run(
      [sys.executable, "-c", _SECOND_TOUCH_FAULTS], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    return int(run.stdout)

  system = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  retained, _ = distributed.worker_env(
    0, system, platform="cpu", devices_per_process=1, pin_cores=True
  )
  assert second_touch_faults(retained) < 100
  if second_touch_faults(system) < 1000:  # huge pages: 64 MiB is 32 faults either way
    pytest.skip("this kernel maps large blocks in huge pages: no faults to remove")


def test_local_accelerators_follow_the_users_platforms():
  assert distributed.local_accelerators({"JAX_PLATFORMS": "cpu"}) == ("cpu", 0)
  assert distributed.local_accelerators({"CUDA_VISIBLE_DEVICES": "0,1,3"}) == ("gpu", 3)
  assert distributed.local_accelerators({"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "2"}) == (
    "gpu",
    1,
  )
  assert distributed.local_accelerators({"CUDA_VISIBLE_DEVICES": ""}) == ("cpu", 0)
  with pytest.raises(ValueError, match="need 4 GPUs; 1 are visible"):
    distributed.launch_local(
      "launch.multiprocess",
      [],
      2,
      devices_per_process=2,
      extra_env={"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "0"},
    )
