"""Where a prefill's KV cache ends up: on the last rank in prompt order, or left sharded.

Every strategy's program returns `kv_parts` [p, L, 2, B, P, K, H] sharded by rank: rank r's
part holds only the K,V it computed (`CacheLayout` says which prompt positions). Two layouts:

  cache="last"     the paper's: the parts are moved onto the last rank's device and put in
                   prompt order there, [L, B, C, K, H] for K and for V. The move runs after
                   the prefill program and is part of its TTFT (`PrefillResult.move_s` when
                   timed). No other rank holds more than its own part at any time.
  cache="sharded"  the parts stay where they were computed; decode attends each rank's part
                   where it lives and merges the partial outputs (kvr_jax.inference.decode).

In one process every shard is addressable and the move is one device-to-device copy per
rank. Across processes a shard on another process cannot be copied by the owner, so a small
SPMD program sends each rank's part to the last rank with `ppermute` instead; as SPMD gives
every rank the output's shape, that program allocates a prompt-long (unused) output on the
other ranks too, for the duration of the move.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies.base import CacheLayout

CACHE_LAYOUTS = ("last", "sharded")


def check_cache(cache) -> str:
  if cache not in CACHE_LAYOUTS:
    raise ValueError(f"unknown cache layout {cache!r}; expected one of {CACHE_LAYOUTS}")
  return cache


def _in_prompt_order(parts, layout: CacheLayout):
  """parts: p arrays [L, 2, B, P, K, H] (rank order) -> (k, v) [L, B, C, K, H]."""
  pieces = [
    parts[rank][:, :, :, row : row + length]
    for rank, row, _, length in layout.runs_in_prompt_order()
  ]
  kv_L2BCKH = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=3)
  return kv_L2BCKH[:, 0], kv_L2BCKH[:, 1]


@functools.partial(jax.jit, static_argnums=(1,))
def assemble(parts, layout: CacheLayout):
  """On one device: the parts (a tuple, rank order) -> (k, v) [L, B, C, K, H] in prompt order."""
  return _in_prompt_order(parts, layout)


@functools.lru_cache(maxsize=32)
def collect_program(mesh, layout: CacheLayout):
  """The move as one SPMD program (for parts that live in several processes): every rank
  holding a run sends its part to rank p-1 (one pair per ppermute), which assembles them."""
  p = layout.num_ranks
  P = jax.P

  def body(parts_1L2BPKH):
    own = parts_1L2BPKH[0]
    received = [
      jax.lax.ppermute(own, AXIS, perm=[(r, p - 1)]) if layout.segments[r] and r != p - 1 else own
      for r in range(p)
    ]
    k, v = _in_prompt_order(received, layout)
    return k[None], v[None]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=(P(AXIS), P(AXIS))))


def gather_on_last_rank(kv_parts, layout: CacheLayout, mesh, method: str = "auto"):
  """The parts [p, L, 2, B, P, K, H] (sharded by rank) -> (k, v) [L, B, C, K, H] on the last
  rank's device, or (None, None) in a process that does not hold it.

  method "copy" copies each rank's part onto that device and assembles there (one process),
  "collective" runs `collect_program`, "auto" the first when every shard is addressable.
  """
  owner = mesh.devices.reshape(-1)[-1]
  if method == "auto":
    method = "copy" if kv_parts.is_fully_addressable else "collective"
  if method == "copy":
    by_rank = {
      tuple(mesh.devices.reshape(-1)).index(s.device): s for s in kv_parts.addressable_shards
    }
    parts = tuple(jax.device_put(by_rank[r].data[0], owner) for r in range(layout.num_ranks))
    return assemble(parts, layout)
  if method != "collective":
    raise ValueError(f"unknown method {method!r}; expected 'auto', 'copy' or 'collective'")
  k, v = collect_program(mesh, layout)(kv_parts)
  for k_shard, v_shard in zip(k.addressable_shards, v.addressable_shards, strict=True):
    if k_shard.device == owner:
      return k_shard.data[0], v_shard.data[0]
  return None, None
