"""A hybrid model's cache form (Qwen3.5, Qwen3-Next: linear and full layers; its program is
kvr_jax/strategies/hybrid.py), `FORM`: `kvr_jax.prefill` plans and runs its program as any
model's (`prefill.run_prefill`; 1-D mesh, or a 2-D one whose ranks are model groups:
heads, key heads, experts and MLP columns split over "model", kvr_jax.runtime.tensor_parallel)
and this module places its outputs and decodes from them: the cache joined on the last
rank (KV-Runahead's last hops and own chunk where they lie; the peers' parts moved there,
across processes too; on a 2-D mesh split over its group by head, `CACHE_SPECS`), or left
in the ranks' parts (cache="sharded": `hybrid_sharded_step` decodes them where they lie,
`sharded_hybrid_decode` gives it to the one sharded stepper).
Rows of one length or padded past their ends (a bucket, a ragged batch), on 1-D and 2-D meshes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.core.caches import kept_cache
from kvr_jax.inference import decode, sharded_decode, steppers
from kvr_jax.inference.cache_form import ModelCacheForm, padded_positions
from kvr_jax.inference.rank_moves import (
  replicated_from_rank,
  stacked_on_last_rank,
)
from kvr_jax.runtime.cache_layout import CacheLayout, parts_spec, unfold_batch
from kvr_jax.runtime.mesh import (
  AXIS,
  MODEL_AXIS,
  global_array,
  model_parallel,
  placements,
  rank_device,
  rank_row_mesh,
  shard_on,
  split_dims,
)
from kvr_jax.strategies import family_program, zigzag
from kvr_jax.strategies.base import count_trace
from kvr_jax.strategies.hybrid import runs_hybrid
from models.layer_kinds import FULL_ATTENTION
from models.qwen3_5 import HybridCache, LinearState, by_kind


def left_in_parts(out: dict, plan) -> dict:
  """cache="sharded"'s `OwnParts` fields (`ModelCacheForm.left_in_parts`): the full layers' K,V
  parts where they lie [p, L_full, 2, B*P, K, H] by rank, laid out as cache_layout says, the
  final linear state (the last rank's; every peer's is the same) and the prompt's halo on
  every rank (one psum each)."""
  mesh, p = plan.mesh, plan.mesh.shape[AXIS]
  layout, halo_rank = parts_layout(plan.strategy, plan.prompt_len, plan.chunks, plan.full_chunks)
  parts = out["kv"][0] if isinstance(out["kv"], tuple) else out["kv"]
  linear = LinearState(
    replicated_from_rank(out["state"], mesh, p - 1),
    replicated_from_rank(out["halo"], mesh, halo_rank),
  )
  return dict(parts=parts, cache_layout=layout, linear_state=linear)


def joined_from_last_hop(out: dict, plan, capacity: int) -> HybridCache:
  """The `HybridCache` of `capacity` positions from the last rank's outputs alone
  (`CacheForm.joined_from_last_hop`): each full layer's last hop and own chunk, each linear
  layer's state and halo, without a move; on a 2-D mesh each device joins its own heads'
  (split over the last rank's group by head, `CACHE_SPECS`: device j holds its KV heads, its
  value heads' states and its q, k, v heads' convolution channels, so the halo's channels
  are in device order)."""
  mine = jax.tree.map(lambda a: _last_rank_part(a, plan.mesh), out)
  return join_last_hop(mine, plan.full_chunks or plan.chunks, capacity)


def joined_from_parts(out: dict, plan, capacity: int) -> HybridCache | None:
  """The outputs moved onto the last rank (every process sends) and joined there in prompt
  order (`CacheForm.joined_from_parts`: the full layers' parts as the strategy's cache
  layout says, any strategy's, the split as data's too). None in a process that does not
  hold the last rank."""
  layout, halo_rank = parts_layout(plan.strategy, plan.prompt_len, plan.chunks, plan.full_chunks)
  mine = jax.tree.map(lambda a: stacked_on_last_rank(a, plan.mesh), out)
  if mine["state"] is None:
    return None
  return join_in_prompt_order(mine, layout, halo_rank, capacity)


def parts_layout(record, T: int, chunks, full_chunks) -> tuple:
  """(where each rank's K,V rows lie: the full layers' split as `record` lays it out, the
  rank whose halo is the prompt's: the one holding its last position in the tokens' split,
  KVR's last rank, the zigzag peers' rank 0). What the join of moved parts, the sharded
  layout and compiled_memory's move figures read."""
  halo_rank, _ = record.cache_layout(T, chunks).holder(T - 1)
  return record.cache_layout(T, full_chunks or chunks), halo_rank


def operands(tokens_BT, lengths):
  """The program's tokens operand (`CacheForm.operands`): tokens [B, T] where every row runs
  to the prompt's end, else (tokens, each position minus its row's end [B, T]: the linear
  layers stop each row's state there)."""
  if lengths is None:
    return tokens_BT
  B, T = tokens_BT.shape
  ends_B = np.asarray(lengths, np.int64).reshape(-1)
  if ends_B.shape != (B,) or (ends_B < 0).any() or (ends_B > T).any():
    raise ValueError(f"lengths must be {B} row ends in [0, {T}], got {np.asarray(lengths)}")
  if (ends_B == T).all():
    return tokens_BT
  return tokens_BT, (np.arange(T)[None] - ends_B[:, None]).astype(np.int32)


def _last_rank_part(array, mesh):
  """The last rank's piece of an output [p, ...]: on its device (1-D mesh), or split over
  its group by head as the program split it (2-D: each device's where it lies; in the last
  rank's process, across processes too)."""
  p, m = mesh.shape[AXIS], model_parallel(mesh)
  if m == 1:
    return shard_on(array, rank_device(mesh, p - 1))
  last_row = list(mesh.devices.reshape(p, m)[-1])
  by_device = {shard.device: shard.data[0] for shard in array.addressable_shards}
  shards = [by_device[device] for device in last_row]
  spec = tuple(array.sharding.spec)[1:]  # the head axis's "model", rank axis dropped
  shape = list(shards[0].shape)
  shape[spec.index(MODEL_AXIS)] *= m
  row = NamedSharding(rank_row_mesh(mesh, p - 1), jax.P(*spec))
  return jax.make_array_from_single_device_arrays(tuple(shape), row, shards)


def check_split(config, spec, T: int, p: int, full_chunks=None) -> None:
  """What a hybrid's split runs, refused by name before anything compiles (kvr_jax.prefill's
  plan asks it: `CacheForm.check_split`): a peer's zigzag chunks each take their
  convolution halo from one neighbour, so each must hold at least its w rows (KV-Runahead's
  chunks pass on the tail of the halo they received: any length); KV-Runahead's split as
  data (the record's `split_shape`) runs one split for every kind of layer."""
  if full_chunks is not None and family_program(spec)[2] is not None:
    raise ValueError("a hybrid's split as data takes one split for every kind of layer")
  if spec.partitioned:
    return
  halo = config.linear_conv_kernel - 1
  c = zigzag.chunk_len(T, p)  # 2p chunks of c: the last ones hold what is left, or padding
  shortest = min(min(c, max(T - j * c, 0)) for j in range(2 * p))
  if shortest < halo:
    raise ValueError(
      f"{spec.name} on {p} ranks splits {T} tokens into zigzag chunks as short as {shortest} "
      "tokens, "
      f"and each must hold the linear layers' convolution halo of {halo} tokens (its kernel "
      f"is {halo + 1}): give a longer prompt, fewer ranks, or strategy='kvr', which runs "
      "any split"
    )


# The joins are jitted once, their lengths static: a jit of a fresh closure per call traced
# and compiled it on every prefill (0.2 s of a 2.8 s TTFT at 16k on bench-qwen3.5-8).
@functools.partial(jax.jit, static_argnums=(1, 2))
def join_last_hop(out: dict, chunks: tuple[int, ...], capacity: int) -> HybridCache:
  """The last rank's outputs as the hybrid cache: each full layer's last hop then its own
  chunk, padded to `capacity` positions; each linear layer's state and halo as they are."""
  count_trace("hybrid-join")
  c_last, prefix, c_max = chunks[-1], sum(chunks[:-1]), max(chunks)
  own, last_hop = out["kv"]
  parts = [unfold_batch(own, c_max)[:, :, :, :c_last]]
  if prefix:
    parts.insert(0, unfold_batch(last_hop, prefix))
  return _padded(jnp.concatenate(parts, axis=3), out["state"], out["halo"], capacity)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def join_in_prompt_order(out: dict, layout: CacheLayout, halo_rank: int, capacity: int):
  """Every rank's K,V part [p, L_full, 2, B*P, K, H] (P = layout.part_len rows) in prompt
  order (`CacheLayout.rows_in_prompt_order`), padded to `capacity` positions; the final
  linear state (the last rank's: every peer's is the same) and the halo of `halo_rank`."""
  count_trace("hybrid-join")
  parts = unfold_batch(out["kv"], layout.part_len)  # [p, L, 2, B, P, K, H]
  ranked = jnp.concatenate(list(parts), axis=3)  # rank 0's rows, then rank 1's, ...
  kv = jnp.take(ranked, jnp.asarray(layout.rows_in_prompt_order()), axis=3)
  return _padded(kv, out["state"][-1], out["halo"][halo_rank], capacity)


def _padded(kv_L2BTKH, state, halo, capacity: int) -> HybridCache:
  pad = [(0, 0)] * 3 + [(0, capacity - kv_L2BTKH.shape[3])] + [(0, 0)] * 2
  return HybridCache(jnp.pad(kv_L2BTKH, pad), LinearState(state, halo))


# A hybrid cache split over a model group by head: K,V [L, 2, B, S, K, H] by KV head, the
# states [L, B, h, k, v] by (value) head, the halos [L, B, w, C] by channel (each device's q, k,
# v heads' channels in turn). On the heads' axes, not a leading [m] axis: with one, XLA:CPU's
# analysis showed a copy of the whole cache in every decode step (161.7 MiB of temporaries
# against 65.7 for bench-qwen3.5's 128 MiB per device at 64k on 1 x 2).
CACHE_SPECS = HybridCache(
  split_dims("L2BSKH", K=MODEL_AXIS),
  LinearState(split_dims("LBhkv", h=MODEL_AXIS), split_dims("LBwC", C=MODEL_AXIS)),
)


def one_device_layout(config, cache: HybridCache, m: int) -> HybridCache:
  """A cache split over a model group of m (`CACHE_SPECS`) in one device's layout, as the
  model's own forward makes it: each KV head once (a group with more devices than KV heads
  holds each repeated), and the halo's channels in q, k, v order (the group's are in device
  order, each device's q, k, v heads' channels in turn). The states are in head order already."""
  kv = cache.kv_2BSKH
  kv = kv[:, :, :, :, :: kv.shape[4] // config.num_kv_heads]
  qk = config.linear_num_key_heads * config.linear_key_head_dim // m  # one device's q (or k)
  blocks = [jnp.split(b, [qk, 2 * qk], axis=-1) for b in jnp.split(cache.linear.halo_BwC, m, -1)]
  halo = jnp.concatenate([block[part] for part in range(3) for block in blocks], axis=-1)
  return HybridCache(kv, LinearState(cache.linear.state_Bhkv, halo))


CACHES = ("last", "sharded")


@kept_cache(8)
def hybrid_sharded_step(graphdef, mesh, layout: CacheLayout):
  """f(state, tokens_B, prompt_lens_B, parts [p, L_full, 2, B*P, K, H], tail [L_full, 2, B,
  M, K, H], linear (LinearState, replicated), tail_index) -> (logits [B, V], tail, linear):
  one token per row at position prompt_lens_B[b] + tail_index from cache="sharded"
  (`sharded_decode.sharded_step_program`). A full layer: every rank attends the token's
  query to its own part where it lies (`sharded_decode.part_attention`, rank r's runs
  `layout.segments[r]`), the last rank also to the decoded tokens' tail (this token's K,V
  written there at `tail_index`), and the partials merge across the ranks (one collective
  per layer), as K,V models' sharded decode does. A linear layer: its recurrent step on
  every rank alike, on the replicated state and halo. The tail and linear pasts are
  donated. On a ("ranks", "model") mesh each rank's group splits heads, key heads and
  experts (its shards' sums over "model"), the parts, tail and linear pasts split by head as
  the prefill split them."""

  def on_full(block, at, carry):
    x_B1D, (tail_L2BMKH, linear), step = carry
    i = at.row  # the layer's row in its kind's stack
    qkv = block.project_qkv(x_B1D, step.positions_B[:, None])
    part_2BPKH = unfold_batch(step.inputs[0][0, i], layout.part_len)
    attn_B1NH, tail_L2BMKH = sharded_decode.attend_parts_and_tail(
      qkv, part_2BPKH, tail_L2BMKH, i, layout, step.positions_B, step.prompt_lens_B,
      step.tail_index, None,
    )  # fmt: skip
    return block.finish(x_B1D, attn_B1NH, reduce=step.reduce), (tail_L2BMKH, linear)

  def on_linear(block, at, carry):
    x_B1D, (tail_L2BMKH, linear), step = carry
    i = at.row  # the layer's row in its kind's stack
    x_B1D, past = block.step(x_B1D, jax.tree.map(lambda s: s[i], linear), step.reduce)
    stacked = jax.tree.map(lambda s, new: s.at[i].set(new.astype(s.dtype)), linear, past)
    return x_B1D, (tail_L2BMKH, LinearState(*stacked))

  by_layer_kind = by_kind(on_full, on_linear)

  def layer(block, at, x_B1D, caches, step):
    return by_layer_kind(block, at, (x_B1D, caches, step))[0]

  tail_spec = sharded_decode.tail_sharding(mesh).spec  # by KV head on a 2-D mesh, as the parts
  specs = ((parts_spec(mesh),), (tail_spec, _linear_specs(mesh)))
  return sharded_decode.sharded_step_program(graphdef, mesh, layer, *specs)


def one_rank_hybrid_parts(cache: HybridCache, T: int, mesh) -> dict:
  """A one-rank prefill's hybrid cache as cache="sharded" holds it: the full layers' K,V as
  the rank's part [1, L, 2, B*T, K, H] (rows folded by batch), the linear pasts as they are."""
  L, _, B, _, K, H = cache.kv_2BSKH.shape
  parts = NamedSharding(mesh, parts_spec(mesh))  # by KV head on a 2-D mesh, as the cache
  fold = jax.jit(
    lambda kv: jnp.reshape(kv[:, :, :, :T], (1, L, 2, B * T, K, H), out_sharding=parts),
    out_shardings=parts,
  )
  layout = CacheLayout(context_len=T, part_len=T, segments=(((0, T, 0),),))
  linear = jax.device_put(cache.linear, placements(mesh, _linear_specs(mesh)))
  return dict(parts=fold(cache.kv_2BSKH), cache_layout=layout, linear_state=linear)


def _linear_specs(mesh):
  return CACHE_SPECS.linear if model_parallel(mesh) > 1 else LinearState(jax.P(), jax.P())


def sharded_hybrid_decode(model, result, max_new_tokens: int):
  """cache="sharded"'s step of a hybrid (`hybrid_sharded_step`), the full layers' parts as
  its input (they stay put), and its caches: the decoded tokens' K,V in a tail on every rank
  and a copy of the linear pasts on every rank (split by head on a 2-D mesh)."""
  mesh = result.mesh
  program = hybrid_sharded_step(model.graphdef, mesh, result.cache_layout)
  L, _, rows, K, H = result.past.parts.shape[1:]
  B = rows // result.cache_layout.part_len
  tail_sharding = sharded_decode.tail_sharding(mesh)
  tail = decode.zeros_on((L, 2, B, max_new_tokens, K, H), model.dtype, tail_sharding)
  return program, (result.past.parts,), (tail, steppers.copied(result.past.linear_state))


def after_hybrid_step(result, caches) -> dict:
  """What the sharded step of each padded row's last real token (at `result.lengths`, the
  prefill stopped before it) leaves for decoding: the linear pasts after it, and the token's
  K,V (the tail's first entry) written into the part that holds its position, in place of
  the prefill's, which came from the linear layers stopped before it."""
  tail_L2BMKH, linear = caches
  layout, mesh = result.cache_layout, result.mesh
  p, B = layout.num_ranks, len(result.lengths)
  beyond = B * layout.part_len  # a row index no part has: that rank writes nothing
  rows_pB = np.full((p, B), beyond, np.int32)
  for b, position in enumerate(np.asarray(result.lengths)):
    rank, row = layout.holder(int(position))
    rows_pB[rank, b] = b * layout.part_len + row  # the parts fold the batch into their rows
  rows_pB = global_array(rows_pB, NamedSharding(mesh, jax.P(AXIS)))
  return dict(
    parts=_written_into_parts(mesh)(result.past.parts, tail_L2BMKH, rows_pB), linear_state=linear
  )


@kept_cache(8)
def _written_into_parts(mesh):
  """(parts [p, L, 2, B*P, K, H], tail [L, 2, B, M, K, H], rows [p, B]) -> the parts with
  the tail's first entry of row b at rank r's row rows[r, b] (past the part: not written)."""

  def write(parts_1L2RKH, tail_L2BMKH, rows_1B):
    new_L2BKH = tail_L2BMKH[:, :, :, 0].astype(parts_1L2RKH.dtype)
    return parts_1L2RKH[0].at[:, :, rows_1B[0]].set(new_L2BKH, mode="drop")[None]

  # The tail lies as the parts do: whole, or by KV head on a 2-D mesh.
  specs = (parts_spec(mesh), sharded_decode.tail_sharding(mesh).spec, jax.P(AXIS))
  return jax.jit(jax.shard_map(write, mesh=mesh, in_specs=specs, out_specs=parts_spec(mesh)))


@functools.partial(jax.jit, static_argnums=1)
def grown(cache: HybridCache, capacity: int) -> HybridCache:
  """The cache with room for `capacity` positions, a fresh buffer: K,V [L_full, 2, B, S, K, H]
  grow along S; a linear layer's state and halo do not grow."""
  return cache._replace(
    kv_2BSKH=padded_positions(cache.kv_2BSKH, 3, capacity),
    linear=jax.tree.map(jnp.copy, cache.linear),
  )


FORM = ModelCacheForm(
  name="hybrid",
  runs=runs_hybrid,
  caches=CACHES,
  group_cache_spec=CACHE_SPECS,
  operands=operands,
  left_in_parts=left_in_parts,
  joined_from_last_hop=joined_from_last_hop,
  joined_from_parts=joined_from_parts,
  grown=grown,
  one_device_layout=one_device_layout,
  prompt_part=lambda cache, T: cache._replace(kv_2BSKH=cache.kv_2BSKH[:, :, :, :T]),
  sharded_decode=sharded_hybrid_decode,
  one_rank_parts=one_rank_hybrid_parts,
  also_kinds=(FULL_ATTENTION,),
  splits_per_kind=True,
  stops_at_row_ends=True,
  check_split=check_split,
  after_sharded_step=after_hybrid_step,
)
