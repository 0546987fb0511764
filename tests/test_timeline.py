"""Per-rank timelines: probed programs compute the same thing, and their records are ordered.

In one process (8 emulated devices) the probes leave logits and cache unchanged (within the
strategies' fixed 1e-5: the barriers change XLA's fusions, hence rounding) and every
rank's marks come in program order; across two processes (`launch.benchmark
--mode=timeline`) the merged timeline's span matches the probed TTFT: the span runs from the
call's start to the last rank's last mark, so it is at most the TTFT and misses only the
hand-back of the outputs, which on a tiny model is a sizeable but bounded share (tolerance
fixed here: the span is at least half the probed TTFT).
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import kvr_jax
from kvr_jax.inference.prefill import plan_prefill, run_prefill
from kvr_jax.planning import costmodel, presets
from kvr_jax.runtime.loading import build_model, preset_config
from kvr_jax.strategies import probe, runahead
from kvr_jax.tools import timeline
from tests.subprocess_env import launcher_env
from tests.tolerance import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYER_ORDER = {
  "kvr": ["qkv", "diagonal", "hop", "attention", "rest"],  # flash: diagonal before the hops
  "allgather": ["qkv", "allgather", "attention", "rest"],
  "ring": ["qkv", "step", "attention", "rest"],
}


def check_order(items, strategy, num_layers, num_ranks):
  """Per rank: embed, then per layer the phases in program order, then the logits."""
  for rank in range(num_ranks):
    mine = [i for i in items if i[0] == rank]
    assert all(end >= start for _, _, _, start, end in mine)
    assert [start for *_, start, _ in mine] == sorted(start for *_, start, _ in mine)
    labels = [(layer, phase.rstrip("0123456789")) for _, layer, phase, _, _ in mine]
    assert labels[0] == (-1, "embed") and labels[-1] == (-1, "logits"), labels
    body = labels[1:-1]
    assert [layer for layer, _ in body] == sorted(layer for layer, _ in body)
    for layer in range(num_layers):
      kinds = [kind for ly, kind in body if ly == layer]
      deduped = [k for n, k in enumerate(kinds) if n == 0 or kinds[n - 1] != k]
      want = LAYER_ORDER[strategy]
      if layer == num_layers - 1:
        # The last layer: only the prompt's last row is read. KV-Runahead's ranks before the
        # last end it with their hops, the last rank attends and finishes its last row (one
        # "rest" probe); the peers gather every rank's K,V into the owner of the last row, which
        # attends and finishes it (`strategies.base.gather_to_owner`).
        if strategy == "kvr":
          want = want[: want.index("attention")] + (["rest"] if rank == num_ranks - 1 else [])
        else:
          want = ["qkv", "gather", "rest"]
      assert deduped == want, (rank, layer, kinds)


@pytest.mark.default_cases("allgather-None")
@pytest.mark.parametrize(
  "strategy,partition", [("kvr", [20, 12, 9, 7]), ("allgather", None), ("ring", None)]
)
def test_probes_change_nothing_and_come_in_order(strategy, partition):
  model = kvr_jax.load_model("tiny-llama")
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, 48)
  mesh = kvr_jax.make_mesh(4)
  kwargs = {"partition": partition} if partition else {}
  plain = kvr_jax.prefill(model, tokens, strategy=strategy, mesh=mesh, **kwargs)
  probe.EVENTS.clear()
  plan = plan_prefill(model, tokens, strategy=strategy, mesh=mesh, timeline=True, **kwargs)
  probed = run_prefill(model, plan, tokens)
  # The call returns when the last rank's outputs are ready (KVR's cache="last" needs nothing
  # from the others): wait for every rank's probes before reading them.
  jax.effects_barrier()
  # The barriers change XLA's fusions (rounding), not the maths: the strategies' 1e-5.
  assert_close(probed.logits, plain.logits, "probed logits")
  assert_close(probed.k_cache, plain.k_cache, "probed K cache")
  run = {"start_ns": min(e[3] for e in probe.EVENTS), "events": list(probe.EVENTS)}
  items = timeline.intervals([run])
  check_order(items, strategy, model.config.num_layers, 4)
  # KVR's p-1 hops and the ring's p-1 steps are each marked; all-gather has one exchange.
  hops = {phase for _, _, phase, _, _ in items if phase.startswith(("hop", "step"))}
  assert len(hops) == (0 if strategy == "allgather" else 3)


@pytest.mark.default_cases("tiny-llama-kvr")
@pytest.mark.parametrize(
  "name, strategy",
  [
    ("tiny-llama", "kvr"),
    ("tiny-llama", "allgather"),
    ("tiny-llama", "ring"),
    ("bench-qwen3.5", "kvr"),
    ("bench-deepseek", "allgather"),
  ],
)
def test_probes_on_a_2d_mesh_record_each_rank_once(name, strategy):
  """On a ("ranks", "model") mesh every device of a rank runs the marks; only the first of
  its group records them: the same records per rank, layer and phase as on the 1-D mesh of
  as many ranks (K,V, hybrid and latent layers), in program order, and the probes change
  no logit."""
  import collections

  model = kvr_jax.Model(build_model(preset_config(name)))
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, 48)
  records = {}
  for mesh in (kvr_jax.make_mesh(2), kvr_jax.make_mesh(2, model=2)):
    plain = kvr_jax.prefill(model, tokens, strategy=strategy, mesh=mesh, cache="sharded")
    probe.EVENTS.clear()
    plan = plan_prefill(model, tokens, strategy, mesh, cache="sharded", timeline=True)
    probed = run_prefill(model, plan, tokens)
    jax.effects_barrier()  # every rank's records, not only the last rank's
    assert_close(probed.logits, plain.logits, "probed logits")
    if name == "tiny-llama":  # K,V layers alone: each phase in program order
      run = {"start_ns": min(e[3] for e in probe.EVENTS), "events": list(probe.EVENTS)}
      check_order(timeline.intervals([run]), strategy, model.config.num_layers, 2)
    records[len(mesh.axis_names)] = collections.Counter(e[:3] for e in probe.EVENTS)
  assert records[2] == records[1]


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_a_latent_models_probes_change_nothing_and_come_in_order():
  """KV-Runahead on latent layers (bench-deepseek: its hops carry latents) marks its phases as
  on K,V layers, in program order per rank, and the probes change neither the logits nor
  the latent cache beyond the strategies' 1e-5."""
  items, num_layers = _probed_latent_model(strategy="kvr", partition=[20, 16, 12])
  check_order(items, "kvr", num_layers, 3)
  assert len({phase for _, _, phase, _, _ in items if phase.startswith("hop")}) == 2


def _probed_latent_model(**kwargs):
  """bench-deepseek's prefill on 3 ranks (cache="last"), probed and not: the probes change
  neither the logits nor the latent cache beyond the strategies' 1e-5. Returns (the probed
  run's intervals, the model's layer count)."""
  model = kvr_jax.Model(build_model(preset_config("bench-deepseek")))
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, 48)
  kwargs = dict(mesh=kvr_jax.make_mesh(3), cache="last", **kwargs)
  plain = kvr_jax.prefill(model, tokens, **kwargs)
  probe.EVENTS.clear()
  probed = run_prefill(model, plan_prefill(model, tokens, timeline=True, **kwargs), tokens)
  jax.effects_barrier()
  assert_close(probed.logits, plain.logits, "probed logits")
  assert_close(probed.past.cache, plain.past.cache, "probed latents")
  items = timeline.intervals(
    [{"start_ns": min(e[3] for e in probe.EVENTS), "events": probe.EVENTS}]
  )
  return items, model.config.num_layers


@pytest.mark.e2e  # slow (compiling bench-deepseek): the end-to-end tier, as KV-Runahead's case
@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_a_latent_models_peers_mark_their_phases_as_on_kv_layers(strategy):
  """All-gather CP and ring attention on latent layers (bench-deepseek, 3 ranks) mark the
  phases they mark on K,V layers, in program order per rank (the last layer gathered on
  the owner of the prompt's last row), ring's p-1 steps each marked, and the probes change
  neither the logits nor the latent cache beyond the strategies' 1e-5."""
  items, num_layers = _probed_latent_model(strategy=strategy)
  check_order(items, strategy, num_layers, 3)
  steps = {phase for _, _, phase, _, _ in items if phase.startswith("step")}
  assert len(steps) == (2 if strategy == "ring" else 0)


def test_timeline_refused_for_strategies_without_probes():
  model = kvr_jax.load_model("tiny-llama")
  with pytest.raises(ValueError, match="strategy 'tsp' has no timeline probes"):
    plan_prefill(model, np.ones((1, 16), np.int32), strategy="tsp", timeline=True)


def test_modelled_kvr_schedule_matches_the_timeline():
  """The schedule's last 'rest' end per rank is exactly the timeline's finish time."""
  t_qkv, t_att, t_rest, hops = [1.0, 0.5, 0.25], [1.0, 2.0, 3.0], [0.5, 0.5, 0.5], [0.2, 0.7]
  steps = runahead.hop_chain_steps(t_qkv, [0.0] * 3, t_att, t_rest, hops)
  layer = costmodel.ModelledLayer(steps, (1, 1, 1), (0, 0, 0), (0, 0, 0))
  schedule = []
  finish = costmodel.layer_timeline(layer, 3, intervals=schedule)
  assert finish == [max(e for r, _, _, _, e in schedule if r == rank) for rank in range(3)]
  # Rank 1 waits for hop 0 in layer 0 (own K,V at 0.5, prefix at 1.0 + 0.2).
  waits = [(s, e) for r, ly, ph, s, e in schedule if (r, ly, ph) == (1, 0, "wait")]
  assert waits == [(0.5, pytest.approx(1.2))]
  setup = presets.make_setup("a100-80gb", "300GBps", dtype_bytes=2)
  config = preset_config("llama-2-7b")
  items = []
  kw = dict(num_ranks=2, partition=(2500, 1596))
  sim = costmodel.simulate(config, "kvr", 4096, setup, **kw, intervals=items)
  last = max(e for r, *_, e in items if r == 1)
  assert last + costmodel.head_work(config, 1, 2).time(setup.hardware) == pytest.approx(sim.ttft)


@pytest.mark.serial  # waits on timeouts or times a span: run alone
@pytest.mark.e2e  # a launched cluster
def test_two_process_timeline_span_matches_ttft(tmp_path):
  env = launcher_env()  # workers set their own device count
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "launch.benchmark",
      "--mode=timeline",
      "--model=tiny-llama",
      "--context_lens=512",
      "--num_processes=2",
      "--repeats=2",
      "--partition=300,212",
      # KV-Runahead alone: the probes of every strategy are checked on emulated devices
      # above; here what crosses processes (the span, the runs of both, the JSON).
      "--timeline_strategies=kvr",
      # The cache joined on the last rank (KV-Runahead's last hops kept): the probed call
      # then ends with the join, after the span.
      "--cache=last",
      f"--output_dir={tmp_path}",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert os.path.getsize(tmp_path / "timeline_512.png") > 10_000
  with open(tmp_path / "timeline_512.json") as f:
    dump = json.load(f)
  assert [d["strategy"] for d in dump] == ["kvr"]
  for d in dump:
    runs = d["runs"]
    assert sorted(r["process_index"] for r in runs) == [0, 1]
    owner = max(runs, key=lambda r: r["process_index"])
    items = [tuple(i) for i in d["measured"]]
    check_order(items, d["strategy"], 4, 2)
    span = timeline.span_s(runs)
    assert 0.5 * owner["probed_ttft_s"] <= span <= owner["probed_ttft_s"], (span, owner)
    assert {i[0] for i in d["modelled"]} == {0, 1}
  assert dump[0]["runs"][0]["partition"] == [300, 212]
  assert {r["cache"] for r in dump[0]["runs"]} == {"last"}
  assert "MEASURED timelines" in proc.stdout and "cache last" in proc.stdout


HYBRID_LINEAR_ORDER = {"kvr": ["linear", "hop", "rest"]}  # the peers: their all-gather of maps


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize("strategy,partition", [("kvr", [40, 24]), ("allgather", None)])
def test_hybrid_probes_change_nothing_and_come_in_order(strategy, partition):
  """A hybrid's own program (bench-qwen3.5-8: a full layer mid-model and one last) marks its
  linear layers ("linear", then KV-Runahead's "hop" or the peers' "allgather", then "rest")
  and its full layers as the strategy's body does, in program order per rank, and the
  probes change no logit beyond the strategies' 1e-5."""
  model = kvr_jax.Model(build_model(preset_config("bench-qwen3.5-8")))
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, 64)
  mesh = kvr_jax.make_mesh(2)
  kwargs = {"partition": partition} if partition else {}
  plain = kvr_jax.prefill(model, tokens, strategy=strategy, mesh=mesh, cache="sharded", **kwargs)
  probe.EVENTS.clear()
  plan = plan_prefill(
    model, tokens, strategy=strategy, mesh=mesh, cache="sharded", timeline=True, **kwargs
  )
  probed = run_prefill(model, plan, tokens)
  jax.effects_barrier()
  assert_close(probed.logits, plain.logits, "probed logits")
  items = timeline.intervals(
    [{"start_ns": min(e[3] for e in probe.EVENTS), "events": probe.EVENTS}]
  )
  kinds = [
    "full" if "Attention" in type(k).__name__ else "linear" for k in model.config.layer_kinds
  ]
  last = len(kinds) - 1
  for rank in range(2):
    mine = [i for i in items if i[0] == rank]
    assert [start for *_, start, _ in mine] == sorted(start for *_, start, _ in mine)
    labels = [(layer, phase.rstrip("0123456789")) for _, layer, phase, _, _ in mine]
    assert labels[0] == (-1, "embed") and labels[-1] == (-1, "logits"), labels
    for layer, kind in enumerate(kinds):
      phases = [p for ly, p in labels if ly == layer]
      phases = [k for n, k in enumerate(phases) if n == 0 or phases[n - 1] != k]
      if kind == "linear":
        want = HYBRID_LINEAR_ORDER.get(strategy, ["linear", "allgather", "rest"])
      elif layer < last:
        want = LAYER_ORDER[strategy]
      elif strategy == "kvr":  # the last layer: the last rank attends one row
        want = ["qkv", "diagonal", "hop"] + (["rest"] if rank == 1 else [])
      else:
        want = ["qkv", "gather", "rest"]
      assert phases == want, (rank, layer, kind, phases)
