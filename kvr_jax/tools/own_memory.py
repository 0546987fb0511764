"""compiled_memory's figures of the models with their own pasts, past their prefill program's
(which kvr_jax.tools.memory lowers from the plan for every model): latent attention
(DeepSeek-V3: a latent per position) and hybrids (Qwen3.5, Qwen3-Next: full layers' K,V and
linear layers' states): each one's cache bytes, cache="last"'s move onto the last rank and the
decode step generate runs after it."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.inference import hybrid as hybrid_inference
from kvr_jax.inference import latent
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.cache_layout import parts_spec
from kvr_jax.runtime.mesh import AXIS, rank_device, rank_row_mesh
from kvr_jax.strategies import by_kind, hybrid
from kvr_jax.tools.xla_memory import (
  analysis,
  compile_for_figures,
  decode_bytes,
  last_rank_step,
  sharded_step,
  struct,
)
from models.qwen3_5 import HybridCache, LinearState


def latent_figures(config, plan, lowered, shape, dtype_name, model) -> dict:
  """compiled_memory's figures of a latent-attention model (DeepSeek-V3) past its prefill
  program's (`lowered`: the plan's program, strategies.by_kind.compile_by_kind, lowered from
  shapes): its latent cache (one headless C-wide entry per token and layer: whole on every
  device of a model group, whatever m), cache="last"'s move (`latent_move`), and with
  decode_tokens the step kvr_jax.generate runs for it: cache="last" on the last rank's group
  over the joined cache grown by them, cache="sharded" on every device over its part and the
  decoded tokens' latents. model: (graphdef, abstract state, its placed shapes)."""
  context_len, num_ranks, batch, m, decode_tokens = shape
  graphdef, state, state_shapes = model
  mesh, chunks, cache = plan.mesh, plan.chunks, plan.cache
  itemsize = np.dtype(dtype_name).itemsize
  L, C = config.num_layers, config.cache_width
  result = {"latent_cache_bytes": L * batch * context_len * C * itemsize}
  if cache == "last":
    last_device = rank_device(mesh, num_ranks - 1)
    parts = {name: (out.shape[1:], out.dtype) for name, out in lowered.out_info[1].items()}
    joins = "last" in parts  # KV-Runahead's program kept its last hop
    result.update(latent_move(parts, joins, chunks, context_len + decode_tokens, last_device))
  if not decode_tokens:
    return result
  dtype = np.dtype(dtype_name)
  if cache == "last":  # the latent cache whole on every device of the group
    grown = jax.ShapeDtypeStruct((L, batch, context_len + decode_tokens, C), dtype)
    lowered = last_rank_step(config, plan.mesh, model, batch, grown, jax.P(), itemsize)
  else:
    rows = lowered.out_info[1]["own"].shape[3]
    by_rank, replicated = NamedSharding(mesh, jax.P(AXIS)), NamedSharding(mesh, jax.P())
    inputs = (
      struct((num_ranks, L, batch, rows, C), dtype, by_rank),  # the parts
      struct((num_ranks, rows), np.int32, by_rank),  # their rows' prompt positions
    )
    tail = struct((L, batch, decode_tokens, C), dtype, replicated)
    step = latent.latent_sharded_step(graphdef, mesh)
    lowered = sharded_step(step, state_shapes, mesh, batch, inputs, (tail,))
  stats = compile_for_figures(lowered, dtype_name).memory_analysis()
  return {**result, **decode_bytes(stats)}


def latent_move(parts: dict, joins: bool, chunks, capacity: int, device) -> dict:
  """What bringing a latent cache onto the last rank needs on its device (`device`), as prefill runs
  it (`latent.FORM`'s joins): KV-Runahead's join of its last hop and its own part where they
  lie (`latent.join_last_hop`), or every rank's part sent there and put in prompt order
  (`latent.join_in_prompt_order`: all p parts on that device at once, beside the cache). parts:
  the program's outputs on one rank, (shape, dtype) each ({"own": [L, B, T_rank, C], "last": [L,
  B, S_{p-2}, C] where kept}). capacity: the cache's positions (the prompt and the decoded tokens'
  room). XLA's `move_argument_bytes` and `move_temp_bytes` of it."""
  on_device = jax.sharding.SingleDeviceSharding(device)
  (own_shape, dtype) = parts["own"]
  if joins:
    last = struct(*parts["last"], on_device)
    own = struct(own_shape, dtype, on_device)
    lowered = latent.join_last_hop.lower(last, own, chunks[-1], capacity)
  else:
    pieces = struct((len(chunks), *own_shape), dtype, on_device)
    rows = struct((sum(chunks),), np.int32, on_device)
    lowered = latent.join_in_prompt_order.lower(pieces, rows, capacity)
  move = analysis(lowered.compile())
  return {"move_argument_bytes": move["argument_bytes"], "move_temp_bytes": move["temp_bytes"]}


def hybrid_move(parts: dict, mesh, joins: bool, split, capacity: int, record) -> dict:
  """What bringing a hybrid cache onto the last rank needs on one device of it, as prefill runs it
  (`hybrid.FORM`'s joins): KV-Runahead's join of its full layers' last hops and own parts and
  its linear states where they lie (`hybrid.join_last_hop`), or every rank's parts sent there,
  stacked, and put in prompt order (`hybrid.join_in_prompt_order`: all p parts at once, beside the
  cache); on a 2-D mesh each device of the last rank's row its heads. parts: the program's outputs
  [p, ...] (`compile_by_kind`'s, shapes). split: (the tokens' chunks, the full layers' K,V parts'
  chunks). capacity: the cache's positions. record: the plan's strategy (its cache layout).
  XLA's `move_argument_bytes` and `move_temp_bytes` of
  it."""
  chunks, full_chunks = split
  p = len(chunks)
  row = rank_row_mesh(mesh, p - 1)
  specs = {**by_kind.attention_specs(mesh), **hybrid.output_specs(mesh)}

  def placed(name, stacked):
    rest = tuple(specs[name])[1:]  # the rank axis dropped, or kept as the stack's, whole
    spec = jax.P(None, *rest) if stacked else jax.P(*rest)
    return lambda x: struct(x.shape if stacked else x.shape[1:], x.dtype, NamedSharding(row, spec))

  on_last = {name: jax.tree.map(placed(name, not joins), part) for name, part in parts.items()}
  if joins:
    lowered = hybrid_inference.join_last_hop.lower(on_last, full_chunks, capacity)
  else:
    layout, halo_rank = hybrid_inference.parts_layout(record, sum(chunks), chunks, full_chunks)
    lowered = hybrid_inference.join_in_prompt_order.lower(on_last, layout, halo_rank, capacity)
  move = analysis(lowered.compile())
  return {"move_argument_bytes": move["argument_bytes"], "move_temp_bytes": move["temp_bytes"]}


def hybrid_figures(config, plan, lowered, shape, dtype_name, model) -> dict:
  """compiled_memory's figures of a hybrid model (Qwen3.5, Qwen3-Next) past its prefill
  program's (`lowered`: the plan's program, strategies.by_kind.compile_by_kind, its weights
  split over "model" on a 2-D mesh): its cache in two parts, one device's share of each:
  `kv_cache_bytes` the full layers' K,V of every position, `state_cache_bytes` the linear
  layers' float32 states and convolution halos, whatever the prompt length; cache="last"'s
  move (`hybrid_move`); with decode_tokens the step generate runs on the last rank's device
  or group over the joined cache grown by them, or over the parts (cache="sharded"). model:
  (graphdef, abstract state, its placed shapes)."""
  context_len, num_ranks, batch, m, decode_tokens = shape
  graphdef, state, state_shapes = model
  spec, mesh, chunks, cache = plan.strategy, plan.mesh, plan.chunks, plan.cache
  full_chunks = plan.full_chunks
  itemsize = np.dtype(dtype_name).itemsize
  past = _hybrid_cache_shapes(config, batch, context_len + decode_tokens, m, dtype_name)
  full_kv, states = (
    int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(part)) // m)
    for part in (past.kv_2BSKH, past.linear)
  )
  layout = spec.cache_layout(context_len, full_chunks or chunks)  # the K,V parts' split
  if cache == "sharded":  # the busiest device's part: the longest part's rows
    full_kv = full_kv * layout.part_len // (context_len + decode_tokens)
  else:  # the prompt's positions (the decoded tokens' counted with the decode step's arguments)
    full_kv = full_kv * context_len // (context_len + decode_tokens)
  result = {"kv_cache_bytes": full_kv, "state_cache_bytes": states}
  if cache == "last":
    joins = plan.keep_last_hop  # KV-Runahead: its last hops, no move
    split = (chunks, full_chunks or chunks)  # the tokens', the K,V parts'
    capacity = context_len + decode_tokens
    result.update(hybrid_move(lowered.out_info[1], mesh, joins, split, capacity, spec))
  if not decode_tokens:
    return result
  if cache == "sharded":
    lowered = _hybrid_sharded_step_lowered(
      config, graphdef, state_shapes, mesh, layout, shape, dtype_name
    )
    stats = compile_for_figures(lowered, dtype_name).memory_analysis()
    return {**result, **decode_bytes(stats)}
  specs = hybrid_inference.CACHE_SPECS  # split by head over the group
  lowered = last_rank_step(config, plan.mesh, model, batch, past, specs, itemsize)
  stats = compile_for_figures(lowered, dtype_name).memory_analysis()
  return {**result, **decode_bytes(stats)}


def _hybrid_sharded_step_lowered(config, graphdef, state_shapes, mesh, layout, shape, dtype_name):
  """hybrid_sharded_step lowered from shapes, as generate(cache="sharded") runs it: the K,V
  parts [p, L, 2, B*P, K, H] by rank, the decoded tokens' tail and the linear pasts on every
  rank (split by head on a 2-D mesh)."""
  context_len, num_ranks, batch, m, decode_tokens = shape
  tail = _hybrid_cache_shapes(config, batch, decode_tokens, m, dtype_name)
  L, _, B, _, K, H = tail.kv_2BSKH.shape
  split = m > 1
  specs = hybrid_inference.CACHE_SPECS if split else jax.tree.map(lambda _: jax.P(), tail)
  tail = jax.tree.map(
    lambda x, spec: struct(x.shape, x.dtype, NamedSharding(mesh, spec)), tail, specs
  )
  parts = struct(
    (num_ranks, L, 2, B * layout.part_len, K, H),
    np.dtype(dtype_name),
    NamedSharding(mesh, parts_spec(mesh)),
  )
  step = hybrid_inference.hybrid_sharded_step(graphdef, mesh, layout)
  return sharded_step(step, state_shapes, mesh, batch, (parts,), (tail.kv_2BSKH, tail.linear))


def _hybrid_cache_shapes(config, batch: int, capacity: int, m: int, dtype_name: str):
  """The HybridCache generate decodes from, as shapes (the whole group's: m devices'
  KV heads, repeated to m where the model has fewer, as the shards hold them)."""
  K = tensor_parallel.kv_heads_per_shard(config, m) * m
  h, d_k = config.linear_num_value_heads, config.linear_key_head_dim
  d_v, w = config.linear_value_head_dim, config.linear_conv_kernel - 1
  L_full, L_linear = (len(config.layers_of(t)) for t in ("full_attention", "linear_attention"))
  dtype = np.dtype(dtype_name)
  return HybridCache(
    jax.ShapeDtypeStruct((L_full, 2, batch, capacity, K, config.head_dim), dtype),
    LinearState(
      jax.ShapeDtypeStruct((L_linear, batch, h, d_k, d_v), np.float32),
      jax.ShapeDtypeStruct((L_linear, batch, w, config.conv_channels), dtype),
    ),
  )
