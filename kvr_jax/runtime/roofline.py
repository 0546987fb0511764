"""The roofline vocabulary of the cost model, and the steps a strategy's modelled layer is made of.

Everything here is MODELLED, never measured (kvr_jax.planning.costmodel runs it). It sits
beside the strategies because each strategy describes its own modelled layer next to its
program (`Strategy.modelled_layer`): per rank, in program order, the phases it computes, the
messages it sends and receives, and the collectives that hold every rank (`Compute`, `Send`,
`Receive`, `Collective`). `costmodel.layer_timeline` runs any such description, layer after
layer; nothing outside a strategy's module knows how that strategy waits.

A phase takes max(FLOPs / achievable FLOP/s, bytes / achievable memory bandwidth) (`Work`).
"""

from __future__ import annotations

import dataclasses

from kvr_jax.runtime import tensor_parallel
from models.config import ModelConfig
from models.kernels import AttentionKernel, get_kernel


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
  # Achievable fraction of the peak in a linear-attention layer's chunked rule (Gated
  # DeltaNet: 64 x 64 blocks, a triangular inverse, exps and a scan over the chunks), far
  # below a large matmul's on a CPU; None: the same as flops_fraction.
  linear_rule_fraction: float | None = None

  @property
  def flops(self) -> float:
    return self.peak_flops * self.flops_fraction

  @property
  def fused_attention_flops(self) -> float:
    fraction = self.fused_attention_fraction
    return self.peak_flops * (self.flops_fraction if fraction is None else fraction)

  @property
  def linear_rule_flops(self) -> float:
    fraction = self.linear_rule_fraction
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
  expert_imbalance: with model_parallel > 1, a mixture split by expert (E/m whole experts per
    device) runs on each device only the rows routed to its experts, and the busiest device
    sets the layer's pace: its rows over its group's mean (>= 1; 1: the routing balanced,
    and the figure to give where the experts' columns are split instead, as every device then
    runs every row). kvr_jax.tools.expert_load measures it from a model's router on a prompt.
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
  expert_imbalance: float = 1.0

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
    u = self.expert_imbalance
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 1 <= u < float("inf"):
      raise ValueError(
        f"expert_imbalance must be a number >= 1 (the busiest device's expert rows over its "
        f"group's mean), got {u!r}"
      )
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
  linear_rule: bool = False  # runs at the hardware's linear-rule FLOP/s

  def __add__(self, other: Work) -> Work:
    # Two pieces of one kind of kernel stay that kind; mixed kinds run at the matmul rate.
    fused = self.fused_attention and other.fused_attention
    rule = self.linear_rule and other.linear_rule
    return Work(self.flops + other.flops, self.bytes + other.bytes, fused, rule)

  def time(self, hw: Hardware) -> float:
    flops = hw.flops
    if self.fused_attention:
      flops = hw.fused_attention_flops
    elif self.linear_rule:
      flops = hw.linear_rule_flops
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
  expert_rows_scale: float = 1.0,
) -> dict[str, Work]:
  """Work of the three phases of one layer for `num_queries` tokens over `num_keys` keys.

  scores_in_memory: the attention writes its [N, T, S] scores and probabilities to memory
  (eager attention, as in the Hugging Face models the paper ran); False models a fused
  (flash) kernel. causal_skip: see Setup; the T queries sit at the end of the S keys and, with
  the model's sliding window, see at most W keys each. scored_keys: keys each query scores
  on average, when the caller knows better (the zigzag layouts); default from the above.
  expert_rows_scale: a mixture's routed rows on this device over its even share (see
  Setup.expert_imbalance; ignored by a dense MLP).
  """
  D, N, K, H = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
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
  # The MLP: FLOPs of the columns each token runs through (a mixture of experts: its k
  # experts', plus the router's [D, E]), weights read of every column some token routes to.
  # A device of a group that splits the experts whole runs `expert_rows_scale` times its
  # share of the routed rows (Setup.expert_imbalance: the busiest device); routing is whole.
  E = config.router_dim
  F_active, F_read = busiest_mlp_dims(config, B * T, expert_rows_scale)
  rest = Work(
    2 * B * T * N * H * D + 2 * B * T * D * (F_active * mlp_matrices + E),
    db * (N * H * D + mlp_matrices * D * F_read + D * E + B * T * (N * H + 2 * D + 2 * F_active)),
  )
  return {"qkv": qkv, "attention": attention, "rest": rest}


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
  queries need), a linear layer's g/m key and h/m value heads, F/m MLP columns and V/m of the
  vocabulary (rounded up: the head's matmul is
  split by rows, the last shard padded). m = 1 is the config itself."""
  m = model_parallel
  if m == 1:
    return config
  split = dict(
    num_heads=config.num_heads // m,
    num_kv_heads=tensor_parallel.kv_heads_per_shard(config, m),
    mlp_dim=config.mlp_dim // m,
    vocab_size=-(-config.vocab_size // m),
  )
  # DeepSeek-V3's experts (expert_dim: E/m whole, the same FLOPs and weights as F/m columns of
  # each when the routing is balanced) and its shared experts; Qwen3.5-MoE's shared expert.
  # Gated DeltaNet's layers (Qwen3.5, Qwen3-Next): g/m key heads with their h/m value heads.
  for name in ("expert_dim", "shared_expert_dim", "linear_num_key_heads", "linear_num_value_heads"):
    if getattr(config, name, 0):
      split[name] = getattr(config, name) // m
  return dataclasses.replace(config, **split)


def shared_mlp_dim(config: ModelConfig) -> int:
  """Columns of the shared experts every token runs through beside its routed ones."""
  return getattr(config, "shared_expert_dim", 0) or getattr(config, "expert_dim", 0) * getattr(
    config, "shared_experts", 0
  )


def busiest_mlp_dims(config: ModelConfig, num_tokens: float, rows_scale: float):
  """(MLP columns a token runs through, columns whose weights `num_tokens` tokens read) on the
  device of a model group that runs `rows_scale` times its share of the routed rows
  (Setup.expert_imbalance); the shared experts' and a dense MLP's columns are not routed."""
  if not config.router_dim or rows_scale == 1:
    return config.active_mlp_dim, config.mlp_weight_dim(num_tokens)
  shared = shared_mlp_dim(config)
  active = (config.active_mlp_dim - shared) * rows_scale + shared
  return active, config.mlp_weight_dim(num_tokens * rows_scale)


def shard_expert_imbalance(config: ModelConfig, model_parallel: int, imbalance: float) -> float:
  """The Setup.expert_imbalance of `config` on `model_parallel` devices per rank: `imbalance`
  (the busiest device's routed rows over its group's mean) where the experts are split whole
  (tensor_parallel.experts_split_whole), else 1: a dense model, one device per rank, or the
  experts' columns split (every device runs every row)."""
  E = getattr(config, "num_experts", 0)
  if model_parallel > 1 and E and tensor_parallel.experts_split_whole(E, model_parallel):
    return imbalance
  return 1.0


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


# --- the steps of a modelled layer ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Compute:
  """`seconds` of the rank's own work, named as the timelines name it ("qkv", "rest", ...)."""

  phase: str
  seconds: float


@dataclasses.dataclass(frozen=True)
class Send:
  """A message to rank `to` over its own link (one per ordered pair), `seconds` in flight.

  It starts when the sender reaches it and the link has delivered the previous layer's
  message; with `Links.held_send` (a rendezvous) also not before the receiver reaches its
  `Receive`, and the sender resumes only when it has landed. Named `phase` on the sender's
  row ("hop0", ...)."""

  to: int
  seconds: float
  phase: str


@dataclasses.dataclass(frozen=True)
class Receive:
  """Wait for the message from rank `source` (a "wait" interval when it lands later)."""

  source: int


@dataclasses.dataclass(frozen=True)
class Collective:
  """A barrier over every rank (an all-gather): it starts when the last rank reaches it and
  takes `seconds` on every rank."""

  phase: str
  seconds: float


Step = Compute | Send | Receive | Collective


@dataclasses.dataclass(frozen=True)
class ModelledLayer:
  """One layer of a strategy's program as the cost model sees it (every layer is alike).

  steps[r]: rank r's steps in program order. partition: each rank's tokens as the strategy
  lays them out. flops[r], bytes[r]: rank r's work per layer. link_bytes: bytes per layer
  on each hop (KV-Runahead) or received by each rank (the peers). after_layers: seconds
  between the last layer and the logits (the peers' cache move onto the last rank)."""

  steps: tuple[tuple[Step, ...], ...]
  partition: tuple[int, ...]
  flops: tuple[float, ...]
  bytes: tuple[float, ...]
  link_bytes: tuple[float, ...] = ()
  after_layers: float = 0.0


def phase_seconds(
  config: ModelConfig, phases: dict[str, Work], num_tokens: float, setup: Setup
) -> dict[str, float]:
  """Seconds of each phase on `setup`'s hardware; the "rest" also holds the layer's
  all-reduces over the rank's model group (`model_reduce_time` of `num_tokens`)."""
  seconds = {name: work.time(setup.hardware) for name, work in phases.items()}
  seconds["rest"] += model_reduce_time(config, num_tokens, setup)
  return seconds


def work_kwargs(setup: Setup) -> dict:
  """The `phase_work` keywords a setup fixes."""
  return dict(
    batch=setup.batch,
    dtype_bytes=setup.dtype_bytes,
    scores_in_memory=setup.scores_in_memory,
    causal_skip=setup.causal_skip,
    expert_rows_scale=setup.expert_imbalance if setup.model_parallel > 1 else 1.0,
  )


def total_work(phases: dict[str, Work]) -> Work:
  return sum(phases.values(), Work(0, 0))
