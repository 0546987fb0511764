"""`generate` and `decode_from`: prefill with any strategy, then decode from the KV cache where
it already lives (the last rank's device after KV-Runahead), with greedy or sampled tokens."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvr_jax.inference import decode
from kvr_jax.inference.buckets import check_prompts
from kvr_jax.inference.kv_cache import check_cache
from kvr_jax.inference.prefill import plan_prefill, run_prefill
from kvr_jax.inference.results import PrefillResult
from kvr_jax.inference.text import encode_text
from kvr_jax.runtime.loading import Model


def _is_integer(value) -> bool:
  """Python and numpy integers, not bools."""
  return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


# Sampling divides float32 logits by the temperature: below float32's smallest normal number
# the division is no longer a temperature (it underflows), so such values are refused.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


def check_sampling(model, max_new_tokens, temperature, top_k, top_p, seed) -> None:
  """The decoding arguments `generate` takes, refused by name (also called by the command
  lines before anything compiles)."""
  if not _is_integer(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"`max_new_tokens` must be a positive integer, got {max_new_tokens!r}")
  if not _is_real(temperature) or not temperature >= 0 or not np.isfinite(temperature):
    raise ValueError(f"`temperature` must be a finite number >= 0, got {temperature!r}")
  if 0 < temperature < MIN_TEMPERATURE:
    raise ValueError(
      f"`temperature`={temperature!r} is below float32's smallest normal number "
      f"({MIN_TEMPERATURE:.3g}); use temperature=0 for greedy decoding"
    )
  vocab = model.config.vocab_size
  if top_k is not None and (not _is_integer(top_k) or not 1 <= top_k <= vocab):
    raise ValueError(f"`top_k` must be an integer in [1, {vocab}], got {top_k!r}")
  if top_p is not None and (not _is_real(top_p) or not 0 < top_p <= 1):
    raise ValueError(f"`top_p` must be in (0, 1], got {top_p!r}")
  if not _is_integer(seed) or not -(2**63) <= seed < 2**63:
    raise ValueError(f"`seed` must be an integer in [-2**63, 2**63), got {seed!r}")


@dataclasses.dataclass
class GenerationResult:
  """tokens: [B, n] new token ids (rows that hit EOS early are padded with EOS);
  text: the decoded new tokens per row when the model has a tokenizer. Across processes
  (jax.distributed) every process has them after cache="sharded" (every process decodes);
  after cache="last" only the process holding the last rank, None in the others."""

  tokens: np.ndarray | None
  text: list[str] | None
  # The prefill's result; a model's own cache after `generate` holds the decoded tokens too
  # (the decode wrote into it), after `decode_from` it is as the prefill left it.
  prefill: PrefillResult
  # [B, V] float32: the logits the last token of `tokens` was drawn from (None where tokens
  # are); after one token, the prefill's.
  last_logits: np.ndarray | None = None


def _encode_prompt(model: Model, prompt, chat_template: bool = True) -> np.ndarray:
  if isinstance(prompt, str) or (
    isinstance(prompt, Sequence) and prompt and all(isinstance(p, str) for p in prompt)
  ):
    if model.tokenizer is None:
      raise ValueError(
        "a text prompt needs a tokenizer, and this model has none (load a "
        "Hugging Face directory with tokenizer files, or pass token ids)"
      )
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    for i, text in enumerate(texts):
      if not text:
        raise ValueError("the prompt is empty" if len(texts) == 1 else f"prompt {i} is empty")
    # Rows of different lengths are a ragged batch (prefill pads them; see its `buckets`).
    return [encode_text(model.tokenizer, t, chat_template) for t in texts]
  return prompt


def _check_length(model: Model, prompt_len: int, max_new_tokens: int) -> None:
  limit = model.config.max_position_embeddings
  if prompt_len + max_new_tokens > limit:
    raise ValueError(
      f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
      f"max_position_embeddings={limit}"
    )


def generate(
  model: Model,
  prompt,
  max_new_tokens: int,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  seed: int = 0,
  strategy: str = "single",
  mesh=None,
  partition: Any = None,
  attention: str | None = None,
  cache: str = "auto",
  buckets=None,
  on_token: Callable[[np.ndarray], object] | None = None,
  chat_template: bool = True,
) -> GenerationResult:
  """Prefill with `strategy`, then decode token by token from the KV cache.

  prompt: token ids [T] or [B, T], a list of token-id rows of different lengths, or text (a
  string or a list of strings; needs a tokenizer). Text is the user's turn of a chat where
  the tokenizer has a chat template (chat_template=False: the text as it is, a raw
  completion). on_token(token_B): called with each step's [B] new tokens as they are drawn
  (kvr_jax.inference.text.TextStream prints a row's answer as it comes). Rows of different
  lengths and `buckets` (see `prefill`) pad the prompt; each row decodes from its own
  length. A row stops at its own EOS (later tokens of that row are EOS) or after
  `max_new_tokens`. Temperature 0 is greedy and deterministic; otherwise top-k then top-p
  filter the temperature-scaled logits.
  cache: "auto" (the default: "last" where the last rank's device holds the weights and the
  whole cache, else "sharded"; see `prefill`), "last" (decode on the last rank's device from
  the whole cache) or "sharded" (the cache stays in the ranks' parts; each step attends
  every part where it lies and merges the partial outputs, see kvr_jax.inference.decode;
  across processes every process runs each step and takes the last rank's token).
  """
  check_sampling(model, max_new_tokens, temperature, top_k, top_p, seed)
  check_cache(cache, allow_auto=True)
  rows, lengths = check_prompts(model, _encode_prompt(model, prompt, chat_template))
  _check_length(model, int(lengths.max()), int(max_new_tokens))
  plan = plan_prefill(model, rows, strategy, mesh, partition, attention, cache, buckets)
  # A model with a cache of its own keeps room for the new tokens in its prefill's cache, and
  # its decode writes into that cache: one copy of it, not a grown second one.
  result = run_prefill(model, plan, rows, decode_room=int(max_new_tokens))
  sampling = (temperature, top_k, top_p, seed)
  return _decode(model, result, max_new_tokens, *sampling, consume=True, on_token=on_token)


def decode_from(
  model: Model,
  result: PrefillResult,
  max_new_tokens: int,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  seed: int = 0,
  on_token: Callable[[np.ndarray], object] | None = None,
) -> GenerationResult:
  """Decodes from a prefill's KV cache, on the device that holds it (see `generate`, also
  for `on_token`); the prefill's cache stays as it was (decode_from again decodes the same
  tokens)."""
  sampling = (temperature, top_k, top_p, seed)
  return _decode(model, result, max_new_tokens, *sampling, consume=False, on_token=on_token)


def _decode(
  model, result, max_new_tokens, temperature, top_k, top_p, seed, consume: bool, on_token=None
):
  """`decode_from`; consume: a model's own cache's decode may write into the prefill's cache
  where it has room (`generate`'s, made with room for the new tokens). Each cache layout
  decodes by its result's own stepper (`PrefillResult.stepper`, kvr_jax.inference.steppers)
  in the one token loop below."""
  check_sampling(model, max_new_tokens, temperature, top_k, top_p, seed)
  max_new_tokens, seed = int(max_new_tokens), int(seed)
  top_k = None if top_k is None else int(top_k)
  _check_length(model, int(np.max(result.lengths, initial=0)), max_new_tokens)
  lengths_B = np.asarray(result.lengths, np.int32)  # row b decodes from position lengths_B[b]
  if not result.decodes_here:
    return GenerationResult(None, None, result)  # another process holds the cache, generates
  agree = _as_is
  if result.decodes_in_every_process:
    # Every process runs every step over the parts where they lie, and all of them take the
    # token the last rank sampled, so that they run the same next step and stop together.
    agree = decode.from_last_rank(result.mesh, ranked=False)
  step, tail, logits, key = result.stepper(model, lengths_B, max_new_tokens, seed, consume)
  out, last_logits, tail = _decode_loop(
    model, step, tail, logits, key, max_new_tokens, (temperature, top_k, top_p), agree, on_token
  )
  text = None
  if model.tokenizer is not None:
    text = [model.tokenizer.decode(row, skip_special_tokens=True) for row in out]
  # A cache the decode consumed (generate's own) is the last step's now.
  result = result.after_decode(tail, consume, max_new_tokens)
  return GenerationResult(out, text, result, last_logits)


def _as_is(token_B):
  return token_B


def _decode_loop(
  model, step, tail, logits, key, max_new_tokens, sampling, agree=_as_is, on_token=None
):
  """Token by token until every row has met an EOS or `max_new_tokens`: ([B, max_new_tokens]
  tokens, every row's tokens after its EOS the EOS again, also where decoding stopped early
  because every row had met one; the last token's logits; the last step's tail). sampling:
  (temperature, top_k, top_p). agree(token) -> the token every process continues with (the
  last rank's, across processes). on_token([B] tokens) after each step, before the next is
  computed."""
  temperature, top_k, top_p = sampling
  eos = np.asarray(model.config.eos_ids, np.int32)
  B = logits.shape[0]
  # A model without EOS never stops early: every column is decoded.
  out = np.full((B, max_new_tokens), eos[0] if eos.size else 0, np.int32)
  done = np.zeros(B, bool)
  for index in range(max_new_tokens):
    token_B = agree(decode.next_token(logits, key, index, temperature, top_k, top_p))
    token_np = np.asarray(token_B.addressable_shards[0].data)  # replicated: any copy
    out[:, index] = np.where(done, out[:, index], token_np)
    if on_token is not None:
      on_token(out[:, index].copy())
    done |= np.isin(token_np, eos)
    if done.all() or index == max_new_tokens - 1:
      break
    logits, tail = step(token_B, index, tail)
  return out, np.asarray(logits.addressable_shards[0].data), tail
