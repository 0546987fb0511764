"""The Qwen hybrids with a mixture of experts, Qwen3.5-MoE (`qwen3_5_moe_text`, and the
`qwen3_5_moe` multimodal checkpoint's language model) and Qwen3-Next (`qwen3_next`: fused
in-projections laid out per key head), against transformers through the project's own
loader; KV-Runahead and a peer on them; the published shapes; what is refused by name."""

import dataclasses
import json
import re

import jax
import numpy as np
import pytest

import kvr_jax
from models.families import config_from_hf
from tests import hf_fixtures
from tests.tolerance import assert_close, relative_error

MODEL_TOL = 1e-4  # whole models against transformers, float32
CASES = list(hf_fixtures.QWEN_MOE_CASES)
T = 70  # no multiple of the 64-token chunk, and longer than one


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """case -> (torch model, directory written with save_pretrained, our loaded model)."""
  return hf_fixtures.saved_checkpoints(hf_fixtures.make_qwen_moe_model, CASES, tmp_path_factory)


@pytest.fixture(scope="module")
def tokens():
  return np.random.RandomState(1).randint(0, hf_fixtures.VOCAB, (2, T))


@pytest.fixture(scope="module")
def logits_of():
  """Every position's logits, compiled once per model (graphdef static)."""
  run = jax.jit(lambda module, tokens_BT: module.logits(module.forward(tokens_BT)[0]))
  return lambda model, tokens: np.asarray(run(model.module, tokens))


@pytest.mark.default_cases("qwen3_next")
@pytest.mark.parametrize("case", CASES)
def test_logits_every_position_match_transformers(checkpoints, tokens, logits_of, case):
  hf_model, _, ours = checkpoints[case]
  assert (ours.config.num_experts, ours.config.shared_expert_dim) == (4, 40)
  err = relative_error(logits_of(ours, tokens), hf_fixtures.hf_logits(hf_model, tokens))
  assert err <= MODEL_TOL, f"{case}: relative error {err:.2e} > {MODEL_TOL}"


@pytest.mark.parametrize("case", CASES)
def test_parameter_count_is_transformers(checkpoints, case):
  hf_model, _, ours = checkpoints[case]
  assert ours.config.num_params() == sum(p.numel() for p in hf_model.parameters())


def test_multimodal_moe_checkpoint_loads_its_language_model(checkpoints, tokens, tmp_path):
  """A `qwen3_5_moe` checkpoint: its `text_config` and `model.language_model.` tensors give
  the text model's logits; the vision tower is named in a warning, not loaded."""
  import warnings

  import safetensors.numpy as st

  _, directory, ours = checkpoints["qwen3_5_moe"]
  with open(f"{directory}/config.json") as f:
    text = json.load(f)
  (tmp_path / "config.json").write_text(
    json.dumps({"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 1}})
  )
  tensors = st.load_file(f"{directory}/model.safetensors")
  renamed = {
    name.replace("model.", "model.language_model.", 1): value for name, value in tensors.items()
  }
  renamed["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
  st.save_file(renamed, str(tmp_path / "model.safetensors"))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    multimodal = kvr_jax.load_model(str(tmp_path))
  assert any("vision tower" in str(w.message) for w in caught)
  np.testing.assert_array_equal(multimodal.module(tokens[:, :8]), ours.module(tokens[:, :8]))


def test_router_renormalisation_read_per_model_type(checkpoints):
  """Qwen3-Next renormalises the chosen weights as `norm_topk_prob` says; Qwen3.5-MoE's
  router always does (transformers ignores the field there)."""
  for case, want_off in (("qwen3_next", False), ("qwen3_5_moe", True)):
    with open(f"{checkpoints[case][1]}/config.json") as f:
      hf = json.load(f)
    hf["norm_topk_prob"] = False
    assert config_from_hf(hf).normalize_expert_weights is want_off, case


def test_dense_layers_among_experts_refused_by_name(checkpoints):
  with open(f"{checkpoints['qwen3_next'][1]}/config.json") as f:
    hf = json.load(f)
  # transformers: a layer is dense where listed, or where (i + 1) is no multiple of the step.
  for field, value, dense in (
    ("mlp_only_layers", [1], "[1]"),
    ("decoder_sparse_step", 2, "[0, 2]"),
  ):
    with pytest.raises(ValueError, match=f"dense MLP layers {re.escape(dense)}"):
      config_from_hf({**hf, field: value})
  dense = config_from_hf({**hf, "num_experts": 0})  # Qwen3-Next with no experts: dense
  assert (dense.num_experts, dense.mlp_dim) == (0, hf["intermediate_size"])
  with pytest.raises(ValueError, match="num_experts_per_tok"):
    config_from_hf({**hf, "num_experts_per_tok": 5})
  config = checkpoints["qwen3_next"][2].config
  with pytest.raises(ValueError, match="shared_expert_dim"):
    dataclasses.replace(config, shared_expert_dim=0)
  with pytest.raises(ValueError, match="experts_per_token"):
    dataclasses.replace(config, num_experts=0)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_kvr_prefill_equals_one_device(checkpoints, tokens):
  """KV-Runahead on uneven chunks: the last logits and every layer's past as one device
  computes them (the experts route each rank's own rows; the MLP is per row, so the peers,
  whose layers tests/test_qwen3_5.py covers, run it alike)."""
  from tests.own_prefill import prefilled

  ours = checkpoints["qwen3_next"][2]
  x_BTD, want = jax.jit(lambda m, t: m.forward(t, capacity=T + 2))(ours.module, tokens)
  result = prefilled(ours, tokens, kvr_jax.make_mesh(3), [30, 25, 15], "flash", 2)
  assert_close(result.logits, ours.module.logits(x_BTD)[:, -1], "last logits")
  assert_close(result.past.cache.kv_2BSKH, want.kv_2BSKH, "full layers' K,V")
  assert_close(result.past.cache.linear.state_Bhkv, want.linear.state_Bhkv, "linear states")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_kvr_on_qwen3_next_decodes_transformers_greedy_tokens(checkpoints, tokens):
  hf_model, _, ours = checkpoints["qwen3_next"]
  want = hf_fixtures.hf_greedy(hf_model, tokens[:1, :30], 6)
  mesh = kvr_jax.make_mesh(2)
  got = kvr_jax.generate(ours, tokens[:1, :30], 6, strategy="kvr", mesh=mesh, partition=[18, 12])
  got = got.tokens
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
  "preset, case, params",
  [
    ("qwen3.5-397b-a17b", "qwen3_5_moe", 396_346_350_336),
    ("qwen3-next-80b-a3b", "qwen3_next", 79_674_391_296),
  ],
)
def test_moe_presets_have_transformers_parameter_count(preset, case, params):
  """The presets' shapes (the published text models: 512 experts, 10 per token, a shared
  expert) have transformers' own parameter count, counted on the meta device."""
  import torch
  import transformers

  from kvr_jax.runtime.loading import preset_config

  cfg = preset_config(preset)
  config_class, model_class = hf_fixtures.QWEN_MOE_CASES[case]
  hf = getattr(transformers, config_class)(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.d_model,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=cfg.num_heads,
    num_key_value_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    linear_num_key_heads=cfg.linear_num_key_heads,
    linear_num_value_heads=cfg.linear_num_value_heads,
    linear_key_head_dim=cfg.linear_key_head_dim,
    linear_value_head_dim=cfg.linear_value_head_dim,
    num_experts=cfg.num_experts,
    num_experts_per_tok=cfg.experts_per_token,
    moe_intermediate_size=cfg.mlp_dim,
    shared_expert_intermediate_size=cfg.shared_expert_dim,
    tie_word_embeddings=False,
  )
  with torch.device("meta"):
    hf_model = getattr(transformers, model_class)(hf)
  assert cfg.layer_types == tuple(hf.layer_types)
  assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters()) == params
