"""MLPs on arrays: SwiGLU, and a mixture of experts: the routers (softmax top-k; DeepSeek's
grouped sigmoid), the top-k choice and the experts' grouped matmuls over the rows routed to
them (no token dropped).

Dimension legend: T tokens, D model dim, E experts, F expert MLP dim, P = T x top-k pairs."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Rows per tile of the experts' grouped matmul: every (token, expert) pair is laid out in its
# expert's run of rows, each run padded to whole tiles, and one tile is one expert's matmul.
EXPERT_TILE = 128


def swiglu(h_BTD, w_gate_DF, w_up_DF, w_down_FD) -> jax.Array:
  """One SwiGLU MLP (a dense layer's, or a shared expert's): down(silu(gate h) * up h)."""
  gate_BTF = jax.nn.silu(jnp.einsum("BTD,DF->BTF", h_BTD, w_gate_DF))
  up_BTF = jnp.einsum("BTD,DF->BTF", h_BTD, w_up_DF)
  return jnp.einsum("BTF,FD->BTD", gate_BTF * up_BTF, w_down_FD)


def mixture_of_experts(
  h_BTD, router_DE, w_gate_EDF, w_up_EDF, w_down_EFD, top_k: int, normalize: bool
) -> jax.Array:
  """A mixture of SwiGLU experts, every token through its `top_k` experts, no token dropped.

  The router's softmax is in float32 over all E experts; the top k are kept (renormalised
  over themselves when `normalize`), as transformers' Qwen3-MoE and Mixtral routers compute.
  Returns [B, T, D] in h's dtype (`run_experts`)."""
  weights_BTk, experts_BTk = route_softmax_top_k(h_BTD, router_DE, None, top_k, normalize)
  return run_experts(h_BTD, weights_BTk, experts_BTk, w_gate_EDF, w_up_EDF, w_down_EFD)


def route_softmax_top_k(h_BTD, router_DE, router_bias_E, top_k: int, normalize: bool):
  """The softmax router: float32 probabilities over all E experts (the logits with the
  router's bias where it has one, gpt-oss), the top k kept, renormalised over themselves when
  `normalize` (the same as gpt-oss's softmax over the top k logits). Returns (weights
  [B, T, k] float32, experts [B, T, k])."""
  logits_BTE = jnp.einsum("BTD,DE->BTE", h_BTD, router_DE)
  if router_bias_E is not None:
    logits_BTE = logits_BTE + router_bias_E
  probs_BTE = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
  weights_BTk, experts_BTk = jax.lax.top_k(probs_BTE, top_k)
  if normalize:
    weights_BTk = weights_BTk / weights_BTk.sum(axis=-1, keepdims=True)
  return weights_BTk, experts_BTk


def clamped_swiglu(x_tD, w_gate_DF, b_gate_F, w_up_DF, b_up_F, w_down_FD, b_down_D, limit, alpha):
  """gpt-oss's expert, as transformers computes it: gate and up with their biases, the gate
  clamped above at `limit` and up to [-limit, limit], (up + 1) * gate * sigmoid(alpha gate),
  then down with its bias."""
  gate_tF = jnp.minimum(x_tD @ w_gate_DF + b_gate_F, limit)
  up_tF = jnp.clip(x_tD @ w_up_DF + b_up_F, -limit, limit)
  glu_tF = gate_tF * jax.nn.sigmoid(gate_tF * alpha)
  return ((up_tF + 1) * glu_tF) @ w_down_FD + b_down_D


def route_grouped_sigmoid(
  h_BTD,
  router_DE,
  choice_bias_E,
  top_k: int,
  num_groups: int,
  groups_per_token: int,
  normalize: bool,
  scaling: float,
) -> tuple[jax.Array, jax.Array]:
  """DeepSeek-V3's router, as transformers computes it: sigmoid scores of float32 logits;
  the choice adds `choice_bias_E` (e_score_correction_bias) to them and is limited to the
  `groups_per_token` groups (of E / num_groups experts) whose two best biased scores sum
  highest; the chosen experts weigh by their unbiased scores, renormalised when `normalize`,
  times `scaling` (routed_scaling_factor). Returns (weights [B, T, k] float32, experts
  [B, T, k])."""
  B, T, _ = h_BTD.shape
  E = router_DE.shape[-1]
  logits_BTE = jnp.einsum("BTD,DE->BTE", h_BTD.astype(jnp.float32), router_DE.astype(jnp.float32))
  scores_BTE = jax.nn.sigmoid(logits_BTE)
  choice_BTE = scores_BTE + choice_bias_E.astype(jnp.float32)
  grouped_BTGe = choice_BTE.reshape(B, T, num_groups, E // num_groups)
  group_scores_BTG = jax.lax.top_k(grouped_BTGe, 2)[0].sum(axis=-1)
  _, groups_BTg = jax.lax.top_k(group_scores_BTG, groups_per_token)
  kept_BTG = (
    jnp.zeros((B, T, num_groups), bool)
    .at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], groups_BTg]
    .set(True)
  )
  kept_BTE = jnp.repeat(kept_BTG, E // num_groups, axis=-1)
  _, experts_BTk = jax.lax.top_k(jnp.where(kept_BTE, choice_BTE, -jnp.inf), top_k)
  weights_BTk = jnp.take_along_axis(scores_BTE, experts_BTk, axis=-1)
  if normalize:
    weights_BTk = weights_BTk / (weights_BTk.sum(axis=-1, keepdims=True) + 1e-20)
  return weights_BTk * scaling, experts_BTk


def run_experts(
  h_BTD, weights_BTk, experts_BTk, w_gate_EDF, w_up_EDF, w_down_EFD, first_expert=None
) -> jax.Array:
  """Each token through its chosen SwiGLU experts, summed by their weights (`run_expert_mlps`)."""

  def expert_swiglu(x_tD, e):
    return (jax.nn.silu(x_tD @ w_gate_EDF[e]) * (x_tD @ w_up_EDF[e])) @ w_down_EFD[e]

  E = w_gate_EDF.shape[0]
  return run_expert_mlps(h_BTD, weights_BTk, experts_BTk, E, expert_swiglu, first_expert)


def run_expert_mlps(
  h_BTD, weights_BTk, experts_BTk, num_experts: int, expert_mlp, first_expert=None
) -> jax.Array:
  """Each token through its chosen experts, `expert_mlp(x [tile, D], e) -> [tile, D]` (expert
  e's MLP on a tile of rows), summed by their weights; no token dropped.

  first_expert: None where `expert_mlp` holds every expert; else (maybe traced) the first of
  the `num_experts` it holds, a tensor-parallel shard's [first, first + num_experts) of the
  router's experts: only the pairs routed to them run (the others are sorted after them, never
  computed, and weigh 0), and the shards' outputs add up to the whole mixture.

  FLOPs follow the active experts: the T k (token, expert) pairs are sorted by expert, each
  expert's run padded to whole tiles of EXPERT_TILE rows, and a loop whose trip count is the
  number of tiles in use runs one [tile, D] x [D, F] matmul of one expert per step (at most
  E - 1 padded rows per expert run; `jax.lax.ragged_dot` computes every expert for every row
  on CPU). Returns [B, T, D] in h's dtype.
  """
  B, T, D = h_BTD.shape
  E, top_k = num_experts, experts_BTk.shape[-1]
  h_SD = h_BTD.reshape(B * T, D)  # S = B T tokens
  expert_P, weight_P = experts_BTk.reshape(-1), weights_BTk.reshape(-1)
  if first_expert is None:
    rows, tile = expert_rows(expert_P, E, EXPERT_TILE)
  else:  # the other shards' pairs: a group E after this shard's, whose tiles are not run
    local_P = expert_P - first_expert
    mine_P = (local_P >= 0) & (local_P < E)
    rows, tile = expert_rows(jnp.where(mine_P, local_P, E), E + 1, EXPERT_TILE, real_experts=E)
    weight_P = jnp.where(mine_P, weight_P, 0)
  pairs = experts_BTk.size  # P = S k (token, expert) pairs
  token_P = jnp.arange(pairs) // top_k
  x_RD = jnp.zeros((rows.num_rows, D), h_SD.dtype).at[rows.row_P].set(h_SD[token_P])

  def one_tile(t, y_RD):
    x_tD = jax.lax.dynamic_slice_in_dim(x_RD, t * tile, tile)
    y_tD = expert_mlp(x_tD, rows.expert_of_tile[t])
    return jax.lax.dynamic_update_slice_in_dim(y_RD, y_tD.astype(y_RD.dtype), t * tile, axis=0)

  y_RD = jax.lax.fori_loop(0, rows.tiles_used, one_tile, jnp.zeros_like(x_RD))
  weighted_PD = y_RD[rows.row_P] * weight_P[:, None].astype(y_RD.dtype)
  out_SD = jnp.zeros_like(h_SD).at[token_P].add(weighted_PD)
  return out_SD.reshape(B, T, D)


class ExpertRows(NamedTuple):
  """Where each (token, expert) pair sits in the experts' tiled rows (see `expert_rows`)."""

  row_P: jax.Array  # each pair's row
  expert_of_tile: jax.Array  # each tile's expert
  tiles_used: jax.Array  # tiles holding some pair (data: the loop's trip count)
  num_rows: int  # rows allocated (static)


def expert_rows(
  expert_P, num_experts: int, max_tile: int, real_experts: int | None = None
) -> tuple[ExpertRows, int]:
  """Pairs sorted by expert, each expert's run padded to whole tiles: each pair's row, each
  tile's expert, the tiles in use (data) and the rows allocated (static: enough for any
  routing, P/tile + E tiles). The tile is `max_tile` or, for few pairs, P rounded up to 8.
  real_experts: the experts [0, real_experts) whose tiles are in use (the later ones' pairs
  are placed but not run: another shard's); default all."""
  real_experts = num_experts if real_experts is None else real_experts
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
  expert_of_tile = jnp.minimum(expert_of_tile, real_experts - 1)
  tiles_used = tile_ends_E[real_experts - 1]
  return ExpertRows(row_P, expert_of_tile, tiles_used, num_tiles * tile), tile
