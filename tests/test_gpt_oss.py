"""gpt-oss (attention sinks, q/k/v/o biases, alternating windows, a biased router, clamped
SwiGLU experts with biases, YaRN) against transformers through the project's own loader:
logits of every position, every strategy against one device, greedy decoding far past the
window in both cache layouts, the published shapes, and what is refused by name."""

import json
import shutil

import numpy as np
import pytest

import kvr_jax
from tests import hf_fixtures
from tests.tolerance import relative_error

MODEL_TOL = 1e-4  # whole models against transformers, float32
STRATEGY_TOL = 1e-5  # strategies against each other, float32
CASES = list(hf_fixtures.GPT_OSS_CASES)
T = 40
NEW_TOKENS = 18  # three windows of the yarn case's 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """case -> (torch model, directory written with save_pretrained, our loaded model)."""
  return hf_fixtures.saved_checkpoints(hf_fixtures.make_gpt_oss_model, CASES, tmp_path_factory)


@pytest.fixture(scope="module")
def tokens():
  return np.random.RandomState(1).randint(0, hf_fixtures.VOCAB, (2, T))


@pytest.mark.default_cases("gpt-oss-mqa")
@pytest.mark.parametrize("case", CASES)
def test_logits_every_position_match_transformers(checkpoints, tokens, case):
  hf_model, _, ours = checkpoints[case]
  err = relative_error(ours.module(tokens), hf_fixtures.hf_logits(hf_model, tokens))
  assert err <= MODEL_TOL, f"{case}: relative error {err:.2e} > {MODEL_TOL}"


def test_config_and_parameters_read_as_transformers(checkpoints):
  hf_model, _, ours = checkpoints["gpt-oss-yarn"]
  cfg = ours.config
  assert cfg.layer_windows == (6, None, 6)  # transformers' default: windows on even layers
  assert (cfg.num_experts, cfg.experts_per_token, cfg.swiglu_limit) == (4, 2, 0.3)
  assert cfg.rope.type == "yarn" and cfg.rope.truncate is False
  assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters())
  sinks = hf_model.model.layers[1].self_attn.sinks.detach().numpy()
  np.testing.assert_array_equal(np.asarray(ours.module.blocks.sinks[...][1]), sinks)
  assert checkpoints["gpt-oss-mqa"][2].config.layer_windows == (9, 9, None)


STRATEGIES = [
  ("kvr", dict(partition=[16, 13, 11])),  # the one body, flash
  ("kvr", dict(partition=[16, 13, 11], attention="dense")),  # the per-rank program
  ("tsp", {}),
  ("ring", {}),
  ("allgather", {}),
]


@pytest.fixture(scope="module")
def single_logits(checkpoints, tokens):
  return np.asarray(kvr_jax.prefill(checkpoints["gpt-oss-yarn"][2], tokens).logits)


@pytest.mark.default_cases("kvr-kwargs1", "tsp-kwargs2")
@pytest.mark.parametrize(("strategy", "kwargs"), STRATEGIES)
def test_every_strategy_equals_one_device(checkpoints, tokens, single_logits, strategy, kwargs):
  """The sink enters each query's softmax once whatever the split: KV-Runahead's prefix and
  diagonal, ring's and all-gather's pieces, TSP's rows."""
  _, _, ours = checkpoints["gpt-oss-yarn"]
  mesh = kvr_jax.make_mesh(3 if "partition" in kwargs else 4)
  logits = kvr_jax.prefill(ours, tokens, strategy=strategy, mesh=mesh, **kwargs).logits
  np.testing.assert_allclose(logits, single_logits, atol=STRATEGY_TOL, rtol=STRATEGY_TOL)


@pytest.mark.default_cases("last")
@pytest.mark.parametrize("cache", ["last", "sharded"])
def test_greedy_decode_past_the_window_matches_transformers(checkpoints, tokens, cache):
  """KV-Runahead on 3 uneven ranks, then 18 tokens (three windows) decoded from the whole
  cache or from the ranks' parts (the sink added where the new token's own key is)."""
  hf_model, _, ours = checkpoints["gpt-oss-yarn"]
  out = kvr_jax.generate(
    ours,
    tokens,
    NEW_TOKENS,
    strategy="kvr",
    mesh=kvr_jax.make_mesh(3),
    partition=[16, 13, 11],
    cache=cache,
  )
  want = hf_fixtures.hf_greedy(hf_model, tokens, NEW_TOKENS)
  np.testing.assert_array_equal(np.asarray(out.tokens), want)


@pytest.mark.parametrize(
  ("preset", "layers", "experts", "params"),
  [("gpt-oss-20b", 24, 32, 20_914_757_184), ("gpt-oss-120b", 36, 128, 116_829_156_672)],
)
def test_presets_have_transformers_parameter_count(preset, layers, experts, params):
  """The published shapes (2880 wide, 64 heads of 64, 8 KV heads, 4 experts per token, YaRN
  32x 4096) have transformers' own parameter count, counted on the meta device."""
  import torch
  import transformers

  from kvr_jax.runtime.loading import preset_config

  cfg = preset_config(preset)
  hf = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)
  with torch.device("meta"):
    hf_model = transformers.GptOssForCausalLM(hf)
  assert cfg.layer_windows == tuple(
    128 if t == "sliding_attention" else None for t in hf.layer_types
  )
  assert (cfg.vocab_size, cfg.d_model, cfg.num_heads, cfg.num_kv_heads) == (
    hf.vocab_size,
    hf.hidden_size,
    hf.num_attention_heads,
    hf.num_key_value_heads,
  )
  assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters()) == params


def edited_checkpoint(checkpoints, tmp_path, **changes):
  """The yarn case's directory copied, its config.json changed (a key None: removed)."""
  _, directory, _ = checkpoints["gpt-oss-yarn"]
  target = tmp_path / "edited"
  shutil.copytree(directory, target)
  path = target / "config.json"
  config = json.loads(path.read_text())
  for key, value in changes.items():
    if value is None:
      config.pop(key, None)
    else:
      config[key] = value
  path.write_text(json.dumps(config))
  return str(target)


@pytest.mark.parametrize(
  ("changes", "message"),
  [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "Mxfp4Config\\(dequantize=True\\)"),
    ({"attention_bias": False}, "attention_bias"),
    ({"num_experts_per_tok": 9}, "exceeds the 4 experts"),
    ({"swiglu_limit": "7"}, "swiglu_limit"),
  ],
)
def test_refused_by_name(checkpoints, tmp_path, changes, message):
  with pytest.raises(ValueError, match=message):
    kvr_jax.load_model(edited_checkpoint(checkpoints, tmp_path, **changes))


def test_absent_keys_take_transformers_defaults(checkpoints, tmp_path):
  """No `layer_types` and no RoPE keys: windows on even layers and YaRN 32x 4096 at base
  150000, as GptOssConfig fills them in."""
  directory = edited_checkpoint(
    checkpoints, tmp_path, layer_types=None, rope_parameters=None, rope_scaling=None
  )
  cfg = kvr_jax.load_model(directory).config
  assert cfg.layer_windows == (6, None, 6)
  assert (cfg.rope.type, cfg.rope.theta, cfg.rope.factor) == ("yarn", 150000.0, 32.0)
  assert cfg.rope.original_max_position_embeddings == 4096


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_saved_model_restores_whole(checkpoints, tokens, tmp_path):
  """Orbax: the sinks, the biases and the experts come back, and the config with them."""
  _, _, ours = checkpoints["gpt-oss-yarn"]
  kvr_jax.save_model(ours, str(tmp_path / "checkpoint"))
  restored = kvr_jax.load_model(str(tmp_path / "checkpoint"))
  assert restored.config == ours.config
  np.testing.assert_array_equal(restored.module(tokens[:, :8]), ours.module(tokens[:, :8]))


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_ragged_rows_in_a_bucket_decode_as_transformers(checkpoints, tokens):
  """Two prompts of 40 and 27 tokens padded to a 48-token bucket, ring attention, the cache
  left in the ranks' parts: each row decodes from its own length (its sinks at its own
  positions) with transformers' greedy tokens for that row alone."""
  hf_model, _, ours = checkpoints["gpt-oss-yarn"]
  rows = [tokens[0], tokens[1, :27]]
  got = kvr_jax.generate(
    ours, rows, 8, strategy="ring", mesh=kvr_jax.make_mesh(4), cache="sharded", buckets=(48,)
  ).tokens
  for row, prompt in enumerate(rows):
    want = hf_fixtures.hf_greedy(hf_model, np.asarray(prompt)[None], 8)[0]
    np.testing.assert_array_equal(np.asarray(got[row]), want, err_msg=f"row {row}")
