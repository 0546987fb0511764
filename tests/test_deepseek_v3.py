"""DeepSeek-V3 (multi-head latent attention, DeepSeek's grouped sigmoid router, shared expert,
dense first layers) against transformers through the project's own loader: logits of every
position, decode from the latent cache in the absorbed form, greedy tokens, the published
shape, and what is refused by name."""

import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvr_jax
from models.families import config_from_hf
from tests import hf_fixtures
from tests.tolerance import assert_close

MODEL_TOL = 1e-4  # whole models against transformers, float32
CASES = list(hf_fixtures.DEEPSEEK_CASES)
T = 40


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """case -> (torch model, directory written with save_pretrained, our loaded model)."""
  out = {}
  for case in CASES:
    hf_model = hf_fixtures.make_deepseek_model(case)
    directory = tmp_path_factory.mktemp(case)
    hf_model.save_pretrained(directory)
    out[case] = (hf_model, str(directory), kvr_jax.load_model(str(directory)))
  return out


@pytest.fixture(scope="module")
def tokens():
  return np.random.RandomState(1).randint(0, hf_fixtures.VOCAB, (2, T))


@pytest.fixture(scope="module")
def forward():
  """Every position's logits and the latent cache, compiled once per model."""

  @jax.jit
  def run(module, tokens_BT, capacity_like):
    x_BTD, cache = module.forward(tokens_BT, capacity=capacity_like.shape[0])
    return module.logits(x_BTD), cache

  return lambda module, tokens, capacity=None: run(
    module, jnp.asarray(tokens), jnp.zeros(capacity or tokens.shape[1])
  )


def relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("case", CASES)
def test_logits_every_position_match_transformers(checkpoints, tokens, forward, case):
  hf_model, _, ours = checkpoints[case]
  logits, _ = forward(ours.module, tokens)
  err = relative_error(logits, hf_fixtures.hf_logits(hf_model, tokens))
  assert err <= MODEL_TOL, f"{case}: relative error {err:.2e} > {MODEL_TOL}"


def test_config_and_parameters_read_as_transformers(checkpoints):
  hf_model, _, ours = checkpoints["deepseek-default"]
  cfg = ours.config
  assert (cfg.first_dense_layers, cfg.moe_layers, cfg.cache_width) == (1, 2, 16 + 8)
  assert (cfg.num_expert_groups, cfg.groups_per_token, cfg.experts_per_token) == (4, 2, 3)
  assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters())
  bias = hf_model.model.layers[1].mlp.gate.e_score_correction_bias.numpy()
  np.testing.assert_array_equal(ours.module.blocks.choice_bias[...][0], bias)
  yarn = checkpoints["deepseek-yarn"][2].config
  # transformers' scaling: (n + r)^-0.5 times (0.1 ln(4) + 1)^2 (mscale_all_dim 1)
  want = checkpoints["deepseek-yarn"][0].model.layers[0].self_attn.scaling
  assert yarn.softmax_scale == pytest.approx(want, rel=1e-12)
  assert yarn.softmax_scale != pytest.approx(cfg.softmax_scale)


@pytest.fixture(scope="module")
def decoded(checkpoints, tokens, forward):
  """Greedy decoding of 6 tokens from a 24-token prompt through the latent cache (the
  absorbed form): (tokens [2, 6], each step's logits [6, 2, V])."""
  _, _, ours = checkpoints["deepseek-default"]
  prompt = tokens[:, :24]
  logits, cache = forward(ours.module, prompt, capacity=24 + 6)
  step = jax.jit(lambda module, t, p, c: module.decode_step(t, p, c))
  positions = jnp.full((2,), 24)
  next_B = jnp.argmax(logits[:, -1], axis=-1)
  out, steps = [], []
  for _ in range(6):
    out.append(next_B)
    step_logits, cache = step(ours.module, next_B, positions, cache)
    steps.append(step_logits)
    next_B, positions = jnp.argmax(step_logits, axis=-1), positions + 1
  return np.stack(out, axis=1), np.stack(steps)


def test_absorbed_decode_equals_the_expanded_forward(checkpoints, tokens, forward, decoded):
  """Each decode step (queries taken into the latent space, the C-wide cache as one key head)
  gives the logits of the forward over the prompt and the tokens so far (every head's K,V
  expanded)."""
  _, _, ours = checkpoints["deepseek-default"]
  new_tokens, step_logits = decoded
  sequence = np.concatenate([tokens[:, :24], new_tokens], axis=1)
  logits, _ = forward(ours.module, sequence)
  assert_close(step_logits.transpose(1, 0, 2), np.asarray(logits[:, 24:30]), "decode logits")


def test_greedy_decode_matches_transformers(checkpoints, tokens, decoded):
  hf_model, _, _ = checkpoints["deepseek-default"]
  new_tokens, _ = decoded
  np.testing.assert_array_equal(new_tokens, hf_fixtures.hf_greedy(hf_model, tokens[:, :24], 6))


def test_cache_is_one_latent_per_token(checkpoints, tokens, forward):
  """The cache holds C = kv_lora_rank + rope numbers per token and layer, whatever the heads."""
  _, _, ours = checkpoints["deepseek-default"]
  _, cache = forward(ours.module, tokens[:, :8], capacity=12)
  assert cache.shape == (3, 2, 12, 24)
  assert not np.asarray(cache[:, :, 8:]).any()  # room for decode, still empty


def test_multi_token_prediction_layers_ignored_and_said(checkpoints, tmp_path):
  import safetensors.numpy as st

  _, directory, ours = checkpoints["deepseek-default"]
  tensors = st.load_file(f"{directory}/model.safetensors")
  tensors["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
  st.save_file(tensors, str(tmp_path / "model.safetensors"))
  with open(f"{directory}/config.json") as f:
    (tmp_path / "config.json").write_text(f.read())
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loaded = kvr_jax.load_model(str(tmp_path))
  assert any("multi-token-prediction" in str(w.message) for w in caught)
  np.testing.assert_array_equal(loaded.module.embedding[...], ours.module.embedding[...])


def test_strategies_refuse_latent_attention_by_name(checkpoints, tokens):
  from kvr_jax.inference.hybrid import prefill_hybrid

  _, _, ours = checkpoints["deepseek-default"]
  with pytest.raises(ValueError, match="multi-head latent attention.*one device"):
    kvr_jax.prefill(ours, tokens[:, :8], strategy="single")
  with pytest.raises(ValueError, match="multi-head latent attention"):
    kvr_jax.generate(ours, tokens[:1, :8], max_new_tokens=2)
  with pytest.raises(ValueError, match="linear-attention layers"):
    prefill_hybrid(ours, tokens, kvr_jax.make_mesh(2), [20, 20])
  with pytest.raises(ValueError, match="dense attention"):
    ours.module.forward(jnp.asarray(tokens), attention="flash")


def test_bad_configs_refused_by_name(checkpoints):
  with open(f"{checkpoints['deepseek-default'][1]}/config.json") as f:
    hf = json.load(f)
  with pytest.raises(ValueError, match="num_key_value_heads"):
    config_from_hf({**hf, "num_key_value_heads": 2})
  with pytest.raises(ValueError, match="groups must divide"):
    config_from_hf({**hf, "n_group": 3})
  with pytest.raises(ValueError, match="experts_per_token"):
    config_from_hf({**hf, "num_experts_per_tok": 5})  # 2 groups of 2 hold 4
  cfg = checkpoints["deepseek-default"][2].config
  with pytest.raises(ValueError, match="head_dim"):
    dataclasses.replace(cfg, head_dim=16)
  with pytest.raises(ValueError, match="first_dense_layers"):
    dataclasses.replace(cfg, first_dense_layers=4)


def test_deepseek_v3_preset_is_the_published_model():
  """The preset's shape (DeepSeek-V3's config.json, its multi-token-prediction layer left out)
  has transformers' own parameter count, counted on the meta device."""
  import torch
  import transformers

  from kvr_jax.runtime.loading import preset_config

  cfg = preset_config("deepseek-v3")
  hf = transformers.DeepseekV3Config()  # transformers' defaults are DeepSeek-V3's shape
  with torch.device("meta"):
    hf_model = transformers.DeepseekV3ForCausalLM(hf)
  assert (cfg.num_layers, cfg.num_heads, cfg.kv_lora_rank, cfg.num_experts) == (61, 128, 512, 256)
  assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters()) == 671_026_404_352
  # 71x: what a hop carries per token, the latent against every head's K and V
  per_head_kv = cfg.num_heads * (cfg.head_dim + cfg.v_head_dim)
  assert per_head_kv / cfg.cache_width == pytest.approx(71.1, abs=0.05)
