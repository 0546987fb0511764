"""Mixtures of experts on a 2-D mesh ("ranks", "model"): each shard of a model group holds
E/m whole experts (kvr_jax.runtime.tensor_parallel), routes every token alike and runs only
the rows routed to its own experts; the psum over "model" adds the experts' outputs. Every
strategy and both cache layouts against one device (1e-5), decode, loading straight into
shards from Hugging Face directories (one tensor per expert, or a layer's experts in one),
Orbax, XLA's memory per device, and what is refused by name."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

import kvr_jax
from kvr_jax.inference.prefill import plan_prefill
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.loading import build_model, preset_config
from kvr_jax.runtime.mesh import MODEL_AXIS
from tests import hf_fixtures
from tests.tolerance import assert_close, relative_error

MOE = preset_config("tiny-moe")  # 8 experts, 2 per token; 4 heads, 2 KV heads
PROMPT = np.random.RandomState(1).randint(0, MOE.vocab_size, (2, 37))
MODEL_TOL = 1e-4  # whole models against transformers, float32


@pytest.fixture(scope="module")
def moe():
  """tiny-moe with every weight moved off its initial value, and its single-device prefill."""
  graphdef, state = nnx.split(build_model(MOE))
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(state))))
  state = jax.tree.map(lambda w: w + 0.05 * jax.random.normal(next(keys), w.shape, w.dtype), state)
  model = kvr_jax.Model(nnx.merge(graphdef, state), source="perturbed-tiny-moe")
  return model, kvr_jax.prefill(model, PROMPT, "single")


CASES = [
  ("kvr", (2, 2), [25, 12]),
  ("kvr", (2, 4), [23, 14]),
  ("kvr", (4, 2), [13, 10, 8, 6]),
  ("ring", (4, 2), None),
  ("allgather", (2, 4), None),
  ("tsp", (2, 2), None),
]


@pytest.mark.default_cases("kvr-shape1-partition1", "tsp-shape5-None")
@pytest.mark.parametrize("strategy,shape,partition", CASES)
def test_every_strategy_with_split_experts_matches_single(moe, strategy, shape, partition):
  """Logits and the gathered cache within 1e-5 of one device's."""
  model, oracle = moe
  mesh = kvr_jax.make_mesh(*shape[:1], model=shape[1])
  kw = {} if partition is None else {"partition": partition}
  result = kvr_jax.prefill(model, PROMPT, strategy, mesh=mesh, cache="sharded", **kw)
  assert_close(result.logits, oracle.logits, "logits")
  k, v = result.gather_cache()
  assert_close(k, oracle.k_cache, "K cache")
  assert_close(v, oracle.v_cache, "V cache")


def test_each_shard_holds_its_own_experts(moe):
  """On 2 x 4 every device holds 2 of the 8 experts of every layer (the router whole), and
  the shards of a group hold different experts."""
  model, _ = moe
  state = model.state_split_over(kvr_jax.make_mesh(2, model=4))
  L, E, D, F = MOE.num_layers, MOE.num_experts, MOE.d_model, MOE.mlp_dim
  for name, shard_shape in [
    ("w_gate", (L, 2, D, F)),
    ("w_up", (L, 2, D, F)),
    ("w_down", (L, 2, F, D)),
  ]:
    leaf = state["blocks"][name]
    assert {s.data.shape for s in leaf.addressable_shards} == {shard_shape}, name
  router = state["blocks"]["router"]
  assert {s.data.shape for s in router.addressable_shards} == {(L, D, E)}
  whole = np.asarray(model.state["blocks"]["w_gate"][...])
  first_row = [s for s in state["blocks"]["w_gate"].addressable_shards if s.index[1].start == 2]
  np.testing.assert_array_equal(np.asarray(first_row[0].data), whole[:, 2:4])


@pytest.mark.default_cases("sharded")
@pytest.mark.parametrize("cache", ["last", "sharded"])
def test_greedy_decode_with_split_experts_is_single_devices(moe, cache):
  model, _ = moe
  want = kvr_jax.generate(model, PROMPT, max_new_tokens=6, strategy="single")
  mesh = kvr_jax.make_mesh(2, model=4)
  got = kvr_jax.generate(
    model, PROMPT, max_new_tokens=6, strategy="kvr", mesh=mesh, partition=[23, 14], cache=cache
  )
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert_close(got.last_logits, want.last_logits, "the last step's logits")


def test_a_model_axis_dividing_neither_experts_nor_columns_is_refused_before_compiling(moe):
  """m must divide E (whole experts per shard) or F (columns of every expert); else refused by
  name. tiny-moe's F is 96: six experts split by column on 4 shards, not on 64."""
  model, _ = moe
  six = dataclasses.replace(MOE, num_experts=6)
  tensor_parallel.check_model_parallel(six, 2)  # 3 experts per shard
  tensor_parallel.check_model_parallel(six, 4)  # 24 columns of each of the 6 experts
  odd = dataclasses.replace(six, mlp_dim=90)
  with pytest.raises(
    ValueError, match=re.escape("model_parallel=4 must divide the 6 experts (each shard")
  ):
    tensor_parallel.check_model_parallel(odd, 4)
  with pytest.raises(ValueError, match="model_parallel=8 must divide num_heads"):
    plan_prefill(model, PROMPT, "kvr", mesh=kvr_jax.make_mesh(1, model=8), cache="sharded")


@pytest.fixture(scope="module")
def six_experts():
  """tiny-moe with six experts (not divided by m = 4), perturbed, and its one-device prefill."""
  config = dataclasses.replace(MOE, num_experts=6)
  graphdef, state = nnx.split(build_model(config))
  keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(state))))
  state = jax.tree.map(lambda w: w + 0.05 * jax.random.normal(next(keys), w.shape, w.dtype), state)
  model = kvr_jax.Model(nnx.merge(graphdef, state), source="six-expert tiny-moe")
  return model, kvr_jax.prefill(model, PROMPT, "single")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_experts_not_divided_by_the_model_axis_split_their_columns(six_experts):
  """Six experts on 2 x 4: every device holds all six with 24 of their 96 columns; KV-Runahead
  within 1e-5 of one device, and greedy decode from its sharded cache gives single's tokens."""
  model, oracle = six_experts
  mesh = kvr_jax.make_mesh(2, model=4)
  state = model.state_split_over(mesh)
  L, D, F = MOE.num_layers, MOE.d_model, MOE.mlp_dim
  for name, shard_shape in [("w_gate", (L, 6, D, F // 4)), ("w_down", (L, 6, F // 4, D))]:
    assert {s.data.shape for s in state["blocks"][name].addressable_shards} == {shard_shape}
  result = kvr_jax.prefill(model, PROMPT, "kvr", mesh=mesh, partition=[23, 14], cache="sharded")
  assert_close(result.logits, oracle.logits, "logits")
  want = kvr_jax.generate(model, PROMPT, max_new_tokens=4, strategy="single")
  got = kvr_jax.generate(
    model, PROMPT, max_new_tokens=4, strategy="kvr", mesh=mesh, partition=[23, 14]
  )
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert_close(got.last_logits, want.last_logits, "the last step's logits")
  from kvr_jax.tools import expert_load

  assert "every device runs every row" in expert_load.expert_load_line(model, PROMPT, 4)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_compiled_memory_holds_one_shards_experts():
  """XLA's per-device arguments of the 2-D program: every block matrix (attention's and the
  experts') divided by m (the 2 KV heads one per shard at m = 4, repeated), the rest whole.
  By hand for tiny-moe, float32, per layer: 2 D N H + 2 D K H attention, 3 E D F experts."""
  kw = dict(context_len=512, num_ranks=2, cache="sharded")
  whole = kvr_jax.compiled_memory("tiny-moe", "kvr", **kw)
  D, N, K, H, F, E, L = 128, 4, 2, 32, 96, 8, 2
  rest = whole["weights_bytes"] - L * (2 * D * N * H + 2 * D * K * H + 3 * E * D * F) * 4
  for m in (2, 4):
    shard = L * (2 * D * N * H // m + 2 * D * max(K // m, 1) * H + 3 * E * D * F // m) * 4
    split = kvr_jax.compiled_memory("tiny-moe", "kvr", model_parallel=m, **kw)
    assert split["weights_bytes"] == rest + shard, m


@pytest.fixture(scope="module")
def hf_moe_checkpoints(tmp_path_factory):
  """A tiny Qwen3-MoE (one tensor per expert) and a tiny gpt-oss (a layer's experts in one
  tensor, with biases) written by transformers: (torch model, directory)."""
  out = {}
  model = hf_fixtures.make_qwen3_moe_model()
  out["qwen3_moe"] = (model, tmp_path_factory.mktemp("qwen3_moe"))
  model.save_pretrained(out["qwen3_moe"][1])
  model = hf_fixtures.make_gpt_oss_model("gpt-oss-yarn")
  out["gpt_oss"] = (model, tmp_path_factory.mktemp("gpt_oss"))
  model.save_pretrained(out["gpt_oss"][1])
  return out


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_gpt_oss_experts_split_by_column_add_their_down_bias_once(tmp_path):
  """A tiny gpt-oss with six experts (random biases) loaded straight into 2 x 4, where 4 does
  not divide 6: each device reads 6 of every expert's 24 columns, and KV-Runahead gives
  transformers' logits (the experts' down bias added by one shard, not by four)."""
  hf_model = hf_fixtures.make_gpt_oss_model("gpt-oss-yarn", num_local_experts=6)
  hf_model.save_pretrained(tmp_path)
  mesh = kvr_jax.make_mesh(2, model=4)
  split = kvr_jax.load_model(str(tmp_path), mesh=mesh)
  blocks = split.state["blocks"]
  assert {s.data.shape[1:] for s in blocks["w_gate"].addressable_shards} == {(6, 32, 6)}
  assert {s.data.shape[1:] for s in blocks["b_down"].addressable_shards} == {(6, 32)}
  tokens = PROMPT % hf_fixtures.VOCAB
  want = hf_fixtures.hf_logits(hf_model, tokens)[:, -1]
  got = kvr_jax.prefill(split, tokens, "kvr", mesh=mesh, partition=[23, 14], cache="sharded")
  err = relative_error(got.logits, want)
  assert err <= MODEL_TOL, f"relative error {err:.2e}"


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_loaded_straight_into_shards_matches_transformers(hf_moe_checkpoints, family, tmp_path):
  """load_model(mesh=) sends each device its own experts; KV-Runahead on 2 x 2 then gives
  transformers' logits, and the split model saves and restores whole (Orbax)."""
  hf_model, directory = hf_moe_checkpoints[family]
  mesh = kvr_jax.make_mesh(2, model=2)
  split = kvr_jax.load_model(str(directory), mesh=mesh)
  w_gate = split.state["blocks"]["w_gate"]
  E = split.config.num_experts
  assert {s.data.shape[1] for s in w_gate.addressable_shards} == {E // 2}
  tokens = PROMPT % hf_fixtures.VOCAB
  want = hf_fixtures.hf_logits(hf_model, tokens)[:, -1]
  got = kvr_jax.prefill(split, tokens, "kvr", mesh=mesh, partition=[23, 14], cache="sharded")
  err = relative_error(got.logits, want)
  assert err <= MODEL_TOL, f"{family}: relative error {err:.2e}"
  kvr_jax.save_model(split, str(tmp_path / "saved"))
  restored = kvr_jax.load_model(str(tmp_path / "saved"))
  assert restored.config == split.config
  assert_close(kvr_jax.prefill(restored, tokens).logits, got.logits, "restored whole")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_expert_rows_per_device_count_every_pair_and_call_out_uneven_routing(
  moe, hf_moe_checkpoints
):
  """Every layer's rows add up to B T k over the devices; a router biased to the first shard's
  experts puts every row there, the line says UNEVEN, and the split prefill stays exact."""
  from kvr_jax.tools import expert_load

  model, _ = moe
  rows = expert_load.expert_rows_per_device(model, PROMPT, 4)
  assert rows.shape == (MOE.num_layers, 4)
  assert (rows.sum(axis=1) == PROMPT.size * MOE.experts_per_token).all()
  assert (rows > 0).all()  # a random router spreads the rows

  _, directory = hf_moe_checkpoints["gpt_oss"]
  loaded = kvr_jax.load_model(str(directory))
  graphdef, state = nnx.split(loaded.module)
  bias = state["blocks"]["router_bias"]
  bias.value = bias.value.at[:, 2:].set(-1e4)  # experts 2 and 3 never chosen: shard 1's
  biased = kvr_jax.Model(nnx.merge(graphdef, state), source="gpt-oss, biased router")
  tokens = PROMPT % hf_fixtures.VOCAB
  rows = expert_load.expert_rows_per_device(biased, tokens, 2)
  assert (rows[:, 0] == tokens.size * 2).all() and (rows[:, 1] == 0).all(), rows
  assert "UNEVEN" in expert_load.describe_expert_load(rows)
  assert expert_load.routing_imbalance(biased, tokens, 2) == 2.0  # the cost model's figure
  assert expert_load.routing_imbalance(biased, tokens, 1) == 1.0
  assert "UNEVEN" not in expert_load.describe_expert_load(np.array([[10, 9], [9, 10]]))
  # What launch.run and launch.benchmark's devices mode print: only for a split mixture.
  assert "UNEVEN" in expert_load.expert_load_line(biased, tokens, 2)
  assert expert_load.expert_load_line(biased, tokens, 1) is None
  assert expert_load.expert_load_line(kvr_jax.load_model("tiny-llama"), PROMPT, 2) is None
  mesh = kvr_jax.make_mesh(2, model=2)
  split = kvr_jax.prefill(biased, tokens, "kvr", mesh=mesh, partition=[23, 14], cache="sharded")
  assert_close(split.logits, kvr_jax.prefill(biased, tokens).logits, "all rows on one shard")


def test_auto_on_a_2d_mesh_models_each_rank_as_its_model_group(moe):
  """strategy="auto" on 2 x 2 plans with the cost model's shards (m = 2, the links preset
  inside a group too): every candidate's modelled TTFT is that of a Setup with
  model_parallel=2, not the 1-D mesh's; one device's pick runs on the last rank's group (its
  two devices), and the logits are single's."""
  from kvr_jax.planning import presets
  from kvr_jax.planning.choice import choose_strategy
  from kvr_jax.planning.costmodel import kernel_flags

  model, oracle = moe
  mesh = kvr_jax.make_mesh(2, model=2)
  plan = plan_prefill(model, PROMPT, "auto", mesh=mesh, cache="sharded")
  T, B = PROMPT.shape[1], PROMPT.shape[0]
  kw = dict(dtype_bytes=4, batch=B, **kernel_flags("flash"))
  split = choose_strategy(MOE, T, 2, presets.make_setup(model_parallel=2, **kw))
  whole = choose_strategy(MOE, T, 2, presets.make_setup(**kw))
  assert dict(plan.choice.predicted_s) == dict(split.predicted_s)
  # The group's all-reduces are modelled: at 37 tokens their latency outweighs the halved work.
  assert split.predicted_s["kvr"] > whole.predicted_s["kvr"]
  if plan.strategy.max_ranks == 1:
    assert list(plan.mesh.devices.reshape(-1)) == list(mesh.devices[-1])
  else:
    assert plan.mesh is mesh
  result = kvr_jax.prefill(model, PROMPT, "auto", mesh=mesh, cache="sharded")
  assert_close(result.logits, oracle.logits, "logits")


def test_the_cost_model_runs_the_busiest_devices_expert_rows():
  """Setup.expert_imbalance u: each rank's modelled MLP FLOPs grow by exactly (u - 1) times
  its even share of the routed rows (2 B c D k F/m per matrix), the router's do not; given
  only where the experts are split whole (six experts on four devices split their columns:
  every device runs every row); a KVR-S split on heavier experts gives rank 0 fewer tokens
  (its cheap attention weighs less against the MLP); u < 1 is refused by name."""
  from kvr_jax.planning import costmodel, presets
  from kvr_jax.planning.partition import PartitionPlan, resolve_partition
  from kvr_jax.runtime.roofline import shard_expert_imbalance

  config, T, chunks = preset_config("qwen3-30b-a3b"), 4096, [2560, 1536]
  D, F, k, m = config.d_model, config.mlp_dim, config.experts_per_token, 4
  kw = dict(dtype_bytes=2, batch=1, model_parallel=m)
  sims = [
    costmodel.simulate(
      config,
      "kvr",
      T,
      presets.make_setup("h100-sxm", "300GBps", expert_imbalance=u, **kw),
      num_ranks=2,
      partition=chunks,
    )
    for u in (1.0, 1.5)
  ]
  for c, even, heavy in zip(chunks, sims[0].rank_flops, sims[1].rank_flops, strict=True):
    assert heavy - even == pytest.approx(0.5 * 2 * c * D * k * (F // m) * 3, rel=1e-9)
  assert sims[1].ttft > sims[0].ttft
  assert shard_expert_imbalance(config, m, 1.5) == 1.5
  assert shard_expert_imbalance(dataclasses.replace(MOE, num_experts=6), 4, 1.5) == 1.0
  assert shard_expert_imbalance(config, 1, 1.5) == 1.0
  splits = [
    resolve_partition(
      PartitionPlan("search", "h100-sxm", "300GBps", expert_imbalance=u),
      T,
      2,
      config=config,
      dtype_bytes=2,
      model_parallel=m,
    )
    for u in (1.0, 4.0)
  ]
  assert splits[1][0] < splits[0][0], splits
  with pytest.raises(ValueError, match="expert_imbalance` must be a number >= 1"):
    PartitionPlan("search", expert_imbalance=0.5)


def test_the_tp_grid_plans_mixtures_on_every_model_group_they_split_over():
  """launch.paper's tp grid on a mixture (MODELLED): Mixtral-8x7B on 16 H100s includes model
  groups of 16 (8 experts split by column) and none the heads refuse; an expert imbalance
  slows only the cells whose experts split whole over m > 1."""
  from launch.harness import tp_grid

  def grid(model, u):
    cells = tp_grid.tp_grid(
      gpus=(16,), context_lens=(8192,), betweens=(50e9,), model=model, expert_imbalance=u
    )
    return {(c.num_ranks, c.model_parallel): c for c in cells}

  mixtral = grid("mixtral-8x7b", 1.0)
  assert sorted(mixtral) == [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]
  even, heavy = grid("qwen3-30b-a3b", 1.0), grid("qwen3-30b-a3b", 1.5)
  for shape, cell in even.items():
    for strategy, seconds in cell.ttft_s.items():
      if shape[1] == 1:
        assert heavy[shape].ttft_s[strategy] == seconds, (shape, strategy)
      else:
        assert heavy[shape].ttft_s[strategy] > seconds, (shape, strategy)


def _mlp_split_over(blocks, x_BTD, m):
  """Layer 0's MLP of stacked `blocks` (its weights split over a "model" axis of m devices as
  tensor_parallel splits them, the shards' outputs added by psum_over_model), and the whole
  block's on one device."""
  graphdef, state = nnx.split(blocks)
  specs = tensor_parallel.partition_specs({"blocks": state}, m)["blocks"]
  mesh = jax.make_mesh((m,), (MODEL_AXIS,), devices=jax.devices()[:m])

  def layer0_mlp(state, reduce):
    block = nnx.merge(graphdef, jax.tree.map(lambda w: w[0], state))
    return block.mlp(x_BTD, reduce)

  split = jax.shard_map(
    lambda s: layer0_mlp(s, tensor_parallel.psum_over_model),
    mesh=mesh,
    in_specs=(specs,),
    out_specs=jax.P(),
    check_vma=False,
  )
  from models.base import no_reduce

  shardings = jax.tree.map(
    lambda spec: jax.NamedSharding(mesh, spec),
    specs,
    is_leaf=lambda x: isinstance(x, jax.P),
  )
  return jax.jit(split)(jax.device_put(state, shardings)), layer0_mlp(state, no_reduce)


@pytest.mark.default_cases("qwen3_5_moe-6-4")
@pytest.mark.parametrize(
  "family,num_experts,m", [("deepseek_v3", 8, 4), ("qwen3_5_moe", 8, 2), ("qwen3_5_moe", 6, 4)]
)
def test_routed_and_shared_experts_split_over_a_model_group(family, num_experts, m):
  """DeepSeek-V3's and Qwen3.5-MoE's mixtures (routed experts, a shared expert, DeepSeek's
  grouped sigmoid router, Qwen's gated shared expert) split over m devices: 8 experts whole
  (E/m per device), 6 on 4 devices by column; the shared expert by column: within 1e-5 of the
  whole MLP. (Their attention runs no tensor parallelism yet: this is the MLP it will run.)"""
  if family == "deepseek_v3":
    config = dataclasses.replace(
      preset_config("bench-deepseek"), num_layers=2, num_experts=num_experts
    )
  else:
    config = dataclasses.replace(
      preset_config("bench-qwen3.5"),
      num_experts=num_experts,
      experts_per_token=2,
      mlp_dim=176,
      shared_expert_dim=176,
    )
  graphdef, state = nnx.split(build_model(config))
  keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(state))))
  state = jax.tree.map(lambda w: w + 0.05 * jax.random.normal(next(keys), w.shape, w.dtype), state)
  blocks = nnx.merge(graphdef, state).blocks
  x_BTD = jax.random.normal(jax.random.key(4), (2, 40, config.d_model))
  split, whole = _mlp_split_over(blocks, x_BTD, m)
  assert_close(split, whole, f"{family}, {num_experts} experts on {m}")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_bfloat16_split_experts_decode_single_devices_tokens():
  """tiny-moe in bfloat16: KV-Runahead on 2 x 2 with the experts split, then 6 greedy tokens
  from its sharded cache, as one device decodes them."""
  model = kvr_jax.load_model("tiny-moe", "bfloat16")
  want = kvr_jax.generate(model, PROMPT, max_new_tokens=6).tokens
  mesh = kvr_jax.make_mesh(2, model=2)
  got = kvr_jax.generate(
    model, PROMPT, 6, strategy="kvr", mesh=mesh, partition=[25, 12], cache="sharded"
  ).tokens
  np.testing.assert_array_equal(got, want)
