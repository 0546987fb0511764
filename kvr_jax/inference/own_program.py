"""What the models with their own context-parallel programs share (kvr_jax.inference.hybrid:
Qwen3.5's hybrid layers; kvr_jax.inference.latent: DeepSeek-V3's latent attention): their
prompt check and greedy decoding from the cache their prefill leaves on the last rank, with
the model's own `decode_step`."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from kvr_jax.core.caches import kept_cache


def check_tokens(model, tokens) -> np.ndarray:
  """A non-empty [batch, length] integer array of ids in the model's vocabulary."""
  tokens_BT = np.asarray(tokens)
  if tokens_BT.ndim != 2 or not np.issubdtype(tokens_BT.dtype, np.integer) or tokens_BT.size == 0:
    raise ValueError(f"tokens must be a non-empty [batch, length] integer array, got {tokens!r}")
  vocab = model.config.vocab_size
  if tokens_BT.min() < 0 or tokens_BT.max() >= vocab:
    raise ValueError(f"token ids must be in [0, {vocab}) for this model")
  return tokens_BT


def check_new_tokens(max_new_tokens, least: int) -> None:
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
    raise ValueError(f"max_new_tokens must be an integer >= {least}, got {max_new_tokens!r}")
  if max_new_tokens < least:
    raise ValueError(f"max_new_tokens must be an integer >= {least}, got {max_new_tokens!r}")


def greedy_from(model, logits_BV, cache, length: int, max_new_tokens: int) -> np.ndarray:
  """Greedy decoding of `max_new_tokens` from a prefill's last logits and cache (`length`
  positions filled), on the device that holds them: [B, max_new_tokens] token ids."""
  step = _decode_step(model.graphdef)
  state = model.state_on(logits_BV.sharding)
  positions_B = np.full(logits_BV.shape[0], length, np.int32)
  next_B, out = logits_BV.argmax(-1), []
  for _ in range(max_new_tokens):
    out.append(next_B)
    logits_BV, cache = step(state, next_B, positions_B, cache)
    next_B, positions_B = logits_BV.argmax(-1), positions_B + 1
  return np.stack([np.asarray(t) for t in out], axis=1)


@kept_cache(8)
def _decode_step(graphdef):
  """The jitted decode step of a model's structure, made once per graphdef (not per call)."""

  @jax.jit
  def step(state, tokens_B, positions_B, cache):
    return nnx.merge(graphdef, state).decode_step(tokens_B, positions_B, cache)

  return step
