"""The flash kernel (online softmax over key blocks) and its mergeable partials.

Tolerance (fixed): float32 kernels agree within 1e-5 relative to the largest magnitude of the
reference (the dense kernel); whole strategies likewise against the dense single oracle.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvr_jax
from kvr_jax.strategies import get_strategy, runahead
from kvr_jax.strategies.base import TRACE_COUNT
from models import kernels
from models.attention import (
  attend,
  attend_blocked,
  attend_fused,
  attend_partial,
  attend_with_lse,
  merge_partials,
)
from models.flash import Lengths, attend_flash, key_block_bounds, window_anchor, window_key_block
from models.kernels import KERNELS

REL_TOL = 1e-5


def jitted(kernel):
  """`kernel` compiled as one program (q, k, v traced; offsets and options static): far
  faster here than running its scans and loops op by op."""

  def call(q, k, v, *static, **options):
    return jax.jit(lambda q, k, v: kernel(q, k, v, *static, **options))(q, k, v)

  return call


def assert_close(got, want, what):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err <= REL_TOL, f"{what}: relative error {err:.2e} > {REL_TOL}"


def qkv(T, S, N, K, H=8, B=2, seed=0, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (B, T, N, H), dtype)
  k = jax.random.normal(keys[1], (B, S, K, H), dtype)
  v = jax.random.normal(keys[2], (B, S, K, H), dtype)
  return q, k, v


def reference_lse(q, k, offset):
  """log-sum-exp of the masked scores, [B, T, N], from the dense scores in float64."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  B, T, N, H = q.shape
  G = N // k.shape[2]
  k_N = np.repeat(k, G, axis=2)
  s = np.einsum("btnh,bsnh->btns", q, k_N) / np.sqrt(H)
  visible = np.arange(k.shape[1])[None, :] <= (offset + np.arange(T))[:, None]
  s = np.where(visible[None, :, None, :], s, -np.inf)
  m = s.max(-1)
  return m + np.log(np.exp(s - m[..., None]).sum(-1))


# (T, S, offset, N, K, query_block, key_block): one block, many blocks, partial blocks at both
# ends, a rank's rectangle (offset > 0), MQA (K=1) and GQA, blocks larger than the input.
SHAPES = [
  (37, 37, 0, 4, 2, 8, 16),
  (13, 50, 37, 4, 1, 4, 8),
  (100, 300, 200, 2, 2, 32, 64),
  (5, 5, 0, 2, 2, 256, 512),
  (64, 1000, 936, 4, 4, 16, 128),
  (129, 129, 0, 4, 1, 32, 32),
]


@pytest.mark.default_cases("5-5-0-2-2-256-512")
@pytest.mark.parametrize("T,S,offset,N,K,bq,bk", SHAPES)
def test_flash_equals_dense_with_its_lse(T, S, offset, N, K, bq, bk):
  q, k, v = qkv(T, S, N, K)
  out, lse = jitted(attend_flash)(q, k, v, offset, query_block=bq, key_block=bk)
  assert_close(out, jitted(attend)(q, k, v, offset), "flash output")
  assert_close(lse, reference_lse(q, k, offset), "flash lse")


def reference_attention(q, k, v, offset, window):
  """Sliding-window causal attention in float64 straight from the definition: query t (at
  offset + t) sees key s iff offset + t - window < s <= offset + t. Returns (out, lse); a row
  that sees no key has out 0 and lse -inf."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  B, T, N, H = q.shape
  G = N // k.shape[2]
  k_N, v_N = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  s = np.einsum("btnh,bsnh->btns", q, k_N) / np.sqrt(H)
  q_pos = (offset + np.arange(T))[:, None]
  k_pos = np.arange(k.shape[1])[None, :]
  visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
  s = np.where(visible[None, :, None, :], s, -np.inf)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  w = np.exp(s - m)
  total = w.sum(-1)
  out = np.einsum("btns,bsnh->btnh", w, v_N) / np.where(total > 0, total, 1.0)[..., None]
  with np.errstate(divide="ignore"):
    return out, m[..., 0] + np.log(total)


# (T, S, offset, N, K, query_block, key_block, window): windows shorter than a block, across
# blocks, of one key, longer than the prompt; a prefix wholly in the past where the last
# queries see nothing (lse -inf); MQA and GQA.
WINDOW_SHAPES = [
  (37, 37, 0, 4, 2, 8, 16, 5),
  (13, 50, 37, 4, 1, 4, 8, 20),
  (100, 300, 200, 2, 2, 32, 64, 70),
  (64, 1000, 936, 4, 4, 16, 128, 1),
  (129, 129, 0, 4, 1, 32, 32, 129),
  (40, 40, 0, 2, 2, 8, 8, 100),
  (16, 32, 60, 2, 1, 8, 8, 40),
  (70, 150, 80, 2, 1, 24, 16, 33),
]


@pytest.mark.default_cases("16-32-60-2-1-8-8-40")
@pytest.mark.parametrize("T,S,offset,N,K,bq,bk,window", WINDOW_SHAPES)
def test_sliding_window_kernels_equal_the_definition(T, S, offset, N, K, bq, bk, window):
  q, k, v = qkv(T, S, N, K, seed=3)
  want_out, want_lse = reference_attention(q, k, v, offset, window)
  out, lse = jitted(attend_flash)(q, k, v, offset, window=window, query_block=bq, key_block=bk)
  lse, sees_nothing = np.asarray(lse), np.isinf(want_lse)
  np.testing.assert_array_equal(np.isneginf(lse), sees_nothing)
  assert_close(np.where(sees_nothing, 0.0, lse), np.where(sees_nothing, 0.0, want_lse), "lse")
  assert_close(out, want_out, "flash output")
  if not sees_nothing.any():  # dense and blocked give a padded row a uniform average instead
    assert_close(jitted(attend)(q, k, v, offset, window=window), want_out, "dense output")
    blocked = jitted(attend_blocked)(q, k, v, offset, bq, window=window)
    assert_close(blocked, want_out, "blocked output")


@pytest.mark.parametrize("window", [None, 1, 5, 24, 40, 1000])
def test_flash_visits_exactly_the_key_blocks_someone_sees(window):
  """key_block_bounds against brute force over many query blocks: every block with a visible
  key is visited, no block without one is (a prefix piece's rows past the window cost nothing:
  KV-Runahead's windowed ranks paid a whole masked block per query block), and the unmasked
  ones are seen whole by every query."""
  bq, bk, nk, num_keys = 8, 8, 7, 53
  for first_q in range(-10, 110, 3):
    last_q = first_q + bq - 1
    q_pos = np.arange(first_q, last_q + 1)[:, None]
    k_pos = np.arange(nk * bk)[None, :]
    visible = (k_pos <= q_pos) & (k_pos < num_keys)
    if window is not None:
      visible &= k_pos > q_pos - window
    seen_by_any = visible.reshape(bq, nk, bk).any(axis=(0, 2))
    seen_by_all = visible.reshape(bq, nk, bk).all(axis=(0, 2))
    lo, full_lo, full_hi, hi = map(int, key_block_bounds(first_q, last_q, bk, nk, num_keys, window))
    assert lo <= full_lo <= full_hi <= hi, (first_q, lo, full_lo, full_hi, hi)
    visited = np.zeros(nk, bool)
    visited[lo:hi] = True
    np.testing.assert_array_equal(visited, seen_by_any, f"visited blocks at {first_q}")
    assert seen_by_all[full_lo:full_hi].all(), (first_q, full_lo, full_hi)


@pytest.mark.parametrize("window,bq", [(1024, 512), (1024, 472), (1000, 496), (40, 24)])
def test_a_windowed_query_block_visits_as_few_key_blocks_at_any_offset(window, bq):
  """Key blocks counted from each query block's window start (window_anchor) cover the
  W + bq - 1 keys it sees in ceil((W + bq - 1) / bk) blocks whatever its offset; counted from
  key 0 they need one more wherever the offset is not a block multiple (KV-Runahead's uneven
  chunks, a prefix of W - 1 keys)."""
  num_keys = 5 * window
  bk = window_key_block(num_keys, 512, window, bq)
  nk = -(-num_keys // bk)
  fewest = -(-(window + bq - 1) // bk)
  for first_q in range(window, 3 * window, 7):
    anchor = int(window_anchor(first_q, window))
    lo, _, _, hi = map(
      int,
      key_block_bounds(
        first_q - anchor, first_q + bq - 1 - anchor, bk, nk, num_keys - anchor, window
      ),
    )
    assert hi - lo == fewest, (first_q, hi - lo, fewest)


def test_sliding_window_is_exercised():
  """Control: the window changes the answer of these shapes (so the test above can fail)."""
  q, k, v = qkv(37, 37, 4, 2, seed=3)
  windowed = jitted(attend_flash)(q, k, v, 0, window=5, query_block=8, key_block=16)[0]
  assert np.abs(np.asarray(windowed) - np.asarray(jitted(attend)(q, k, v, 0))).max() > 0.1


@pytest.mark.parametrize("T,S,offset,N,K,bq,bk", SHAPES)
def test_fused_split_equals_dense(T, S, offset, N, K, bq, bk):
  """jax.nn.dot_product_attention on the unmasked prefix and the causal diagonal, merged by
  their lse (implementation="xla" here; "cudnn" on a GPU is the same code path)."""
  del bq, bk
  q, k, v = qkv(T, S, N, K, seed=1)
  out, lse = jitted(attend_fused)(q, k, v, offset, "xla")
  assert_close(out, jitted(attend)(q, k, v, offset), "fused output")
  assert_close(lse, reference_lse(q, k, offset), "fused lse")


def test_merge_of_disjoint_key_sets_is_exact():
  """A rank's rectangle as [0, offset) unmasked plus its causal square, merged: equals the
  whole; and merging with an empty partial (lse = -inf) changes nothing."""
  T, offset, N, K = 48, 80, 4, 2
  q, k, v = qkv(T, offset + T, N, K, seed=2)
  prefix = jitted(attend_flash)(q, k[:, :offset], v[:, :offset], offset, key_block=32)
  diagonal = jitted(attend_flash)(q, k[:, offset:], v[:, offset:], 0, query_block=16, key_block=16)
  out, lse = merge_partials(*prefix, *diagonal)
  assert_close(out, jitted(attend)(q, k, v, offset), "merged output")
  assert_close(lse, reference_lse(q, k, offset), "merged lse")
  empty = (jnp.zeros_like(prefix[0]), jnp.full_like(prefix[1], -jnp.inf))
  same, same_lse = merge_partials(*prefix, *empty)
  assert_close(same, prefix[0], "merge with nothing")
  assert_close(same_lse, prefix[1], "merge with nothing (lse)")
  # The merge is not an average: swapping one partial's lse must change the result.
  wrong, _ = merge_partials(prefix[0], diagonal[1], diagonal[0], prefix[1])
  assert np.abs(np.asarray(wrong) - np.asarray(out)).max() > 1e-3


def test_flash_program_does_not_grow_with_the_prompt():
  """Blocks are a scan and a fori_loop: the compiled program's text is the same size for 1k
  and 8k queries (the blocked kernel unrolls one slice per query block)."""

  def hlo_size(T):
    q, k, v = (jax.ShapeDtypeStruct((1, T, 4, 16), jnp.float32) for _ in range(3))
    k = v = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
    fn = jax.jit(lambda q, k, v: attend_flash(q, k, v, 0)[0])
    return len(fn.lower(q, k, v).as_text())

  small, large = hlo_size(1024), hlo_size(8192)
  assert large < 1.05 * small, (small, large)


def test_flash_future_token_has_no_influence():
  T, N, K = 300, 4, 2
  q, k, v = qkv(T, T, N, K, seed=3)
  out = jitted(attend_flash)(q, k, v, 0, query_block=64, key_block=64)[0]
  k2, v2 = k.at[:, 150].set(100.0), v.at[:, 150].set(-100.0)
  out2 = jitted(attend_flash)(q, k2, v2, 0, query_block=64, key_block=64)[0]
  np.testing.assert_array_equal(np.asarray(out2[:, :150]), np.asarray(out[:, :150]))
  assert not np.allclose(out2[:, 150:], out[:, 150:], atol=1e-2)


def test_flash_bfloat16_close_to_float32():
  """bf16 inputs, float32 softmax statistics: within bf16's own rounding (2^-8 relative per
  element, a few roundings deep) of the float32 result."""
  q, k, v = qkv(200, 200, 4, 1, seed=4)
  want = attend(q, k, v, 0)
  got = attend_flash(
    q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), 0, key_block=64
  )[0]
  assert got.dtype == jnp.bfloat16
  err = np.abs(np.asarray(got, np.float32) - np.asarray(want)).max() / np.abs(want).max()
  assert err < 0.02


# --- whole strategies with the flash kernel ----------------------------------------------------

# Long enough for several 256-query and 512-key blocks, with partial blocks everywhere.
LONG = 1100
# (p, partition): even and uneven, chunks not multiples of any block size.
FLASH_CASES = [
  (1, "even"),
  (2, [700, 400]),
  (3, [500, 333, 267]),
  (4, "even"),
  (8, [250, 200, 150, 140, 120, 100, 90, 50]),
  # The first rank longer than all the others together, a last rank of one token: the one
  # body's row loops run 4, 1 and 1 blocks of its padded 1000 rows.
  (3, [1000, 99, 1]),
]


@pytest.fixture(scope="module")
def long_setup():
  models = {"gqa": kvr_jax.load_model("tiny-llama"), "mqa": kvr_jax.load_model("tiny-falcon")}
  tokens = np.random.RandomState(5).randint(0, 512, (2, LONG))
  dense = {
    name: kvr_jax.prefill(model, tokens, attention="dense") for name, model in models.items()
  }
  return models, tokens, dense


@pytest.mark.default_cases("mqa")
@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_single_flash_matches_dense(long_setup, name):
  models, tokens, dense = long_setup
  got = kvr_jax.prefill(models[name], tokens, attention="flash")
  assert_close(got.logits, dense[name].logits, "logits")
  assert_close(got.k_cache, dense[name].k_cache, "K cache")
  assert_close(got.v_cache, dense[name].v_cache, "V cache")


@pytest.mark.default_cases("gqa-1-even")
@pytest.mark.parametrize(
  "name,p,partition",
  [("gqa", p, partition) for p, partition in FLASH_CASES]
  + [("mqa", p, partition) for p, partition in FLASH_CASES if p in (3, 8)],
)
def test_kvr_flash_matches_dense_single(long_setup, name, p, partition):
  models, tokens, dense = long_setup
  got = kvr_jax.prefill(
    models[name],
    tokens,
    strategy="kvr",
    mesh=kvr_jax.make_mesh(p),
    partition=partition,
    attention="flash",
  )
  assert_close(got.logits, dense[name].logits, "logits")
  assert_close(got.k_cache, dense[name].k_cache, "K cache")
  assert_close(got.v_cache, dense[name].v_cache, "V cache")


def test_kvr_per_rank_program_matches_dense_single(long_setup):
  """The per-rank switch program (kept as the one body's reference, and for the kernels with
  static bounds) with the flash kernel: early diagonal rows on every rank > 0."""
  models, tokens, dense = long_setup
  got = kvr_jax.prefill(
    models["gqa"],
    tokens,
    strategy=runahead.PER_RANK_STRATEGY,
    mesh=kvr_jax.make_mesh(3),
    partition=[500, 333, 267],
    attention="flash",
  )
  assert got.strategy == "kvr-per-rank"
  assert_close(got.logits, dense["gqa"].logits, "logits")
  assert_close(got.k_cache, dense["gqa"].k_cache, "K cache")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_kvr_flash_bfloat16_close_to_float32(long_setup):
  models, tokens, dense = long_setup
  model16 = kvr_jax.load_model("tiny-llama", dtype="bfloat16")
  got = kvr_jax.prefill(
    model16, tokens, strategy="kvr", mesh=kvr_jax.make_mesh(3), partition=[500, 333, 267]
  )
  f32 = np.asarray(dense["gqa"].logits)
  err = np.abs(np.asarray(got.logits, np.float32) - f32).max() / np.abs(f32).max()
  assert err < 0.05  # the bound the bf16 dense strategy test uses (test_strategies.py)


def test_flash_is_the_default_of_single_and_kvr():
  assert get_strategy("single").default_attention == "flash"
  assert get_strategy("kvr").default_attention == "flash"
  assert get_strategy("tsp").default_attention == "dense"


# --- bfloat16 partials: merged with a float32 log-sum-exp ---------------------------------------

# Fixed up front, for bfloat16 inputs: within one bfloat16 step (2^-8) of the largest output
# magnitude of a float64 reference computed from the same (rounded) inputs.
BF16_REL_TOL = 2.0**-8


def bf16_case():
  """bfloat16 q, k, v whose scores reach ~30 (lse in [15, 38]: bfloat16 steps of 0.125 to 0.25
  there), 64 queries at offset 128, and the float64 reference output."""
  T, S, offset, N, K, H = 64, 192, 128, 4, 2, 32
  rng = np.random.RandomState(0)
  q = jnp.asarray(rng.randn(1, T, N, H) * 3, jnp.bfloat16)
  k = jnp.asarray(rng.randn(1, S, K, H) * 3, jnp.bfloat16)
  v = jnp.asarray(rng.randn(1, S, K, H), jnp.bfloat16)
  q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
  scores = np.einsum("btkgh,bskh->bkgts", q64.reshape(1, T, K, N // K, H), k64) / np.sqrt(H)
  scores = np.where(np.arange(S)[None] <= offset + np.arange(T)[:, None], scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  want = np.einsum("bkgts,bskh->btkgh", weights, v64).reshape(1, T, N, H)
  return q, k, v, offset, want


def relative_error(got, want) -> float:
  return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("kernel", ["fused", "flash"])
def test_bfloat16_partials_merge_with_a_float32_lse(kernel):
  """The two-piece kernel (prefix + diagonal) and the flash kernel with bfloat16 inputs stay
  within one bfloat16 step of a float64 reference: their log-sum-exp and the merge are
  float32 (and flash scales bfloat16 scores in float32)."""
  q, k, v, offset, want = bf16_case()
  out, _ = jitted(attend_partial)(q, k, v, offset, kernel)
  assert out.dtype == jnp.float32
  assert relative_error(out, want) <= BF16_REL_TOL


def test_a_bfloat16_lse_fails_the_bfloat16_merge_bound():
  """Control: the same two pieces merged with their lse rounded to bfloat16 (what
  jax.nn.dot_product_attention(return_residual=True) returns for bfloat16 inputs) miss it."""
  q, k, v, offset, want = bf16_case()
  prefix = attend_with_lse(q, k[:, :offset], v[:, :offset], offset)
  diagonal = attend_with_lse(q, k[:, offset:], v[:, offset:], 0)
  rounded = [lse.astype(jnp.bfloat16) for lse in (prefix[1], diagonal[1])]
  out, _ = merge_partials(prefix[0], rounded[0], diagonal[0], rounded[1])
  assert relative_error(out, want) > BF16_REL_TOL


# --- attention="auto": the kernel per platform, and every kernel its own program ----------------


class FakeDevice:
  def __init__(self, platform, platform_version=""):
    self.platform = platform
    self.client = type("Client", (), {"platform_version": platform_version})()


@pytest.mark.parametrize(
  "strategy,device,dtype,window,want",
  [
    ("single", "cpu", "float32", None, "flash"),
    ("kvr", "cpu", "bfloat16", None, "flash"),
    ("single", "gpu", "bfloat16", None, "cudnn"),
    ("kvr", "gpu", "float16", None, "cudnn"),
    ("kvr", "gpu", "float32", None, "flash"),  # cuDNN takes no float32
    ("kvr", "gpu", "bfloat16", 64, "flash"),  # nor a sliding window
    ("kvr", "rocm", "bfloat16", None, "flash"),  # an AMD GPU: no cuDNN
    # The peers run cuDNN in ring's pieces (whole blocks and causal diagonals) too: a fair
    # fight on GPUs; with a window, flash (the pieces take none).
    ("ring", "gpu", "bfloat16", None, "cudnn"),
    ("allgather", "gpu", "bfloat16", None, "cudnn"),
    ("ring", "gpu", "bfloat16", 64, "flash"),
    ("tsp", "gpu", "bfloat16", None, "dense"),
    ("kvr", "tpu", "bfloat16", None, "flash"),
    ("kvr", "gpu-without-cudnn", "bfloat16", None, "flash"),  # a GPU without the library
  ],
)
def test_auto_attention_resolves_per_platform(strategy, device, dtype, window, want, monkeypatch):
  # This machine has no cuDNN: the fake NVIDIA GPUs have it unless the case says otherwise.
  monkeypatch.setattr(kernels, "cudnn_available", lambda: device != "gpu-without-cudnn")
  fake = FakeDevice("gpu", "rocm 6.2") if device == "rocm" else FakeDevice(device, "cuda 12.8")
  if device == "gpu-without-cudnn":
    fake = FakeDevice("gpu", "cuda 12.8")
    why = KERNELS["cudnn"].why_not(fake, dtype, window)
    assert why is not None and "needs cuDNN" in why
  spec = get_strategy(strategy)
  assert spec.resolve_attention("auto", fake, dtype, window).name == want
  assert spec.resolve_attention(None, fake, dtype, window).name == want
  named = spec.attention_kinds[-1]  # a kernel named is run as named
  assert spec.resolve_attention(named, fake, dtype, window).name == named


def test_auto_is_this_machines_flash_and_each_kernel_compiles_its_own_program():
  """On this CPU "auto" runs the flash program (no new compile after an explicit "flash"); a
  second kernel is a second program (the kernel is part of the cache key); "cudnn" is refused
  here before anything compiles."""
  model = kvr_jax.load_model("tiny-llama")
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, 96)
  mesh = kvr_jax.make_mesh(2)

  def traces(attention):
    before = TRACE_COUNT["kvr"]
    kvr_jax.prefill(model, tokens, "kvr", mesh=mesh, partition=[56, 40], attention=attention)
    return TRACE_COUNT["kvr"] - before

  assert traces("flash") == 1
  assert traces("auto") == 0
  assert traces(None) == 0
  assert traces("fused") == 1
  with pytest.raises(ValueError, match="cudnn.*gpu"):
    traces("cudnn")


def test_block_sizes_are_part_of_the_kernel_and_of_its_program():
  """A flash record with other block sizes is another compiled program (no module global
  changes a cached one), with the same logits and cache within 1e-5; a record comes back
  from prefill as its name."""
  model = kvr_jax.load_model("tiny-llama")
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, 96)
  mesh = kvr_jax.make_mesh(2)
  small = dataclasses.replace(KERNELS["flash"], query_block=16, key_block=32)
  results, traces = [], []
  for kernel in ("flash", small, small):
    before = TRACE_COUNT["kvr"]
    results.append(
      kvr_jax.prefill(model, tokens, "kvr", mesh=mesh, partition=[56, 40], attention=kernel)
    )
    traces.append(TRACE_COUNT["kvr"] - before)
  assert traces[1:] == [1, 0]
  assert results[1].attention == "flash"
  assert_close(results[1].logits, results[0].logits, "logits")
  assert_close(results[1].k_cache, results[0].k_cache, "k cache")


def test_clear_caches_makes_the_next_prefill_compile_again():
  from kvr_jax.core.caches import clear_caches

  model = kvr_jax.load_model("tiny-llama")
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, 64)
  mesh = kvr_jax.make_mesh(2)
  counts = []
  for clear in (False, False, True):
    if clear:
      clear_caches()
    before = TRACE_COUNT["kvr"]
    kvr_jax.prefill(model, tokens, "kvr", mesh=mesh, partition=[40, 24])
    counts.append(TRACE_COUNT["kvr"] - before)
  assert counts[1:] == [0, 1]


def test_attention_questions_are_answered_by_kernel_fields_only():
  """No module outside models/kernels.py and the dispatch in models/attention.py compares an
  attention kernel's name: a new kernel is one record, not a hunt through the tree."""
  import ast
  import pathlib

  root = pathlib.Path(__file__).resolve().parents[1]
  allowed = {root / "models" / "kernels.py", root / "models" / "attention.py"}
  names = set(KERNELS)
  found = []
  for path in sorted(
    p for pkg in ("kvr_jax", "models", "launch") for p in (root / pkg).rglob("*.py")
  ):
    if path in allowed:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if not isinstance(node, ast.Compare):
        continue
      for side in (node.left, *node.comparators):
        values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        if any(isinstance(v, ast.Constant) and v.value in names for v in values):
          found.append(f"{path.relative_to(root)}:{node.lineno}")
  assert not found, f"kernel names compared outside models/kernels.py: {found}"


def test_every_query_offset_against_dense_catches_an_off_by_one_block_bound():
  """Query blocks starting at every position modulo the key block (offset traced: one
  program): a key block counted whole one key too early (a future key leaks) or too late
  fails here; the SHAPES above do not reach every alignment."""
  T, S, bq, bk = 8, 48, 8, 16
  q, k, v = qkv(T, S, 4, 2, seed=5)
  flash = jax.jit(lambda q, k, v, o: attend_flash(q, k, v, o, query_block=bq, key_block=bk))
  dense = jax.jit(lambda q, k, v, o: attend(q, k, v, o))
  for offset in range(S - T + 1):
    assert_close(flash(q, k, v, offset)[0], dense(q, k, v, offset), f"offset {offset}")


def test_a_prompt_of_exactly_max_position_embeddings_tokens_runs():
  model = kvr_jax.load_model("tiny-llama")
  n = model.config.max_position_embeddings
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, n)
  assert kvr_jax.prefill(model, tokens).k_cache.shape[2] == n
  with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
    kvr_jax.prefill(model, kvr_jax.synthetic_prompt(model.config.vocab_size, n + 1))


# --- lengths as data: the one-body KV-Runahead program's kernel ----------------------------


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize("window", [None, 7])
def test_traced_query_rows_and_key_end_match_dense(window):
  """One compiled kernel for every (offset, key_end, query rows, first rows' key end): the
  rows asked for equal the dense kernel over keys [0, key_end), the first rows over [0, end)
  (on a query-block edge or inside a block); the query blocks holding none of the rows are
  not visited (out 0, lse -inf); keys at or past a row's end are never seen (garbage there
  changes nothing)."""
  T, S, bq, bk = 37, 90, 8, 16
  q, k, v = qkv(T, S, 4, 2, seed=7)
  garbage = jnp.full_like(k, 1e3)

  @jax.jit
  def flash(q, k, v, offset, key_end, lo, hi, split, first_end):
    return attend_flash(
      q,
      k,
      v,
      offset,
      window=window,
      query_block=bq,
      key_block=bk,
      out_dtype=jnp.float32,
      lengths=Lengths(query_rows=(lo, hi), key_end=key_end, short_rows=(split, first_end)),
    )

  for offset, key_end, lo, hi, split, first_end in [
    (50, 50, 0, 37, 0, 0),
    (50, 60, 5, 30, 0, 0),
    (0, 37, 0, 37, 0, 0),
    (20, 45, 13, 25, 0, 0),
    (50, 87, 0, 37, 16, 50),  # KV-Runahead's early rows: prefix [0, 50) only
    (50, 87, 3, 37, 13, 47),  # a split inside a query block, an end inside a key block
    (20, 57, 0, 37, 40, 9),  # every row a first row
  ]:
    ends = np.where(np.arange(T) < split, min(first_end, key_end), key_end)
    tail = jnp.arange(S)[None, :, None, None] >= key_end  # the first rows' end: below
    k_dirty, v_dirty = jnp.where(tail, garbage, k), jnp.where(tail, garbage, v)
    out, lse = flash(q, k_dirty, v_dirty, offset, key_end, lo, hi, split, first_end)
    for end in sorted(set(ends[lo:hi])):
      want = attend(q, k[:, :end], v[:, :end], offset, window=window)
      # Rows that see some key (with a window, rows far past the end see none: flash gives
      # them weight 0, the dense kernel a uniform average of masked scores).
      position = offset + np.arange(T)
      seen = np.minimum(position, end - 1) >= np.maximum(position - (window or S) + 1, 0)
      rows = np.arange(T)[seen & (ends == end) & (np.arange(T) >= lo) & (np.arange(T) < hi)]
      if rows.size:
        assert_close(out[:, rows], want[:, rows], f"rows {rows} at key end {end}")
    skipped = np.ones(T, bool)
    skipped[lo // bq * bq : -(-hi // bq) * bq] = False
    assert np.all(np.isneginf(np.asarray(lse)[:, skipped])), (lo, hi)
    assert not np.any(np.asarray(out)[:, skipped])
  # No key at all (rank 0's prefix): every row weighs nothing in a merge.
  out, lse = flash(q, k, v, 0, 0, 0, T, 0, 0)
  assert np.all(np.isneginf(np.asarray(lse))) and not np.any(np.asarray(out))


@pytest.mark.default_cases("qwen3")
@pytest.mark.parametrize("form", ["window", "qwen3", "2d-mesh"])
def test_early_diagonal_rows_under_a_window_qwen3_and_a_2d_mesh(form):
  """The one body's early diagonal rows (0 < r_i < c_i: rank 1 attends 160 or 232 of its 460
  rows to its own keys before its prefix arrives) with a sliding window, Qwen3's q/k norms
  and tensor-parallel ranks, against the dense single device."""
  from kvr_jax.runtime.loading import build_model, preset_config

  if form == "qwen3":
    config = dataclasses.replace(preset_config("tiny-llama"), qk_norm=True)
    model = kvr_jax.Model(build_model(config), source="tiny-qwen3-form")
  else:
    model = kvr_jax.load_model("tiny-mistral" if form == "window" else "tiny-llama")
  mesh = kvr_jax.make_mesh(2, model=2) if form == "2d-mesh" else kvr_jax.make_mesh(2)
  chunks = (640, 460)
  block = runahead.one_body_block(model.config, chunks, KERNELS["flash"])
  early = runahead.early_rows_in_blocks(model.config, chunks, block)
  assert 0 < early[1] < chunks[1], early
  tokens = np.random.RandomState(9).randint(0, model.config.vocab_size, (1, sum(chunks)))
  want = kvr_jax.prefill(model, tokens, attention="dense")
  one_body = runahead.ONE_BODY_STRATEGY  # two ranks run the per-rank program by default
  got = kvr_jax.prefill(model, tokens, one_body, mesh=mesh, partition=list(chunks))
  assert_close(got.logits, want.logits, "logits")
  # What decode reads: the whole cache, or on a windowed layer from its last hop's first key
  # on (KV-Runahead's join keeps no more there: zeros before it).
  first = model.config.kind.first_key(chunks[0])
  assert_close(got.k_cache[:, :, first:], want.k_cache[:, :, first:], "K cache")
  assert_close(got.v_cache[:, :, first:], want.v_cache[:, :, first:], "V cache")
