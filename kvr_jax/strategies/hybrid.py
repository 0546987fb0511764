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
              full layers run (`hybrid_body`), per rank or as one body whose every rank,
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

KV-Runahead's full layers may take their own split (`compile_hybrid(full_chunks=)`,
`KindSplit`): a full layer's causal attention wants the earlier ranks' chunks longer, a
linear layer's work is even per token, and where each hop is a rendezvous every layer runs
at its slower rank's pace. The hidden states then move into the full split at each full
layer's start and back at its end (each rank's edge rows to its neighbour, D numbers a
token); the tokens, the linear layers and the logits keep `chunks`.

The program outputs each rank's full layers' K,V as the strategy emits them and each linear
layer's leaving state and halo; `kvr_jax.inference.hybrid` joins them into the model's
`HybridCache` on the last rank (KV-Runahead: its last hop and own chunk, no move; the peers:
their parts moved and reordered).
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
from flax import nnx

from kvr_jax.core.caches import kept_cache
from kvr_jax.runtime.cache_layout import parts_spec
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, model_parallel, split_dims
from kvr_jax.strategies import REGISTRY, family_builder, registered_record, zigzag
from kvr_jax.strategies.base import (
  RankBody,
  Strategy,
  model_reduce,
  rank_program,
  reshard_rows,
  spmd,
)
from kvr_jax.strategies.linear_chain import (
  chain_linear_layer,
  chain_linear_layer_one_body,
  halo_at_row_ends,
  plain_maps,
  stop_at_row_ends,
)
from kvr_jax.strategies.probe import mark
from kvr_jax.strategies.runahead import check_body, one_body_as_data
from kvr_jax.strategies.runahead.rank_layer import pad_rows
from kvr_jax.strategies.runahead.schedule import OneBodyShape
from models import gated_deltanet as gdn
from models.base import Layer, no_reduce
from models.layer_kinds import FULL_ATTENTION
from models.qwen3_5 import FULL, LINEAR, by_kind


def runs_hybrid(spec: Strategy) -> bool:
  """Its record lends a rank body (`Strategy.rank_body`) for the full layers (how a linear
  layer's state crosses the ranks is `Strategy.prefix_chain`'s)."""
  return spec.rank_body is not None


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
    else:
      x_out, leaving, halo = zigzag_linear_layer(
        block, x, rank, sum(chunks), len(chunks), reduce, probe, real_Bc
      )
    if from_end_Bc is not None:
      halo = halo_at_row_ends(block, x, from_end_Bc, halo.shape[1]).astype(halo.dtype)
    return x_out, leaving, halo

  return linear_layer


def hybrid_body(
  spec: Strategy, kernel, chunks, full_chunks, body: str | None, split_shape=None
) -> str | None:
  """KV-Runahead's program body on a hybrid model, the same for its full and its linear
  layers: `check_body`'s choice (the one body where the kernel takes lengths as data on
  more than PER_RANK_UP_TO ranks) or the one asked for. A split per layer kind runs
  "per-rank": its moves between the two splits are static slices (`KindSplit`). None for the
  peers (their layers are of one body). The split as data (`split_shape`) runs the one body
  and no split per layer kind (its moves' slices are static). Refuses a strategy that runs no
  hybrid, and a split per layer kind or a split as data under a peer."""
  check_runs_hybrid(spec)
  if full_chunks is not None and not spec.prefix_chain:
    raise ValueError(f"a split per layer kind is KV-Runahead's; {spec.name} lays out its own")
  if split_shape is not None and not spec.prefix_chain:
    raise ValueError(f"a split as data is KV-Runahead's; {spec.name} lays out its own")
  if not spec.prefix_chain:
    return None
  if split_shape is not None:
    if full_chunks is not None or body == "per-rank" or chunks is not None:
      raise ValueError(
        "a hybrid's split as data runs KV-Runahead's one body on one split for every kind of "
        "layer, the split its operand (no chunks, no split per layer kind, no per-rank body)"
      )
    return "one"
  if full_chunks is not None and full_chunks != chunks:
    if body == "one":
      raise ValueError("a split per layer kind runs KV-Runahead's per-rank body, not 'one'")
    return "per-rank"
  return check_body(body, kernel, len(chunks))


def check_runs_hybrid(strategy: str | Strategy) -> None:
  """Refuses a strategy (a name or a record) whose programs run no hybrid model
  (`runs_hybrid`, asked of its registered record)."""
  shown = strategy.name if isinstance(strategy, Strategy) else strategy
  record = registered_record(strategy)
  if record is None or not runs_hybrid(record):
    raise ValueError(f"hybrid models run under {STRATEGIES}, not {shown!r}")


@family_builder(check_runs_hybrid)
@kept_cache(16)
def compile_hybrid(
  spec: Strategy,
  graphdef,
  mesh,
  chunks: tuple[int, ...] | None,
  kernel,
  keep_last_hop: bool = True,
  timeline: bool = False,
  full_chunks: tuple[int, ...] | None = None,
  body: str | None = None,
  split_shape: OneBodyShape | None = None,
  padded: bool = False,
):
  """The jitted SPMD program of `spec` (a name of STRATEGIES or a record: KV-Runahead's bring
  their body and split as data, `strategies.family_builder`) on a hybrid model: (state, tokens
  [p, B, T_rank] as the strategy arranges them) -> per rank (logits [p, B, V]: rank p-1's are
  the prompt's last position's, {"full": each full layer's K,V output as the strategy emits
  it [p, L_full, ...], "state": [p, L_linear, B, h, k, v], "halo": [p, L_linear, B, w, C]}).
  On a ("ranks", "model") mesh the state is split over each rank's group
  (runtime.tensor_parallel: heads, key heads with their value heads, experts, MLP columns),
  the shards' partial sums added by psum_over_model, and every output's heads split over
  "model" (`output_specs`: shard j's K,V heads, value heads' states and its q, k, v heads'
  convolution channels, so a halo's channels are in shard order). keep_last_hop=False:
  KV-Runahead's full layers emit its ranks' own parts alone (cache="sharded": the last hop,
  a prefix-long output on the last rank, is not kept). timeline: the program marks its
  phases (strategies.probe; the full layers as the strategy's body marks them, the linear
  layers at "linear", "hop" or "allgather", and "rest"; one-dimensional meshes).
  full_chunks (KV-Runahead): the full layers' own split, `chunks` the linear layers' (and
  the tokens'): the hidden states move between the two at each full layer (`KindSplit`).
  body (KV-Runahead): "one" or "per-rank" for both kinds of layer (`hybrid_body`).
  split_shape (KV-Runahead, chunks None): an envelope (`OneBodyShape.envelope` of the full
  layers' config) whose one program takes the split as data, a third operand
  (`OneBodyShape.table`): one program for every split that fits it, both kinds of layer in
  the one body, the full layers' parts `split_shape.part_len` rows and no last hop kept."""
  body_kind = hybrid_body(spec, kernel, chunks, full_chunks, body, split_shape)
  if split_shape is not None:
    _check_split_as_data(mesh, timeline, keep_last_hop)
    full_body = one_body_as_data(split_shape, kernel)
  else:
    full_chunks = chunks if full_chunks is None else full_chunks
    body_of = spec.rank_body
    if spec.prefix_chain:
      body_of = functools.partial(body_of, body=body_kind)
    keeps = spec.cache_from_last_hop is not None and keep_last_hop
    full_body = body_of(graphdef, full_chunks, kernel, timeline, keeps)
  layers = _HybridLayers(spec, kernel, chunks, full_chunks, timeline, split_shape, body_kind)
  make_body = functools.partial(_hybrid_rank_body, layers, full_body, padded)
  p = mesh.shape[AXIS]
  program = rank_program(
    f"{spec.name}-hybrid", graphdef, make_body, p, timeline, model_reduce(mesh)
  )
  return spmd(program, mesh, (jax.P(AXIS), output_specs(mesh)), split_shape is not None)


@dataclasses.dataclass(frozen=True)
class _HybridLayers:
  """What a hybrid rank's layers are built from (`compile_hybrid`'s checked arguments):
  body_kind is `hybrid_body`'s."""

  spec: Strategy
  kernel: object
  chunks: tuple[int, ...] | None
  full_chunks: tuple[int, ...] | None
  timeline: bool
  split_shape: OneBodyShape | None
  body_kind: str | None


def _hybrid_rank_body(layers, full_body, padded: bool, model, rank, rows_BT, reduce, *table):
  """A hybrid rank's `RankBody`: the strategy's rank body (`full_body`, its make_body) on
  the full layers, which it sees as a model of full layers alone, and the strategy's linear
  layer on the others; each kind's outputs written into its buffer in the carry at the
  layer's row in its stack ({"full": the K,V the strategy emits, "state", "halo"}).
  rows_BT: the tokens, or where `padded` (tokens, each position minus its row's end)."""
  spec, chunks = layers.spec, layers.chunks
  tokens_BT, from_end_BT = rows_BT if padded else (rows_BT, None)
  full_config = model.config.of_kind(FULL_ATTENTION)
  full = full_body(
    types.SimpleNamespace(config=full_config, blocks=model.blocks), rank, tokens_BT, reduce, *table
  )
  one_body = None  # KV-Runahead's one body: its shape and lengths, static or data
  if layers.split_shape is not None or layers.body_kind == "one":
    one_body = _one_body_lengths(full_config, chunks, layers.kernel, layers.split_shape, table)
  c = full.tokens_BT.shape[1]
  from_end_Bc = None if from_end_BT is None else pad_rows(from_end_BT, c)
  linear_layer = _linear_layer(spec, rank, chunks, reduce, layers.timeline, one_body, from_end_Bc)
  split = KindSplit(chunks, layers.full_chunks, rank)
  full_layer = _full_layer(model.config, full, split, layers.timeline)
  # The buffers' shapes from a layer of each kind traced abstractly on this rank's rows (the
  # embedding here is for its shape alone: nothing reads it, and XLA drops it).
  x = model.embed(full.tokens_BT)
  out = _empty_outputs(model, full, full_layer, lambda block, x: linear_layer(block, x), x)

  def on_full(block, at, state):  # at: the layer's index in the model, its row in its stack
    x, (layer_carry, out) = state
    x, layer_carry, kv_out = full_layer(block, x, layer_carry, at)
    written = jax.tree.map(lambda s, new: s.at[at.row].set(new), out["full"], kv_out)
    return x, (layer_carry, dict(out, full=written))

  def on_linear(block, at, state):
    x, (layer_carry, out) = state
    x, leaving, halo = linear_layer(block, x, at.index)
    state, halo = out["state"].at[at.row].set(leaving), out["halo"].at[at.row].set(halo)
    return x, (layer_carry, dict(out, state=state, halo=halo))

  step = by_kind(on_full, on_linear)

  def layer(block, x, carry, at):
    (x, carry), _ = step(block, at, (x, carry))
    return x, carry, None

  last_row = full.last_row
  if spec.prefix_chain:  # x is in the linear layers' layout (`chunks`) after every layer
    lengths_p = jnp.asarray(chunks) if one_body is None else one_body[1]
    last_row = functools.partial(jnp.take, indices=lengths_p[rank] - 1, axis=1)
  outputs = lambda carry, _: carry[1]  # noqa: E731  (the kinds' buffers)
  return RankBody(full.tokens_BT, layer, last_row, full.owner, (full.carry, out), outputs)


def _check_split_as_data(mesh, timeline: bool, keep_last_hop: bool) -> None:
  """What the split as data does not run, by name: its hops' sizes are data, so no last hop
  is kept (its parts move for cache="last") and no probe marks them; 1-D meshes."""
  if timeline or keep_last_hop:
    raise ValueError("a hybrid's split as data keeps no last hop and marks no timeline")
  if model_parallel(mesh) > 1:
    raise ValueError("a program that takes its split as data runs on a 1-D mesh")


def _one_body_lengths(full_config, chunks, kernel, split_shape, table) -> tuple:
  """KV-Runahead's one body on a hybrid: (its shape, each rank's length [p]): the split's
  own shape and lengths where it is static, the envelope and the table's first row where
  the split is data."""
  if split_shape is None:
    return OneBodyShape.of_split(full_config, chunks, kernel), jnp.asarray(chunks, jnp.int32)
  return split_shape, jnp.asarray(table[0][0], jnp.int32)


def _full_layer(config, body, split_full, timeline: bool):
  """(block, x, carry, at) -> full layer at.index (its index in the model: the rank layer knows the
  model's last layer by it, whose attention and rest KV-Runahead's ranks before the last
  skip) in the strategy's rank body, its hidden states moved into the full layers' split and
  back (`KindSplit`)."""
  moves = timeline and split_full.linear != split_full.full

  def full_layer(block, x, carry, at):
    x = mark(moves, "move", at.index, split_full.enter(x))
    x, carry, kv = body.layer(block, x, carry, at)
    return split_full.leave(x, at.index, config.num_layers), carry, kv

  return full_layer


@dataclasses.dataclass(frozen=True)
class KindSplit:
  """KV-Runahead's hidden states between the linear layers' split (`linear`, the tokens'
  layout, in which every layer leaves them) and the full layers' (`full`): a full layer
  enters by moving them into its split and leaves by moving them back
  (`strategies.base.reshard_rows`: each rank's edge rows to its neighbour). The model's last
  layer moves nothing back: only the prompt's last row is read after it, and rank p-1 holds
  it in both splits (moved locally to its row in `linear`). One split for both: no move."""

  linear: tuple[int, ...] | None  # None: the split is data, one for both (no move)
  full: tuple[int, ...] | None
  rank: object

  def enter(self, x_BcD):
    if self.full is None or self.linear == self.full:
      return x_BcD
    return reshard_rows(x_BcD, self.linear, self.full, self.rank)

  def leave(self, x_BcD, l, num_layers: int):
    if self.full is None or self.linear == self.full:
      return x_BcD
    p = len(self.full)

    def last_row_only(x_BcD):  # rank p-1's last row at its place in `linear`
      row_BD = x_BcD[:, self.full[p - 1] - 1]
      at = jnp.zeros((x_BcD.shape[0], max(self.linear), x_BcD.shape[2]), x_BcD.dtype)
      return at.at[:, self.linear[p - 1] - 1].set(row_BD)

    def back(x_BcD):
      return reshard_rows(x_BcD, self.full, self.linear, self.rank)

    return jax.lax.cond(l == num_layers - 1, last_row_only, back, x_BcD)


def output_specs(mesh) -> dict:
  """compile_hybrid's outputs by rank, their heads over "model" on a 2-D mesh: the full
  layers' K,V [p, L, 2, rows, K, H] (every array the strategy emits), the linear layers'
  states [p, L, B, h, k, v] and halos [p, L, B, w, C]."""
  P = jax.P
  if model_parallel(mesh) == 1:
    return {"full": P(AXIS), "state": P(AXIS), "halo": P(AXIS)}
  return {
    "full": parts_spec(mesh),
    "state": split_dims("pLBhkv", p=AXIS, h=MODEL_AXIS),
    "halo": split_dims("pLBwC", p=AXIS, C=MODEL_AXIS),
  }


def _empty_outputs(model, body, full_layer, linear_layer, x) -> dict:
  """Zero buffers, varying over the ranks, for what every layer outputs: their shapes from
  one full and one linear layer traced abstractly (`jax.eval_shape`) on the first rows of
  the stacks."""
  cfg = model.config
  first = Layer(jnp.int32(0), jnp.int32(0), FULL_ATTENTION)
  out = {}
  for name, layer_type, kind, stack, run in (
    ("full", FULL, FULL_ATTENTION, model.blocks, lambda b: full_layer(b, x, body.carry, first)[2]),
    ("linear", LINEAR, cfg.linear_kind, model.linear_blocks, lambda b: linear_layer(b, x)[1:]),
  ):
    count = len(cfg.layers_of(layer_type))
    graphdef, stacked = nnx.split(stack)
    # No layer of this kind (a Qwen3.5 model of one kind alone): its branch never runs and
    # its outputs hold no layer, shaped from a layer's weights' shapes all the same.
    first_rows = jax.tree.map(lambda w: w[0] if count else jnp.zeros(w.shape[1:], w.dtype), stacked)

    # The block is made inside the abstract trace, seeing its kind's config as in the scan.
    def first_layer():
      block = nnx.merge(graphdef, first_rows)  # noqa: B023
      block.config = cfg.of_kind(kind)  # noqa: B023
      return run(block)  # noqa: B023

    shapes = jax.eval_shape(first_layer)
    zeros = jax.tree.map(
      lambda s: jax.lax.pcast(jnp.zeros((count, *s.shape), s.dtype), (AXIS,), to="varying"),
      shapes,
    )
    if name == "full":
      out["full"] = zeros
    else:
      out["state"], out["halo"] = zeros
  return out
