"""The one program builder (strategies.by_kind) is every strategy's program: on a K,V model
(one kind, or a windowed and a full kind) it equals one device's, and it refuses a kind it
has no part for, by name, before tracing."""

import dataclasses

import jax
import numpy as np
import pytest

import kvr_jax
from kvr_jax.runtime.loading import load_model
from kvr_jax.runtime.mesh import AXIS, global_array
from kvr_jax.strategies import get_strategy
from kvr_jax.strategies.by_kind import compile_by_kind
from models.kernels import get_kernel
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
  layout, equal one device's (the same builder under "single")."""
  model = load_model(preset)
  spec, flash, kinds = get_strategy(strategy), get_kernel("flash"), model.config.kinds
  if preset == "tiny-gemma":
    assert len(kinds) == 2, kinds
  tokens = np.asarray(kvr_jax.synthetic_prompt(model.config.vocab_size, 24)).reshape(1, 24)

  def run(spec, mesh, chunks):
    by_rank = jax.NamedSharding(mesh, jax.P(AXIS))
    tokens_pBc = global_array(spec.arrange(tokens, chunks), by_rank)
    program = compile_by_kind(spec, model.graphdef, mesh, chunks, flash, kinds, False)
    logits, outputs = program(model.state_for(mesh), tokens_pBc)
    assert set(outputs) == {"kv"}, set(outputs)
    return np.asarray(logits)[-1], np.asarray(outputs["kv"])

  want_logits, want_kv = run(get_strategy("single"), kvr_jax.make_mesh(1), (24,))
  chunks = spec.layout(24, 2, chunks)
  got_logits, got_kv = run(spec, kvr_jax.make_mesh(2), chunks)
  layout = spec.cache_layout(24, chunks)
  # [p, L, 2, P, K, H] -> [L, 2, p * P, K, H] rank after rank, then the prompt's rows.
  by_rows = np.concatenate(list(got_kv), axis=2)[:, :, layout.rows_in_prompt_order()]
  assert_close(got_logits, want_logits, "the last rank's logits")
  assert_close(by_rows, want_kv[0], "every rank's K,V part, in prompt order")


def test_a_kind_without_a_part_is_refused_by_name():
  @dataclasses.dataclass(frozen=True)
  class ToyKind:
    name = "toy"

  model = load_model("tiny-llama")
  with pytest.raises(ValueError, match="no program runs toy layers"):
    compile_by_kind("kvr", model.graphdef, kvr_jax.make_mesh(2), (12, 12), "flash", (ToyKind(),))
