"""The cost model, the timeline simulator and the partition methods (all modelled, no devices
except the FLOP check against XLA's cost analysis)."""

import dataclasses
import itertools
import json
import os
import time

import jax
import numpy as np
import pytest

import kvr_jax
from kvr_jax.planning import costmodel, layer_timeline, presets, search, tables
from kvr_jax.planning.partition import PartitionPlan, resolve_partition
from kvr_jax.runtime.loading import build_model, preset_config
from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies import REGISTRY, runahead, tsp, zigzag
from kvr_jax.strategies.by_kind import compile_by_kind
from models.config import ModelConfig
from models.falcon import FalconConfig
from models.llama import LlamaConfig
from models.masks import window_start

LLAMA7 = preset_config("llama-2-7b")


def a100(links="300GBps", dtype_bytes=2, hardware="a100-80gb"):
  """The paper's setting: A100, fp16 (what the cost model's callers used to get by default)."""
  return presets.make_setup(hardware, links, dtype_bytes=dtype_bytes)


def unit_config():
  """One KV head of dimension 2 (RoPE needs pairs), batch 1, 1-byte values: a token's K (or V)
  is 2 bytes, so K and V of n tokens are 4n bytes."""
  return LlamaConfig(
    vocab_size=8,
    d_model=2,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    head_dim=2,
    mlp_dim=2,
    max_position_embeddings=64,
    norm_eps=1e-5,
  )


# --- the paper's worked example and hand-computed timelines -----------------------------------


def test_paper_example_c9_p3_score_entries_and_traffic():
  cfg = unit_config()
  attention = [costmodel.layer_flops(cfg, c, s).attention for c, s in ((4, 4), (3, 7), (2, 9))]
  unit = costmodel.layer_flops(cfg, 1, 1).attention
  assert [a / unit for a in attention] == [16, 21, 18]  # critical rank: 21 entries
  assert costmodel.layer_flops(cfg, 3, 9).attention / unit == 27  # TSP, every rank
  kvr = costmodel.simulate(cfg, "kvr", 9, a100(dtype_bytes=1), num_ranks=3, partition=(4, 3, 2))
  assert kvr.link_bytes == [4 * 4, 4 * 7]  # 4 + 7 = 11 tokens per tensor
  tsp_sim = costmodel.simulate(cfg, "tsp", 9, a100(dtype_bytes=1), num_ranks=3)
  assert sum(tsp_sim.link_bytes) == 4 * 18  # 2 x 18 = 36 K/V entries exchanged


def kvr_timeline(qkv, after, hops, num_layers, diagonal=None, held_send=False, intervals=None):
  """KV-Runahead's hop chain (its own steps, runahead.hop_chain_steps) through the one
  generic timeline, from per-rank phase times in arbitrary units."""
  p = len(qkv)
  diagonal = [0.0] * p if diagonal is None else diagonal
  steps = runahead.hop_chain_steps(qkv, diagonal, after, [0.0] * p, hops)
  layer = costmodel.ModelledLayer(steps, (1,) * p, (0.0,) * p, (0.0,) * p)
  return costmodel.layer_timeline(layer, num_layers, held_send, intervals)


def reference_hop_chain(qkv, after, hops, num_layers, diagonal, held_send):
  """An independent oracle: KV-Runahead's recurrence written out by hand (rank i is ready
  after its qkv and diagonal and, for i > 0, once hop i-1 lands; hop i starts when rank i is
  ready and link i is free, and held, when rank i+1 has done its own work too)."""
  p = len(qkv)
  free, link_free = [0.0] * p, [0.0] * max(p - 1, 0)
  for _ in range(num_layers):
    own = [free[i] + qkv[i] + diagonal[i] for i in range(p)]
    arrive = 0.0
    for i in range(p):
      ready = max(own[i], arrive) if i > 0 else own[i]
      resume = ready
      if i < p - 1:
        send = max(ready, link_free[i], own[i + 1] if held_send else 0.0)
        arrive = link_free[i] = send + hops[i]
        resume = arrive if held_send else ready
      free[i] = resume + after[i]
  return free


def test_kvr_timeline_hand_computed():
  # C=9, p=3, (4,3,2): attention c_i*S_i = 16, 21, 18 time units; hop k carries S_k units.
  # Layer 1: r0 sends [0,4) 0->4, done 16; r1 ready 4, sends [0,7) 4->11, done 25;
  #          r2 ready 11, done 29.
  # Layer 2: r0 sends 16->20, done 32; r1 ready max(25,20)=25, sends 25->32, done 46;
  #          r2 ready max(29,32)=32, done 50.
  finish = kvr_timeline([0, 0, 0], [16, 21, 18], [4, 7], num_layers=2)
  assert finish == [32, 46, 50]


def test_kvr_timeline_one_slow_link_hand_computed():
  # As above with link 1 three times slower (hop 1 takes 20): layer 1 r2 ready 24, done 42;
  # layer 2 r1 sends at max(25, link free 24) = 25 -> 45; r2 ready 45, done 63.
  finish = kvr_timeline([0, 0, 0], [16, 21, 18], [4, 20], num_layers=2)
  assert finish == [32, 46, 63]


def test_kvr_timeline_qkv_overlaps_waiting():
  # A receiver computes its own qkv while the prefix is in flight: waiting costs max, not sum.
  assert kvr_timeline([3, 3], [1, 1], [5], num_layers=1) == [4, 9]


def test_kvr_timeline_diagonal_fills_the_wait():
  # Rank 1 attends its own chunk (4 units) while hop 0 (qkv 3 + 5 -> arrives at 8) is in
  # flight: done at 8 + 1, as if the diagonal were free; a diagonal of 6 ends at 9 > 8.
  assert kvr_timeline([3, 3], [1, 1], [5], 1, diagonal=[0, 4]) == [4, 9]
  assert kvr_timeline([3, 3], [1, 1], [5], 1, diagonal=[0, 6]) == [4, 10]
  # A forwarding rank sends only after its diagonal (the program's order): rank 1's
  # diagonal ends at 3 + 6 = 9 > hop 0's arrival at 8, so hop 1 runs 9 -> 14.
  finish = kvr_timeline([3, 3, 3], [1, 1, 1], [5, 5], 1, diagonal=[0, 6, 0])
  assert finish == [4, 10, 15]


def test_kvr_timeline_held_send_hand_computed():
  # A rendezvous hop (gloo): it starts when both ends reach it and holds its sender until it
  # lands. qkv 3 each, hop 5: 3 -> 8, both resume at 8 and finish at 9 (async: rank 0 at 4).
  assert kvr_timeline([3, 3], [1, 1], [5], 1, held_send=True) == [9, 9]
  # A diagonal longer than the sender's qkv now delays the sender: hop 7 -> 12, both 13.
  assert kvr_timeline([3, 3], [1, 1], [5], 1, [0, 4], held_send=True) == [13, 13]
  # Two layers, rank 1's attention 2: layer 0 ends at 9 and 10; layer 1: rank 0 ready to send
  # at 12, rank 1 at 13: hop 13 -> 18, done 19 and 20.
  assert kvr_timeline([3, 3], [1, 2], [5], 2, held_send=True) == [19, 20]


@pytest.mark.parametrize("window", [None, 300])
def test_kvr_diagonal_and_prefix_add_up_to_the_ranks_attention(window):
  """With a flash kernel rank i > 0's attention is split into its diagonal and its prefix;
  their FLOPs add up to the whole rank's (no work lost or counted twice), and the first
  rank keeps its whole attention."""
  config = dataclasses.replace(preset_config("llama-2-7b"), sliding_window=window)
  chunks = (1000, 700, 500)
  flash = presets.make_setup("a100-80gb", "300GBps", dtype_bytes=2, scores_in_memory=False)
  flash = dataclasses.replace(flash, causal_skip=True)
  dense = dataclasses.replace(flash, scores_in_memory=True)
  assert flash.diagonal_first and not dense.diagonal_first
  split = [rank.phases for rank in runahead.layer_work(config, chunks, flash)[0]]
  whole_setup = dataclasses.replace(flash, causal_skip=False)
  whole = [rank.phases for rank in runahead.layer_work(config, chunks, whole_setup)[0]]
  assert "diagonal" not in split[0]
  starts, ends = (0, 1000, 1700), (1000, 1700, 2200)
  keys = [e - window_start(s, window) for s, e in zip(starts, ends, strict=True)]
  skipping = [
    costmodel.phase_work(config, c, k, 1, 2, scores_in_memory=False, causal_skip=True)
    for c, k in zip(chunks, keys, strict=True)
  ]
  for i in (1, 2):
    total = split[i]["diagonal"].flops + split[i]["attention"].flops
    assert total == pytest.approx(skipping[i]["attention"].flops)
    assert split[i]["attention"].flops < whole[i]["attention"].flops


def test_a_collective_waits_for_the_last_rank_every_layer():
  # Rank 0's qkv takes 2, rank 1's 5: the all-gather (3) starts at 5 on both, then 1 and 4 of
  # work: layer 0 ends at 9 and 12; layer 1's barrier waits for rank 1 again: 12 + 5 = 17,
  # 20, then 21 and 24.
  def rank(qkv, after):
    return (
      costmodel.Compute("qkv", qkv),
      costmodel.Collective("allgather", 3.0),
      costmodel.Compute("rest", after),
    )

  layer = costmodel.ModelledLayer((rank(2.0, 1.0), rank(5.0, 4.0)), (1, 1), (0, 0), (0, 0))
  intervals = []
  assert costmodel.layer_timeline(layer, 2, intervals=intervals) == [21.0, 24.0]
  gathers = sorted((r, ly, s, e) for r, ly, ph, s, e in intervals if ph == "allgather")
  assert gathers == [(0, 0, 5, 8), (0, 1, 17, 20), (1, 0, 5, 8), (1, 1, 17, 20)]


def test_a_layer_whose_ranks_wait_on_each_other_is_refused():
  waits_forever = (costmodel.Receive(1), costmodel.Send(1, 1.0, "hop0"))
  also = (costmodel.Receive(0), costmodel.Send(0, 1.0, "hop1"))
  layer = costmodel.ModelledLayer((waits_forever, also), (1, 1), (0, 0), (0, 0))
  with pytest.raises(ValueError, match=r"deadlocks: ranks \[0, 1\]"):
    costmodel.layer_timeline(layer, 1)


@pytest.mark.parametrize("held_send", [False, True])
def test_the_generic_timeline_runs_the_hop_chain_as_its_recurrence(held_send):
  """KV-Runahead's steps through the generic timeline end each rank where the hand-written
  recurrence does, on random phase times, hops and diagonals; the intervals' last "rest"
  ends there too."""
  rng = np.random.RandomState(7)
  for _ in range(200):
    p, L = rng.randint(1, 6), rng.randint(1, 4)
    qkv, after = list(rng.rand(p)), list(rng.rand(p))
    diagonal = list(rng.rand(p) * (rng.rand(p) < 0.5))
    hops = list(rng.rand(p - 1) * 3)
    intervals = []
    generic = kvr_timeline(qkv, after, hops, L, diagonal, held_send, intervals)
    oracle = reference_hop_chain(qkv, after, hops, L, diagonal, held_send)
    np.testing.assert_allclose(generic, oracle, rtol=1e-12)
    ends = [max(e for r, _, ph, _, e in intervals if r == i and ph == "rest") for i in range(p)]
    np.testing.assert_allclose(ends, oracle, rtol=1e-12)


def test_peers_move_their_cache_and_held_ring_steps_take_turns():
  """The peers' cache="last" pays the move of p-1 ranks' parts (KVR's last rank holds its
  cache from the hops); with held sends a ring step's compute and its message add up instead
  of overlapping: (L-1) (p-1) min(step, message) more (the last layer gathers instead)."""
  config, p, C = preset_config("bench-llama"), 2, 8192
  base = presets.make_setup("a100-80gb", "10GBps", dtype_bytes=2, scores_in_memory=False)
  base = dataclasses.replace(base, causal_skip=True)
  L, links = config.num_layers, base.links
  head = costmodel.head_work(config, 1, 2).time(base.hardware)
  message = costmodel.kv_message_bytes(config, 2 * zigzag.chunk_len(C, p), 1, 2)
  for strategy in ("ring", "allgather"):
    layer = costmodel.modelled_layer(config, strategy, C, base, p)
    steps = layer.steps
    assert steps[0] == steps[1]  # every rank alike
    per_layer = sum(step.seconds for step in steps[0])
    # The last layer: qkv and the gather of every rank's K,V into the owner (instead of
    # ring's steps and all-gather CP's all-gather, the same bytes), one row.
    last_steps = costmodel.last_layer(layer, base).steps[0]
    assert [step.phase for step in last_steps] == ["qkv", "gather"]
    assert last_steps[1].seconds == pytest.approx(message / links.bandwidth + links.latency)
    last = sum(step.seconds for step in last_steps)
    move = (p - 1) * (L * message / links.bandwidth + links.latency)
    ttft = costmodel.simulate(config, strategy, C, base, num_ranks=p).ttft
    assert ttft == pytest.approx((L - 1) * per_layer + last + move + head)
  held = dataclasses.replace(base, links=dataclasses.replace(links, held_send=True))
  c = zigzag.chunk_len(C, p)  # a step: 2c queries against c keys, all scored
  kw = dict(scores_in_memory=False, scored_keys=c)
  t_step = costmodel.phase_work(config, 2 * c, c, 1, 2, **kw)["attention"].time(base.hardware)
  t_message = message / links.bandwidth + links.latency
  ring = [costmodel.simulate(config, "ring", C, s, num_ranks=p).ttft for s in (base, held)]
  assert ring[1] - ring[0] == pytest.approx((L - 1) * (p - 1) * min(t_step, t_message))
  assert min(t_step, t_message) > 0


def test_slow_link_only_slows_its_hop():
  fast = costmodel.Links(100.0, 0.0)
  slow = fast.with_slow_link(1, 10.0)
  assert [slow.link_bandwidth(k) for k in range(3)] == [100.0, 10.0, 100.0]
  assert slow.slowest(4) == 10.0
  cfg = preset_config("tiny-llama")
  hw = costmodel.Hardware("unit", 1e12, 1e12, 1.0, 1.0)
  base = costmodel.simulate(cfg, "tsp", 64, costmodel.Setup(hw, fast, 2), num_ranks=4)
  slower = costmodel.simulate(cfg, "tsp", 64, costmodel.Setup(hw, slow, 2), num_ranks=4)
  assert slower.ttft > base.ttft  # the ring all-gather is bound by its slowest link


# --- FLOP counts against the compiled programs ------------------------------------------------


def _one_layer(name):
  """A model whose program XLA's cost analysis counts as one whole layer and the head: two
  layers, because it counts the layer loop's body once, the larger branch of its cond (a
  whole layer; the model's last layer attends one row). With one layer the loop and the cond
  fold away and the program is that last layer alone."""
  config = dataclasses.replace(preset_config(name), num_layers=2)
  return kvr_jax.Model(build_model(config)), config


@pytest.mark.default_cases("tiny-falcon")
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-falcon"])
def test_single_program_flops_match_xla(name):
  model, config = _one_layer(name)
  C = 512
  mesh = kvr_jax.make_mesh(1)
  fn = compile_by_kind("single", model.graphdef, mesh, (C,), "dense", config.kinds, False)
  by_rank = jax.NamedSharding(mesh, jax.P(AXIS))
  tokens = jax.ShapeDtypeStruct((1, 1, C), np.int32, sharding=by_rank)
  state = model.state_on(jax.NamedSharding(mesh, jax.P()))
  compiled = fn.lower(state, tokens).compile()
  measured = compiled.cost_analysis()["flops"]
  phases = costmodel.phase_work(config, C, C, batch=1, dtype_bytes=4)
  modelled = sum(w.flops for w in phases.values()) + costmodel.head_work(config, 1, 4).flops
  assert abs(measured / modelled - 1) < 0.10, (measured, modelled)


@pytest.mark.default_cases("tiny-llama")
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-falcon"])
def test_tsp_program_flops_match_xla(name):
  model, config = _one_layer(name)
  C, p = 1000, 4  # padded to 4 x 250
  mesh = kvr_jax.make_mesh(p)
  fn = compile_by_kind("tsp", model.graphdef, mesh, tsp.layout(C, p), "dense", config.kinds, False)
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  by_rank = jax.sharding.NamedSharding(mesh, jax.P(AXIS))
  tokens = jax.device_put(tsp.pad_shards(np.zeros((1, C), np.int32), p), by_rank)
  measured = fn.lower(model.state_on(replicated), tokens).compile().cost_analysis()["flops"]
  sim = costmodel.simulate(config, "tsp", C, a100(dtype_bytes=4), num_ranks=p)
  modelled = sim.rank_flops[0] + costmodel.head_work(config, 1, 4).flops
  assert abs(measured / modelled - 1) < 0.10, (measured, modelled)


def test_kvr_rank_flops_follow_the_partition():
  chunks = (400, 250, 200, 174)
  sim = costmodel.simulate(LLAMA7, "kvr", 1024, a100(), num_ranks=4, partition=chunks)
  ends = np.cumsum(chunks)
  for i in range(4):
    assert sim.rank_flops[i] == pytest.approx(
      costmodel.layer_flops(LLAMA7, chunks[i], ends[i]).total
    )


# --- sliding windows ---------------------------------------------------------------------------

MISTRAL7 = preset_config("mistral-7b")  # W = 4096


@pytest.mark.parametrize("first,T,W", [(0, 10, 4), (3, 5, 100), (50, 7, 20), (2, 30, 9), (0, 1, 1)])
def test_visible_keys_counts_by_brute_force(first, T, W):
  positions = np.arange(first, first + T)
  assert costmodel.visible_keys(first, T, W) == pytest.approx(np.minimum(positions + 1, W).mean())
  assert costmodel.visible_keys(first, T, None) == pytest.approx((positions + 1).mean())


def test_windowed_kvr_scores_and_hops_are_bounded_by_the_window():
  """With a skipping kernel the ranks together score exactly the visible entries,
  sum_q min(q+1, W), and hop k carries min(S_k, W-1) tokens' K,V, whatever the partition."""
  C, W, chunks = 16384, MISTRAL7.sliding_window, (7000, 4000, 3000, 2384)
  setup = dataclasses.replace(a100(), scores_in_memory=False, causal_skip=True)
  sim = costmodel.simulate(MISTRAL7, "kvr", C, setup, num_ranks=4, partition=chunks)
  cfg = MISTRAL7
  per_score = 4 * cfg.num_heads * cfg.head_dim  # QK^T and PV, 2 FLOPs per multiply-add
  one_token = costmodel.layer_flops(cfg, 1, 1)
  rank_non_attention = [c * (one_token.projections + one_token.mlp) for c in chunks]
  attention = sum(sim.rank_flops) - sum(rank_non_attention)
  assert attention == pytest.approx(per_score * np.minimum(np.arange(C) + 1, W).sum(), rel=1e-9)
  ends = np.cumsum(chunks)[:-1]
  token_bytes = costmodel.kv_message_bytes(cfg, 1, 1, 2)
  assert sim.link_bytes == [token_bytes * min(int(e), W - 1) for e in ends]
  unwindowed = dataclasses.replace(MISTRAL7, sliding_window=None)
  plain = costmodel.simulate(unwindowed, "kvr", C, setup, num_ranks=4, partition=chunks)
  assert plain.link_bytes == [token_bytes * int(e) for e in ends]
  assert sim.ttft < plain.ttft


def test_the_search_takes_the_window():
  """Past the window every token costs the same, so the searched split of a long prompt is
  close to even with a window and strongly uneven without (modelled, A100, flash)."""
  C, p = 32768, 4
  setup = dataclasses.replace(a100(), scores_in_memory=False, causal_skip=True)
  windowed = search.search_partition(search.modelled_objective(MISTRAL7, C, p, setup), C, p)
  unwindowed_config = dataclasses.replace(MISTRAL7, sliding_window=None)
  plain = search.search_partition(search.modelled_objective(unwindowed_config, C, p, setup), C, p)
  assert max(windowed) / min(windowed) < 1.2 < max(plain) / min(plain), (windowed, plain)


# --- partition methods ------------------------------------------------------------------------


def _brute_force(objective, C, p):
  best = None
  for bounds in itertools.combinations(range(1, C), p - 1):
    chunks = tuple(np.diff((0, *bounds, C)))
    value = objective(chunks)
    if best is None or value < best[0]:
      best = (value, chunks)
  return best


@pytest.mark.parametrize(
  "model,C,p,links",
  [
    ("llama-2-7b", 24, 3, "300GBps"),
    ("llama-2-7b", 16, 4, "10GBps"),
    ("falcon-7b", 20, 4, "300GBps"),
    ("tiny-llama", 30, 3, "10GBps"),
  ],
)
def test_search_finds_the_brute_force_optimum(model, C, p, links):
  config = preset_config(model)
  objective = search.modelled_objective(config, C, p, a100(links))
  found = search.search_partition(objective, C, p)
  best_value, best_chunks = _brute_force(objective, C, p)
  assert objective(found) == pytest.approx(best_value, rel=1e-12), (found, best_chunks)


@pytest.mark.parametrize("held_send", [False, True])
def test_the_timeline_ends_at_a_steady_state_with_the_full_runs_result(monkeypatch, held_send):
  """Once a layer advances every clock alike, layer_timeline adds that advance per layer left
  instead of running them: the same TTFT as running every layer (intervals=[] runs them
  all), within 1e-9, for every strategy, uneven splits, slow links, and a model whose
  layers differ (gemma-3: per-layer windows); and a 32-layer model stops early."""
  full_gemma = preset_config("gemma-3-12b")
  gemma = dataclasses.replace(
    full_gemma, num_layers=12, layer_windows=full_gemma.layer_windows[:12]
  )
  rng = np.random.RandomState(0)
  layer_runs = []
  real_run_layer = layer_timeline._run_layer
  monkeypatch.setattr(
    layer_timeline, "_run_layer", lambda *a: layer_runs.append(a[4]) or real_run_layer(*a)
  )
  for config, links, p in itertools.product(
    (LLAMA7, MISTRAL7, gemma), ("300GBps", "10GBps"), (2, 5)
  ):
    setup = a100(links)
    setup = dataclasses.replace(setup, links=dataclasses.replace(setup.links, held_send=held_send))
    C = 8192
    for strategy in ("kvr", "ring", "allgather", "tsp"):
      partition = None
      if strategy == "kvr":
        bounds = np.sort(rng.choice(np.arange(1, C), p - 1, replace=False))
        partition = tuple(int(c) for c in np.diff((0, *bounds, C)))
      run = dict(num_ranks=p, partition=partition)
      layer_runs.clear()
      fast = costmodel.simulate(config, strategy, C, setup, **run)
      fast_layers = len(layer_runs)
      every = costmodel.simulate(config, strategy, C, setup, **run, intervals=[])
      assert len(layer_runs) - fast_layers == config.num_layers
      assert fast.ttft == pytest.approx(every.ttft, rel=1e-9), (config.architecture, strategy)
      assert fast.rank_finish == pytest.approx(every.rank_finish, rel=1e-9)
      if config is LLAMA7 and strategy == "kvr":
        assert fast_layers < config.num_layers // 2  # the 32 layers stop early


def test_the_timeline_runs_on_while_a_waiting_rank_is_still_catching_up():
  """Rank 1 reaches its receive 0.9 s after the message lands, but is 0.1 s per layer
  faster than rank 0, so the message catches up with it at layer 9: every clock advances
  alike in layers 1 and 2 (3.0, 2.9, 3.0 s), yet the receive's gap shrinks, so the timeline
  may not skip ahead there: skipping would end rank 1 at 58.0 s (20 layers of 2.9 s, never
  waiting), before the time it ends having waited."""
  from kvr_jax.runtime.roofline import Compute, ModelledLayer, Receive, Send

  rank0 = (Compute("qkv", 1.0), Send(1, 0.1, "hop0"), Compute("rest", 2.0))
  rank1 = (Compute("qkv", 2.0), Receive(0), Compute("rest", 0.9))
  layer = ModelledLayer((rank0, rank1), (1, 1), (0.0, 0.0), (0.0, 0.0), (0.0,))
  every_layer = costmodel.layer_timeline(layer, 20, intervals=[])
  assert costmodel.layer_timeline(layer, 20) == pytest.approx(every_layer, rel=1e-12)
  assert every_layer[1] > 20 * 2.9 + 0.5  # it did wait in the late layers


def _noisy_compare(objective, noise: float, calls: list):
  """A compare whose measurements tell two points apart only when their values differ by
  more than `noise` (what an interval verdict does with samples of that spread)."""

  def compare(best, candidates):
    calls.append((best, list(candidates)))
    verdicts = []
    for chunks in candidates:
      gap = objective(chunks) - objective(best)
      verdict = "ahead" if gap < -noise else "behind" if gap > noise else "tie"
      verdicts.append((verdict, objective(chunks)))
    return verdicts

  return compare


def test_the_descent_halves_its_step_only_past_points_shown_slower():
  """No noise, the minimum at 700 of 1024 on two ranks, steps of 256 down to 16: worked by
  hand, the descent moves 512 -> 768 (shown faster), has no new neighbour there (1024 leaves
  rank 1 nothing, 512 was left), halves to 640, 704 and, both neighbours of 704 shown slower
  at 32 and at 16, ends at 704: the grid point nearest 700. Five comparisons."""
  calls = []
  compare = _noisy_compare(lambda chunks: abs(chunks[0] - 700), 0.0, calls)
  found = search.descend_by_comparison(compare, 1024, 2, multiple=16)
  assert found == (704, 320)
  assert [best for best, _ in calls] == [(512, 512), (768, 256), (640, 384), (704, 320), (704, 320)]
  assert calls[-1][1] == [(688, 336), (720, 304)]


def test_the_descent_ends_where_the_measurements_cannot_tell_neighbours_apart():
  """The same minimum, measurements that cannot tell 50 apart: 768 is shown faster than 512
  (68 against 188), but 640 (60) ties with 768, so no smaller step is tried: it would move the
  time less than the measurements can see. Two comparisons, where search_partition's grid on
  the same values takes every step size down to 16."""
  calls = []
  compare = _noisy_compare(lambda chunks: abs(chunks[0] - 700), 50.0, calls)
  assert search.descend_by_comparison(compare, 1024, 2, multiple=16) == (768, 256)
  assert len(calls) == 2
  # A start is taken as given (the modelled split), and a cap bounds every neighbour.
  calls.clear()
  found = search.descend_by_comparison(
    compare, 1024, 3, multiple=16, start=(500, 300, 224), max_chunk=512, first_step=64
  )
  assert calls[0][0] == (496, 304, 224)
  assert all(max(c) <= 512 for _, candidates in calls for c in candidates) and max(found) <= 512


def test_the_search_takes_improvements_as_it_meets_them():
  """16 ranks, a 10 GB/s link: the modelled best drains rank after rank to a few tokens, a
  long walk from the balanced start. Taking each improving transfer as the sweep meets it,
  and repeating it while it improves, walks there in under 3500 evaluations (the best-of-
  each-sweep engine it replaced took 13,635, 4.6 s); the end is still a point no transfer
  of one token improves."""
  C, p = 4096, 16
  setup = presets.make_setup("a100-80gb", "10GBps", dtype_bytes=2)
  config = preset_config("tiny-llama")
  objective = search.modelled_objective(config, C, p, setup)
  evaluated = []

  def counted(chunks):
    evaluated.append(chunks)
    return objective(chunks)

  start = search.balanced_partition(config, C, p, setup)
  found = search.search_partition(counted, C, p, start=start)
  assert len(evaluated) < 3500, len(evaluated)
  assert objective(found) < objective(start)
  for donor, taker in itertools.permutations(range(p), 2):
    moved = list(found)
    moved[donor] -= 1
    moved[taker] += 1
    if moved[donor] >= 1:
      assert objective(tuple(moved)) >= objective(found), (donor, taker)


def test_an_improving_transfer_is_repeated_before_the_sweep_goes_on():
  """The line search: right after a transfer improves, the same transfer is tried again
  from the new point (a far best is walked to, not re-swept to, token by token)."""
  target = (700, 200, 124)
  evaluated = []

  def distance(chunks):
    return sum(abs(c - t) for c, t in zip(chunks, target, strict=True))

  def objective(chunks):
    evaluated.append(chunks)
    return distance(chunks)

  assert search.search_partition(objective, 1024, 3) == target
  best, repeats = evaluated[0], 0
  for i, chunks in enumerate(evaluated[1:-1], start=1):
    if distance(chunks) < distance(best):
      again = tuple(int(c) for c in np.add(chunks, np.subtract(chunks, best)))
      # evaluated next, unless already evaluated (memoised) or past a chunk's bounds
      assert again in evaluated[: i + 2] or min(again) < 1, (chunks, again, evaluated[i + 1])
      best, repeats = chunks, repeats + 1
  assert repeats >= 3


def test_search_respects_a_multiple():
  objective = search.modelled_objective(LLAMA7, 4100, 4, a100())
  chunks = search.search_partition(objective, 4100, 4, multiple=128)
  assert sum(chunks) == 4100 and all(c % 128 == 0 for c in chunks[:-1])


def test_a_search_started_near_its_best_skips_the_coarse_steps():
  """`first_step`: a grid started next to the best point (the measured search starts from
  the modelled split) takes no step of C/2p tokens: it finds the same best and evaluates
  fewer partitions (each one a compile and four prefills when measured), none further from
  its start than its steps add up to."""
  best, start = (5056, 3136), (5120, 3072)

  def searched(**kwargs):
    seen = []

    def objective(chunks):
      seen.append(chunks)
      return abs(chunks[0] - best[0]) + 0.5 * abs(chunks[1] - best[1])

    return search.search_partition(objective, 8192, 2, multiple=64, **kwargs), seen

  coarse, coarse_seen = searched()
  near, near_seen = searched(start=start, first_step=256)
  assert coarse == near == best
  assert len(near_seen) < len(coarse_seen), (near_seen, coarse_seen)
  # Besides the even split (every search weighs it as a start), 256 + 128 + 64 at most.
  moved = [c for c in near_seen if c != (4096, 4096)]
  assert max(abs(c[0] - start[0]) for c in moved) < 2 * 256, moved
  assert max(abs(c[0] - 4096) for c in coarse_seen) >= 2048  # the C/2p step, from even


@pytest.mark.default_cases(
  "search-5",
  "search-9",
  "search-17",
  "search-1000",
  "balanced-5",
  "balanced-9",
  "balanced-17",
  "balanced-64",
  "balanced-1000",
  "predict-5",
  "predict-9",
  "predict-17",
  "predict-64",
  "predict-1000",
  "even-5",
  "even-9",
  "even-17",
  "even-64",
  "even-1000",
)
@pytest.mark.parametrize("C", [5, 9, 17, 64, 1000])
@pytest.mark.parametrize("method", ["search", "balanced", "predict", "even"])
def test_every_partition_is_valid(C, method):
  # p close to C where C is small; a long prompt with the usual rank counts.
  ranks = {1, 2, 3, min(8, C), C - 1, C} if C <= 64 else {1, 2, 3, 8}
  for p in sorted(ranks - {0}):
    plan = PartitionPlan(method, hardware="a100-80gb", links="10GBps", table_model="llama-2-7b")
    if method == "predict" and p not in tables.TABLE_RANKS:
      continue
    chunks = resolve_partition(plan, C, p, config=LLAMA7, dtype_bytes=2)
    assert len(chunks) == p and sum(chunks) == C and min(chunks) >= 1, (method, C, p, chunks)


@pytest.mark.parametrize("method", ["balanced", "search"])
def test_max_chunk_caps_the_longest_chunk(method):
  """A per-device memory cap: the uncapped balanced split gives rank 0 far more than C/p at
  32k tokens on 8 ranks; capped, no chunk exceeds the cap and the split is still valid."""
  C, p = 32768, 8
  plan = PartitionPlan(method, hardware="a100-80gb", links="300GBps", multiple=64)
  free = resolve_partition(plan, C, p, config=LLAMA7, dtype_bytes=2)
  cap = 5000
  assert max(free) > cap  # the cap binds
  capped = resolve_partition(
    dataclasses.replace(plan, max_chunk=cap), C, p, config=LLAMA7, dtype_bytes=2
  )
  assert sum(capped) == C and len(capped) == p and max(capped) <= cap, capped
  assert capped != free


def test_max_chunk_refused_when_nothing_fits():
  plan = PartitionPlan("balanced", hardware="a100-80gb", links="300GBps", max_chunk=4095)
  with pytest.raises(ValueError, match=r"max_chunk=4095 is below ceil\(C/p\) = 4096"):
    resolve_partition(plan, 32768, 8, config=LLAMA7)
  with pytest.raises(ValueError, match="`max_chunk` must be a positive integer"):
    PartitionPlan("balanced", max_chunk=0)
  predict = PartitionPlan("predict", hardware="a100-80gb", links="10GBps", max_chunk=4096)
  with pytest.raises(ValueError, match="above max_chunk=4096"):
    resolve_partition(predict, 32768, 8, config=LLAMA7, model_name="llama-2-7b")


def test_predict_is_exact_at_table_points():
  for path in sorted(__import__("glob").glob(f"{tables.PARTITION_DIR}/*.json")):
    with open(path) as f:
      table = json.load(f)
    for entry in table["entries"]:
      assert tables.predict_partition(table, entry["context_len"]) == tuple(entry["partition"])


def test_predict_interpolates_fractions_between_entries():
  table = {
    "num_ranks": 2,
    "entries": [
      {"context_len": 100, "partition": [60, 40]},
      {"context_len": 300, "partition": [150, 150]},
    ],
  }
  # Halfway (C=200): boundary fraction (0.6 + 0.5) / 2 = 0.55 -> 110.
  assert tables.predict_partition(table, 200) == (110, 90)
  # Outside the range: the nearest entry's fractions (clamped).
  assert tables.predict_partition(table, 1000) == (500, 500)
  assert tables.predict_partition(table, 50) == (30, 20)


def test_shipped_tables_are_current():
  """The committed tables equal a fresh search (so the regeneration command is the truth)."""
  table = tables.build_table("falcon-7b", "a100-80gb", "300GBps", 4, context_lens=(1024, 16384))
  with open(tables.table_path("falcon-7b", "a100-80gb", "300GBps", 4)) as f:
    shipped = {e["context_len"]: e["partition"] for e in json.load(f)["entries"]}
  for entry in table["entries"]:
    assert shipped[entry["context_len"]] == entry["partition"]


def test_a_failed_table_write_keeps_the_old_table(tmp_path):
  """Tables (like the calibration and measured searches) are replaced whole or not at all."""
  table = {"model": "m", "hardware": "h", "links": "l", "num_ranks": 2, "entries": [1]}
  path = tables.write_table(table, str(tmp_path))
  with pytest.raises(TypeError):
    tables.write_table({**table, "entries": [object()]}, str(tmp_path))
  with open(path) as f:
    assert json.load(f) == table
  assert sorted(p.name for p in tmp_path.iterdir()) == [os.path.basename(path)]


def test_balanced_comes_close_to_search_at_high_bandwidth():
  for C in (2048, 8192):
    objective = search.modelled_objective(LLAMA7, C, 8, a100("300GBps"))
    balanced = search.balanced_partition(LLAMA7, C, 8, a100("300GBps"))
    searched = search.search_partition(objective, C, 8, start=balanced)
    assert objective(balanced) <= 1.02 * objective(searched)


def test_local_calibration_measures_positive_numbers():
  hw, links = presets.hardware_preset("local"), presets.links_preset("local")
  assert hw.flops > 1e8 and hw.bandwidth > 1e8
  assert links.bandwidth > 1e6 and links.latency > 0
  # The chunked linear-attention rule is measured too, and is no faster than a large matmul.
  assert 0 < hw.linear_rule_flops <= 1.5 * hw.flops


@pytest.mark.parametrize(
  "edit",
  [
    lambda c: c["hardware"].update(peak_flops=0),
    lambda c: c["hardware"].update(memory_bandwidth=float("nan")),
    lambda c: c["links"].update(bandwidth=-1.0),
    lambda c: c["hardware"].update(linear_rule_fraction=0.0),
    lambda c: c["hardware"].update(fused_attention_fraction=0.0),
  ],
)
def test_a_calibration_file_with_nonsense_figures_counts_as_absent(tmp_path, edit):
  """Valid JSON with a zero or NaN rate is measured again, never divided by."""
  hw, links = presets.hardware_preset("local"), presets.links_preset("local")
  good = {"hardware": dataclasses.asdict(hw), "links": dataclasses.asdict(links)}
  path = tmp_path / "calibration.json"
  path.write_text(json.dumps(good))
  assert presets._read(str(path)) == (hw, links)
  edit(good)
  path.write_text(json.dumps(good))
  assert presets._read(str(path)) is None


@pytest.fixture
def no_compilation_cache():
  """The test run's own compilation cache (conftest.py) off for one test, then back."""
  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", None)
  yield
  jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.parametrize("unusable", ["file", "/proc/self/kvr"])
def test_an_unusable_cache_directory_degrades_to_not_caching(
  tmp_path, monkeypatch, unusable, no_compilation_cache
):
  """A file, or a directory that cannot be created: a warning saying why, then every cache
  measures again (calibration not stored, no local tables, no compilation cache)."""
  from kvr_jax.core import resources
  from kvr_jax.runtime import compilation

  (tmp_path / "file").write_text("x")
  path = str(tmp_path / "file") if unusable == "file" else unusable
  monkeypatch.setenv("KVR_JAX_CACHE_DIR", path)
  why = "is a file" if unusable == "file" else "cannot be created"
  with pytest.warns(resources.CacheDirWarning, match=f"kvr-jax cache directory .* {why}"):
    assert resources.cache_dir() is None
  with pytest.warns(resources.CacheDirWarning):
    assert tables.local_partition_dir() is None
  with pytest.warns(resources.CacheDirWarning):
    assert compilation.enable() is None
  assert not compilation.enabled()
  # The calibration is measured (here: stubbed) and returned, never written.
  figures = (presets.hardware_preset("a100-80gb"), presets.links_preset("300GBps"))
  monkeypatch.setattr(presets, "measure_hardware", lambda: figures[0])
  monkeypatch.setattr(presets, "measure_links", lambda hardware: figures[1])
  presets.local_calibration.cache_clear()
  try:
    with pytest.warns(resources.CacheDirWarning):
      assert presets.local_calibration() == figures
  finally:
    presets.local_calibration.cache_clear()
  assert (tmp_path / "file").read_text() == "x"
  with pytest.raises(ValueError, match="no partition table .* the kvr-jax cache directory"):
    with pytest.warns(resources.CacheDirWarning):
      tables.load_table("tiny-llama", "local", "local", 2)


def test_a_table_built_on_this_machine_answers_before_the_shipped_one(tmp_path, monkeypatch):
  monkeypatch.setenv("KVR_JAX_CACHE_DIR", str(tmp_path))
  shipped = tables.load_table("falcon-7b", "a100-80gb", "300GBps", 2)
  mine = dict(shipped, entries=[{"context_len": 1024, "partition": [600, 424]}])
  tables.write_table(mine, tables.local_partition_dir())
  assert tables.load_table("falcon-7b", "a100-80gb", "300GBps", 2)["entries"] == mine["entries"]


# --- bad input --------------------------------------------------------------------------------


def test_bad_inputs(tmp_path):
  with pytest.raises(ValueError, match="p=9 ranks but only C=8"):
    costmodel.simulate(LLAMA7, "tsp", 8, a100(), num_ranks=9)
  with pytest.raises(ValueError, match="p=9 ranks but only C=8"):
    search.search_partition(lambda c: 0.0, 8, 9)
  with pytest.raises(ValueError, match="unknown hardware preset 'v100'"):
    presets.make_setup("v100", "300GBps", dtype_bytes=2)
  with pytest.raises(ValueError, match="unknown link preset"):
    presets.make_setup("a100-80gb", "1GBps", dtype_bytes=2)
  with pytest.raises(ValueError, match="no partition table for model='llama-3-8b'"):
    tables.load_table("llama-3-8b", "a100-80gb", "300GBps", 4)
  wrong = tables.table_path("falcon-7b", "a100-80gb", "300GBps", 4, str(tmp_path))
  with open(tables.table_path("llama-2-7b", "a100-80gb", "300GBps", 4)) as f:
    table = json.load(f)
  with open(wrong, "w") as f:
    json.dump(table, f)  # a llama table filed under falcon's name
  with pytest.raises(ValueError, match="table is for model='llama-2-7b'"):
    tables.load_table("falcon-7b", "a100-80gb", "300GBps", 4, str(tmp_path))
  with open(wrong, "w") as f:
    f.write("{not json")
  with pytest.raises(ValueError, match="corrupt partition table"):
    tables.load_table("falcon-7b", "a100-80gb", "300GBps", 4, str(tmp_path))
  # Valid JSON, right keys, but an entry that is no partition of its length.
  table = {**table, "model": "falcon-7b"}
  table["entries"] = [dict(table["entries"][0])]
  table["entries"][0]["partition"] = [c + 1 for c in table["entries"][0]["partition"]]
  with open(wrong, "w") as f:
    json.dump(table, f)
  with pytest.raises(ValueError, match="chunks must be positive integers summing to"):
    tables.load_table("falcon-7b", "a100-80gb", "300GBps", 4, str(tmp_path))
  with pytest.raises(ValueError, match="unknown partition method"):
    PartitionPlan("fastest")
  with pytest.raises(ValueError, match="needs a table"):
    resolve_partition("predict", 64, 2, config=LLAMA7)


def test_the_search_models_the_kernel_that_runs():
  """flash writes no scores and skips a rank's masked future: modelled attention work of c
  queries at the end of an S-key prefix is c * (S - (c-1)/2), and no score traffic."""
  cfg = unit_config()
  dense = costmodel.phase_work(cfg, 4, 9, 1, 1)["attention"]
  flash = costmodel.phase_work(cfg, 4, 9, 1, 1, scores_in_memory=False, causal_skip=True)[
    "attention"
  ]
  assert flash.flops / dense.flops == pytest.approx((9 - 1.5) / 9)
  assert dense.bytes - flash.bytes == 4 * 1 * 1 * 4 * 9  # the score traffic, gone
  # A later rank's attention is cheaper under flash, so the search gives it more tokens.
  dense_setup = presets.make_setup("a100-80gb", "300GBps", dtype_bytes=2)
  flash_setup = presets.make_setup(
    "a100-80gb", "300GBps", dtype_bytes=2, scores_in_memory=False, causal_skip=True
  )
  chunks_dense = search.balanced_partition(LLAMA7, 8192, 4, dense_setup)
  chunks_flash = search.balanced_partition(LLAMA7, 8192, 4, flash_setup)
  assert chunks_flash[-1] > chunks_dense[-1] and sum(chunks_flash) == 8192


# --- tensor parallelism inside a rank (a ranks x model mesh) ----------------------------------

LLAMA70 = preset_config("llama-3.1-70b")  # 64 heads, 8 KV heads, F 28672, V 128256


def tp_setup(model_parallel, model_links=None, links=None, **kw):
  """H100, bf16, flash; free links unless given (bandwidth 1e30 B/s, no latency)."""
  free = costmodel.Links(1e30, 0.0)
  return costmodel.Setup(
    presets.hardware_preset("h100-sxm"),
    links or free,
    dtype_bytes=2,
    scores_in_memory=False,
    causal_skip=True,
    model_parallel=model_parallel,
    model_links=model_links or free,
    **kw,
  )


def test_model_shard_splits_heads_columns_vocab_and_replicates_kv():
  shard = costmodel.model_shard(LLAMA70, 4)
  assert (shard.num_heads, shard.num_kv_heads, shard.mlp_dim, shard.vocab_size) == (
    16,
    2,
    7168,
    32064,
  )
  assert shard.d_model == LLAMA70.d_model and shard.num_layers == LLAMA70.num_layers
  # 16 shards, 8 KV heads: one head on each shard (each replicated twice), V/16 rounded up.
  shard = costmodel.model_shard(LLAMA70, 16)
  assert (shard.num_heads, shard.num_kv_heads, shard.mlp_dim, shard.vocab_size) == (
    4,
    1,
    1792,
    8016,
  )
  assert costmodel.model_shard(LLAMA70, 1) is LLAMA70
  for bad in (3, 128):  # 3 divides nothing; 128 shards of 64 heads
    with pytest.raises(ValueError, match=f"model_parallel={bad} must divide num_heads"):
      costmodel.model_shard(LLAMA70, bad)


def test_model_reduce_time_hand_computed():
  """unit_config with d_model 2, batch 3, 2-byte values, 10 tokens: [3, 10, 2] partial sums of
  120 bytes; over 4 shards a ring all-reduce moves 2*3/4*120 = 180 bytes at 1000 B/s (0.18 s)
  in 6 steps of 0.01 s latency (0.06 s): 0.24 s per all-reduce, two per Llama layer, one per
  Falcon layer (its attention and MLP outputs add up before the one reduction)."""
  config = unit_config()
  setup = dataclasses.replace(
    tp_setup(4, model_links=costmodel.Links(1000.0, 0.01)), batch=3, dtype_bytes=2
  )
  assert costmodel.model_reduce_time(config, 10, setup) == pytest.approx(0.48)
  shared = dataclasses.fields(ModelConfig)  # the fields every architecture has
  falcon = FalconConfig(**{f.name: getattr(config, f.name) for f in shared})
  assert costmodel.model_reduce_time(falcon, 10, setup) == pytest.approx(0.24)
  assert costmodel.model_reduce_time(config, 10, dataclasses.replace(setup, model_parallel=1)) == 0


@pytest.mark.parametrize("strategy", ["single", "tsp", "kvr", "ring", "allgather"])
def test_tensor_parallel_divides_the_work_and_adds_the_reductions(strategy):
  """70B at 8192 tokens is compute-bound in every phase (and memory-bound only in the head,
  whose bytes split the same way): with free links, 4 shards per rank take exactly 1/4 of the
  time. With real links between the shards, each layer adds exactly its reductions."""
  C, p = 8192, 1 if strategy == "single" else 2
  kw = dict(num_ranks=p, partition=(4608, 3584) if strategy == "kvr" else None)

  def ttft(setup):
    return costmodel.simulate(LLAMA70, strategy, C, setup, **kw).ttft

  assert ttft(tp_setup(4)) == pytest.approx(ttft(tp_setup(1)) / 4, rel=1e-9)
  slow = costmodel.Links(100e9, 5e-6)
  added = ttft(tp_setup(4, model_links=slow)) - ttft(tp_setup(4))
  tokens = {"single": C, "tsp": C // p, "kvr": 4608, "ring": C // p, "allgather": C // p}
  # KVR: the last rank finishes last, but its layers wait on rank 0's (the hop): rank 0's
  # longer chunk paces every layer. The model's last layer finishes one row (no reduction
  # modelled): every strategy adds L - 1 layers' reductions.
  setup = tp_setup(4, model_links=slow)
  per_layer = costmodel.model_reduce_time(LLAMA70, tokens[strategy], setup)
  assert added == pytest.approx((LLAMA70.num_layers - 1) * per_layer, rel=1e-6)


def test_each_shard_sends_its_own_kv_heads():
  """A hop carries each shard's KV heads (K/m of them), all shards at once: 8 KV heads over 4
  shards, a quarter of the bytes per link; over 16, one (replicated) head each: an eighth."""
  chunks = (4608, 3584)

  def hop_bytes(m):
    sim = costmodel.simulate(LLAMA70, "kvr", 8192, tp_setup(m), num_ranks=2, partition=chunks)
    return sim.link_bytes[0]

  assert hop_bytes(1) == costmodel.kv_message_bytes(LLAMA70, 4608, 1, 2)
  assert hop_bytes(4) * 4 == hop_bytes(1)
  assert hop_bytes(16) * 8 == hop_bytes(1)


def test_cluster_links_cross_nodes_where_ranks_do():
  """Nodes of 8 devices, rank-major: ranks of 4 devices cross a node boundary between ranks 1
  and 2 (link 1); single devices between 7 and 8; a model group of 16 spans two nodes and
  all-reduces over all 8 NICs of a node at once (min(400, 8 * 25) = 200 GB/s)."""
  kw = dict(devices_per_node=8, inside=400e9, between=25e9)
  ranks, model = presets.cluster_links(4, 4, **kw)
  assert ranks.slow == ((1, 25e9),) and ranks.bandwidth == 400e9 and model.bandwidth == 400e9
  ranks, _ = presets.cluster_links(16, 1, **kw)
  assert ranks.slow == ((7, 25e9),) and ranks.link_bandwidth(6) == 400e9
  ranks, model = presets.cluster_links(1, 16, **kw)
  assert ranks.slow == () and model.bandwidth == 200e9
  ranks, _ = presets.cluster_links(2, 8, **kw)  # every shard of rank 0 sends to the other node
  assert ranks.slow == ((0, 25e9),)
  with pytest.raises(ValueError, match="model_parallel=3 must divide devices_per_node=8"):
    presets.cluster_links(2, 3, **kw)


def test_device_memory_hand_computed():
  """70B over 2 shards, bf16, 32768 tokens: half of every weight (num_params * 2 bytes / 2)
  and 4 of the 8 KV heads of every layer's cache: 2 (K, V) * 32768 * 4 * 128 * 2 bytes * 80."""
  setup = tp_setup(2)
  cache = 2 * 32768 * 4 * 128 * 2 * 80
  expected = LLAMA70.num_params() + cache
  assert costmodel.device_memory(LLAMA70, 32768, setup) == expected
  assert (
    expected
    > 0.9 * setup.hardware.memory_bytes
    > costmodel.device_memory(LLAMA70, 32768, tp_setup(4))
  )


def test_setup_refuses_model_parallel_without_its_links():
  hw, links = presets.hardware_preset("h100-sxm"), costmodel.Links(1e9)
  with pytest.raises(ValueError, match="model_parallel=2 needs `model_links`"):
    costmodel.Setup(hw, links, 2, model_parallel=2)
  with pytest.raises(ValueError, match="model_parallel must be an integer >= 1"):
    costmodel.Setup(hw, links, 2, model_parallel=0)


@pytest.mark.parametrize(
  "model,links,context_len,ranks,want",
  [
    ("bench-llama", "300GBps", 8, 2, "single"),  # a short prompt: one device wins
    ("llama-2-7b", "10GBps", 2048, 8, "kvr"),  # slow links: KVR's hops hide behind compute
    ("falcon-7b", "300GBps", 1024, 2, "ring"),  # one KV head, fast links: ring by a hair
  ],
)
def test_auto_picks_what_the_model_predicts(model, links, context_len, ranks, want):
  """strategy="auto" is the lowest MODELLED TTFT of the four candidates, KV-Runahead with its
  searched split (hand-worked cases on A100 presets)."""
  from kvr_jax.planning.choice import AUTO_CANDIDATES, choose_strategy

  setup = presets.make_setup("a100-80gb", links, dtype_bytes=2, **costmodel.kernel_flags("flash"))
  choice = choose_strategy(preset_config(model), context_len, ranks, setup)
  # The candidates are the registered strategies that say so (Strategy.auto_candidate).
  assert AUTO_CANDIDATES == ("single", "kvr", "ring", "allgather")
  assert set(choice.predicted_s) == set(AUTO_CANDIDATES)
  assert choice.strategy == want == min(choice.predicted_s, key=choice.predicted_s.get)
  if want == "kvr":
    assert len(choice.chunks) == ranks and sum(choice.chunks) == context_len
  else:
    assert choice.chunks is None
  assert f"auto picked {want}" in str(choice)


def test_prefill_auto_runs_and_reports_its_choice(monkeypatch):
  """prefill(strategy="auto") runs what the model picked (here single: a tiny model on A100
  presets; then a KV-Runahead pick with its split, forced), says what it picked and refuses
  what it cannot honour, before anything compiles."""
  from kvr_jax.inference import auto as auto_module
  from kvr_jax.planning.choice import StrategyChoice

  model = kvr_jax.load_model("tiny-llama")
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, 64)
  mesh = kvr_jax.make_mesh(2)
  plan = kvr_jax.PartitionPlan("search", hardware="a100-80gb", links="300GBps")
  single = kvr_jax.prefill(model, tokens)
  got = kvr_jax.prefill(model, tokens, "auto", mesh=mesh, partition=plan)
  assert got.strategy == got.choice.strategy == "single"
  np.testing.assert_allclose(np.asarray(got.logits), np.asarray(single.logits), atol=1e-5)
  forced = StrategyChoice("kvr", (40, 24), {"single": 2.0, "kvr": 1.0, "ring": 1.5})
  monkeypatch.setattr(auto_module, "choose_strategy", lambda *a, **k: forced)
  got = kvr_jax.prefill(model, tokens, "auto", mesh=mesh, partition=plan)
  assert (got.strategy, got.partition, got.choice) == ("kvr", (40, 24), forced)
  for kwargs, message in (
    (dict(attention="dense"), "runs each strategy's own kernel"),
    (dict(partition=[40, 24]), "chooses KV-Runahead's split itself"),
  ):
    with pytest.raises(ValueError, match=message):
      kvr_jax.prefill(model, tokens, "auto", mesh=mesh, **kwargs)


def test_auto_runs_its_one_device_pick_on_the_last_rank_alone(monkeypatch):
  """auto's pick of single runs on the last rank's device (where cache="last" puts every
  strategy's cache), in that device's process alone: a process without it computes nothing
  and holds nothing (no logits, no cache, no tokens to decode)."""
  model = kvr_jax.load_model("tiny-llama")
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, 64)
  mesh = kvr_jax.make_mesh(4)
  last = mesh.devices.flat[-1]
  plan = kvr_jax.PartitionPlan("search", hardware="a100-80gb", links="300GBps")
  got = kvr_jax.prefill(model, tokens, "auto", mesh=mesh, partition=plan)
  assert got.strategy == "single" and got.device == last
  assert got.gather_cache()[0].devices() == {last}
  # The same call in a process that does not hold the last rank's device.
  monkeypatch.setattr(jax, "process_index", lambda *args: 1)
  for cache in ("last", "sharded"):
    elsewhere = kvr_jax.prefill(model, tokens, "auto", mesh=mesh, partition=plan, cache=cache)
    assert elsewhere.strategy == "single" and not elsewhere.is_local
    assert elsewhere.gather_cache() == (None, None)
    generated = kvr_jax.generate(
      model, tokens, 2, strategy="auto", mesh=mesh, partition=plan, cache=cache
    )
    assert generated.tokens is None


def test_the_command_line_comparison_runs_auto_and_says_what_it_picked():
  """launch.run --strategy=auto's library call: auto beside the strategies it picks from,
  the pick and every modelled TTFT in its report, a kernel named refused up front."""
  from kvr_jax.tools import demo

  model = kvr_jax.load_model("tiny-llama")
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, 96)
  plan = kvr_jax.PartitionPlan("search", hardware="a100-80gb", links="10GBps")
  reports = demo.compare_strategies(
    model, tokens, ["single", "auto"], num_devices=2, partition=plan, repeats=1, max_new_tokens=2
  )
  auto = reports[1]
  assert auto.strategy == "auto" and auto.choice.startswith("auto picked ")
  picked = auto.choice.split()[2]
  assert picked in ("single", "kvr", "ring", "allgather")
  assert all(f"{name} " in auto.choice for name in ("single", "kvr", "ring", "allgather"))
  assert (auto.partition is not None) == (picked == "kvr")  # kvr runs with its split
  assert auto.first_tokens == reports[0].first_tokens  # greedy decode from its cache
  assert auto.choice in demo.format_table(reports).splitlines()
  with pytest.raises(ValueError, match="strategy 'auto' runs each strategy's own kernel"):
    demo.compare_strategies(model, tokens, ["auto"], num_devices=2, attention="dense")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_the_command_line_comparison_runs_a_measured_partition_once(monkeypatch):
  """launch.run --partition=measured's library call: the measured search runs once, on the
  padded prompt's shape (a ragged batch is padded to its bucket), before any strategy; kvr
  runs its answer and shows the search in its plan time; auto and a 2-D mesh are refused up
  front, before anything is searched or compiled."""
  from kvr_jax.tools import demo

  model = kvr_jax.load_model("tiny-llama")
  rows = [np.arange(70) % 512, np.arange(90) % 512]
  plan = kvr_jax.PartitionPlan("search", objective="measured", multiple=16)
  searched = []

  def fake_search(model_, tokens, mesh, plan_):
    searched.append((tokens.shape, plan_))
    time.sleep(0.2)  # the search's time lands in kvr's plan column
    return (64, 32)

  monkeypatch.setattr(demo, "measured_partition", fake_search)
  reports = demo.compare_strategies(
    model,
    rows,
    ["single", "kvr"],
    num_devices=2,
    partition=plan,
    repeats=1,
    max_new_tokens=1,
    buckets="auto",
  )
  assert searched == [((2, 96), plan)]  # both rows in the 96-token bucket
  kvr = reports[1]
  assert kvr.partition == (64, 32) and kvr.plan_s >= 0.2 > reports[0].plan_s
  for strategies, kwargs, says in (
    (["kvr", "auto"], {}, "strategy 'auto' chooses by the cost model"),
    (["kvr"], {"num_devices": 4, "model_parallel": 2}, "1-D mesh"),
  ):
    with pytest.raises(ValueError, match=says):
      demo.compare_strategies(model, rows, strategies, partition=plan, **kwargs)
  assert len(searched) == 1


@pytest.mark.parametrize("strategy", sorted(REGISTRY))
def test_every_registered_strategy_is_modelled_by_its_own_layer(strategy):
  """simulate reads nothing but the strategy's own `modelled_layer`: its
  intervals end where simulate's TTFT says, less the cache move and the head."""
  config, C = preset_config("llama-2-7b"), 4096
  flash = costmodel.kernel_flags("flash")
  setup = presets.make_setup("a100-80gb", "10GBps", dtype_bytes=2, **flash)
  p = 1 if strategy == "single" else 3
  partition = (1800, 1300, 996) if REGISTRY[strategy].partitioned else None
  kw = dict(num_ranks=p, partition=partition)
  intervals = []
  sim = costmodel.simulate(config, strategy, C, setup, **kw, intervals=intervals)
  layer = costmodel.modelled_layer(config, strategy, C, setup, p, partition)
  assert len(layer.steps) == p and sum(layer.partition) >= C
  last_rank_end = max(e for r, *_, e in intervals if r == p - 1)
  head = costmodel.head_work(config, 1, 2).time(setup.hardware)
  assert sim.ttft == pytest.approx(last_rank_end + layer.after_layers + head)
  assert {ly for _, ly, *_ in intervals} == set(range(config.num_layers))


def test_windows_per_layer_are_modelled_layer_by_layer():
  """A model whose layers alternate full attention and a 512-token window: each layer is
  modelled with its own window, so its hops are the mean of the all-full and all-windowed
  models' (a windowed hop carries at most W-1 keys) and its TTFT lies between theirs."""
  full = dataclasses.replace(preset_config("llama-2-7b"), num_layers=4)
  windowed = full.with_window(512)
  mixed = dataclasses.replace(full, layer_windows=(None, 512, None, 512))
  assert mixed.narrowest_window == 512 and mixed.sliding_window is None
  setup = a100("10GBps")
  kw = dict(num_ranks=4, partition=(2600, 2200, 1900, 1492))
  sims = {
    name: costmodel.simulate(config, "kvr", 8192, setup, **kw)
    for name, config in (("full", full), ("windowed", windowed), ("mixed", mixed))
  }
  one_window = costmodel.kv_message_bytes(full, 511, 1, 2)
  assert max(sims["windowed"].link_bytes) == one_window
  pairs = zip(sims["full"].link_bytes, sims["windowed"].link_bytes, strict=True)
  halves = [(a + b) / 2 for a, b in pairs]
  assert sims["mixed"].link_bytes == pytest.approx(halves)
  assert sims["windowed"].ttft < sims["mixed"].ttft < sims["full"].ttft
  intervals = []
  costmodel.simulate(mixed, "kvr", 8192, setup, **kw, intervals=intervals)
  hop = {ly: e - s for r, ly, ph, s, e in intervals if (r, ph) == (0, "hop0")}
  assert hop[1] < hop[0] and hop[1] == pytest.approx(hop[3])  # layer 1 and 3 windowed


def test_the_last_layer_attends_one_row_in_every_strategy():
  """A model's last layer reads the prompt's last row alone (models.base.finish_one_row):
  every rank's attention and rest drop out of it, KV-Runahead keeps its hops (the cache needs
  the layer's K,V), ring's steps become the all-gather of the bytes they pass; the TTFT is
  (L - 1) whole layers and that last one (single: its qkv alone)."""
  config, C, setup = LLAMA7, 4096, a100()
  for strategy, p, partition in (
    ("single", 1, None),
    ("kvr", 3, (1800, 1300, 996)),
    ("ring", 2, None),
    ("allgather", 2, None),
    ("tsp", 2, None),
  ):
    layer = costmodel.modelled_layer(config, strategy, C, setup, p, partition)
    last = costmodel.last_layer(layer, setup)
    for rank_steps, whole_steps in zip(last.steps, layer.steps, strict=True):
      phases = [getattr(step, "phase", None) for step in rank_steps]
      assert not {"attention", "rest", "step"} & set(phases), (strategy, phases)
      assert phases[0] == "qkv"
      sends = [s for s in whole_steps if isinstance(s, costmodel.Send)]
      assert sends == [s for s in rank_steps if isinstance(s, costmodel.Send)]
    sim = costmodel.simulate(config, strategy, C, setup, num_ranks=p, partition=partition)
    timeline = costmodel.layer_timeline(
      [layer] * (config.num_layers - 1) + [last], config.num_layers, intervals=[]
    )
    assert sim.ttft == pytest.approx(
      timeline[-1] + layer.after_layers + costmodel.head_work(config, 1, 2).time(setup.hardware)
    )
    if strategy == "single":
      assert timeline[-1] == pytest.approx(
        (config.num_layers - 1) * sum(s.seconds for s in layer.steps[0]) + last.steps[0][0].seconds
      )
