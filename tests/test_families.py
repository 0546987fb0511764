"""The families that are the Llama decoder with switches: Mistral (sliding window), Qwen2
(Q/K/V bias), Qwen3 (q/k norm, head_dim != d_model / heads), against transformers through
every strategy, and the windowed KV-Runahead hops.

Tolerances (fixed): whole models against transformers within 1e-4 relative to the largest
logit; strategies against `single` within 1e-5 (logits and the K,V decode uses).
"""

import re

import jax
import numpy as np
import pytest

import kvr_jax
from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies import runahead
from kvr_jax.strategies.by_kind import compile_by_kind
from models import config_from_dict, config_from_hf
from models.masks import window_start
from tests import hf_fixtures

MODEL_TOL = 1e-4
REL_TOL = 1e-5
FAMILIES = list(hf_fixtures.FAMILY_CASES)
WINDOW = hf_fixtures.FAMILY_CASES["mistral-window"][2]["sliding_window"]  # 6
# C=37 over 4 ranks, unevenly: the first chunk is longer than the window, the last two shorter
# (they forward keys they received).
C, PARTITION = 37, (16, 12, 5, 4)
STRATEGY_MESH = [("single", 1), ("tsp", 4), ("kvr", 4), ("ring", 4), ("allgather", 4)]


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  return np.abs(got - want).max() / np.abs(want).max()


@pytest.fixture(scope="module")
def families(tmp_path_factory):
  """case -> (torch model, our model loaded from its save_pretrained directory)."""
  out = {}
  for case in FAMILIES:
    hf_model = hf_fixtures.make_hf_model(case, seed=3)
    directory = tmp_path_factory.mktemp(case)
    hf_model.save_pretrained(directory)
    out[case] = (hf_model, kvr_jax.load_model(str(directory)))
  return out


@pytest.fixture(scope="module")
def tokens():
  return np.random.RandomState(5).randint(0, hf_fixtures.VOCAB, (2, C))


@pytest.fixture(scope="module")
def hf_reference(families, tokens):
  return {case: hf_fixtures.hf_logits(hf_model, tokens) for case, (hf_model, _) in families.items()}


def test_configs_carry_the_switches(families):
  configs = {case: model.config for case, (_, model) in families.items()}
  assert configs["mistral-window"].sliding_window == WINDOW
  assert configs["gemma3-local-global"].windows == (WINDOW, None)
  assert configs["qwen2-bias"].qkv_bias and configs["qwen2-bias"].sliding_window is None
  qwen3 = configs["qwen3-qknorm"]
  assert qwen3.qk_norm and qwen3.head_dim * qwen3.num_heads != qwen3.d_model
  for case, (hf_model, model) in families.items():
    assert model.config.num_params() == sum(p.numel() for p in hf_model.parameters()), case


@pytest.mark.default_cases("qwen2-bias")
@pytest.mark.parametrize("case", FAMILIES)
def test_logits_every_position_match_transformers(families, hf_reference, tokens, case):
  _, model = families[case]
  for attention in ("dense", "flash"):
    logits = model.module.logits(model.module.forward(tokens, attention)[0])
    assert rel_err(logits, hf_reference[case]) <= MODEL_TOL, attention


@pytest.mark.default_cases("single-1-qwen2-bias", "kvr-4-qwen2-bias")
@pytest.mark.parametrize("case", FAMILIES)
@pytest.mark.parametrize("strategy,p", STRATEGY_MESH)
def test_every_strategy_matches_transformers_and_single(
  families, hf_reference, tokens, case, strategy, p
):
  _, model = families[case]
  kwargs = {"partition": PARTITION} if strategy == "kvr" else {}
  got = kvr_jax.prefill(model, tokens, strategy=strategy, mesh=kvr_jax.make_mesh(p), **kwargs)
  assert rel_err(got.logits, hf_reference[case][:, -1]) <= MODEL_TOL
  want = kvr_jax.prefill(model, tokens)
  assert rel_err(got.logits, want.logits) <= REL_TOL
  # The K,V decode reads: each layer's whole cache, or with a window its last W-1 positions
  # (KV-Runahead's join keeps no more on a windowed layer).
  for layer, window in enumerate(model.config.windows):
    first = window_start(C, window)
    for got_kv, want_kv in ((got.k_cache, want.k_cache), (got.v_cache, want.v_cache)):
      assert rel_err(got_kv[layer, :, first:], want_kv[layer, :, first:]) <= REL_TOL, layer


@pytest.mark.default_cases("single-1-qwen2-bias")
@pytest.mark.parametrize("case", FAMILIES)
@pytest.mark.parametrize("strategy,p", [("single", 1), ("kvr", 4)])
def test_greedy_tokens_match_transformers(families, tokens, case, strategy, p):
  """Decode continues from each strategy's cache; with Mistral's window of 6 and a prompt of
  37, every decode step masks by the window (and never reads what KVR left zero)."""
  hf_model, model = families[case]
  prompt = tokens[:1]
  kwargs = {"partition": PARTITION} if strategy == "kvr" else {}
  got = kvr_jax.generate(
    model, prompt, max_new_tokens=8, strategy=strategy, mesh=kvr_jax.make_mesh(p), **kwargs
  ).tokens
  np.testing.assert_array_equal(got, hf_fixtures.hf_greedy(hf_model, prompt, 8))


def test_window_is_exercised(families, hf_reference, tokens):
  """Control: the same Mistral weights without the window give other logits, so the parity
  tests above can fail on a window bug."""
  import dataclasses

  _, model = families["mistral-window"]
  module = model.module
  unwindowed = dataclasses.replace(module.config, sliding_window=None)
  saved = module.config
  module.config = module.blocks.config = unwindowed
  try:
    logits = module.logits(module.forward(tokens, "dense")[0])
  finally:
    module.config = module.blocks.config = saved
  assert rel_err(logits, hf_reference["mistral-window"]) > 1e-2


def _kv_permutes(model, chunks, B=2):
  mesh = kvr_jax.make_mesh(len(chunks))
  fn = compile_by_kind("kvr", model.graphdef, mesh, chunks, "flash", model.config.kinds, False)
  tokens = runahead.pad_chunks(np.zeros((B, sum(chunks)), np.int32), chunks)
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  by_rank = jax.sharding.NamedSharding(mesh, jax.P(AXIS))
  hlo = fn.lower(model.state_on(replicated), jax.device_put(tokens, by_rank)).compile().as_text()
  pattern = r"= \w+\[([\d,]+)\]\{[\d,]*\} collective-permute(?:-start)?\("
  shapes = [tuple(int(d) for d in m.group(1).split(",")) for m in re.finditer(pattern, hlo)]
  cfg = model.config
  # K and V stacked: [2, B, keys, K, H]; the logits never move in KVR (the last rank owns them).
  assert all(s[:2] == (2, B) and s[3:] == (cfg.num_kv_heads, cfg.head_dim) for s in shapes), shapes
  return sorted(s[2] for s in shapes)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_windowed_hops_carry_at_most_w_keys(families):
  """Compiled program: each of the p-1 hops carries min(S_k, W-1) keys with the window, and
  the whole prefix S_k without (Qwen2, same shapes otherwise)."""
  ends = np.cumsum(PARTITION)[:-1]
  windowed = _kv_permutes(families["mistral-window"][1], PARTITION)
  assert windowed == sorted(min(int(e), WINDOW - 1) for e in ends)
  assert max(windowed) <= WINDOW
  assert _kv_permutes(families["qwen2-bias"][1], PARTITION) == sorted(int(e) for e in ends)
  # Windows per layer (Gemma 3): the windowed layer's hops carry at most W-1 keys, the full
  # layer's the whole prefix.
  mixed = _kv_permutes(families["gemma3-local-global"][1], PARTITION)
  assert mixed == sorted([int(e) for e in ends] + [min(int(e), WINDOW - 1) for e in ends])


def test_layer_kinds_are_one_body_each():
  """Gemma 3 27B's 62 layers (five 1024-token windows to one full) are two kinds of layer:
  two compiled bodies, whatever the depth."""
  from models.layer_kinds import AttentionKind, kinds_in_order

  def kinds(windows):
    return tuple(k.window for k in kinds_in_order(AttentionKind(w) for w in windows))

  gemma = ((1024,) * 5 + (None,)) * 10 + (1024, 1024)
  assert kinds(gemma) == (1024, None)
  assert kinds((None, 8, 4, 8)) == (4, 8, None)


def test_fused_kernel_refused_for_a_windowed_model(families, tokens):
  _, model = families["mistral-window"]
  with pytest.raises(ValueError, match="sliding window of 6 tokens.*'fused'"):
    kvr_jax.prefill(model, tokens, attention="fused")


def _qwen2_config(**overrides):
  hf = dict(
    model_type="qwen2",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=32,
  )
  return config_from_hf({**hf, **overrides})


def test_sliding_window_from_config_json():
  assert _qwen2_config().sliding_window is None  # use_sliding_window defaults to off
  assert _qwen2_config(use_sliding_window=True, max_window_layers=0).sliding_window == 32
  sliding = ["sliding_attention"] * 4
  assert _qwen2_config(use_sliding_window=True, layer_types=sliding).sliding_window == 32
  with pytest.raises(ValueError, match="need a positive `sliding_window`, got None"):
    _qwen2_config(layer_types=sliding)  # windowed layers, but the window is switched off
  # The first max_window_layers layers full, the rest windowed (each layer its own window).
  mixed = _qwen2_config(use_sliding_window=True, max_window_layers=2)
  assert (mixed.sliding_window, mixed.windows) == (None, (None, None, 32, 32))
  with pytest.raises(ValueError, match="layer_types.*chunked_attention"):
    _qwen2_config(layer_types=["chunked_attention"] * 4)
  mistral = dict(_qwen2_config().to_dict(), architecture="llama", sliding_window=0)
  with pytest.raises(ValueError, match="`sliding_window` must be a positive integer"):
    config_from_dict(mistral)
  supported = (
    "'llama', 'mistral', 'qwen2', 'qwen3', 'qwen3_moe', 'mixtral', 'falcon', 'gemma3_text'"
  )
  with pytest.raises(ValueError, match=f"supported: {supported}"):
    _qwen2_config(model_type="gemma")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_windows_per_layer_decode_from_either_layout_and_a_bucket(families, tokens):
  """Gemma 3's windowed and full layers through KV-Runahead's sharded cache (each decode step
  attends every part where it lies, with the layer's own window) and a padded bucket: the
  greedy tokens are transformers'."""
  hf_model, model = families["gemma3-local-global"]
  prompt = tokens[:1]
  want = hf_fixtures.hf_greedy(hf_model, prompt, 6)
  mesh = kvr_jax.make_mesh(4)
  for cache, buckets in (("sharded", None), ("sharded", (48,)), ("last", (48,))):
    got = kvr_jax.generate(
      model,
      prompt,
      6,
      strategy="kvr",
      mesh=mesh,
      cache=cache,
      buckets=buckets,
      partition=PARTITION if buckets is None else [20, 14, 8, 6],
    ).tokens
    np.testing.assert_array_equal(got, want, err_msg=f"{cache} {buckets}")


def test_families_are_records_registered_in_one_place():
  """A family is one record (models/family.py) in one registry line; what reads the registry
  (the model_types config.json may name, a config's module class and tensor names) follows."""
  from models import Falcon, Gemma, Llama, LlamaConfig
  from models.deepseek_v3 import DeepseekV3
  from models.families import ARCHITECTURES, FAMILIES, SUPPORTED_MODEL_TYPES, family_of
  from models.family import Family
  from models.gpt_oss import GptOss
  from models.qwen3_5 import Qwen35

  assert [(f.architecture, f.module_class) for f in FAMILIES] == [
    ("llama", Llama),
    ("falcon", Falcon),
    ("gemma3", Gemma),
    ("qwen3_5", Qwen35),
    ("deepseek_v3", DeepseekV3),
    ("gpt_oss", GptOss),
  ]
  assert set(SUPPORTED_MODEL_TYPES) == {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "falcon",
    "gemma3_text",
    "qwen3_5_text",
    "qwen3_5",
    "qwen3_5_moe_text",
    "gpt_oss",
    "qwen3_5_moe",
    "qwen3_next",
    "deepseek_v3",
  }
  assert {arch: cls.architecture for arch, cls in ARCHITECTURES.items()} == {
    "llama": "llama",
    "falcon": "falcon",
    "gemma3": "gemma3",
    "qwen3_5": "qwen3_5",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "gpt_oss",
  }
  config = _qwen2_config()
  assert family_of(config) is FAMILIES[0] and family_of(config).tensor_targets(
    config, "model.layers.0.self_attn.q_proj.bias"
  )[0][0] == ("blocks", "bq")
  with pytest.raises(ValueError, match="says architecture 'llama'"):
    Family("falcon", ("falcon",), LlamaConfig, Llama, None, None)
  with pytest.raises(ValueError, match="loads no Hugging Face model_type"):
    Family("llama", (), LlamaConfig, Llama, None, None)
  # An unknown model_type is refused by name before any of its fields is read.
  with pytest.raises(ValueError, match="`model_type`='bert' is not supported; supported: 'llama'"):
    config_from_hf({"model_type": "bert"})


@pytest.mark.default_cases("mistral-window")
@pytest.mark.parametrize("case", ["mistral-window", "gemma3-local-global"])
def test_the_per_rank_program_attends_each_layer_kinds_window(families, tokens, case):
  """The per-rank switch program (two ranks run it by default; the dense kernel always does)
  starts each rank's keys where its layer's kind says (`AttentionKind.first_key`): logits
  within 1e-5 of single on the windowed families, with the window well inside the chunks."""
  _, model = families[case]
  want = kvr_jax.prefill(model, tokens).logits
  for attention in ("flash", "dense"):
    got = kvr_jax.prefill(
      model,
      tokens,
      strategy=runahead.PER_RANK_STRATEGY,
      mesh=kvr_jax.make_mesh(2),
      partition=[20, C - 20],
      attention=attention,
    )
    assert rel_err(got.logits, want) <= REL_TOL, attention
