"""One launched process that runs a launcher's `main` on many argument lists.

The one-line error checks of the command lines are many (a bad flag each) and each needs
only the launcher's flag parsing and its checks, yet starting an interpreter and importing
JAX for each costs seconds. absl's flags are global to a process, so this driver imports the
launcher once and, for each argument list, forgets the previous parse
(`FLAGS.unparse_flags`), parses the new one and calls `main` as `absl.app.run` would,
capturing what it prints and the exit status `sys.exit` gives:

  python -m tests.launcher_driver launch.run RESULTS.json < ARGV_LISTS.json

`run_each` (below) is what the tests call. The process runs as a user's shell would (the
launcher sets its own device count), so a check that depends on the devices sees the same 8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What one argument list printed and the status it ended with (as subprocess.run's)."""

  argv: list[str]
  returncode: int
  stdout: str
  stderr: str


def _exit_status(code) -> int:
  """sys.exit's argument as the process's status (None: 0; a message: 1, as Python does)."""
  if code is None:
    return 0
  return code if isinstance(code, int) else 1


def _run_one(module, argv: list[str]) -> dict:
  from absl import flags

  stdout, stderr = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
    try:
      sys.argv = [module.__file__, *argv]  # as the interpreter sets it (a launcher may re-run it)
      flags.FLAGS.unparse_flags()
      rest = flags.FLAGS([module.__name__, *argv])
      status = _exit_status(module.main(rest))
    except flags.Error as e:  # absl.app.run's own handling of a flag it cannot parse
      print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
      status = 1
    except SystemExit as e:
      status = _exit_status(e.code)
    except Exception:  # an uncaught error: a traceback and status 1, as the interpreter's
      traceback.print_exc()
      status = 1
  return {
    "argv": argv,
    "returncode": status,
    "stdout": stdout.getvalue(),
    "stderr": stderr.getvalue(),
  }


def run_each(module: str, argv_lists: list[list[str]], env=None, timeout=600) -> list[Outcome]:
  """Runs `python -m module` once per argument list, all in one launched process."""
  from tests.subprocess_env import launcher_env

  with tempfile.TemporaryDirectory() as tmp:
    results = os.path.join(tmp, "results.json")
    proc = subprocess.run(
      [sys.executable, "-m", "tests.launcher_driver", module, results],
      cwd=ROOT,
      input=json.dumps(argv_lists),
      capture_output=True,
      text=True,
      timeout=timeout,
      env=env or launcher_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(results) as f:
      return [Outcome(**r) for r in json.load(f)]


def main() -> None:
  module_name, results = sys.argv[1], sys.argv[2]
  argv_lists = json.load(sys.stdin)
  module = importlib.import_module(module_name)
  outcomes = [_run_one(module, argv) for argv in argv_lists]
  with open(results, "w") as f:
    json.dump(outcomes, f)


if __name__ == "__main__":
  main()
