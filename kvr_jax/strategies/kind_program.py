"""What a layer kind contributes to a rank's program, and how a rank's layers of several kinds
are composed into one `RankBody` (strategies.by_kind builds the programs from these).

A kind's past decides how its layer crosses the ranks: softmax attention keeps K,V per
position (the strategy's own rank body: KV-Runahead's hop chain, the peers' ring or
all-gather), a latent model one latent per position (the same chain over one-head entries,
or a peer's latent layer), a Gated DeltaNet layer a fixed-size state and convolution halo
(passed down KV-Runahead's chain, or every chunk's map all-gathered). Each is a `KindPart`:
its layer, what its layers carry, the stack its weights lie in; each names what it outputs
(a dict: {"kv"}, {"state", "halo"}, {"own", "last"}). `compose` runs the parts in one scan
body: a model of one kind outputs its layers' dicts stacked by the scan, a model of several
writes each kind's outputs into a buffer of its layers in the carry (the scan's per-step
outputs must be alike in every branch).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvr_jax.runtime.mesh import AXIS
from kvr_jax.strategies.base import Strategy, reshard_rows
from kvr_jax.strategies.probe import mark
from kvr_jax.strategies.runahead.bodies import one_body_as_data
from models.base import Layer


@dataclasses.dataclass(frozen=True)
class ProgramArgs:
  """The builder's checked arguments, which every kind's part reads. spec: the registered
  record; chunks: the split (None where it is data), full_chunks: KV-Runahead's own split for
  the softmax layers of a hybrid (None: `chunks`); kernel: the record; body: KV-Runahead's
  ("one", "per-rank"), None for a peer; split_shape: the envelope of a split as data;
  keep_last_hop: cache="last" joins the last hop (no move); timeline: phase probes; padded:
  rows padded past their ends (a linear layer's state stops at each row's end)."""

  spec: Strategy
  graphdef: Any
  chunks: tuple[int, ...] | None
  full_chunks: tuple[int, ...] | None
  kernel: Any
  body: str | None
  split_shape: Any
  keep_last_hop: bool
  timeline: bool
  padded: bool


@dataclasses.dataclass(frozen=True)
class RankContext:
  """What one rank's parts are built from, inside the trace: the model, its rank (traced),
  its tokens [B, T] (padded to the body's rows), each row's position minus its row's end
  where rows are padded past their ends (else None), the shards' reduce, the split's table
  where it is data (a tuple: empty where it is static), and KV-Runahead's one body (its
  shape, each rank's length [p]) or None."""

  model: Any
  rank: Any
  tokens_BT: Any
  from_end_BT: Any
  reduce: Callable
  table: tuple
  one_body: tuple | None


@dataclasses.dataclass(frozen=True)
class KindPart:
  """A strategy's layers of one kind on one rank: layer(block, x, carry, at) -> (x, carry,
  outputs: a dict of arrays, the same in every layer of the kind); blocks: the stacked
  weights its layers run (the outputs' shapes are traced on its first row); carry: what its
  layers carry (KV-Runahead's buffer), or None."""

  layer: Callable
  blocks: Any
  carry: Any = None


@dataclasses.dataclass(frozen=True)
class KindProgram:
  """How the builder runs one kind of layer (strategies.by_kind.KIND_PROGRAMS, by the kind
  record's class). check(strategy): refuses a strategy (a name or a record) whose programs
  do not run the kind, by name (probes a strategy does not place the builder refuses once,
  for every kind); part(args, ctx, kind) -> its `KindPart`; output_specs(mesh, args) ->
  {output name: how it lies over the mesh}; label: the program's name in TRACE_COUNT
  (f"{strategy}-{label}"), "" for none."""

  check: Callable
  part: Callable
  output_specs: Callable
  label: str = ""


def compose(model, kinds: tuple, parts: tuple, x_BTD):
  """One scan body from each kind's part: (layer(block, x, carry, at) -> (x, carry, out_l),
  the carry, outputs(carry, out_L) or None). One kind: its outputs are the scan's stacked
  out_l (None: `RankBody`'s default). Several: an output name written by several kinds is
  one buffer of their layers in model order (their shapes must agree); each layer writes
  its row, and `outputs` reads the buffers."""
  index_of = {kind: i for i, kind in enumerate(kinds)}
  carries = tuple(part.carry for part in parts)

  def run(block, x, carries, at):
    i = index_of[at.kind]
    x, own, out = parts[i].layer(block, x, carries[i], at)
    return x, carries[:i] + (own,) + carries[i + 1 :], out

  if len(parts) == 1:
    return run, carries, None
  writes, buffers = _output_buffers(model, kinds, parts, carries, x_BTD)
  rows = {name: jnp.asarray(row_L, jnp.int32) for name, (_, row_L) in writes.items()}

  def layer(block, x, carry, at):
    carries, buffers = carry
    x, carries, out = run(block, x, carries, at)
    buffers = {
      name: _write_row(buffer, out[name], rows[name][at.index]) if name in out else buffer
      for name, buffer in buffers.items()
    }
    return x, (carries, buffers), None

  return layer, (carries, buffers), lambda carry, _: carry[1]


def _zeros(layers: int, s):
  """Zeros of `layers` rows of shape `s`, varying over the ranks (each rank writes its own)."""
  return jax.lax.pcast(jnp.zeros((layers, *s.shape), s.dtype), (AXIS,), to="varying")


def _write_row(buffer, value, row):
  return jax.tree.map(lambda s, new: s.at[row].set(new), buffer, value)


def _output_buffers(model, kinds, parts, carries, x_BTD) -> tuple[dict, dict]:
  """({output name: (its kinds, each layer's row in its buffer [L], -1 where it writes
  none)}, {name: zero buffer [layers, ...], varying over the ranks}): the shapes from one
  layer of each kind traced abstractly on its stack's first row (`jax.eval_shape`)."""
  kind_L = model.config.layer_kinds
  shapes, writes = {}, {}
  for kind, part, carry in zip(kinds, parts, carries, strict=True):
    graphdef, stacked = nnx.split(part.blocks)
    # A kind no layer has (a hybrid of linear layers alone): its branch never runs and its
    # buffers hold no layer, shaped from a layer's weights' shapes all the same.
    first_rows = jax.tree.map(
      lambda w: w[0] if w.shape[0] else jnp.zeros(w.shape[1:], w.dtype), stacked
    )

    def first_layer(graphdef=graphdef, first_rows=first_rows, part=part, kind=kind, carry=carry):
      block = nnx.merge(graphdef, first_rows)
      block.config = model.config.of_kind(kind)
      first = Layer(jnp.int32(0), jnp.int32(0), kind)
      return part.layer(block, x_BTD, carry, first)[2]

    for name, shape in jax.eval_shape(first_layer).items():
      if name in shapes and shapes[name] != shape:
        raise ValueError(f"layer kinds write {name!r} in different shapes: {shape}, {shapes[name]}")
      shapes[name] = shape
      writes.setdefault(name, []).append(kind)
  table = {}
  for name, of in writes.items():
    layers = [l for l, kind in enumerate(kind_L) if kind in of]
    row_L = np.full(len(kind_L), -1)
    row_L[layers] = np.arange(len(layers))
    table[name] = (tuple(of), row_L)
  buffers = {
    name: jax.tree.map(functools.partial(_zeros, int((table[name][1] >= 0).sum())), shape)
    for name, shape in shapes.items()
  }
  return table, buffers


@dataclasses.dataclass(frozen=True)
class KindSplit:
  """KV-Runahead's hidden states between the split of the tokens (`linear`, in which every
  layer leaves them: a hybrid's linear layers') and a softmax layer's own (`full`): such a
  layer enters by moving them into its split and leaves by moving them back
  (`strategies.base.reshard_rows`: each rank's edge rows to its neighbour). A full layer's
  causal attention wants the earlier ranks' chunks longer, a linear layer's work is even per
  token. The model's last layer moves nothing back: only the prompt's last row is read after
  it, and rank p-1 holds it in both splits (moved locally to its row in `linear`). One split
  for both: no move."""

  linear: tuple[int, ...] | None  # None: the split is data, one for both (no move)
  full: tuple[int, ...] | None
  rank: object

  def enter(self, x_BcD):
    if self.full is None or self.linear == self.full:
      return x_BcD
    return reshard_rows(x_BcD, self.linear, self.full, self.rank)

  def leave(self, x_BcD, l, num_layers: int):
    if self.full is None or self.linear == self.full:
      return x_BcD
    p = len(self.full)

    def last_row_only(x_BcD):  # rank p-1's last row at its place in `linear`
      row_BD = x_BcD[:, self.full[p - 1] - 1]
      at = jnp.zeros((x_BcD.shape[0], max(self.linear), x_BcD.shape[2]), x_BcD.dtype)
      return at.at[:, self.linear[p - 1] - 1].set(row_BD)

    def back(x_BcD):
      return reshard_rows(x_BcD, self.full, self.linear, self.rank)

    return jax.lax.cond(l == num_layers - 1, last_row_only, back, x_BcD)


def strategy_body(args: ProgramArgs, chunks: tuple[int, ...] | None) -> Callable:
  """The strategy's own rank body's maker (`Strategy.rank_body`) on `chunks`: KV-Runahead's
  in the program's body, or its split as data's one body (`bodies.one_body_as_data`); the
  last hop kept where the strategy keeps one and the program asks it."""
  spec = args.spec
  if args.split_shape is not None:
    return one_body_as_data(args.split_shape, args.kernel)
  options = dict(body=args.body) if spec.prefix_chain else {}
  keeps = spec.cache_from_last_hop is not None and args.keep_last_hop
  return spec.rank_body(args.graphdef, chunks, args.kernel, args.timeline, keeps, **options)


def attention_part(args: ProgramArgs, ctx: RankContext, kind) -> KindPart:
  """Softmax attention over K,V, on a model of several kinds: the strategy's own rank body
  (`Strategy.rank_body`; KV-Runahead's in the plan's body, or its split as data's one body)
  on a view of the model holding this kind's layers alone, its hidden states moved into its
  own split and back (`KindSplit`, where KV-Runahead's softmax layers take one). Outputs
  {"kv": the K,V the strategy emits}."""
  model = ctx.model
  full_chunks = args.chunks if args.full_chunks is None else args.full_chunks
  make_body = strategy_body(args, full_chunks)
  config, blocks = model.config.of_kind(kind), _stack_of(model, kind)
  view = _KindView(config, blocks)
  body = make_body(view, ctx.rank, ctx.tokens_BT, ctx.reduce, *ctx.table)
  if body.tokens_BT.shape != ctx.tokens_BT.shape:
    raise ValueError(f"the rank body pads its rows to {body.tokens_BT.shape}, not the program's")
  split = KindSplit(args.chunks, full_chunks, ctx.rank)
  moves = args.timeline and split.linear != split.full

  def layer(block, x, carry, at):
    # at.index is the layer's index in the model: the rank layer knows the model's last
    # layer by it, whose attention and rest KV-Runahead's ranks before the last skip.
    x = mark(moves, "move", at.index, split.enter(x))
    x, carry, kv = body.layer(block, x, carry, at)
    return split.leave(x, at.index, config.num_layers), carry, {"kv": kv}

  return KindPart(layer, blocks, body.carry)


@dataclasses.dataclass(frozen=True)
class _KindView:
  """The model as a rank body sees it when it runs one kind's layers: that kind's config and
  stack (`blocks`: the K,V bodies read their heads and dtype from it)."""

  config: Any
  blocks: Any


def _stack_of(model, kind):
  """The stacked weights of `model`'s layers of `kind` (one stack holds them; where no layer
  is of it, the model's `blocks`, its softmax layers' stack, empty)."""
  kind_L = model.config.layer_kinds
  held = [s.blocks for s in model.layer_stacks() if any(kind_L[l] == kind for l in s.layers)]
  if not held:
    return model.blocks
  if len(held) != 1:
    raise ValueError(f"{kind.name} layers lie in {len(held)} stacks; a kind's part runs one")
  return held[0]
