"""Real trained models by name (kvr_jax.runtime.trained): refused in one line where their
wheels are not installed, converted once into the cache directory, and (end to end, where
the wheels are installed) every strategy's answer is transformers' greedy answer."""

import importlib.util
import os

import numpy as np
import pytest

import kvr_jax
from kvr_jax.inference.text import encode_text
from kvr_jax.runtime import trained
from tests import hf_fixtures


def _not_installed(monkeypatch, model):
  real = importlib.util.find_spec
  monkeypatch.setattr(
    trained.importlib.util,
    "find_spec",
    lambda name, *args: None if name in model.packages else real(name, *args),
  )


@pytest.mark.parametrize("name", sorted(trained.TRAINED_MODELS))
def test_a_trained_model_not_installed_is_one_line_naming_its_install(monkeypatch, tmp_path, name):
  model = trained.TRAINED_MODELS[name]
  _not_installed(monkeypatch, model)
  monkeypatch.setenv("KVR_JAX_CACHE_DIR", str(tmp_path))
  with pytest.raises(ValueError, match="is not installed") as refused:
    kvr_jax.load_model(name)
  assert model.install in str(refused.value) and "\n" not in str(refused.value)
  assert not (tmp_path / "models").exists()  # nothing written


def test_the_conversion_is_made_once_then_read(monkeypatch, tmp_path):
  """The first load converts into the cache directory and later loads read it; a conversion
  that fails leaves no directory that a later load would take for a finished one."""
  monkeypatch.setenv("KVR_JAX_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(trained, "gguf_pieces", lambda model: ["piece"])
  calls = []

  def write(model, directory):  # a tiny Llama in place of the dequantised GGUF
    calls.append(directory)
    if len(calls) == 1:
      raise RuntimeError("interrupted")
    hf_fixtures.make_hf_model("llama-gqa").save_pretrained(directory)

  monkeypatch.setattr(trained, "write_hf_directory", write)
  with pytest.raises(RuntimeError, match="interrupted"):
    kvr_jax.load_model("smollm2-135m")
  assert not (tmp_path / "models" / "smollm2-135m").exists()
  assert os.listdir(tmp_path / "models") == []  # the staging directory went too
  first = kvr_jax.load_model("smollm2-135m")
  second = kvr_jax.load_model("smollm2-135m")
  assert len(calls) == 2  # converted once (after the interrupted try), then read
  assert first.source == second.source == f"hf:{tmp_path / 'models' / 'smollm2-135m'}"


def test_writing_into_a_directory_that_holds_something_is_refused(tmp_path):
  (tmp_path / "kept.txt").write_text("the user's")
  with pytest.raises(ValueError, match="exists and is not empty"):
    trained.write_hf_directory(trained.TRAINED_MODELS["gemma-3-270m"], str(tmp_path))
  assert (tmp_path / "kept.txt").read_text() == "the user's"


def _installed(name: str) -> bool:
  return all(importlib.util.find_spec(p) is not None for p in trained.TRAINED_MODELS[name].packages)


# A real prompt of more than 2,000 tokens: this repository's design notes, then a question.
QUESTION = "\n\nQuestion: In one sentence, what does this document describe? Answer:"


@pytest.mark.e2e  # converts and runs a real model: minutes
@pytest.mark.parametrize("name", sorted(trained.TRAINED_MODELS))
def test_every_strategy_answers_a_long_prompt_as_transformers_does(name):
  if not _installed(name):
    pytest.skip(f"{name} is not installed ({trained.TRAINED_MODELS[name].install})")
  import torch
  import transformers

  model = kvr_jax.load_model(name, dtype="float32")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "WORKSPACE.md")) as f:
    document = f.read()
  text = document[:12000] + QUESTION
  prompt = encode_text(model.tokenizer, text)
  assert len(prompt) >= 2000, len(prompt)
  reference = transformers.AutoModelForCausalLM.from_pretrained(
    trained.converted_directory(name), dtype=torch.float32
  )
  with torch.no_grad():
    want = reference.generate(torch.tensor(prompt[None]), max_new_tokens=24, do_sample=False)[
      0, len(prompt) :
    ].numpy()
  want_text = model.tokenizer.decode(want, skip_special_tokens=True)
  mesh = kvr_jax.make_mesh(4)
  for strategy in ("single", "tsp", "kvr", "ring", "allgather"):
    kwargs = {} if strategy == "single" else {"mesh": mesh}
    got = kvr_jax.generate(model, [prompt], 24, strategy=strategy, **kwargs)
    # transformers stops at EOS; generate pads the row with EOS to 24 (not in the text).
    np.testing.assert_array_equal(got.tokens[0, : len(want)], want, err_msg=strategy)
    assert got.text[0] == want_text, (strategy, got.text[0], want_text)
