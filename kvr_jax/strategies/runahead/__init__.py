"""KV-Runahead prefill under `jax.shard_map`: uneven chunks, a point-to-point K,V hop chain.

One jitted SPMD program; every rank runs the layer loop below on its own chunk. Per layer:

  rank:        0            1                 2                    3
  own chunk  [0,S0)      [S0,S1)           [S1,S2)              [S2,C)
  project    q,k,v       q,k,v             q,k,v                q,k,v       (switch: c_i rows)
  diagonal     .         c1 x c1 causal    c2 x c2              c3 x c3     (switch: flash)
  hop 0      kv[0,S0) ─────▶ kv[0,S0)
  hop 1                  kv[0,S1) ───────────▶ kv[0,S1)
  hop 2                                    kv[0,S2) ──────────────▶ kv[0,S2)
  attend     c0 x S0     c1 x S0 prefix    c2 x S1 prefix       c3 x S2     (switch: static,
                         + merge           + merge              + merge      lse merge)
  finish     MLP c0      MLP c1            MLP c2               MLP c3

Every rank holds a [B, c_max] padded chunk because SPMD needs one static shape. Two bodies
(`Options.body`):
  "one" (`one_body`; the flash kernel): every rank runs one body, its real length,
    start and early rows are data; the projections and the MLP run over row blocks in loops
    whose trip count is the rank's length, and the flash kernel visits only the query and
    key blocks inside the real lengths: at most one block of padding per rank, and a program
    that does not grow with p.
  "per-rank" (`per_rank_body`; dense, blocked, fused, cudnn, whose bounds are static): a
    `lax.switch` on the rank index whose branch i slices exactly c_i rows and S_i keys: no
    FLOP on padding, but every branch is compiled (the program grows with p).
Hop k is a `ppermute` with the single pair (k, k+1) that sends the static prefix [0, S_k) of
rank k's keys, K and V stacked in one message, with their own K heads (never repeated to the
N query heads): the hops' sizes follow the split in both bodies (SPMD collectives need static
shapes), so a new split is a new program.

Better than the paper: a rank does not idle while it waits for its prefix. With a kernel that
returns its log-sum-exp (flash, fused), rank i > 0 first attends the first r_i rows of its own
chunk (the causal diagonal square, which needs nothing from anyone), then receives the prefix
and attends its queries to it and the rest of the diagonal, and the partials merge exactly in
float32 (`attention.merge_partials`). An optimization barrier orders the early rows before the
hops, so that XLA cannot move them behind the receive; rank 0 has no prefix and attends after
it has sent hop 0.

How many rows go first (`rows_before_hop`): a hop is a rendezvous, not a fire-and-forget send.
Its sender's next work is ordered behind the hop (the barrier below), and the transfer itself
needs both ends (gloo on CPU holds the send until the receive is posted; NCCL does for large
messages). So rank i should reach hop i-1 when its sender does, no later: its qkv plus r_i
diagonal rows take as many FLOPs as the sender's work before that send. Whole diagonals first
(the previous order) held rank 0 back by rank 1's diagonal minus the qkv difference in the
first layer, and left rank 1 idle by as much after the last (the measured timelines showed
both); in the layers between, any r_i is as good when the split is balanced.

Buffers. Rank 0's message is its own chunk. A forwarding rank (0 < k < p-1) keeps an
accumulation buffer carried across layers (never zero-filled: each layer overwrites what it
reads, [window start, S_k)), its own K,V written at its chunk's start, the received prefix
before them. The last hop's message is attended where it arrives: the last rank forwards
nothing, so with p = 2 there is no prompt-long buffer at all. `ppermute` gives zeros to ranks
outside the pair, so only rank k+1 writes hop k into its buffer (`jnp.where`).

Each rank outputs its own chunk's K,V ([L, 2, B*c_max, K, H], padded to the largest chunk),
never a prompt-long stack; they stay where they were computed (cache="sharded";
kvr_jax.inference.kv_cache). For the paper's layout (cache="last": the whole cache on the
last rank) nothing needs to move: the last hop of every layer already carried [0, S_{p-2})
to the last rank, which attended it. With `keep_last_hop` the program also returns each
layer's last-hop message ([L, 2, B*S_{p-2}, K, H]; zeros on the ranks it did not reach, the
price of SPMD's one output shape) and the last rank's cache is that message and its own chunk,
joined where they lie. (Moving the parts after the program instead sent rank 0's chunk to the
last rank twice and cost KVR 0.3 s of 2.6 s at 8k on two processes.) Prefill asks for it only
where memory allows (kvr_jax.inference.kv_cache.join_affordable).

Sliding window W (Mistral): query q sees only keys (q - W, q], so hop k carries only the last
W-1 keys of [0, S_k) and each rank attends to [start - W + 1, S_i): hop bytes and attention
are bounded by W whatever the prompt length. The last rank then holds the K,V decode needs,
positions [C - W + 1, C) and more; positions no rank passed on stay zero in its cache, and
decode masks by the window, so it never reads them. The cache parts hold every position
(each rank keeps its whole chunk). So cache="last" joins the last hop on windowed layers too
(`last_hop_holds_cache`): the kept message is set at its positions, zeros before its window
start, and the last rank's cache is whole where decode reads it (no move; where the window is
shorter than the prompt the last rank keeps that layer's ring only, cut from the message and
its own chunk: kvr_jax.inference.kv_cache.join_rings_on_device).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from kvr_jax.core.caches import kept_cache
from kvr_jax.core.chunks import chunk_starts
from kvr_jax.runtime.cache_layout import contiguous_layout
from kvr_jax.runtime.mesh import global_array
from kvr_jax.strategies import latent_modelled, linear_modelled
from kvr_jax.strategies.base import (
  CAUSAL_KERNELS,
  KindLayers,
  Strategy,
)
from kvr_jax.strategies.runahead.bodies import one_body, per_rank_body
from kvr_jax.strategies.runahead.hops import hop_chain, hop_chain_as_data, varying_axes
from kvr_jax.strategies.runahead.modelled import (
  RankWork,
  hop_chain_steps,
  layer_work,
  modelled_layer,
  rank_work,
)
from kvr_jax.strategies.runahead.rank_layer import map_row_blocks, rank_layer
from kvr_jax.strategies.runahead.schedule import (
  BODIES,
  HOP_GRANULE,
  PER_RANK_UP_TO,
  OneBodyShape,
  check_body,
  early_rows_in_blocks,
  hop_span,
  last_hop_holds_cache,
  one_body_block,
  rows_before_hop,
)
from models.kernels import get_kernel
from models.layer_kinds import GatedDeltaNetKind, LatentAttentionKind

# What the strategy's callers read, from the modules that own it.
__all__ = [
  "BODIES",
  "HOP_GRANULE",
  "ONE_BODY_STRATEGY",
  "PER_RANK_STRATEGY",
  "PER_RANK_UP_TO",
  "SPLIT_AS_DATA",
  "STRATEGY",
  "OneBodyShape",
  "Options",
  "RankWork",
  "configured",
  "early_rows_in_blocks",
  "hop_chain",
  "hop_chain_as_data",
  "hop_chain_steps",
  "hop_span",
  "kvr_body",
  "layer_work",
  "map_row_blocks",
  "modelled_layer",
  "one_body_block",
  "pad_chunks",
  "rank_layer",
  "rank_work",
  "rows_before_hop",
  "split_as_data_strategy",
  "on_split",
  "table_on",
  "varying_axes",
  "last_hop_holds_cache",
  "with_body",
]


def kvr_body(graphdef, chunks, attention, timeline, keep_last_hop, body=None):
  """KV-Runahead's rank (`Strategy.rank_body`). body: "one" (every rank runs one
  program body, lengths as data; the default for the kernels with `lengths_as_data` on more
  than PER_RANK_UP_TO ranks) or "per-rank" (a switch branch per rank, the default otherwise);
  part of the cache key.

  Its program: f(state, tokens [p, B, c_max]) -> (logits [p, B, V], {"kv": kv parts [p, L,
  2, B*c_max, K, H]}); rank p-1's logits are the answer, rank i's part is its chunk's K,V.
  keep_last_hop (only where `last_hop_holds_cache`): "kv" is (kv parts, last-hop messages
  [p, L, 2, B*S_{p-2}, K, H], batch folded), rank p-1's message being the prompt's first
  S_{p-2} positions."""
  body = check_body(body, attention, len(chunks))
  make = one_body if body == "one" else per_rank_body
  return make(graphdef, chunks, attention, timeline, keep_last_hop)


def pad_chunks(tokens_BC, chunks: tuple[int, ...]):
  """[B, C] -> [p, B, c_max]: rank i's tokens, zero-padded to the largest chunk."""
  tokens_BC = np.asarray(tokens_BC)
  c_max = max(chunks)
  out = np.zeros((len(chunks), tokens_BC.shape[0], c_max), tokens_BC.dtype)
  for i, (start, c) in enumerate(zip(chunk_starts(chunks), chunks, strict=True)):
    out[i, :, :c] = tokens_BC[:, start : start + c]
  return out


def layout(context_len: int, num_ranks: int, chunks: tuple[int, ...]) -> tuple[int, ...]:
  return chunks  # the user's (validated) partition, rank 0 the earliest tokens


@dataclasses.dataclass(frozen=True)
class Options:
  """KV-Runahead's own program options, frozen into its record (`Strategy.options`) and so
  into every program's cache key. body: "one" (every rank runs one body, lengths as data),
  "per-rank" (a switch branch per rank, every kernel), or None (`check_body`'s choice for the
  kernel and rank count). split_shape: an envelope (`OneBodyShape.envelope`) whose one
  program takes the split as data, with `config` (the model's, for the split's table); None:
  the split is static, a program per split. Kept last hop and probes are per program
  (`by_kind.compile_by_kind(keep_last_hop=, timeline=)`); the split as data refuses both."""

  body: str | None = None
  split_shape: OneBodyShape | None = None
  config: Any = None

  def __post_init__(self):
    if self.body is not None and self.body not in BODIES:
      raise ValueError(f"unknown KV-Runahead body {self.body!r}; expected one of {BODIES}")
    if self.split_shape is not None and (self.body == "per-rank" or self.config is None):
      raise ValueError("the split as data runs the one body and needs the model's config")


STRATEGY = Strategy(
  name="kvr",
  auto_candidate=True,
  description="KV-Runahead: uneven chunks, point-to-point K,V hop chain, causal skipping",
  partitioned=True,
  attention_kinds=CAUSAL_KERNELS,
  layout=layout,
  arrange=pad_chunks,
  modelled_layer=modelled_layer,
  timeline_probes=True,
  cache_from_last_hop=last_hop_holds_cache,
  options=Options(),
  prefix_chain=True,
  rank_body=kvr_body,
  # Its chain carries a latent as it carries K,V, and a linear layer's state down the ranks
  # (strategies.latent, strategies.hybrid: `prefix_chain`).
  kind_layers={
    LatentAttentionKind: KindLayers(latent_modelled.kvr_latent_layer),
    GatedDeltaNetKind: KindLayers(linear_modelled.kvr_linear_layer),
  },
)


def configured(options: Options) -> Strategy:
  """KV-Runahead's record with these options: the registry's `STRATEGY` for the defaults; a
  fixed body (launch.benchmark's kvr-per-rank-* and kvr-one-body-* variants, the reference
  the one body was measured against: one record each, made once); or one program for every
  split that fits a shape (what the measured search times its candidates on). Not in the
  registry: `prefill` takes the record itself."""
  if options == STRATEGY.options:
    return STRATEGY
  if options.split_shape is not None:
    return _split_as_data(options)
  return _FIXED_BODIES[options.body]


def _with_fixed_body(body: str) -> Strategy:
  name = "one-body" if body == "one" else body
  return dataclasses.replace(
    STRATEGY,
    name=f"kvr-{name}",
    variant_of=STRATEGY.name,
    description=f"KV-Runahead's {name} program on every rank count, for comparisons",
    options=Options(body=body),
  )


_FIXED_BODIES = {body: _with_fixed_body(body) for body in BODIES}
PER_RANK_STRATEGY = _FIXED_BODIES["per-rank"]
ONE_BODY_STRATEGY = _FIXED_BODIES["one"]


def with_body(body: str | None) -> Strategy:
  """KV-Runahead with its program body fixed (`BODIES`), or its default choice (None)."""
  return configured(Options(body=body))


SPLIT_AS_DATA = "kvr-split-as-data"


@kept_cache(64)
def table_on(mesh, config, shape: OneBodyShape, chunks: tuple[int, ...]):
  """A split's table on every rank of `mesh`, made once per split (not on every call)."""
  return global_array(shape.table(config, chunks), jax.NamedSharding(mesh, jax.P()))


def on_split(program, mesh, config, shape: OneBodyShape, chunks: tuple[int, ...]):
  """A program that takes its split as data (state, tokens, table), bound to one split:
  (state, tokens) -> its outputs, the split's table its third operand (`table_on`). config:
  the one the table is made for (a hybrid's full layers')."""
  table = table_on(mesh, config, shape, tuple(chunks))
  return lambda state, tokens_pBc: program(state, tokens_pBc, table)


def split_as_data_strategy(config, shape: OneBodyShape) -> Strategy:
  """KV-Runahead on one program for every split of `config`'s model that fits `shape`
  (`OneBodyShape.envelope`): `configured(Options(split_shape=shape, config=config))`."""
  return configured(Options(split_shape=shape, config=config))


@kept_cache(16)
def _split_as_data(options: Options) -> Strategy:
  """The split is the program's operand and its hops are sized as data, so a new split
  compiles nothing. Its parts are `shape.part_len` rows (the envelope's chunk); cache="last"
  moves them. Its program is the one builder's (strategies.by_kind.compile_plan: the one
  body as data, `bodies.one_body_as_data`, its table made from `options.config`)."""
  shape = options.split_shape

  def layout(context_len: int, num_ranks: int, chunks) -> tuple[int, ...]:
    shape.check_split(tuple(chunks))
    return tuple(chunks)

  def arrange(tokens_BC, chunks):
    tokens_pBc = pad_chunks(tokens_BC, chunks)
    return np.pad(tokens_pBc, ((0, 0), (0, 0), (0, shape.chunk_len - tokens_pBc.shape[2])))

  return dataclasses.replace(
    STRATEGY,
    name=SPLIT_AS_DATA,
    variant_of=STRATEGY.name,
    description="KV-Runahead on one program for every split that fits its shape",
    attention_kinds=tuple(k for k in CAUSAL_KERNELS if get_kernel(k).lengths_as_data),
    layout=layout,
    arrange=arrange,
    cache_layout=lambda C, chunks: contiguous_layout(chunks, shape.part_len),
    timeline_probes=False,
    cache_from_last_hop=None,
    options=options,
  )
