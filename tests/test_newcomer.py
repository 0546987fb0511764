"""What a new user types first: README's Python blocks and the launchers' help examples, as
written, in fresh processes; and the API's first mistakes, each one clear error."""

import ast
import glob
import os
import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest

import kvr_jax
from kvr_jax.runtime.mesh import AXIS
from tests.subprocess_env import launcher_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")


def readme():
  """README.md and the docs/ pages it links to: what a newcomer reads and copies."""
  pages = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
  text = []
  for page in pages:
    with open(page) as f:
      text.append(f.read())
  return "\n".join(text)


def fresh_env():
  """A new user's shell: no emulated-device flags (the snippets set what they need)."""
  return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


@pytest.mark.e2e  # launched as a newcomer runs it
@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", readme()))))
def test_readme_python_blocks_run_as_written(index, tmp_path):
  block = re.findall(r"```python\n(.*?)```", readme(), re.S)[index]
  script = tmp_path / "snippet.py"
  script.write_text(block)
  proc = subprocess.run(
    [sys.executable, str(script)],
    cwd=ROOT,
    env=fresh_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]


def _commands(text):
  """`python -m launch.X ...` commands in a text: lines of fenced blocks and docstrings
  (joined over trailing backslashes) and inline code spans (which may wrap over lines)."""
  text = re.sub(r"\\\n\s*", " ", text)
  fenced = re.findall(r"```\w*\n(.*?)```", text, re.S)
  prose = re.sub(r"```\w*\n.*?```", "", text, flags=re.S)
  spans = [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
  lines = [ln for block in fenced for ln in block.splitlines()] + spans
  lines += [ln for ln in prose.splitlines() if ln.strip().startswith("python -m launch.")]
  found = []
  for line in lines:
    m = re.search(r"python -m launch\.\w+[^`#|]*", line)
    if m:
      found.append(" ".join(m.group(0).split()))
  return found


def _help_examples():
  """Example command lines of the launchers' docstrings (what --help prints)."""
  out = []
  for name in sorted(os.listdir(LAUNCH)):
    if name.endswith(".py"):
      with open(os.path.join(LAUNCH, name)) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
      out += _commands(doc)
  return out


def _defined_flags(module):
  """The flags the launcher defines, in its own module or a launch module it imports (its
  flags kept apart: launch/benchmark_flags.py)."""
  with open(os.path.join(LAUNCH, module + ".py")) as f:
    source = f.read()
  for imported in re.findall(r"^from launch\.(\w+) import", source, flags=re.M):
    if os.path.exists(os.path.join(LAUNCH, imported + ".py")):
      with open(os.path.join(LAUNCH, imported + ".py")) as f:
        source += f.read()
  return set(re.findall(r"flags\.DEFINE_\w+\(\s*\"(\w+)\"", source))


EXAMPLES = sorted(set(_help_examples() + _commands(readme())))


def test_examples_were_found():
  assert len(EXAMPLES) >= 10 and any("launch.multiprocess" in c for c in EXAMPLES)


@pytest.mark.parametrize("command", EXAMPLES)
def test_every_example_uses_flags_its_launcher_defines(command):
  """Every example in a --help text or README names a launcher that exists and only flags
  it defines (the examples that take minutes are not run here; launch.run's are, below)."""
  words = shlex.split(command)
  module = words[2].split(".", 1)[1]
  assert os.path.exists(os.path.join(LAUNCH, module + ".py")), command
  defined = _defined_flags(module)
  for word in words[3:]:
    if word.startswith("--"):
      name = word[2:].split("=", 1)[0]
      assert name in defined or (name.startswith("no") and name[2:] in defined), (name, command)


# launch.run's example lines (not prose mentions with placeholders such as --model=output_dir).
# The bare `python -m launch.run` runs in tests/test_launchers.py::test_run_main_job (with
# --output_json, to read its numbers back), so it is not run twice.
RUN_EXAMPLES = sorted(
  c
  for c in set(_help_examples())
  if c.startswith("python -m launch.run ") and "output_dir" not in c
)


@pytest.mark.e2e  # launched as a newcomer runs it
@pytest.mark.parametrize("command", RUN_EXAMPLES)
def test_launch_run_help_examples_run_as_written(command):
  words = shlex.split(command)
  proc = subprocess.run(
    [sys.executable, *words[1:]],
    cwd=ROOT,
    env=launcher_env(),  # the launcher asks for its own devices
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "kvr" in proc.stdout


def test_first_api_mistakes_are_one_clear_error():
  model = kvr_jax.load_model("tiny-llama")
  tokens = np.ones((1, 64), np.int32)
  mesh = kvr_jax.make_mesh(np.int64(4))  # numpy integers are integers
  assert mesh.shape[AXIS] == 4
  with pytest.raises(ValueError, match="list of 4 chunk lengths or a method name, got 16"):
    kvr_jax.prefill(model, tokens, strategy="kvr", mesh=mesh, partition=16)
  got = kvr_jax.prefill(model, tokens, strategy="kvr", mesh=mesh, partition=np.full(4, 16))
  assert got.partition == (16, 16, 16, 16)
  twice = [jax.devices()[0]] * 2
  with pytest.raises(ValueError, match="appears twice in the mesh"):
    kvr_jax.make_mesh(2, twice)
  with pytest.raises(ValueError, match="appears twice in the mesh"):
    kvr_jax.prefill(
      model, tokens, strategy="kvr", mesh=jax.make_mesh((2,), ("ranks",), devices=twice)
    )
  with pytest.raises(ValueError, match="preset name or a directory"):
    kvr_jax.load_model(42)


def test_every_plans_answer_is_validated():
  """`PartitionPlan("even", multiple=32)` cannot split 16 tokens over 4 ranks: one clear error
  before anything compiles (it once returned (-64, 32, 32, 16))."""
  model = kvr_jax.load_model("tiny-llama")
  with pytest.raises(ValueError, match="multiple"):
    kvr_jax.prefill(
      model,
      np.ones((1, 16), np.int32),
      strategy="kvr",
      mesh=kvr_jax.make_mesh(4),
      partition=kvr_jax.PartitionPlan("even", multiple=32),
    )


@pytest.mark.e2e  # launched as a newcomer runs it
def test_predict_for_any_preset_after_the_command_its_error_names(tmp_path):
  """No table: the error names a command; run exactly that command (in a fresh process with
  the same cache directory) and predict then works."""
  model = kvr_jax.load_model("tiny-falcon")
  tokens = np.ones((1, 3000), np.int32)
  plan = kvr_jax.PartitionPlan("predict", hardware="a100-80gb", links="10GBps")
  mesh = kvr_jax.make_mesh(2)
  with pytest.raises(ValueError, match="Build it on this machine with `python -m") as error:
    kvr_jax.prefill(model, tokens, strategy="kvr", mesh=mesh, partition=plan)
  command = re.search(r"`(python -m launch\.partition_tables [^`]*)`", str(error.value)).group(1)
  proc = subprocess.run(
    [sys.executable, *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  got = kvr_jax.prefill(model, tokens, strategy="kvr", mesh=mesh, partition=plan)
  assert sum(got.partition) == 3000 and got.partition[0] > got.partition[1]
