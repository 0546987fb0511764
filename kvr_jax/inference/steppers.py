"""decode_from's steppers, one per cache layout (`CacheForm.stepper` picks by the result's):
each returns (step(token_B, index, tail) -> (logits, tail), the first tail, the prompt's
logits and the sampling key), all placed where that cache decodes.

  last_rank_stepper   cache="last", every model: the model's own decode step over its own
                      cache, on the last rank's device or model group
  sharded_stepper     cache="sharded" of K,V: every part attended where it lies (a hybrid's
                      and a latent model's: their forms', inference/hybrid.py, latent.py)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.inference import decode, sharded_decode
from kvr_jax.runtime.mesh import MODEL_AXIS, global_array, model_parallel, placements, split_dims


def sharded_stepper(model, result, max_new_tokens, seed):
  """cache="sharded": every operand replicated over the prefill's mesh but the cache parts,
  which stay put; each step attends every part where it lies
  (sharded_decode.sharded_decode_program), and a windowed layer whose window the prompt
  outgrew its ring (`past.rings`, copied: the steps write into theirs). Across processes
  every operand is a global array that every process builds alike."""
  replicated, past = NamedSharding(result.mesh, jax.P()), result.past
  lengths_B = np.asarray(result.lengths, np.int32)
  B, (L_f, K, H) = len(lengths_B), (past.kv_parts.shape[1], *past.kv_parts.shape[4:])
  state = model.state_for(result.mesh)
  heads = replicated  # the tail's heads: split over "model" where the weights' are
  if model_parallel(result.mesh) > 1:
    heads = NamedSharding(result.mesh, split_dims("L2BTKH", K=MODEL_AXIS))
  kept = past.kept or decode.DecodeLayout.whole(L_f)
  tail = decode.zeros_on((L_f, 2, B, max_new_tokens, K, H), past.kv_parts.dtype, heads)
  caches = tuple(
    tail if ring is None else _copied(past.rings[group]) for group, ring in enumerate(kept.rings)
  )
  program = sharded_decode.sharded_decode_program(
    model.graphdef, result.mesh, result.cache_layout, kept
  )
  prompt_lens_B = global_array(lengths_B, replicated)

  def step(token_B, index, caches):
    index = global_array(np.int32(index), replicated)
    return program(state, token_B, prompt_lens_B, past.kv_parts, caches, index)

  return step, caches, *sharded_decode.first_draw(result, seed)


# A fresh copy of arrays (global ones too), which a step then owns and donates.
_copied = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


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
  if group is None:
    device = result.device
    state = model.state_on(device)

    def placed(x):
      return jax.device_put(x, device)

    cache = form.decode_past(result, placed(lengths_B), capacity, consume)
    program = decode.decode_step_of(model.graphdef)
  else:
    replicated = NamedSharding(group, jax.P())
    state = model.state_split_over(group)

    def placed(x):
      return jax.device_put(x, replicated)

    cache = form.decode_past(result, placed(lengths_B), capacity, consume)
    spec = form.decode_cache_spec(cache)
    program = decode.group_decode_step(model.graphdef, group, spec)
    cache = jax.device_put(cache, placements(group, spec))  # a no-op where it lies so
  lengths_B = np.asarray(lengths_B, np.int32)

  def step(token_B, index, cache):
    return program(state, placed(token_B), placed(lengths_B + index), cache)

  return step, cache, placed(result.logits), placed(jax.random.key(seed))
