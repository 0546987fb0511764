"""The interface every prefill strategy implements, and the one trace counter they share.

A strategy is a frozen `Strategy`: how it lays the prompt out over the ranks of a 1-D mesh
(`layout`, `arrange`), what one rank runs (`rank_body`), which prompt positions each rank's
part of the KV cache holds (`cache_layout`) and its layer as the cost model sees it
(`modelled_layer`). Its program, on every model, comes from the one builder
(strategies.by_kind.compile_by_kind), and has one signature:

  program(state, tokens_pBc) -> (logits_pBV, {"kv": kv_parts [p, L, 2, B*P, K, H], ...})

state replicated over the mesh, tokens_pBc each rank's tokens (from `arrange`), outputs
sharded by rank, one entry per kind of past the model's layers keep. Only the last rank's
logits are the answer (the runner moves them there, where decode continues). kv_parts
holds, on every rank, only the K,V that rank computed (its chunk, or its two zigzag
chunks), padded to the longest part P, batch folded into the rows (`fold_batch` says why):
never a prompt-long copy per rank. `CacheLayout` says which rows of each part are which
prompt positions; `kvr_jax.inference.kv_cache` brings the parts onto the last rank in
prompt order (cache="last") or decodes from them where they are (cache="sharded").
`kvr_jax.inference.prefill` dispatches on the registry in kvr_jax/strategies/__init__.py and
knows nothing else about any strategy.

Every program is one runner (`rank_program` under `spmd`) around a rank's `RankBody`: the
strategy's own on a model of softmax layers; on a model of other kinds of past composed
from each kind's part (the strategy's own rank body for softmax layers, strategies.hybrid's
and strategies.latent's for the others), whose outputs are that model's pasts (a latent per
position, a linear layer's state and halo).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvr_jax.core.chunks import chunk_starts, moved_rows
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.cache_layout import CacheLayout, contiguous_layout, parts_spec
from kvr_jax.runtime.mesh import AXIS, model_parallel
from kvr_jax.strategies.probe import mark
from models import scan_layers
from models.base import finish_one_row, no_reduce
from models.kernels import DEFAULT_CAUSAL_KERNEL, KERNEL_NAMES, KERNELS, AttentionKernel, get_kernel

# The kernels of strategies that skip masked work (single, kvr), their default first.
CAUSAL_KERNELS = (DEFAULT_CAUSAL_KERNEL.name,) + tuple(
  k for k in KERNEL_NAMES if k != DEFAULT_CAUSAL_KERNEL.name
)
AUTO = "auto"
# What attention="auto" (the default) runs, per platform: the first kernel the strategy runs
# that runs there for the model's dtype and sliding window (`AttentionKernel.runs_on`), else
# the strategy's default. Chosen by measurement (docs/gpu.md): on one H100, cuDNN's fused
# attention ran causal bf16 self-attention at 435-646 TFLOP/s from 8k to 32k tokens, the
# flash kernel at 45-61; on CPUs the flash kernel is the fastest exact kernel from 1k tokens
# up (`--mode=kernels`).
AUTO_KERNELS = {"cpu": ("flash",), "gpu": ("cudnn", "flash"), "tpu": ("flash",)}


# Times each strategy's program was traced (= compiled): tests use it to show that a second
# call with the same shapes compiles nothing.
TRACE_COUNT: collections.Counter[str] = collections.Counter()


def count_trace(strategy: str) -> None:
  TRACE_COUNT[strategy] += 1


class KindLayers(NamedTuple):
  """A strategy's layer on a layer kind with a past of its own (models.layer_kinds: a latent
  per position, a linear layer's fixed-size state), as context parallelism is an attention
  backend per kind: modelled(config, context_len, setup, chunks) -> the `ModelledLayer` the
  cost model times; rank_layer, where its program runs the kind with a layer of its own (the
  latent peers': (block, x, rank, context_len, num_ranks, attention, reduce, probe) -> (x,
  its own latents); None where the program takes the kind another way: KV-Runahead's chain,
  a hybrid's linear layers)."""

  modelled: Callable[..., Any]
  rank_layer: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class Strategy:
  """One prefill strategy.

  name: what `prefill(strategy=...)` and the command lines take.
  description: one line for help texts.
  partitioned: the user chooses the chunk lengths (`partition=`); otherwise `layout` alone
    decides them.
  attention_kinds: the attention kernels it runs (the first is its default).
  max_ranks: the largest mesh it runs on (single: 1), None for any.
  layout(context_len, num_ranks, chunks) -> chunks: each rank's token count as the program
    sees it (chunks is the validated partition for a partitioned strategy, else None).
  arrange(tokens_BC, chunks) -> [p, B, c_max] host tokens, each rank's slice padded.
  rank_body(graphdef, chunks, kernel, timeline, keep_last_hop, **options) -> make_body: what
    one rank runs (see `RankBody`), refusing what the strategy does not run (timeline probes,
    a kept last hop). Its program, on any model, is the one builder's
    (strategies.by_kind.compile_by_kind): the same rank body on a model of softmax layers,
    and on each softmax layer among layers of other kinds.
  cache_layout(context_len, chunks) -> the CacheLayout of the program's kv_parts output.
  modelled_layer(config, context_len, setup, chunks) -> its program's layer as the cost model
    sees it (runtime.roofline.ModelledLayer: per rank, the phases, messages and waits in
    program order; config is one tensor-parallel shard's), which kvr_jax.planning.costmodel
    times; a new strategy is modelled with nothing added there.
  """

  name: str
  description: str
  partitioned: bool
  attention_kinds: tuple[str, ...]
  layout: Callable[[int, int, tuple[int, ...] | None], tuple[int, ...]]
  arrange: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]
  rank_body: Callable[..., Callable]
  modelled_layer: Callable[..., Any]
  cache_layout: Callable[[int, tuple[int, ...]], CacheLayout] = lambda C, chunks: contiguous_layout(
    chunks
  )
  max_ranks: int | None = None
  # rank_body(..., timeline=True) places probes at its phase boundaries (strategies.probe).
  timeline_probes: bool = False
  # (chunks, the model's layer kinds) -> whether rank_body(..., keep_last_hop=True) can return
  # what the last rank received, from which it holds the whole cache without a move
  # (KV-Runahead's hops carry it); None: the strategy's cache="last" always moves the parts.
  cache_from_last_hop: Callable[[tuple[int, ...], tuple], bool] | None = None
  attention_note: str = ""  # why it runs only these kernels, for the error message
  # strategy="auto" weighs it (planning.choice): its modelled TTFT, with its searched split
  # where it is partitioned.
  auto_candidate: bool = False
  # Its kernel is part of its definition (TSP: dense masked scores): a kernel asked for in a
  # comparison is not passed, rather than refused (inference.prefill.prefill_arguments).
  fixed_kernel: bool = False
  # The strategy's own frozen options, where it has variants of its program (KV-Runahead:
  # runahead.Options, its body and whether the split is data); None where it has none.
  options: Any = None
  # The registry's name of the strategy this record is a variant of (KV-Runahead with a
  # fixed body or its split as data); None for a registered record (`registered_name`).
  variant_of: str | None = None
  # Its ranks pass the prompt's prefix down the ranks in order (KV-Runahead): a layer whose
  # past is a fixed-size state (Gated DeltaNet) passes the state down the same chain, and
  # the ranks' layout is contiguous chunks; otherwise a model's own programs gather every
  # rank's state or entries (strategies.hybrid, strategies.latent).
  prefix_chain: bool = False
  # It merges attention partials over disjoint keys by their log-sum-exp (ring attention):
  # a kernel must return one (a model's own programs check it; `attention_kinds` already
  # holds only such kernels for the K,V programs).
  merges_by_lse: bool = False
  # Its ranks hold two zigzag chunks each (r and 2p-1-r: the ring and all-gather peers): a
  # linear layer's state is made from every chunk's map gathered on every rank
  # (strategies.hybrid), where a prefix chain passes it down the ranks.
  zigzag_chunks: bool = False
  # Its layers on the kinds with a past of their own, by the kind record's class
  # (LatentAttentionKind, GatedDeltaNetKind) -> `KindLayers`; softmax attention over K,V is
  # `compile`'s and `modelled_layer`'s. A kind it has none for, it does not run. Left out of
  # the hash: the same for a registered record and its variants.
  kind_layers: dict = dataclasses.field(default_factory=dict, hash=False)

  def layers_of_kind(self, kind) -> KindLayers:
    """Its `KindLayers` for a layer of `kind` (a models.layer_kinds record); refused by name
    where it has none."""
    if type(kind) not in self.kind_layers:
      raise ValueError(f"strategy {self.name!r} runs no {kind.name} layers")
    return self.kind_layers[type(kind)]

  @property
  def registered_name(self) -> str:
    """The registry's name of the strategy whose program this record runs."""
    return self.variant_of or self.name

  def keeps_last_hop(self, cache: str, chunks: tuple[int, ...], kinds: tuple) -> bool:
    """cache="last" can come from what the last rank received (no move): this strategy's hops
    carry the whole prefix for these chunks (`cache_from_last_hop`). Whether it should is
    memory's question (kvr_jax.inference.kv_cache.join_affordable)."""
    return (
      cache == "last"
      and self.cache_from_last_hop is not None
      and self.cache_from_last_hop(chunks, kinds)
    )

  @property
  def default_attention(self) -> str:
    return self.attention_kinds[0]

  def check_attention(self, attention) -> AttentionKernel | str:
    """`attention` as its record ("auto" for None and "auto"); refuses an unknown kernel and a
    kernel this strategy does not run."""
    if attention is None or attention == AUTO:
      return AUTO
    if not isinstance(attention, AttentionKernel) and attention not in KERNELS:
      raise ValueError(
        f"unknown attention {attention!r}; expected {AUTO!r} or one of {KERNEL_NAMES}"
      )
    kernel = get_kernel(attention)
    if kernel.name not in self.attention_kinds:
      raise ValueError(
        f"strategy {self.name!r} runs attention in {self.attention_kinds}, not {kernel.name!r}"
        + (f": {self.attention_note}" if self.attention_note else "")
      )
    return kernel

  def resolve_attention(self, attention, device, dtype, window: int | None) -> AttentionKernel:
    """The concrete kernel record: `attention` checked, or for "auto" (and None) the first of
    AUTO_KERNELS[device's platform] that this strategy runs and that runs there for `dtype`
    and `window`, else the strategy's default. A compiled program is keyed by what this
    returns, so "auto" never reaches a compile."""
    kernel = self.check_attention(attention)
    if kernel != AUTO:
      return kernel
    for name in AUTO_KERNELS.get(device.platform, ()):
      if name in self.attention_kinds and KERNELS[name].runs_on(device, dtype, window):
        return KERNELS[name]
    return KERNELS[self.default_attention]


def ordered_after(value, *deps):
  """`value` (a pytree), made to depend on `deps` as data, so that XLA computes every dep
  before anything that reads `value`.

  Why not `jax.lax.optimization_barrier`: XLA:CPU expands barriers before it schedules, and
  then orders independent work as it likes. KV-Runahead's early diagonal rows (the work a
  rank does while its prefix is on the way) were scheduled after the hop they were to hide,
  and rank 0's whole diagonal before its send (the one body's two-process timeline: rank 1
  idle 38 ms per layer in the hop, rank 0's hop phase 67 ms; 3 ms after). The dependence is
  a select on whether the first element of every dep is NaN: false for every finite or
  infinite value, nothing XLA can fold away. It fuses into the op that reads `value` where
  that op is in the same computation; across a `lax.switch` branch boundary it is a pass of
  its own (the per-rank program's q and hop message: a 17 MB select took 0.75 ms on this
  CPU)."""
  flags = [jnp.isnan(jnp.ravel(d)[0]) for d in jax.tree.leaves(deps) if d.size]
  if not flags:
    return value
  any_nan = functools.reduce(jnp.logical_or, flags)
  return jax.tree.map(lambda v: jnp.where(any_nan, jnp.zeros_like(v), v), value)


def last_rank(chunks: tuple[int, ...]) -> int:
  return len(chunks) - 1


def model_reduce(mesh):
  """What a rank program passes to `Block.finish(..., reduce=)` / `CausalLM.forward`: the psum
  of its tensor-parallel shards' partial sums on a ("ranks", "model") mesh, else nothing."""
  return tensor_parallel.psum_over_model if model_parallel(mesh) > 1 else no_reduce


def spmd(rank_program, mesh, out_specs=None, with_table: bool = False):
  """Every strategy's program over the mesh: the tokens (an array, or a tuple of arrays
  [p, B, T_rank]) and the outputs sharded by rank; the weights whole on every rank (1-D
  mesh) or split over each rank's "model" row (2-D: `tensor_parallel`'s specs, from the
  state's own structure at trace time). out_specs: how rank_program's outputs lie, None for
  the K,V programs' (logits by rank, every K,V output [p, L, 2, rows, K, H] by rank, its heads
  split over "model" on a 2-D mesh); a model whose layers output other pasts gives its own
  (strategies.by_kind: each kind's `KindProgram.output_specs`). with_table: a third operand,
  the split's table, whole on every rank (1-D meshes only)."""
  P = jax.P
  m = model_parallel(mesh)
  if out_specs is None:
    out_specs = (P(AXIS), P(AXIS) if m == 1 else parts_spec(mesh))
  if m == 1:
    in_specs = (P(), P(AXIS), P()) if with_table else (P(), P(AXIS))
    body = jax.shard_map(rank_program, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return jax.jit(body)
  if with_table:
    raise ValueError("a program that takes its split as data runs on a 1-D mesh")

  @jax.jit
  def body_2d(state, tokens_pBc):
    state_specs = tensor_parallel.partition_specs(state, m)
    # check_vma=False: the hidden states and logits are whole on every shard of a rank (the
    # psums make them so), but KV-Runahead's per-rank lax.switch joins its operands' types
    # and marks them varying over "model", which the type check would then refuse as a
    # carry and as the logits output. tests/test_tensor_parallel.py checks the values.
    return jax.shard_map(
      rank_program,
      mesh=mesh,
      in_specs=(state_specs, P(AXIS)),
      out_specs=out_specs,
      check_vma=False,
    )(state, tokens_pBc)

  return body_2d


def logits_to_last_rank(logits_BV, owner: int, num_ranks: int):
  """The prompt's last position's logits, computed on rank `owner`, moved to rank p-1 where
  decode continues (B x V values, once); unchanged when the owner is already p-1."""
  if owner == num_ranks - 1:
    return logits_BV
  return jax.lax.ppermute(logits_BV, AXIS, perm=[(owner, num_ranks - 1)])


def gather_to_owner(own, owner: int, num_ranks: int, axis: int):
  """Every rank's `own` on rank `owner` (static), joined in rank order along `axis` as a tiled
  all_gather joins them; on the other ranks the result is meaningless (zeros where a piece did
  not arrive) and must not be read. One one-way collective-permute per other rank, each into
  the owner. Why not all_gather: only the owner reads the result (a last layer's last row);
  an all-gather also sends every piece to every other rank, and on two ranks it is a two-way
  exchange, which takes twice a one-way send where a pair's directions share the link (gloo
  serialises them: docs/measurements.md, "Links")."""
  pieces = [
    own if r == owner else jax.lax.ppermute(own, AXIS, perm=[(r, owner)]) for r in range(num_ranks)
  ]
  return jnp.concatenate(pieces, axis=axis)


def reshard_rows(x_BcD, from_chunks: tuple[int, ...], to_chunks: tuple[int, ...], rank):
  """Rows laid out in contiguous chunks, rank i holding `from_chunks[i]` rows (padded to the
  longest), laid out again by `to_chunks` (padded to its longest; zeros past a rank's
  length): KV-Runahead's hidden states between layer kinds that want different splits
  (strategies.hybrid). Both splits are static, so every piece a rank sends is a static
  slice: one collective-permute with one pair per (sender, receiver) whose spans overlap,
  which for neighbouring splits is each rank's edge rows to its neighbour alone. A rank's
  own overlap stays, read at its own offset (a gather of its rows, no message)."""
  if from_chunks == to_chunks:
    return x_BcD
  from_starts, to_starts = chunk_starts(from_chunks), chunk_starts(to_chunks)
  c_to = max(to_chunks)
  # The own overlap: row j of the new chunk is row j + shift of the old one where it lies
  # in both this rank's old and new spans.
  shift_p = jnp.asarray([t - f for t, f in zip(to_starts, from_starts, strict=True)], jnp.int32)
  lo_p = jnp.asarray(
    [max(f, t) - t for f, t in zip(from_starts, to_starts, strict=True)], jnp.int32
  )
  hi_p = jnp.asarray(
    [
      min(f + fc, t + tc) - t
      for f, fc, t, tc in zip(from_starts, from_chunks, to_starts, to_chunks, strict=True)
    ],
    jnp.int32,
  )
  rows_c = jnp.arange(c_to)
  own_c = (rows_c >= lo_p[rank]) & (rows_c < hi_p[rank])
  source_c = jnp.clip(rows_c + shift_p[rank], 0, x_BcD.shape[1] - 1)
  out_BcD = jnp.where(own_c[None, :, None], jnp.take(x_BcD, source_c, axis=1), 0).astype(
    x_BcD.dtype
  )
  for s, d, at_sender, at_receiver, n in moved_rows(from_chunks, to_chunks):
    piece = jax.lax.ppermute(x_BcD[:, at_sender : at_sender + n], AXIS, perm=[(s, d)])
    here = out_BcD[:, at_receiver : at_receiver + n]
    out_BcD = out_BcD.at[:, at_receiver : at_receiver + n].set(jnp.where(rank == d, piece, here))
  return out_BcD


def owner_last_row(block, x_BTD, queries, prompt_MBSKH, rank, last_position, reduce):
  """A rank's part of the model's last layer where the prompt's cache entries are gathered
  on the owner (the zigzag and latent peers: `gather_to_owner`; TSP: its all-gather): only
  the prompt's last row is read, so the rank holding it attends that row over
  `prompt_MBSKH` (prompt order, from position 0) and finishes it
  (`models.base.finish_one_row`); every other rank and row skips both.
  last_position: (the owner rank, its row there, the prompt position)."""
  owner, row, position = last_position
  return jax.lax.cond(
    rank == owner,
    lambda x: finish_one_row(block, x, queries, prompt_MBSKH, row, position, reduce),
    lambda x: x,
    x_BTD,
  )


# --- the one strategy runner ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RankBody:
  """What a strategy's rank runs, built inside the trace by its `make_body(model, rank,
  tokens_BT, reduce)` (rank traced: `lax.axis_index`). The runner does the rest.

  tokens_BT: the tokens its layers run on (padded where the strategy pads them).
  layer(block, x_BTD, carry, at) -> (x_BTD, carry, out_l): one layer (at: the scan's
    models.base.Layer: its index in the model, its row in its stack, its kind), from the
    same `project_qkv` / `attend` / `finish` calls as every strategy; out_l is what the
    layer outputs (the rank's own K,V, batch folded: `fold_batch`; a tuple where it keeps
    more; a latent model's latents), the same shapes in every layer.
  carry: what the layers carry beside the hidden states (KV-Runahead's buffer), or None.
  last_row(x_BTD) -> [B, D]: the row of this rank holding the prompt's last position when
    this rank is `owner`.
  owner: the rank computing the prompt's last position; its logits move to rank p-1.
  outputs(carry, out_L) -> what the rank outputs besides its logits, from the carry after
    the last layer and the layers' out_l stacked [L, ...]: None for the stacked out_l. A
    model whose layer kinds output pasts of different shapes (a hybrid's K,V and linear
    states) writes each into its kind's buffer in the carry, and reads them here.
  """

  tokens_BT: Any
  layer: Callable
  last_row: Callable
  owner: int
  carry: Any = None
  outputs: Callable | None = None


def rank_program(name: str, graphdef, make_body: Callable, num_ranks: int, timeline: bool, reduce):
  """The program every strategy runs per rank on every model, (state, tokens [1, B, T] (or a
  tuple of such: the body's), *table) -> (logits [1, B, V], outputs [1, L, ...]): count the
  trace, merge the model, build the `RankBody` (the strategy's, or a model family's around
  it: strategies.by_kind), embed, scan its layer over the model's layers
  (`models.scan_layers`: one compiled body per layer kind), and the last position's logits
  on rank p-1 (probed at both ends when `timeline`). table: the split as data, where the
  body takes it (`make_body(..., table)`), else nothing."""

  def program(state, tokens_1BT, *table):
    count_trace(name)
    model = nnx.merge(graphdef, state)
    tokens = jax.tree.map(lambda t: t[0], tokens_1BT)
    body = make_body(model, jax.lax.axis_index(AXIS), tokens, reduce, *table)
    x_BTD = mark(timeline, "embed", -1, model.embed(body.tokens_BT))

    def layer(block, at, x_and_carry):
      x_BTD, carry, out_l = body.layer(block, *x_and_carry, at)
      return (x_BTD, carry), out_l

    (x_BTD, carry), out_L = scan_layers(model, layer, (x_BTD, body.carry))
    outputs = out_L if body.outputs is None else body.outputs(carry, out_L)
    logits_BV = model.logits(body.last_row(x_BTD)[:, None])[:, 0]
    logits_BV = logits_to_last_rank(logits_BV, body.owner, num_ranks)
    logits_BV = mark(timeline, "logits", -1, logits_BV)
    return logits_BV[None], jax.tree.map(lambda out: out[None], outputs)

  return program


def refuse(name: str, timeline: bool = False, keep_last_hop: bool = False) -> None:
  """A strategy's refusal of what it does not run, by name."""
  if timeline:
    raise ValueError(f"strategy {name!r} has no timeline probes")
  if keep_last_hop:
    raise ValueError(f"strategy {name!r} does not keep its last hop (cache='last' moves parts)")
