"""Hybrid models (Qwen3.5: Gated DeltaNet linear layers among softmax ones) under KV-Runahead
and the peers: the full layers run the strategy's own rank layer (its `RankBody.layer`, as on
every model); a linear layer passes a state, contiguous chunks by a chain, zigzag chunks by an
all-gather.

Every rank runs each of its spans (a KV-Runahead chunk, or a peer's two zigzag chunks) of a
linear layer before the state entering it is known: models.gated_deltanet's entry map gives
its outputs as o_0 + Q_eff S and its leaving state as A S + B. Then:

  kvr         hop k sends rank k's leaving state and its last w input rows (the halo) to
              rank k+1: one [B, h, k, v] float32 state and [B, w, C], whatever the prompt
              length. Each rank runs its chunk but the first w rows ahead; the receiver
              runs those w rows from the state and halo (their convolution needs the
              halo), then applies its map (a small matmul) before it forwards: the chain's
              serial work. Rank 0 enters with zeros and runs the plain chunked form. The
              halo rides the chain rather than a hop of its own at the layer's start,
              where each rank would wait for its successor to reach the layer (a
              collective-permute is a rendezvous on gloo). The layer runs in the body the
              full layers run (`by_kind.program_body`), per rank or as one body whose every rank,
              rank 0 too, runs the entry-map form at the split's padded width
              (strategies.linear_chain).
  ring, allgather
              one all-gather of every chunk's map (A and B), then every rank composes the maps
              of the chunks before each of its own (2p small matmuls): the state pass MaxText
              and SGLang use for delta-rule layers. Why not a chain over the zigzag chunks: it
              would visit every rank twice, in the order 0..p-1, p-1..0, serialising 2p hops.

The peers' convolution halos (the last w = W - 1 inputs of the span before) travel point to
point in one collective-permute per direction (every span holds at least w tokens; refused
otherwise). Rows past a span's real length are padding: g = beta = 0
leaves the state as it is (exact), and their outputs are dropped.

KV-Runahead's full layers may take their own split (`by_kind.compile_by_kind(full_chunks=)`,
`kind_program.KindSplit`): a full layer's causal attention wants the earlier ranks' chunks longer, a
linear layer's work is even per token, and where each hop is a rendezvous every layer runs
at its slower rank's pace. The hidden states then move into the full split at each full
layer's start and back at its end (each rank's edge rows to its neighbour, D numbers a
token); the tokens, the linear layers and the logits keep `chunks`.

This module is the linear layers' part in the one builder (strategies.by_kind: `PROGRAM`); the
program outputs each rank's full layers' K,V as the strategy emits them ("kv") and each linear
layer's leaving state and halo; `kvr_jax.inference.hybrid` joins them into the model's
`HybridCache` on the last rank (KV-Runahead: its last hop and own chunk, no move; the peers:
their parts moved and reordered).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, model_parallel, split_dims
from kvr_jax.strategies import REGISTRY, registered_record, zigzag
from kvr_jax.strategies.base import Strategy
from kvr_jax.strategies.kind_program import KindPart, KindProgram, ProgramArgs, RankContext
from kvr_jax.strategies.linear_chain import (
  chain_linear_layer,
  chain_linear_layer_one_body,
  halo_at_row_ends,
  plain_maps,
  stop_at_row_ends,
)
from kvr_jax.strategies.probe import mark
from models import gated_deltanet as gdn
from models.base import no_reduce


def runs_hybrid(spec: Strategy) -> bool:
  """Its linear layers' state crosses the ranks: down KV-Runahead's chain
  (`Strategy.prefix_chain`), or from every zigzag chunk's map gathered by the peers
  (`Strategy.zigzag_chunks`); its full layers run its own rank body. TSP's even chunks
  have no linear layer of their own (it is the paper's K,V baseline); "single" runs every
  model as its own forward (`CacheForm.runs`)."""
  return spec.prefix_chain or spec.zigzag_chunks


# The registered strategies whose programs run hybrids: read from the records, not listed.
STRATEGIES = tuple(name for name, spec in REGISTRY.items() if runs_hybrid(spec))


def _span_maps(block, mixed_BcC, halo_BwC, g_Bch, beta_Bch, real_rows, from_zeros):
  """One span's convolution and entry map: (Q_eff-and-all maps, its last w real inputs).
  from_zeros (traced bool): the span enters with a zero state (the prompt's first), so it
  runs the plain chunked form."""
  c = mixed_BcC.shape[1]
  conv_BcC, _ = gdn.causal_conv(mixed_BcC, block.conv_kernel(), halo_BwC)
  real_c = jnp.arange(c) < real_rows
  g_Bch, beta_Bch = (jnp.where(real_c[:, None], x, 0) for x in (g_Bch, beta_Bch))
  q, k, v, g = block.heads(conv_BcC, g_Bch)
  maps = jax.lax.cond(
    from_zeros, plain_maps, lambda ops: gdn.chunked_with_entry_map(*ops), (q, k, v, g, beta_Bch)
  )
  w = halo_BwC.shape[1]
  return maps, jax.lax.dynamic_slice_in_dim(mixed_BcC, real_rows - w, w, axis=1)


def zigzag_linear_layer(
  block,
  x_B2cD,
  rank,
  context_len: int,
  num_ranks: int,
  reduce=no_reduce,
  probe=lambda label, v: v,
  real_B2c=None,
):
  """A peer's linear layer on rank `rank`'s two zigzag chunks r and 2p-1-r (module
  docstring): (x [B, 2c, D], the prompt's final state [B, h, k, v] (the same on every rank),
  the last w real inputs of the prompt's last chunk [B, w, C] (rank 0 holds it)).
  probe(label, value) -> value: the timeline's mark at "linear" (the spans' maps made),
  "allgather" (every chunk's map here) and "rest" (the layer's output). real_B2c: the rows
  before each row's end (`linear_chain.stop_at_row_ends`; None: every row)."""
  p, c = num_ranks, zigzag.chunk_len(context_len, num_ranks)
  mixed, z_B2chv, g, beta = block.inputs(x_B2cD)
  g, beta = stop_at_row_ends(g, beta, real_B2c)
  w = block.conv_q.shape[0] - 1
  halves = [slice(0, c), slice(c, 2 * c)]
  chunk_ids = (rank, 2 * p - 1 - rank)
  reals = [jnp.clip(context_len - j * c, 0, c) for j in chunk_ids]
  tails = [mixed[:, s][:, c - w :] for s in halves]  # every chunk but the last is whole
  # Chunk r's halo is chunk r-1's tail (rank r-1's first half); chunk 2p-1-r's is chunk
  # 2p-2-r's (rank r+1's second half), rank p-1's second chunk (p) takes its own first's.
  first_halo = jax.lax.ppermute(tails[0], AXIS, perm=[(i, i + 1) for i in range(p - 1)])
  second_halo = jax.lax.ppermute(tails[1], AXIS, perm=[(i + 1, i) for i in range(p - 1)])
  second_halo = jnp.where(rank == p - 1, tails[0], second_halo)
  spans = [
    _span_maps(block, mixed[:, s], halo, g[:, s], beta[:, s], real, chunk == 0)
    for s, halo, real, chunk in zip(
      halves, (first_halo, second_halo), reals, chunk_ids, strict=True
    )
  ]
  spans = probe("linear", spans)
  A_2Bhkk = jnp.stack([m[2] for m, _ in spans])
  B_2Bhkv = jnp.stack([m[3] for m, _ in spans])
  # Every chunk's map on every rank: [p, 2, ...] -> chunk order (rank r's halves are r and
  # 2p-1-r), then the states entering each chunk by composing them in order.
  A_all, B_all = probe(
    "allgather", (jax.lax.all_gather(A_2Bhkk, AXIS), jax.lax.all_gather(B_2Bhkv, AXIS))
  )
  order = [(j, 0) if j < p else (2 * p - 1 - j, 1) for j in range(2 * p)]
  entering = [jnp.zeros_like(B_2Bhkv[0])]
  for r, half in order:
    entering.append(jnp.einsum("Bhkj,Bhjv->Bhkv", A_all[r, half], entering[-1]) + B_all[r, half])
  entering_j = jnp.stack(entering)  # [2p + 1, ...]: entering[j] enters chunk j
  outs = []
  for (maps, _), chunk in zip(spans, chunk_ids, strict=True):
    o_Bchv, _ = gdn.apply_entry_state(*maps, entering_j[chunk])
    outs.append(o_Bchv)
  x_B2cD = block.output(x_B2cD, jnp.concatenate(outs, axis=1), z_B2chv, reduce)
  return probe("rest", x_B2cD), entering_j[-1], spans[1][1]


def _linear_layer(spec: Strategy, rank, chunks, reduce, timeline: bool, one_body, from_end_Bc):
  """(block, x, l) -> the strategy's linear layer (model layer l: the timeline's label) on
  this rank. one_body (KV-Runahead in the one body): (its shape, each rank's length [p] as
  data); its row loops take the shape's block, the full layers' own. from_end_Bc (rows
  padded past their ends): each held row's position minus its row's end; the state stops
  at each row's end and the halo is the last w inputs before it (`halo_at_row_ends`)."""
  real_Bc = None if from_end_Bc is None else from_end_Bc < 0

  def linear_layer(block, x, l=0):
    def probe(label, value):
      return mark(timeline, label, l, value)

    if spec.prefix_chain and one_body is not None:
      shape, lengths_p = one_body
      x_out, leaving, halo = chain_linear_layer_one_body(
        block, x, rank, lengths_p[rank], shape.num_ranks, reduce, probe, shape.block, real_Bc
      )
    elif spec.prefix_chain:
      x_out, leaving, halo = chain_linear_layer(block, x, rank, chunks, reduce, probe, real_Bc)
    else:  # the zigzag peers (`runs_hybrid`)
      x_out, leaving, halo = zigzag_linear_layer(
        block, x, rank, sum(chunks), len(chunks), reduce, probe, real_Bc
      )
    if from_end_Bc is not None:
      halo = halo_at_row_ends(block, x, from_end_Bc, halo.shape[1]).astype(halo.dtype)
    return x_out, leaving, halo

  return linear_layer


def check_runs_hybrid(strategy: str | Strategy) -> None:
  """Refuses a strategy (a name or a record) whose programs run no hybrid model
  (`runs_hybrid`, asked of its registered record)."""
  shown = strategy.name if isinstance(strategy, Strategy) else strategy
  record = registered_record(strategy)
  if record is None or not runs_hybrid(record):
    raise ValueError(f"hybrid models run under {STRATEGIES}, not {shown!r}")


def linear_part(args: ProgramArgs, ctx: RankContext, kind) -> KindPart:
  """A Gated DeltaNet layer's part in a rank's program (strategies.by_kind): the strategy's
  linear layer (KV-Runahead's chain in its body, or the peers' all-gathered maps), its
  outputs {"state": the layer's leaving state [B, h, k, v], "halo": the last w inputs
  [B, w, C]} (at each row's end where rows are padded past them)."""
  del kind
  layer = _linear_layer(
    args.spec, ctx.rank, args.chunks, ctx.reduce, args.timeline, ctx.one_body, ctx.from_end_BT
  )

  def part_layer(block, x, carry, at):
    x, leaving, halo = layer(block, x, at.index)
    return x, carry, {"state": leaving, "halo": halo}

  return KindPart(part_layer, ctx.model.linear_blocks)


def output_specs(mesh, args=None) -> dict:
  """A linear layer's outputs by rank, their heads over "model" on a 2-D mesh: the states
  [p, L, B, h, k, v] and halos [p, L, B, w, C] (a shard's value heads' states, its q, k, v
  heads' convolution channels: a halo's channels are in shard order)."""
  del args
  P = jax.P
  if model_parallel(mesh) == 1:
    return {"state": P(AXIS), "halo": P(AXIS)}
  return {
    "state": split_dims("pLBhkv", p=AXIS, h=MODEL_AXIS),
    "halo": split_dims("pLBwC", p=AXIS, C=MODEL_AXIS),
  }


# Gated DeltaNet layers in the one builder (strategies.by_kind.KIND_PROGRAMS).
PROGRAM = KindProgram(check_runs_hybrid, linear_part, output_specs, "hybrid")
