"""Every Qwen3.5 layer pattern transformers runs: a model of linear-attention layers alone
(all three hybrid families) or of full-attention layers alone loads (the stack of the kind it
lacks holds no layer) and matches transformers, through one device and KV-Runahead, with
the cache on the last rank and kept by the ranks."""

import numpy as np
import pytest
import torch

import kvr_jax
from tests import hf_fixtures
from tests.tolerance import relative_error

MODEL_TOL = 1e-4  # whole models against transformers, float32
T, NEW = 12, 3
MAKERS = {
  "qwen3_5": lambda **kw: hf_fixtures.make_qwen35_model("qwen3_5-default", **kw),
  "qwen3_5_moe": lambda **kw: hf_fixtures.make_qwen_moe_model("qwen3_5_moe", **kw),
  "qwen3_next": lambda **kw: hf_fixtures.make_qwen_moe_model("qwen3_next", **kw),
}


# One case in the default tier: a hybrid family's model of full layers alone keeps a K,V
# model's cache and decodes it through its family's decode step; the rest end to end.
@pytest.mark.default_cases("full_attention-qwen3_5")
@pytest.mark.parametrize("family", list(MAKERS))
@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_one_kind_of_layer_alone_matches_transformers(tmp_path, family, kind):
  hf_model = MAKERS[family](num_hidden_layers=2, layer_types=[kind, kind])
  hf_model.save_pretrained(tmp_path)
  model = kvr_jax.load_model(str(tmp_path))
  assert model.config.layer_types == (kind, kind)
  prompt = np.random.RandomState(2).randint(0, hf_fixtures.VOCAB, (1, T))
  want_logits = hf_fixtures.hf_logits(hf_model, prompt)[:, -1]
  with torch.no_grad():  # uncached: transformers keeps no cache for linear layers alone
    want_tokens = hf_model.generate(
      torch.as_tensor(prompt),
      max_new_tokens=NEW,
      min_new_tokens=NEW,
      do_sample=False,
      use_cache=False,
    )[:, T:].numpy()
  mesh = kvr_jax.make_mesh(2)
  for strategy, cache in (("single", "auto"), ("kvr", "last"), ("kvr", "sharded")):
    kwargs = {} if strategy == "single" else dict(mesh=mesh, partition=[7, 5], cache=cache)
    got = kvr_jax.generate(model, prompt, NEW, strategy=strategy, **kwargs)
    err = relative_error(got.prefill.logits, want_logits)
    assert err <= MODEL_TOL, f"{family} {kind} {strategy} {cache}: relative error {err:.2e}"
    np.testing.assert_array_equal(got.tokens, want_tokens, f"{strategy} {cache}")
