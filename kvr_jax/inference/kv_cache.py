"""Where a prefill's KV cache ends up: on the last rank in prompt order, or left sharded.

Every strategy's program returns `kv_parts` [p, L, 2, B*P, K, H] sharded by rank (batch folded
into the rows, see strategies.base.fold_batch): rank r's part holds only the K,V it computed
(`CacheLayout` says which prompt positions). Two layouts:

  cache="last"     the paper's: the parts are moved onto the last rank's device and put in
                   prompt order there, [L, B, C, K, H] for K and for V. The move runs after
                   the prefill program and is part of its TTFT (`PrefillTiming.moves_s` when
                   timed). No other rank holds more than its own part at any time.
  cache="sharded"  the parts stay where they were computed; decode attends each rank's part
                   where it lives and merges the partial outputs (kvr_jax.inference.decode).

KV-Runahead needs no move for "last": its last hop already brought every earlier position to
the last rank; its program then also returns those messages (`last_hop`) and the last rank
joins them with its own part where both lie (`join_last_hop`), no transfer at all.

In one process every shard is addressable and the move is one device-to-device copy per
run of real rows, written into the cache in place (the last device holds the cache and one
run beside it). Across processes a shard on another process cannot be copied by the owner,
so a small
SPMD program sends each rank's part to the last rank with `ppermute` instead; as SPMD gives
every rank the output's shape, that program allocates a prompt-long (unused) output on the
other ranks too, for the duration of the move.

On a ("ranks", "model") mesh a rank's part is split over its row by KV heads; the same
program moves every shard's heads to the same shard of the last rank (a ppermute over
"ranks" per model shard), and the cache is [L, B, C, K, H] over the last rank's row, heads
split over "model" (`gather_on_model_group`). KV-Runahead's no-move join runs there per
device of the last rank's row, on its heads (`join_on_model_group`).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from kvr_jax.core.caches import kept_cache
from kvr_jax.inference import decode, sharded_decode
from kvr_jax.inference.rank_moves import send_to_last_program
from kvr_jax.runtime.cache_layout import CacheLayout, parts_spec, unfold_batch
from kvr_jax.runtime.mesh import (
  AXIS,
  MODEL_AXIS,
  global_array,
  model_parallel,
  rank_row_mesh,
  split_dims,
)

CACHE_LAYOUTS = ("last", "sharded")
# cache="auto" puts the whole cache on the last rank only while the weights and it take at
# most this share of that device's memory.
WHOLE_CACHE_SHARE = 0.8
# KV-Runahead's join may cost a rank that does not keep the cache at most this share of its
# device's memory in zeros (SPMD gives every rank the last-hop output's shape); beyond it, in
# one process, the parts move instead (real rows only).
JOIN_MEMORY_SHARE = 1 / 16


def device_memory_bytes(device) -> int:
  """What `device` can hold: its allocator's limit where it reports one (GPUs), else the
  host's physical memory shared by this process's devices (emulated CPU devices)."""
  try:  # another process's device reports nothing here
    stats = device.memory_stats() if device.process_index == jax.process_index() else None
  except jax.errors.JaxRuntimeError:  # a backend without allocator statistics
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return host // max(1, len(jax.local_devices()))


def last_hop_bytes(config, chunks, batch: int, itemsize: int, kv_heads: int) -> int:
  """The join's output on every rank: each layer's last hop (S_{p-2} positions) as its kind
  keeps it (`kept_hop_bytes`: K,V of `kv_heads` heads, a latent prefix, none for a linear
  layer). chunks: the split the hops follow (a hybrid's full layers' own where they have one)."""
  prefix = sum(chunks[:-1])
  return sum(
    kind.kept_hop_bytes(config, prefix, batch, itemsize, kv_heads) for kind in config.layer_kinds
  )


def join_affordable(hop_bytes: int, device_memory: int) -> bool:
  """Whether KV-Runahead's cache="last" joins its last hops (no move) rather than moving its
  parts: only while the join's zeros on the other ranks stay within JOIN_MEMORY_SHARE of a
  device: a Qwen2.5-14B shape at 131k tokens on 8 ranks would cost every rank 42 GiB of them
  (float32), and its parts move; a tiny model joins. (In one process and across: the move
  across processes sends part by part, with no prompt-long output on any rank but the
  last.)"""
  return hop_bytes <= JOIN_MEMORY_SHARE * device_memory


def check_cache(cache, allow_auto: bool = False) -> str:
  """A cache layout by name; "auto" where the caller plans it (`choose_cache_layout`)."""
  choices = CACHE_LAYOUTS + (("auto",) if allow_auto else ())
  if cache not in choices:
    raise ValueError(f"unknown cache layout {cache!r}; expected one of {choices}")
  return cache


def whole_cache_bytes(config, context_len: int, batch: int, itemsize: int, shards: int = 1) -> int:
  """What cache="last" puts on one device of the last rank's model group of `shards`: each
  layer's past as its kind counts it (models/layer_kinds.py `cache_bytes`): K and V of every
  position of the prompt, a window's ring of W positions, a latent per position, a linear
  layer's state and halo whatever the prompt's length."""
  return sum(
    kind.cache_bytes(config, context_len, batch, itemsize, shards) for kind in config.layer_kinds
  )


def choose_cache_layout(cache_bytes: int, weights_bytes: int, device_memory: int) -> str:
  """cache="auto": "last" (the whole cache on the last rank's device, where decode reads it
  with no merge across ranks) when that device holds the weights and the whole cache within
  WHOLE_CACHE_SHARE of its memory (the rest is the prefill's and decode's working set);
  otherwise "sharded" (each rank keeps the part it computed: no device holds more than its
  part)."""
  fits = weights_bytes + cache_bytes <= WHOLE_CACHE_SHARE * device_memory
  return "last" if fits else "sharded"


def _in_prompt_order(parts, layout: CacheLayout):
  """parts: p arrays [L, 2, B*P, K, H] (rank order) -> (k, v) [L, B, C, K, H]: each built
  directly from the real rows (no stacked [L, 2, ...] intermediate)."""
  runs = layout.runs_in_prompt_order()
  parts = [unfold_batch(part, layout.part_len) for part in parts]

  def gather(kv_index):
    pieces = [parts[rank][:, kv_index, :, row : row + length] for rank, row, _, length in runs]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=2)

  return gather(0), gather(1)


@functools.partial(jax.jit, static_argnums=(2, 3))
def real_rows(part_L2RKH, row, length: int, part_len: int):
  """The rows of one run, sliced where the part lives (only real rows travel); one compile
  per run length, the row is data. Returns [L, 2, B, length, K, H]."""
  part_L2BPKH = unfold_batch(part_L2RKH, part_len)
  return jax.lax.dynamic_slice_in_dim(part_L2BPKH, row, length, axis=3)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def place(k_LBCKH, v_LBCKH, piece_L2BnKH, position):
  """Writes one run's K,V into the cache at `position`, in place (the cache is donated)."""
  k_LBCKH = jax.lax.dynamic_update_slice_in_dim(k_LBCKH, piece_L2BnKH[:, 0], position, axis=2)
  v_LBCKH = jax.lax.dynamic_update_slice_in_dim(v_LBCKH, piece_L2BnKH[:, 1], position, axis=2)
  return k_LBCKH, v_LBCKH


@functools.partial(jax.jit, static_argnums=(4, 5), donate_argnums=(0, 1))
def place_rows(k_LBCKH, v_LBCKH, part_L2RKH, row, length: int, part_len: int, position):
  """`place` of `real_rows` in one program, where the part and the cache lie on one device:
  the run's rows go from the part straight into the cache (no run-sized piece written and
  read back in between: inside one jit the two inline into one program)."""
  return place(k_LBCKH, v_LBCKH, real_rows(part_L2RKH, row, length, part_len), position)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def split_kv(part_1L2RKH, part_len: int, row: int, length: int):
  """One rank's part that holds the whole prompt -> (k, v) [L, B, C, K, H], plain arrays."""
  kv_L2BPKH = unfold_batch(part_1L2RKH[0], part_len)[:, :, :, row : row + length]
  return kv_L2BPKH[:, 0], kv_L2BPKH[:, 1]


def copy_onto(kv_parts, layout: CacheLayout, mesh, device):
  """One process: each run's real rows are copied onto `device` and written into the cache
  there, one at a time, so that the device holds the cache and one run beside it."""
  rank_of = {d: r for r, d in enumerate(mesh.devices.reshape(-1))}
  parts = {rank_of[s.device]: s.data for s in kv_parts.addressable_shards}
  runs = layout.runs_in_prompt_order()
  if len(runs) == 1 and runs[0][0] == rank_of[device]:
    # The whole cache is already this device's part (one rank): one split, no copy in.
    k_v = split_kv(parts[runs[0][0]], layout.part_len, runs[0][1], runs[0][3])
    return jax.device_put(k_v, jax.sharding.SingleDeviceSharding(device))
  L, _, rows, K, H = kv_parts.shape[1:]
  B = rows // layout.part_len
  shape = (L, B, layout.context_len, K, H)
  # A plain single-device placement (a one-device mesh's shard would keep its mesh axis).
  on_device = jax.sharding.SingleDeviceSharding(device)
  k = jnp.zeros(shape, kv_parts.dtype, device=on_device)
  v = jnp.zeros(shape, kv_parts.dtype, device=on_device)
  for rank, row, position, length in layout.runs_in_prompt_order():
    piece = jax.device_put(real_rows(parts[rank][0], row, length, layout.part_len), on_device)
    k, v = place(k, v, piece, position)
  return k, v


def send_onto_last_rank(kv_parts, layout: CacheLayout, mesh):
  """Every rank holding a run sends its part to rank p-1, one sender at a time (every process
  runs each small program), and each device of rank p-1 writes each run's real rows (its
  heads) into its cache in place as they arrive. A rank that does not keep the cache holds,
  beside its own part, one part-sized output at a time; the last rank holds the cache and
  one received part. Returns, per device of rank p-1 in "model" order, (k, v) [L, B, C, K',
  H] (K' the heads it holds); [] in a process that does not hold that rank."""
  p = layout.num_ranks
  last_row = list(mesh.devices.reshape(mesh.shape[AXIS], -1)[-1])
  if last_row[0].process_index != jax.process_index():
    last_row = []  # another process keeps the cache (a rank's devices are one process's)
  caches = {}
  for device in last_row:
    L, _, rows, K, H = next(
      s.data for s in kv_parts.addressable_shards if s.device == device
    ).shape[1:]
    shape = (L, rows // layout.part_len, layout.context_len, K, H)
    on_device = jax.sharding.SingleDeviceSharding(device)
    caches[device] = tuple(jnp.zeros(shape, kv_parts.dtype, device=on_device) for _ in "kv")
  # One stage at a time: the cache's zeros, then each send, then its writes. Dispatched all
  # at once, a send waiting on its peer shared the process's core with the zeros and the
  # writes and the move took longer and varied more (two pinned processes, bench-mistral
  # 8k: 0.16-0.35 s before, 0.10-0.14 s staged; docs/measurements.md).
  jax.block_until_ready(list(caches.values()))
  for rank in range(p):
    if not layout.segments[rank]:
      continue
    received = kv_parts if rank == p - 1 else send_to_last_program(mesh, rank)(kv_parts)
    jax.block_until_ready(received)
    for device in last_row:
      part = next(s.data for s in received.addressable_shards if s.device == device)[0]
      for position, length, row in layout.segments[rank]:
        caches[device] = place_rows(*caches[device], part, row, length, layout.part_len, position)
    jax.block_until_ready(list(caches.values()))
  return [caches[device] for device in last_row]


@kept_cache(32)
def collect_program(mesh, layout: CacheLayout):
  """The move as one SPMD program: every rank holding a run sends its part to rank p-1 (one
  pair per ppermute), which assembles them. Its output is prompt-long on every device (SPMD:
  one shape), which is why the moves send part by part instead (`send_onto_last_rank`);
  kept as what that replaced (tests/test_cache_layout.py compares their memory)."""
  p = layout.num_ranks
  # [p, L, 2, B*P, K, H] in, [p, L, B, C, K, H] out: by rank, and on a 2-D mesh heads by shard.
  spec = parts_spec(mesh)

  def body(parts_1L2BPKH):
    own = parts_1L2BPKH[0]
    received = [
      jax.lax.ppermute(own, AXIS, perm=[(r, p - 1)]) if layout.segments[r] and r != p - 1 else own
      for r in range(p)
    ]
    k, v = _in_prompt_order(received, layout)
    return k[None], v[None]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))


def gather_on_model_group(kv_parts, layout: CacheLayout, mesh):
  """2-D mesh: (k, v) [L, B, C, K, H] on the last rank's row of devices, heads split over
  "model" (`send_onto_last_rank`: every shard's heads to its counterpart, part by part);
  (None, None) in a process that does not hold that row."""
  return _heads_on_last_row(send_onto_last_rank(kv_parts, layout, mesh), mesh)


def join_on_model_group(kv_parts, last_hop, layout: CacheLayout, mesh, kept=None, lengths_B=None):
  """2-D mesh, KV-Runahead's cache="last" without a move: each device of the last rank's row
  joins its heads' last hop and own part where they lie (`join_on_device`), (k, v)
  [L, B, C, K, H] on that row, heads split over "model" as `gather_on_model_group` leaves
  them; (None, None) in a process that does not hold the row. With `kept` (windows shorter
  than the prompt): (k, v, rings) as `join_rings_on_device` joins them, each ring's heads
  split the same way; (None, None, ()) elsewhere."""
  p = mesh.shape[AXIS]
  last_row = list(mesh.devices.reshape(p, -1)[-1])
  ((position, own_len, row),) = layout.segments[-1]
  assert row == 0 and last_hop.shape[3] * layout.part_len == position * kv_parts.shape[3]
  hops = {s.device: s.data for s in last_hop.addressable_shards}
  parts = {s.device: s.data for s in kv_parts.addressable_shards}
  if last_row[0] not in hops:
    return (None, None) if kept is None else (None, None, ())
  lengths = (position, layout.part_len, own_len)
  if kept is None:
    joined = [join_on_device(hops[d], parts[d], *lengths) for d in last_row]
    return _heads_on_last_row(joined, mesh)
  rows_B = np.asarray(lengths_B, np.int32)
  joined = [
    join_rings_on_device(hops[d], parts[d], *lengths, kept, jax.device_put(rows_B, d))
    for d in last_row
  ]
  k, v = _heads_on_last_row([j[:2] for j in joined], mesh)
  rings = tuple(
    None if ring is None else _heads_on_last_row([j[2][g] for j in joined], mesh)
    for g, ring in enumerate(kept.rings)
  )
  return k, v, rings


def _heads_on_last_row(per_device, mesh):
  """(k, v) [L, B, C, K/m, H] on each device of the last rank's row (each placed by its
  device) as one (k, v) [L, B, C, K, H] over that row with heads split over "model"; (None,
  None) for none."""
  if not per_device:
    return None, None
  group = rank_row_mesh(mesh, mesh.shape[AXIS] - 1)  # where decode runs its step
  heads_split = jax.sharding.NamedSharding(group, split_dims("LBCKH", K=MODEL_AXIS))
  L, B, C, K, H = per_device[0][0].shape
  shape = (L, B, C, K * len(per_device), H)
  return tuple(
    jax.make_array_from_single_device_arrays(shape, heads_split, [kv[i] for kv in per_device])
    for i in (0, 1)
  )


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def join_on_device(last_hop_1L2RKH, part_1L2RKH, prefix_len: int, part_len: int, own_len: int):
  """(k, v) [L, B, C, K, H]: the last hop's rows (positions [0, prefix_len)) then the own
  part's first own_len rows; K and V each built directly (no [L, 2, ...] temporary)."""
  hop_L2BSKH = unfold_batch(last_hop_1L2RKH[0], prefix_len)
  own_L2BcKH = unfold_batch(part_1L2RKH[0], part_len)
  return tuple(
    jnp.concatenate([hop_L2BSKH[:, i], own_L2BcKH[:, i, :, :own_len]], axis=2) for i in (0, 1)
  )


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def join_rings_on_device(
  last_hop_1L2RKH, part_1L2RKH, prefix_len: int, part_len: int, own_len: int, kept, lengths_B
):
  """`join_on_device` where windowed layers keep rings (`kept`, decode.DecodeLayout of the
  prompt): (k, v) [L_f, B, C, K, H] of the layers that keep every position, joined as ever,
  and per group of `kept` a window's ring (k, v) [L_g, B, W, K, H] (None for the every-position
  group), each row's last W positions at slot position mod W: taken from the own chunk, and
  from the last hop's last positions where the chunk is shorter than the window. No
  prompt-long buffer of a windowed layer is built."""
  hop_L2BSKH = unfold_batch(last_hop_1L2RKH[0], prefix_len)
  own_L2BcKH = unfold_batch(part_1L2RKH[0], part_len)[:, :, :, :own_len]
  full = kept.every_position_layers
  k, v = (jnp.concatenate([hop_L2BSKH[full, i], own_L2BcKH[full, i]], axis=2) for i in (0, 1))
  rings = []
  for group, ring in enumerate(kept.rings):
    if ring is None:
      rings.append(None)
      continue
    layers = kept.layers_of(group)
    position_BW = decode.ring_positions(lengths_B, ring)
    # Each slot from the hop (positions before prefix_len) or from the own chunk, not both.
    in_hop_BW = position_BW < prefix_len
    ring_L2BWKH = decode.take_slots(
      hop_L2BSKH[layers], jnp.where(in_hop_BW, position_BW, -1), axis=3
    ) + decode.take_slots(
      own_L2BcKH[layers], jnp.where(in_hop_BW, -1, position_BW - prefix_len), axis=3
    )
    rings.append((ring_L2BWKH[:, 0], ring_L2BWKH[:, 1]))
  return k, v, tuple(rings)


def join_last_hop(kv_parts, last_hop, layout: CacheLayout, mesh, kept=None, lengths_B=None):
  """(k, v) [L, B, C, K, H] on the last rank's device from what it already holds: the last
  hop's messages (positions [0, S_{p-2})) and its own part; (None, None) in a process that
  does not hold it. With `kept` (windows shorter than the prompt, decode.DecodeLayout):
  (k, v, rings) as `join_rings_on_device` joins them, (None, None, ()) elsewhere."""
  owner = mesh.devices.reshape(-1)[-1]
  ((position, own_len, row),) = layout.segments[-1]
  assert row == 0 and last_hop.shape[3] * layout.part_len == position * kv_parts.shape[3]
  hop = [s.data for s in last_hop.addressable_shards if s.device == owner]
  part = [s.data for s in kv_parts.addressable_shards if s.device == owner]
  if not hop:
    return (None, None) if kept is None else (None, None, ())
  if kept is None:
    return join_on_device(hop[0], part[0], position, layout.part_len, own_len)
  lengths_B = jax.device_put(np.asarray(lengths_B, np.int32), owner)
  return join_rings_on_device(hop[0], part[0], position, layout.part_len, own_len, kept, lengths_B)


def on_last_row(x, mesh):
  """A replicated array's copy (on a 2-D mesh: its heads' shards, axis 3 split over "model")
  on the last rank's device (its row of devices); None in a process that does not hold it."""
  last_row = list(mesh.devices.reshape(mesh.shape[AXIS], -1)[-1])
  shards = {s.device: s.data for s in x.addressable_shards}
  if last_row[0] not in shards:
    return None
  if model_parallel(mesh) == 1:
    return shards[last_row[0]]
  group = rank_row_mesh(mesh, mesh.shape[AXIS] - 1)
  heads = jax.sharding.NamedSharding(group, split_dims("LBCKH", K=MODEL_AXIS))
  return jax.make_array_from_single_device_arrays(x.shape, heads, [shards[d] for d in last_row])


def kept_on_last_rank(kv_parts, layout: CacheLayout, mesh, kept, lengths_B, last_hop=None):
  """cache="last" where windowed layers keep rings (`kept`, decode.DecodeLayout of the prompt):
  (k, v) [L_f, B, C, K, H] of the layers that keep every position and the rings per group of
  `kept` (None for the every-position group), on the last rank's device (its row on a 2-D
  mesh); (None, None, ()) in a process that does not hold it.

  KV-Runahead with its last hop joins them where they lie (`join_rings_on_device`). The peers'
  parts move only the every-position layers; each window's ring is cut where its positions
  lie and summed over the ranks (sharded_decode.sharded_rings_program: one psum of the window), and
  the last rank keeps its copy."""
  if last_hop is not None and model_parallel(mesh) > 1:
    return join_on_model_group(kv_parts, last_hop, layout, mesh, kept, lengths_B)
  if last_hop is not None:
    return join_last_hop(kv_parts, last_hop, layout, mesh, kept, lengths_B)
  lengths = global_array(np.asarray(lengths_B, np.int32), jax.sharding.NamedSharding(mesh, jax.P()))
  full_parts, rings = sharded_decode.sharded_rings_program(mesh, layout, kept)(kv_parts, lengths)
  return cut_on_last_rank(full_parts, rings, layout, mesh, kept)


def cut_on_last_rank(full_parts, rings, layout: CacheLayout, mesh, kept):
  """`kept_on_last_rank` from parts already cut (`sharded_decode.sharded_rings_program`'s outputs:
  the every-position layers' parts [p, L_f, 2, B*P, K, H] and the replicated rings): those
  parts moved onto the last rank, the rings' copies there. Where every layer keeps a ring
  nothing moves: the every-position layers are an empty [0, B, C, K, H] there."""
  rings = tuple(None if r is None else tuple(on_last_row(x, mesh) for x in r) for r in rings)
  if kept.every_position_group is not None:
    k, v = gather_on_last_rank(full_parts, layout, mesh)
    return (None, None, ()) if k is None else (k, v, rings)
  ring_k = next(r[0] for r in rings if r is not None)
  if ring_k is None:
    return None, None, ()  # another process holds the last rank
  _, B, _, K, H = ring_k.shape
  none = jnp.zeros((0, B, layout.context_len, K, H), ring_k.dtype, device=ring_k.sharding)
  return none, none, rings


def gather_on_last_rank(kv_parts, layout: CacheLayout, mesh, method: str = "auto", last_hop=None):
  """The parts [p, L, 2, B*P, K, H] (sharded by rank) -> (k, v) [L, B, C, K, H] on the last
  rank's device, or (None, None) in a process that does not hold it. On a 2-D mesh: on the
  last rank's row, heads split over "model" (`join_on_model_group` from the last hop, else
  `gather_on_model_group`; `method` unused).

  last_hop: KV-Runahead's last-hop messages where its program kept them: the cache is joined
  on the last rank from what it holds (`join_last_hop`), nothing moves. Otherwise method
  "copy" copies each run's real rows onto that device and writes them into the cache there
  (one process), "collective" sends the parts to the last rank one rank at a time
  (`send_onto_last_rank`, across processes), "auto" the first when every shard is
  addressable.
  """
  if model_parallel(mesh) > 1 and last_hop is not None:
    return join_on_model_group(kv_parts, last_hop, layout, mesh)
  if model_parallel(mesh) > 1:
    return gather_on_model_group(kv_parts, layout, mesh)
  if last_hop is not None:
    return join_last_hop(kv_parts, last_hop, layout, mesh)
  owner = mesh.devices.reshape(-1)[-1]
  if method == "auto":
    method = "copy" if kv_parts.is_fully_addressable else "collective"
  if method == "copy":
    return copy_onto(kv_parts, layout, mesh, owner)
  if method != "collective":
    raise ValueError(f"unknown method {method!r}; expected 'auto', 'copy' or 'collective'")
  (on_owner,) = send_onto_last_rank(kv_parts, layout, mesh) or [(None, None)]
  return on_owner
