"""decode_from's steppers, one per cache layout (each result's `PrefillResult.stepper` picks
its own): stepper(model, result, lengths_B, max_new_tokens, seed) returns (step(token_B,
index, tail) -> (logits, tail), the first tail, the prompt's logits and the sampling key),
all placed where that cache decodes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.inference import decode, sharded_decode
from kvr_jax.runtime.mesh import MODEL_AXIS, global_array, model_parallel, placements, split_dims


def model_group_stepper(model, result, lengths_B, max_new_tokens, seed):
  """Tensor parallelism, cache="last": the last rank's row of devices decodes as shards of
  the model, from the cache there (heads split), a windowed layer keeping only its window
  as on one device (`whole_cache_stepper`)."""
  past = result.past
  group = past.k_layers.sharding.mesh
  replicated = NamedSharding(group, jax.P())
  state = model.state_split_over(group)
  capacity = result.prompt_len + max_new_tokens
  layout = decode.DecodeLayout.of(model.config, capacity)
  program = decode.model_group_decode_step(model.graphdef, group, layout)
  lengths = jax.device_put(lengths_B, replicated)
  caches = decode.decode_caches(
    past.k_layers, past.v_layers, lengths, layout, capacity, past.kept, past.rings
  )
  heads = NamedSharding(group, split_dims("LBSKH", K=MODEL_AXIS))
  caches = jax.device_put(caches, heads)  # where the step reads them (a no-op where they are)

  def step(token_B, index, caches):
    token_B = jax.device_put(token_B, replicated)
    positions_B = jax.device_put(lengths_B + index, replicated)
    return program(state, token_B, positions_B, caches)

  logits = jax.device_put(result.logits, replicated)
  return step, caches, logits, jax.device_put(jax.random.key(seed), replicated)


def sharded_stepper(model, result, lengths_B, max_new_tokens, seed):
  """cache="sharded": every operand replicated over the prefill's mesh but the cache parts,
  which stay put; each step attends every part where it lies
  (sharded_decode.sharded_decode_program), and a windowed layer whose window the prompt
  outgrew its ring (`past.rings`, copied: the steps write into theirs). Across processes
  every operand is a global array that every process builds alike."""
  replicated, past = NamedSharding(result.mesh, jax.P()), result.past
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


def whole_cache_stepper(model, result, lengths_B, max_new_tokens, seed):
  """cache="last": decode on the device holding the whole cache, grown there for the new
  tokens; a windowed layer keeps only its window (a ring, decode.DecodeLayout) where the
  window is shorter than the prompt and the new tokens."""
  device, past = result.device, result.past
  state = model.state_on(device)
  capacity = result.prompt_len + max_new_tokens
  layout = decode.DecodeLayout.of(model.config, capacity)
  lengths_on_device = jax.device_put(lengths_B, device)
  caches = decode.decode_caches(
    past.k_layers, past.v_layers, lengths_on_device, layout, capacity, past.kept, past.rings
  )

  def step(token_B, index, caches):
    positions_B = jax.device_put(lengths_B + index, device)
    return decode.ring_decode_step(model.graphdef, layout, state, token_B, positions_B, caches)

  return step, caches, result.logits, jax.device_put(jax.random.key(seed), device)


def model_cache_stepper(
  model, result, lengths_B, max_new_tokens: int, seed: int, consume: bool = False
):
  """`decode_from`'s stepper for a model's own cache (a hybrid's or latent model's):
  (step(token_B, index, cache) -> (logits, cache), the first cache, the prompt's logits, the
  sampling key), placed where the cache lies. cache="last": the model's own decode step on
  the last rank's device (its model group on a 2-D mesh, the cache split as the prefill left
  it), from a grown copy of the cache (consume: from the prefill's own cache where it has the
  room, written in place);
  cache="sharded": every rank attends its own part (latent.latent_sharded_step)."""
  if model.config != result.config:
    raise ValueError(
      f"this cache is a {result.config.architecture} model's ({result.form.name} cache); decode "
      "it with the model that made it"
    )
  form = result.form
  form.check_held(result)
  if result.cache == "sharded":
    return form.sharded_stepper(model, result, max_new_tokens, seed)
  group = result.decode_mesh
  if group is None:
    device = result.device
    state = model.state_on(device)
    program = decode.decode_step_of(model.graphdef)

    def placed(x):
      return jax.device_put(x, device)
  else:
    replicated = NamedSharding(group, jax.P())
    state = model.state_split_over(group)
    program = decode.group_decode_step(model.graphdef, group, form.group_cache_spec)

    def placed(x):
      return jax.device_put(x, replicated)

  capacity = result.prompt_len + max_new_tokens
  if form.consumed_by(result, consume, max_new_tokens):
    cache = result.past.cache  # generate's own: the steps donate and write into it
  else:
    cache = form.grown(result.past.cache, capacity)
  if group is not None:  # where the group's step reads it (a latent cache joined on one device)
    cache = jax.device_put(cache, placements(group, form.group_cache_spec))
  lengths_B = np.asarray(lengths_B, np.int32)

  def step(token_B, index, cache):
    return program(state, placed(token_B), placed(lengths_B + index), cache)

  return step, cache, placed(result.logits), placed(jax.random.key(seed))
