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
              collective-permute is a rendezvous on gloo).
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
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.cache_layout import parts_spec
from kvr_jax.runtime.mesh import AXIS, MODEL_AXIS, model_parallel
from kvr_jax.strategies import zigzag
from kvr_jax.strategies.allgather import allgather_body
from kvr_jax.strategies.base import count_trace, logits_to_last_rank, own_spmd, reshard_rows
from kvr_jax.strategies.probe import mark
from kvr_jax.strategies.ring import ring_body
from kvr_jax.strategies.runahead import kvr_body
from kvr_jax.strategies.runahead.rank_layer import pad_rows
from models import gated_deltanet as gdn
from models.base import no_reduce
from models.layer_kinds import FULL_ATTENTION
from models.qwen3_5 import FULL, LINEAR, scan_layers

STRATEGIES = ("kvr", "ring", "allgather")
# Each strategy's rank maker (strategy_compiler's body_of) and whether it keeps its last hop.
_BODIES = {
  "kvr": (functools.partial(kvr_body, body="per-rank"), True),
  "ring": (ring_body, False),
  "allgather": (allgather_body, False),
}


def state_chain(leave, first_message, rank, num_ranks: int):
  """What each rank enters its chunk with: (state [B, h, k, v], the w input rows before its
  chunk [B, w, C]); rank 0 enters with zeros. p-1 hops: hop k sends rank k's
  leave(what rank k entered with) -> (its leaving state, the last w inputs up to its chunk's
  end) to rank k+1. Every rank computes `leave` at every hop (SPMD: small work); only rank
  k's is sent."""
  entering = first_message
  for k in range(num_ranks - 1):
    message = jax.lax.ppermute(leave(*entering), AXIS, perm=[(k, k + 1)])
    # zeros reach the ranks outside the pair
    entering = jax.tree.map(lambda new, old: jnp.where(rank == k + 1, new, old), message, entering)
  return entering


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
    from_zeros, _plain_maps, lambda ops: gdn.chunked_with_entry_map(*ops), (q, k, v, g, beta_Bch)
  )
  w = halo_BwC.shape[1]
  return maps, jax.lax.dynamic_slice_in_dim(mixed_BcC, real_rows - w, w, axis=1)


def _plain_maps(operands):
  """The maps of a span entered with zeros: its plain chunked pass (Q_eff and A zero)."""
  q = operands[0]
  state_shape = (q.shape[0], q.shape[2], q.shape[3], operands[2].shape[3])
  o_Bchv, B_Bhkv = gdn.chunked(*operands, gdn.zeros_as(q, state_shape))
  A_Bhkk = gdn.zeros_as(q, (*B_Bhkv.shape[:2], q.shape[-1], q.shape[-1]))
  return o_Bchv, jnp.zeros_like(q), A_Bhkk, B_Bhkv


def _at_own_length(rank, chunks: tuple[int, ...], phase, rows: int | None = None):
  """phase(i, c_i, *operands) -> (arrays with rows on axis 1, arrays without) on rank
  `rank`'s own static length: a `lax.switch` whose branch i runs rank i's c_i rows, the
  rowed outputs padded back to `rows` (the longest chunk's by default). The rows past a
  rank's chunk are never computed: a searched split's short rank does its own tokens' work,
  not the longest rank's (padded rows would cost it the projections, the entry map and the
  MLP of tokens it does not hold)."""
  rows = max(chunks) if rows is None else rows

  def branch(i, *operands):
    rowed, whole = phase(i, chunks[i], *operands)
    return jax.tree.map(lambda a: pad_rows(a, rows), rowed), whole

  return lambda *operands: jax.lax.switch(
    rank, [functools.partial(branch, i) for i in range(len(chunks))], *operands
  )


def _chain_span_maps(block, w: int, i, c, mixed_BcC, g_Bch, beta_Bch):
  """Rank i's chunk of c rows as maps of what enters it, before anything arrives: rank 0 its
  outputs and leaving state from zeros; rank i > 0 its rest (rows w..c) as an entry map, the
  head's w rows left as zeros until the hop brings the state and the halo."""
  B, C = mixed_BcC.shape[0], mixed_BcC.shape[2]
  if i == 0:  # the prompt's first chunk: zeros enter it, halo included
    zero_halo = jnp.zeros((B, w, C), mixed_BcC.dtype)
    conv_BcC, _ = gdn.causal_conv(mixed_BcC[:, :c], block.conv_kernel(), zero_halo)
    o_Bchv, q_eff, A_Bhkk, B_Bhkv = _plain_maps(
      (*block.heads(conv_BcC, g_Bch[:, :c]), beta_Bch[:, :c])
    )
    return (o_Bchv, q_eff), (A_Bhkk, B_Bhkv)
  # The rest: rows w..c (none when c <= w), their convolution's halo the chunk's own
  # first w rows.
  conv_BrC, _ = gdn.causal_conv(mixed_BcC[:, w:c], block.conv_kernel(), mixed_BcC[:, :w])
  operands = (*block.heads(conv_BrC, g_Bch[:, w:c]), beta_Bch[:, w:c])
  if c <= w:  # no rest: the identity map
    q_Brhk, v_Brhv = operands[0], operands[2]
    B, h, d_k, d_v = q_Brhk.shape[0], q_Brhk.shape[2], q_Brhk.shape[3], v_Brhv.shape[3]
    A_Bhkk = gdn.zeros_as(g_Bch, (B, h, d_k, d_k)) + jnp.eye(d_k)  # (q has no rows)
    o_Brhv, q_eff_Brhk, B_Bhkv = v_Brhv, q_Brhk, gdn.zeros_as(g_Bch, (B, h, d_k, d_v))
  else:
    o_Brhv, q_eff_Brhk, A_Bhkk, B_Bhkv = gdn.chunked_with_entry_map(*operands)

  # The head's w rows, filled once the hop arrives: shaped from w, not sliced from the
  # rest (a rest shorter than w would give a shorter head and shift every row after it).
  def before_rest(rest_Br__):
    head = jnp.zeros((rest_Br__.shape[0], w, *rest_Br__.shape[2:]), rest_Br__.dtype)
    return jnp.concatenate([head, rest_Br__], axis=1)

  return (before_rest(o_Brhv), before_rest(q_eff_Brhk)), (A_Bhkk, B_Bhkv)


def chain_linear_layer(
  block, x_BcD, rank, chunks: tuple[int, ...], reduce=no_reduce, probe=lambda label, v: v
):
  """KV-Runahead's linear layer on rank `rank`'s contiguous chunk (module docstring):
  (x [B, c_max, D], the state it leaves [B, h, k, v], the last w inputs up to its chunk's
  end [B, w, C]). Each rank's phases run at its own length (`_at_own_length`). Rank 0 enters
  with zeros and runs the plain chunked form. Rank i > 0 splits its chunk into a head (its
  first w rows, or all c of them when c <= w: their convolution needs the rows before the
  chunk) and the rest (rows w..c, convolved from the chunk's own rows): it runs the rest
  ahead as an entry map before anything arrives, then one hop brings the entering state and
  the halo together, the head runs recurrently from them, and the rest's map is applied to
  the state the head leaves. One message per hop, on the chain: no rank waits at a layer's
  start for its successor. Any chunk length runs: a chunk shorter than w passes on a halo
  that ends with its own rows and begins with the halo it received.
  reduce: a model group's sum (each shard holds some key heads, their state and channels:
  what its hops carry). probe(label, value) -> value: the timeline's mark at "linear" (the
  chunk's maps made), "hop" (what the chain brought) and "rest" (the layer's output)."""
  p, w = len(chunks), block.conv_q.shape[0] - 1
  # The head reads w rows even where a chunk is shorter: its rows past the chunk are
  # padding (g = beta = 0 leave the state as it is; their outputs are dropped).
  head_rows = max(max(chunks), w)

  def inputs(i, c, x_BcD):
    return block.inputs(x_BcD[:, :c]), ()

  (mixed_BcC, z_Bchv, g_Bch, beta_Bch), _ = _at_own_length(rank, chunks, inputs, head_rows)(x_BcD)
  c_rank = jnp.asarray(chunks, jnp.int32)[rank]

  def halo_after(entering_halo_BwC):
    """The last w inputs up to the chunk's end: the chunk's own when c >= w, else the tail of
    the halo it entered with followed by its c rows."""
    rows_BwcC = jnp.concatenate([entering_halo_BwC.astype(mixed_BcC.dtype), mixed_BcC], axis=1)
    return jax.lax.dynamic_slice_in_dim(rows_BwcC, c_rank, w, axis=1)

  (o_Bchv, q_eff_Bchk), (A_Bhkk, B_Bhkv) = probe(
    "linear",
    _at_own_length(rank, chunks, functools.partial(_chain_span_maps, block, w), head_rows)(
      mixed_BcC, g_Bch, beta_Bch
    ),
  )

  def head(entering_Bhkv, halo_BwC):
    """The head's w outputs and the state it leaves, from what the hop brought."""
    conv_BwC, _ = gdn.causal_conv(mixed_BcC[:, :w], block.conv_kernel(), halo_BwC)
    q, k, v, g = block.heads(conv_BwC, g_Bch[:, :w])
    return gdn.recurrent(q, k, v, g, beta_Bch[:, :w], entering_Bhkv)

  def leave(entering_Bhkv, halo_BwC):  # rank 0's A is zero: it leaves B
    _, after_head_Bhkv = head(entering_Bhkv, halo_BwC)
    leaving_Bhkv = jnp.einsum("Bhkj,Bhjv->Bhkv", A_Bhkk, after_head_Bhkv) + B_Bhkv
    return leaving_Bhkv, halo_after(halo_BwC)

  zero_halo = jnp.zeros((mixed_BcC.shape[0], w, mixed_BcC.shape[2]), mixed_BcC.dtype)
  entering_Bhkv, halo_BwC = probe(
    "hop", state_chain(leave, (jnp.zeros_like(B_Bhkv), zero_halo), rank, p)
  )
  o_head_Bwhv, after_head_Bhkv = head(entering_Bhkv, halo_BwC)
  leaving_Bhkv = jnp.einsum("Bhkj,Bhjv->Bhkv", A_Bhkk, after_head_Bhkv) + B_Bhkv

  def finish(i, c, x_BcD, z_Bchv, o_Bchv, q_eff_Bchk, o_head_Bwhv, after_head_Bhkv):
    o_Bchv = o_Bchv[:, :c]
    if i > 0:  # rank 0 entered with zeros: its outputs need no correction
      rest_Brhv = o_Bchv[:, w:] + jnp.einsum("BThk,Bhkv->BThv", q_eff_Bchk[:, w:c], after_head_Bhkv)
      head_Bwhv = o_head_Bwhv[:, : min(c, w)].astype(o_Bchv.dtype)
      o_Bchv = jnp.concatenate([head_Bwhv, rest_Brhv], axis=1)
    return block.output(x_BcD[:, :c], o_Bchv, z_Bchv[:, :c], reduce), ()

  x_BcD, _ = _at_own_length(rank, chunks, finish)(
    x_BcD, z_Bchv, o_Bchv, q_eff_Bchk, o_head_Bwhv, after_head_Bhkv
  )
  return probe("rest", x_BcD), leaving_Bhkv, halo_after(halo_BwC)


def zigzag_linear_layer(
  block,
  x_B2cD,
  rank,
  context_len: int,
  num_ranks: int,
  reduce=no_reduce,
  probe=lambda label, v: v,
):
  """A peer's linear layer on rank `rank`'s two zigzag chunks r and 2p-1-r (module
  docstring): (x [B, 2c, D], the prompt's final state [B, h, k, v] (the same on every rank),
  the last w real inputs of the prompt's last chunk [B, w, C] (rank 0 holds it)).
  probe(label, value) -> value: the timeline's mark at "linear" (the spans' maps made),
  "allgather" (every chunk's map here) and "rest" (the layer's output)."""
  p, c = num_ranks, zigzag.chunk_len(context_len, num_ranks)
  mixed, z_B2chv, g, beta = block.inputs(x_B2cD)
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


def _linear_layer(strategy: str, config, rank, chunks: tuple[int, ...], reduce, timeline: bool):
  """(block, x, i) -> the strategy's linear layer i on this rank, marked for the timeline."""
  # ([0] where a kind has no layer: only `_empty_outputs`' abstract trace reads it then)
  linear_index_L = jnp.asarray(config.layers_of(LINEAR) or [0], jnp.int32)

  def linear_layer(block, x, i=0):
    def probe(label, value):  # the model's index of linear layer i
      return mark(timeline, label, linear_index_L[i], value)

    if strategy == "kvr":
      return chain_linear_layer(block, x, rank, chunks, reduce, probe)
    return zigzag_linear_layer(block, x, rank, sum(chunks), len(chunks), reduce, probe)

  return linear_layer


@kept_cache(16)
def compile_hybrid(
  strategy: str,
  graphdef,
  mesh,
  chunks: tuple[int, ...],
  kernel,
  keep_last_hop: bool = True,
  timeline: bool = False,
  full_chunks: tuple[int, ...] | None = None,
):
  """The jitted SPMD program of `strategy` (STRATEGIES) on a hybrid model: (state, tokens
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
  the tokens'): the hidden states move between the two at each full layer (`KindSplit`)."""
  if strategy not in STRATEGIES:
    raise ValueError(f"hybrid models run under {STRATEGIES}, not {strategy!r}")
  if full_chunks is not None and strategy != "kvr":
    raise ValueError(f"a split per layer kind is KV-Runahead's; {strategy} lays out its own")
  full_chunks = chunks if full_chunks is None else full_chunks
  body_of, keeps = _BODIES[strategy]
  make_body = body_of(graphdef, full_chunks, kernel, timeline, keeps and keep_last_hop)
  P = jax.P
  m = model_parallel(mesh)
  reduce = tensor_parallel.psum_over_model if m > 1 else no_reduce

  def program(state, tokens_1BT):
    count_trace(f"{strategy}-hybrid")
    model = nnx.merge(graphdef, state)
    full_config = model.config.of_kind(FULL_ATTENTION)
    rank = jax.lax.axis_index(AXIS)
    # The strategy's rank sees a model of full layers (the ones it runs).
    full_model = types.SimpleNamespace(config=full_config, blocks=model.blocks)
    body = make_body(full_model, rank, tokens_1BT[0], reduce)

    linear_layer = _linear_layer(strategy, model.config, rank, chunks, reduce, timeline)

    # Each full row's index in the model: the rank layer knows the model's last layer by it
    # (KV-Runahead's ranks before the last skip its attention and rest: nothing reads them).
    full_index_F = jnp.asarray(model.config.layers_of(FULL) or [0], jnp.int32)
    split_full = KindSplit(chunks, full_chunks, rank, model.config.num_layers)

    def full_layer(block, x, carry, i):
      block.config = full_config
      l = full_index_F[i]
      x = mark(timeline and chunks != full_chunks, "move", l, split_full.enter(x))
      x, carry, kv = body.layer(block, x, carry, l)
      return split_full.leave(x, l), carry, kv

    x = mark(timeline, "embed", -1, model.embed(body.tokens_BT))
    out = _empty_outputs(model, body, full_layer, lambda block, x: linear_layer(block, x), x)

    def on_full(block, i, carry):
      x, layer_carry, out = carry
      x, layer_carry, kv_out = full_layer(block, x, layer_carry, i)
      full = jax.tree.map(lambda s, new: s.at[i].set(new), out["full"], kv_out)
      return x, layer_carry, dict(out, full=full)

    def on_linear(block, i, carry):
      x, layer_carry, out = carry
      x, leaving, halo = linear_layer(block, x, i)
      out = dict(out, state=out["state"].at[i].set(leaving), halo=out["halo"].at[i].set(halo))
      return x, layer_carry, out

    x, _, out = scan_layers(model, on_full, on_linear, (x, body.carry, out))
    last_row = body.last_row
    if strategy == "kvr":  # x is in the linear layers' layout (`chunks`) after every layer
      last_row = functools.partial(jnp.take, indices=jnp.asarray(chunks)[rank] - 1, axis=1)
    logits_BV = model.logits(last_row(x)[:, None])[:, 0]
    logits_BV = logits_to_last_rank(logits_BV, body.owner, len(chunks))
    logits_BV = mark(timeline, "logits", -1, logits_BV)
    return jax.tree.map(lambda a: a[None], (logits_BV, out))

  return own_spmd(program, mesh, (P(AXIS), output_specs(mesh)))


@dataclasses.dataclass(frozen=True)
class KindSplit:
  """KV-Runahead's hidden states between the linear layers' split (`linear`, the tokens'
  layout, in which every layer leaves them) and the full layers' (`full`): a full layer
  enters by moving them into its split and leaves by moving them back
  (`strategies.base.reshard_rows`: each rank's edge rows to its neighbour). The model's last
  layer moves nothing back: only the prompt's last row is read after it, and rank p-1 holds
  it in both splits (moved locally to its row in `linear`). One split for both: no move."""

  linear: tuple[int, ...]
  full: tuple[int, ...]
  rank: object
  num_layers: int

  def enter(self, x_BcD):
    return reshard_rows(x_BcD, self.linear, self.full, self.rank)

  def leave(self, x_BcD, l):
    if self.linear == self.full:
      return x_BcD
    p = len(self.full)

    def last_row_only(x_BcD):  # rank p-1's last row at its place in `linear`
      row_BD = x_BcD[:, self.full[p - 1] - 1]
      at = jnp.zeros((x_BcD.shape[0], max(self.linear), x_BcD.shape[2]), x_BcD.dtype)
      return at.at[:, self.linear[p - 1] - 1].set(row_BD)

    def back(x_BcD):
      return reshard_rows(x_BcD, self.full, self.linear, self.rank)

    return jax.lax.cond(l == self.num_layers - 1, last_row_only, back, x_BcD)


def output_specs(mesh) -> dict:
  """compile_hybrid's outputs by rank, their heads over "model" on a 2-D mesh: the full
  layers' K,V [p, L, 2, rows, K, H] (every array the strategy emits), the linear layers'
  states [p, L, B, h, k, v] and halos [p, L, B, w, C]."""
  P = jax.P
  if model_parallel(mesh) == 1:
    return {"full": P(AXIS), "state": P(AXIS), "halo": P(AXIS)}
  return {
    "full": parts_spec(mesh),
    "state": P(AXIS, None, None, MODEL_AXIS),
    "halo": P(AXIS, None, None, None, MODEL_AXIS),
  }


def _empty_outputs(model, body, full_layer, linear_layer, x) -> dict:
  """Zero buffers, varying over the ranks, for what every layer outputs: their shapes from
  one full and one linear layer traced abstractly (`jax.eval_shape`) on the first rows of
  the stacks."""
  cfg = model.config
  out = {}
  for name, layer_type, stack, run in (
    ("full", FULL, model.blocks, lambda b: full_layer(b, x, body.carry, 0)[2]),
    ("linear", LINEAR, model.linear_blocks, lambda b: linear_layer(b, x)[1:]),
  ):
    count = len(cfg.layers_of(layer_type))
    graphdef, stacked = nnx.split(stack)
    # No layer of this kind (a Qwen3.5 model of one kind alone): its branch never runs and
    # its outputs hold no layer, shaped from a layer's weights' shapes all the same.
    first_rows = jax.tree.map(lambda w: w[0] if count else jnp.zeros(w.shape[1:], w.dtype), stacked)
    # The block is made inside the abstract trace: a layer may set its config there.
    shapes = jax.eval_shape(lambda: run(nnx.merge(graphdef, first_rows)))  # noqa: B023
    zeros = jax.tree.map(
      lambda s: jax.lax.pcast(jnp.zeros((count, *s.shape), s.dtype), (AXIS,), to="varying"),
      shapes,
    )
    if name == "full":
      out["full"] = zeros
    else:
      out["state"], out["halo"] = zeros
  return out
