"""Text in and out: prompts through the tokenizer (and its chat template), answers streamed as
they are decoded and equal to `GenerationResult.text`."""

import dataclasses

import numpy as np
import pytest

import kvr_jax
from kvr_jax.inference.text import TextStream, encode_text
from tests import hf_fixtures

# A chat template of the Jinja kind transformers applies: the user's turn, then the
# assistant's cue (words of the fixture's vocabulary, so that they are tokens too).
CHAT_TEMPLATE = (
  "{% for m in messages %}w1 {{ m['content'] }} w2{% endfor %}"
  "{% if add_generation_prompt %} w3{% endif %}"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  """tiny-llama with a word tokenizer over w0..w126 (its EOS, id 2, is the word "w1")."""
  directory = tmp_path_factory.mktemp("tokenizer")
  hf_fixtures.save_word_tokenizer(directory)
  import transformers

  tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  return dataclasses.replace(kvr_jax.load_model("tiny-llama"), tokenizer=tokenizer)


def test_the_stream_writes_each_rows_answer_as_generate_returns_it(model):
  mesh = kvr_jax.make_mesh(2)
  steps, pieces = [], []
  prompts = ["w5 w6 w7 w8 w9 w10", "w11 w12 w13"]
  streams = [TextStream(model, row=r, write=pieces.append) for r in (0, 1)]
  row1 = []
  streams[1].write = row1.append

  def on_token(token_B):
    steps.append(np.array(token_B))
    for stream in streams:
      stream(token_B)

  out = kvr_jax.generate(
    model, prompts, max_new_tokens=6, strategy="kvr", mesh=mesh, buckets="auto", on_token=on_token
  )
  # on_token saw every step's tokens, in order: the result's columns.
  np.testing.assert_array_equal(np.stack(steps, axis=1), out.tokens[:, : len(steps)])
  assert "".join(pieces) == out.text[0] and "".join(row1) == out.text[1]
  assert out.text[0]  # the fixture's answer is not empty


def test_the_stream_stops_at_eos_and_holds_back_a_partial_character(model):
  eos = model.config.eos_ids[0]
  pieces = []
  stream = TextStream(model, write=pieces.append)
  for token in (10, 11, eos, 12):
    stream(np.array([token]))
  assert "".join(pieces) == model.tokenizer.decode([10, 11], skip_special_tokens=True)

  class Bytes:  # a tokenizer whose first token is half a character
    def decode(self, ids, skip_special_tokens=True):
      return "é"[: len(ids) - 1] + "\ufffd" if len(ids) == 1 else "é"

  stream = TextStream(model, write=pieces.append)
  stream.tokenizer = Bytes()
  pieces.clear()
  stream(np.array([10]))
  assert pieces == []
  stream(np.array([11]))
  assert pieces == ["é"]


def test_a_chat_template_wraps_the_prompt_unless_turned_off(model):
  tokenizer = model.tokenizer
  raw = encode_text(tokenizer, "w5 w6", chat_template=True)
  assert list(raw) == tokenizer("w5 w6")["input_ids"]  # no template: the text as it is
  tokenizer.chat_template = CHAT_TEMPLATE
  try:
    chat = encode_text(tokenizer, "w5 w6")
    assert list(chat) == tokenizer("w1 w5 w6 w2 w3")["input_ids"]
    assert list(encode_text(tokenizer, "w5 w6", chat_template=False)) == list(raw)
    # generate takes the same switch: the prompt it ran is the templated one, or not.
    templated = kvr_jax.generate(model, "w5 w6", max_new_tokens=1)
    as_is = kvr_jax.generate(model, "w5 w6", max_new_tokens=1, chat_template=False)
    assert templated.prefill.prompt_len == len(chat) and as_is.prefill.prompt_len == len(raw)
  finally:
    tokenizer.chat_template = None


def test_a_stream_needs_a_tokenizer():
  with pytest.raises(ValueError, match="needs a model with a tokenizer"):
    TextStream(kvr_jax.load_model("tiny-llama"))
