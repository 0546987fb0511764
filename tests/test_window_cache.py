"""Window-sized decode caches: from the whole cache on the last rank, a
windowed layer keeps only its last W positions, a ring written at position mod W
(decode.DecodeLayout), and decoding far past the window still gives the tokens of greedy
decoding over transformers' uncached forward, for every strategy, with ragged rows."""

import jax
import numpy as np
import pytest
import torch

import kvr_jax
from kvr_jax.inference import decode, sharded_decode
from kvr_jax.tools.memory import compiled_memory
from tests import hf_fixtures

WINDOW = 6  # every case's window
NEW_TOKENS = 3 * WINDOW + 2  # decoded past three whole windows
LENGTHS = (40, 27, 3)  # ragged rows: rings wrapping at other slots, and one not yet full


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """case -> (torch model, directory, our loaded model)."""
  out = hf_fixtures.saved_checkpoints(
    hf_fixtures.make_hf_model, ["mistral-window", "gemma3-local-global"], tmp_path_factory
  )
  out.update(
    hf_fixtures.saved_checkpoints(
      hf_fixtures.make_gpt_oss_model, ["gpt-oss-yarn"], tmp_path_factory
    )
  )
  return out


@pytest.fixture(scope="module")
def rows():
  rng = np.random.RandomState(5)
  return [rng.randint(0, hf_fixtures.VOCAB, n).astype(np.int32) for n in LENGTHS]


def uncached_greedy(hf_model, row, n: int) -> np.ndarray:
  """n tokens, each the argmax of transformers' whole forward over the row so far (no cache:
  transformers' own cached windows are not the reference)."""
  sequence = torch.as_tensor(row, dtype=torch.long)[None]
  out = []
  with torch.no_grad():
    for _ in range(n):
      token = hf_model(sequence).logits[0, -1].argmax()
      out.append(int(token))
      sequence = torch.cat([sequence, token.reshape(1, 1)], dim=1)
  return np.asarray(out)


@pytest.fixture(scope="module")
def want(checkpoints, rows):
  return {
    case: [uncached_greedy(hf_model, row, NEW_TOKENS) for row in rows]
    for case, (hf_model, _, _) in checkpoints.items()
  }


def test_layout_keeps_a_ring_only_where_the_window_binds(checkpoints):
  gemma = checkpoints["gemma3-local-global"][2].config  # layer 0 windowed (6), layer 1 full
  mixed = decode.DecodeLayout.of(gemma, capacity=60)
  assert mixed.rings == (WINDOW, None)
  assert mixed.group_of_layer == (0, 1) and mixed.slot_of_layer == (0, 0)
  # A window as long as the cache never binds: every position, one stack, as before.
  assert decode.DecodeLayout.of(gemma, capacity=WINDOW) == decode.DecodeLayout.whole(2)
  mistral = checkpoints["mistral-window"][2].config
  assert decode.DecodeLayout.of(mistral, capacity=60).rings == (WINDOW,)


def test_rings_hold_each_rows_last_window(checkpoints):
  """Slot j of row b holds the row's latest position p < length with p = j (mod W); a row
  shorter than the window leaves its later slots zero."""
  config = checkpoints["gemma3-local-global"][2].config
  L, B, C, K, H = 2, 2, 10, 2, 3
  rng = np.random.RandomState(0)
  k = rng.randn(L, B, C, K, H).astype(np.float32)
  v = rng.randn(L, B, C, K, H).astype(np.float32)
  layout = decode.DecodeLayout.of(config, capacity=12)
  cache = decode.decode_caches(k, v, np.asarray([10, 4], np.int32), layout, 12)
  assert cache.layout == layout
  (k_ring, v_ring), (k_full, v_full) = cache.groups
  assert k_ring.shape == (1, B, WINDOW, K, H) and k_full.shape == (1, B, 12, K, H)
  for slot, position in zip(range(WINDOW), [6, 7, 8, 9, 4, 5], strict=True):
    np.testing.assert_array_equal(k_ring[0, 0, slot], k[0, 0, position])
    np.testing.assert_array_equal(v_ring[0, 0, slot], v[0, 0, position])
  np.testing.assert_array_equal(k_ring[0, 1, :4], k[0, 1, :4])
  np.testing.assert_array_equal(k_ring[0, 1, 4:], 0)
  np.testing.assert_array_equal(k_full[0, :, :C], k[1])
  np.testing.assert_array_equal(v_full[0, :, C:], 0)


STRATEGY_RUNS = {
  "single": {},
  "kvr": {"partition": [16, 13, 11], "mesh": 3},
  "ring": {"mesh": 2},
  "allgather": {"mesh": 2},
  "tsp": {"mesh": 2},
}


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize(
  ("case", "strategy", "cache"),
  [("gemma3-local-global", s, "last") for s in STRATEGY_RUNS]
  + [("mistral-window", "single", "last"), ("gpt-oss-yarn", "single", "last")]
  + [("gemma3-local-global", s, "sharded") for s in ("kvr", "ring", "tsp")]
  + [("mistral-window", "allgather", "sharded"), ("gpt-oss-yarn", "kvr", "sharded")],
)
def test_greedy_decode_far_past_the_window_matches_transformers(
  checkpoints, rows, want, case, strategy, cache
):
  """Prefill with `strategy`, then three windows and more decoded from the rings (cache="last":
  on the last rank; "sharded": replicated beside the other layers' parts): each row's tokens
  are those of transformers' uncached forward."""
  _, _, ours = checkpoints[case]
  run = dict(STRATEGY_RUNS[strategy])
  mesh = kvr_jax.make_mesh(run.pop("mesh")) if "mesh" in run else None
  out = kvr_jax.generate(ours, rows, NEW_TOKENS, strategy=strategy, mesh=mesh, cache=cache, **run)
  for b in range(len(rows)):
    np.testing.assert_array_equal(out.tokens[b], want[case][b], err_msg=f"row {b}")


@pytest.mark.default_cases("kvr")
@pytest.mark.parametrize("strategy", ["kvr", "allgather"])
def test_sharded_layout_keeps_a_windowed_layers_ring_only(checkpoints, rows, strategy):
  """cache="sharded" on Gemma 3 mixed (layer 0 windowed at 6, layer 1 full), ragged rows: the
  parts hold the full layer only; the windowed layer a replicated ring [1, B, W, K, H]; the
  cache in prompt order equals single's where the ring keeps it (each row's last W
  positions) and is zeros before."""
  _, _, ours = checkpoints["gemma3-local-global"]
  run = dict(STRATEGY_RUNS[strategy])
  mesh = kvr_jax.make_mesh(run.pop("mesh"))
  got = kvr_jax.prefill(ours, rows, strategy=strategy, mesh=mesh, cache="sharded", **run)
  single = kvr_jax.prefill(ours, rows)
  B = len(rows)
  K, H = ours.config.num_kv_heads, ours.config.head_dim
  assert got.past.kept.rings == (WINDOW, None) and got.past.kv_parts.shape[1] == 1
  k_ring, v_ring = got.past.rings[0]
  assert k_ring.shape == v_ring.shape == (1, B, WINDOW, K, H)
  assert k_ring.sharding.is_fully_replicated
  k_got, v_got = (np.asarray(x) for x in got.gather_cache())
  k_want, v_want = (np.asarray(x) for x in single.gather_cache())
  np.testing.assert_allclose(k_got[1], k_want[1], atol=1e-5, rtol=0)  # the full layer
  for b, length in enumerate(LENGTHS):
    start = max(0, length - WINDOW)
    for got_x, want_x in ((k_got, k_want), (v_got, v_want)):
      np.testing.assert_allclose(
        got_x[0, b, start:length], want_x[0, b, start:length], atol=1e-5, rtol=0
      )
      np.testing.assert_array_equal(got_x[0, b, :start], 0)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_memory_counts_a_windowed_layers_window_only():
  """tiny-gemma (three layers windowed at 64, one full) decoding past 1000 positions: the
  step's arguments are the weights and the rings, not every position of every layer."""
  figures = compiled_memory("tiny-gemma", "single", context_len=1000, num_ranks=1, decode_tokens=24)
  config = kvr_jax.runtime.loading.config_of("tiny-gemma")
  per_position = 2 * config.num_kv_heads * config.head_dim * 4  # K and V, float32
  rings = 3 * 64 * per_position
  assert figures["decode_cache_bytes"] == rings + 1 * 1024 * per_position
  step_arguments = figures["decode_argument_bytes"] - figures["weights_bytes"]
  assert figures["decode_cache_bytes"] <= step_arguments < figures["decode_cache_bytes"] + 64
  assert jax.devices()[0].platform == "cpu"  # the suite's figures are XLA:CPU's
  # cache="sharded" on 4 ranks: the full layer's part (250 positions) and tail, and the rings,
  # replicated on every rank (the prompt outgrew the window).
  sharded = compiled_memory(
    "tiny-gemma",
    "kvr",
    context_len=1000,
    num_ranks=4,
    partition="even",
    cache="sharded",
    decode_tokens=24,
  )
  assert sharded["decode_cache_bytes"] == rings + 1 * (250 + 24) * per_position
  step_arguments = sharded["decode_argument_bytes"] - sharded["weights_bytes"]
  assert sharded["decode_cache_bytes"] <= step_arguments < sharded["decode_cache_bytes"] + 64
  # cache="last", all-gather CP on 4 ranks (zigzag: 8 runs of 125): what the move holds on the
  # last rank is the full layer's cache (1000 positions), one run (125) beside it, and the
  # rings; no windowed layer's every position (3 x 1000 more) reaches it.
  moved = compiled_memory(
    "tiny-gemma", "allgather", context_len=1000, num_ranks=4, cache="last", decode_tokens=24
  )
  held = rings + (1000 + 125) * per_position
  assert held <= moved["move_argument_bytes"] < held + 64


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize(
  "partition",
  [[16, 13, 11], [16, 20, 4]],  # the last chunk longer than the window, and shorter
  ids=["ring-from-own-chunk", "ring-from-hop-and-chunk"],
)
def test_kvr_joins_rings_from_its_last_hop_and_chunk(checkpoints, monkeypatch, partition):
  """cache="last" on Gemma 3 mixed (layer 0 windowed at 6, layer 1 full), rows of one length:
  the result keeps the full layer in prompt order and the windowed layer's ring only,
  [1, B, W, K, H], slot j holding the prompt's position p in [C - W, C) with p = j (mod W),
  equal to the program's own K,V there. KV-Runahead joins them from its last hop and its
  own chunk on the last rank (the moves and the peers' ring program are made to fail), also
  where its chunk is shorter than the window; all-gather moves the full layer and the rings
  and keeps the same."""
  _, _, ours = checkpoints["gemma3-local-global"]
  C = sum(partition)
  rng = np.random.RandomState(9)
  prompt = rng.randint(0, hf_fixtures.VOCAB, (2, C)).astype(np.int32)
  K, H = ours.config.num_kv_heads, ours.config.head_dim
  # The program's own K,V in prompt order: single's parts, before anything is kept or cut.
  plan = kvr_jax.inference.prefill.plan_prefill(ours, prompt, cache="last", buckets=None)
  parts = kvr_jax.inference.prefill.run_prefill(ours, plan, prompt, move_cache=False)
  k_all, v_all = (np.asarray(x) for x in parts.gather_cache())
  assert k_all.shape == (2, 2, C, K, H)
  slots = {p % WINDOW: p for p in range(C - WINDOW, C)}

  def check(result):
    assert result.past.kept.rings == (WINDOW, None)
    assert result.past.k_layers.shape == (1, 2, C, K, H)
    np.testing.assert_allclose(np.asarray(result.past.k_layers[0]), k_all[1], atol=1e-5, rtol=0)
    k_ring, v_ring = (np.asarray(x) for x in result.past.rings[0])
    assert k_ring.shape == (1, 2, WINDOW, K, H)
    for slot, position in slots.items():
      np.testing.assert_allclose(k_ring[0, :, slot], k_all[0, :, position], atol=1e-5, rtol=0)
      np.testing.assert_allclose(v_ring[0, :, slot], v_all[0, :, position], atol=1e-5, rtol=0)

  gathered = kvr_jax.prefill(
    ours, prompt, strategy="allgather", mesh=kvr_jax.make_mesh(2), cache="last", buckets=None
  )
  check(gathered)

  def no_move(*args, **kwargs):
    raise AssertionError("KV-Runahead's last rank joins what it holds: nothing moves")

  kwargs = dict(strategy="kvr", mesh=kvr_jax.make_mesh(3), partition=partition, cache="last")
  assert kvr_jax.inference.prefill.plan_prefill(ours, prompt, buckets=None, **kwargs).keep_last_hop
  monkeypatch.setattr(kvr_jax.inference.kv_cache, "gather_on_last_rank", no_move)
  monkeypatch.setattr(kvr_jax.inference.kv_cache, "send_onto_last_rank", no_move)
  monkeypatch.setattr(sharded_decode, "sharded_rings_program", no_move)
  joined = kvr_jax.prefill(ours, prompt, buckets=None, **kwargs)
  check(joined)
