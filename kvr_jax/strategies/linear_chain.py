"""KV-Runahead's linear layer (Gated DeltaNet) on contiguous chunks: a chain of p-1 hops,
hop k sending rank k's leaving state and its last w input rows (the convolution's halo) to
rank k+1 (strategies.hybrid's module docstring says why the halo rides the state's hop).

Two forms, as KV-Runahead's full layers have two bodies (strategies.runahead.bodies):

  chain_linear_layer          every phase at the rank's own static length (a `lax.switch`
                              per phase, a branch per rank): no row of padding is computed,
                              but every branch is compiled (the program grows with p).
  chain_linear_layer_one_body every rank runs one program at the split's padded width, its
                              length as data: rows past it are padding (g = beta = 0 leave
                              the state as it is, exactly; their outputs are zeroed), and
                              the loops over row blocks and 64-token chunks stop at its real
                              rows (at most a block of padded work each). Rank 0 runs the
                              entry-map form from a zero state and halo like every other
                              rank, where the per-rank form runs the plain chunked pass: the
                              same values, a [k, k] map per chunk more work. The program
                              does not grow with p, and the lengths could be the program's
                              operand.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies.runahead.hops import varying_axes
from kvr_jax.strategies.runahead.rank_layer import map_row_blocks, pad_rows
from models import gated_deltanet as gdn
from models.base import no_reduce


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


def plain_maps(operands):
  """The maps of a span entered with zeros: its plain chunked pass (Q_eff and A zero)."""
  q = operands[0]
  state_shape = (q.shape[0], q.shape[2], q.shape[3], operands[2].shape[3])
  o_Bchv, B_Bhkv = gdn.chunked(*operands, gdn.zeros_as(q, state_shape))
  A_Bhkk = gdn.zeros_as(q, (*B_Bhkv.shape[:2], q.shape[-1], q.shape[-1]))
  return o_Bchv, jnp.zeros_like(q), A_Bhkk, B_Bhkv


def stop_at_row_ends(g_Bch, beta_Bch, real_Bc):
  """g and beta zeroed where a row has ended (real_Bc False: the padding past a row's end in
  a bucket or a ragged batch, [B, c] as the tokens are laid out, padded with False to g's
  rows): g = beta = 0 leaves the state as it is, so every span leaves each row's state at
  its own end exactly. real_Bc None: every row runs to the end of the prompt."""
  if real_Bc is None:
    return g_Bch, beta_Bch
  real_Bc1 = pad_rows(real_Bc, g_Bch.shape[1])[..., None]
  return jnp.where(real_Bc1, g_Bch, 0), jnp.where(real_Bc1, beta_Bch, 0)


def halo_at_row_ends(block, x_BcD, from_end_Bc, w: int):
  """Each row's last w real inputs [B, w, C] (the convolution's halo a decode step reads),
  wherever they lie: from_end_Bc is each held row's position minus its row's end (the
  padding that lays chunks out is 0: no position of the halo), so position end - w + j is
  slot j. Every rank adds the layer inputs x of the slots it holds (a one-hot sum: exact),
  one psum over the ranks of [B, w, D] brings them everywhere, and the slots' inputs are
  projected there; a slot before the prompt (a row shorter than w) is the zero halo a
  prompt enters with."""
  slot_Bcw = (from_end_Bc + w)[..., None] == jnp.arange(w)
  held_BwD = jnp.einsum("Bcw,BcD->BwD", slot_Bcw.astype(x_BcD.dtype), x_BcD)
  x_BwD, count_Bw = jax.lax.psum((held_BwD, slot_Bcw.sum(1, dtype=jnp.int32)), AXIS)
  mixed_BwC = block.inputs(x_BwD)[0]
  return jnp.where(count_Bw[..., None] > 0, mixed_BwC, 0)


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
    o_Bchv, q_eff, A_Bhkk, B_Bhkv = plain_maps(
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
  block,
  x_BcD,
  rank,
  chunks: tuple[int, ...],
  reduce=no_reduce,
  probe=lambda label, v: v,
  real_Bc=None,
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
  chunk's maps made), "hop" (what the chain brought) and "rest" (the layer's output).
  real_Bc: the rows before each row's end (`stop_at_row_ends`; None: every row)."""
  p, w = len(chunks), block.conv_q.shape[0] - 1
  # The head reads w rows even where a chunk is shorter: its rows past the chunk are
  # padding (g = beta = 0 leave the state as it is; their outputs are dropped).
  head_rows = max(max(chunks), w)

  def inputs(i, c, x_BcD):
    return block.inputs(x_BcD[:, :c]), ()

  (mixed_BcC, z_Bchv, g_Bch, beta_Bch), _ = _at_own_length(rank, chunks, inputs, head_rows)(x_BcD)
  g_Bch, beta_Bch = stop_at_row_ends(g_Bch, beta_Bch, real_Bc)
  c_rank = jnp.asarray(chunks, jnp.int32)[rank]

  (o_Bchv, q_eff_Bchk), (A_Bhkk, B_Bhkv) = probe(
    "linear",
    _at_own_length(rank, chunks, functools.partial(_chain_span_maps, block, w), head_rows)(
      mixed_BcC, g_Bch, beta_Bch
    ),
  )

  o_head_Bwhv, after_head_Bhkv, leaving_Bhkv, halo_BwC = _chain_the_head(
    block, mixed_BcC, g_Bch, beta_Bch, (A_Bhkk, B_Bhkv), c_rank, rank, p, probe
  )

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
  return probe("rest", x_BcD), leaving_Bhkv, halo_BwC


def chain_linear_layer_one_body(
  block,
  x_BcD,
  rank,
  c_rank,
  num_ranks: int,
  reduce=no_reduce,
  probe=lambda label, v: v,
  row_block: int | None = None,
  real_Bc=None,
):
  """`chain_linear_layer` in the one body (module docstring): rank `rank` holds c_rank
  (traced) real rows of x [B, c, D], the rest padding. Returns what chain_linear_layer
  returns, x at its own width [B, c, D] with zeros past c_rank. The chunk splits into a head
  (its first w rows: their convolution needs the rows before the chunk, and the state that
  enters it) and the rest (rows w.., convolved from the chunk's own rows), run ahead as an
  entry map; the hop brings the state and the halo, the head runs recurrently from them and
  the rest's map takes the state the head leaves. A chunk shorter than w has a rest of
  padding alone (the identity map) and leaves a halo that ends with its own rows. The
  projections and the output (out-proj, MLP) run in loops of `row_block` rows (one block of
  every row where None) and the rest's entry map in loops of 64-token chunks, their trip
  counts the rank's real rows: padding costs at most a block of each, as in the full
  layers' one body. real_Bc: the rows before each row's end (`stop_at_row_ends`)."""
  w, width = block.conv_q.shape[0] - 1, x_BcD.shape[1]
  R = row_block or max(width, w + 1)
  rows = -(-max(width, w + 1) // R) * R  # whole blocks: a head of w rows and a rest
  real_r = jnp.arange(rows) < c_rank
  x_BrD = jnp.where(real_r[None, :, None], pad_rows(x_BcD, rows), 0).astype(x_BcD.dtype)
  inputs = _in_row_blocks(lambda x_BRD: block.inputs(x_BRD), c_rank, R, reduce, x_BrD)
  mixed_BrC, z_Brhv, g_Brh, beta_Brh = inputs
  g_Brh, beta_Brh = (jnp.where(real_r[:, None], a, 0) for a in (g_Brh, beta_Brh))
  g_Brh, beta_Brh = stop_at_row_ends(g_Brh, beta_Brh, real_Bc)

  conv_BrC, _ = gdn.causal_conv(mixed_BrC[:, w:], block.conv_kernel(), mixed_BrC[:, :w])
  rest = (*block.heads(conv_BrC, g_Brh[:, w:]), beta_Brh[:, w:])
  o_rest_Brhv, q_eff_Brhk, A_Bhkk, B_Bhkv = probe(
    "linear", gdn.chunked_with_entry_map_upto(*rest, c_rank - w)
  )

  o_head_Bwhv, after_head_Bhkv, leaving_Bhkv, halo_BwC = _chain_the_head(
    block, mixed_BrC, g_Brh, beta_Brh, (A_Bhkk, B_Bhkv), c_rank, rank, num_ranks, probe
  )
  o_rest_Brhv = o_rest_Brhv + jnp.einsum("BThk,Bhkv->BThv", q_eff_Brhk, after_head_Bhkv)
  o_Brhv = jnp.concatenate([o_head_Bwhv.astype(o_rest_Brhv.dtype), o_rest_Brhv], axis=1)
  (x_BrD,) = _in_row_blocks(
    lambda x_BRD, o_BRhv, z_BRhv: (block.output(x_BRD, o_BRhv, z_BRhv, reduce),),
    c_rank,
    R,
    reduce,
    x_BrD,
    o_Brhv,
    z_Brhv,
  )
  x_BcD = jnp.where(real_r[None, :, None], x_BrD, 0).astype(x_BcD.dtype)[:, :width]
  return probe("rest", x_BcD), leaving_Bhkv, halo_BwC


def _in_row_blocks(fn, real_rows, row_block: int, reduce, *inputs):
  """fn(*row blocks of inputs) -> a tuple of arrays with rows on axis 1, run on the blocks
  that hold the first `real_rows` rows (traced) alone (`rank_layer.map_row_blocks`); the
  rows of later blocks are zeros (varying over the rank's axes: `hops.varying_axes`)."""
  shapes = jax.eval_shape(fn, *(x[:, :row_block] for x in inputs))
  rows = inputs[0].shape[1]
  zeros = tuple(
    jax.lax.pcast(
      jnp.zeros((s.shape[0], rows, *s.shape[2:]), s.dtype), varying_axes(reduce), to="varying"
    )
    for s in shapes
  )
  return map_row_blocks(lambda _, *blocks: fn(*blocks), real_rows, row_block, inputs, zeros)


def _chain_the_head(block, mixed_BrC, g_Brh, beta_Brh, maps, c_rank, rank, num_ranks, probe):
  """Both forms' chain: the hop brings the state and the halo entering the chunk, its head
  (its first w rows of inputs, g and beta: padding past c_rank has g = beta = 0) runs
  recurrently from them, and the rest's map (A, B) takes the state the head leaves. Every
  rank computes what it would send at every hop (rank 0's A is zero: it leaves B). Returns
  (the head's outputs [B, w, h, v], the state after the head, the leaving state, the last w
  inputs up to the chunk's end [B, w, C]: the entering halo's tail where c_rank < w)."""
  w = block.conv_q.shape[0] - 1
  A_Bhkk, B_Bhkv = maps

  def halo_after(entering_halo_BwC):
    rows_BwrC = jnp.concatenate([entering_halo_BwC.astype(mixed_BrC.dtype), mixed_BrC], axis=1)
    return jax.lax.dynamic_slice_in_dim(rows_BwrC, c_rank, w, axis=1)

  def head(entering_Bhkv, halo_BwC):
    conv_BwC, _ = gdn.causal_conv(mixed_BrC[:, :w], block.conv_kernel(), halo_BwC)
    q, k, v, g = block.heads(conv_BwC, g_Brh[:, :w])
    return gdn.recurrent(q, k, v, g, beta_Brh[:, :w], entering_Bhkv)

  def leave(entering_Bhkv, halo_BwC):
    _, after_head_Bhkv = head(entering_Bhkv, halo_BwC)
    leaving_Bhkv = jnp.einsum("Bhkj,Bhjv->Bhkv", A_Bhkk, after_head_Bhkv) + B_Bhkv
    return leaving_Bhkv, halo_after(halo_BwC)

  zero_halo = jnp.zeros((mixed_BrC.shape[0], w, mixed_BrC.shape[2]), mixed_BrC.dtype)
  entering_Bhkv, halo_BwC = probe(
    "hop", state_chain(leave, (jnp.zeros_like(B_Bhkv), zero_halo), rank, num_ranks)
  )
  o_head_Bwhv, after_head_Bhkv = head(entering_Bhkv, halo_BwC)
  leaving_Bhkv = jnp.einsum("Bhkj,Bhjv->Bhkv", A_Bhkk, after_head_Bhkv) + B_Bhkv
  return o_head_Bwhv, after_head_Bhkv, leaving_Bhkv, halo_after(halo_BwC)
