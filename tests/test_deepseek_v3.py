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
from flax import nnx

import kvr_jax
from kvr_jax.strategies import TRACE_COUNT, runahead
from kvr_jax.strategies.runahead.schedule import OneBodyShape
from launch.harness import latent_forms
from models.families import config_from_hf
from models.kernels import get_kernel
from tests import hf_fixtures
from tests.measured_checks import assert_candidates_on_one_program
from tests.own_prefill import prefilled
from tests.tolerance import assert_close, relative_error

MODEL_TOL = 1e-4  # whole models against transformers, float32
CASES = list(hf_fixtures.DEEPSEEK_CASES)
T = 40


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """case -> (torch model, directory written with save_pretrained, our loaded model)."""
  return hf_fixtures.saved_checkpoints(hf_fixtures.make_deepseek_model, CASES, tmp_path_factory)


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


@pytest.mark.default_cases("deepseek-direct-q")
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
  """case -> greedy decoding of 6 tokens from a 24-token prompt through the latent cache
  (the absorbed form): (tokens [2, 6], each step's logits [6, 2, V]), once per case."""
  done = {}

  def of(case):
    if case not in done:
      done[case] = _decode_greedily(checkpoints[case][2], tokens, forward)
    return done[case]

  return of


# The decode tests' cases: YaRN's mscale_all_dim changes the softmax scale that the absorbed
# decode must take from the config (head_dim^-0.5 alone decodes other tokens).
DECODE_CASES = ["deepseek-default", "deepseek-yarn"]


def _decode_greedily(ours, tokens, forward):
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


@pytest.mark.default_cases("flash")
@pytest.mark.parametrize("kernel", ["blocked", "flash"])
def test_every_kernel_on_the_expanded_heads_equals_dense(checkpoints, tokens, forward, kernel):
  """The blocked and flash kernels over the expanded heads (values zero-padded to the key
  width, the YaRN scale carried by the queries) give the dense reference's logits and cache."""
  _, _, ours = checkpoints["deepseek-yarn"]
  logits, cache = forward(ours.module, tokens)
  run = jax.jit(lambda m, t: m.forward(t, attention=kernel))
  x_BTD, kernel_cache = run(ours.module, tokens)
  assert_close(ours.module.logits(x_BTD), logits, f"{kernel} logits")
  assert_close(kernel_cache, cache, f"{kernel} latent cache")


@pytest.mark.default_cases("deepseek-yarn")
@pytest.mark.parametrize("case", DECODE_CASES)
def test_absorbed_decode_equals_the_expanded_forward(checkpoints, tokens, forward, decoded, case):
  """Each decode step (queries taken into the latent space, the C-wide cache as one key head)
  gives the logits of the forward over the prompt and the tokens so far (every head's K,V
  expanded)."""
  _, _, ours = checkpoints[case]
  new_tokens, step_logits = decoded(case)
  sequence = np.concatenate([tokens[:, :24], new_tokens], axis=1)
  logits, _ = forward(ours.module, sequence)
  assert_close(step_logits.transpose(1, 0, 2), np.asarray(logits[:, 24:30]), "decode logits")


@pytest.mark.default_cases("deepseek-yarn")
@pytest.mark.parametrize("case", DECODE_CASES)
def test_greedy_decode_matches_transformers(checkpoints, tokens, decoded, case):
  hf_model, _, _ = checkpoints[case]
  new_tokens, _ = decoded(case)
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


def test_unknown_kernels_refuse_latent_models_by_name(checkpoints, tokens):
  _, _, ours = checkpoints["deepseek-default"]
  with pytest.raises(ValueError, match="'paged'"):
    ours.module.forward(jnp.asarray(tokens), attention="paged")


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


# Moonlight-16B-A3B's shape as transformers' keys: no q low-rank path, one expert group, 64
# experts of 1408 columns (6 per token), 2 shared, the first layer dense.
MOONLIGHT = dict(
  vocab_size=163840,
  hidden_size=2048,
  num_hidden_layers=27,
  num_attention_heads=16,
  num_key_value_heads=16,
  intermediate_size=11264,
  moe_intermediate_size=1408,
  n_routed_experts=64,
  n_shared_experts=2,
  num_experts_per_tok=6,
  n_group=1,
  topk_group=1,
  first_k_dense_replace=1,
  q_lora_rank=None,
  routed_scaling_factor=2.446,
)


@pytest.mark.parametrize(
  "preset, shape, params",
  [("deepseek-v3", {}, 671_026_404_352), ("moonlight-16b-a3b", MOONLIGHT, 15_960_108_544)],
)
def test_latent_presets_are_the_published_models(preset, shape, params):
  """The presets' shapes (DeepSeek-V3's config.json, its multi-token-prediction layer left
  out: transformers' defaults; Moonlight-16B-A3B's) have transformers' own parameter count,
  counted on the meta device."""
  import torch
  import transformers

  from kvr_jax.runtime.loading import preset_config

  cfg = preset_config(preset)
  hf = transformers.DeepseekV3Config(**shape)
  with torch.device("meta"):
    hf_model = transformers.DeepseekV3ForCausalLM(hf)
  assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters()) == params
  assert (cfg.first_dense_layers, cfg.num_experts) == (
    hf.first_k_dense_replace,
    hf.n_routed_experts,
  )


def test_deepseek_v3_hop_is_71x_smaller_than_per_head_kv():
  from kvr_jax.runtime.loading import preset_config

  cfg = preset_config("deepseek-v3")
  # 71x: what a hop carries per token, the latent against every head's K and V
  per_head_kv = cfg.num_heads * (cfg.head_dim + cfg.v_head_dim)
  assert per_head_kv / cfg.cache_width == pytest.approx(71.1, abs=0.05)


# --- KV-Runahead and all-gather CP on latent attention (kvr_jax.inference.latent)


@pytest.fixture(scope="module")
def one_device(checkpoints, tokens):
  """The single-device reference of "deepseek-default": the last position's logits and the
  latent cache (room for 2 more positions)."""
  module = checkpoints["deepseek-default"][2].module
  x_BTD, cache = jax.jit(lambda m, t: m.forward(t, capacity=T + 2))(module, tokens)
  return module.logits(x_BTD)[:, -1], cache


@pytest.mark.default_cases("kvr-2-partition0-dense", "tsp-3-None-dense")
@pytest.mark.parametrize(
  "strategy, ranks, partition, attention",
  [
    ("kvr", 2, [25, 15], "dense"),
    ("kvr", 4, [5, 15, 12, 8], "flash"),
    ("allgather", 3, None, "flash"),
    ("tsp", 3, None, "dense"),
    ("ring", 3, None, "flash"),
  ],
)
def test_latent_prefill_equals_one_device(
  checkpoints, tokens, one_device, strategy, ranks, partition, attention
):
  """KV-Runahead's hops carry the latent prefix (4 ranks: forwarding buffers), all-gather CP
  gathers every rank's latents; each rank expands what it holds: the last rank's logits and
  its whole latent cache as one device computes them, KV-Runahead's with no move."""
  ours = checkpoints["deepseek-default"][2]
  mesh = kvr_jax.make_mesh(ranks)
  result = prefilled(ours, tokens, mesh, partition, attention, 2, strategy)
  want_logits, want_cache = one_device
  assert_close(result.logits, want_logits, "last logits")
  assert_close(result.past.cache, want_cache, "latent cache")
  assert result.logits.devices() == result.past.cache.devices() == {mesh.devices.flat[-1]}
  assert result.moved == (strategy != "kvr")


def test_the_split_as_data_equals_one_device(checkpoints, tokens, one_device):
  """KV-Runahead with the split as data (`runahead.split_as_data_strategy`: one program for
  every split that fits its envelope) on latent layers: at two splits, the last rank's
  logits and its whole latent cache (the parts moved there: no last hop is kept, its size
  being data) as one device computes them, on one trace."""
  ours, mesh = checkpoints["deepseek-default"][2], kvr_jax.make_mesh(3)
  shape = OneBodyShape.envelope(ours.config, (16, 14, 10), get_kernel("flash"), 18)
  as_data = runahead.split_as_data_strategy(ours.config, shape)
  traced = TRACE_COUNT["kvr-latent"]
  for split in ([16, 14, 10], [2, 18, 20]):
    result = prefilled(ours, tokens, mesh, split, "flash", 2, as_data)
    want_logits, want_cache = one_device
    assert_close(result.logits, want_logits, f"{split}: last logits")
    assert_close(result.past.cache, want_cache, f"{split}: latent cache")
    assert result.moved and result.past.cache.devices() == {mesh.devices.flat[-1]}
  assert TRACE_COUNT["kvr-latent"] - traced <= 1, "a program per split"


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize("cache", ["last", "sharded"])
def test_the_split_as_data_decodes_transformers_tokens(checkpoints, tokens, cache):
  """kvr_jax.generate with the split as data's record on a latent model: transformers'
  greedy tokens from its cache, joined on the last rank or left in the ranks' parts, at two
  splits on one program."""
  hf_model, _, ours = checkpoints["deepseek-default"]
  prompt = tokens[:1, :24]
  want = hf_fixtures.hf_greedy(hf_model, prompt, 6)
  shape = OneBodyShape.envelope(ours.config, (14, 10), get_kernel("flash"), 20)
  strategy = runahead.split_as_data_strategy(ours.config, shape)
  for split in ([14, 10], [4, 20]):
    got = kvr_jax.generate(
      ours, prompt, 6, strategy=strategy, mesh=kvr_jax.make_mesh(2), partition=split, cache=cache
    )
    np.testing.assert_array_equal(got.tokens, want, err_msg=f"split {split}")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_the_measured_search_times_a_latent_models_candidates_on_one_program(
  checkpoints, tokens, tmp_path
):
  """objective='measured' on a latent model: its candidates run on the split as data's
  program, not a program each."""
  ours, mesh = checkpoints["deepseek-default"][2], kvr_jax.make_mesh(2)
  assert_candidates_on_one_program(ours, tokens, mesh, "kvr-latent", tmp_path)


def test_latent_kvr_attends_its_early_diagonal_before_the_hop(checkpoints):
  """With flash (it returns its log-sum-exp) KV-Runahead's ranks attend their first rows'
  own latents before the prefix lands, as on K,V layers; the split [5, 15, 12, 8] that
  test_latent_prefill_equals_one_device checks gives ranks 2 and 3 early rows; dense, none."""
  from kvr_jax.strategies.latent import kvr_latent_rank
  from models.kernels import get_kernel

  ours = checkpoints["deepseek-default"][2]
  chunks = (5, 15, 12, 8)
  flash = kvr_latent_rank(ours.module, 0, chunks, get_kernel("flash"))
  assert flash.diagonal_first and flash.static_early_rows[0] == 0
  assert flash.static_early_rows[2] > 0 and flash.static_early_rows[3] > 0
  dense = kvr_latent_rank(ours.module, 0, chunks, get_kernel("dense"))
  assert not dense.diagonal_first and dense.static_early_rows == (0, 0, 0, 0)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_kvr_on_latent_attention_decodes_transformers_greedy_tokens(checkpoints, tokens):
  hf_model, _, ours = checkpoints["deepseek-default"]
  want = hf_fixtures.hf_greedy(hf_model, tokens[:1, :24], 6)
  mesh = kvr_jax.make_mesh(2)
  got = kvr_jax.generate(ours, tokens[:1, :24], 6, strategy="kvr", mesh=mesh, partition=[14, 10])
  got = got.tokens
  np.testing.assert_array_equal(got, want)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize("cache", ["last", "sharded"])
def test_latent_samples_transformers_draws_in_both_layouts(checkpoints, tokens, cache):
  """Sampled decoding (temperature, top-k, seed) from KV-Runahead's latent cache, whole or in
  the ranks' parts, draws the tokens that transformers' uncached logits give with
  kvr_jax.generate's key schedule (not the greedy ones)."""
  hf_model, _, ours = checkpoints["deepseek-default"]
  prompt = tokens[:1, :24]
  want = hf_fixtures.hf_sampled(hf_model, prompt, 6, temperature=1.5, top_k=40, seed=5)
  assert not np.array_equal(want, hf_fixtures.hf_greedy(hf_model, prompt, 6))
  mesh = kvr_jax.make_mesh(2)
  sampling = dict(temperature=1.5, top_k=40, seed=5)
  got = kvr_jax.generate(
    ours, prompt, 6, strategy="kvr", mesh=mesh, partition=[14, 10], cache=cache, **sampling
  )
  np.testing.assert_array_equal(got.tokens, want)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize(
  ("strategy", "ranks", "partition", "length"),
  # 22: zigzag pads to 24; TSP's ranks hold 8, 8 and 6 (the last padded)
  [
    ("kvr", 3, [10, 8, 6], 24),
    ("allgather", 4, None, 22),
    ("tsp", 3, None, 22),
    ("ring", 2, None, 22),
  ],
)
def test_sharded_latent_cache_decodes_in_place(
  checkpoints, tokens, strategy, ranks, partition, length
):
  """cache="sharded": the ranks' latents stay where the prefill computed them (nothing moves),
  each decode step merges every rank's absorbed partial over its own part (and the last
  rank's over the decoded tokens): transformers' greedy tokens."""
  from kvr_jax.runtime.mesh import AXIS

  hf_model, _, ours = checkpoints["deepseek-default"]
  prompt = tokens[:, :length]
  mesh = kvr_jax.make_mesh(ranks)
  result = prefilled(ours, prompt, mesh, partition, None, 6, strategy, cache="sharded")
  assert result.cache == "sharded" and result.past.parts.sharding.spec[0] == AXIS
  assert {s.device for s in result.past.parts.addressable_shards} == set(mesh.devices.flat)
  assert sorted(p for p in result.past.part_positions.flat if p >= 0) == list(range(length))
  got = kvr_jax.generate(
    ours, prompt, 6, strategy=strategy, mesh=mesh, partition=partition, cache="sharded"
  )
  np.testing.assert_array_equal(got.tokens, hf_fixtures.hf_greedy(hf_model, prompt, 6))


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_a_hop_carries_the_latent_not_the_heads(checkpoints):
  """The compiled KV-Runahead program's collective-permutes (its hops) carry C = kv_lora_rank
  + rope numbers per token (one headless latent), not N x (nope + rope + v) of per-head K,V:
  the bytes per token read from the HLO's shapes."""
  import re

  from kvr_jax.runtime.mesh import AXIS
  from kvr_jax.strategies import get_strategy
  from kvr_jax.strategies.by_kind import compile_by_kind
  from models.kernels import get_kernel

  ours = checkpoints["deepseek-default"][2]
  cfg, chunks, B = ours.config, (16, 12, 12), 2
  mesh = kvr_jax.make_mesh(3)
  program = compile_by_kind(
    "kvr", ours.graphdef, mesh, chunks, get_kernel("flash"), ours.config.kinds
  )
  tokens_pBc = get_strategy("kvr").arrange(np.zeros((B, sum(chunks)), np.int32), chunks)
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  by_rank = jax.sharding.NamedSharding(mesh, jax.P(AXIS))
  hlo = (
    program.lower(ours.state_on(replicated), jax.device_put(tokens_pBc, by_rank))
    .compile()
    .as_text()
  )
  pattern = r"= f32\[([\d,]+)\]\{[\d,]*\} collective-permute(?:-start)?\("
  shapes = [tuple(int(d) for d in m.group(1).split(",")) for m in re.finditer(pattern, hlo)]
  # Two stacks (dense, experts) of two hops each: [1, B, S_k, 1, C] with S_k = 16 and 28.
  assert sorted(shapes) == sorted([(1, B, 16, 1, 24), (1, B, 28, 1, 24)] * 2), shapes
  bytes_per_token = {4 * np.prod(s) // (B * s[2]) for s in shapes}
  assert bytes_per_token == {4 * cfg.cache_width}
  per_head = 4 * cfg.num_heads * (cfg.head_dim + cfg.v_head_dim)
  assert per_head / (4 * cfg.cache_width) == 6  # 4 heads x (24 + 12) against 16 + 8


# --- latent attention and DeepSeek's mixture on a 2-D mesh (heads and experts over "model")


@pytest.mark.default_cases("tsp-shape4-None-dense")
@pytest.mark.parametrize(
  "strategy, shape, partition, attention",
  [
    ("kvr", (2, 2), [25, 15], "flash"),
    ("kvr", (2, 4), [22, 18], "dense"),
    ("allgather", (2, 4), None, "flash"),
    ("ring", (2, 2), None, "flash"),
    ("tsp", (2, 2), None, "dense"),
  ],
)
def test_latent_prefill_on_a_2d_mesh_equals_one_device(
  checkpoints, tokens, one_device, strategy, shape, partition, attention
):
  """Each rank a model group: the query heads and kv_b_proj split over "model", the 8 routed
  experts E/m whole per device, the shared expert and the dense first layer by column, the
  latent (headless) whole on every shard, and what the hops carry: the last rank's logits and
  its whole latent cache as one device computes them."""
  ours = checkpoints["deepseek-default"][2]
  mesh = kvr_jax.make_mesh(shape[0], model=shape[1])
  result = prefilled(ours, tokens, mesh, partition, attention, 2, strategy)
  want_logits, want_cache = one_device
  assert_close(result.logits, want_logits, "last logits")
  assert_close(result.past.cache, want_cache, "latent cache")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_a_latent_model_loads_split_and_decodes_on_its_model_groups(checkpoints, tokens):
  """load_model(mesh=) on 2 x 4 sends each device its heads (wq_b, wk_b, wv_b, wo [.., N/m, ..]),
  its 2 of the 8 experts and its quarter of the shared expert's and dense layer's columns;
  KV-Runahead then decodes transformers' greedy tokens from the last rank's group (the cache
  whole there) and from the ranks' parts."""
  hf_model, directory, _ = checkpoints["deepseek-default"]
  mesh = kvr_jax.make_mesh(2, model=4)
  split = kvr_jax.load_model(str(directory), mesh=mesh)
  cfg, m = split.config, 4
  local = {
    ("blocks", "wk_b"): 2,
    ("blocks", "wo"): 1,
    ("blocks", "w_gate"): 1,
    ("blocks", "w_shared_gate"): 2,
    ("dense_blocks", "w_gate"): 2,
  }
  whole = {
    ("blocks", "wk_b"): cfg.num_heads,
    ("blocks", "wo"): cfg.num_heads,
    ("blocks", "w_gate"): cfg.num_experts,
    ("blocks", "w_shared_gate"): cfg.expert_dim * cfg.shared_experts,
    ("dense_blocks", "w_gate"): cfg.mlp_dim,
  }
  for (stack, name), axis in local.items():
    leaf = split.state[stack][name]
    assert {s.data.shape[axis] for s in leaf.addressable_shards} == {whole[stack, name] // m}
  latent = split.state["blocks"]["wkv_a"]
  assert {s.data.shape for s in latent.addressable_shards} == {latent.shape}  # whole
  prompt = tokens[:, :24]
  want = hf_fixtures.hf_greedy(hf_model, prompt, 5)
  for cache in ("last", "sharded"):
    got = kvr_jax.generate(
      split, prompt, 5, strategy="kvr", mesh=mesh, partition=[14, 10], cache=cache
    )
    np.testing.assert_array_equal(got.tokens, want, err_msg=cache)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_compiled_memory_of_a_latent_model_splits_its_weights_not_its_latents():
  """XLA's per-device memory (from shapes) of bench-deepseek's KV-Runahead program on 2 x 1 and
  2 x 2: one device holds half of every head's and expert's weights (by hand: the q
  projection, kv_b_proj's halves and wo per head; the dense layer's, the routed and the
  shared experts' matrices), the latent projection, router and norms whole; the latent cache
  is the same on both (headless: whole on every shard), and the last rank's decode step
  holds the weights and that cache grown by the new tokens."""
  from kvr_jax.runtime.loading import preset_config

  cfg = preset_config("bench-deepseek")
  kw = dict(context_len=512, num_ranks=2, partition="even", decode_tokens=4)
  whole = kvr_jax.compiled_memory(cfg, "kvr", **kw)
  split = kvr_jax.compiled_memory(cfg, "kvr", model_parallel=2, **kw)
  D, N, R, L = cfg.d_model, cfg.num_heads, cfg.kv_lora_rank, cfg.num_layers
  n, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  heads = L * (D * N * (n + r) + R * N * (n + v) + N * v * D)
  f, E = cfg.expert_dim, cfg.num_experts
  mlps = cfg.first_dense_layers * 3 * D * cfg.mlp_dim
  mlps += cfg.moe_layers * 3 * D * f * (E + cfg.shared_experts)
  assert whole["weights_bytes"] - split["weights_bytes"] == (heads + mlps) * 4 // 2
  latents = L * 512 * cfg.cache_width * 4
  assert whole["latent_cache_bytes"] == split["latent_cache_bytes"] == latents
  grown = L * (512 + 4) * cfg.cache_width * 4
  assert split["decode_argument_bytes"] >= split["weights_bytes"] + grown
  assert split["decode_argument_bytes"] < split["weights_bytes"] + grown + 1024
  # cache="sharded" keeps no last hop: each device's outputs lose its [L, B, 256, C] buffer.
  sharded = kvr_jax.compiled_memory(cfg, "kvr", model_parallel=2, cache="sharded", **kw)
  hop = L * 256 * cfg.cache_width * 4
  assert 0 <= split["output_bytes"] - sharded["output_bytes"] - hop < 64  # XLA's few bytes


def test_a_latent_layers_rest_runs_in_row_blocks_as_whole(checkpoints, tokens):
  """DeepSeek's out-projection and mixture in blocks of 16 rows (what the strategies run with
  ROW_BLOCK = 8192 on long chunks: one block's routed rows at a time) equal the whole 40 rows."""
  module = checkpoints["deepseek-default"][2].module
  block = nnx.merge(*nnx.split(module.blocks))  # the stacked experts' layers
  layer = nnx.merge(nnx.split(block)[0], jax.tree.map(lambda w: w[0], nnx.split(block)[1]))
  rng = np.random.RandomState(5)
  cfg = module.config
  x = jnp.asarray(rng.randn(2, T, cfg.d_model), jnp.float32)
  attn = jnp.asarray(rng.randn(2, T, cfg.num_heads, cfg.v_head_dim), jnp.float32)
  assert_close(layer.finish(x, attn, row_block=16), layer.finish(x, attn, None), "row blocks")


def test_latent_prefill_refuses_by_name(checkpoints, tokens):
  ours, two = checkpoints["deepseek-default"][2], kvr_jax.make_mesh(2)
  with pytest.raises(ValueError, match="unknown strategy 'zigzag'"):
    prefilled(ours, tokens, two, None, strategy="zigzag")
  with pytest.raises(ValueError, match="log-sum-exp"):
    prefilled(ours, tokens, two, None, "dense", strategy="ring")
  with pytest.raises(ValueError, match="lays the prompt out itself"):
    prefilled(ours, tokens, two, [20, 20], strategy="allgather")
  with pytest.raises(ValueError, match="outside the vocabulary"):
    prefilled(ours, tokens + 1000, two, [20, 20])
  with pytest.raises(ValueError, match="unknown cache layout .parts."):
    prefilled(ours, tokens, two, [20, 20], cache="parts")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_a_saved_model_restores_whole(checkpoints, tokens, tmp_path):
  """Orbax: both stacks (dense and experts) and the router's correction bias come back."""
  _, _, ours = checkpoints["deepseek-default"]
  kvr_jax.save_model(ours, str(tmp_path / "checkpoint"))
  restored = kvr_jax.load_model(str(tmp_path / "checkpoint"))
  assert restored.config == ours.config
  np.testing.assert_array_equal(restored.module(tokens[:, :8]), ours.module(tokens[:, :8]))


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_the_absorbed_form_of_a_chunk_is_the_expanded_one():
  """A rank's 24 queries after a 40-position prefix (bench-deepseek's shapes, random weights
  and inputs, float32): the absorbed form (queries into the latent space, an MQA over the
  latents) gives the expanded form's outputs (every head's K,V built) within 1e-5, causal
  from the queries' offset."""
  config = kvr_jax.runtime.loading.preset_config("bench-deepseek")
  graphdef, state = latent_forms.one_latent_layer(config, seed=3)
  layer = nnx.merge(graphdef, state)
  rng = np.random.RandomState(4)
  N, n, r = config.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
  q_nope = jnp.asarray(rng.randn(2, 24, N, n), jnp.float32)
  q_rope = jnp.asarray(rng.randn(2, 24, N, r), jnp.float32)
  cache = jnp.asarray(rng.randn(2, 64, config.kv_lora_rank + r), jnp.float32)
  absorbed = layer.attend_absorbed_chunk(q_nope, q_rope, cache, 40)
  expanded = layer.attend_expanded(q_nope, q_rope, cache, 40, "dense")
  assert absorbed.shape == (2, 24, N, config.v_head_dim)
  assert_close(absorbed, expanded, "absorbed against expanded")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_latent_forms_are_timed_beside_their_modelled_sums():
  """The tool times both forms and counts their multiply-adds, hand-worked for bench-deepseek
  (N 4, R 128, n 64, r 32, v 64) at c = 8 after S = 256: expanded 264 x 128 x 4 x 128 + 8 x
  264 x 4 x 160, absorbed 8 x 4 x 64 x 128 + 8 x 4 x 128 x 64 + 8 x 264 x 4 x 288."""
  (row,) = latent_forms.time_latent_forms(
    "bench-deepseek", prefix_len=256, chunk_lens=[8], repeats=1
  )
  assert (row.chunk_len, row.prefix_len) == (8, 256)
  assert row.expanded_macs == 264 * 128 * 4 * 128 + 8 * 264 * 4 * 160
  assert row.absorbed_macs == 8 * 4 * 64 * 128 + 8 * 4 * 128 * 64 + 8 * 264 * 4 * 288
  assert min(row.expanded_flash_s, row.expanded_dense_s, row.absorbed_s) > 0
  assert "absorbed/expanded" in latent_forms.latent_forms_table([row])
  with pytest.raises(ValueError, match="no latent attention"):
    latent_forms.time_latent_forms("tiny-llama")
  with pytest.raises(ValueError, match="must be positive"):
    latent_forms.time_latent_forms("bench-deepseek", chunk_lens=[0])
