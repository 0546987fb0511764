"""Pure per-layer maths: masks against literal matrices, RoPE, attention over an offset prefix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import attend, attend_blocked
from models.config import RopeConfig
from models.masks import causal_mask
from models.rope import apply_rope, rope_inv_freq

TOL = 1e-5


def jitted(kernel):
  """`kernel` compiled as one program (q, k, v traced; offsets and options static): far
  faster here than running its scans and loops op by op."""

  def call(q, k, v, *static, **options):
    return jax.jit(lambda q, k, v: kernel(q, k, v, *static, **options))(q, k, v)

  return call


def test_causal_mask_square_is_lower_triangular():
  expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], bool)
  np.testing.assert_array_equal(causal_mask(4, 4, 0), expected)


def test_causal_mask_with_offset_is_last_diagonal_block():
  # Two queries at positions 3 and 4 attending to a 5-key prefix (a KV-Runahead rank).
  expected = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
  np.testing.assert_array_equal(causal_mask(2, 5, 3), expected)


def test_causal_mask_hides_unfilled_cache_tail():
  # One decode query at position 2 over a cache of capacity 6.
  expected = np.array([[1, 1, 1, 0, 0, 0]], bool)
  np.testing.assert_array_equal(causal_mask(1, 6, 2), expected)


def test_rope_position_zero_is_identity_and_preserves_norm():
  x = jax.random.normal(jax.random.key(0), (1, 5, 3, 8))
  rope = RopeConfig(theta=100.0)
  zero = apply_rope(x, jnp.zeros((1, 5), jnp.int32), rope)
  np.testing.assert_allclose(zero, x, atol=TOL)
  rotated = apply_rope(x, jnp.arange(5)[None], rope)
  np.testing.assert_allclose(
    jnp.linalg.norm(rotated, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=TOL
  )


def test_rope_literal_two_dims():
  # head_dim 2: one frequency (1.0); position m rotates (a, b) by m radians.
  x = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
  out = apply_rope(x, jnp.array([[1]]), RopeConfig(theta=10000.0))
  np.testing.assert_allclose(out.reshape(2), [np.cos(1.0), np.sin(1.0)], atol=TOL)


def test_rope_scores_depend_only_on_relative_position():
  rope = RopeConfig(theta=10000.0)
  q = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(2), (1, 1, 1, 16))

  def score(m, n):
    qm = apply_rope(q, jnp.array([[m]]), rope)
    kn = apply_rope(k, jnp.array([[n]]), rope)
    return float(jnp.sum(qm * kn))

  assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-4)
  assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-2)


@pytest.mark.parametrize("rope_type", ["linear", "llama3"])
def test_rope_scaling_slows_long_wavelengths(rope_type):
  base = rope_inv_freq(64, RopeConfig(theta=10000.0))
  scaled = rope_inv_freq(
    64, RopeConfig(theta=10000.0, type=rope_type, factor=8.0, original_max_position_embeddings=512)
  )
  # The lowest frequency is divided by the factor in both schemes.
  assert scaled[-1] == pytest.approx(base[-1] / 8.0, rel=1e-6)
  if rope_type == "llama3":
    assert scaled[0] == pytest.approx(base[0], rel=1e-6)  # high frequencies kept


def test_attend_over_offset_prefix_equals_rows_of_full_attention():
  B, C, N, K, H = 2, 12, 4, 2, 8
  keys = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(keys[0], (B, C, N, H))
  k = jax.random.normal(keys[1], (B, C, K, H))
  v = jax.random.normal(keys[2], (B, C, K, H))
  full = attend(q, k, v, query_offset=0)
  # A rank owning tokens [5, 9) attends to the prefix [0, 9) only.
  part = attend(q[:, 5:9], k[:, :9], v[:, :9], query_offset=5)
  np.testing.assert_allclose(part, full[:, 5:9], atol=TOL)


def test_attend_grouped_query_matches_repeated_heads():
  B, T, N, K, H = 1, 6, 6, 2, 4
  keys = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(keys[0], (B, T, N, H))
  k = jax.random.normal(keys[1], (B, T, K, H))
  v = jax.random.normal(keys[2], (B, T, K, H))
  repeated = attend(q, jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2), 0)
  np.testing.assert_allclose(attend(q, k, v, 0), repeated, atol=TOL)


def test_future_token_has_no_influence_on_past_outputs():
  B, T, N, H = 1, 8, 2, 4
  keys = jax.random.split(jax.random.key(5), 3)
  q, k, v = (jax.random.normal(kk, (B, T, N, H)) for kk in keys)
  out = attend(q, k, v, 0)
  k2, v2 = k.at[:, 5].set(100.0), v.at[:, 5].set(-100.0)
  out2 = attend(q, k2, v2, 0)
  np.testing.assert_allclose(out2[:, :5], out[:, :5], atol=TOL)
  assert not np.allclose(out2[:, 5:], out[:, 5:], atol=1e-2)


@pytest.mark.default_cases("5-64")
@pytest.mark.parametrize("offset,T", [(0, 300), (37, 129), (5, 64)])
def test_blocked_attention_equals_dense(offset, T):
  B, N, K, H = 1, 4, 2, 8
  keys = jax.random.split(jax.random.key(6), 3)
  S = offset + T
  q = jax.random.normal(keys[0], (B, T, N, H))
  k = jax.random.normal(keys[1], (B, S, K, H))
  v = jax.random.normal(keys[2], (B, S, K, H))
  dense = jitted(attend)(q, k, v, offset)
  np.testing.assert_allclose(jitted(attend_blocked)(q, k, v, offset, 128), dense, atol=TOL)
  np.testing.assert_allclose(jitted(attend_blocked)(q, k, v, offset, 16), dense, atol=TOL)
