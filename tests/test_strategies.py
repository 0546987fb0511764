"""KV-Runahead and TSP against the single-device oracle, on emulated CPU devices.

Tolerance (fixed): float32 strategies agree with `single` within 1e-5 relative to the largest
magnitude of the reference tensor (logits and every layer's K and V).
"""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvr_jax
from kvr_jax.planning import costmodel
from kvr_jax.runtime.loading import build_model, preset_config
from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies import TRACE_COUNT, runahead
from kvr_jax.strategies.by_kind import compile_by_kind
from kvr_jax.strategies.runahead import schedule
from kvr_jax.tools import measured, phases
from models.falcon import FalconConfig
from models.kernels import get_kernel
from tests.lazy import LazyDict
from tests.matrix import pairwise

REL_TOL = 1e-5
CONTEXT = 13  # not divisible by 2, 3, 4 or 8


def assert_close(got, want, what):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err <= REL_TOL, f"{what}: relative error {err:.2e} > {REL_TOL}"


def falcon_40b_form():
  config = dataclasses.replace(
    preset_config("tiny-falcon"),
    num_kv_heads=2,
    separate_mlp_norm=True,
    qkv_layout="grouped",
    num_layers=2,
  )
  assert isinstance(config, FalconConfig)
  return kvr_jax.Model(build_model(config), source="falcon-40b-form")


@pytest.fixture(scope="module")
def models():
  return {
    "tiny-llama": kvr_jax.load_model("tiny-llama"),
    "tiny-falcon": kvr_jax.load_model("tiny-falcon"),
    "falcon-40b-form": falcon_40b_form(),
  }


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  return {1: rng.randint(0, 512, (1, CONTEXT)), 3: rng.randint(0, 512, (3, CONTEXT))}


@pytest.fixture(scope="module")
def oracle(models, prompts):
  """(model name, batch) -> the one-device prefill, made when a test first asks for it."""
  return LazyDict(lambda key: kvr_jax.prefill(models[key[0]], prompts[key[1]]))


# (p, partition, batch): even and uneven splits, a one-token chunk, C not divisible by p.
CASES = [
  (1, "even", 1),
  (2, "even", 3),
  (2, [12, 1], 1),
  (3, [6, 4, 3], 3),
  (4, "even", 1),
  (4, [1, 5, 4, 3], 3),
  (8, "even", 1),
  (8, [3, 2, 2, 2, 1, 1, 1, 1], 3),
]


# The Falcon-40B form (grouped KV, two norms) on the uneven meshes of 3+ ranks only: the GQA
# families run every strategy again in tests/test_families.py.
KVR_MATRIX = [(name, *case) for name in ("tiny-llama", "tiny-falcon") for case in CASES] + [
  ("falcon-40b-form", *case) for case in CASES if case[0] >= 3 and case[1] != "even"
]


# Every pair of model, mesh, split and batch in the default tier; the product in the e2e tier.
@pytest.mark.default_cases(
  "tiny-falcon-1-even-1",
  "falcon-40b-form-3-partition16-3",
  "falcon-40b-form-8-partition18-3",
)
@pytest.mark.parametrize(
  "name,p,partition,batch",
  pairwise(KVR_MATRIX, lambda case: (case[0], case[1], case[2] == "even", case[3])),
)
def test_kvr_matches_single(models, prompts, oracle, name, p, partition, batch):
  model, ref = models[name], oracle[(name, batch)]
  mesh = kvr_jax.make_mesh(p)
  got = kvr_jax.prefill(model, prompts[batch], strategy="kvr", mesh=mesh, partition=partition)
  assert_close(got.logits, ref.logits, "logits")
  assert_close(got.k_cache, ref.k_cache, "K cache")
  assert_close(got.v_cache, ref.v_cache, "V cache")
  # The whole cache is on the last rank's device, where decode continues.
  assert got.device == mesh.devices.reshape(-1)[-1]
  assert got.k_cache.sharding.device_set == {got.device}


TSP_MATRIX = [
  (name, p, batch)
  for name in ("tiny-llama", "tiny-falcon")
  for p, batch in [(1, 1), (2, 3), (3, 1), (4, 3), (8, 1)]
] + [("falcon-40b-form", 3, 1), ("falcon-40b-form", 8, 1)]


@pytest.mark.default_cases("tiny-falcon-1-1")
@pytest.mark.parametrize("name,p,batch", pairwise(TSP_MATRIX))
def test_tsp_matches_single(models, prompts, oracle, name, p, batch):
  ref = oracle[(name, batch)]
  got = kvr_jax.prefill(models[name], prompts[batch], strategy="tsp", mesh=kvr_jax.make_mesh(p))
  assert_close(got.logits, ref.logits, "logits")
  assert_close(got.k_cache, ref.k_cache, "K cache")
  assert_close(got.v_cache, ref.v_cache, "V cache")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-falcon"])
def test_greedy_generation_identical_across_strategies(models, name):
  model = models[name]
  prompt = np.random.RandomState(5).randint(0, 512, (2, 29))
  mesh = kvr_jax.make_mesh(4)
  single = kvr_jax.generate(model, prompt, 16).tokens
  kvr = kvr_jax.generate(model, prompt, 16, strategy="kvr", mesh=mesh, partition=[11, 8, 6, 4])
  tsp_tokens = kvr_jax.generate(model, prompt, 16, strategy="tsp", mesh=mesh).tokens
  np.testing.assert_array_equal(kvr.tokens, single)
  np.testing.assert_array_equal(tsp_tokens, single)
  assert kvr.prefill.device == mesh.devices.reshape(-1)[-1]


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_bfloat16_kvr_close_to_float32(prompts):
  """bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 0.2% per op). Through 4 layers of
  ~10 rounded ops each the logits drift by a few percent of their range; we allow 5% of the
  largest float32 logit. A wiring error (wrong offset, missing prefix) shows up as O(100%)."""
  f32 = kvr_jax.prefill(kvr_jax.load_model("tiny-llama"), prompts[3]).logits
  model16 = kvr_jax.load_model("tiny-llama", dtype="bfloat16")
  got = kvr_jax.prefill(
    model16, prompts[3], strategy="kvr", mesh=kvr_jax.make_mesh(3), partition=[6, 4, 3]
  )
  assert got.k_cache.dtype == np.dtype("bfloat16")
  f32 = np.asarray(f32)
  err = np.abs(np.asarray(got.logits, np.float32) - f32).max() / np.abs(f32).max()
  assert err < 0.05
  single16 = kvr_jax.prefill(model16, prompts[3]).logits
  # bf16 KVR against bf16 single: the same roundings in a different order.
  assert np.abs(np.asarray(got.logits) - np.asarray(single16)).max() / np.abs(f32).max() < 0.05


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_second_call_does_not_compile_again(models, prompts):
  model, mesh = models["tiny-llama"], kvr_jax.make_mesh(4)
  kvr_jax.prefill(model, prompts[1], strategy="kvr", mesh=mesh, partition=[5, 3, 3, 2])
  kvr_jax.prefill(model, prompts[1], strategy="tsp", mesh=mesh)
  before = (TRACE_COUNT["kvr"], TRACE_COUNT["tsp"])
  kvr_jax.prefill(model, prompts[1], strategy="kvr", mesh=mesh, partition=[5, 3, 3, 2])
  kvr_jax.prefill(model, prompts[1], strategy="tsp", mesh=mesh)
  assert (TRACE_COUNT["kvr"], TRACE_COUNT["tsp"]) == before
  kvr_jax.prefill(model, prompts[1], strategy="kvr", mesh=mesh, partition=[4, 4, 3, 2])
  assert TRACE_COUNT["kvr"] == before[0] + 1  # a new partition is a new program


# Splits of 150 tokens over 3 ranks: a rank of one token, a first rank longer than the others
# together, a last rank of one token, lengths that are multiples of no block.
SPLITS_AS_DATA = [(1, 100, 49), (120, 20, 10), (60, 89, 1), (37, 53, 60)]


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_one_program_runs_every_split_that_fits_its_shape():
  """KV-Runahead with the split as data (runahead.split_as_data_strategy): every split of
  SPLITS_AS_DATA on one program, one trace, hops sized as data; logits and the whole cache
  (its parts moved onto the last rank) within 1e-5 of single. tiny-gemma: layers with a
  64-token window (hops carry the last 63 keys of the prefix) and full layers (the whole
  prefix), grouped K,V heads."""
  model, mesh = kvr_jax.load_model("tiny-gemma"), kvr_jax.make_mesh(3)
  tokens = np.random.RandomState(5).randint(0, 512, (2, 150))
  want = kvr_jax.prefill(model, tokens)
  kernel = get_kernel("flash")
  longest = max(max(split) for split in SPLITS_AS_DATA)
  shape = runahead.OneBodyShape.envelope(model.config, SPLITS_AS_DATA[0], kernel, longest)
  strategy = runahead.split_as_data_strategy(model.config, shape)
  before = TRACE_COUNT[runahead.SPLIT_AS_DATA]
  for split in SPLITS_AS_DATA:
    got = kvr_jax.prefill(model, tokens, strategy=strategy, mesh=mesh, partition=list(split))
    assert_close(got.logits, want.logits, f"{split} logits")
    assert_close(got.k_cache, want.k_cache, f"{split} k cache")
    assert_close(got.v_cache, want.v_cache, f"{split} v cache")
  assert TRACE_COUNT[runahead.SPLIT_AS_DATA] == before + 1
  # A split the shape cannot hold is refused before anything runs: chunks of at most 50
  # tokens in whole blocks (at most 56 rows: a block of the even split is at most 56).
  small = runahead.OneBodyShape.envelope(model.config, (50, 50, 50), kernel, 50)
  strategy = runahead.split_as_data_strategy(model.config, small)
  for split, message in (((110, 20, 20), "longer than this program's"), ((75, 75), "3 ranks")):
    with pytest.raises(ValueError, match=message):
      kvr_jax.prefill(model, tokens, strategy=strategy, mesh=mesh, partition=list(split))
  assert TRACE_COUNT[runahead.SPLIT_AS_DATA] == before + 1


@pytest.mark.parametrize(
  "partition,message",
  [
    ([7, 6], "2 chunks but the mesh has 4 ranks"),
    ([7, 0, 3, 3], "at least one token"),
    ([9, -2, 3, 3], "at least one token"),
    ([5, 3, 3, 3], "sums to 14"),
    ("fastest", "unknown partition"),
    ([5, 3, 3, 2.5], "integer"),
  ],
)
def test_bad_partitions_fail_before_compiling(models, prompts, partition, message):
  before = TRACE_COUNT["kvr"]
  with pytest.raises(ValueError, match=message):
    kvr_jax.prefill(
      models["tiny-llama"],
      prompts[1],
      strategy="kvr",
      mesh=kvr_jax.make_mesh(4),
      partition=partition,
    )
  assert TRACE_COUNT["kvr"] == before


def test_bad_meshes_fail_before_compiling(models):
  model = models["tiny-llama"]
  before = TRACE_COUNT["kvr"]
  with pytest.raises(ValueError, match="8 ranks but only 5 prompt tokens"):
    kvr_jax.prefill(model, np.arange(5)[None], strategy="kvr", mesh=kvr_jax.make_mesh(8))
  wrong_axis = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
  with pytest.raises(ValueError, match="axis 'ranks'"):
    kvr_jax.prefill(model, np.arange(5)[None], strategy="kvr", mesh=wrong_axis)
  with pytest.raises(ValueError, match="Mesh"):
    kvr_jax.prefill(model, np.arange(5)[None], strategy="tsp", mesh="cpu:0")
  with pytest.raises(ValueError, match="only 8 devices"):
    kvr_jax.make_mesh(9)
  assert TRACE_COUNT["kvr"] == before


# --- The compiled program: hops, bytes and per-rank work -------------------------------------


def _compiled_kvr_hlo(model, chunks, batch=1):
  mesh = kvr_jax.make_mesh(len(chunks))
  kinds = model.config.kinds
  fn = compile_by_kind("kvr", model.graphdef, mesh, tuple(chunks), "flash", kinds, False)
  tokens = runahead.pad_chunks(np.zeros((batch, sum(chunks)), np.int32), tuple(chunks))
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  by_rank = jax.sharding.NamedSharding(mesh, jax.P(AXIS))
  lowered = fn.lower(model.state_on(replicated), jax.device_put(tokens, by_rank))
  return lowered.compile().as_text()


@pytest.mark.default_cases("tiny-llama")
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-falcon"])
def test_hop_chain_one_pair_per_hop_and_exact_bytes(models, name):
  """p-1 collective-permutes, hop k couples only (k, k+1) and carries exactly S_k tokens of
  K and V with the model's own KV head count (Falcon-7B form: one head)."""
  model, chunks, batch = models[name], (400, 250, 200, 174), 2
  hlo = _compiled_kvr_hlo(model, chunks, batch)
  hops = []
  for line in hlo.splitlines():
    m = re.search(r"= (\w+)\[([\d,]+)\]\{[\d,]*\} collective-permute(?:-start)?\(", line)
    if m:
      pairs = re.search(r"source_target_pairs=\{(\{\d+,\d+\}(?:,\{\d+,\d+\})*)\}", line).group(1)
      shape = tuple(int(d) for d in m.group(2).split(","))
      hops.append((pairs, m.group(1), shape))
  assert "all-gather" not in hlo
  cfg = model.config
  ends = np.cumsum(chunks)
  assert len(hops) == len(chunks) - 1
  for k, (pairs, dtype, shape) in enumerate(sorted(hops)):
    assert pairs == f"{{{k},{k + 1}}}"
    assert dtype == "f32"
    assert shape == (2, batch, ends[k], cfg.num_kv_heads, cfg.head_dim)
    assert np.prod(shape) * 4 == costmodel.kv_message_bytes(cfg, int(ends[k]), batch, 4)


def test_rows_before_the_hop_hand_computed():
  """Rank i attends as many diagonal rows before its hop as fit, in FLOPs, between its own
  qkv and its sender's readiness. tiny-llama: qkv 2*128*(4+2*2)*32 = 65536 FLOPs per token, a
  scored key 4*4*32 = 512; the first r rows see r(r+1)/2 keys."""
  cfg = preset_config("tiny-llama")
  # Rank 1: 300 tokens of spare qkv = 38400 keys -> r(r+1) <= 76800 -> 276. Rank 2 waits for
  # rank 1, which holds its prefix when rank 0 sends (700 tokens): 200 spare -> 225.
  assert runahead.rows_before_hop(cfg, (700, 400, 500)) == (0, 276, 225)
  # A longer chunk than its sender's has nothing to fill; rank 2's sender is then ready at
  # rank 1's 500-token qkv, later than its whole 100-row diagonal.
  assert runahead.rows_before_hop(cfg, (300, 500, 100)) == (0, 0, 100)
  assert runahead.rows_before_hop(cfg, (275,) * 4) == (0, 0, 0, 0)
  # 20 spare tokens = 2560 keys: r(r+1)/2 <= 2560 -> 71; with a window of 16 a row sees at
  # most 16 keys: 136 + 16 (r - 16) <= 2560 -> 167.
  assert runahead.rows_before_hop(cfg, (420, 400)) == (0, 71)
  windowed = dataclasses.replace(cfg, sliding_window=16)
  assert runahead.rows_before_hop(windowed, (420, 400)) == (0, 167)


def test_the_early_rows_closed_form_matches_counting_rows():
  """rows_before_hop's closed form (the cost model's search calls it for every split it
  weighs) against counting rows one by one: the most rows whose diagonal fits in the FLOPs."""
  for window in (1, 3, 16, 10**9):
    for c in (1, 2, 17, 40):
      for flops in range(-5, 512 * 900, 2111):
        rows, keys = 0, 0
        while rows < c and 512 * (keys + min(rows + 1, window)) <= flops:
          keys += min(rows + 1, window)
          rows += 1
        assert schedule._most_rows_within(flops, 512, c, window) == rows, (window, c, flops)


@pytest.mark.default_cases("tiny-llama")
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-falcon"])
def test_each_rank_computes_only_its_share(models, name):
  """XLA's cost analysis of each rank's compiled layer follows c_i and c_i * S_i."""
  model, chunks = models[name], (400, 250, 200, 174)
  cfg = model.config
  ends = np.cumsum(chunks)
  graphdef, stacked = nnx.split(model.module.blocks)
  layer0 = jax.tree.map(lambda a: a[0], stacked)
  x = jax.ShapeDtypeStruct((1, max(chunks), cfg.d_model), np.float32)
  prefix = jax.ShapeDtypeStruct((2, 1, sum(chunks), cfg.num_kv_heads, cfg.head_dim), np.float32)
  for i in range(len(chunks)):

    def rank_i(layer_state, x_BcD, kv_prefix, i=i):
      return runahead.rank_layer(nnx.merge(graphdef, layer_state), x_BcD, kv_prefix, i, chunks)

    compiled = jax.jit(rank_i).lower(layer0, x, prefix).compile()
    measured = compiled.cost_analysis()["flops"]
    analytic = costmodel.layer_flops(cfg, chunks[i], int(ends[i])).total
    padded = costmodel.layer_flops(cfg, max(chunks), sum(chunks)).total
    assert abs(measured / analytic - 1) < 0.10, (i, measured, analytic)
    if i > 0:  # what a program that worked on padding would cost: clearly distinguishable
      assert measured < 0.9 * padded


@pytest.mark.default_cases("balanced")
@pytest.mark.parametrize("method", ["search", "balanced"])
def test_cost_model_partitions_run_and_match_single(models, prompts, oracle, method):
  """ "search"/"balanced" pick uneven chunks from the cost model (local preset); the result is
  still exact, and the chosen partition is reported."""
  got = kvr_jax.prefill(
    models["tiny-llama"], prompts[1], strategy="kvr", mesh=kvr_jax.make_mesh(3), partition=method
  )
  assert len(got.partition) == 3 and sum(got.partition) == CONTEXT
  assert_close(got.logits, oracle[("tiny-llama", 1)].logits, "logits")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_measured_search_resumes_from_disk(models, tmp_path, monkeypatch):
  """objective='measured' times real prefills, the best and its neighbours interleaved; an
  interrupted search resumes from its file and decides as before."""
  from kvr_jax.tools import timing

  model, mesh = models["tiny-llama"], kvr_jax.make_mesh(2)
  tokens = np.random.RandomState(3).randint(0, 512, (1, 64))
  cache = str(tmp_path / "measured.json")
  real_prefill = timing.run_prefill
  calls = {"n": 0, "limit": None}

  def counting_prefill(*args, **kwargs):
    calls["n"] += 1
    if calls["limit"] is not None and calls["n"] > calls["limit"]:
      raise KeyboardInterrupt
    return real_prefill(*args, **kwargs)

  def search_with_cache():
    return measured.measured_search(
      model, tokens, mesh, multiple=8, repeats=1, cache_path=cache, show_progress=False
    )

  def stored_batches():
    with open(cache) as f:
      return json.load(f)["batches"]

  monkeypatch.setattr(timing, "run_prefill", counting_prefill)
  # The first batch (the even split and its two neighbours, on one program: one first call,
  # then one timed run each) is written, then "Ctrl-C" in the second (at 16 tokens every
  # neighbour is shown faster or slower by one sample each, so a second comparison follows,
  # at 16 or at 8).
  calls["limit"] = 7
  with pytest.raises(KeyboardInterrupt):
    search_with_cache()
  (first,) = stored_batches()
  assert first == "32,32;16,48;48,16"
  calls.update(n=0, limit=None)
  traces = TRACE_COUNT["kvr"], TRACE_COUNT[runahead.SPLIT_AS_DATA]
  chunks = search_with_cache()
  later = [key for key in stored_batches() if key != first]
  assert later and calls["n"] == sum(1 + len(key.split(";")) for key in later)
  # Every candidate ran on one program with the split as data (at most one trace: the
  # interrupted search may have traced it), none on a program of its own.
  assert TRACE_COUNT["kvr"] == traces[0]
  assert TRACE_COUNT[runahead.SPLIT_AS_DATA] <= traces[1] + 1
  assert len({p for key in later for p in key.split(";")}) >= 3
  assert sum(chunks) == 64 and chunks[0] % 8 == 0
  calls["n"] = 0
  assert search_with_cache() == chunks
  assert calls["n"] == 0  # fully resumed
  other = np.random.RandomState(3).randint(0, 512, (2, 64))
  with pytest.raises(ValueError, match="another setup"):
    measured.measured_search(model, other, mesh, cache_path=cache, show_progress=False)
  with open(cache) as f:
    stored = json.load(f)
  assert {"dtype": "float32", "kernel": "flash"}.items() <= stored["setup"].items()
  # Another process's batch written meanwhile is kept when this one writes (merged).
  stored["batches"]["56,8;40,24"] = {"56,8": [9.0], "40,24": [9.5]}
  with open(cache, "w") as f:
    json.dump(stored, f)
  measured.measured_search(
    model, tokens, mesh, multiple=32, repeats=1, cache_path=cache, show_progress=False
  )
  assert stored_batches()["56,8;40,24"] == {"56,8": [9.0], "40,24": [9.5]}
  # Valid JSON with bad values, or the older search's medians: one clear error naming the file.
  for bad, says in (
    ([1, 2], "not a measured-search cache"),
    ({"setup": stored["setup"], "batches": {"40,24;48,16": {"40,24": [0.1]}}}, "bad batch"),
    ({"setup": stored["setup"], "batches": {"40,20": {"40,20": [0.1]}}}, "bad batch"),
    ({"setup": stored["setup"], "batches": {"40,24": {"40,24": [-1.0]}}}, "bad batch"),
    ({"setup": stored["setup"], "results": {"40,24": 0.1}}, "older measured search"),
  ):
    with open(cache, "w") as f:
      json.dump(bad, f)
    with pytest.raises(ValueError, match=f"{cache}.*{says}"):
      search_with_cache()


def test_measured_comparison_times_the_best_with_each_batch(models, monkeypatch):
  """Candidates are timed with the best, at most BATCH of them a batch (every batch re-times
  the best: a verdict compares samples of one interleaved run), and a candidate is "ahead"
  only where its samples all beat the best's."""
  model, mesh = models["tiny-llama"], kvr_jax.make_mesh(2)
  batches = []

  def fake_time_together(model, tokens, mesh, partitions, repeats, strategy):
    batches.append(partitions)
    return {",".join(map(str, c)): [float(c[0]), float(c[0]) + 2.5] for c in partitions}

  monkeypatch.setattr(measured, "_time_together", fake_time_together)
  compare = measured.measured_comparison(model, np.zeros((1, 64), np.int32), mesh, repeats=2)
  best = (30, 34)
  candidates = [(20, 44), (28, 36), (32, 32), (40, 24), (10, 54), (34, 30)]
  verdicts = compare(best, candidates)
  assert batches == [[best, *candidates[:4]], [best, *candidates[4:]]]
  assert [v for v, _ in verdicts] == ["ahead", "tie", "tie", "behind", "ahead", "behind"]
  assert [m for _, m in verdicts] == [c[0] + 1.25 for c in candidates]


def test_every_process_takes_the_last_processs_measured_file(tmp_path, monkeypatch):
  """Across processes the measured search's file is read where it is written (the last
  process) and what it holds, or its refusal, is sent to every process: across hosts
  without a shared filesystem another process's file (here: none) must not change its
  decisions. Two processes played in turn, the broadcasts recorded and replayed."""
  setup = {"model": "m", "shape": [1, 64]}
  stored = {"32,32;24,40": {"32,32": [1.0, 1.1], "24,40": [0.9, 0.95]}}
  written = tmp_path / "last.json"
  written.write_text(json.dumps({"setup": setup, "batches": stored}))
  sent = []

  def broadcast(value, is_source):
    if is_source:
      sent.append(np.asarray(value).copy())
      return value
    return sent.pop(0)

  monkeypatch.setattr(measured.multihost_utils, "broadcast_one_to_all", broadcast)
  monkeypatch.setattr(jax, "process_count", lambda: 2)

  def as_process(index, path):
    monkeypatch.setattr(jax, "process_index", lambda: index)
    return measured._stored_batches(str(path), setup, 64)

  assert as_process(1, written) == stored
  assert as_process(0, tmp_path / "absent.json") == stored and not sent
  written.write_text("{not json")
  for index in (1, 0):
    with pytest.raises(ValueError, match="last.json: unreadable measured-search cache"):
      as_process(index, written if index == 1 else tmp_path / "absent.json")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize("strategy,p,partition", [("single", 1, None), ("kvr", 3, [150, 60, 90])])
def test_blocked_attention_matches_dense(models, strategy, p, partition):
  """attention='blocked' skips masked blocks (blocks of 128 queries: 300 tokens span three)."""
  model = models["tiny-falcon"]
  tokens = np.random.RandomState(7).randint(0, 512, (2, 300))
  kwargs = {} if strategy == "single" else {"mesh": kvr_jax.make_mesh(p), "partition": partition}
  dense = kvr_jax.prefill(model, tokens, strategy=strategy, attention="dense", **kwargs)
  blocked = kvr_jax.prefill(model, tokens, strategy=strategy, attention="blocked", **kwargs)
  assert_close(blocked.logits, dense.logits, "logits")
  assert_close(blocked.k_cache, dense.k_cache, "K cache")
  with pytest.raises(ValueError, match="TSP computes dense"):
    kvr_jax.prefill(model, tokens, strategy="tsp", attention="blocked")
  with pytest.raises(ValueError, match="unknown attention"):
    kvr_jax.prefill(model, tokens, attention="sparse")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_fitted_hardware_drives_an_exact_search(models, prompts, oracle):
  """fitted_hardware times this model's phases here and returns cost-model figures: positive
  rates (the attention's as a fraction of the linear phases'), a split from them that runs
  exact, and a clear refusal for a kernel that writes its scores."""
  model = models["tiny-llama"]
  hardware = phases.fitted_hardware(model, CONTEXT, num_ranks=2, repeats=1)
  assert hardware.name == "fitted" and hardware.flops > 0
  assert hardware.fused_attention_flops > 0
  plan = kvr_jax.PartitionPlan("search", hardware=hardware)
  got = kvr_jax.prefill(
    model, prompts[1], strategy="kvr", mesh=kvr_jax.make_mesh(2), partition=plan
  )
  assert len(got.partition) == 2 and sum(got.partition) == CONTEXT
  assert_close(got.logits, oracle[("tiny-llama", 1)].logits, "logits")
  with pytest.raises(ValueError, match="fitted_hardware models kernels"):
    phases.fitted_hardware(model, CONTEXT, attention="dense")


# --- the one-body program: one body for every rank, lengths as data --------------------------


def test_row_blocks_visit_only_the_real_rows():
  """map_row_blocks runs ceil(n / R) blocks for a traced n (one program for every n): the
  rows of later blocks keep what the output held, so a rank computes at most R - 1 padded
  rows of projections and MLP."""
  R, rows = 8, 40

  @jax.jit
  def visited(n):
    ones = lambda first_row, x: (jnp.ones_like(x),)
    return runahead.map_row_blocks(ones, n, R, (jnp.zeros((1, rows)),), (jnp.zeros((1, rows)),))[0]

  for n in (1, 7, 8, 9, 33, 40):
    assert int(visited(n).sum()) == -(-n // R) * R, n


def test_one_body_block_pads_each_split_least():
  """The one body's block (row loops and query blocks) follows the split: [640, 384] in
  blocks of 128 pads nothing (a fixed 256 computed 1280 rows for 1024 tokens), the rank
  of 2637 tokens that attends the longest prefix pads 3 rows (a fixed 512 padded it to 3072),
  and the long chunk of [2685, 1411] a few."""
  from models.kernels import KERNELS

  config = preset_config("bench-llama")

  def padded(chunks):
    block = runahead.one_body_block(config, chunks, KERNELS["flash"])
    assert block % 8 == 0 and block <= KERNELS["flash"].query_block, block
    return [-(-c // block) * block - c for c in chunks]

  assert padded((640, 384)) == [0, 0]
  assert padded((5555, 2637))[1] <= 8
  # Half of each query block's diagonal key block is masked work: counted, it keeps the long
  # chunk of [2685, 1411] (on the critical path) within a few rows (472-row blocks padded it
  # by 147 rows, and the one body ran 6-15% behind the per-rank program at 4k).
  assert padded((2685, 1411))[0] <= 32
  assert max(padded((1000, 99, 1))) < 128  # a one-token rank pads less than a block


def test_ordered_after_is_a_data_dependence():
  """`ordered_after(value, dep)` reads dep (a NaN in its first element zeroes value, any
  finite or infinite value leaves it unchanged): XLA must compute dep first, where an
  optimization barrier's order did not survive XLA:CPU's scheduling."""
  from kvr_jax.strategies.base import ordered_after

  value = jnp.arange(6.0).reshape(2, 3)
  after = jax.jit(ordered_after)
  for dep in (jnp.zeros(4), jnp.full(4, -jnp.inf), jnp.array([jnp.inf, jnp.nan])):
    assert np.array_equal(after(value, dep), value), dep
  assert not np.any(after(value, jnp.array([jnp.nan, 1.0])))
  assert not np.any(after((value, value), jnp.ones(2), jnp.array([jnp.nan]))[1])


def _compiled_size(model, chunks, body):
  mesh = kvr_jax.make_mesh(len(chunks))
  kinds = model.config.kinds
  fn = compile_by_kind("kvr", model.graphdef, mesh, tuple(chunks), "flash", kinds, False, body=body)
  tokens = runahead.pad_chunks(np.zeros((1, sum(chunks)), np.int32), tuple(chunks))
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  by_rank = jax.sharding.NamedSharding(mesh, jax.P(AXIS))
  lowered = fn.lower(model.state_on(replicated), jax.device_put(tokens, by_rank))
  return len(lowered.as_text().splitlines())


def test_one_body_program_does_not_grow_with_ranks(models):
  """The one body is the same program text whatever p; only the p-1 hops are added (a few
  lines each). The per-rank program compiles a branch per rank: it grows with p."""
  model = models["tiny-llama"]
  one = {p: _compiled_size(model, tuple([64] * p), "one") for p in (2, 8)}
  per_rank = {p: _compiled_size(model, tuple([64] * p), "per-rank") for p in (2, 8)}
  assert one[8] < 1.2 * one[2], one
  assert per_rank[8] > 2 * per_rank[2], per_rank


def test_one_body_refuses_static_kernels(models):
  with pytest.raises(ValueError, match="one-body KV-Runahead program runs attention in"):
    model = models["tiny-llama"]
    mesh, kinds = kvr_jax.make_mesh(2), model.config.kinds
    compile_by_kind("kvr", model.graphdef, mesh, (7, 6), "fused", kinds, False, body="one")


def test_kvr_variants_are_one_record_with_frozen_options(models):
  """KV-Runahead's variants are its one record with other `Options` (body, split as data),
  made by `configured`; options it cannot run are refused by name."""
  model = models["tiny-llama"]
  assert runahead.configured(runahead.Options()) is runahead.STRATEGY
  assert runahead.PER_RANK_STRATEGY.options == runahead.Options(body="per-rank")
  assert runahead.with_body("one") is runahead.ONE_BODY_STRATEGY
  shape = runahead.OneBodyShape.envelope(model.config, (32, 32), get_kernel("flash"), 48)
  as_data = runahead.split_as_data_strategy(model.config, shape)
  assert as_data.options == runahead.Options(split_shape=shape, config=model.config)
  assert as_data.name == runahead.SPLIT_AS_DATA and not as_data.timeline_probes
  with pytest.raises(ValueError, match="unknown KV-Runahead body"):
    runahead.Options(body="two")
  with pytest.raises(ValueError, match="needs the model's config"):
    runahead.Options(split_shape=shape)
