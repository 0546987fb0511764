"""A TTFT cost model of the prefill programs: per-rank FLOPs and bytes, and a timeline.

Everything this module prints is MODELLED, never measured. It exists to (a) drive the
partition search without running the model and (b) reproduce the paper's GPU-scale figures,
which this machine cannot measure.

Per layer, each rank runs three phases (the same split as the real program):
  qkv        input norm, Q/K/V projections, RoPE            on its c_i tokens
  attention  c_i queries against S_i keys                    (TSP: C/p against C, dense)
  rest       output projection and MLP                       on its c_i tokens
Each phase takes max(FLOPs / achievable FLOP/s, bytes / achievable memory bandwidth).

The timeline follows the dependencies of the real programs:
  kvr   ranks run independently; hop k couples only ranks k and k+1. It starts when rank k
        holds [0, S_k) (its own qkv done and hop k-1 arrived) and link k is free, and takes
        bytes / bandwidth_k + latency. With a flash/fused kernel rank i > 0 attends the first
        rows of its own chunk (the diagonal; as many as the program does before its hop,
        strategies.runahead.rows_before_hop) before it waits for the prefix, and the prefix
        and the rest of the diagonal after it. The receiver waits for the message before its
        attention. `Links.held_send` says whether the sender waits too: False, sends are
        asynchronous (XLA's collective-permute-start/-done, an NCCL send on its own stream)
        and the sender goes on while the message is in flight; True, the hop is a
        rendezvous (gloo on CPU, measured by the timelines): it starts when both ends reach
        it and the sender resumes when it lands. The `local` calibration sets it.
  tsp   the all-gather is a barrier over all ranks; a ring all-gather takes p-1 steps of one
        chunk each over the slowest link.
  single one device, dense masked attention (as the Hugging Face baseline computes it).
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
import math
from collections.abc import Sequence

from kvr_jax.core.chunks import check_ranks, prefix_ends
from kvr_jax.runtime import tensor_parallel
from kvr_jax.strategies import runahead, zigzag
from models.config import ModelConfig
from models.kernels import AttentionKernel, get_kernel
from models.layers import window_start


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator. `*_fraction` are the stated achievable fractions of the peaks."""

  name: str
  peak_flops: float  # dense fp16/bf16 FLOP/s
  memory_bandwidth: float  # bytes/s
  flops_fraction: float
  memory_fraction: float
  note: str = ""
  # Achievable fraction of the peak inside a fused (flash) attention kernel, whose exp and
  # rescaling make it slower than a plain matmul; None: the same as flops_fraction.
  fused_attention_fraction: float | None = None
  memory_bytes: float | None = None  # device memory, where known (what fits: device_memory)

  @property
  def flops(self) -> float:
    return self.peak_flops * self.flops_fraction

  @property
  def fused_attention_flops(self) -> float:
    fraction = self.fused_attention_fraction
    return self.peak_flops * (self.flops_fraction if fraction is None else fraction)

  @property
  def bandwidth(self) -> float:
    return self.memory_bandwidth * self.memory_fraction


@dataclasses.dataclass(frozen=True)
class Links:
  """Point-to-point links between rank k and k+1 (link k); `slow` overrides single links."""

  bandwidth: float  # bytes/s
  latency: float = 10e-6  # seconds per message
  slow: tuple[tuple[int, float], ...] = ()  # (link index, bytes/s)
  # A hop is a rendezvous: it starts when its receiver is ready too, and its sender resumes
  # only when it has landed (see the module docstring).
  held_send: bool = False

  def link_bandwidth(self, k: int) -> float:
    return dict(self.slow).get(k, self.bandwidth)

  def slowest(self, num_ranks: int) -> float:
    return min([self.link_bandwidth(k) for k in range(max(num_ranks - 1, 1))])

  def with_slow_link(self, k: int, bandwidth: float) -> Links:
    slow = dict(self.slow)
    slow[k] = bandwidth
    return dataclasses.replace(self, slow=tuple(sorted(slow.items())))


def kernel_flags(kernel: str | AttentionKernel) -> dict[str, bool]:
  """What the cost model needs of an attention kernel (its record's fields), as the keyword
  arguments `Setup`, `phase_work`, `make_setup` and `resolve_partition` take."""
  kernel = get_kernel(kernel)
  return {
    "scores_in_memory": kernel.scores_in_memory,
    "causal_skip": kernel.skips_causal_blocks,
  }


@dataclasses.dataclass(frozen=True)
class Setup:
  """What a modelled prefill runs on: the device, the links, and the shape of the traffic.

  dtype_bytes: bytes per weight/activation element (2 for fp16/bf16, 4 for float32).
  scores_in_memory: the attention kernel writes its score matrix to memory (dense and
    blocked kernels, eager Hugging Face attention); False models a fused (flash) kernel.
  causal_skip: the kernel skips the masked future inside a rank's own diagonal block (flash,
    blocked, fused): T queries at the end of an S-key prefix then see S - (T-1)/2 keys on
    average instead of S (the paper's dense accounting).
  """

  hardware: Hardware
  links: Links
  dtype_bytes: int
  batch: int = 1
  scores_in_memory: bool = True
  causal_skip: bool = False
  # Tensor parallelism inside each rank (see the module docstring): the devices per rank, and
  # the links between them (required when model_parallel > 1).
  model_parallel: int = 1
  model_links: Links | None = None

  @property
  def diagonal_first(self) -> bool:
    """KV-Runahead's ranks attend their own chunk before the prefix arrives: the kernels
    whose partials merge (flash, fused: no scores in memory, the future skipped)."""
    return self.causal_skip and not self.scores_in_memory

  def __post_init__(self):
    if not isinstance(self.hardware, Hardware) or not isinstance(self.links, Links):
      raise ValueError(
        "Setup takes Hardware and Links objects; for presets by name use "
        "kvr_jax.planning.presets.make_setup"
      )
    if self.dtype_bytes not in (1, 2, 4, 8):
      raise ValueError(f"`dtype_bytes` must be 1, 2, 4 or 8, got {self.dtype_bytes!r}")
    if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
      raise ValueError(f"batch must be >= 1, got {self.batch!r}")
    m = self.model_parallel
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
      raise ValueError(f"model_parallel must be an integer >= 1, got {m!r}")
    if m > 1 and not isinstance(self.model_links, Links):
      raise ValueError(
        f"model_parallel={m} needs `model_links` (a Links: the links inside a rank's model "
        "group, over which its all-reduces run)"
      )


# --- per-phase work ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Work:
  flops: float
  bytes: float
  fused_attention: bool = False  # runs at the hardware's fused-attention FLOP/s

  def __add__(self, other: Work) -> Work:
    fused = self.fused_attention and other.fused_attention  # two fused-kernel pieces stay one
    return Work(self.flops + other.flops, self.bytes + other.bytes, fused)

  def time(self, hw: Hardware) -> float:
    flops = hw.fused_attention_flops if self.fused_attention else hw.flops
    return max(self.flops / flops, self.bytes / hw.bandwidth)


def visible_keys(first_query: int, num_queries: int, window: int | None) -> float:
  """Keys a causal query sees, on average over queries at positions [first, first + T):
  q + 1, or min(q + 1, W) with a sliding window W."""
  T, a, b = num_queries, first_query + 1, first_query + num_queries  # sum min(x, W), x in [a, b]
  if T <= 0:
    return 0.0
  if window is None or b <= window:
    return (a + b) / 2
  if a >= window:
    return float(window)
  return ((a + window) * (window - a + 1) / 2 + (b - window) * window) / T


def phase_work(
  config: ModelConfig,
  num_queries: int,
  num_keys: int,
  batch: int,
  dtype_bytes: int,
  *,
  scores_in_memory: bool = True,
  causal_skip: bool = False,
  scored_keys: float | None = None,
) -> dict[str, Work]:
  """Work of the three phases of one layer for `num_queries` tokens over `num_keys` keys.

  scores_in_memory: the attention writes its [N, T, S] scores and probabilities to memory
  (eager attention, as in the Hugging Face models the paper ran); False models a fused
  (flash) kernel. causal_skip: see Setup; the T queries sit at the end of the S keys and, with
  the model's sliding window, see at most W keys each. scored_keys: keys each query scores
  on average, when the caller knows better (the zigzag layouts); default from the above.
  """
  D, N, K, H, F = (
    config.d_model,
    config.num_heads,
    config.num_kv_heads,
    config.head_dim,
    config.mlp_dim,
  )
  T, S, B, db = num_queries, num_keys, batch, dtype_bytes
  mlp_matrices = config.mlp_matrices
  qkv = Work(
    2 * B * T * D * (N + 2 * K) * H, db * (D * (N + 2 * K) * H + B * T * (D + (N + 2 * K) * H))
  )
  # Keys each query scores, on average: all S, or only the visible ones.
  if scored_keys is not None:
    S_scored = scored_keys
  elif causal_skip and T <= S:
    S_scored = visible_keys(S - T, T, config.sliding_window)
  else:
    S_scored = S
  score_traffic = 4 * B * N * T * S_scored * db if scores_in_memory else 0  # w, r, w, r
  attention = Work(
    4 * B * N * H * T * S_scored,
    db * (2 * B * T * N * H + 2 * B * S * K * H) + score_traffic,
    fused_attention=not scores_in_memory,
  )
  rest = Work(
    2 * B * T * N * H * D + 2 * B * T * D * F * mlp_matrices,
    db * (N * H * D + mlp_matrices * D * F + B * T * (N * H + 2 * D + 2 * F)),
  )
  return {"qkv": qkv, "attention": attention, "rest": rest}


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


def head_work(config: ModelConfig, batch: int, dtype_bytes: int) -> Work:
  """Final norm and vocabulary projection of the last position."""
  return Work(
    2 * batch * config.d_model * config.vocab_size, dtype_bytes * config.d_model * config.vocab_size
  )


def kv_message_bytes(config: ModelConfig, num_tokens: int, batch: int, dtype_bytes: int) -> int:
  """K and V of `num_tokens` tokens of one layer, with the model's own KV head count."""
  return 2 * batch * num_tokens * config.num_kv_heads * config.head_dim * dtype_bytes


def model_shard(config: ModelConfig, model_parallel: int) -> ModelConfig:
  """What one of a rank's `model_parallel` tensor-parallel shards holds and computes: N/m query
  heads, K/m KV heads (one, replicated, on every shard when K < m: the least each shard's
  queries need), F/m MLP columns and V/m of the vocabulary (rounded up: the head's matmul is
  split by rows, the last shard padded). m = 1 is the config itself."""
  m = model_parallel
  if m == 1:
    return config
  return dataclasses.replace(
    config,
    num_heads=config.num_heads // m,
    num_kv_heads=tensor_parallel.kv_heads_per_shard(config, m),
    mlp_dim=config.mlp_dim // m,
    vocab_size=-(-config.vocab_size // m),
  )


def model_reduce_time(config: ModelConfig, num_tokens: float, setup: Setup) -> float:
  """Seconds of one layer's all-reduces over a rank's model group for `num_tokens` tokens:
  the attention output projection and the MLP's down projection each end in partial sums of
  [B, T, D] (one all-reduce for Falcon, whose parallel block adds both before reducing). A
  ring all-reduce moves 2(m-1)/m of the bytes over the group's slowest link in 2(m-1) steps."""
  m = setup.model_parallel
  if m == 1:
    return 0.0
  ln = setup.model_links
  reductions = config.reductions_per_layer
  nbytes = setup.batch * num_tokens * config.d_model * setup.dtype_bytes
  one = 2 * (m - 1) / m * nbytes / ln.slowest(m) + 2 * (m - 1) * ln.latency
  return reductions * one


def device_memory(config: ModelConfig, context_len: int, setup: Setup) -> float:
  """Bytes one device of the rank that decodes holds after the prefill: its shard of the
  weights (1/m of every matrix, the norms whole) and its shard of the whole prompt's KV cache
  (every strategy leaves the cache on the last rank, cache="last"). Activations of the
  prefill are left out: they are per-chunk, a few percent at these sizes."""
  m, db = setup.model_parallel, setup.dtype_bytes
  shard = model_shard(config, m)
  cache = kv_message_bytes(shard, context_len, setup.batch, db) * config.num_layers
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


def simulate(
  config: ModelConfig,
  strategy: str,
  context_len: int,
  setup: Setup,
  *,
  num_ranks: int = 1,
  partition: Sequence[int] | None = None,
) -> Simulation:
  """Modelled TTFT of one prefill (see the module docstring for the dependency rules). With
  `setup.model_parallel` > 1 the per-rank figures are one device's (one model shard's)."""
  if not isinstance(setup, Setup):
    raise ValueError(f"`setup` must be a costmodel.Setup, got {type(setup).__name__}")
  hw, ln = setup.hardware, setup.links
  config = model_shard(config, setup.model_parallel)
  C, L, B, db = context_len, config.num_layers, setup.batch, setup.dtype_bytes
  check_ranks(C, num_ranks)
  head = head_work(config, B, db).time(hw)
  kw = dict(
    batch=B,
    dtype_bytes=db,
    scores_in_memory=setup.scores_in_memory,
    causal_skip=setup.causal_skip,
  )

  if strategy == "single":
    phases = phase_work(config, C, C, **kw)
    per_layer = sum(w.time(hw) for w in phases.values()) + model_reduce_time(config, C, setup)
    total = sum(phases.values(), Work(0, 0))
    ttft = L * per_layer + head
    return Simulation("single", (C,), ttft, [ttft], [total.flops], [total.bytes], [])

  p = num_ranks
  if strategy == "tsp":
    c = math.ceil(C / p)
    phases = phase_work(config, c, c * p, **kw)
    chunk_bytes = kv_message_bytes(config, c, B, db)
    allgather = (p - 1) * (chunk_bytes / ln.slowest(p) + ln.latency) if p > 1 else 0.0
    t_qkv = phases["qkv"].time(hw)
    t_after = phases["attention"].time(hw) + phases["rest"].time(hw)
    t_after += model_reduce_time(config, c, setup)
    # Identical ranks: each layer is qkv, the all-gather barrier, then attention and MLP.
    ttft = tsp_timeline(t_qkv, allgather, t_after, L) + head
    total = sum(phases.values(), Work(0, 0))
    return Simulation(
      "tsp",
      (c,) * p,
      ttft,
      [ttft] * p,
      [total.flops] * p,
      [total.bytes] * p,
      [(p - 1) * chunk_bytes] * p,
    )

  if strategy in ("ring", "allgather"):
    return _simulate_zigzag(config, strategy, C, setup, p)
  if strategy != "kvr":
    raise ValueError(f"unknown strategy {strategy!r}; expected single, tsp, kvr, ring or allgather")
  if partition is None or len(partition) != p or sum(partition) != C or min(partition) < 1:
    raise ValueError(
      f"kvr needs a partition of {p} positive chunks summing to {C}, got {partition!r}"
    )
  chunks = tuple(int(c) for c in partition)
  phases, hop_bytes, hop_time = _kvr_layer(config, chunks, setup)
  t = _kvr_phase_times(config, chunks, phases, setup)
  t_after = [a + r for a, r in zip(t["attention"], t["rest"], strict=True)]
  free = kvr_timeline(t["qkv"], t_after, hop_time, L, t["diagonal"], ln.held_send)
  ttft = free[-1] + head
  totals = [sum(ph.values(), Work(0, 0)) for ph in phases]
  return Simulation(
    "kvr",
    chunks,
    ttft,
    list(free),
    [w.flops for w in totals],
    [w.bytes for w in totals],
    [float(b) for b in hop_bytes],
  )


def _kvr_layer(config, chunks: tuple[int, ...], setup: Setup):
  """One layer of KV-Runahead: each rank's phase Work, and each hop's bytes and seconds.
  With a sliding window rank i attends from its window start and hop k carries the last W-1
  keys of [0, S_k): both bounded by W (strategies.runahead). With a kernel whose partials
  merge (`Setup.diagonal_first`) rank i > 0 has a "diagonal" phase (its own chunk, before the
  hop) and its "attention" is the prefix alone."""
  ln, B, db = setup.links, setup.batch, setup.dtype_bytes
  kw = dict(
    batch=B,
    dtype_bytes=db,
    scores_in_memory=setup.scores_in_memory,
    causal_skip=setup.causal_skip,
  )
  p, ends, window = len(chunks), prefix_ends(chunks), config.sliding_window
  keys = [ends[i] - window_start(ends[i] - chunks[i], window) for i in range(p)]
  phases = [phase_work(config, chunks[i], keys[i], **kw) for i in range(p)]
  if setup.diagonal_first:
    early_rows = runahead.rows_before_hop(config, chunks)
    for i in range(1, p):
      c, prefix, r = chunks[i], keys[i] - chunks[i], early_rows[i]
      if prefix <= 0:
        continue
      # Before the hop: rows [0, r) of the diagonal, a causal r x r square.
      diagonal = phase_work(config, r, r, **kw)["attention"]
      # The prefix lies wholly before the queries: the keys they see there, on average.
      seen = visible_keys(prefix, c, window) - visible_keys(0, c, window)
      rest = dict(kw, causal_skip=False)
      attention = phase_work(config, c, prefix, **rest, scored_keys=seen)["attention"]
      if r < c:  # after it: rows [r, c) at the end of the chunk's c keys
        attention = attention + phase_work(config, c - r, c, **kw)["attention"]
      phases[i] = dict(phases[i], diagonal=diagonal, attention=attention)
  hop_tokens = [ends[k] - window_start(ends[k], window) for k in range(p - 1)]
  hop_bytes = [kv_message_bytes(config, hop_tokens[k], B, db) for k in range(p - 1)]
  hop_time = [hop_bytes[k] / ln.link_bandwidth(k) + ln.latency for k in range(p - 1)]
  return phases, hop_bytes, hop_time


def _kvr_phase_times(config, chunks, phases, setup: Setup) -> dict[str, list[float]]:
  """Per rank seconds of each KVR phase ("diagonal" 0 where the rank has none); the rest
  includes the layer's all-reduces over the rank's model group."""
  names = ("qkv", "diagonal", "attention", "rest")
  t = {n: [ph[n].time(setup.hardware) if n in ph else 0.0 for ph in phases] for n in names}
  reduce = [model_reduce_time(config, c, setup) for c in chunks]
  t["rest"] = [r + a for r, a in zip(t["rest"], reduce, strict=True)]
  return t


def schedule(
  config: ModelConfig,
  strategy: str,
  context_len: int,
  setup: Setup,
  *,
  num_ranks: int,
  partition: Sequence[int] | None = None,
) -> list[tuple[int, int, str, float, float]]:
  """MODELLED timeline of kvr, ring or allgather: (rank, layer, phase, start, end) intervals
  from the same per-layer phases `simulate` sums (the head after them is not included)."""
  L, config = config.num_layers, model_shard(config, setup.model_parallel)
  if strategy == "kvr":
    chunks = tuple(int(c) for c in partition)
    phases, _, hop_time = _kvr_layer(config, chunks, setup)
    t = _kvr_phase_times(config, chunks, phases, setup)
    return kvr_schedule(
      t["qkv"], t["attention"], t["rest"], hop_time, L, t["diagonal"], setup.links.held_send
    )
  if strategy not in ("ring", "allgather"):
    raise ValueError(f"no modelled timeline for {strategy!r}; expected kvr, ring or allgather")
  # Every rank alike: the layer's phases one after the other.
  phases = _zigzag_layer(config, strategy, context_len, setup, num_ranks)[0]
  t, out = 0.0, []
  for layer in range(L):
    for phase, seconds in phases:
      out.extend((r, layer, phase, t, t + seconds) for r in range(num_ranks))
      t += seconds
  return out


def _zigzag_layer(config, strategy: str, context_len: int, setup: Setup, p: int):
  """One layer of a zigzag peer: ([(phase, seconds)], seconds after the last layer, the
  attention Work, the qkv/rest Work of 2c tokens, the bytes each rank sends per layer)."""
  hw, ln = setup.hardware, setup.links
  L, B, db = config.num_layers, setup.batch, setup.dtype_bytes
  c = zigzag.chunk_len(context_len, p)
  padded = zigzag.padded_len(context_len, p)
  kw = dict(batch=B, dtype_bytes=db, scores_in_memory=setup.scores_in_memory)
  own = phase_work(config, 2 * c, 2 * c, **kw)  # qkv and rest of 2c tokens
  t_qkv = own["qkv"].time(hw)
  t_rest = own["rest"].time(hw) + model_reduce_time(config, 2 * c, setup)
  message = kv_message_bytes(config, 2 * c, B, db)
  t_message = message / ln.slowest(p) + ln.latency if p > 1 else 0.0
  window = config.sliding_window
  # cache="last": every other rank's parts (2c tokens, L layers) move onto the last rank.
  t_cache = (p - 1) * (L * message / ln.slowest(p) + ln.latency)
  # Keys each query of the busiest rank sees, causally (and within the window).
  visible = max(
    (visible_keys(r * c, c, window) + visible_keys((2 * p - 1 - r) * c, c, window)) / 2
    for r in range(p)
  )
  if strategy == "ring":
    # Every step scores 2c^2 entries: a [2c queries x c keys] unmasked block. With a window
    # most blocks are skipped; the visible work is spread over the p steps (an
    # approximation: the real steps are uneven), and every message still travels.
    per_step = c if window is None else visible / p
    step = phase_work(config, 2 * c, c, **kw, scored_keys=per_step)["attention"]
    t_step = step.time(hw)
    # The next step's K,V travel while this step computes, unless sends hold their sender
    # (Links.held_send: then a step's compute and its message take turns).
    overlap = t_step + t_message if ln.held_send else max(t_step, t_message)
    t_attention = (p - 1) * overlap + t_step
    phases = [("qkv", t_qkv), ("step", t_attention), ("rest", t_rest)]
    return phases, t_cache, Work(step.flops * p, step.bytes * p), own, message
  keys = visible if setup.causal_skip else padded
  attention = phase_work(config, 2 * c, keys, **kw, scored_keys=keys)["attention"]
  t_gather = (p - 1) * t_message
  phases = [("qkv", t_qkv), ("allgather", t_gather), ("attention", attention.time(hw))]
  return phases + [("rest", t_rest)], t_cache, attention, own, message


def _simulate_zigzag(config, strategy: str, context_len: int, setup: Setup, p: int):
  """The zigzag peers: 2p chunks of c tokens (prompt padded to 2pc), rank r holds chunks r
  and 2p-1-r, so every rank has the same work; messages go over the slowest link.

  ring       per layer: qkv on 2c tokens; p attention steps of 2c^2 visible scores each (own
             chunks causally at step 0, then a c x 2c or 2c x c unmasked block); the K,V of
             2c tokens for step s+1 is sent while step s computes, so each step takes the
             longer of the two (their sum with `Links.held_send`); then the rest.
  allgather  per layer: qkv; a barrier all-gather of 2c-token K,V in p-1 ring steps; attention
             of the two chunks over every visible key ((2pc+1)/2 per query on average with a
             causally skipping kernel, all 2pc with the dense one); the rest.
  Both: after the last layer the cache moves onto the last rank (p-1 messages of L layers'
  2c-token K,V, cache="last"; KV-Runahead's last rank already holds it from its hops).
  """
  L = config.num_layers
  phases, after, attention, own, message = _zigzag_layer(config, strategy, context_len, setup, p)
  head = head_work(config, setup.batch, setup.dtype_bytes).time(setup.hardware)
  ttft = L * sum(seconds for _, seconds in phases) + after + head
  link = [float(message * (p - 1))] * p
  total = own["qkv"] + attention + own["rest"]
  return Simulation(
    strategy,
    zigzag.layout(context_len, p),
    ttft,
    [ttft] * p,
    [total.flops] * p,
    [total.bytes] * p,
    link,
  )


def kvr_timeline(
  t_qkv: Sequence[float],
  t_after: Sequence[float],
  hop_time: Sequence[float],
  num_layers: int,
  t_diagonal: Sequence[float] | None = None,
  held_send: bool = False,
) -> list[float]:
  """When each rank finishes its last layer, from per-layer phase times (see module doc).

  t_qkv[i]: rank i's qkv phase; t_after[i]: its attention + rest; hop_time[k]: hop k's time;
  t_diagonal[i]: attention rank i does before its prefix arrives (kvr_schedule); held_send:
  hops are rendezvous (`Links.held_send`).
  """
  # kvr_schedule's recurrence without its intervals (the search calls this ~50k times per
  # paper grid); tests/test_costmodel.py checks that the two agree.
  p = len(t_qkv)
  t_diagonal = [0.0] * p if t_diagonal is None else list(t_diagonal)
  free = [0.0] * p
  link_free = [0.0] * max(p - 1, 0)
  for _ in range(num_layers):
    own = [free[i] + t_qkv[i] + t_diagonal[i] for i in range(p)]
    arrive = 0.0
    for i in range(p):
      ready = max(own[i], arrive) if i > 0 else own[i]
      resume = ready
      if i < p - 1:
        send = max(ready, link_free[i], own[i + 1] if held_send else 0.0)
        arrive = link_free[i] = send + hop_time[i]
        if held_send:
          resume = arrive
      free[i] = resume + t_after[i]
  return free


def kvr_schedule(
  t_qkv: Sequence[float],
  t_attention: Sequence[float],
  t_rest: Sequence[float],
  hop_time: Sequence[float],
  num_layers: int,
  t_diagonal: Sequence[float] | None = None,
  held_send: bool = False,
) -> list[tuple[int, int, str, float, float]]:
  """The modelled KVR timeline as intervals (rank, layer, phase, start, end): per layer each
  rank's "qkv", its "diagonal" (rank i > 0 attending its first diagonal rows before the
  prefix arrives, where t_diagonal[i] > 0), its "wait" for hop i-1 (when the prefix arrives
  later than that), "attention" (over the prefix and the rest of the diagonal) and "rest";
  "hop{k}" intervals (on the sender's row) run from when rank k holds its prefix and link k
  is free to when rank k+1 has it. A rank forwards only after its diagonal (the program's
  order: the diagonal comes before the hops). held_send: a hop also waits for its receiver's
  qkv and diagonal, and its sender "wait"s until it has landed; otherwise a sender does not
  wait for its send (asynchronous sends)."""
  p = len(t_qkv)
  t_diagonal = [0.0] * p if t_diagonal is None else list(t_diagonal)
  free = [0.0] * p  # rank i is done with the previous layer
  link_free = [0.0] * max(p - 1, 0)  # link k has delivered the previous layer's message
  out = []
  for layer in range(num_layers):
    own = []  # when rank i's work before its hop is done: its K,V written, its diagonal rows
    for i in range(p):
      out.append((i, layer, "qkv", free[i], free[i] + t_qkv[i]))
      own.append(free[i] + t_qkv[i])
      if t_diagonal[i] > 0:
        out.append((i, layer, "diagonal", own[i], own[i] + t_diagonal[i]))
        own[i] += t_diagonal[i]
    arrive = 0.0
    for i in range(p):
      ready = own[i]
      if i > 0 and arrive > own[i]:  # prefix [0, S_{i-1}) received after its own work
        out.append((i, layer, "wait", own[i], arrive))
        ready = arrive
      resume = ready
      if i < p - 1:
        send = max(ready, link_free[i], own[i + 1] if held_send else 0.0)
        arrive = send + hop_time[i]
        link_free[i] = arrive
        out.append((i, layer, f"hop{i}", send, arrive))
        if held_send:  # the sender is held until its message has landed
          out.append((i, layer, "wait", ready, arrive))
          resume = arrive
      out.append((i, layer, "attention", resume, resume + t_attention[i]))
      free[i] = resume + t_attention[i] + t_rest[i]
      out.append((i, layer, "rest", resume + t_attention[i], free[i]))
  return out


def tsp_timeline(t_qkv: float, t_allgather: float, t_after: float, num_layers: int) -> float:
  """Identical ranks; the all-gather is a barrier between qkv and attention in every layer."""
  return num_layers * (t_qkv + t_allgather + t_after)


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
