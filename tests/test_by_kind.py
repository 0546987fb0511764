"""The one program builder (strategies.by_kind) assembles a model from its kinds' parts: on a
K,V model it gives the strategy's own program's answer, through the scan's stacked outputs
(one kind) or through the kinds' buffers (a windowed and a full kind writing one "kv"), and
it refuses a kind it has no part for, by name, before tracing."""

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
    ("tiny-llama", "kvr", (14, 10)),  # one kind: the scan's stacked outputs
    ("tiny-gemma", "kvr", (14, 10)),  # a windowed and a full kind: one buffer of both
    pytest.param("tiny-gemma", "ring", None, marks=pytest.mark.e2e),  # a peer's body
  ],
)
def test_the_one_builder_gives_the_strategys_own_program(preset, strategy, chunks):
  model = load_model(preset)
  spec, mesh, flash = get_strategy(strategy), kvr_jax.make_mesh(2), get_kernel("flash")
  chunks = spec.layout(24, 2, chunks)
  kinds = model.config.kinds
  if preset == "tiny-gemma":
    assert len(kinds) == 2, kinds
  tokens = np.asarray(kvr_jax.synthetic_prompt(model.config.vocab_size, 24)).reshape(1, 24)
  tokens_pBc = global_array(spec.arrange(tokens, chunks), jax.NamedSharding(mesh, jax.P(AXIS)))
  state = model.state_for(mesh)
  want_logits, want_kv = spec.compile(model.graphdef, mesh, chunks, flash)(state, tokens_pBc)
  program = compile_by_kind(strategy, model.graphdef, mesh, chunks, flash, kinds, False)
  got_logits, got = program(state, tokens_pBc)
  assert set(got) == {"kv"}
  assert got["kv"].shape == want_kv.shape
  assert_close(np.asarray(got_logits)[-1], np.asarray(want_logits)[-1], "the last rank's logits")
  assert_close(np.asarray(got["kv"]), np.asarray(want_kv), "every rank's K,V part")


def test_a_kind_without_a_part_is_refused_by_name():
  @dataclasses.dataclass(frozen=True)
  class ToyKind:
    name = "toy"

  model = load_model("tiny-llama")
  with pytest.raises(ValueError, match="no program runs toy layers"):
    compile_by_kind("kvr", model.graphdef, kvr_jax.make_mesh(2), (12, 12), "flash", (ToyKind(),))
