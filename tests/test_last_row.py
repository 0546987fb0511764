"""A prefill's last layer attends and finishes the prompt's last row alone: the first token
reads that row's logits and nothing else of the layer, and every row's cache entries are made
before its attention. Every strategy (KV-Runahead's two bodies, the peers, TSP, single), the
hybrid and latent programs and their models' own forward (strategy "single") do it.

What is checked here: the programs' matmuls (their jaxpr: the last layer's MLP runs on one
row, and no strategy runs an MLP on any other row count than its chunks' and that one), and
that the one-row path is the layer's own output at that row (1e-5). Which branch runs is in
the timeline probes (tests/test_timeline.py); every strategy's logits against the oracle in
tests/test_strategies.py, test_peers.py, test_cache_forms.py and test_qwen3_5.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvr_jax
from kvr_jax.inference.prefill import plan_prefill
from kvr_jax.runtime.loading import build_model, preset_config
from kvr_jax.runtime.mesh import AXIS, global_array
from kvr_jax.strategies import by_kind, runahead
from models.base import finish_one_row
from tests import hf_fixtures
from tests.tolerance import assert_close

T = 40


def _subjaxprs(value):
  for item in value if isinstance(value, (list, tuple)) else (value,):
    if hasattr(item, "eqns"):  # a Jaxpr
      yield item
    elif hasattr(getattr(item, "jaxpr", None), "eqns"):  # a ClosedJaxpr
      yield item.jaxpr


def _matmul_rows(jaxpr, width: int) -> set[int]:
  """The row counts (axis -2) of every dot_general in `jaxpr` (nested: pjit, shard_map, scan,
  cond and switch branches) whose output is `width` wide: an MLP's first matmuls."""
  rows = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      shape = eqn.outvars[0].aval.shape
      if len(shape) >= 2 and shape[-1] == width:
        rows.add(shape[-2])
    for value in eqn.params.values():
      for sub in _subjaxprs(value):
        rows |= _matmul_rows(sub, width)
  return rows


def _program_rows(model, strategy, ranks: int, width: int, **kwargs) -> set[int]:
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, T)
  mesh = kvr_jax.make_mesh(ranks)
  plan = plan_prefill(model, tokens, strategy=strategy, mesh=mesh, **kwargs)
  arranged = plan.strategy.arrange(np.asarray(tokens), plan.chunks)
  tokens_pBc = global_array(arranged, jax.sharding.NamedSharding(mesh, jax.P(AXIS)))
  jaxpr = jax.make_jaxpr(plan.program(model))(model.state_for(mesh), tokens_pBc)
  return _matmul_rows(jaxpr.jaxpr, width)


@pytest.fixture(scope="module")
def llama():
  return kvr_jax.load_model("tiny-llama")


# (strategy, ranks, partition, the rows its layers before the last run their MLP on)
KV_RUNS = [
  ("single", 1, None, {T}),
  (runahead.PER_RANK_STRATEGY, 3, [18, 12, 10], {18, 12, 10}),  # a branch per rank, its c_i
  (runahead.ONE_BODY_STRATEGY, 3, [18, 12, 10], None),  # row blocks of the one body
  ("ring", 2, None, {T // 2}),
  ("allgather", 2, None, {T // 2}),
  ("tsp", 2, None, {T // 2}),
]


@pytest.mark.default_cases(
  "strategy1-3-partition1-rows1",
  "strategy2-3-partition2-None",
  "ring-2-None-rows3",
  "allgather-2-None-rows4",
  "tsp-2-None-rows5",
)
@pytest.mark.parametrize("strategy, ranks, partition, rows", KV_RUNS)
def test_kv_strategies_finish_one_row_in_the_last_layer(llama, strategy, ranks, partition, rows):
  kwargs = {"partition": partition} if partition else {}
  got = _program_rows(llama, strategy, ranks, llama.config.mlp_dim, **kwargs)
  assert 1 in got, got  # the last layer's one row
  if rows is not None:
    assert got == rows | {1}, got


def test_finish_one_row_is_the_layer_at_that_row(llama):
  """The one-row path against the whole layer's output at that row, at an offset into a longer
  key set (a KV-Runahead rank's last row over its prefix and its chunk)."""
  model = llama.module
  block = jax.tree.map(lambda w: w[0], model.blocks)
  x_BTD = jax.random.normal(jax.random.key(0), (2, T, llama.config.d_model))
  positions_BT = jnp.broadcast_to(jnp.arange(T), (2, T))
  q, k, v = block.project_qkv(x_BTD, positions_BT)
  whole_BTD = block.finish(x_BTD, block.attend(q, k, v, 0, "flash"))
  # The last 8 rows as a rank's chunk whose prefix is the first 32 positions.
  got_B8D = finish_one_row(block, x_BTD[:, 32:], q[:, 32:], jnp.stack([k, v]), 7, T - 1)
  assert_close(got_B8D[:, -1], whole_BTD[:, -1], "the last row")
  np.testing.assert_array_equal(got_B8D[:, :-1], x_BTD[:, 32:-1])  # the others as they came
  # Another row than the last: its own position.
  got_B8D = finish_one_row(block, x_BTD[:, 32:], q[:, 32:], jnp.stack([k, v]), 3, 35)
  assert_close(got_B8D[:, 3], whole_BTD[:, 35], "row 35")


@pytest.fixture(scope="module")
def own_models(tmp_path_factory):
  hybrid_model = hf_fixtures.saved_checkpoints(
    hf_fixtures.make_qwen35_model, ["qwen3_5-default"], tmp_path_factory
  )["qwen3_5-default"][2]
  latent_model = hf_fixtures.saved_checkpoints(
    hf_fixtures.make_deepseek_model, ["deepseek-default"], tmp_path_factory
  )["deepseek-default"][2]
  return {"hybrid": hybrid_model, "latent": latent_model}


def _mlp_width(model) -> int:
  """A width only a layer's rest has: the hybrid's MLP columns, the latent model's router
  (its last layers are a mixture of experts; every row is routed)."""
  cfg = model.config
  return cfg.num_experts if hasattr(cfg, "expert_dim") else cfg.mlp_dim


@pytest.mark.default_cases("latent")
@pytest.mark.parametrize("family", ["hybrid", "latent"])
def test_own_forward_finishes_one_row_only_when_asked(own_models, family):
  model = own_models[family]
  tokens_BT = jnp.asarray(kvr_jax.synthetic_prompt(model.config.vocab_size, T))
  width = _mlp_width(model)

  def rows(last_row_only):
    jaxpr = jax.make_jaxpr(
      lambda m, t: m.forward(t, "flash", last_row_only=last_row_only)[0][:, -1]
    )(model.module, tokens_BT)
    return _matmul_rows(jaxpr.jaxpr, width)

  assert rows(False) == {T}
  assert rows(True) == {T, 1}
  # The last row through the skip is the model's own.
  run = jax.jit(
    lambda m, t, only: m.forward(t, "flash", last_row_only=only)[0][:, -1], static_argnums=2
  )
  assert_close(run(model.module, tokens_BT, True), run(model.module, tokens_BT, False), "last row")


@pytest.mark.default_cases(
  "hybrid-kvr-2-rows0",
  "latent-kvr-2-rows2",
  "latent-allgather-2-rows3",
  "latent-tsp-2-rows4",
)
@pytest.mark.parametrize(
  "family, strategy, ranks, rows",
  [
    ("hybrid", "kvr", 2, {24, 16}),
    ("hybrid", "ring", 2, {T // 2}),
    ("latent", "kvr", 2, {24, 16}),
    ("latent", "allgather", 2, {T // 2}),
    ("latent", "tsp", 2, {T // 2}),
  ],
)
def test_own_programs_finish_one_row_in_the_last_layer(own_models, family, strategy, ranks, rows):
  model = own_models[family]
  mesh = kvr_jax.make_mesh(ranks)
  chunks = (24, 16) if strategy == "kvr" else None
  tokens = np.asarray(kvr_jax.synthetic_prompt(model.config.vocab_size, T))
  kinds = model.config.kinds
  if family == "hybrid":
    chunks = chunks or hybrid_layout(strategy, ranks)
    program = by_kind.compile_by_kind(strategy, model.graphdef, mesh, chunks, "flash", kinds)
  else:
    chunks = chunks or hybrid_layout(strategy, ranks)
    program = by_kind.compile_by_kind(strategy, model.graphdef, mesh, chunks, "flash", kinds)
  arranged = kvr_jax.strategies.get_strategy(strategy).arrange(tokens, chunks)
  tokens_pBc = global_array(arranged, jax.sharding.NamedSharding(mesh, jax.P(AXIS)))
  jaxpr = jax.make_jaxpr(program)(model.state_for(mesh), tokens_pBc)
  got = _matmul_rows(jaxpr.jaxpr, _mlp_width(model))
  assert got == rows | {1}, got


def hybrid_layout(strategy: str, ranks: int) -> tuple[int, ...]:
  return tuple(kvr_jax.strategies.get_strategy(strategy).layout(T, ranks))


@pytest.mark.default_cases("tsp-2")
@pytest.mark.parametrize("strategy, ranks", [("single", 1), ("tsp", 2)])
def test_the_one_row_branch_is_the_one_taken(strategy, ranks):
  """Which branch runs, seen by XLA: in a one-layer model the layer index is a constant, the
  cond folds to the branch taken, and XLA's count of the program's FLOPs is that branch's.
  The last layer's one row costs a fraction of a whole layer (the two-layer program's count:
  XLA counts the layer loop's body once, its larger branch). KV-Runahead's and the zigzag
  peers' programs keep their conds (a rank-dependent switch, a loop XLA does not unroll):
  which branch they run is in their timeline probes (tests/test_timeline.py)."""

  def program_flops(num_layers: int) -> float:
    config = dataclasses.replace(preset_config("tiny-llama"), num_layers=num_layers)
    model = kvr_jax.Model(build_model(config))
    tokens = kvr_jax.synthetic_prompt(config.vocab_size, 256)
    mesh = kvr_jax.make_mesh(ranks)
    plan = plan_prefill(model, tokens, strategy=strategy, mesh=mesh)
    arranged = plan.strategy.arrange(np.asarray(tokens), plan.chunks)
    tokens_pBc = global_array(arranged, jax.sharding.NamedSharding(mesh, jax.P(AXIS)))
    lowered = plan.program(model).lower(model.state_for(mesh), tokens_pBc)
    return lowered.compile().cost_analysis()["flops"]

  one_row, whole = program_flops(1), program_flops(2)
  assert one_row < 0.3 * whole, (one_row, whole)
