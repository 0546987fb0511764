"""The architecture, checked: layers import only downwards, no cycle, no hidden imports, and an
installed wheel carries its presets and KVR-P tables."""

import ast
import importlib
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kvr_jax", "models", "launch")
# Bottom to top: a module may import only from its own layer or the layers before it.
LAYERS = (
  "models",
  "kvr_jax.core",
  "kvr_jax.runtime",
  "kvr_jax.strategies",
  "kvr_jax.planning",
  "kvr_jax.inference",
  "kvr_jax.tools",
  "kvr_jax",  # the curated facade, kvr_jax/__init__.py
  "launch",
)


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, pathlib.Path]:
  return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported_modules(tree: ast.AST, modules: dict) -> list[tuple[str, ast.AST]]:
  """Project modules an AST imports, with the node that imports each."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      # `from pkg import sub` imports pkg.sub when that is a module, else a name of pkg.
      names = [
        f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
        for a in node.names
      ]
    else:
      continue
    found += [(n, node) for n in names if n.split(".")[0] in PACKAGES and n in modules]
  return found


def layer_of(name: str) -> int:
  if name == "kvr_jax":  # the facade alone; its submodules belong to their own layers
    return LAYERS.index("kvr_jax")
  return max(
    i
    for i, layer in enumerate(LAYERS)
    if layer != "kvr_jax" and (name == layer or name.startswith(layer + "."))
  )


def import_graph():
  modules = project_modules()
  graph, inside_functions = {}, []
  for name, path in modules.items():
    tree = ast.parse(path.read_text(), str(path))
    graph[name] = {target for target, _ in imported_modules(tree, modules)}
    for func in ast.walk(tree):
      if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
        for target, node in imported_modules(func, modules):
          inside_functions.append(f"{name}:{node.lineno} imports {target} inside a function")
  return graph, inside_functions


def find_cycle(graph) -> list[str] | None:
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for target in sorted(graph.get(node, ())):
      # A package's own __init__ importing its submodules is how packages re-export, and the
      # submodules' imports of siblings are what the layer rule checks; skip parent packages.
      if node.startswith(target + "."):
        continue
      if state.get(target) == "open":
        return stack[stack.index(target) :] + [target]
      if target not in state:
        cycle = visit(target)
        if cycle:
          return cycle
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node)
      if cycle:
        return cycle
  return None


def test_no_project_import_inside_a_function():
  _, inside = import_graph()
  assert inside == []


def test_no_import_cycle():
  graph, _ = import_graph()
  assert find_cycle(graph) is None


def test_layers_import_only_downwards():
  graph, _ = import_graph()
  upward = [
    f"{source} (layer {LAYERS[layer_of(source)]}) imports {target} (layer "
    f"{LAYERS[layer_of(target)]})"
    for source, targets in graph.items()
    for target in targets
    if layer_of(target) > layer_of(source)
  ]
  assert upward == []


def test_the_checks_can_fail():
  """The detectors on a made-up graph with an upward import, a cycle and a hidden import."""
  graph = {
    "kvr_jax.core.chunks": {"kvr_jax.tools.demo"},
    "kvr_jax.tools.demo": {"kvr_jax.core.chunks"},
  }
  assert find_cycle(graph) == ["kvr_jax.core.chunks", "kvr_jax.tools.demo", "kvr_jax.core.chunks"]
  assert layer_of("kvr_jax.tools.demo") > layer_of("kvr_jax.core.chunks")
  tree = ast.parse("def f():\n  from kvr_jax.core import chunks\n")
  modules = {"kvr_jax.core.chunks": None, "kvr_jax.core": None}
  assert [t for t, _ in imported_modules(tree.body[0], modules)] == ["kvr_jax.core.chunks"]


def test_every_strategy_is_registered_and_has_a_module():
  from kvr_jax import strategies

  # A strategy is a module, or a package whose __init__ holds its record.
  files = [*(ROOT / "kvr_jax" / "strategies").glob("*.py")]
  files += (ROOT / "kvr_jax" / "strategies").glob("*/__init__.py")
  modules = {
    p.parent.name if p.stem == "__init__" else p.stem
    for p in files
    if "\nSTRATEGY = Strategy(" in p.read_text()
  }
  defined = [importlib.import_module(f"kvr_jax.strategies.{m}").STRATEGY for m in sorted(modules)]
  assert sorted(s.name for s in defined) == sorted(strategies.REGISTRY)
  assert all(strategies.REGISTRY[s.name] is s for s in defined)
  assert strategies.STRATEGIES == tuple(strategies.REGISTRY)


@pytest.mark.e2e  # builds the wheel
@pytest.mark.skipif(os.environ.get("KVR_SKIP_WHEEL") == "1", reason="KVR_SKIP_WHEEL=1")
def test_the_wheel_carries_presets_and_tables(tmp_path):
  """`pip install .` (not -e) must find presets and KVR-P tables: build the wheel, install it
  into a bare directory and load both from there, run from a directory without the sources."""
  # Built from a copy: setuptools writes build/ and *.egg-info next to the sources it builds.
  source = tmp_path / "src"
  shutil.copytree(
    ROOT,
    source,
    ignore=shutil.ignore_patterns(
      ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "results"
    ),
  )
  build = subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "wheel",
      "--no-deps",
      "--no-build-isolation",
      "-q",
      "-w",
      str(tmp_path / "dist"),
      str(source),
    ],
    capture_output=True,
    text=True,
  )
  assert build.returncode == 0, build.stderr[-2000:]
  (wheel,) = (tmp_path / "dist").glob("kvr_jax-*.whl")
  target = tmp_path / "site"
  install = subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "install",
      "--no-deps",
      "-q",
      "--target",
      str(target),
      str(wheel),
    ],
    capture_output=True,
    text=True,
  )
  assert install.returncode == 0, install.stderr[-2000:]
  script = (
    "import kvr_jax\n"
    "from kvr_jax.core import resources\n"
    "from kvr_jax.planning import tables\n"
    f"assert kvr_jax.__file__.startswith({str(target)!r}), kvr_jax.__file__\n"
    f"assert str(resources.config_dir()).startswith({str(target)!r})\n"
    "from kvr_jax.runtime.loading import preset_config, preset_names\n"
    "cfg = preset_config('llama-2-7b')\n"
    "print(cfg.num_layers, len(preset_names()))\n"
    "t = tables.load_table('llama-2-7b', 'a100-80gb', '300GBps', 4)\n"
    "print(tables.predict_partition(t, 4096))\n"
  )
  env = dict(os.environ, PYTHONPATH=str(target))
  run = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env
  )
  assert run.returncode == 0, run.stderr[-2000:]
  layers, presets = run.stdout.split()[:2]
  assert layers == "32" and int(presets) >= 6


# --- state that used to be hidden ----------------------------------------------------------------


def test_local_calibration_is_kept_on_disk_and_reused(tmp_path, monkeypatch):
  """The same command gives the same searched chunks run after run: the first calibration of
  a machine is stored and read back; `calibrate()` measures again and replaces it."""
  from kvr_jax.planning import presets
  from kvr_jax.planning.partition import resolve_partition
  from kvr_jax.runtime.loading import preset_config

  monkeypatch.setenv("KVR_JAX_CACHE_DIR", str(tmp_path))
  presets.local_calibration.cache_clear()
  try:
    config = preset_config("llama-2-7b")
    first = presets.local_calibration()
    (stored,) = tmp_path.glob("calibration-*.json")
    chunks = resolve_partition("search", 4096, 4, config=config)
    presets.local_calibration.cache_clear()  # a new process: reads the file, measures nothing
    monkeypatch.setattr(presets, "measure_hardware", lambda: pytest.fail("measured again"))
    assert presets.local_calibration() == first
    assert resolve_partition("search", 4096, 4, config=config) == chunks
    monkeypatch.undo()
    monkeypatch.setenv("KVR_JAX_CACHE_DIR", str(tmp_path))
    before = stored.stat().st_mtime_ns
    again = presets.calibrate()
    assert stored.stat().st_mtime_ns > before and presets.local_calibration() == again
  finally:
    presets.local_calibration.cache_clear()


def test_weight_copies_per_placement_are_bounded():
  import jax

  import kvr_jax
  from kvr_jax.runtime import loading

  model = kvr_jax.load_model("tiny-llama")
  for device in jax.devices()[: loading.MAX_PLACEMENTS + 2]:
    model.state_on(device)
  assert model.placements == tuple(jax.devices()[2 : loading.MAX_PLACEMENTS + 2])


def test_measured_plans_are_resolved_above_prefill(monkeypatch):
  """prefill refuses a measured plan with the call to make; measured_partition searches once
  per (model, mesh, shape, plan), and a new model never inherits an answer."""
  import numpy as np

  import kvr_jax
  from kvr_jax.tools import measured

  plan = kvr_jax.PartitionPlan("search", objective="measured", multiple=16)
  model, mesh = kvr_jax.load_model("tiny-llama"), kvr_jax.make_mesh(2)
  tokens = np.zeros((1, 64), np.int32)
  with pytest.raises(ValueError, match="kvr_jax.tools.measured.measured_partition"):
    kvr_jax.prefill(model, tokens, strategy="kvr", mesh=mesh, partition=plan)
  calls = []
  monkeypatch.setattr(
    measured, "measured_search", lambda *a, **k: calls.append((a[0], k)) or (48, 16)
  )
  assert measured.measured_partition(model, tokens, mesh, plan) == (48, 16)
  # It starts from the modelled split, with steps of at most C/16p (here the multiple).
  modelled = kvr_jax.PartitionPlan("search", multiple=16)
  from kvr_jax.inference.prefill import plan_prefill

  want = plan_prefill(model, tokens, strategy="kvr", mesh=mesh, partition=modelled).chunks
  assert calls[0][1]["start"] == tuple(want) and calls[0][1]["first_step"] == 16
  assert measured.measured_partition(model, tokens, mesh, plan) == (48, 16)
  assert len(calls) == 1
  other = kvr_jax.load_model("tiny-llama")
  measured.measured_partition(other, tokens, mesh, plan)
  assert len(calls) == 2 and calls[1][0] is other


def test_every_cache_of_programs_is_registered():
  """No bare functools.lru_cache in the library: every kept program or plan is made with
  `core.caches.kept_cache`, so that `clear_caches()` drops it (a cold-start benchmark would
  otherwise time a warm program). `functools.cache` stays for what is kept on purpose."""
  bare = []
  for path in sorted((ROOT / "kvr_jax").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Attribute) and node.attr == "lru_cache":
        if path.name != "caches.py":
          bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
  assert not bare, f"use core.caches.kept_cache: {bare}"


def test_a_plan_across_processes_asks_each_choice_once(monkeypatch):
  """Across processes every per-process choice (auto's pick, the split, the join) is process
  0's, broadcast; a second plan of the same prompt shape asks no process again (a broadcast
  cost 2-3 ms on gloo, a tenth of a 1k-token prefill)."""
  import numpy as np

  import kvr_jax
  from kvr_jax.inference import prefill as prefill_module
  from kvr_jax.runtime import agreement

  asked = []

  def broadcast(value):  # process 0's answer is this process's (one process here)
    asked.append(np.asarray(value).tolist())
    return value

  monkeypatch.setattr(agreement, "spans_processes", lambda mesh: True)
  monkeypatch.setattr(agreement.multihost_utils, "broadcast_one_to_all", broadcast)
  model, mesh = kvr_jax.load_model("tiny-llama"), kvr_jax.make_mesh(2)
  tokens = np.zeros((1, 72), np.int32)  # a shape no other test plans
  plans = [
    prefill_module.plan_prefill(model, tokens, "kvr", mesh=mesh, partition="search", cache="last")
    for _ in range(2)
  ]
  assert len(asked) == 2, asked  # the split, then the join: once
  assert asked[0] == list(plans[0].chunks) and plans[1].chunks == plans[0].chunks
  del asked[:]
  for _ in range(2):
    prefill_module.plan_prefill(model, tokens, "auto", mesh=mesh, cache="auto")
  assert 1 <= len(asked) <= 4, asked  # auto's pick and the layout, once (with its split)
  first = len(asked)
  prefill_module.plan_prefill(model, tokens, "auto", mesh=mesh, cache="auto")
  assert len(asked) == first
