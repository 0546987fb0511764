"""The peers KV-Runahead is measured against: zigzag ring attention and all-gather context
parallelism, against the single-device oracle, and their compiled communication.

Tolerance (fixed): float32 strategies agree with `single` within 1e-5 relative to the largest
magnitude of the reference tensor (logits and every layer's K and V).
"""

import re

import jax
import numpy as np
import pytest

import kvr_jax
from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies import allgather, ring, zigzag
from kvr_jax.strategies.by_kind import compile_by_kind
from tests.matrix import pairwise

REL_TOL = 1e-5
PEERS = ["ring", "allgather"]


def assert_close(got, want, what):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err <= REL_TOL, f"{what}: relative error {err:.2e} > {REL_TOL}"


@pytest.fixture(scope="module")
def models():
  return {"gqa": kvr_jax.load_model("tiny-llama"), "mqa": kvr_jax.load_model("tiny-falcon")}


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(11)
  # C = 13 and 37 need padding to a multiple of 2p for every p > 1; 1024 for none of them.
  return {(C, B): rng.randint(0, 512, (B, C)) for C, B in ((13, 1), (37, 2), (1024, 1))}


@pytest.fixture(scope="module")
def oracle(models, prompts):
  return {
    (name, key): kvr_jax.prefill(model, tokens)
    for name, model in models.items()
    for key, tokens in prompts.items()
  }


def check(models, prompts, oracle, name, strategy, p, key, attention=None):
  mesh = kvr_jax.make_mesh(p)
  got = kvr_jax.prefill(
    models[name], prompts[key], strategy=strategy, mesh=mesh, attention=attention
  )
  want = oracle[(name, key)]
  assert_close(got.logits, want.logits, "logits")
  assert_close(got.k_cache, want.k_cache, "K cache")
  assert_close(got.v_cache, want.v_cache, "V cache")
  # The cache is in prompt order on the last rank's device, where decode continues.
  assert got.device == kvr_jax.make_mesh(p).devices.reshape(-1)[-1]
  return got


# (p, (C, batch)): every mesh at C=37 (batch 2); the padding-heavy C=13 on 3 and 8 ranks;
# C=1024 (several flash blocks per chunk) on 2, 4 and 8.
GQA_CASES = [(p, (37, 2)) for p in (1, 2, 3, 4, 8)] + [(p, (13, 1)) for p in (3, 8)]
GQA_CASES += [(p, (1024, 1)) for p in (2, 4, 8)]


# Every peer x mesh x length pair in the default tier; the whole product in the e2e tier.
@pytest.mark.default_cases("allgather-1-key1", "ring-2-key14")
@pytest.mark.parametrize(
  "strategy,p,key",
  pairwise(
    [(s, p, key) for p, key in GQA_CASES for s in PEERS],
    lambda case: (case[0], case[1], case[2][0]),
  ),
)
def test_peer_matches_single_gqa(models, prompts, oracle, strategy, p, key):
  check(models, prompts, oracle, "gqa", strategy, p, key)


@pytest.mark.default_cases("3-allgather")
@pytest.mark.parametrize("strategy", PEERS)
@pytest.mark.parametrize("p", [3, 8])
def test_peer_matches_single_mqa(models, prompts, oracle, strategy, p):
  check(models, prompts, oracle, "mqa", strategy, p, (37, 2))


@pytest.mark.default_cases("gqa-3-key0-ring")
@pytest.mark.parametrize("strategy", PEERS)
@pytest.mark.parametrize("name,p,key", [("gqa", 3, (13, 1)), ("mqa", 4, (37, 2))])
def test_peer_two_piece_kernel_matches_single(models, prompts, oracle, strategy, name, p, key):
  """The peers in the two-piece kernel's pieces (each a whole block in the past or a causal
  diagonal, static offsets: what cuDNN runs on GPUs; "fused" is the same pieces in XLA):
  exact on a padding-heavy prompt, and on a batch of two with one KV head on four ranks."""
  check(models, prompts, oracle, name, strategy, p, key, attention="fused")


def test_allgather_with_the_dense_kernel_matches_single(models, prompts, oracle):
  """All-gather CP's dense kernel (no log-sum-exp) attends the gathered K,V in prompt order,
  never in the two-piece kernels' pieces."""
  check(models, prompts, oracle, "gqa", "allgather", 3, (13, 1), attention="dense")


def test_peers_refuse_what_the_two_piece_kernels_cannot_run():
  """cuDNN is refused off NVIDIA GPUs, and a sliding window by the two-piece kernels, each
  in one line before anything compiles."""
  mistral = kvr_jax.load_model("tiny-mistral")
  tokens = np.zeros((1, 16), np.int32)
  for strategy in PEERS:
    with pytest.raises(ValueError, match="cudnn.*gpu"):
      kvr_jax.prefill(
        kvr_jax.load_model("tiny-llama"), tokens, strategy=strategy, attention="cudnn"
      )
    with pytest.raises(ValueError, match="window.*'fused' does not take"):
      kvr_jax.prefill(mistral, tokens, strategy=strategy, attention="fused")


@pytest.mark.default_cases("allgather")
@pytest.mark.parametrize("strategy", PEERS)
def test_peer_greedy_tokens_identical(models, prompts, strategy):
  model, tokens = models["gqa"], prompts[(37, 2)]
  want = kvr_jax.generate(model, tokens, 12)
  got = kvr_jax.generate(model, tokens, 12, strategy=strategy, mesh=kvr_jax.make_mesh(4))
  np.testing.assert_array_equal(got.tokens, want.tokens)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_peer_bfloat16_close_to_float32(prompts, oracle):
  model16 = kvr_jax.load_model("tiny-llama", dtype="bfloat16")
  f32 = np.asarray(oracle[("gqa", (37, 2))].logits)
  for strategy in PEERS:
    got = kvr_jax.prefill(model16, prompts[(37, 2)], strategy=strategy, mesh=kvr_jax.make_mesh(3))
    assert got.k_cache.dtype == np.dtype("bfloat16")
    err = np.abs(np.asarray(got.logits, np.float32) - f32).max() / np.abs(f32).max()
    assert err < 0.05, (strategy, err)  # the bound of the bf16 KVR test


def test_zigzag_layout():
  # C = 13, p = 3: c = 3, 6 chunks, 5 padding positions at the end.
  assert zigzag.chunk_len(13, 3) == 3 and zigzag.padded_len(13, 3) == 18
  assert list(zigzag.rank_order(13, 3)[:6]) == [0, 1, 2, 15, 16, 17]  # rank 0: chunks 0 and 5
  assert zigzag.layout(13, 3) == (3, 4, 6)  # rank 0: 3 + 0 (chunk 5 is padding), rank 1: 3 + 1
  tokens = np.arange(100, 113)[None]
  arranged = zigzag.arrange(tokens, zigzag.layout(13, 3))
  assert arranged.shape == (3, 1, 6)
  assert list(arranged[1, 0]) == [103, 104, 105, 112, 0, 0]  # chunks 1 and 4
  order = zigzag.rank_order(13, 3)
  np.testing.assert_array_equal(order[zigzag.prompt_order(13, 3)], np.arange(18))
  assert zigzag.last_position_owner(13, 3) == (1, 3)  # position 12: chunk 4, rank 1, row 3


def _hlo(strategy_module, model, p, C, B=1):
  mesh = kvr_jax.make_mesh(p)
  chunks = zigzag.layout(C, p)
  spec, kinds = strategy_module.STRATEGY, model.config.kinds
  fn = compile_by_kind(spec, model.graphdef, mesh, chunks, "flash", kinds, False)
  tokens = zigzag.arrange(np.zeros((B, C), np.int32), chunks)
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  by_rank = jax.sharding.NamedSharding(mesh, jax.P(AXIS))
  lowered = fn.lower(model.state_on(replicated), jax.device_put(tokens, by_rank))
  return lowered.compile().as_text()


def _ops(hlo, op):
  pattern = rf"= (\w+)\[([\d,]+)\]\{{[\d,]*\}} {op}(?:-start)?\("
  return [tuple(int(d) for d in m.group(2).split(",")) for m in re.finditer(pattern, hlo)]


@pytest.mark.default_cases("gqa")
@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_ring_hlo_p_minus_1_permutes_of_own_kv_heads(models, name):
  model, p, C, B = models[name], 4, 1024, 2
  hlo = _hlo(ring, model, p, C, B)
  cfg = model.config
  c = zigzag.chunk_len(C, p)
  permutes = _ops(hlo, "collective-permute")
  kv_hops = [s for s in permutes if s == (2, B, 2 * c, cfg.num_kv_heads, cfg.head_dim)]
  # p-1 steps in the layer body's every-row branch, and p-1 one-way sends of every other
  # rank's K,V into the owner of the prompt's last row in the last layer's branch, where it
  # attends that row alone (strategies.base.gather_to_owner, tests/test_last_row.py).
  assert len(kv_hops) == 2 * (p - 1)
  # The rest: the last position's logits (rank 0's second chunk at C=1024, p=4) to rank p-1.
  assert [s for s in permutes if s not in kv_hops] == [(B, cfg.vocab_size)]
  # No all-gather: each rank keeps its own part of the cache (tests/test_cache_layout.py).
  assert _ops(hlo, "all-gather") == []


@pytest.mark.default_cases("gqa")
@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_allgather_hlo_one_gather_per_layer_no_permute(models, name):
  model, p, C, B = models[name], 4, 1024, 2
  hlo = _hlo(allgather, model, p, C, B)
  cfg = model.config
  # One all-gather, of own KV heads, in the every-row branch of the layer body (run once per
  # layer by the scan); the last layer's branch sends every other rank's K,V into the owner
  # of the prompt's last row alone (p-1 one-way permutes: strategies.base.gather_to_owner).
  c = C // (2 * p)
  assert _ops(hlo, "all-gather") == [(2, B, 2 * p * c, cfg.num_kv_heads, cfg.head_dim)]
  own = (2, B, 2 * c, cfg.num_kv_heads, cfg.head_dim)
  # The last position (rank 0's second chunk here) moves its logits to rank p-1: B x V values.
  assert sorted(_ops(hlo, "collective-permute")) == sorted([own] * (p - 1) + [(B, cfg.vocab_size)])
