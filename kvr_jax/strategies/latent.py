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

The program outputs each rank's own latents per layer (and, for KV-Runahead, the last hop's
message, so the last rank holds every position without a move); `kvr_jax.inference.latent`
joins them into the model's latent cache on the last rank.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kvr_jax.core.caches import kept_cache
from kvr_jax.core.chunks import chunk_starts
from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies import zigzag
from kvr_jax.strategies.base import count_trace, logits_to_last_rank, ordered_after
from kvr_jax.strategies.runahead.hops import hop_chain
from kvr_jax.strategies.runahead.schedule import buffer_len

STRATEGIES = ("kvr", "allgather")


def _project(block, x_BTD, positions_BT):
  """(no-rope queries, rope queries, latents [B, T, C]) of rows at `positions_BT`."""
  h_BTD = block.attention_input(x_BTD)
  q_nope, q_rope = block.queries(h_BTD, positions_BT)
  return q_nope, q_rope, block.latents(h_BTD, positions_BT)


def _finish(block, x_BTD, attn_BTNv):
  return block.mlp(x_BTD + block.attention_output(attn_BTNv))


def kvr_latent_layer(block, x_BcD, buffer_1BS1C, rank, chunks: tuple[int, ...], attention):
  """Rank `rank`'s layer (every phase a `lax.switch` whose branch i has rank i's static
  shapes): (x [B, c_max, D], the forwarding buffer, (its own latents [B, c_max, C], the last
  hop's message [B, S_{p-2}, C]))."""
  p, c_max = len(chunks), x_BcD.shape[1]
  starts = chunk_starts(chunks)
  B = x_BcD.shape[0]

  def project(x_BcD, i):
    c = chunks[i]
    positions_Bc = jnp.broadcast_to(starts[i] + jnp.arange(c), (B, c))
    pad = lambda a: jnp.pad(a, [(0, 0), (0, c_max - c)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
    return tuple(pad(a) for a in _project(block, x_BcD[:, :c], positions_Bc))

  q_nope, q_rope, own_BcC = jax.lax.switch(
    rank, [functools.partial(project, i=i) for i in range(p)], x_BcD
  )
  own_1Bc1C = own_BcC[None, :, :, None]  # the latents as a one-head K,V message
  if p > 2:  # own latents after the received prefix: what this rank forwards
    at = jnp.asarray(starts, jnp.int32)[rank]
    buffer_1BS1C = jax.lax.dynamic_update_slice_in_dim(buffer_1BS1C, own_1Bc1C, at, axis=2)
  buffer_1BS1C, last_1Bs1C = hop_chain(buffer_1BS1C, own_1Bc1C, rank, chunks, block.config.kind)
  q_nope = ordered_after(q_nope, (buffer_1BS1C, last_1Bs1C))  # attention waits for the hops

  def attend_and_finish(x_BcD, q_nope, q_rope, own_BcC, buffer_1BS1C, last_1Bs1C, i):
    c, start = chunks[i], starts[i]
    own = own_BcC[:, :c]
    if i == 0:
      keys_BSC = own
    elif i == p - 1:  # the last hop's message is its prefix
      keys_BSC = jnp.concatenate([last_1Bs1C[0, :, :, 0], own], axis=1)
    else:  # the buffer holds the prefix, then its own chunk at `start`
      keys_BSC = buffer_1BS1C[0, :, : start + c, 0]
    attn = block.attend_expanded(q_nope[:, :c], q_rope[:, :c], keys_BSC, start, attention)
    out_BcD = _finish(block, x_BcD[:, :c], attn)
    return jnp.pad(out_BcD, ((0, 0), (0, c_max - c), (0, 0)))

  x_BcD = jax.lax.switch(
    rank,
    [functools.partial(attend_and_finish, i=i) for i in range(p)],
    x_BcD,
    q_nope,
    q_rope,
    own_BcC,
    buffer_1BS1C,
    last_1Bs1C,
  )
  return x_BcD, buffer_1BS1C, (own_BcC, last_1Bs1C[0, :, :, 0])


def allgather_latent_layer(block, x_B2cD, rank, context_len: int, num_ranks: int, attention):
  """A zigzag rank's layer: its two chunks' latents all-gathered with every rank's, the whole
  prompt expanded, its queries attended causally (a `lax.switch` on the rank: each chunk's
  offset static, as every kernel takes): (x [B, 2c, D], its own latents)."""
  B, p = x_B2cD.shape[0], num_ranks
  c = zigzag.chunk_len(context_len, p)
  positions_B2c = zigzag.positions(rank, c, p, B)
  q_nope, q_rope, own_B2cC = _project(block, x_B2cD, positions_B2c)
  every_pB2cC = jax.lax.all_gather(own_B2cC, AXIS)
  # Chunk j is rank j's first half (j < p) or rank 2p-1-j's second half.
  halves = [
    every_pB2cC[j, :, :c] if j < p else every_pB2cC[2 * p - 1 - j, :, c:] for j in range(2 * p)
  ]
  prompt_BSC = jnp.concatenate(halves, axis=1)  # the padded prompt's latents, in order

  def attend(q_nope, q_rope, prompt_BSC, r):
    pieces = []
    for rows, chunk in zip((slice(0, c), slice(c, 2 * c)), zigzag.rank_chunks(r, p), strict=True):
      keys_BSC = prompt_BSC[:, : (chunk + 1) * c]  # a chunk's queries see up to its own end
      pieces.append(
        block.attend_expanded(q_nope[:, rows], q_rope[:, rows], keys_BSC, chunk * c, attention)
      )
    return jnp.concatenate(pieces, axis=1)

  attn = jax.lax.switch(
    rank, [functools.partial(attend, r=r) for r in range(p)], q_nope, q_rope, prompt_BSC
  )
  return _finish(block, x_B2cD, attn), own_B2cC


@kept_cache(16)
def compile_latent(strategy: str, graphdef, mesh, chunks: tuple[int, ...], kernel):
  """The jitted SPMD program of `strategy` (STRATEGIES) on a latent-attention model: (state,
  tokens [p, B, T_rank] as the strategy arranges them) -> per rank (logits [p, B, V]: rank
  p-1's are the prompt's last position's, {"own": [p, L, B, T_rank, C], and for "kvr" "last":
  [p, L, B, S_{p-2}, C], the last hop's message})."""
  if strategy not in STRATEGIES:
    raise ValueError(f"latent-attention models run under {STRATEGIES}, not {strategy!r}")
  p, context_len = len(chunks), sum(chunks)
  P = jax.P

  def program(state, tokens_1BT):
    count_trace(f"{strategy}-latent")
    attention = kernel
    model = nnx.merge(graphdef, state)
    cfg = model.config
    rank = jax.lax.axis_index(AXIS)
    tokens_BT = tokens_1BT[0]
    B, T_rank = tokens_BT.shape
    x_BTD = model.embed(tokens_BT)
    L, C = cfg.num_layers, cfg.cache_width
    varying = lambda shape: jax.lax.pcast(jnp.zeros(shape, model.dtype), (AXIS,), to="varying")  # noqa: E731
    out = {"own": varying((L, B, T_rank, C))}
    if strategy == "kvr":
      out["last"] = varying((L, B, sum(chunks[:-1]), C))
      carry = varying((1, B, buffer_len(chunks), 1, C))
    else:
      carry = None

    def layer(block, l, state):
      x_BTD, carry, out = state
      if strategy == "kvr":
        x_BTD, carry, (own, last) = kvr_latent_layer(block, x_BTD, carry, rank, chunks, attention)
        out = {"own": out["own"].at[l].set(own), "last": out["last"].at[l].set(last)}
      else:
        x_BTD, own = allgather_latent_layer(block, x_BTD, rank, context_len, p, attention)
        out = {"own": out["own"].at[l].set(own)}
      return x_BTD, carry, out

    x_BTD, _, out = model.scan_layers(layer, (x_BTD, carry, out))
    if strategy == "kvr":
      owner, row = p - 1, chunks[-1] - 1
    else:
      owner, row = zigzag.last_position_owner(context_len, p)
    logits_BV = model.logits(x_BTD[:, row : row + 1])[:, 0]
    logits_BV = logits_to_last_rank(logits_BV, owner, p)
    return jax.tree.map(lambda a: a[None], (logits_BV, out))

  body = jax.shard_map(program, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS))
  return jax.jit(body)
