"""Gated DeltaNet's maths (models/gated_deltanet.py) against a direct token-by-token
recurrence written here, against transformers' own functions, and the affine entry map that
KV-Runahead's state hop rests on. No devices, no model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models import gated_deltanet as gdn
from tests.tolerance import assert_close

B, T, H_V, D_K, D_V = 2, 150, 3, 8, 6  # T is no multiple of the 64-token chunk


def rule_inputs(seed: int, T: int = T):
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (B, T, H_V, D_K))
  k = jax.random.normal(keys[1], (B, T, H_V, D_K))
  v = jax.random.normal(keys[2], (B, T, H_V, D_V))
  # Slow decays (as trained models have): the state outlives a span, so a test sees it.
  g = -0.02 * jax.nn.softplus(jax.random.normal(keys[3], (B, T, H_V)))
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H_V)))
  state = jax.random.normal(keys[5], (B, H_V, D_K, D_V))
  q, k, g = gdn.prepare(q, k, g)
  return q, k, v, g, beta, state


def direct_rule(q, k, v, g, beta, state):
  """The rule as its definition reads, one token and one head at a time, in numpy float64."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  S = np.array(state, np.float64)
  out = np.zeros(v.shape)
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      for t in range(q.shape[1]):
        S[b, h] *= np.exp(g[b, t, h])
        delta = beta[b, t, h] * (v[b, t, h] - S[b, h].T @ k[b, t, h])
        S[b, h] += np.outer(k[b, t, h], delta)
        out[b, t, h] = S[b, h].T @ q[b, t, h]
  return out, S


@pytest.fixture(scope="module")
def inputs():
  return rule_inputs(0)


@pytest.fixture(scope="module")
def expected(inputs):
  return direct_rule(*inputs)


def test_recurrent_form_is_the_rule(inputs, expected):
  out, final = jax.jit(gdn.recurrent)(*inputs)
  assert_close(out, expected[0], "recurrent outputs")
  assert_close(final, expected[1], "recurrent final state")


def test_chunked_form_is_the_rule(inputs, expected):
  out, final = jax.jit(gdn.chunked)(*inputs)
  assert_close(out, expected[0], "chunked outputs")
  assert_close(final, expected[1], "chunked final state")


def test_chunked_form_matches_transformers_function(inputs):
  from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

  q, k, v, g, beta, state = inputs
  # transformers takes raw q and k (it normalises and scales them itself): undo our scale.
  raw_q = np.asarray(q) * D_K**0.5
  torch_args = [torch.from_numpy(np.array(x)) for x in (raw_q, k, v, g, beta)]
  want_out, want_state = hf.torch_chunk_gated_delta_rule(
    *torch_args,
    initial_state=torch.from_numpy(np.array(state)),
    output_final_state=True,
    use_qk_l2norm_in_kernel=True,
  )
  out, final = jax.jit(gdn.chunked)(*inputs)
  assert_close(out, want_out.numpy(), "chunked outputs against transformers")
  assert_close(final, want_state.numpy(), "final state against transformers")


def test_entry_map_gives_any_entering_state(inputs):
  """A span run before its entering state is known, then corrected: the same outputs and
  leaving state as the span run from that state (KV-Runahead's state hop)."""
  q, k, v, g, beta, state = inputs
  maps = jax.jit(gdn.chunked_with_entry_map)(q, k, v, g, beta)
  want_out, want_final = jax.jit(gdn.chunked)(q, k, v, g, beta, state)
  out, final = gdn.apply_entry_state(*maps, state)
  assert_close(out, want_out, "outputs from the entry map")
  assert_close(final, want_final, "leaving state from the entry map")


@pytest.mark.default_cases("0", "101")
@pytest.mark.parametrize("real_rows", [0, 37, 64, 101])
def test_entry_map_up_to_a_traced_length_is_the_real_spans(inputs, real_rows):
  """`chunked_with_entry_map_upto` over the whole padded span with `real_rows` real rows (the
  rest padding: g = beta = 0) gives the maps of the real rows alone: the same outputs on them,
  the same A and B (the one body's linear layer runs it at each rank's length)."""
  q, k, v, g, beta, _ = inputs
  real_T = jnp.arange(q.shape[1]) < real_rows
  g, beta = (jnp.where(real_T[:, None], x, 0) for x in (g, beta))
  got = jax.jit(gdn.chunked_with_entry_map_upto)(q, k, v, g, beta, jnp.asarray(real_rows))
  if real_rows == 0:  # no real row: the identity map, and nothing enters the state
    np.testing.assert_array_equal(got[2], jnp.broadcast_to(jnp.eye(q.shape[3]), got[2].shape))
    np.testing.assert_array_equal(got[3], 0)
    return
  want = gdn.chunked_with_entry_map(*(x[:, :real_rows] for x in (q, k, v, g, beta)))
  assert_close(got[0][:, :real_rows], want[0], "outputs of the real rows")
  assert_close(got[1][:, :real_rows], want[1], "Q_eff of the real rows")
  assert_close(got[2], want[2], "A")
  assert_close(got[3], want[3], "B")


def test_spans_chained_by_their_states_are_the_whole(inputs, expected):
  """Three uneven spans (not chunk-aligned), each entered with the state the previous one
  left, as KV-Runahead's ranks: the whole prompt's outputs and final state."""
  q, k, v, g, beta, state = inputs
  outs, S = [], state
  for a, b in ((0, 37), (37, 101), (101, T)):
    maps = gdn.chunked_with_entry_map(*(x[:, a:b] for x in (q, k, v, g, beta)))
    out, S = gdn.apply_entry_state(*maps, S)
    outs.append(out)
  assert_close(jnp.concatenate(outs, axis=1), expected[0], "chained span outputs")
  assert_close(S, expected[1], "chained final state")


def test_causal_conv_matches_transformers_and_chains_by_halo():
  from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

  C, W = 5, 4
  x = jax.random.normal(jax.random.key(1), (B, 23, C))
  kernel_WC = jax.random.normal(jax.random.key(2), (W, C))
  zeros = jnp.zeros((B, W - 1, C))
  whole, halo = gdn.causal_conv(x, kernel_WC, zeros)
  want = hf.causal_conv1d_fn(
    torch.from_numpy(np.array(x)).transpose(1, 2),
    torch.from_numpy(np.asarray(kernel_WC).T.copy()),
    activation="silu",
  ).transpose(1, 2)
  assert_close(whole, want.numpy(), "convolution against transformers")
  np.testing.assert_array_equal(halo, x[:, -(W - 1) :])
  # Two pieces, the second entered with the first's halo (a rank's convolution halo).
  first, first_halo = gdn.causal_conv(x[:, :2], kernel_WC, zeros)  # shorter than the halo
  second, _ = gdn.causal_conv(x[:, 2:], kernel_WC, first_halo)
  assert_close(jnp.concatenate([first, second], axis=1), whole, "convolution in two pieces")


def test_unit_lower_inverse_inverts_and_the_chunked_form_calls_no_lapack_solve(inputs):
  """The chunk's triangular system is inverted by blocks in matmuls (numpy's inverse within
  float32's 1e-5), never by jaxlib's batched LAPACK solve, which can hang on a CPU whose
  thread pool it waits in (see `unit_lower_inverse`); a size that is no power of two is
  refused by name."""
  rng = np.random.RandomState(3)
  for n in (1, 2, 16, 64):
    lower = np.tril(rng.randn(2, 3, n, n) * 0.3, -1) + np.eye(n)
    got = gdn.unit_lower_inverse(jnp.asarray(lower, jnp.float32))
    assert_close(got, np.linalg.inv(lower), f"inverse of {n} x {n}")
  with pytest.raises(ValueError, match="power-of-two"):
    gdn.unit_lower_inverse(jnp.eye(48))
  jaxpr = jax.make_jaxpr(gdn.chunked)(*inputs)
  assert "triangular_solve" not in str(jaxpr)
