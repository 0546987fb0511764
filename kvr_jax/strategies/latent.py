"""Latent-attention models (DeepSeek-V3: models/latent_attention.py) under KV-Runahead and
all-gather CP. What travels is the latent, one headless C-wide entry per token (DeepSeek-V3:
512 + 64 numbers against 128 heads x (192 + 128) of K and V: 71x less); every rank expands
what it holds into its heads' keys and values with kv_b_proj and attends as multi-head
attention.

  kvr         contiguous uneven chunks; hop k sends the latent prefix [0, S_k) from rank k to
              rank k+1 (`runahead.hops.hop_chain` on the latents laid out as a one-head K,V
              message [1, B, S, 1, C]: the same chain, buffers and last hop as on K,V). Rank i
              expands its received prefix and its own chunk (S_i positions) and attends its
              c_i queries: its expansion costs S_i x R x N (n + v) FLOPs, which the search's
              split weighs like its attention.
  allgather   the zigzag layout; one all-gather of every rank's latents, then every rank
              expands the whole prompt and attends its two chunks (what the engines' MLA
              context parallelism does).
  ring        the zigzag layout; each rank's latents passed around the ring, every step's
              received chunks expanded and attended as ring attention attends K,V.
  tsp         the paper's baseline: even contiguous chunks, one all-gather of the latents,
              every rank expands the whole prompt and computes dense masked scores.

The peers' rank layers live with their strategies (allgather.latent_layer, ring.latent_layer,
tsp.latent_layer: each record's `KindLayers.rank_layer` for LatentAttentionKind); this module
is the latent layers' part in the one builder (strategies.by_kind: `PROGRAM`), the peers'
layers and KV-Runahead's chain.

The program outputs each rank's own latents per layer (and, for KV-Runahead, the last hop's
message, so the last rank holds every position without a move); `kvr_jax.inference.latent`
joins them into the model's latent cache on the last rank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies import REGISTRY, registered_record
from kvr_jax.strategies.base import Strategy, gather_to_owner, owner_last_row
from kvr_jax.strategies.kind_program import KindPart, KindProgram, ProgramArgs, RankContext
from kvr_jax.strategies.probe import mark
from kvr_jax.strategies.runahead.bodies import one_body_layer
from kvr_jax.strategies.runahead.rank_layer import RankLayer
from kvr_jax.strategies.runahead.schedule import OneBodyShape, attends_diagonal_first
from models.base import no_reduce
from models.kernels import get_kernel
from models.layer_kinds import LatentAttentionKind


def runs_latent(spec: Strategy) -> bool:
  """Its program runs latent layers: KV-Runahead's chain carries the latents as K,V, a peer
  lends its rank layer for them (`KindLayers.rank_layer`)."""
  lent = spec.kind_layers.get(LatentAttentionKind)
  return spec.prefix_chain or (lent is not None and lent.rank_layer is not None)


# The registered strategies whose programs run latent layers, read from their records.
STRATEGIES = tuple(name for name, spec in REGISTRY.items() if runs_latent(spec))


def _project(block, x_BTD, positions_BT):
  """(no-rope queries, rope queries, latents [B, T, C]) of rows at `positions_BT`."""
  h_BTD = block.attention_input(x_BTD)
  q_nope, q_rope = block.queries(h_BTD, positions_BT)
  return q_nope, q_rope, block.latents(h_BTD, positions_BT)


def _finish(block, x_BTD, attn_BTNv, reduce):
  return block.finish(x_BTD, attn_BTNv, reduce=reduce)


def local_heads(model) -> int:
  """The query heads this shard's weights hold (all N on a 1-D mesh, N/m in a model group)."""
  stack = model.blocks if model.blocks is not None else model.dense_blocks
  return stack.wk_b[...].shape[2]


def kvr_latent_rank(
  model,
  rank,
  chunks: tuple[int, ...] | None,
  attention,
  reduce=no_reduce,
  timeline: bool = False,
  body: str = "per-rank",
  split_table=None,
):
  """KV-Runahead's rank layer (`runahead.rank_layer`) on latent layers, in its per-rank body
  (static lengths) or its one body (`body="one"`, lengths as data: `bodies.one_body_layer`,
  rows padded to its blocks), as on K,V layers: its cache entries are the latents, one
  headless [1, C] per position (`LatentAttention.project_entries`), which the hops carry as
  they carry K,V; with a kernel that returns its log-sum-exp (flash) each rank i > 0 attends
  its first rows' own latents (expanded) before its hop lands (`attend_entries_partial`,
  merged by lse); the last hop kept (the last rank holds every position without a move).
  reduce: a model group's sum (its heads and experts split; every shard of a rank computes,
  sends and receives the same whole latent). timeline: the rank layer marks its phases as on
  K,V layers (strategies.probe). split_table: (an envelope `OneBodyShape`, its table [3, p],
  the program's operand): the one body with the split as data, chunks None, no last hop
  kept (its size is data)."""
  heads = dict(
    dtype=model.dtype, q_heads=local_heads(model), entry_shape=(1, 1, model.config.cache_width)
  )
  kernel = get_kernel(attention)
  if split_table is not None:
    shape, table = split_table
    return one_body_layer(model.config, rank, reduce, shape, kernel, False, False, table, **heads)
  if body == "one":  # a plan runs it on 2 or more ranks: the last hop holds the cache
    shape = OneBodyShape.of_split(model.config, chunks, kernel)
    table = shape.table(model.config, chunks)
    return one_body_layer(
      model.config, rank, reduce, shape, kernel, timeline, True, table, chunks, **heads
    )
  return RankLayer.at_static_lengths(
    chunks,
    attention,
    model.config,
    rank,
    reduce,
    diagonal_first=attends_diagonal_first(attention, len(chunks)),
    timeline=timeline,
    keep_last_hop=True,
    **heads,
  )


def peer_last_layer(spec: Strategy, block, x_BTD, rank, chunks: tuple[int, ...], reduce, probe):
  """A peer's (ring, all-gather, TSP) part of the model's last layer on latents, where only
  the prompt's last row is read: every rank's latents gathered in prompt order on the owner
  of the last position (`strategies.base.gather_to_owner`), which attends that row and
  finishes it (`strategies.base.owner_last_row`): (x, its own latents [B, T, C]). probe:
  the marks of a peer's last K,V layer ("qkv", "gather", "rest")."""
  p, context_len = len(chunks), sum(chunks)
  B, T = x_BTD.shape[:2]
  # Each row's prompt position in the strategy's layout (-1: padding, never read: only the
  # prompt's rows are gathered, and only its last row's query attends).
  layout = spec.cache_layout(context_len, chunks)
  positions_BT = jnp.broadcast_to(jnp.asarray(layout.positions())[rank], (B, T))
  queries, own_1BT1C = probe("qkv", block.project_entries(x_BTD, positions_BT))
  owner, row = layout.holder(context_len - 1)
  every_1BS1C = gather_to_owner(own_1BT1C, owner, p, axis=2)  # only the owner reads them
  every_1BS1C = probe("gather", every_1BS1C)
  prompt_1BS1C = jnp.take(every_1BS1C, jnp.asarray(layout.rows_in_prompt_order()), axis=2)
  at = (owner, row, context_len - 1)
  x_BTD = owner_last_row(block, x_BTD, queries, prompt_1BS1C, rank, at, reduce)
  return probe("rest", x_BTD), own_1BT1C[0, :, :, 0]


def check_runs_latent(strategy: str | Strategy) -> None:
  """Refuses a strategy (a name or a record) whose programs run no latent model
  (`runs_latent`, asked of its registered record). Probes: every record that places them
  places them on latent layers too (KV-Runahead's rank layer marks them as K,V layers; the
  peers' latent layers mark the phases their K,V layers mark)."""
  shown = strategy.name if isinstance(strategy, Strategy) else strategy
  record = registered_record(strategy)
  if record is None or not runs_latent(record):
    raise ValueError(f"latent-attention models run under {STRATEGIES}, not {shown!r}")


def _peer_layer(spec, block, x_BTD, l, last, rank, chunks, attention, reduce, timeline):
  """A peer's latent layer l: its every-row layer (its record's `KindLayers.rank_layer`:
  allgather.latent_layer, ring.latent_layer, tsp.latent_layer), or where `last` (traced:
  the model's last layer) its part in the prompt's last row alone (`peer_last_layer`): (x,
  its own latents); marked for the timeline where `timeline`."""

  def probe(label, value):
    return mark(timeline, label, l, value)

  def every_row(x_BTD):
    layer = spec.layers_of_kind(block.config.kind).rank_layer
    return layer(block, x_BTD, rank, sum(chunks), len(chunks), attention, reduce, probe)

  def last_row(x_BTD):
    return peer_last_layer(spec, block, x_BTD, rank, chunks, reduce, probe)

  return jax.lax.cond(last, last_row, every_row, x_BTD)


def latent_part(args: ProgramArgs, ctx: RankContext, kind) -> KindPart:
  """A latent layer's part in a rank's program (strategies.by_kind): KV-Runahead's rank layer
  with the latents as its entries (`kvr_latent_rank`: the chain in its body, or the split as
  data's one body) or a peer's latent layer (`_peer_layer`); every layer outputs {"own": its
  rows' latents [B, T_rank, C], and KV-Runahead's "last", the last hop's message [B, S, C],
  where the last hop is kept}."""
  del kind
  spec, model, rank, chunks = args.spec, ctx.model, ctx.rank, args.chunks
  cfg, B = model.config, ctx.tokens_BT.shape[0]
  stack = model.layer_stacks()[0].blocks
  if not spec.prefix_chain:

    def peer_layer(block, x_BTD, carry, at):
      last = at.index == cfg.num_layers - 1
      x_BTD, own = _peer_layer(
        spec, block, x_BTD, at.index, last, rank, chunks, args.kernel, ctx.reduce, args.timeline
      )
      return x_BTD, carry, {"own": own}

    return KindPart(peer_layer, stack)
  split_table = None if args.split_shape is None else (args.split_shape, ctx.table[0])
  ranks = kvr_latent_rank(
    model, rank, chunks, args.kernel, ctx.reduce, args.timeline, args.body, split_table
  )
  keep_last = _keeps_last(args)

  def chain_layer(block, x_BTD, carry, at):
    x_BTD, carry, emitted = ranks.layer(block, x_BTD, carry, at)  # (its own part, last hop)
    out = {"own": emitted[0].reshape(B, -1, cfg.cache_width)}
    if keep_last:
      out["last"] = emitted[1].reshape(B, -1, cfg.cache_width)
    return x_BTD, carry, out

  return KindPart(chain_layer, stack, ranks.empty_buffer(B))


def _keeps_last(args: ProgramArgs) -> bool:
  """KV-Runahead's latent program outputs its last hop (what cache="last" joins on the last
  rank) where the plan keeps it; without it no rank writes out a prefix-long buffer per
  layer, which at 1M tokens is the size of the whole latent cache on every device."""
  return args.spec.prefix_chain and args.keep_last_hop and args.split_shape is None


def output_specs(mesh, args: ProgramArgs) -> dict:
  """The latents are whole on every shard of a rank: every output lies by rank alone."""
  del mesh
  return {"own": jax.P(AXIS), "last": jax.P(AXIS)} if _keeps_last(args) else {"own": jax.P(AXIS)}


# Latent layers in the one builder (strategies.by_kind.KIND_PROGRAMS).
PROGRAM = KindProgram(check_runs_latent, latent_part, output_specs, "latent")
