"""A mixture of experts on arrays: the router, the top-k choice and the experts' grouped
matmuls over the rows routed to them (no token dropped).

Dimension legend: T tokens, D model dim, E experts, F expert MLP dim, P = T x top-k pairs."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Rows per tile of the experts' grouped matmul: every (token, expert) pair is laid out in its
# expert's run of rows, each run padded to whole tiles, and one tile is one expert's matmul.
EXPERT_TILE = 128


def mixture_of_experts(
  h_BTD, router_DE, w_gate_EDF, w_up_EDF, w_down_EFD, top_k: int, normalize: bool
) -> jax.Array:
  """A mixture of SwiGLU experts, every token through its `top_k` experts, no token dropped.

  The router's softmax is in float32 over all E experts; the top k are kept (renormalised
  over themselves when `normalize`), as transformers' Qwen3-MoE and Mixtral routers compute.
  FLOPs follow the active experts: the T k (token, expert) pairs are sorted by expert, each
  expert's run padded to whole tiles of EXPERT_TILE rows, and a loop whose trip count is the
  number of tiles in use runs one [tile, D] x [D, F] matmul of one expert per step (at most
  E - 1 padded rows per expert run; `jax.lax.ragged_dot` computes every expert for every row
  on CPU). Returns [B, T, D] in h's dtype.
  """
  B, T, D = h_BTD.shape
  E = router_DE.shape[-1]
  h_SD = h_BTD.reshape(B * T, D)  # S = B T tokens
  logits_SE = jnp.einsum("SD,DE->SE", h_SD, router_DE).astype(jnp.float32)
  weights_Sk, experts_Sk = jax.lax.top_k(jax.nn.softmax(logits_SE, axis=-1), top_k)
  if normalize:
    weights_Sk = weights_Sk / weights_Sk.sum(axis=-1, keepdims=True)
  rows, tile = expert_rows(experts_Sk.reshape(-1), E, EXPERT_TILE)
  pairs = experts_Sk.size  # P = S k (token, expert) pairs
  token_P = jnp.arange(pairs) // top_k
  x_RD = jnp.zeros((rows.num_rows, D), h_SD.dtype).at[rows.row_P].set(h_SD[token_P])

  def one_tile(t, y_RD):
    x_tD = jax.lax.dynamic_slice_in_dim(x_RD, t * tile, tile)
    e = rows.expert_of_tile[t]
    gate_tF = jax.nn.silu(x_tD @ w_gate_EDF[e])
    y_tD = (gate_tF * (x_tD @ w_up_EDF[e])) @ w_down_EFD[e]
    return jax.lax.dynamic_update_slice_in_dim(y_RD, y_tD.astype(y_RD.dtype), t * tile, axis=0)

  y_RD = jax.lax.fori_loop(0, rows.tiles_used, one_tile, jnp.zeros_like(x_RD))
  weighted_PD = y_RD[rows.row_P] * weights_Sk.reshape(-1)[:, None].astype(y_RD.dtype)
  out_SD = jnp.zeros_like(h_SD).at[token_P].add(weighted_PD)
  return out_SD.reshape(B, T, D)


class ExpertRows(NamedTuple):
  """Where each (token, expert) pair sits in the experts' tiled rows (see `expert_rows`)."""

  row_P: jax.Array  # each pair's row
  expert_of_tile: jax.Array  # each tile's expert
  tiles_used: jax.Array  # tiles holding some pair (data: the loop's trip count)
  num_rows: int  # rows allocated (static)


def expert_rows(expert_P, num_experts: int, max_tile: int) -> tuple[ExpertRows, int]:
  """Pairs sorted by expert, each expert's run padded to whole tiles: each pair's row, each
  tile's expert, the tiles in use (data) and the rows allocated (static: enough for any
  routing, P/tile + E tiles). The tile is `max_tile` or, for few pairs, P rounded up to 8."""
  pairs = expert_P.shape[0]
  tile = min(max_tile, -(-pairs // 8) * 8)
  counts_E = jnp.zeros(num_experts, jnp.int32).at[expert_P].add(1)
  tiles_E = -(-counts_E // tile)
  first_tile_E = jnp.cumsum(tiles_E) - tiles_E
  first_pair_E = jnp.cumsum(counts_E) - counts_E
  order_P = jnp.argsort(expert_P, stable=True)
  sorted_expert_P = expert_P[order_P]
  rank_in_run = jnp.arange(pairs) - first_pair_E[sorted_expert_P]
  row_sorted = first_tile_E[sorted_expert_P] * tile + rank_in_run
  row_P = jnp.zeros(pairs, jnp.int32).at[order_P].set(row_sorted)
  num_tiles = -(-pairs // tile) + num_experts
  tile_ends_E = jnp.cumsum(tiles_E)
  expert_of_tile = jnp.searchsorted(tile_ends_E, jnp.arange(num_tiles), side="right")
  expert_of_tile = jnp.minimum(expert_of_tile, num_experts - 1)
  return ExpertRows(row_P, expert_of_tile, tile_ends_E[-1], num_tiles * tile), tile
