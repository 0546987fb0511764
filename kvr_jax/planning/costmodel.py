"""A TTFT cost model of the prefill programs: per-rank FLOPs and bytes, and a timeline.

Everything this module prints is MODELLED, never measured. It exists to (a) drive the
partition search without running the model and (b) reproduce the paper's GPU-scale figures,
which this machine cannot measure.

Per layer, each rank runs three phases (the same split as the real program):
  qkv        input norm, Q/K/V projections, RoPE            on its c_i tokens
  attention  c_i queries against S_i keys                    (TSP: C/p against C, dense)
  rest       output projection and MLP                       on its c_i tokens
Each phase takes max(FLOPs / achievable FLOP/s, bytes / achievable memory bandwidth)
(kvr_jax.runtime.roofline, the vocabulary).

Each strategy describes its own layer next to its program (`Strategy.modelled_layer`): per
rank, in program order, its phases (`Compute`), its messages (`Send`, `Receive`) and its
barriers (`Collective`). `layer_timeline` runs any such description layer after layer, and
`simulate` (with its `intervals`, the Gantt chart) is that one timeline for every registered
strategy (kvr_jax/planning/layer_timeline.py runs it):
  a Send starts when its sender reaches it and its link has delivered the previous layer's
    message, and lands `seconds` later; the receiver waits at its Receive until it has.
    `Links.held_send` says whether the sender waits too: False, sends are asynchronous
    (XLA's collective-permute-start/-done, an NCCL send on its own stream) and the sender goes
    on while the message is in flight; True, the message is a rendezvous (gloo on CPU,
    measured by the timelines): it starts when the receiver reaches its Receive too, and the
    sender resumes when it lands. The `local` calibration sets it.
  a Collective starts on every rank when the last rank reaches it.
What each strategy's layer holds (KV-Runahead's hop chain and early diagonal rows, TSP's
all-gather barrier, the zigzag peers' overlapped ring steps or gathered K,V and their cache
move after the last layer) is documented beside it in kvr_jax/strategies/.
Bandwidth is per link, so one slow link (the paper's non-uniform case) can be modelled.
Tensor parallelism inside a rank (`Setup.model_parallel` = m, a 2-D mesh ranks x model): a rank
is m devices sharing every layer Megatron-style (query heads, MLP columns and the vocabulary
split m ways; KV heads too, replicated where there are fewer than m), so each phase is one
shard's work (`model_shard`), plus the layer's all-reduces of [B, T, D] over the group's links
`Setup.model_links` (`model_reduce_time`) in its rest; each shard sends its own KV heads to its
counterpart in the next rank, all shards at once, each over its own link (`links` is per
device).
A model's sliding window W bounds what kernels that skip masked work score (each query at
most W keys), KV-Runahead's hops (at most W-1 keys) and its ranks' key reads; TSP's dense
scores and the peers' messages stay as they are.

Pure: it takes Hardware and Links objects (in one frozen `Setup`); named presets and the
`local` calibration live in kvr_jax.planning.presets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvr_jax.core.chunks import check_chunks, check_ranks, moved_rows
from kvr_jax.core.layer_support import check_full_partition
from kvr_jax.planning.layer_timeline import layer_timeline
from kvr_jax.runtime.roofline import (
  Collective,
  Compute,
  Hardware,
  Links,
  ModelledLayer,
  Receive,
  Send,
  Setup,
  Work,
  head_work,
  kernel_flags,
  kv_message_bytes,
  model_reduce_time,
  model_shard,
  phase_work,
  visible_keys,
)
from kvr_jax.strategies import get_strategy
from models.config import ModelConfig
from models.layer_kinds import AttentionKind, GatedDeltaNetKind

__all__ = [
  "Collective",
  "Compute",
  "Hardware",
  "LayerFlops",
  "Links",
  "ModelledLayer",
  "Receive",
  "Send",
  "Setup",
  "Simulation",
  "Work",
  "device_memory",
  "head_work",
  "kernel_flags",
  "kv_message_bytes",
  "layer_flops",
  "layer_timeline",
  "lower_bound",
  "model_reduce_time",
  "model_shard",
  "phase_work",
  "simulate",
  "visible_keys",
]


@dataclasses.dataclass(frozen=True)
class LayerFlops:
  """Matmul FLOPs of one layer on one rank, by part."""

  projections: float  # Q, K, V and the output projection
  attention: float  # QK^T and PV over the prefix
  mlp: float

  @property
  def total(self) -> float:
    return self.projections + self.attention + self.mlp


def layer_flops(config: ModelConfig, num_queries: int, num_keys: int, batch: int = 1) -> LayerFlops:
  """One layer, `num_queries` tokens attending to `num_keys` keys (c_i and S_i for KVR rank i;
  C/p and C for TSP; T and T on one device). Elementwise work (norms, RoPE, softmax) is left
  out, which is why compiled programs count a few percent more."""
  phases = phase_work(config, num_queries, num_keys, batch, 1)
  out_projection = 2 * batch * num_queries * config.num_heads * config.head_dim * config.d_model
  return LayerFlops(
    phases["qkv"].flops + out_projection,
    phases["attention"].flops,
    phases["rest"].flops - out_projection,
  )


def device_memory(config: ModelConfig, context_len: int, setup: Setup) -> float:
  """Bytes one device of the rank that decodes holds after the prefill: its shard of the
  weights (1/m of every matrix, the norms whole) and its shard of the whole prompt's past
  (every strategy leaves the cache on the last rank, cache="last"): each layer's as its kind
  keeps it (`hop_bytes` of the whole prompt: K,V of every position, a window's last W-1, a
  linear layer's state and halo, a latent per position). Activations of the prefill are
  left out: they are per-chunk, a few percent at these sizes."""
  m, db = setup.model_parallel, setup.dtype_bytes
  shard = model_shard(config, m)
  cache = sum(kind.hop_bytes(shard, context_len, setup.batch, db) for kind in shard.layer_kinds)
  return config.num_params() / m * db + cache


# --- the timeline ------------------------------------------------------------------------------


@dataclasses.dataclass
class Simulation:
  """A modelled prefill. Times in seconds; per-rank lists are indexed by rank."""

  strategy: str
  partition: tuple[int, ...]
  ttft: float
  rank_finish: list[float]  # when each rank finished its last layer
  rank_flops: list[float]  # per layer
  rank_memory_bytes: list[float]  # per layer
  link_bytes: list[float]  # per layer: hop k (kvr) or per-rank all-gather receive (tsp)
  # Per layer, per rank: the hidden states a rank sends to lay them out again (KV-Runahead
  # on a hybrid with a split per kind, `with_moves`; zeros otherwise), beside link_bytes.
  moved_bytes: list[float]


def modelled_layer(
  config: ModelConfig,
  strategy: str,
  context_len: int,
  setup: Setup,
  num_ranks: int = 1,
  partition: Sequence[int] | None = None,
) -> ModelledLayer:
  """The strategy's own description of one layer (`Strategy.modelled_layer`) of one shard's
  config (`model_shard`), for its layout of the prompt."""
  if not isinstance(setup, Setup):
    raise ValueError(f"`setup` must be a costmodel.Setup, got {type(setup).__name__}")
  spec = get_strategy(strategy)
  check_ranks(context_len, num_ranks)
  chunks = None
  if spec.partitioned:
    if partition is None:
      raise ValueError(
        f"{spec.name} needs a partition of {num_ranks} chunks summing to {context_len}"
      )
    chunks = check_chunks(partition, context_len, num_ranks)
  config = model_shard(config, setup.model_parallel)
  chunks = spec.layout(context_len, num_ranks, chunks)
  if isinstance(config.kind, AttentionKind):
    return spec.modelled_layer(config, context_len, setup, chunks)
  # A kind with a past of its own (a linear layer's state, a latent per position): the
  # strategy's layer for it, from its record.
  return spec.layers_of_kind(config.kind).modelled(config, context_len, setup, chunks)


# The steps of an attention layer that a prefill's last layer runs for one row only: its
# attention and rest (the owner of the last row's one row: taken as no time).
ONE_ROW_STEPS = ("attention", "rest")
# Ring's steps (attention and passes overlapped, K,V or latents): in the last layer a
# gather of the same bytes into the owner of the last row.
RING_STEPS = ("step", "steps")


def last_layer(layer: ModelledLayer, setup: Setup) -> ModelledLayer:
  """A model's last attention layer as every strategy's program runs it: only the prompt's
  last row is read, so its attention and rest run for that row alone on the rank holding it
  (`models.base.finish_one_row`), KV-Runahead's ranks before the last end the layer with
  their hops, and the peers gather every rank's entries into the owner (ring instead of its
  steps, all-gather CP instead of its all-gather). Its projections, hops, gathers
  and a latent layer's expansion stay; its flops and bytes are the layer's (the per-layer
  means)."""
  p, links = len(layer.steps), setup.links
  ranks = []
  for r, rank_steps in enumerate(layer.steps):
    kept = []
    for step in rank_steps:
      if isinstance(step, Compute) and step.phase in ONE_ROW_STEPS:
        continue
      if isinstance(step, Compute) and step.phase in RING_STEPS:
        gather = layer.link_bytes[r] / links.slowest(p) + (p - 1) * links.latency
        step = Collective("gather", gather)
      elif isinstance(step, Collective) and step.phase == "allgather":
        # The same bytes into the owner alone (strategies.base.gather_to_owner): on a
        # full-duplex link the owner's ingress takes as long as every rank's. (TSP's program
        # keeps its all-gather there, outside the layer's cond: the same time.)
        step = Collective("gather", step.seconds)
      kept.append(step)
    ranks.append(tuple(kept))
  return dataclasses.replace(layer, steps=tuple(ranks))


def simulate(
  config: ModelConfig,
  strategy: str,
  context_len: int,
  setup: Setup,
  *,
  num_ranks: int = 1,
  partition: Sequence[int] | None = None,
  intervals: list | None = None,
  full_partition: Sequence[int] | None = None,
) -> Simulation:
  """Modelled TTFT of one prefill: the strategy's modelled layer through `layer_timeline`,
  then what follows the last layer (a cache move) and the head on the last rank. With
  `setup.model_parallel` > 1 the per-rank figures are one device's (one model shard's); with
  layers of several kinds each kind's layers are modelled as theirs (per-layer figures: the
  mean over the layers).
  intervals: a list to append the modelled timeline to, (rank, layer, phase, start, end)
  (the Gantt chart beside a measured one; the cache move and the head not included).
  full_partition (KV-Runahead on a hybrid): the full layers' own split, `partition` the
  linear layers'; each full layer then moves the hidden states into its split and back
  (`with_moves`)."""
  full_chunks = check_full_partition(
    config, get_strategy(strategy), full_partition, context_len, num_ranks
  )

  def partition_of(kind):
    linear = isinstance(kind, GatedDeltaNetKind)
    return partition if full_chunks is None or linear else full_chunks

  by_kind = {
    kind: modelled_layer(
      config.of_kind(kind), strategy, context_len, setup, num_ranks, partition_of(kind)
    )
    for kind in config.kinds
  }
  layers = [by_kind[kind] for kind in config.layer_kinds]
  if not isinstance(config.layer_kinds[-1], GatedDeltaNetKind):
    layers[-1] = last_layer(layers[-1], setup)
  moved_bytes = [0.0] * num_ranks
  if full_chunks is not None:
    layers, moved_bytes = with_moves(config, layers, tuple(partition), full_chunks, setup)
  shard = model_shard(config, setup.model_parallel)
  finish = layer_timeline(layers, config.num_layers, setup.links.held_send, intervals)
  head = head_work(shard, setup.batch, setup.dtype_bytes).time(setup.hardware)
  last = layers[-1]

  def per_layer(field):  # the mean over the layers (they differ where their windows do)
    columns = zip(*(getattr(d, field) for d in layers), strict=True)
    return [sum(values) / len(layers) for values in columns]

  return Simulation(
    get_strategy(strategy).name,
    last.partition,
    finish[-1] + last.after_layers + head,
    finish,
    per_layer("flops"),
    per_layer("bytes"),
    per_layer("link_bytes"),
    [b / len(layers) for b in moved_bytes],
  )


def move_steps(from_chunks, to_chunks, row_bytes: float, links) -> tuple[list[list], list]:
  """Each rank's steps to lay hidden states out again (`strategies.base.reshard_rows`): the
  pieces in the program's order (`moved_rows`'), a send ("move") on the sender and a receive
  on the receiver (in that one order no rendezvous waits on a later one). Neighbours over
  their own link, others over the slowest. Also the bytes each rank sends."""
  p = len(from_chunks)
  steps, sent = [[] for _ in range(p)], [0.0] * p
  for s, d, _, _, rows in moved_rows(from_chunks, to_chunks):
    bandwidth = links.link_bandwidth(min(s, d)) if abs(s - d) == 1 else links.slowest(p)
    steps[s].append(Send(d, rows * row_bytes / bandwidth + links.latency, "move"))
    steps[d].append(Receive(s))
    sent[s] += rows * row_bytes
  return steps, sent


def with_moves(config, layers: list, linear_chunks, full_chunks, setup: Setup):
  """The modelled layers of KV-Runahead on a hybrid whose full layers take their own split:
  each full layer starts by moving the hidden states (D numbers a token) into its split and
  ends by moving them back; the model's last layer moves nothing back (one row is read).
  Returns (the layers, the bytes of hidden states each rank sends over all of them)."""
  sent = [0.0] * len(linear_chunks)
  if linear_chunks == full_chunks:
    return layers, sent
  row_bytes = setup.batch * config.d_model * setup.dtype_bytes
  enter, enter_sent = move_steps(linear_chunks, full_chunks, row_bytes, setup.links)
  leave, leave_sent = move_steps(full_chunks, linear_chunks, row_bytes, setup.links)
  moved = {}  # one description per original (the timeline's steady state runs on identity)
  last = len(layers) - 1
  for l, kind in enumerate(config.layer_kinds):
    if isinstance(kind, GatedDeltaNetKind):
      continue
    layer = layers[l]
    key = (id(layer), l == last)
    if key not in moved:
      after = [[] for _ in enter] if l == last else leave
      steps = tuple((*a, *steps, *b) for a, steps, b in zip(enter, layer.steps, after, strict=True))
      moved[key] = dataclasses.replace(layer, steps=steps)
    layers[l] = moved[key]
    for r, (e, v) in enumerate(zip(enter_sent, leave_sent, strict=True)):
      sent[r] += e + (0.0 if l == last else v)
  return layers, sent


def lower_bound(config: ModelConfig, context_len: int, num_ranks: int, setup: Setup) -> float:
  """Modelled ideal: the single-device causal work (C(C+1)/2 scores, not C^2) split perfectly
  over p ranks (of m devices each, `setup.model_parallel`) with free communication. No real
  schedule reaches it."""
  hw, scores_in_memory = setup.hardware, setup.scores_in_memory
  config = model_shard(config, setup.model_parallel)
  B, db, C = setup.batch, setup.dtype_bytes, context_len
  phases = phase_work(config, C, C, batch=B, dtype_bytes=db, scores_in_memory=scores_in_memory)
  causal = phase_work(
    config, C, (C + 1) / 2, batch=B, dtype_bytes=db, scores_in_memory=scores_in_memory
  )["attention"]
  per_layer = (phases["qkv"].time(hw) + causal.time(hw) + phases["rest"].time(hw)) / num_ranks
  return config.num_layers * per_layer + head_work(config, B, db).time(hw)
