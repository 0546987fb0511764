"""KV-Runahead on hybrid models (Qwen3.5: Gated DeltaNet linear layers among softmax ones):
the full layers hop their K,V prefix as on every model (the per-rank program's layer,
`per_rank._PerRankBranches`); a linear layer hops one state.

A linear layer on rank i (chunk [S_{i-1}, S_i), c_i tokens, padded to c_max):

  inputs     norm, the fused q/k/v projections, z, decay g and beta of its own rows
  halo       its last w = W - 1 convolution inputs go to rank i+1 (one collective-permute for
             every pair at once: nothing waits on an earlier rank), which convolves with them
  entry map  its chunk run before its entering state S is known, as affine maps of it:
             o = o_0 + Q_eff S and S_out = A S + B (models.gated_deltanet.chunked_with_entry_map;
             rank 0 enters with zeros and runs the plain chunked form)
  state hop  hop k: rank k sends A_k S_k + B_k to rank k+1 (one [B, h, k, v] float32 state
             whatever the prompt length, then one small matmul on the receiver before it
             forwards: the chain's serial work)
  correct    o = o_0 + Q_eff S, then the gated norm, out_proj and the MLP of its rows

so every rank runs its whole chunk ahead of the state, as it runs its diagonal ahead of the
K,V prefix in a full layer. Rows past c_i are padding: their g and beta are zero, which leaves
the state as it is (exact), and their outputs are dropped.

The last rank ends holding the whole past decode needs, with nothing moved: each full layer's
last hop (the prompt's first S_{p-2} positions) and its own chunk, and each linear layer's
state and halo (what its chain and its own rows left). `assemble_cache` joins them into the
model's `HybridCache`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from kvr_jax.core.caches import kept_cache
from kvr_jax.core.chunks import chunk_starts
from kvr_jax.runtime.cache_layout import unfold_batch
from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies.base import count_trace
from kvr_jax.strategies.runahead.per_rank import _PerRankBranches
from kvr_jax.strategies.runahead.schedule import (
  attends_diagonal_first,
  buffer_len,
  rows_before_hop,
)
from models import gated_deltanet as gdn
from models.base import no_reduce
from models.layer_kinds import FULL_ATTENTION
from models.qwen3_5 import FULL, LINEAR, HybridCache, LinearState, scan_layers

NAME = "kvr-hybrid"


def state_chain(A_Bhkk, B_Bhkv, rank, num_ranks: int):
  """The state each rank enters its chunk with: p-1 hops, hop k sends rank k's leaving state
  A_k S_k + B_k to rank k+1 (rank 0 enters with zeros). Every rank computes the small matmul
  at every hop (SPMD); only rank k's is sent."""
  S_Bhkv = jnp.zeros_like(B_Bhkv)
  for k in range(num_ranks - 1):
    leaving = jnp.einsum("Bhkj,Bhjv->Bhkv", A_Bhkk, S_Bhkv) + B_Bhkv
    message = jax.lax.ppermute(leaving, AXIS, perm=[(k, k + 1)])
    S_Bhkv = jnp.where(rank == k + 1, message, S_Bhkv)  # zeros reach the ranks outside the pair
  return S_Bhkv


def linear_rank_layer(block, x_BcD, rank, chunks: tuple[int, ...]):
  """Rank `rank`'s linear layer over its chunk (see the module docstring): (x [B, c_max, D],
  the state it leaves [B, h, k, v], the last w real rows of its convolution input [B, w, C])."""
  p, c_max = len(chunks), x_BcD.shape[1]
  c = jnp.asarray(chunks, jnp.int32)[rank]
  mixed_BcC, z_Bchv, g_Bch, beta_Bch = block.inputs(x_BcD)
  w = block.conv[...].shape[0] - 1
  own_halo_BwC = jax.lax.dynamic_slice_in_dim(mixed_BcC, c - w, w, axis=1)
  halo_BwC = jax.lax.ppermute(own_halo_BwC, AXIS, perm=[(i, i + 1) for i in range(p - 1)])
  conv_BcC, _ = gdn.causal_conv(mixed_BcC, block.conv[...], halo_BwC)
  real_c = jnp.arange(c_max) < c
  g_Bch, beta_Bch = (jnp.where(real_c[:, None], x, 0) for x in (g_Bch, beta_Bch))
  q, k, v, g = block.heads(conv_BcC, g_Bch)

  def from_zeros(operands):  # rank 0: the entering state is zero, known now
    q = operands[0]
    o_Bchv, B_Bhkv = gdn.chunked(*operands, gdn.zeros_as(q, _state_shape(operands)))
    A_Bhkk = gdn.zeros_as(q, (*B_Bhkv.shape[:2], q.shape[-1], q.shape[-1]))
    return o_Bchv, jnp.zeros_like(q), A_Bhkk, B_Bhkv

  def ahead(operands):
    return gdn.chunked_with_entry_map(*operands)

  maps = jax.lax.cond(rank == 0, from_zeros, ahead, (q, k, v, g, beta_Bch))
  entering_Bhkv = state_chain(maps[2], maps[3], rank, p)
  o_Bchv, leaving_Bhkv = gdn.apply_entry_state(*maps, entering_Bhkv)
  return block.output(x_BcD, o_Bchv, z_Bchv), leaving_Bhkv, own_halo_BwC


def _state_shape(operands) -> tuple[int, ...]:
  q, _, v = operands[:3]
  return (q.shape[0], q.shape[2], q.shape[3], v.shape[3])


@kept_cache(16)
def compile_hybrid(graphdef, mesh, chunks: tuple[int, ...], kernel):
  """The jitted SPMD program: (state, tokens [p, B, c_max]) -> per rank (logits [p, B, V],
  own K,V parts [p, L_full, 2, B*c_max, K, H], last hops [p, L_full, 2, B*S_{p-2}, K, H],
  leaving states [p, L_linear, B, h, k, v], halos [p, L_linear, B, w, C]); rank p-1's logits
  are the prompt's last position's."""
  p = len(chunks)
  P = jax.P

  def program(state, tokens_1Bc):
    count_trace(NAME)
    model = nnx.merge(graphdef, state)
    cfg = model.config
    rank = jax.lax.axis_index(AXIS)
    full_config = cfg.of_kind(FULL_ATTENTION)
    rows = rows_before_hop(full_config, chunks) if attends_diagonal_first(kernel, p) else None
    ranks = _PerRankBranches(
      chunks, kernel, False, True, no_reduce, full_config, rank, rows or (0,) * p
    )
    tokens_Bc = tokens_1Bc[0]
    B, c_max = tokens_Bc.shape
    outputs = _empty_outputs(model, B, c_max, chunks)

    def on_full(block, i, carry):
      x_BcD, buffer, out = carry
      block.config = full_config
      x_BcD, buffer, (own, last_hop) = ranks.layer(block, x_BcD, buffer, i)
      out = dict(out, own=out["own"].at[i].set(own), last_hop=out["last_hop"].at[i].set(last_hop))
      return x_BcD, buffer, out

    def on_linear(block, i, carry):
      x_BcD, buffer, out = carry
      x_BcD, leaving, halo = linear_rank_layer(block, x_BcD, rank, chunks)
      out = dict(out, state=out["state"].at[i].set(leaving), halo=out["halo"].at[i].set(halo))
      return x_BcD, buffer, out

    buffer = _varying(
      jnp.zeros((2, B, buffer_len(chunks), cfg.num_kv_heads, cfg.head_dim), model.dtype)
    )
    x_BcD = model.embed(tokens_Bc)
    x_BcD, _, out = scan_layers(model, on_full, on_linear, (x_BcD, buffer, outputs))
    logits_BV = model.logits(ranks.last_row(x_BcD)[:, None])[:, 0]
    return jax.tree.map(lambda a: a[None], (logits_BV, out))

  body = jax.shard_map(program, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS))
  return jax.jit(body)


def _varying(x):
  return jax.lax.pcast(x, (AXIS,), to="varying")


def _empty_outputs(model, batch: int, c_max: int, chunks: tuple[int, ...]) -> dict:
  cfg = model.config
  L_full, L_linear = len(cfg.layers_of(FULL)), len(cfg.layers_of(LINEAR))
  K, H = cfg.num_kv_heads, cfg.head_dim
  h, d_k, d_v = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
  prefix = chunk_starts(chunks)[-1]  # what the last hop carries: [0, S_{p-2})
  shapes = {
    "own": ((L_full, 2, batch * c_max, K, H), model.dtype),
    "last_hop": ((L_full, 2, batch * prefix, K, H), model.dtype),
    "state": ((L_linear, batch, h, d_k, d_v), jnp.float32),
    "halo": ((L_linear, batch, cfg.linear_conv_kernel - 1, cfg.conv_channels), model.dtype),
  }
  return {name: _varying(jnp.zeros(shape, dtype)) for name, (shape, dtype) in shapes.items()}


@dataclasses.dataclass(frozen=True)
class HybridOutputs:
  """What rank p-1 holds after the program: the prompt's last logits [B, V] and its cache."""

  logits_BV: jax.Array
  cache: HybridCache


def assemble_cache(out: dict, chunks: tuple[int, ...], capacity: int) -> HybridCache:
  """The hybrid cache from rank p-1's outputs (`compile_hybrid`'s, without the rank axis):
  each full layer's last hop then its own chunk, padded to `capacity` positions; each linear
  layer's state and halo as they are."""
  c_last, prefix, c_max = chunks[-1], chunk_starts(chunks)[-1], max(chunks)
  parts = [unfold_batch(out["own"], c_max)[:, :, :, :c_last]]
  if prefix:
    parts.insert(0, unfold_batch(out["last_hop"], prefix))
  kv = jnp.concatenate(parts, axis=3)
  kv = jnp.pad(kv, [(0, 0)] * 3 + [(0, capacity - kv.shape[3])] + [(0, 0)] * 2)
  return HybridCache(kv, LinearState(out["state"], out["halo"]))
