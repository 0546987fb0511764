"""The one program builder: every strategy's program on every model, a rank body per kind of
past (strategies.kind_program) from its record in KIND_PROGRAMS, composed into one rank body
and run by the one strategy runner (`base.rank_program` under `base.spmd`).

  softmax attention      kind_program.attention_part: the strategy's own rank body
                         (`Strategy.rank_body`): on a model of softmax layers alone, the
                         whole model's (each layer's window its own)
  Gated DeltaNet         strategies.hybrid.PROGRAM: the state down KV-Runahead's chain, or
                         every chunk's map all-gathered by the zigzag peers
  latent attention       strategies.latent.PROGRAM: the latents as one-head entries down the
                         chain, or a peer's latent layer

A new kind of layer is a record in models/layer_kinds.py, its part (a `KindProgram`) and one
line here; a new strategy is a record with its rank body; no builder is copied.
`compile_plan` is every model's program for a plan (`PrefillPlan.compile`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvr_jax.core.caches import kept_cache
from kvr_jax.runtime.cache_layout import parts_spec
from kvr_jax.runtime.mesh import AXIS, model_parallel
from kvr_jax.strategies import (
  family_program,
  get_strategy,
  hybrid,
  latent,
  runahead,
)
from kvr_jax.strategies.base import RankBody, model_reduce, rank_program, spmd
from kvr_jax.strategies.kind_program import (
  KindProgram,
  ProgramArgs,
  RankContext,
  attention_part,
  compose,
  strategy_body,
)
from kvr_jax.strategies.runahead.rank_layer import pad_rows
from kvr_jax.strategies.runahead.schedule import OneBodyShape, check_body
from models.kernels import get_kernel
from models.layer_kinds import AttentionKind, GatedDeltaNetKind, LatentAttentionKind


def _check_attention(strategy) -> None:
  """Every registered strategy runs softmax layers (its own rank body); an unknown name is
  refused by name."""
  get_strategy(strategy)


def attention_specs(mesh, args=None) -> dict:
  """Every K,V output [p, L, 2, rows, K, H] by rank, its heads over "model" on a 2-D mesh."""
  del args
  return {"kv": jax.P(AXIS) if model_parallel(mesh) == 1 else parts_spec(mesh)}


# How the builder runs each kind of layer, by the kind record's class; checked in this order
# (a kind of its own first: its message names the strategies that run its family).
KIND_PROGRAMS: dict[type, KindProgram] = {
  GatedDeltaNetKind: hybrid.PROGRAM,
  LatentAttentionKind: latent.PROGRAM,
  AttentionKind: KindProgram(_check_attention, attention_part, attention_specs),
}


def compile_plan(plan, graphdef, padded: bool = False, also_kinds: tuple = ()):
  """The program of `plan` (a `PrefillPlan`) on a model of `graphdef`, every model's
  (`PrefillPlan.compile`): (state, tokens laid out by rank) -> (logits [p, B, V], {each
  kind's outputs}): `compile_by_kind` on the plan's kinds and `also_kinds` (those whose
  outputs its cache holds even where no layer is of them: a hybrid's full layers' K,V), with
  the plan's strategy, split (the full layers' own, `plan.full_chunks`), kernel, kept last
  hops and probes; a split as data's one program bound to the plan's split (its table made
  for the layers whose past is an entry per position: `runahead.on_split`). padded: rows
  padded past their ends (the tokens operand a tuple: `CacheForm.operands`)."""
  kinds = tuple(dict.fromkeys((*plan.kinds, *also_kinds)))
  mesh, kernel, timeline = plan.mesh, plan.kernel, plan.timeline
  spec, body, split_shape = family_program(plan.strategy, None, None)
  if split_shape is None:
    return compile_by_kind(
      spec, graphdef, mesh, plan.chunks, kernel, kinds, plan.keep_last_hop, timeline,
      plan.full_chunks, body, padded=padded,
    )  # fmt: skip
  program = compile_by_kind(
    spec, graphdef, mesh, None, kernel, kinds, False, timeline, None, body, split_shape, padded
  )
  table_config = _entries_config(plan.strategy.options.config, kinds)
  return runahead.on_split(program, mesh, table_config, split_shape, plan.chunks)


def compile_by_kind(
  strategy,
  graphdef,
  mesh,
  chunks: tuple[int, ...] | None,
  kernel,
  kinds: tuple,
  keep_last_hop: bool = True,
  timeline: bool = False,
  full_chunks: tuple[int, ...] | None = None,
  body: str | None = None,
  split_shape: OneBodyShape | None = None,
  padded: bool = False,
):
  """The jitted SPMD program of `strategy` (a name or a record: KV-Runahead's bring their body
  and split as data, `strategies.family_program`) on a model of `kinds` (its config's kinds):
  (state, tokens [p, B, T_rank] as the strategy arranges them, where `padded` (tokens, each
  position minus its row's end), and the split's table where it is data) -> (logits [p, B,
  V]: rank p-1's are the prompt's last position's, {each kind's outputs by name, [p, layers
  of the kind, ...]}). On a ("ranks", "model") mesh the state is split over each rank's group
  (runtime.tensor_parallel) and the shards' partial sums added by psum_over_model.
  keep_last_hop: KV-Runahead's last hops kept (cache="last" joins them, no move). timeline:
  the phases marked (strategies.probe). full_chunks (KV-Runahead on a hybrid): the softmax
  layers' own split, `chunks` the others' and the tokens' (`kind_program.KindSplit`). body:
  KV-Runahead's "one" or "per-rank" for every kind of layer (`program_body`). split_shape
  (KV-Runahead, chunks None): an envelope (`OneBodyShape.envelope` of the softmax or latent
  layers' config) whose one program takes the split as data: one program for every split
  that fits it. Refusals by name before anything is traced."""
  kinds = tuple(kinds)
  for kind in sorted(kinds, key=lambda k: isinstance(k, AttentionKind)):
    if type(kind) not in KIND_PROGRAMS:
      raise ValueError(f"no program runs {kind.name} layers (strategies.by_kind.KIND_PROGRAMS)")
    KIND_PROGRAMS[type(kind)].check(strategy)
  if timeline and not get_strategy(strategy).timeline_probes:
    raise ValueError(f"strategy {get_strategy(strategy).name!r} has no timeline probes")
  spec, body, split_shape = family_program(strategy, body, split_shape)
  chunks = None if chunks is None else tuple(chunks)
  full_chunks = None if full_chunks is None else tuple(full_chunks)
  args = (spec, graphdef, mesh, chunks, get_kernel(kernel), kinds, keep_last_hop, timeline)
  return _compiled(*args, full_chunks, body, split_shape, padded)


@kept_cache(32)
def _compiled(
  spec, graphdef, mesh, chunks, kernel, kinds, keep_last_hop, timeline, full_chunks, body,
  split_shape, padded,
):  # fmt: skip
  body = program_body(spec, mesh, kernel, chunks, full_chunks, body, split_shape)
  if split_shape is not None and (timeline or keep_last_hop):
    raise ValueError("a split as data keeps no last hop and marks no timeline")
  args = ProgramArgs(
    spec, graphdef, chunks, full_chunks, kernel, body, split_shape, keep_last_hop, timeline, padded
  )
  programs = [KIND_PROGRAMS[type(kind)] for kind in kinds]
  specs = {}
  for program in programs:
    specs.update(program.output_specs(mesh, args))
  label = next((program.label for program in programs if program.label), "")
  name = f"{spec.name}-{label}" if label else spec.name
  if not label and split_shape is not None:  # a K,V model's one program for every split
    name = runahead.SPLIT_AS_DATA
  p = mesh.shape[AXIS]
  make_body = lambda *traced: _rank_body(args, kinds, *traced)  # noqa: E731
  program = rank_program(name, graphdef, make_body, p, timeline, model_reduce(mesh))
  return spmd(program, mesh, (jax.P(AXIS), specs), split_shape is not None)


def program_body(spec, mesh, kernel, chunks, full_chunks, body, split_shape) -> str | None:
  """KV-Runahead's program body, the same for every kind of layer: `check_body`'s choice (the
  one body where the kernel takes lengths as data on more than PER_RANK_UP_TO ranks) or the
  one asked for. A split per layer kind runs "per-rank" (its moves between the two splits
  are static slices: `KindSplit`); the split as data runs the one body on one split for
  every kind. None for the peers (their layers are of one body). Refuses a split per layer
  kind or a split as data under a peer, and a split as data with chunks, a split per kind,
  the per-rank body or a 2-D mesh."""
  if not spec.prefix_chain:
    if full_chunks is not None:
      raise ValueError(f"a split per layer kind is KV-Runahead's; {spec.name} lays out its own")
    if split_shape is not None:
      raise ValueError(f"a split as data is KV-Runahead's; {spec.name} lays out its own")
    return None
  if split_shape is not None:
    if full_chunks is not None or body == "per-rank" or chunks is not None:
      raise ValueError(
        "a split as data runs KV-Runahead's one body on one split for every kind of layer, "
        "the split its operand (no chunks, no split per layer kind, no per-rank body)"
      )
    if model_parallel(mesh) > 1:
      raise ValueError("a program that takes its split as data runs on a 1-D mesh")
    return "one"
  if full_chunks is not None and full_chunks != chunks:
    if body == "one":
      raise ValueError("a split per layer kind runs KV-Runahead's per-rank body, not 'one'")
    return "per-rank"
  return check_body(body, kernel, len(chunks))


def _rank_body(args: ProgramArgs, kinds, model, rank, rows_BT, reduce, *table) -> RankBody:
  """A rank's `RankBody`: on a model of softmax layers alone the strategy's own on the whole
  model (`_whole_model_body`); else its tokens padded to the body's rows (KV-Runahead's one
  body: whole blocks), each kind's part (`KIND_PROGRAMS`), composed (`kind_program.compose`),
  and the row holding the prompt's last position."""
  tokens_BT, from_end_BT = rows_BT if args.padded else (rows_BT, None)
  if _one_attention_part(kinds):
    return _whole_model_body(args, model, rank, tokens_BT, reduce, table)
  one_body = None
  if args.body == "one":
    one_body = _one_body_lengths(_entries_config(model.config, kinds), args, table)
  rows = tokens_BT.shape[1] if one_body is None else one_body[0].chunk_len
  tokens_BT = pad_rows(tokens_BT, rows)
  from_end_BT = None if from_end_BT is None else pad_rows(from_end_BT, rows)
  ctx = RankContext(model, rank, tokens_BT, from_end_BT, reduce, table, one_body)
  parts = tuple(KIND_PROGRAMS[type(kind)].part(args, ctx, kind) for kind in kinds)
  # The buffers' shapes are traced on an embedding of the rows (for its shape alone:
  # nothing reads it, and XLA drops it).
  layer, carry, outputs = compose(model, kinds, parts, model.embed(tokens_BT))
  owner, last_row = _prompts_last_row(args, rank, table)
  return RankBody(tokens_BT, layer, last_row, owner, carry, outputs)


def _one_attention_part(kinds) -> bool:
  """A model of softmax layers alone (each layer's window its own): the strategy's own rank
  body runs the whole model as one part, its K,V the scan's stacked outputs."""
  return all(isinstance(kind, AttentionKind) for kind in kinds)


def _whole_model_body(args: ProgramArgs, model, rank, tokens_BT, reduce, table) -> RankBody:
  """The strategy's own `RankBody` on the whole model (`kind_program.strategy_body`), its
  outputs named: {"kv": what its layers emit, stacked [L, ...]} (a tuple with KV-Runahead's
  kept last hops)."""
  body = strategy_body(args, args.chunks)(model, rank, tokens_BT, reduce, *table)
  own = body.outputs

  def outputs(carry, out_L):
    return {"kv": out_L if own is None else own(carry, out_L)}

  return dataclasses.replace(body, outputs=outputs)


def _entries_config(config, kinds):
  """The config KV-Runahead's one body's shape and a split as data's table are made for: a
  model of softmax layers alone, its own (each layer's window its own); else that of the
  first of the program's `kinds` whose past is an entry per position (softmax or latent:
  what the hops carry)."""
  if _one_attention_part(kinds):
    return config
  return config.of_kind(next(kind for kind in kinds if hasattr(kind, "hop_span")))


def _one_body_lengths(config, args: ProgramArgs, table) -> tuple:
  """KV-Runahead's one body: (its shape, each rank's length [p]): the split's own shape and
  lengths where it is static, the envelope and the table's first row where it is data."""
  if args.split_shape is None:
    shape = OneBodyShape.of_split(config, args.chunks, args.kernel)
    return shape, jnp.asarray(args.chunks, jnp.int32)
  return args.split_shape, jnp.asarray(table[0][0], jnp.int32)


def _prompts_last_row(args: ProgramArgs, rank, table) -> tuple:
  """(the rank that holds the prompt's last position, x [B, T, D] -> its hidden state [B, D]
  there): its row static (`cache_layout.holder` of the tokens' layout), or data where the
  split is (the last rank's length)."""
  if table:
    row = jnp.asarray(table[0][0], jnp.int32)[rank] - 1
    owner = args.split_shape.num_ranks - 1
    return owner, lambda x: jax.lax.dynamic_index_in_dim(x, row, 1, False)
  context_len = sum(args.chunks)
  owner, row = args.spec.cache_layout(context_len, args.chunks).holder(context_len - 1)
  return owner, lambda x: x[:, row]
