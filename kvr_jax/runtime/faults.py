"""A multi-process job's failures, bounded in time and said in one line.

* a process whose job raises (`worker_failures`): it prints the error and exits at once,
  without JAX's shutdown barrier, which would wait minutes for peers that are blocked in a
  collective waiting for it;
* a process whose collective fails because another process is gone (killed, crashed): every
  survivor prints one line naming itself, the process it lost and the step (`stage`), and
  exits with status 4 (EXIT_PEER_LOST), within a second where gloo sees the closed socket;
* a process started by hand (`run_supervised`) runs its work as a child, so that JAX's C++
  abort on a lost coordinator is one line and status 4 too.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import traceback

# A worker started by a supervisor (`launch_local`, or `run_supervised` in cluster mode) has
# this set; a process started by hand in cluster mode has not, and supervises itself.
SUPERVISED_ENV = "KVR_JAX_SUPERVISED"


STAGE_FILE_ENV = "KVR_JAX_STAGE_FILE"


# glog lines (the coordination service's, XLA's): "E1125 21:25:30.183 5232 file.cc:1520] ..."
_GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\]")


_COORDINATION_FATAL = "JAX distributed service detected fatal errors"


def is_supervised() -> bool:
  return os.environ.get(SUPERVISED_ENV) == "1"


def run_supervised(process_id: int, command: list[str]) -> int:
  """Cluster mode, a process started by hand: runs `command` (this process's own arguments)
  as a child and returns its exit status. Why: when another process of the cluster dies,
  JAX's client thread that polls the coordination service may terminate the child from C++
  (its fatal log, SIGABRT) before Python sees any error: the coordinator lost, or a peer
  that died before a collective failed. The child's own lines pass through as they come; the
  coordination service's log lines are held back, and such a death becomes one line (which
  process, which was lost, at which step) and EXIT_PEER_LOST."""
  with tempfile.TemporaryDirectory(prefix="kvr_jax_stage_") as directory:
    stage_file = os.path.join(directory, "stage")
    env = {**os.environ, SUPERVISED_ENV: "1", STAGE_FILE_ENV: stage_file}
    child = subprocess.Popen(
      [sys.executable, *command],
      env=env,
      stderr=subprocess.PIPE,
      text=True,
      preexec_fn=_die_with_parent,
    )
    held = []
    # From the first glog line on, everything is held (a glog record runs over several
    # lines); it is written out at the end, but for a lost peer, which is one line.
    for line in child.stderr:
      if held or _GLOG_LINE.match(line):
        held.append(line)
      else:
        sys.stderr.write(line)
        sys.stderr.flush()
    code = child.wait()
    text = "".join(held)
    if code != 0 and _COORDINATION_FATAL in text:
      label = "its job"
      with contextlib.suppress(OSError), open(stage_file) as f:
        label = f.read().strip() or label
      print(
        f"error: process {process_id}: lost {_lost_in_log(text)} during {label}; stopping "
        "(JAX's coordination service ended this process)",
        file=sys.stderr,
      )
      return EXIT_PEER_LOST
    if code == EXIT_PEER_LOST:  # the child said so in its own line: that line alone
      text = "".join(line for line in held if line.startswith("error: "))
    sys.stderr.write(text)
    return code if code >= 0 else 128 - code


def _die_with_parent() -> None:
  """In the child before it runs (Linux): SIGKILL when the supervisor dies, so that killing
  the process a user started kills its work too (else the child would run on, orphaned)."""
  with contextlib.suppress(OSError, AttributeError):
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _lost_in_log(text: str) -> str:
  """Which process the coordination service's fatal log says is gone."""
  if "leader task" in text or "Failed to send RPC to coordination service" in text:
    return "process 0 (the coordinator)"
  ids = sorted(set(re.findall(r"Task (\d+) heartbeat timeout", text)), key=int)
  unhealthy = re.search(r"stopped sending heartbeats\):\s*\n([\d,\s]+)", text)
  if not ids and unhealthy:
    ids = re.findall(r"\d+", unhealthy.group(1))
  return _processes(ids) if ids else "another process"


def _processes(ids) -> str:
  """'process 1' or 'processes 1, 2'."""
  return f"process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"


EXIT_JOB_FAILED = 1


EXIT_USER_ERROR = 2


EXIT_PEER_LOST = 4


# What a collective's runtime error says when the process at the other end is gone (gloo over
# TCP, JAX's coordination service): such an error is a lost peer, not this process's fault.
PEER_LOST_MARKERS = (
  "connection reset by peer",
  "connection closed by peer",
  "broken pipe",
  "socket closed",
  "gloo",
  "heartbeat",
  "coordination service",
)


@dataclasses.dataclass
class _Stage:
  """What this worker is doing now (a label per prefill or decode run), so that a lost peer is
  reported at its step. Set by `stage`; it never changes a compiled program."""

  label: str = "its job"


_STAGE = _Stage()


@contextlib.contextmanager
def stage(label: str):
  """Names the step the body runs (e.g. "prefill kvr", "decode kvr") for the one-line report
  of a lost peer (`worker_failures`, and `run_supervised`, which reads it from the file its
  child is given: the child may die from C++ before it can say anything)."""
  before = _STAGE.label
  _set_stage(label)
  yield  # an exception leaves the label as it is: the step that failed
  _set_stage(before)


def _set_stage(label: str) -> None:
  _STAGE.label = label
  path = os.environ.get(STAGE_FILE_ENV)
  if path:
    with contextlib.suppress(OSError), open(path, "w") as f:
      f.write(label)


def is_peer_lost(error: BaseException) -> bool:
  """Whether `error` is a collective failing because another process is gone."""
  text = str(error).lower()
  runtime = type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
  return runtime and any(marker in text for marker in PEER_LOST_MARKERS)


def lost_processes(timeout: float = 5.0) -> list[int] | None:
  """The process ids JAX's coordination service no longer counts as live (None when it cannot
  tell within `timeout` seconds, or this process is not in a cluster)."""
  import jax
  from jax._src import distributed as jax_distributed

  client = getattr(jax_distributed.global_state, "client", None)
  if client is None or not hasattr(client, "get_live_nodes"):
    return None
  everyone = list(range(jax.process_count()))
  answer: list = []

  def ask():
    with contextlib.suppress(Exception):
      live = client.get_live_nodes(everyone)
      answer.append(sorted(set(everyone) - set(live)))

  asking = threading.Thread(target=ask, daemon=True)
  asking.start()
  asking.join(timeout)
  return answer[0] if answer and answer[0] else None


def peer_lost_line(error: BaseException, lost: list[int] | None) -> str:
  """The one line a survivor prints: which process it is, which it lost, at which step."""
  import jax

  me = jax.process_index()
  if lost:
    who = _processes(lost)
  else:
    others = [i for i in range(jax.process_count()) if i != me]
    who = f"another process (of {others})" if len(others) != 1 else f"process {others[0]}"
  cause = str(error).strip().splitlines()[-1][:160] if str(error).strip() else type(error).__name__
  return (
    f"error: process {me}: lost {who} during {_STAGE.label}; stopping "
    f"(the collective failed: {cause})"
  )


@contextlib.contextmanager
def worker_failures():
  """A worker's job: any exception ends this process at once with its message on stderr (a
  ValueError, the user's mistake: one line and status 2; anything else: the traceback and
  status 1). Not `sys.exit`: Python's exit runs JAX's distributed shutdown, a barrier with
  the other processes, which never arrive while they wait for this one in a collective (a
  decode step, a hop), so the run would hang for the barrier's minutes and end in an abort
  that hides the cause."""
  try:
    yield
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    _exit_now(EXIT_USER_ERROR)
  except Exception as e:  # noqa: BLE001 - a lost peer is one line, anything else a traceback
    if not is_peer_lost(e):
      traceback.print_exc()
      _exit_now(EXIT_JOB_FAILED)
    print(peer_lost_line(e, lost_processes()), file=sys.stderr)
    _exit_now(EXIT_PEER_LOST)
  except BaseException as e:  # noqa: BLE001 - every failure must end the process the same way
    if isinstance(e, SystemExit) and e.code in (None, 0):
      raise
    traceback.print_exc()
    _exit_now(EXIT_JOB_FAILED)


def _exit_now(code: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
