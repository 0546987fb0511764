"""KV-Runahead across processes: jax.distributed setup and a supervised local launcher.

Every process runs the same program (multi-controller JAX). After `initialize`, `jax.devices()`
lists every process's devices, so `make_mesh()` spans them all, and `prefill` / `generate` run
unchanged: each process feeds only its own ranks' chunks, and only the process of the last
rank gets the logits and the KV cache (and generates).

Faults are bounded in time, never a hang:
* a process that never arrives: after `init_timeout` seconds the others print one clear line
  and exit with status 75 (EXIT_CLUSTER_NOT_FORMED);
* a process that dies: under `launch_local` the supervisor sees its exit at once, stops the
  others and raises naming it;
* a coordinator port already in use: ValueError before anything starts;
* a job that raises, a lost peer, a cluster joined by hand: kvr_jax.runtime.faults.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from kvr_jax.runtime.faults import SUPERVISED_ENV

DEFAULT_INIT_TIMEOUT = 60
DEFAULT_HEARTBEAT_TIMEOUT = 10
EXIT_CLUSTER_NOT_FORMED = 75
RESULT_PREFIX = "KVR_RESULT "
# One XLA CPU thread per process: each process is pinned to its own core.
SINGLE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
# What the launcher adds on GPUs: the latency-hiding scheduler lets a collective (KVR's hop,
# ring's ppermute) run under independent compute instead of between it.
GPU_XLA_FLAGS = "--xla_gpu_enable_latency_hiding_scheduler=true"
# What pinned CPU workers (the timing runs) ask of glibc's malloc: one arena, no mmap of large
# blocks, no trim, so that the memory a call frees is the next call's without page faults.
# Why: XLA:CPU allocates each call's temporaries and outputs afresh, and glibc maps large
# blocks anew and unmaps them when freed, so every call first-touches them again: 3 us a
# 4 KiB page on this project's 2-core VM (256 MiB: 200 ms; docs/measurements.md).
# A GPU's caching allocator (XLA's BFC) keeps its pool and never faults, and a strategy with
# larger temporaries (KV-Runahead's longest chunk, its kept hops) paid for it per call
# here: measured, not modelled, at 16k on bench-qwen3.5-8 it cost ~100 ms of 2.6-4 s.
RETAINED_MALLOC_TUNABLES = {
  "glibc.malloc.arena_max": "1",
  "glibc.malloc.mmap_threshold": str(1 << 32),
  "glibc.malloc.trim_threshold": str(1 << 34),
}


def local_accelerators(env) -> tuple[str, int]:
  """("gpu", n) where the environment's JAX_PLATFORMS admits GPUs and n NVIDIA GPUs are
  visible (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`), else ("cpu", 0). Probed without
  starting JAX: a launcher holding GPU memory would starve its own workers."""
  platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms and not {"cuda", "gpu"} & set(platforms):
    return "cpu", 0
  visible = env.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    count = len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
  else:
    try:
      listing = subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
      ).stdout
    except (OSError, subprocess.TimeoutExpired):
      listing = ""
    count = sum(line.startswith("GPU ") for line in listing.splitlines())
  return ("gpu", count) if count else ("cpu", 0)


def _flag_name(flag: str) -> str:
  return flag.split("=")[0].lstrip("-")


def worker_env(
  process_id: int,
  base_env,
  *,
  platform: str,
  devices_per_process: int,
  pin_cores: bool,
  retain_memory: bool | None = None,
) -> tuple[dict, list[str]]:
  """One worker's environment and extra arguments. The user's JAX_PLATFORMS, XLA_FLAGS and
  GLIBC_TUNABLES are kept; the launcher appends only the settings its own options ask for
  (replacing the user's value of those alone): on CPUs the emulated device count (and one
  thread when pinned), and JAX_PLATFORMS=cpu where the user set none; on GPUs the
  latency-hiding scheduler, and `--local_device_ids` giving process i its own
  `devices_per_process` GPUs. retain_memory: glibc's malloc keeps what a call frees for the
  next (RETAINED_MALLOC_TUNABLES); default: pinned CPU workers, the timing runs."""
  env = {**base_env, SUPERVISED_ENV: "1"}  # launch_local watches its workers itself
  if retain_memory is None:
    retain_memory = pin_cores and platform != "gpu"
  if retain_memory:
    ours = [f"{name}={value}" for name, value in RETAINED_MALLOC_TUNABLES.items()]
    user = base_env.get("GLIBC_TUNABLES", "").split(":")
    env["GLIBC_TUNABLES"] = ":".join(_user_then_ours([t for t in user if t], ours))
  if platform == "gpu":
    ours = GPU_XLA_FLAGS.split()
    first = process_id * devices_per_process
    ids = ",".join(str(first + j) for j in range(devices_per_process))
    args = [f"--local_device_ids={ids}"]
  else:
    ours = [f"--xla_force_host_platform_device_count={devices_per_process}"]
    ours += SINGLE_THREAD_XLA_FLAGS.split() if pin_cores else []
    env.setdefault("JAX_PLATFORMS", "cpu")
    args = []
  env["XLA_FLAGS"] = " ".join(_user_then_ours(base_env.get("XLA_FLAGS", "").split(), ours))
  return env, args


def _user_then_ours(user: list[str], ours: list[str]) -> list[str]:
  """Settings ("name=value") of the user's that none of ours names, then ours: ours replace
  the user's of the same name, the rest are kept."""
  names = {_flag_name(s) for s in ours}
  return [s for s in user if _flag_name(s) not in names] + ours


def _parse_address(address: str) -> tuple[str, int]:
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"coordinator address must be host:port, got {address!r}")
  return host, int(port)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    try:
      s.bind((host, port))
    except OSError:
      return False
  return True


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def initialize(
  coordinator_address: str,
  num_processes: int,
  process_id: int,
  *,
  init_timeout: int = DEFAULT_INIT_TIMEOUT,
  heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT,
  local_device_ids=None,
) -> None:
  """jax.distributed.initialize with gloo CPU collectives, checked arguments, bounded waits.
  local_device_ids: this process's accelerators (one GPU per process: [process_id]); None
  lets JAX take every local device."""
  host, port = _parse_address(coordinator_address)
  if not isinstance(num_processes, int) or num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes!r}")
  if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
  local = host in ("localhost", "127.0.0.1", socket.gethostname())
  if process_id == 0 and local and not port_is_free(port):
    raise ValueError(
      f"coordinator port {port} is already in use; choose another (--coordinator_address or --port)"
    )
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  message = (
    f"error: process {process_id}: the cluster of {num_processes} processes did not form "
    f"within {init_timeout}s at {coordinator_address}: at least one process never arrived, or "
    "the coordinator is unreachable"
  )

  def give_up():
    # JAX's own deadline aborts the process from C++ with a stack trace; this watchdog fires
    # first and exits with one clear line instead.
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_CLUSTER_NOT_FORMED)

  watchdog = threading.Timer(init_timeout, give_up)
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
      coordinator_address,
      num_processes,
      process_id,
      initialization_timeout=init_timeout + 30,
      heartbeat_timeout_seconds=heartbeat_timeout,
      **({} if not local_device_ids else {"local_device_ids": [int(i) for i in local_device_ids]}),
    )
  except Exception as e:  # noqa: BLE001 - jax raises XlaRuntimeError and others here
    detail = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    raise RuntimeError(f"{message[len('error: ') :]} ({detail})") from None
  finally:
    watchdog.cancel()


def owner_output(payload: dict) -> None:
  """The process holding the last rank reports its result to the launcher (one stdout line)."""
  print(RESULT_PREFIX + json.dumps(payload), flush=True)


@dataclasses.dataclass
class ProcessOutcome:
  process_id: int
  returncode: int
  stdout: str
  stderr: str

  def results(self) -> list[dict]:
    return [
      json.loads(line[len(RESULT_PREFIX) :])
      for line in self.stdout.splitlines()
      if line.startswith(RESULT_PREFIX)
    ]


def launch_local(
  worker_module: str,
  worker_args: list[str],
  num_processes: int,
  *,
  devices_per_process: int = 1,
  port: int | None = None,
  pin_cores: bool = False,
  timeout: float = 600.0,
  skip_processes: tuple[int, ...] = (),
  extra_env: dict | None = None,
  platform: str | None = None,
  network=None,
  retain_memory: bool | None = None,
) -> list[ProcessOutcome]:
  """Starts `python -m worker_module` num_processes times on this machine and supervises them.

  Each worker gets --coordinator_address, --num_processes and --process_id (and on GPUs
  --local_device_ids). platform: "cpu" (emulated devices_per_process devices per process) or
  "gpu" (devices_per_process GPUs per process); default: GPUs where the user's JAX_PLATFORMS
  admits them and some are visible (`local_accelerators`), else the CPU. The user's
  JAX_PLATFORMS and XLA_FLAGS are kept (`worker_env`). pin_cores pins process i to core i
  (mod the cores present), with single-threaded XLA on CPUs. If a process exits
  with an error, the others are stopped at once and RuntimeError names it; past `timeout`
  seconds all are stopped. `skip_processes` leaves processes out (to test a missing one).
  network: a `links.ProcessNetwork` (a full-duplex throttled link): process i starts inside
  its network namespace and the coordinator is at process 0's address there; None: the
  loopback. retain_memory: `worker_env`'s (default: pinned CPU workers keep freed memory, as
  a GPU's caching allocator does, so that no call pays page faults for its buffers).
  """
  port, platform, base_env = _check_launch(
    num_processes, devices_per_process, port, extra_env, platform
  )
  cores = sorted(os.sched_getaffinity(0))
  procs: dict[int, subprocess.Popen] = {}
  for i in range(num_processes):
    if i in skip_processes:
      continue
    env, platform_args = worker_env(
      i,
      base_env,
      platform=platform,
      devices_per_process=devices_per_process,
      pin_cores=pin_cores,
      retain_memory=retain_memory,
    )
    core = cores[i % len(cores)]
    host = "localhost" if network is None else network.address(0)
    cmd = [
      *([] if network is None else network.command_prefix(i)),
      sys.executable,
      "-m",
      worker_module,
      f"--coordinator_address={host}:{port}",
      f"--num_processes={num_processes}",
      f"--process_id={i}",
      *platform_args,
      *worker_args,
    ]
    procs[i] = subprocess.Popen(
      cmd,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      preexec_fn=(lambda core=core: os.sched_setaffinity(0, {core})) if pin_cores else None,
    )
  return _supervise(procs, timeout)


def _check_launch(num_processes, devices_per_process, port, extra_env, platform):
  """launch_local's arguments checked before any process starts: (the coordinator's free
  port, the platform, the workers' base environment)."""
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if isinstance(devices_per_process, bool) or not isinstance(devices_per_process, int):
    raise ValueError(f"devices_per_process must be >= 1, got {devices_per_process!r}")
  if devices_per_process < 1:
    raise ValueError(f"devices_per_process must be >= 1, got {devices_per_process}")
  if port is not None and not 1 <= port <= 65535:
    raise ValueError(
      f"the coordinator port must be in [1, 65535], got {port}"
      + (" (leave --port out to pick a free one)" if port == 0 else "")
    )
  port = free_port() if port is None else port
  if not port_is_free(port):
    raise ValueError(f"coordinator port {port} is already in use; choose another (--port)")
  base_env = dict(os.environ, **(extra_env or {}))
  if platform is None:
    platform, gpus = local_accelerators(base_env)
  elif platform == "gpu":
    gpus = local_accelerators(base_env)[1]
  elif platform != "cpu":
    raise ValueError(f"platform must be 'cpu' or 'gpu', got {platform!r}")
  if platform == "gpu" and num_processes * devices_per_process > gpus:
    raise ValueError(
      f"{num_processes} processes x {devices_per_process} GPU(s) need "
      f"{num_processes * devices_per_process} GPUs; {gpus} are visible"
    )
  return port, platform, base_env


def _supervise(procs: dict[int, subprocess.Popen], timeout: float) -> list[ProcessOutcome]:
  import threading

  output: dict[int, list[str]] = {i: ["", ""] for i in procs}

  def drain(i, stream, slot):  # read continuously so a full pipe never blocks a worker
    output[i][slot] = stream.read()

  threads = [
    threading.Thread(target=drain, args=(i, p.stdout, 0), daemon=True) for i, p in procs.items()
  ]
  threads += [
    threading.Thread(target=drain, args=(i, p.stderr, 1), daemon=True) for i, p in procs.items()
  ]
  for t in threads:
    t.start()
  deadline = time.monotonic() + timeout
  failed = None
  stopped: set[int] = set()  # processes seen suspended (SIGSTOP, a debugger): they go silent
  while time.monotonic() < deadline:
    codes = {i: p.poll() for i, p in procs.items()}
    stopped |= {i for i, p in procs.items() if codes[i] is None and _is_stopped(p.pid)}
    failed = next((i for i, c in codes.items() if c not in (None, 0)), None)
    if failed is not None or all(c == 0 for c in codes.values()):
      break
    time.sleep(0.1)
  timed_out = failed is None and any(p.poll() is None for p in procs.values())
  for p in procs.values():
    if p.poll() is None:
      p.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
      p.send_signal(signal.SIGTERM)
  for p in procs.values():
    try:
      p.wait(5)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
  for t in threads:
    t.join(5)
  outcomes = [ProcessOutcome(i, p.returncode, *output[i]) for i, p in procs.items()]
  if failed is not None:
    bad = next(o for o in outcomes if o.process_id == failed)
    raise RuntimeError(describe_failure(failed, bad.returncode, bad.stderr, stopped - {failed}))
  if timed_out:
    raise RuntimeError(
      f"the processes did not finish within {timeout:.0f}s and were stopped"
      + (f" (process(es) {sorted(stopped)} had been suspended)" if stopped else "")
    )
  return outcomes


def _is_stopped(pid: int) -> bool:
  """Whether a process is suspended (state T: SIGSTOP, SIGTSTP, a debugger)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
  except (OSError, IndexError):
    return False


def describe_failure(process_id: int, returncode: int, stderr: str, stopped=()) -> str:
  """One paragraph on why the cluster stopped: who failed, how, and the likely cause."""
  if returncode < 0:
    try:
      how = f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
      how = f"was killed by signal {-returncode}"
  else:
    how = f"exited with code {returncode}"
  text = f"process {process_id} {how}; the other processes were stopped."
  if stopped:
    text += (
      f" Process(es) {sorted(stopped)} had been suspended (e.g. SIGSTOP) and stopped "
      "answering, so JAX's coordination service gave up on them"
      + (" and aborted the others" if returncode == -signal.SIGABRT else "")
      + "."
    )
    return text  # the failed process's output is JAX's abort trace, not the cause
  return f"{text} Its last error output:\n{_tail(stderr)}"


def _tail(text: str, lines: int = 8) -> str:
  """The last lines of a worker's stderr, without native stack frames ("    @ 0x...",
  "*** SIGABRT received ...", "PC: @ ...")."""
  frame = ("@ 0x", "@ ", "*** ", "PC: @", "(stack")
  kept = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(frame)]
  return "\n".join(kept[-lines:]) or "(none: it exited without a message)"
