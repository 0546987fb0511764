"""Single-device prefill and generate: results, determinism and every bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvr_jax
from kvr_jax.inference import decode
from kvr_jax.inference.generate import decode_from


@pytest.fixture(scope="module")
def model():
  return kvr_jax.load_model("tiny-llama")


@pytest.fixture(scope="module")
def prompt():
  return np.random.RandomState(0).randint(0, 512, (2, 24))


def test_prefill_single_shapes_and_last_logits(model, prompt):
  result = kvr_jax.prefill(model, prompt)
  cfg = model.config
  assert result.logits.shape == (2, cfg.vocab_size)
  assert result.k_cache.shape == (cfg.num_layers, 2, 24, cfg.num_kv_heads, cfg.head_dim)
  assert result.prompt_len == 24
  np.testing.assert_allclose(
    np.asarray(result.logits), np.asarray(model.module(prompt))[:, -1], atol=1e-5
  )


def test_decode_steps_match_a_longer_prefill(model, prompt):
  """Greedy continuation scored by a fresh prefill picks the same tokens."""
  out = kvr_jax.generate(model, prompt, max_new_tokens=6).tokens
  extended = np.concatenate([prompt, out[:, :5]], axis=1)
  predicted = np.asarray(model.module(extended))[:, 23:].argmax(-1)
  eos = model.config.eos_token_id
  for row in range(2):  # after EOS a row is padded, so compare up to its first EOS
    stop = list(out[row]).index(eos) + 1 if eos in out[row] else 6
    np.testing.assert_array_equal(predicted[row, :stop], out[row, :stop])
  assert out.shape == (2, 6)


def test_greedy_is_deterministic_and_sampling_depends_on_seed(model, prompt):
  a = kvr_jax.generate(model, prompt, max_new_tokens=8).tokens
  b = kvr_jax.generate(model, prompt, max_new_tokens=8).tokens
  np.testing.assert_array_equal(a, b)
  s1 = kvr_jax.generate(model, prompt, 8, temperature=5.0, seed=1).tokens
  s1_again = kvr_jax.generate(model, prompt, 8, temperature=5.0, seed=1).tokens
  s2 = kvr_jax.generate(model, prompt, 8, temperature=5.0, seed=2).tokens
  np.testing.assert_array_equal(s1, s1_again)
  assert not np.array_equal(s1, s2)


def test_top_k_one_is_greedy(model, prompt):
  greedy = kvr_jax.generate(model, prompt, 6).tokens
  np.testing.assert_array_equal(
    kvr_jax.generate(model, prompt, 6, temperature=3.0, top_k=1).tokens, greedy
  )
  np.testing.assert_array_equal(
    kvr_jax.generate(model, prompt, 6, temperature=3.0, top_p=1e-6).tokens, greedy
  )


def test_stops_at_eos(model, prompt):
  greedy = kvr_jax.generate(model, prompt[:1], 6).tokens[0]
  out = _with_eos(model, int(greedy[1]), prompt[:1], 6)[0]
  # The row ends at its first EOS and is padded with EOS to the [B, n] it promises.
  first = list(greedy).index(greedy[1])
  assert first + 1 < 6
  want = np.concatenate([greedy[: first + 1], np.full(6 - first - 1, greedy[1])])
  np.testing.assert_array_equal(out, want)


def test_a_row_that_ends_early_keeps_its_eos_while_the_others_decode(model, prompt):
  """Two rows, an EOS that only row 0 draws: row 0 is EOS from there on, row 1 decodes on."""
  greedy = kvr_jax.generate(model, prompt, 6).tokens
  eos = next(int(t) for t in greedy[0, :3] if t not in greedy[1])
  out = _with_eos(model, eos, prompt, 6)
  first = list(greedy[0]).index(eos)
  np.testing.assert_array_equal(out[0, : first + 1], greedy[0, : first + 1])
  np.testing.assert_array_equal(out[0, first:], np.full(6 - first, eos))
  np.testing.assert_array_equal(out[1], greedy[1])


def _with_eos(model, eos: int, prompt, n: int) -> np.ndarray:
  """generate's tokens with `eos` as the model's EOS."""
  import dataclasses

  eos_model = kvr_jax.Model(model.module)
  eos_model.module.config = dataclasses.replace(model.config, eos_token_id=eos)
  try:
    return kvr_jax.generate(eos_model, prompt, n).tokens
  finally:
    eos_model.module.config = model.config


@pytest.mark.parametrize(
  "tokens,message",
  [
    (np.zeros((1, 0), np.int32), "empty"),
    ([[1, 2], []], "prompt row 1 is empty"),
    (np.array([[1, 2, 512]]), "outside the vocabulary"),
    (np.array([[1, -1]]), "outside the vocabulary"),
    (np.array([[1.5, 2.0]]), "integer"),
  ],
)
def test_bad_prompts(model, tokens, message):
  with pytest.raises(ValueError, match=message):
    kvr_jax.prefill(model, tokens)


def test_bad_generate_arguments(model, prompt):
  limit = model.config.max_position_embeddings
  with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
    kvr_jax.generate(model, prompt, max_new_tokens=limit)
  with pytest.raises(ValueError, match="max_new_tokens"):
    kvr_jax.generate(model, prompt, max_new_tokens=0)
  with pytest.raises(ValueError, match="tokenizer"):
    kvr_jax.generate(model, "hello", max_new_tokens=2)
  with pytest.raises(ValueError, match="top_k"):
    kvr_jax.generate(model, prompt, 2, top_k=0)
  with pytest.raises(ValueError, match="unknown strategy"):
    kvr_jax.prefill(model, prompt, strategy="ulysses")


def _with_first_logits(result, logits_BV):
  return dataclasses.replace(result, logits=jax.device_put(logits_BV, result.device))


def test_the_last_vocabulary_id_can_be_decoded(model, prompt):
  """First-token logits whose argmax is id V-1 (greedy and a near-zero temperature): a
  decoder that drops the last column cannot pass."""
  result = kvr_jax.prefill(model, prompt)
  V = model.config.vocab_size
  logits = jnp.zeros((2, V)).at[:, V - 1].set(5.0).at[:, 0].set(4.0)
  fixed = _with_first_logits(result, logits)
  assert list(decode_from(model, fixed, 1).tokens[:, 0]) == [V - 1, V - 1]
  sampled = decode_from(model, fixed, 1, temperature=1e-3, seed=3).tokens
  assert list(sampled[:, 0]) == [V - 1, V - 1]


def test_temperature_shapes_the_distribution():
  """One logit row drawn 512 times: a low temperature is greedy, a high one spreads the draws
  almost uniformly, T=1 lies between (fixed seed)."""
  logits = jnp.broadcast_to(jnp.linspace(0.0, 30.0, 64), (512, 64))
  key = jax.random.key(0)

  def distinct(temperature):
    tokens = decode.sample(logits, key, temperature, top_k=None, top_p=None)
    return np.unique(np.asarray(tokens)), np.asarray(tokens)

  cold, cold_tokens = distinct(1e-30)  # far below any logit gap: exactly greedy
  assert list(cold) == [63] and (cold_tokens == 63).all()
  warm, _ = distinct(1.0)
  hot, _ = distinct(100.0)
  assert len(warm) < 40 < len(hot), (len(warm), len(hot))


def test_a_tiny_positive_temperature_is_greedy_or_refused(model, prompt):
  greedy = kvr_jax.generate(model, prompt, 4).tokens
  np.testing.assert_array_equal(
    kvr_jax.generate(model, prompt, 4, temperature=1e-37).tokens, greedy
  )
  with pytest.raises(ValueError, match="smallest normal number.*temperature=0"):
    kvr_jax.generate(model, prompt, 4, temperature=1e-39)


def test_numpy_integers_are_accepted(model, prompt):
  want = kvr_jax.generate(model, prompt, 3, temperature=2.0, top_k=5, seed=7).tokens
  got = kvr_jax.generate(
    model, prompt, np.int64(3), temperature=2.0, top_k=np.int32(5), seed=np.int64(7)
  ).tokens
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
  "kwargs,message",
  [
    (dict(seed=2**70), "seed"),
    (dict(seed="abc"), "seed"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_new_tokens=True), "max_new_tokens"),
  ],
)
def test_bad_sampling_arguments_are_one_clear_error(model, prompt, kwargs, message):
  kwargs = {"max_new_tokens": 2, **kwargs}
  with pytest.raises(ValueError, match=message):
    kvr_jax.generate(model, prompt, **kwargs)
