"""decode_from's steppers, one per cache layout (`CacheForm.stepper` picks by the result's):
each returns (step(token_B, index, tail) -> (logits, tail), the first tail, the prompt's
logits and the sampling key), all placed where that cache decodes.

  last_rank_stepper   cache="last", every model: the model's own decode step over its own
                      cache, on the last rank's device or model group
  sharded_stepper     cache="sharded", every model: every part attended where it lies, by
                      the form's program (`CacheForm.sharded_decode`)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.inference import decode, sharded_decode
from kvr_jax.runtime.mesh import global_array, placements


def sharded_stepper(model, result, max_new_tokens: int, seed: int):
  """cache="sharded", every model: each step attends every rank's part where it lies, by
  the form's program (`CacheForm.sharded_decode`: a layer of the model's kinds on
  `sharded_decode.sharded_step_program`, its read-only inputs, the parts, and its first
  caches: the decoded tokens' tail, a window's ring, a linear layer's state, fresh copies
  that the steps donate and carry). Every operand but the parts is replicated over the
  prefill's mesh; across processes every one is a global array that every process builds
  alike."""
  replicated = NamedSharding(result.mesh, jax.P())
  state = model.state_for(result.mesh)
  program, inputs, caches = result.form.sharded_decode(model, result, max_new_tokens)
  # Each row's own length: a padded row's parts are read up to it, its tokens follow it.
  prompt_lens_B = global_array(np.asarray(result.lengths, np.int32), replicated)

  def step(token_B, index, caches):
    index = global_array(np.int32(index), replicated)
    logits, *caches = program(state, token_B, prompt_lens_B, *inputs, *caches, index)
    return logits, tuple(caches)

  return step, tuple(caches), *sharded_decode.first_draw(result, seed)


# A fresh copy of arrays (global ones too), which a step then owns and donates.
copied = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def last_rank_stepper(model, result, lengths_B, max_new_tokens: int, seed: int, consume=False):
  """cache="last", every model: the model's own decode step (`decode.decode_step_of`) on the
  last rank's device where the cache lies, or on a 2-D mesh as tensor-parallel shards over
  the last rank's row (`decode.group_decode_step`, the cache split as its form says:
  `CacheForm.decode_cache_spec`), over the cache its form makes for the decode
  (`CacheForm.decode_past`: a K,V cache grown into a fresh buffer, a window that binds kept
  as its ring alone; a model's own cache grown, or generate's own written in place:
  consume)."""
  form, group = result.form, result.decode_mesh
  capacity = result.prompt_len + max_new_tokens
  if group is None:  # the cache's device
    where, state = result.device, model.state_on(result.device)
  else:  # replicated over the last rank's row, the cache split as its form says
    where, state = NamedSharding(group, jax.P()), model.state_split_over(group)

  def placed(x):
    return jax.device_put(x, where)

  cache = form.decode_past(result, placed(lengths_B), capacity, consume)
  if group is None:
    program = decode.decode_step_of(model.graphdef)
  else:
    spec = form.decode_cache_spec(cache)
    program = decode.group_decode_step(model.graphdef, group, spec)
    cache = jax.device_put(cache, placements(group, spec))  # a no-op where it lies so
  lengths_B = np.asarray(lengths_B, np.int32)

  def step(token_B, index, cache):
    return program(state, placed(token_B), placed(lengths_B + index), cache)

  return step, cache, placed(result.logits), placed(jax.random.key(seed))
