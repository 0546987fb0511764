"""KV-Runahead across processes (jax.distributed, gloo), and its failure modes, end to end."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_launcher(*flags, timeout=240):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # workers set their own
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
    "--max_new_tokens=8",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout[: proc.stdout.rindex("}") + 1])
  assert result["process_count"] == 2 and result["num_ranks"] == 4
  assert result["partition"] == [80, 50, 40, 30]
  assert result["process_index"] == 1  # the last rank's process holds the cache and generates
  assert result["relative_logit_error"] <= 1e-5
  assert result["kvr_tokens"] == result["single_tokens"]
  assert len(result["kvr_tokens"][0]) >= 1


def test_a_process_that_dies_stops_the_others_with_a_clear_error():
  proc, seconds = run_launcher(
    "--num_processes=2", "--context_len=64", "--debug_crash_process=1", "--heartbeat_timeout=5"
  )
  assert proc.returncode == 1
  assert "process 1 exited with code 3; the other processes were stopped" in proc.stderr
  assert seconds < 60


def test_a_process_that_never_arrives_gives_a_clear_error_in_bounded_time():
  proc, seconds = run_launcher(
    "--num_processes=2", "--context_len=64", "--init_timeout=5", "--debug_skip_process=1"
  )
  assert proc.returncode == 1
  assert "did not form within 5s" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert seconds < 60


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
  from kvr_jax.runtime import distributed

  with pytest.raises(ValueError, match="host:port"):
    distributed.initialize("localhost", 2, 0)
  with pytest.raises(ValueError, match="process_id must be in"):
    distributed.initialize("localhost:1234", 2, 2)
