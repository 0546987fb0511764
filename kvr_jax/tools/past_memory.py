"""compiled_memory's figures of a model's past, past its prefill program's: one measurement
for every kind of past (`past_figures`). Each kind says, from shapes, what its cache holds,
how cache="last" brings it onto the last rank and what its decode steps read: a `PastMemory`
(`PAST_MEMORY`, by its cache form's name):
  kv      K,V per layer (kvr_jax.inference.kv_form): KV-Runahead's join of its last hops or
          the parts moved run by run; a window the prompt outgrew kept as its ring alone
  latent  one headless latent per position (kvr_jax.inference.latent): whole on every
          device of a model group
  hybrid  full layers' K,V and linear layers' fixed-size states and halos
          (kvr_jax.inference.hybrid)
The measurement then runs the same for every kind: the move's and the decode step's programs
compiled from those shapes and read by XLA's analysis (kvr_jax.tools.xla_memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.inference import decode, sharded_decode
from kvr_jax.inference import hybrid as hybrid_inference
from kvr_jax.inference import latent as latent_inference
from kvr_jax.inference.kv_cache import join_on_device, join_rings_on_device, place
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.cache_layout import parts_spec
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, rank_device, rank_row_mesh, split_dims
from kvr_jax.strategies import by_kind
from kvr_jax.strategies import hybrid as hybrid_program
from kvr_jax.tools.xla_memory import (
  analysis,
  compile_for_figures,
  decode_bytes,
  last_rank_step,
  on_last_row,
  sharded_step,
  struct,
)
from models.kv_cache import KVCache
from models.qwen3_5 import HybridCache, LinearState


@dataclasses.dataclass(frozen=True)
class Measured:
  """What a kind's hooks read: the model's config, the plan prefill would make, the shape
  measured (context_len T, ranks p, batch B, devices per rank m, decode tokens M), the dtype,
  the prefill program's cache outputs as shapes (by name, [p, ...]: `lowered.out_info[1]`)
  and the model (graphdef, abstract state, its placed shapes)."""

  config: Any
  plan: Any
  shape: tuple[int, int, int, int, int]
  dtype_name: str
  outputs: dict
  model: tuple

  @property
  def itemsize(self) -> int:
    return np.dtype(self.dtype_name).itemsize

  @property
  def capacity(self) -> int:
    """The positions the cache keeps for decoding: the prompt and the decode tokens'."""
    context_len, *_, decode_tokens = self.shape
    return context_len + decode_tokens


@dataclasses.dataclass(frozen=True)
class PastMemory:
  """How compiled_memory measures one kind of past, each hook f(Measured):

  cache_bytes -> {figure: bytes}: one device's share of what the prefill leaves.
  move -> (argument bytes, temp bytes): what the last rank's device (each of its row's, on a
    2-D mesh) holds while cache="last" brings the cache there, as prefill runs it (XLA's
    analysis of that join compiled from shapes).
  grown -> the cache generate decodes after cache="last", as shapes with room for the decode
    tokens (the whole model group's heads; the form's `decode_cache_spec` places it).
  sharded -> (program, inputs, caches): cache="sharded"'s decode step (the form's
    `sharded_decode`, the same program) and its operands as placed shapes."""

  cache_bytes: Callable
  move: Callable
  grown: Callable
  sharded: Callable


def past_figures(measured: Measured, memory: PastMemory) -> dict:
  """The figures of a model's past, every kind alike: whether KV-Runahead's last rank joins
  its last hops (`joins_last_hop`), the cache's bytes, cache="last"'s move
  (`move_argument_bytes`, `move_temp_bytes`) and with decode tokens one decode step's
  (`decode_cache_bytes`: the cache among its arguments on one device; `decode_argument_bytes`,
  `decode_output_bytes`, `decode_temp_bytes`)."""
  config, plan = measured.config, measured.plan
  _, _, batch, _, decode_tokens = measured.shape
  figures = {"joins_last_hop": plan.keep_last_hop, **memory.cache_bytes(measured)}
  if plan.cache == "last":
    arguments, temps = memory.move(measured)
    figures.update(move_argument_bytes=int(arguments), move_temp_bytes=int(temps))
  if not decode_tokens:
    return figures
  if plan.cache == "last":
    grown = memory.grown(measured)
    specs = plan.cache_form.decode_cache_spec(grown)
    lowered = last_rank_step(
      config, plan.mesh, measured.model, batch, grown, specs, measured.itemsize
    )
    held = on_last_row(plan.mesh, grown, specs)
  else:
    program, inputs, caches = memory.sharded(measured)
    lowered = sharded_step(program, measured.model[2], plan.mesh, batch, inputs, caches)
    held = (inputs, caches)
  stats = compile_for_figures(lowered, measured.dtype_name).memory_analysis()
  return {**figures, "decode_cache_bytes": cache_bytes_on_a_device(held), **decode_bytes(stats)}


def cache_bytes_on_a_device(shapes) -> int:
  """One device's bytes of the floating-point arrays among placed `shapes` (a decode step's
  cache operands, not the positions that index them)."""
  return int(
    sum(
      np.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
      for x in jax.tree.leaves(shapes)
      if jnp.issubdtype(x.dtype, jnp.floating)
    )
  )


def _moved(lowered) -> tuple[int, int]:
  figures = analysis(lowered.compile())
  return figures["argument_bytes"], figures["temp_bytes"]


# --- K,V ------------------------------------------------------------------------------------


def _kv_heads(measured: Measured) -> tuple[int, int]:
  """(one device's KV heads, head_dim)."""
  _, _, _, m, _ = measured.shape
  return tensor_parallel.kv_heads_per_shard(measured.config, m), measured.config.head_dim


def _kv_cache_bytes(measured: Measured) -> dict:
  context_len, _, batch, _, _ = measured.shape
  (K, H), L = _kv_heads(measured), measured.config.num_layers
  return {"kv_cache_bytes": L * 2 * batch * context_len * K * H * measured.itemsize}


def _kv_move(measured: Measured) -> tuple[int, int]:
  """KV-Runahead's join of its last hops and its own part on the last rank's device
  (kv_cache.join_on_device; join_rings_on_device where windows keep rings), or the move of
  the parts run by run: the last rank's device holds the cache (the every-position layers and
  the rings) and one run's real rows beside it (kv_cache.place, XLA's analysis of writing the
  longest run). On a 2-D mesh each device of the last rank's row, its heads."""
  config, plan, dtype_name = measured.config, measured.plan, measured.dtype_name
  _, _, batch, _, _ = measured.shape
  (K, H), L, chunks = _kv_heads(measured), config.num_layers, plan.chunks
  context_len = sum(chunks)
  layout = plan.strategy.cache_layout(context_len, chunks)
  on_last = jax.sharding.SingleDeviceSharding(plan.mesh.devices.reshape(-1)[-1])
  kept = decode.DecodeLayout.of(config, context_len)
  if plan.keep_last_hop:
    prefix_len = context_len - chunks[-1]
    hop = struct((1, L, 2, batch * prefix_len, K, H), dtype_name, on_last)
    part = struct((1, L, 2, batch * layout.part_len, K, H), dtype_name, on_last)
    args = (hop, part, prefix_len, layout.part_len, chunks[-1])
    if kept.rings == (None,):
      return _moved(join_on_device.lower(*args))
    lengths = struct((batch,), np.int32, on_last)
    return _moved(join_rings_on_device.lower(*args, kept, lengths))
  ring_bytes = sum(
    2 * len(kept.layers_of(g)) * batch * ring * K * H * measured.itemsize
    for g, ring in enumerate(kept.rings)
    if ring is not None
  )
  L_f = len(kept.every_position_layers)
  if not L_f:
    return ring_bytes, 0
  longest = max(length for _, _, _, length in layout.runs_in_prompt_order())
  cache_shape = struct((L_f, batch, context_len, K, H), dtype_name, on_last)
  piece = struct((L_f, 2, batch, longest, K, H), dtype_name, on_last)
  position = struct((), np.int32, on_last)
  arguments, temps = _moved(place.lower(cache_shape, cache_shape, piece, position))
  return arguments + ring_bytes, temps


def _kv_groups(measured: Measured, kept, every_position: int, sharding=None) -> tuple:
  """Per group of `kept`, (k, v) shapes [L_g, B, S, K, H] (the group's heads): a ring of its
  window, or `every_position` positions."""
  _, _, batch, m, _ = measured.shape
  K, H = _kv_heads(measured)
  return tuple(
    (
      struct(
        (len(kept.layers_of(g)), batch, ring or every_position, K * m, H),
        measured.dtype_name,
        sharding,
      ),
    )
    * 2
    for g, ring in enumerate(kept.rings)
  )


def _kv_grown(measured: Measured) -> KVCache:
  """The whole cache grown by the decode tokens, a window shorter than that kept as its ring
  (decode.DecodeLayout, as generate keeps it)."""
  kept = decode.DecodeLayout.of(measured.config, measured.capacity)
  return KVCache(kept, _kv_groups(measured, kept, measured.capacity))


# A ring, its KV heads split over "model" (the tail lies as sharded_decode.tail_sharding).
_RING_HEADS = split_dims("LBWKH", K=MODEL_AXIS)


def _kv_sharded(measured: Measured) -> tuple:
  """sharded_decode.sharded_decode_program over every device's part [p, L_f, 2, B*P, K, H], the
  tail of the every-position layers and the rings of the windows the prompt outgrew."""
  plan = measured.plan
  context_len, _, batch, m, decode_tokens = measured.shape
  mesh, layout = plan.mesh, plan.strategy.cache_layout(context_len, plan.chunks)
  (K, H), dtype_name = _kv_heads(measured), measured.dtype_name
  replicated = NamedSharding(mesh, jax.P())
  kept = decode.DecodeLayout.of(measured.config, context_len)
  every, L_f = kept.every_position_group, len(kept.every_position_layers)
  tail_sharding = sharded_decode.tail_sharding(mesh)
  tail = struct((L_f, 2, batch, decode_tokens, K * m, H), dtype_name, tail_sharding)
  ring_sharding = NamedSharding(mesh, _RING_HEADS) if m > 1 else replicated
  rings = _kv_groups(measured, kept, 0, ring_sharding)
  caches = tuple(tail if g == every else rings[g] for g in range(len(kept.rings)))
  parts = struct(
    (layout.num_ranks, L_f, 2, batch * layout.part_len, K * m, H),
    dtype_name,
    NamedSharding(mesh, parts_spec(mesh)),
  )
  program = sharded_decode.sharded_decode_program(measured.model[0], mesh, layout, kept)
  return program, (parts,), (caches,)


KV = PastMemory(_kv_cache_bytes, _kv_move, _kv_grown, _kv_sharded)


# --- latent attention -----------------------------------------------------------------------


def _latent_cache_bytes(measured: Measured) -> dict:
  """One headless C-wide entry per token and layer, whole on every device of a model group
  (whatever m)."""
  context_len, _, batch, _, _ = measured.shape
  L, C = measured.config.num_layers, measured.config.cache_width
  return {"latent_cache_bytes": L * batch * context_len * C * measured.itemsize}


def _latent_move(measured: Measured) -> tuple[int, int]:
  """KV-Runahead's join of its last hop and its own part where they lie
  (`latent.join_last_hop`), or every rank's part sent to the last rank's device and put in
  prompt order (`latent.join_in_prompt_order`: all p parts there at once, beside the cache).
  The program's outputs on one rank: {"own": [L, B, T_rank, C], "last": [L, B, S_{p-2}, C]
  where kept}."""
  plan = measured.plan
  on_device = jax.sharding.SingleDeviceSharding(rank_device(plan.mesh, measured.shape[1] - 1))
  parts = {name: (out.shape[1:], out.dtype) for name, out in measured.outputs.items()}
  own_shape, dtype = parts["own"]
  if "last" in parts:  # KV-Runahead's program kept its last hop
    last, own = struct(*parts["last"], on_device), struct(own_shape, dtype, on_device)
    return _moved(
      latent_inference.join_last_hop.lower(last, own, plan.chunks[-1], measured.capacity)
    )
  pieces = struct((len(plan.chunks), *own_shape), dtype, on_device)
  rows = struct((sum(plan.chunks),), np.int32, on_device)
  return _moved(latent_inference.join_in_prompt_order.lower(pieces, rows, measured.capacity))


def _latent_grown(measured: Measured):
  _, _, batch, _, _ = measured.shape
  L, C = measured.config.num_layers, measured.config.cache_width
  return jax.ShapeDtypeStruct((L, batch, measured.capacity, C), np.dtype(measured.dtype_name))


def _latent_sharded(measured: Measured) -> tuple:
  """`latent.latent_sharded_step` over the parts [p, L, B, T_rank, C] and their rows' prompt
  positions, by rank, and the decoded tokens' latents replicated."""
  mesh = measured.plan.mesh
  _, num_ranks, batch, _, decode_tokens = measured.shape
  L, C = measured.config.num_layers, measured.config.cache_width
  dtype, rows = np.dtype(measured.dtype_name), measured.outputs["own"].shape[3]
  by_rank, replicated = NamedSharding(mesh, jax.P(AXIS)), NamedSharding(mesh, jax.P())
  inputs = (
    struct((num_ranks, L, batch, rows, C), dtype, by_rank),  # the parts
    struct((num_ranks, rows), np.int32, by_rank),  # their rows' prompt positions
  )
  tail = struct((L, batch, decode_tokens, C), dtype, replicated)
  return latent_inference.latent_sharded_step(measured.model[0], mesh), inputs, (tail,)


LATENT = PastMemory(_latent_cache_bytes, _latent_move, _latent_grown, _latent_sharded)


# --- hybrids: full layers' K,V beside linear layers' states ----------------------------------


def _hybrid_cache(measured: Measured, positions: int) -> HybridCache:
  """A hybrid cache of `positions` as shapes, the whole group's (m devices' KV heads,
  repeated to m where the model has fewer, as the shards hold them)."""
  config = measured.config
  _, _, batch, m, _ = measured.shape
  K = tensor_parallel.kv_heads_per_shard(config, m) * m
  h, d_k = config.linear_num_value_heads, config.linear_key_head_dim
  d_v, w = config.linear_value_head_dim, config.linear_conv_kernel - 1
  L_full, L_linear = (len(config.layers_of(t)) for t in ("full_attention", "linear_attention"))
  dtype = np.dtype(measured.dtype_name)
  return HybridCache(
    jax.ShapeDtypeStruct((L_full, 2, batch, positions, K, config.head_dim), dtype),
    LinearState(
      jax.ShapeDtypeStruct((L_linear, batch, h, d_k, d_v), np.float32),
      jax.ShapeDtypeStruct((L_linear, batch, w, config.conv_channels), dtype),
    ),
  )


def _hybrid_layout(measured: Measured):
  """The full layers' K,V parts' layout (their own split where the plan has one)."""
  plan = measured.plan
  return plan.strategy.cache_layout(measured.shape[0], plan.full_chunks or plan.chunks)


def _hybrid_cache_bytes(measured: Measured) -> dict:
  """One device's share of each part: `kv_cache_bytes` the full layers' K,V (cache="sharded":
  the longest part's rows; else every prompt position), `state_cache_bytes` the linear
  layers' float32 states and halos, whatever the prompt length."""
  context_len, _, _, m, _ = measured.shape
  whole = _hybrid_cache(measured, measured.capacity)
  full_kv, states = (
    int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(part)) // m)
    for part in (whole.kv_2BSKH, whole.linear)
  )
  positions = _hybrid_layout(measured).part_len if measured.plan.cache == "sharded" else context_len
  return {"kv_cache_bytes": full_kv * positions // measured.capacity, "state_cache_bytes": states}


def _hybrid_move(measured: Measured) -> tuple[int, int]:
  """KV-Runahead's join of its full layers' last hops and own parts and its linear states
  where they lie (`hybrid.join_last_hop`), or every rank's parts sent to the last rank,
  stacked, and put in prompt order (`hybrid.join_in_prompt_order`: all p parts at once,
  beside the cache); on a 2-D mesh each device of the last rank's row its heads."""
  plan = measured.plan
  chunks, full_chunks = plan.chunks, plan.full_chunks or plan.chunks
  row = rank_row_mesh(plan.mesh, len(chunks) - 1)
  specs = {**by_kind.attention_specs(plan.mesh), **hybrid_program.output_specs(plan.mesh)}
  joins = plan.keep_last_hop

  def placed(name):
    rest = tuple(specs[name])[1:]  # the rank axis dropped, or kept whole as the stack's
    spec = jax.P(*rest) if joins else jax.P(None, *rest)
    shape = (lambda x: x.shape[1:]) if joins else (lambda x: x.shape)
    return lambda x: struct(shape(x), x.dtype, NamedSharding(row, spec))

  on_last = {name: jax.tree.map(placed(name), part) for name, part in measured.outputs.items()}
  if joins:
    return _moved(hybrid_inference.join_last_hop.lower(on_last, full_chunks, measured.capacity))
  T = sum(chunks)
  layout, halo_rank = hybrid_inference.parts_layout(plan.strategy, T, chunks, plan.full_chunks)
  lowered = hybrid_inference.join_in_prompt_order.lower(
    on_last, layout, halo_rank, measured.capacity
  )
  return _moved(lowered)


def _hybrid_sharded(measured: Measured) -> tuple:
  """`hybrid.hybrid_sharded_step` over the full layers' K,V parts [p, L, 2, B*P, K, H] by
  rank, the decoded tokens' tail and the linear pasts on every rank (split by head on a 2-D
  mesh)."""
  mesh, layout = measured.plan.mesh, _hybrid_layout(measured)
  _, num_ranks, _, m, decode_tokens = measured.shape
  tail = _hybrid_cache(measured, decode_tokens)
  L, _, B, _, K, H = tail.kv_2BSKH.shape
  specs = hybrid_inference.CACHE_SPECS if m > 1 else jax.tree.map(lambda _: jax.P(), tail)
  tail = jax.tree.map(
    lambda x, spec: struct(x.shape, x.dtype, NamedSharding(mesh, spec)), tail, specs
  )
  parts = struct(
    (num_ranks, L, 2, B * layout.part_len, K, H),
    np.dtype(measured.dtype_name),
    NamedSharding(mesh, parts_spec(mesh)),
  )
  program = hybrid_inference.hybrid_sharded_step(measured.model[0], mesh, layout)
  return program, (parts,), (tail.kv_2BSKH, tail.linear)


HYBRID = PastMemory(
  _hybrid_cache_bytes,
  _hybrid_move,
  lambda measured: _hybrid_cache(measured, measured.capacity),
  _hybrid_sharded,
)

# Each kind of past's measurement, by its cache form's name (kvr_jax.inference.cache_form).
PAST_MEMORY = {"kv": KV, "latent": LATENT, "hybrid": HYBRID}
