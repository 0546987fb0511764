"""Length buckets and ragged batches: many prompt lengths, one program per bucket, and every
row's logits, cache and greedy tokens as if it had run alone at its exact length."""

import numpy as np
import pytest

import kvr_jax
from kvr_jax.inference import buckets
from kvr_jax.strategies import TRACE_COUNT
from tests.tolerance import assert_close

STRATEGIES = ("single", "tsp", "kvr", "ring", "allgather")
BUCKET = 128  # the default ladder's bucket of every length in (112, 128]
LENGTHS = tuple(range(117, 129))  # a dozen lengths in that bucket
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def model():
  return kvr_jax.load_model("tiny-llama")


@pytest.fixture(scope="module")
def prompt():
  """One long prompt whose prefixes are the prompts (no EOS among them: rows run on)."""
  return np.random.RandomState(0).randint(3, 512, BUCKET)


@pytest.fixture(scope="module")
def reference(model, prompt):
  """The plain model's logits at every position of the whole prompt: by causality, row
  t - 1 is the last-position logits of the prefix of t tokens run alone."""
  return np.asarray(model.module(prompt[None]))[0]


@pytest.fixture(scope="module")
def mesh():
  return kvr_jax.make_mesh(4)


def alone(model, tokens):
  """The prompt run by itself: single device, exact shape, greedy."""
  return kvr_jax.generate(model, tokens, NEW_TOKENS)


def test_the_default_ladder():
  assert [buckets.auto_bucket(t) for t in (1, 16, 17, 100, 113, 128, 129)] == [
    16,
    16,
    32,
    112,
    128,
    128,
    144,
  ]
  assert [buckets.auto_bucket(t) for t in (1000, 1025, 2049, 4096)] == [1024, 1152, 2304, 4096]
  for t in range(1, 5000, 7):  # never more than 1/8 of padding past 128 tokens
    b = buckets.auto_bucket(t)
    assert t <= b and (t <= 128 or (b - t) / t < 1 / 8)
  assert buckets.bucket_length(130, "auto", max_position=140) == 140  # capped by the model
  assert buckets.bucket_length(100, (64, 256), 512) == 256
  assert buckets.bucket_length(300, (64, 256), 512) == 300  # past the ladder: exact


@pytest.mark.default_cases("allgather")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_dozen_lengths_in_one_bucket_trace_once(model, prompt, reference, mesh, strategy):
  """Every length in the bucket runs the bucket's one program, and its logits are those of
  the prompt alone; the cache holds the prompt's K,V at the real positions."""
  kwargs = {} if strategy == "single" else {"mesh": mesh}
  kvr_jax.prefill(model, prompt[: LENGTHS[0]], strategy=strategy, buckets="auto", **kwargs)
  before = TRACE_COUNT[strategy]
  for t in LENGTHS:
    result = kvr_jax.prefill(model, prompt[:t], strategy=strategy, buckets="auto", **kwargs)
    assert result.prompt_len == BUCKET and result.lengths.tolist() == [t]
    assert_close(result.logits[0], reference[t - 1], f"{strategy} logits at length {t}")
  assert TRACE_COUNT[strategy] == before  # no new program for any of the dozen lengths
  exact = kvr_jax.prefill(model, prompt[: LENGTHS[3]])
  t = LENGTHS[3]
  padded = kvr_jax.prefill(model, prompt[:t], strategy=strategy, buckets="auto", **kwargs)
  assert_close(padded.k_cache[:, :, :t], exact.k_cache, f"{strategy} K cache, real positions")
  assert_close(padded.v_cache[:, :, :t], exact.v_cache, f"{strategy} V cache, real positions")


# Three rows of different lengths, each ending on a different rank's chunk, in the bucket of
# the longest (112): their greedy tokens also check decoding from a bucket.
RAGGED = (70, 23, 101)


@pytest.mark.default_cases("allgather-last")
@pytest.mark.parametrize(
  "strategy,cache",
  [
    ("single", "last"),
    ("kvr", "last"),
    ("kvr", "sharded"),
    ("ring", "last"),
    ("allgather", "last"),
  ],
)
def test_a_ragged_batch_equals_its_rows_run_alone(model, prompt, reference, mesh, strategy, cache):
  rows = [prompt[BUCKET - t :] for t in RAGGED]  # different contents, not only lengths
  kwargs = {} if strategy == "single" else {"mesh": mesh}
  got = kvr_jax.generate(
    model, rows, NEW_TOKENS, strategy=strategy, cache=cache, buckets="auto", **kwargs
  )
  assert got.prefill.lengths.tolist() == list(RAGGED)
  assert got.prefill.prompt_len == buckets.auto_bucket(max(RAGGED))
  for i, row in enumerate(rows):
    want = alone(model, row)
    assert_close(got.prefill.logits[i], want.prefill.logits[0], f"{strategy} row {i} logits")
    np.testing.assert_array_equal(got.tokens[i], want.tokens[0], f"{strategy} row {i} tokens")


@pytest.mark.default_cases("kvr-sharded")
@pytest.mark.parametrize(
  "strategy,cache",
  [
    ("kvr", "last"),
    ("kvr", "sharded"),
    ("ring", "last"),
    ("allgather", "sharded"),
    ("tsp", "last"),
  ],
)
def test_a_ragged_batch_on_a_2d_mesh_equals_its_rows_run_alone(
  model, prompt, reference, strategy, cache
):
  """On a ("ranks", "model") mesh (2 x 2): the last real tokens' step over the last rank's
  model group (cache="last") or the parts with a tail split by KV head (cache="sharded")."""
  rows = [prompt[BUCKET - t :] for t in RAGGED]
  mesh = kvr_jax.make_mesh(2, model=2)
  got = kvr_jax.generate(model, rows, NEW_TOKENS, strategy=strategy, cache=cache, mesh=mesh)
  assert got.prefill.lengths.tolist() == list(RAGGED)
  for i, row in enumerate(rows):
    want = alone(model, row)
    assert_close(got.prefill.logits[i], want.prefill.logits[0], f"{strategy} row {i} logits")
    np.testing.assert_array_equal(got.tokens[i], want.tokens[0], f"{strategy} row {i} tokens")


def test_a_ragged_batch_without_buckets_pads_to_its_longest_row(model, prompt, reference):
  rows = [prompt[:40], prompt[:33]]
  result = kvr_jax.prefill(model, rows)
  assert result.prompt_len == 40 and result.lengths.tolist() == [40, 33]
  assert_close(result.logits[1], reference[32], "the shorter row's logits")
  equal = kvr_jax.prefill(model, [prompt[:40], prompt[:40]])  # no padding: no decode step
  assert equal.prompt_len == 40 and equal.lengths.tolist() == [40, 40]


@pytest.mark.parametrize(
  "tokens,kwargs,message",
  [
    ([[5, 6, 7], []], {}, "prompt row 1 is empty"),
    ([[5, 6], [7, 600]], {}, "token id 600 at position 1 of prompt row 1 is outside"),
    ([[5, 6], [7] * 8193], {}, "prompt row 1: 8193 tokens exceeds max_position_embeddings"),
    ([[5, 6, 7]], {"buckets": (64, 32)}, "strictly increasing"),
    ([[5, 6, 7]], {"buckets": (64, 9000)}, "bucket 9000 is past the model's"),
    ([[5, 6, 7]], {"buckets": (0, 64)}, "positive integers"),
    ([[5, 6, 7]], {"buckets": "octaves"}, "`buckets` must be None"),
    (
      [list(range(3, 120))],
      {"buckets": "auto", "strategy": "kvr", "partition": [60, 57]},
      "sums to 117, but the prompt runs padded to its bucket of 128",
    ),
  ],
)
def test_bad_ragged_and_bucketed_input_is_one_clear_error(model, mesh, tokens, kwargs, message):
  before = sum(TRACE_COUNT.values())
  if kwargs.get("strategy") == "kvr":
    kwargs = dict(kwargs, mesh=kvr_jax.make_mesh(2))
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    kvr_jax.prefill(model, tokens, **kwargs)
  assert sum(TRACE_COUNT.values()) == before  # refused before anything was traced


def test_one_plan_runs_every_prompt_of_its_bucket(model, mesh):
  """plan_prefill decides everything once (no compile); run_prefill runs any prompt of the
  plan's bucket and batch through one program, each row as prefill gives it, and refuses a
  prompt of another shape by name before running."""
  from kvr_jax.inference.prefill import plan_prefill, run_prefill

  rng = np.random.RandomState(7)
  short, longer = (rng.randint(0, model.config.vocab_size, (1, n)) for n in (40, 58))
  before = TRACE_COUNT["kvr"]
  plan = plan_prefill(model, short, "kvr", mesh=mesh, partition="even", buckets=[64])
  assert TRACE_COUNT["kvr"] == before  # planning compiles nothing
  assert (plan.prompt_len, plan.batch, plan.chunks) == (64, 1, (16, 16, 16, 16))
  traces = []
  for tokens in (short, longer):
    got = run_prefill(model, plan, tokens)
    traces.append(TRACE_COUNT["kvr"])
    want = kvr_jax.prefill(model, tokens, "kvr", mesh=mesh, partition="even", buckets=[64])
    assert_close(got.logits, want.logits, "logits")
    assert_close(got.k_cache, want.k_cache, "K cache")
  # One program for the bucket (compiled by the first run, unless an earlier test had):
  # the second prompt compiles nothing.
  assert traces[0] <= before + 1 and traces[1] == traces[0] == TRACE_COUNT["kvr"]
  with pytest.raises(ValueError, match="plan runs 1 row.* padded to 64 tokens"):
    run_prefill(model, plan, rng.randint(0, model.config.vocab_size, (2, 40)))
  # A prompt exactly a bucket long is not padded to the next bucket (explicit or auto).
  exact = rng.randint(0, model.config.vocab_size, (1, 128))
  for ladder in ([64, 128, 256], "auto"):
    planned = plan_prefill(model, exact, "kvr", mesh=mesh, partition="even", buckets=ladder)
    assert (planned.prompt_len, planned.padded) == (128, False), ladder
