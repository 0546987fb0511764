"""The one program builder (strategies.by_kind) is every strategy's program: on a K,V model
(one kind, or a windowed and a full kind) it equals one device's, and it refuses a kind it
has no part for, by name, before tracing."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvr_jax
from kvr_jax.runtime.loading import build_model, load_model, preset_config
from kvr_jax.runtime.mesh import AXIS, global_array
from kvr_jax.strategies import by_kind, get_strategy
from kvr_jax.strategies.by_kind import compile_by_kind
from kvr_jax.strategies.kind_program import KindPart, KindProgram
from models.base import no_reduce, scan_layers
from models.kernels import get_kernel
from models.layer_kinds import FULL_ATTENTION
from models.llama import LlamaConfig
from tests.tolerance import assert_close


@pytest.mark.parametrize(
  "preset, strategy, chunks",
  [
    ("tiny-llama", "kvr", (14, 10)),  # one kind of layer
    ("tiny-gemma", "kvr", (14, 10)),  # a windowed and a full kind, one part
    pytest.param("tiny-gemma", "ring", None, marks=pytest.mark.e2e),  # a peer's body
  ],
)
def test_the_one_builder_equals_one_device_on_kv_models(preset, strategy, chunks):
  """Every strategy's program on a K,V model is the one builder's, its K,V named "kv": the
  last rank's logits and every rank's K,V part, laid in prompt order by the strategy's cache
  layout, equal the model's own forward on one device (models.base.CausalLM.forward, which
  no strategy runs)."""
  model = load_model(preset)
  spec, flash, kinds = get_strategy(strategy), get_kernel("flash"), model.config.kinds
  if preset == "tiny-gemma":
    assert len(kinds) == 2, kinds
  tokens = np.asarray(kvr_jax.synthetic_prompt(model.config.vocab_size, 24)).reshape(1, 24)
  x_BTD, k_LBTKH, v_LBTKH = model.module.forward(jnp.asarray(tokens), "dense")
  want_logits = np.asarray(model.module.logits(x_BTD[:, -1:]))[:, 0]
  want_kv = np.stack([np.asarray(k_LBTKH)[:, 0], np.asarray(v_LBTKH)[:, 0]], axis=1)

  mesh, chunks = kvr_jax.make_mesh(2), spec.layout(24, 2, chunks)
  tokens_pBc = global_array(spec.arrange(tokens, chunks), jax.NamedSharding(mesh, jax.P(AXIS)))
  program = compile_by_kind(spec, model.graphdef, mesh, chunks, flash, kinds, False)
  logits, outputs = program(model.state_for(mesh), tokens_pBc)
  assert set(outputs) == {"kv"}, set(outputs)
  layout = spec.cache_layout(24, chunks)
  # [p, L, 2, P, K, H] (one row: batch folded is the rows) -> [L, 2, p * P, K, H] rank after
  # rank, then the prompt's rows.
  parts = np.concatenate(list(np.asarray(outputs["kv"])), axis=2)
  assert_close(np.asarray(logits)[-1], want_logits, "the last rank's logits")
  assert_close(parts[:, :, layout.rows_in_prompt_order()], want_kv, "the K,V in prompt order")


def test_a_kind_without_a_part_is_refused_by_name():
  @dataclasses.dataclass(frozen=True)
  class ToyKind:
    name = "toy"

  model = load_model("tiny-llama")
  with pytest.raises(ValueError, match="no program runs toy layers"):
    compile_by_kind("kvr", model.graphdef, kvr_jax.make_mesh(2), (12, 12), "flash", (ToyKind(),))


# --- a made-up kind through the whole builder ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class MlpOnlyKind:
  """A layer that keeps no past: its rows skip attention (the block's output projection and
  MLP on a zero attention output), so nothing crosses the ranks and nothing is cached."""

  name: str = "mlp-only"


MLP_ONLY = MlpOnlyKind()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlpOnlyConfig(LlamaConfig):
  """tiny-llama with its layer 2 of 4 of the made-up kind."""

  @functools.cached_property
  def layer_kinds(self) -> tuple:
    kinds = list(super().layer_kinds)
    kinds[2] = MLP_ONLY
    return tuple(kinds)

  def of_kind(self, kind):
    return self if kind == MLP_ONLY else super().of_kind(kind)


def _skip_attention(block, x_BTD, reduce):
  cfg = block.config
  zeros_BTNH = jnp.zeros((*x_BTD.shape[:2], cfg.num_heads, cfg.head_dim), x_BTD.dtype)
  return block.finish(x_BTD, zeros_BTNH, reduce=reduce)


def _mlp_only_part(args, ctx, kind) -> KindPart:
  del args, kind

  def layer(block, x_BTD, carry, at):
    del at
    return _skip_attention(block, x_BTD, ctx.reduce), carry, {}  # no past: outputs nothing

  return KindPart(layer, ctx.model.blocks)


MLP_ONLY_PROGRAM = KindProgram(lambda strategy: None, _mlp_only_part, lambda *_: {})


@pytest.mark.parametrize("strategy, chunks", [("kvr", (14, 10)), ("ring", None)])
def test_a_made_up_kind_runs_through_the_builder(monkeypatch, strategy, chunks):
  """A new kind of layer is its record, its part (a `KindProgram`) and its line in
  KIND_PROGRAMS (WORKSPACE.md, "How to add a layer kind"): with nothing else added, the
  builder runs a model whose layer 2 of 4 is of it beside three softmax layers, and the last
  rank's logits and the softmax layers' K,V (their own buffer: layers 0, 1, 3) equal the
  same model's layers run in order on one device (`scan_layers`, dense attention)."""
  monkeypatch.setitem(by_kind.KIND_PROGRAMS, MlpOnlyKind, MLP_ONLY_PROGRAM)
  base = preset_config("tiny-llama")
  config = MlpOnlyConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
  model = kvr_jax.Model(build_model(config))
  assert config.kinds == (MLP_ONLY, FULL_ATTENTION), config.kinds
  tokens = np.asarray(kvr_jax.synthetic_prompt(config.vocab_size, 24)).reshape(1, 24)

  def reference_layer(block, at, x_BTD):
    q, k, v = block.project_qkv(x_BTD, jnp.arange(24)[None])  # layer 2's: not read
    if at.kind == MLP_ONLY:
      x_BTD = _skip_attention(block, x_BTD, no_reduce)
    else:
      x_BTD = block.finish(x_BTD, block.attend(q, k, v, 0, "dense"))
    return x_BTD, jnp.stack([k[0], v[0]])

  module = model.module
  x_BTD, kv_L2TKH = scan_layers(module, reference_layer, module.embed(jnp.asarray(tokens)))
  want_logits = np.asarray(module.logits(x_BTD[:, -1:]))[:, 0]
  want_kv = np.asarray(kv_L2TKH)[[0, 1, 3]]

  spec = get_strategy(strategy)
  mesh, chunks = kvr_jax.make_mesh(2), spec.layout(24, 2, chunks)
  tokens_pBc = global_array(spec.arrange(tokens, chunks), jax.NamedSharding(mesh, jax.P(AXIS)))
  program = compile_by_kind(spec, model.graphdef, mesh, chunks, "flash", config.kinds, False)
  logits, outputs = program(model.state_for(mesh), tokens_pBc)
  assert set(outputs) == {"kv"}, set(outputs)
  parts = np.concatenate(list(np.asarray(outputs["kv"])), axis=2)
  rows = spec.cache_layout(24, chunks).rows_in_prompt_order()
  assert_close(np.asarray(logits)[-1], want_logits, "the last rank's logits")
  assert_close(parts[:, :, rows], want_kv, "the softmax layers' K,V in prompt order")
