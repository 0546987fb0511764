"""Text in and out: prompts encoded with the tokenizer (its chat template where it has one),
and the new tokens shown as text while they are decoded.

`generate(model, "a question", on_token=TextStream(model))` prints row 0's answer as it comes;
`GenerationResult.text` holds every row's answer when decoding ends.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np


def has_chat_template(tokenizer) -> bool:
  return bool(getattr(tokenizer, "chat_template", None))


def encode_text(tokenizer, text: str, chat_template: bool = True) -> np.ndarray:
  """[T] token ids of `text`: as the user's turn of a chat, ready for the assistant's answer,
  where the tokenizer has a chat template and `chat_template` is True (an instruction-tuned
  model answers that, not a raw continuation); else the text itself (raw completion)."""
  if chat_template and has_chat_template(tokenizer):
    ids = tokenizer.apply_chat_template(
      [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in newer transformers
      ids = ids["input_ids"]
  else:
    ids = tokenizer(text)["input_ids"]
  return np.asarray(ids, np.int32)


class TextStream:
  """A decode step's callback (`generate(on_token=)`): writes one row's new text as its
  tokens arrive, and stops at that row's EOS.

  Each step decodes the row's tokens so far and writes what was not written yet (a
  tokenizer's pieces only make text together: a word split over tokens, a character over
  bytes), holding back a trailing partial character."""

  def __init__(self, model, row: int = 0, write: Callable[[str], object] | None = None):
    if model.tokenizer is None:
      raise ValueError("a text stream needs a model with a tokenizer")
    self.tokenizer = model.tokenizer
    self.eos = set(int(e) for e in model.config.eos_ids)
    self.row = row
    self.write = write or _write_stdout
    self.tokens: list[int] = []
    self.written = ""
    self.ended = False

  def __call__(self, token_B: np.ndarray) -> None:
    if self.ended:
      return
    token = int(np.asarray(token_B)[self.row])
    if token in self.eos:
      self.ended = True
      return
    self.tokens.append(token)
    text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
    if text.endswith("\ufffd"):  # a character whose bytes have not all come yet
      return
    # What was not written yet (where the tokenizer re-spelled the start, the rest of it).
    self.write(text[len(self.written) :])
    self.written = text


def _write_stdout(piece: str) -> None:
  sys.stdout.write(piece)
  sys.stdout.flush()
