"""Mixtures of experts (Qwen3-MoE, Mixtral): the grouped matmul against a dense reference,
every strategy against single, the cost model's active parameters, the presets. Parity with
transformers is in tests/test_config_fidelity.py (qwen3_moe and mixtral checkpoints).

Tolerances (fixed): float32 kernels and strategies against each other within 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvr_jax
from kvr_jax.planning import costmodel
from kvr_jax.runtime.loading import preset_config
from models.experts import expert_rows, mixture_of_experts
from tests.tolerance import assert_close


def dense_reference(h_BTD, router_DE, w_gate, w_up, w_down, top_k, normalize):
  """Every expert on every token, weighted by the router (zero outside a token's top k)."""
  probs = jax.nn.softmax(jnp.einsum("BTD,DE->BTE", h_BTD, router_DE), axis=-1)
  top, _ = jax.lax.top_k(probs, top_k)
  weights = jnp.where(probs >= top[..., -1:], probs, 0.0)
  if normalize:
    weights = weights / weights.sum(-1, keepdims=True)
  gate = jax.nn.silu(jnp.einsum("BTD,EDF->BTEF", h_BTD, w_gate))
  out = jnp.einsum("BTEF,EFD->BTED", gate * jnp.einsum("BTD,EDF->BTEF", h_BTD, w_up), w_down)
  return jnp.einsum("BTED,BTE->BTD", out, weights)


@pytest.mark.default_cases("0.0-False", "8.0-True", "8.0-False")
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("skew", [0.0, 8.0])
def test_grouped_experts_equal_every_expert_weighted(normalize, skew):
  """No token dropped, none counted twice: with routing spread or piled onto one expert (a
  router biased to expert 0), the tiled matmul equals the dense sum over experts."""
  rng = np.random.RandomState(0)
  B, T, D, F, E, k = 2, 150, 16, 24, 6, 2
  h = jnp.asarray(rng.randn(B, T, D), jnp.float32)
  router = rng.randn(D, E)
  router[:, 0] += skew * np.sign(np.asarray(h).mean((0, 1)))  # most tokens pick expert 0
  experts = [jnp.asarray(rng.randn(E, *shape) * 0.3, jnp.float32) for shape in ((D, F),) * 2]
  w_down = jnp.asarray(rng.randn(E, F, D) * 0.3, jnp.float32)
  args = (h, jnp.asarray(router, jnp.float32), *experts, w_down, k, normalize)
  assert_close(mixture_of_experts(*args), dense_reference(*args), "experts")


def test_tiles_follow_the_active_experts():
  """The loop runs only the tiles that hold pairs: at most P/tile + E of them, and exactly
  one tile per expert when each expert gets fewer pairs than a tile."""
  expert_P = jnp.asarray([0, 0, 0, 3, 3, 1] * 40, jnp.int32)  # 240 pairs, experts 0, 1, 3
  rows, tile = expert_rows(expert_P, num_experts=5, max_tile=64)
  counts = np.bincount(np.asarray(expert_P), minlength=5)
  assert int(rows.tiles_used) == sum(-(-c // tile) for c in counts) == 2 + 1 + 2
  assert rows.num_rows == (-(-240 // tile) + 5) * tile
  # Every pair its own row, inside its expert's tiles.
  row_P = np.asarray(rows.row_P)
  assert len(set(row_P.tolist())) == 240
  tile_expert = np.asarray(rows.expert_of_tile)[row_P // tile]
  np.testing.assert_array_equal(tile_expert, np.asarray(expert_P))


@pytest.fixture(scope="module")
def moe_model():
  return kvr_jax.load_model("tiny-moe")


@pytest.fixture(scope="module")
def tokens():
  return np.random.RandomState(3).randint(0, 512, (2, 61))


@pytest.mark.default_cases("allgather-None")
@pytest.mark.parametrize(
  "strategy,partition", [("kvr", [25, 20, 10, 6]), ("ring", None), ("allgather", None)]
)
def test_every_strategy_runs_the_experts_as_single_does(moe_model, tokens, strategy, partition):
  want = kvr_jax.prefill(moe_model, tokens)
  got = kvr_jax.prefill(moe_model, tokens, strategy, kvr_jax.make_mesh(4), partition)
  assert_close(got.logits, want.logits, f"{strategy} logits")
  assert_close(got.k_cache, want.k_cache, f"{strategy} K cache")
  assert_close(got.v_cache, want.v_cache, f"{strategy} V cache")


def test_decode_through_the_experts_matches_single(moe_model, tokens):
  mesh = kvr_jax.make_mesh(4)
  single = kvr_jax.generate(moe_model, tokens, max_new_tokens=6).tokens
  kvr = kvr_jax.generate(
    moe_model, tokens, 6, strategy="kvr", mesh=mesh, partition=[25, 20, 10, 6], cache="sharded"
  ).tokens
  np.testing.assert_array_equal(kvr, single)


@pytest.mark.parametrize(
  "name,params,active",
  # transformers' own count of the published configs (Qwen3MoeForCausalLM, MixtralForCausalLM
  # on the meta device), and the active parameters per token the model cards state (3.3B,
  # 12.9B: attention, k experts, router, embeddings).
  [("qwen3-30b-a3b", 30_532_122_624, 3.3e9), ("mixtral-8x7b", 46_702_792_704, 12.9e9)],
)
def test_moe_presets_have_the_published_parameter_counts(name, params, active):
  config = preset_config(name)
  assert config.num_params() == params
  dense_experts = config.mlp_matrices * config.d_model * config.mlp_dim
  inactive = (config.num_experts - config.experts_per_token) * dense_experts * config.num_layers
  assert params - inactive == pytest.approx(active, rel=0.03)


def test_the_cost_model_counts_active_experts():
  """A token's MLP FLOPs are its k experts' and the router's; the weights read are every
  expert some token routes to: k experts for one token, all E for a long prompt."""
  config = preset_config("qwen3-30b-a3b")
  D, F, E, k = config.d_model, config.mlp_dim, config.num_experts, config.experts_per_token
  out_proj = 2 * config.num_heads * config.head_dim * D
  for T in (1, 4096):
    rest = costmodel.phase_work(config, T, T, 1, 2)["rest"]
    assert rest.flops == T * (out_proj + 2 * D * (3 * k * F + E))
    experts_read = min(E, T * k)
    weights = config.num_heads * config.head_dim * D + 3 * D * F * experts_read + D * E
    activations = T * (config.num_heads * config.head_dim + 2 * D + 2 * k * F)
    assert rest.bytes == 2 * (weights + activations)
