"""The modelled layer of a latent-attention model (DeepSeek-V3: kvr_jax/strategies/latent.py)
per strategy, for the cost model: what each rank computes and moves.

Per token, a rank projects its queries and its latent (C = R + r numbers). Every key position
a rank attends is expanded from its latent into the N heads' no-rope keys and values (R x N x
(n + v) per position: for DeepSeek-V3 R = 512, N = 128, n + v = 256: 16.8 MFLOP, about the
projections of a whole token), then its queries attend (causal, flash: n + r key and v value
numbers per head). So expansion is work that follows the keys a rank sees, like attention:

  single      one rank: the prompt's C positions expanded once.
  kvr         rank i receives the latent prefix [0, S_{i-1}) (S x C numbers: 71x fewer bytes
              than DeepSeek-V3's per-head K,V), forwards it, expands S_i positions, attends its
              c_i queries. The last rank expands the whole prompt: KV-Runahead's split must
              weigh expansion beside attention, which this model lets KVR-S do.
  allgather   an all-gather of every rank's 2c latents over the slowest link; every rank then
              expands the whole (padded) prompt and attends its two zigzag chunks.
  ring        the zigzag layout; p steps, each expanding and attending the 2c latents that
              arrived (the whole padded prompt over the p steps, as all-gather CP expands it)
              while the next 2c pass to the next rank: a step takes the longer of the two.
  tsp         even contiguous chunks of c = ceil(C/p); an all-gather of every rank's c
              latents, the whole padded prompt expanded on every rank, dense masked scores
              (every query against all p c keys; their memory traffic is not modelled here).
"""

from __future__ import annotations

from kvr_jax.core.chunks import chunk_starts, prefix_ends
from kvr_jax.runtime.roofline import (
  Collective,
  Compute,
  ModelledLayer,
  Receive,
  Send,
  Work,
  busiest_mlp_dims,
  model_reduce_time,
)
from kvr_jax.strategies import zigzag
from kvr_jax.strategies.linear_modelled import layer_of


def latent_phases(config, queries: float, keys: float, scored: float, setup) -> dict[str, Work]:
  """{"qkv": queries and latents of `queries` tokens, "expand": `keys` positions' keys and
  values from their latents, "attention": `queries` x `scored` (the keys each sees, summed
  over queries / queries) scores and sums, "rest": out-projection and MLP}."""
  D, N, Q, R = config.d_model, config.num_heads, config.q_lora_rank, config.kv_lora_rank
  n, r, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
  C = config.cache_width
  B, db, T, S = setup.batch, setup.dtype_bytes, queries, keys
  q_weights = D * Q + Q * N * (n + r) if Q else D * N * (n + r)
  qkv = Work(
    2 * B * T * (q_weights + D * C),
    db * (q_weights + D * C) + db * B * T * (D + N * (n + r) + C),
  )
  expand = Work(2 * B * S * R * N * (n + v), db * R * N * (n + v) + db * B * S * (C + N * (n + v)))
  attention = Work(
    2 * B * N * T * scored * (n + r + v),
    db * B * (T * N * (2 * (n + r) + v) + S * N * (n + r + v)),
    fused_attention=True,
  )
  E = config.router_dim
  rows_scale = setup.expert_imbalance if setup.model_parallel > 1 else 1.0
  F_active, F_read = busiest_mlp_dims(config, B * T, rows_scale)
  rest = Work(
    2 * B * T * (N * v * D + config.mlp_matrices * D * F_active + D * E),
    db * (N * v * D + config.mlp_matrices * D * F_read + D * E)
    + db * B * T * (N * v + 2 * D + 2 * F_active),
  )
  return {"qkv": qkv, "expand": expand, "attention": attention, "rest": rest}


def latent_bytes(config, positions: float, setup) -> float:
  """One hop or gathered piece: `positions` latents, one headless copy."""
  return setup.batch * positions * config.cache_width * setup.dtype_bytes


def _causal_keys(start: int, c: int) -> float:
  """Keys the queries [start, start + c) see on average (query q sees q + 1)."""
  return start + (c + 1) / 2 if c else 0.0


def _computes(work, hw, names, reduce_s: float = 0.0) -> list:
  """The phases `names` as Computes; `reduce_s`: the model group's all-reduces of the rows
  (`model_reduce_time`), added to the rest."""
  return [
    Compute(name, work[name].time(hw) + (reduce_s if name == "rest" else 0)) for name in names
  ]


def single_latent_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  C = chunks[0]
  work = latent_phases(config, C, C, _causal_keys(0, C), setup)
  reduce_s = model_reduce_time(config, C, setup)
  steps = [_computes(work, setup.hardware, ("qkv", "expand", "attention", "rest"), reduce_s)]
  return layer_of(steps, chunks, [work], ())


def kvr_latent_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  """Rank i: its queries and latents, the prefix received and forwarded, S_i positions
  expanded, its c_i queries attended, the rest (module docstring)."""
  p, hw, links = len(chunks), setup.hardware, setup.links
  starts, ends = chunk_starts(chunks), prefix_ends(chunks)
  works, steps, sent = [], [], []
  for i, c in enumerate(chunks):
    work = latent_phases(config, c, ends[i], _causal_keys(starts[i], c), setup)
    rank = _computes(work, hw, ("qkv",))
    if i > 0:
      rank.append(Receive(i - 1))
    if i < p - 1:
      hop = latent_bytes(config, ends[i], setup)
      rank.append(Send(i + 1, hop / links.link_bandwidth(i) + links.latency, f"hop{i}"))
      sent.append(hop)
    rank += _computes(
      work, hw, ("expand", "attention", "rest"), model_reduce_time(config, c, setup)
    )
    works.append(work)
    steps.append(rank)
  return layer_of(steps, chunks, works, sent)


def _zigzag_rank_work(config, rank: int, c: int, p: int, setup) -> dict[str, Work]:
  """A zigzag rank's phases: its two chunks' 2c queries over the whole padded prompt, every
  position expanded, the keys its two chunks see causally scored (ring and all-gather CP)."""
  first, second = zigzag.rank_chunks(rank, p)
  scored = (_causal_keys(first * c, c) + _causal_keys(second * c, c)) / 2
  return latent_phases(config, 2 * c, 2 * p * c, scored, setup)


def allgather_latent_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  """Every rank: its two chunks' latents, the all-gather, the whole padded prompt expanded,
  its two chunks attended (module docstring)."""
  p, hw, links = len(chunks), setup.hardware, setup.links
  c = zigzag.chunk_len(context_len, p)
  piece = latent_bytes(config, 2 * c, setup)
  gather = (p - 1) * (piece / links.slowest(p) + links.latency) if p > 1 else 0.0
  reduce_s = model_reduce_time(config, 2 * c, setup)
  works, steps = [], []
  for rank in range(p):
    work = _zigzag_rank_work(config, rank, c, p, setup)
    works.append(work)
    rank_steps = _computes(work, hw, ("qkv",)) + [Collective("gather latents", gather)]
    steps.append(rank_steps + _computes(work, hw, ("expand", "attention", "rest"), reduce_s))
  return layer_of(steps, chunks, works, [(p - 1) * piece] * p)


def ring_latent_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  """Every rank: its two chunks' latents, then p steps of (expand and attend the 2c latents
  held, pass them on), the rest (module docstring)."""
  p, hw, links = len(chunks), setup.hardware, setup.links
  c = zigzag.chunk_len(context_len, p)
  piece = latent_bytes(config, 2 * c, setup)
  message = piece / links.slowest(p) + links.latency
  reduce_s = model_reduce_time(config, 2 * c, setup)
  works, steps = [], []
  for rank in range(p):
    work = _zigzag_rank_work(config, rank, c, p, setup)
    works.append(work)
    step = (work["expand"].time(hw) + work["attention"].time(hw)) / p
    passing = step + message if links.held_send else max(step, message)
    rank_steps = _computes(work, hw, ("qkv",)) + [Compute("steps", (p - 1) * passing + step)]
    steps.append(rank_steps + _computes(work, hw, ("rest",), reduce_s))
  return layer_of(steps, chunks, works, [(p - 1) * piece] * p)


def tsp_latent_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  """Every rank: its contiguous chunk's latents, the all-gather, the whole padded prompt
  expanded, every query scored against every key (module docstring)."""
  p, hw, links = len(chunks), setup.hardware, setup.links
  c = -(-context_len // p)
  piece = latent_bytes(config, c, setup)
  gather = (p - 1) * (piece / links.slowest(p) + links.latency) if p > 1 else 0.0
  work = latent_phases(config, c, p * c, p * c, setup)
  reduce_s = model_reduce_time(config, c, setup)
  rank_steps = _computes(work, hw, ("qkv",)) + [Collective("gather latents", gather)]
  rank_steps += _computes(work, hw, ("expand", "attention", "rest"), reduce_s)
  return layer_of([rank_steps] * p, chunks, [work] * p, [(p - 1) * piece] * p)
