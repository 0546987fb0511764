"""Prefill of a latent-attention model (DeepSeek-V3) on a 1-D mesh with KV-Runahead or
all-gather CP, and greedy decoding from the latent cache the last rank then holds:
`prefill_latent`, `generate_latent` (kvr_jax/strategies/latent.py is the program).

Not yet through `prefill`/`generate` (their results, cache layouts, buckets and planning are
built for K,V caches): rows of one length, the cache whole on the last rank (all-gather CP's
only in one process).
Every argument is checked before anything compiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from kvr_jax.core.chunks import check_chunks, check_ranks
from kvr_jax.inference.own_program import check_new_tokens, check_tokens, greedy_from
from kvr_jax.runtime.loading import Model
from kvr_jax.runtime.mesh import AXIS, check_mesh, global_array, rank_device, shard_on
from kvr_jax.strategies import get_strategy, zigzag
from kvr_jax.strategies.latent import STRATEGIES, compile_latent
from models.kernels import get_kernel
from models.layer_kinds import LatentAttentionKind


@dataclasses.dataclass(frozen=True)
class LatentPrefill:
  """logits_BV: the prompt's last position's logits (on the last rank's device). cache: the
  model's latent cache there, [L, B, capacity, C]. chunks: each rank's tokens as the strategy
  laid them out. moved: whether the cache was moved onto the last rank (all-gather CP's
  parts) or was there already (KV-Runahead's last hop and own chunk)."""

  logits_BV: jax.Array
  cache: jax.Array
  chunks: tuple[int, ...]
  capacity: int
  moved: bool


def prefill_latent(
  model: Model,
  tokens,
  mesh,
  partition=None,
  max_new_tokens: int = 0,
  strategy: str = "kvr",
  attention: str = "flash",
  join: bool = True,
) -> LatentPrefill:
  """`strategy` ("kvr", "allgather") over `mesh`'s ranks; KV-Runahead's rank i takes
  partition[i] tokens (contiguous, in order; None: even), all-gather CP its zigzag chunks (no
  partition). max_new_tokens: room the cache keeps for decoding. attention: the expanded
  heads' kernel (models.kernels: dense, blocked, flash, ...). join=False: return as soon as
  the last rank's logits exist, the cache left where the program put it (`cache` None; what
  the benchmark times).
  With a mesh over several processes only the last rank's process gets the logits (and, for
  KV-Runahead, the cache); all-gather CP's cache move across processes is not built."""
  latent = isinstance(model, Model) and isinstance(model.config.kinds[0], LatentAttentionKind)
  if not latent:
    raise ValueError(
      "prefill_latent takes a loaded latent-attention model (DeepSeek-V3); every other model "
      "runs through kvr_jax.prefill"
    )
  if strategy not in STRATEGIES:
    raise ValueError(f"latent-attention models run under {STRATEGIES}, not {strategy!r}")
  tokens_BT = check_tokens(model, tokens)
  p = check_mesh(mesh)
  if p < 2:
    raise ValueError("prefill_latent runs on 2 or more ranks; on one device use model.module")
  if join and strategy != "kvr" and jax.process_count() > 1:
    raise ValueError(
      f"{strategy} on a latent model across processes: moving its cache onto the last rank "
      "is not built; pass join=False (the cache stays where it was computed)"
    )
  kernel = get_kernel(attention)
  check_new_tokens(max_new_tokens, 0)
  T = tokens_BT.shape[1]
  spec = get_strategy(strategy)
  if strategy == "kvr":
    chunks = check_chunks(partition, T, p)
  else:
    if partition is not None:
      raise ValueError(f"strategy {strategy!r} lays the prompt out itself: give no partition")
    check_ranks(T, p)
    chunks = spec.layout(T, p, None)
  program = compile_latent(strategy, model.graphdef, mesh, chunks, kernel)
  state = model.state_on(NamedSharding(mesh, jax.P()))
  tokens_pBc = global_array(spec.arrange(tokens_BT, chunks), NamedSharding(mesh, jax.P(AXIS)))
  logits_pBV, out = program(state, tokens_pBc)
  owner = rank_device(mesh, p - 1)
  capacity = T + max_new_tokens
  logits_BV = shard_on(logits_pBV, owner)  # None in the other processes
  if logits_BV is None:  # another process's rank is last: this one returns when its part is done
    jax.block_until_ready(out)
  if not join or logits_BV is None:
    return LatentPrefill(logits_BV, None, chunks, capacity, False)
  if strategy == "kvr":  # the last rank holds every position: its last hop and its own chunk
    last, own = shard_on(out["last"], owner), shard_on(out["own"], owner)
    cache = jax.jit(_joined, static_argnums=(2, 3))(last, own, chunks[-1], capacity)
  else:  # every rank's parts move to the last rank, then into prompt order
    pieces = [jax.device_put(shard_on(out["own"], rank_device(mesh, r)), owner) for r in range(p)]
    cache = jax.jit(_in_prompt_order, static_argnums=(1, 2, 3))(pieces, T, p, capacity)
  return LatentPrefill(logits_BV, cache, chunks, capacity, strategy != "kvr")


def _joined(last_LBsC, own_LBcC, c_last: int, capacity: int):
  cache = jnp.concatenate([last_LBsC, own_LBcC[:, :, :c_last]], axis=2)
  return jnp.pad(cache, ((0, 0), (0, 0), (0, capacity - cache.shape[2]), (0, 0)))


def _in_prompt_order(pieces, T: int, p: int, capacity: int):
  ranked = jnp.concatenate(pieces, axis=2)  # rank 0's two chunks, then rank 1's, ...
  cache = jnp.take(ranked, jnp.asarray(zigzag.prompt_order(T, p)), axis=2)[:, :, :T]
  return jnp.pad(cache, ((0, 0), (0, 0), (0, capacity - T), (0, 0)))


def generate_latent(
  model: Model,
  tokens,
  mesh,
  partition=None,
  max_new_tokens: int = 1,
  strategy: str = "kvr",
  attention: str = "flash",
):
  """Greedy decoding of `max_new_tokens` from `prefill_latent`'s cache on the last rank's
  device (the absorbed form: each step reads the latents): [B, max_new_tokens] token ids."""
  check_new_tokens(max_new_tokens, 1)
  result = prefill_latent(model, tokens, mesh, partition, max_new_tokens, strategy, attention)
  return greedy_from(model, result.logits_BV, result.cache, sum(result.chunks), max_new_tokens)
