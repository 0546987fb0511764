"""Modelled linear-attention layers (Gated DeltaNet, `models.layer_kinds.GatedDeltaNetKind`):
one `ModelledLayer` per strategy, which kvr_jax.planning.costmodel times beside the full
layers' (`costmodel.modelled_layer` comes here for a layer of that kind). Every figure is
MODELLED.

A linear layer's work is linear in its tokens: the projections (q, k, v fused, z, a, b), the
convolution, the chunked rule (per 64-token chunk and value head: the intra-chunk scores and
solve, c (k + v) per token, and the state reads and write, 3 k v per token), out_proj and
the MLP. Running a span ahead of its entering state (the entry map) adds, per chunk and head,
the chain of [k, k] step matrices (k^3) and Q_eff (c k^2), and per token the correction
(k v). How the strategies pass the state:

  single      the whole prompt, no entry map.
  kvr         each rank its contiguous chunk, rank 0 without the entry map (it enters with
              zeros); hop k (rank k to k+1) one state [B, h, k, v] float32, after which the
              receiver computes A S + B before it forwards: the chain's serial work.
  ring, allgather, tsp
              each rank its chunks, every chunk ahead (the entry map); an all-gather of every
              rank's maps (A [h, k, k] and B [h, k, v] per chunk, float32: a barrier), then
              each rank composes the maps before its chunks (a small matmul per earlier
              chunk): kvr_jax/strategies/hybrid.py's `zigzag_linear_layer` (TSP's program
              does not run hybrids; modelled the same way on its one chunk per rank).
  replicated  (not a strategy; `replicated_linear_layer`) every rank runs every token of the
              linear layer, as tpu-inference runs Qwen3.5 under context parallelism, after an
              all-gather of the hidden states where the previous layer was a full one.
"""

from __future__ import annotations

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

RULE_CHUNK = 64  # the chunked form's chunk (models.gated_deltanet.CHUNK)
STATE_BYTES = 4  # the state is float32


def rule_flops_per_token(heads: int, d_k: int, d_v: int, entry_map: bool) -> float:
  """The chunked rule's FLOPs per token (all value heads): the intra-chunk scores and the
  triangular system applied to values and keys, c (k + v) each, and the state's reads and
  write, 3 k v; ahead of the state (the entry map) also the chain of [k, k] step matrices
  (k^3 per chunk) and Q_eff (k^2 per token)."""
  rule = RULE_CHUNK * (d_k + d_v) * 2 + 3 * d_k * d_v
  ahead = d_k**3 / RULE_CHUNK + d_k * d_k if entry_map else 0.0
  return 2 * heads * (rule + ahead)


def linear_phases(config, tokens: float, setup, entry_map: bool) -> dict[str, Work]:
  """{"linear": the projections and convolution, "rule": the chunked rule (with the entry
  map where it runs ahead; at the hardware's linear-rule rate), "rest": the correction,
  gated norm, out_proj and MLP} of `tokens` tokens."""
  D, C, W = config.d_model, config.conv_channels, config.linear_conv_kernel
  h, k, v = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
  B, db, T = setup.batch, setup.dtype_bytes, tokens
  projections = D * (C + h * v + 2 * h)
  linear = Work(
    2 * B * T * (projections + C * W),
    db * (projections + C * W) + db * B * T * (D + 2 * C + 2 * h * v),
  )
  rule = Work(B * T * rule_flops_per_token(h, k, v, entry_map), 0.0, linear_rule=True)
  correction = h * k * v if entry_map else 0.0
  # The MLP as the roofline counts it: the columns a token runs through (a mixture's chosen
  # and shared experts) and the router's; weights read of every column some token routes to;
  # on a model group, the busiest device's routed rows (Setup.expert_imbalance).
  rows_scale = setup.expert_imbalance if setup.model_parallel > 1 else 1.0
  F_active, F_read = busiest_mlp_dims(config, B * T, rows_scale)
  E = config.router_dim
  rest = Work(
    2 * B * T * (correction + h * v * D + config.mlp_matrices * D * F_active + D * E),
    db * (h * v * D + config.mlp_matrices * D * F_read + D * E)
    + db * B * T * (2 * h * v + 2 * D + 2 * F_active),
  )
  return {"linear": linear, "rule": rule, "rest": rest}


def _mixer_time(work: dict[str, Work], hw) -> float:
  """The projections' and the rule's seconds: one step, each at its own rate."""
  return work["linear"].time(hw) + work["rule"].time(hw)


def _rest(config, tokens: float, work: dict[str, Work], setup) -> Compute:
  """The correction, gated norm, out_proj and MLP, with a model group's all-reduces of their
  partial sums (`model_reduce_time`: none on one device)."""
  return Compute(
    "rest", work["rest"].time(setup.hardware) + model_reduce_time(config, tokens, setup)
  )


def state_bytes(config, batch: int) -> int:
  """One hop of KV-Runahead on a linear layer: the state (and the halo, sent apart)."""
  return (
    batch
    * config.linear_num_value_heads
    * config.linear_key_head_dim
    * (config.linear_value_head_dim)
    * STATE_BYTES
  )


def map_bytes(config, batch: int) -> int:
  """One span's entry map: A [h, k, k] and B [h, k, v], float32."""
  h, k, v = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
  return batch * h * k * (k + v) * STATE_BYTES


def _chain_work(config, setup) -> Work:
  """A S + B on one state: what a KV-Runahead rank computes between receiving and sending."""
  h, k, v = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
  return Work(2 * setup.batch * h * k * k * v, STATE_BYTES * setup.batch * h * k * (k + 2 * v))


def layer_of(steps, partition, works, link_bytes) -> ModelledLayer:
  """A ModelledLayer from each rank's steps and its phases' work (summed per rank)."""
  totals = [sum(w.values(), Work(0, 0)) for w in works]
  return ModelledLayer(
    tuple(tuple(s) for s in steps),
    tuple(partition),
    tuple(t.flops for t in totals),
    tuple(t.bytes for t in totals),
    tuple(float(b) for b in link_bytes),
  )


def single_linear_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  work = linear_phases(config, chunks[0], setup, entry_map=False)
  hw = setup.hardware
  steps = [(Compute("linear", _mixer_time(work, hw)), _rest(config, chunks[0], work, setup))]
  return layer_of(steps, chunks, [work], ())


def kvr_linear_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  """Each rank its chunk ahead, then the state chain (see the module docstring)."""
  p, hw, links = len(chunks), setup.hardware, setup.links
  hop = state_bytes(config, setup.batch)
  chain = _chain_work(config, setup).time(hw)
  works, steps = [], []
  for i, c in enumerate(chunks):
    work = linear_phases(config, c, setup, entry_map=i > 0)
    rank = [Compute("linear", _mixer_time(work, hw))]
    if i > 0:
      rank += [Receive(i - 1), Compute("chain", chain)]
    if i < p - 1:
      rank.append(Send(i + 1, hop / links.link_bandwidth(i) + links.latency, f"hop{i}"))
    rank.append(_rest(config, c, work, setup))
    works.append(work)
    steps.append(rank)
  return layer_of(steps, chunks, works, [hop] * (p - 1))


def gathered_maps_layer(pieces_per_rank: int):
  """A peer's linear layer: every rank its `pieces_per_rank` chunks ahead, an all-gather of
  every chunk's entry map over the slowest link, the composition, the correction."""

  def modelled(config, context_len: int, setup, chunks) -> ModelledLayer:
    p, hw, links = len(chunks), setup.hardware, setup.links
    maps = pieces_per_rank * map_bytes(config, setup.batch)
    gather = (p - 1) * (maps / links.slowest(p) + links.latency) if p > 1 else 0.0
    compose = (pieces_per_rank * p) * _chain_work(config, setup).time(hw)
    works, steps = [], []
    for c in chunks:
      work = linear_phases(config, c, setup, entry_map=True)
      works.append(work)
      steps.append(
        (
          Compute("linear", _mixer_time(work, hw)),
          Collective("gather maps", gather),
          Compute("chain", compose),
          _rest(config, c, work, setup),
        )
      )
    return layer_of(steps, chunks, works, [(p - 1) * maps] * p)

  return modelled


def replicated_linear_layer(
  config, context_len: int, setup, num_ranks: int, gather_hidden: bool
) -> ModelledLayer:
  """Every rank runs all `context_len` tokens (no state to pass); `gather_hidden`: first an
  all-gather of the hidden states (each rank's C/p rows of D) over the slowest link, where
  the previous layer ran its tokens split."""
  p, hw, links = num_ranks, setup.hardware, setup.links
  work = linear_phases(config, context_len, setup, entry_map=False)
  rows = setup.batch * (context_len / p) * config.d_model * setup.dtype_bytes
  steps = [Compute("linear", _mixer_time(work, hw)), _rest(config, context_len, work, setup)]
  if gather_hidden and p > 1:
    steps.insert(0, Collective("gather x", (p - 1) * (rows / links.slowest(p) + links.latency)))
  sent = [(p - 1) * rows if gather_hidden else 0.0] * p
  return layer_of([steps] * p, (context_len,) * p, [work] * p, sent)
