"""What the models with their own context-parallel programs share (kvr_jax.inference.hybrid:
Qwen3.5's hybrid layers; kvr_jax.inference.latent: DeepSeek-V3's latent attention): their
prompt check and decoding (greedy or sampled, as `kvr_jax.generate`) from the cache their
prefill leaves on the last rank, with the model's own `decode_step`."""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import numpy as np
from flax import nnx

from kvr_jax.core.caches import kept_cache
from kvr_jax.inference import decode
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.mesh import model_parallel


def check_tokens(model, tokens) -> np.ndarray:
  """A non-empty [batch, length] integer array of ids in the model's vocabulary."""
  tokens_BT = np.asarray(tokens)
  if tokens_BT.ndim != 2 or not np.issubdtype(tokens_BT.dtype, np.integer) or tokens_BT.size == 0:
    raise ValueError(f"tokens must be a non-empty [batch, length] integer array, got {tokens!r}")
  vocab = model.config.vocab_size
  if tokens_BT.min() < 0 or tokens_BT.max() >= vocab:
    raise ValueError(f"token ids must be in [0, {vocab}) for this model")
  return tokens_BT


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


def check_new_tokens(max_new_tokens, least: int) -> None:
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
    raise ValueError(f"max_new_tokens must be an integer >= {least}, got {max_new_tokens!r}")
  if max_new_tokens < least:
    raise ValueError(f"max_new_tokens must be an integer >= {least}, got {max_new_tokens!r}")


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How each new token is chosen, as `kvr_jax.generate` chooses it: the most likely at
  temperature 0; else the temperature, then top-k, then top-p, and step i drawn with the key
  `fold_in(key(seed), i)` (`decode.sample`): the same logits and seed give the same tokens
  whichever strategy made the cache. Checked by `check_sampling`."""

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  seed: int = 0

  def token(self, logits_BV, index: int):
    """Step `index`'s tokens [B] from its logits [B, V]."""
    key = jax.random.key(self.seed)
    return decode.next_token(logits_BV, key, index, self.temperature, self.top_k, self.top_p)


def decode_from_cache(
  model, logits_BV, cache, length: int, max_new_tokens: int, sampling: Sampling = Sampling()
) -> np.ndarray | None:
  """`max_new_tokens` chosen by `sampling` from a prefill's last logits and cache (`length`
  positions filled; consumed: the steps write into it), decoded with the model's
  `decode_step` on the device that holds them:
  [B, max_new_tokens] token ids (no stop at an end-of-sequence token). None in a process
  that does not hold them (logits_BV None: another process holds the last rank)."""
  decoded = decode_with_last_logits(model, logits_BV, cache, length, max_new_tokens, sampling)
  return None if decoded is None else decoded[0]


def decode_with_last_logits(
  model, logits_BV, cache, length: int, max_new_tokens: int, sampling: Sampling = Sampling()
) -> tuple[np.ndarray, jax.Array] | None:
  """`decode_from_cache`'s tokens and the logits the last of them was drawn from (what
  every decode step's cache and inputs led to: the launchers compare it with single's)."""
  if logits_BV is None:
    return None
  state = model.state_on(logits_BV.sharding)
  step = decode_step_of(model.graphdef)
  return sample_steps(step, state, logits_BV, cache, length, max_new_tokens, sampling)


def sample_steps(step, state, logits_BV, cache, length: int, max_new_tokens: int, sampling):
  """The decode loop: a token drawn from `logits_BV` by `sampling`, then `step(state, tokens,
  positions, cache) -> (logits, cache)` at position `length` + i, `max_new_tokens` times (no
  step after the last): ([B, max_new_tokens] token ids, the last token's logits)."""
  positions_B = np.full(logits_BV.shape[0], length, np.int32)
  out = []
  for index in range(max_new_tokens):
    next_B = sampling.token(logits_BV, index)
    out.append(np.asarray(next_B))
    if index + 1 < max_new_tokens:
      logits_BV, cache = step(state, next_B, positions_B + index, cache)
  return np.stack(out, axis=1), logits_BV


@kept_cache(8)
def decode_step_of(graphdef):
  """The jitted decode step of a model's structure, made once per graphdef (not per call).
  The cache is donated: each step writes the new token into it where it lies (without, XLA
  outputs a second cache every step: bench-qwen3.5 at 16k, 65.1 MiB beside its 64 MiB)."""

  @functools.partial(jax.jit, donate_argnums=(3,))
  def step(state, tokens_B, positions_B, cache):
    return nnx.merge(graphdef, state).decode_step(tokens_B, positions_B, cache)

  return step


@kept_cache(8)
def group_decode_step(graphdef, row_mesh, cache_spec):
  """The model's decode step on one rank's model group (a ("ranks", "model") mesh of one
  rank): (state split over "model", tokens [B], positions [B], cache placed by `cache_spec`
  (a PartitionSpec, or a pytree of them: a latent cache whole on every shard, a hybrid's split
  by head), donated) -> (logits [B, V] replicated, the cache moved on). Each shard runs its
  heads and experts; the psums over "model" add their partial sums."""
  P = jax.P

  def shard_step(state, tokens_B, positions_B, cache):
    model = nnx.merge(graphdef, state)
    return model.decode_step(tokens_B, positions_B, cache, reduce=tensor_parallel.psum_over_model)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def step(state, tokens_B, positions_B, cache):
    # check_vma=False: the psums make the logits (and a whole cache) whole on every shard.
    return jax.shard_map(
      shard_step,
      mesh=row_mesh,
      in_specs=(
        tensor_parallel.partition_specs(state, model_parallel(row_mesh)),
        P(),
        P(),
        cache_spec,
      ),
      out_specs=(P(), cache_spec),
      check_vma=False,
    )(state, tokens_B, positions_B, cache)

  return step
