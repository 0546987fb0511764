"""KV-Runahead prefill of a hybrid model (Qwen3.5: linear and full layers) on a 1-D mesh, and
greedy decoding from the cache its last rank holds: `prefill_hybrid`, `generate_hybrid`.

Not yet through `prefill`/`generate` (their results, cache layouts, buckets and planning are
built for K,V caches): one process, rows of one length, cache on the last rank, KV-Runahead
only (the peers need a state pass over their zigzag chunks: not built). Every argument is
checked before anything compiles.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.core.chunks import check_chunks
from kvr_jax.runtime.loading import Model
from kvr_jax.runtime.mesh import AXIS, check_mesh, global_array, rank_device, shard_on
from kvr_jax.strategies.runahead import STRATEGY, pad_chunks
from kvr_jax.strategies.runahead.hybrid import assemble_cache, compile_hybrid
from models.kernels import get_kernel
from models.layer_kinds import unbuilt_kinds
from models.qwen3_5 import HybridCache


@dataclasses.dataclass(frozen=True)
class HybridPrefill:
  """logits_BV: the prompt's last position's logits (on the last rank's device). cache: the
  model's `HybridCache` there, with room for `capacity` positions. chunks: the split."""

  logits_BV: jax.Array
  cache: HybridCache
  chunks: tuple[int, ...]
  capacity: int


def prefill_hybrid(
  model: Model, tokens, mesh, partition, attention="dense", max_new_tokens: int = 0
) -> HybridPrefill:
  """KV-Runahead over `mesh`'s ranks with rank i taking partition[i] tokens (contiguous, in
  order); the last rank ends with the whole cache (no move). max_new_tokens: room the cache
  keeps for decoding."""
  if not isinstance(model, Model) or not unbuilt_kinds(model.config):
    raise ValueError(
      "prefill_hybrid takes a loaded hybrid model (linear-attention layers, e.g. Qwen3.5); "
      "every other model runs through kvr_jax.prefill"
    )
  tokens_BT = np.asarray(tokens)
  cfg = model.config
  if tokens_BT.ndim != 2 or not np.issubdtype(tokens_BT.dtype, np.integer) or tokens_BT.size == 0:
    raise ValueError(f"tokens must be a non-empty [batch, length] integer array, got {tokens!r}")
  if tokens_BT.min() < 0 or tokens_BT.max() >= cfg.vocab_size:
    raise ValueError(f"token ids must be in [0, {cfg.vocab_size}) for this model")
  p = check_mesh(mesh)
  if p < 2:
    raise ValueError("prefill_hybrid runs on 2 or more ranks; on one device use model.module")
  if jax.process_count() > 1:
    raise ValueError("prefill_hybrid runs in one process (across processes: not built)")
  T = tokens_BT.shape[1]
  chunks = check_chunks(partition, T, p)
  halo = cfg.linear_conv_kernel - 1
  if min(chunks) < halo:
    raise ValueError(
      f"every rank's chunk must hold at least {halo} tokens (the convolution's halo a linear "
      f"layer passes on), got partition {chunks}"
    )
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
  kernel = STRATEGY.check_attention(attention)
  if kernel == "auto":
    kernel = get_kernel(STRATEGY.default_attention)
  program = compile_hybrid(model.graphdef, mesh, chunks, kernel)
  state = model.state_on(NamedSharding(mesh, jax.P()))
  tokens_pBc = global_array(pad_chunks(tokens_BT, chunks), NamedSharding(mesh, jax.P(AXIS)))
  logits_pBV, out = program(state, tokens_pBc)
  owner = rank_device(mesh, p - 1)
  out = {name: shard_on(value, owner) for name, value in out.items()}
  capacity = T + max_new_tokens
  cache = jax.jit(assemble_cache, static_argnums=(1, 2))(out, chunks, capacity)
  return HybridPrefill(shard_on(logits_pBV, owner), cache, chunks, capacity)


def generate_hybrid(model: Model, tokens, mesh, partition, max_new_tokens: int, attention="dense"):
  """Greedy decoding of `max_new_tokens` from `prefill_hybrid`'s cache on the last rank's
  device: [B, max_new_tokens] token ids."""
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  result = prefill_hybrid(model, tokens, mesh, partition, attention, max_new_tokens)
  step = _decode_step(model.graphdef)
  state = model.state_on(result.logits_BV.sharding)
  positions_B = np.full(result.logits_BV.shape[0], sum(result.chunks), np.int32)
  next_B, cache, out = result.logits_BV.argmax(-1), result.cache, []
  for _ in range(max_new_tokens):
    out.append(next_B)
    logits_BV, cache = step(state, next_B, positions_B, cache)
    next_B, positions_B = logits_BV.argmax(-1), positions_B + 1
  return np.stack([np.asarray(t) for t in out], axis=1)


def _decode_step(graphdef):
  from flax import nnx

  @jax.jit
  def step(state, tokens_B, positions_B, cache):
    return nnx.merge(graphdef, state).decode_step(tokens_B, positions_B, cache)

  return step
