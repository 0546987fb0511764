"""The K,V cache form, `FORM`: a model of softmax attention layers alone (Llama, Mistral,
Qwen2/3 and their MoE, Mixtral, Gemma 3, Falcon, gpt-oss). Each layer keeps (K, V) per
position, or where its window is shorter than the prompt a ring of its window
(decode.DecodeLayout); the result's past is a `KVWhole` (cache="last": the cache in prompt
order on the last rank, KV-Runahead's joined from its last hop without a move) or `KVParts`
(cache="sharded", and run_prefill(move_cache=False): each rank's part where it was
computed). Every registered strategy runs it, on 1-D and 2-D meshes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.core.layer_support import check_layers_run
from kvr_jax.inference import decode, sharded_decode, steppers
from kvr_jax.inference.cache_form import CacheForm, PrefillRun, replicated_logits, result_fields
from kvr_jax.inference.kv_cache import cut_on_last_rank, gather_on_last_rank, kept_on_last_rank
from kvr_jax.inference.results import PrefillResult
from kvr_jax.inference.sharded_decode import prompt_order_of_rings
from kvr_jax.runtime.mesh import (
  AXIS,
  MODEL_AXIS,
  global_array,
  piece_on,
  rank_device,
  spans_processes,
  split_dims,
)
from kvr_jax.strategies.base import last_rank
from models.kv_cache import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVWhole:
  """cache="last"'s past (the paper's layout): the cache on the last rank's device (its row
  of devices on a 2-D mesh, heads split over "model"), where decode continues.

  k_layers, v_layers: [L_f, B, S, K, H], S = prompt_len, in prompt order: every layer, or
  where a window is shorter than the prompt (`kept`, decode.DecodeLayout of the prompt) only
  the layers that keep every position; such a window's layers keep only a ring, `rings[g]` =
  (k, v) [L_g, B, W, K, H] per group of `kept` (None for the every-position group), each
  row's last W prompt positions at slot position mod W: what decode reads, all that moved or
  was joined."""

  k_layers: jax.Array
  v_layers: jax.Array
  kept: decode.DecodeLayout | None = dataclasses.field(default=None, metadata=dict(static=True))
  rings: tuple = ()

  def decode_cache(self) -> KVCache:
    """The cache as the model's decode step reads it, with no copy and no room beyond the
    prompt: per group of the kept layout (the every-position layers, then each ring)."""
    kept = self.kept or decode.DecodeLayout.whole(self.k_layers.shape[0])
    groups = tuple(
      (self.k_layers, self.v_layers) if ring is None else self.rings[g]
      for g, ring in enumerate(kept.rings)
    )
    return KVCache(kept, groups)

  def with_groups(self, cache: KVCache) -> KVWhole:
    """This past from a decode cache of `decode_cache()`'s layout."""
    kept, groups = cache.layout, cache.groups
    every = kept.every_position_group
    k, v = (self.k_layers, self.v_layers) if every is None else groups[every]
    rings = tuple(None if ring is None else groups[g] for g, ring in enumerate(kept.rings))
    return KVWhole(k, v, self.kept, rings if self.kept else ())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVParts:
  """cache="sharded"'s past: the parts where they were computed. kv_parts [p, L, 2, B*P, K, H]
  (batch folded into the rows: `strategies.base.unfold_batch(part, cache_layout.part_len)`
  gives [..., B, P, K, H]) sharded over the result's mesh, rank r's part holding the
  positions `cache_layout.segments[r]` says. last_hop: KV-Runahead's last-hop messages where
  the plan kept them (`run_prefill(move_cache=False)`): the last rank's cache is joined from
  them and its part, without a move (`PrefillResult.moved_to_last_rank`). Where a window is
  shorter than the prompt (`kept`; else None: every layer in the parts) kv_parts holds only
  the layers of `kept`'s every-position group, [p, L_f, 2, B*P, K, H]; a windowed layer keeps
  a ring of its window, `rings[g]` = (k, v) [L_g, B, W, K, H] replicated over the mesh (None
  for the every-position group), each row's last W prompt positions at slot position mod W
  (sharded_decode.sharded_rings_program)."""

  kv_parts: jax.Array
  last_hop: jax.Array | None = None
  kept: decode.DecodeLayout | None = dataclasses.field(default=None, metadata=dict(static=True))
  rings: tuple = ()


def prompt_order(k_full, v_full, kept, rings, lengths, prompt_len: int):
  """(k, v) [L, B, C, K, H] in prompt order from what is kept where windowed layers keep
  rings (`kept`; None: k_full, v_full already hold every layer): the every-position layers
  [L_f, B, C, K, H] as they are, each ring's positions in prompt order (zeros before the
  window), stacked by layer."""
  if kept is None:
    return k_full, v_full
  pieces = [
    (k_full, v_full) if ring is None else prompt_order_of_rings(*rings[g], lengths, prompt_len)
    for g, ring in enumerate(kept.rings)
  ]
  return tuple(kept.in_layer_order([kv[i] for kv in pieces]) for i in (0, 1))


def _model_heads(k_LBSKH, v_LBSKH, kv_heads: int | None):
  """(k, v) with the model's KV heads: a head repeated r times over "model" shards (K < m)
  taken once, so that the cache has single's shape on every mesh."""
  if k_LBSKH is None or kv_heads is None or k_LBSKH.shape[3] == kv_heads:
    return k_LBSKH, v_LBSKH
  repeats = k_LBSKH.shape[3] // kv_heads

  def once(x):  # the heads axis is split over "model": replicate over the row, then slice
    whole = jax.device_put(x, x.sharding.update(spec=jax.P()))
    return whole[:, :, :, ::repeats]

  return once(k_LBSKH), once(v_LBSKH)


def hop_holds_rows(config, chunks, lengths_B) -> bool:
  """Whether KV-Runahead's last hop and the last chunk hold what every row decodes from. A
  windowed layer's hop carries only the W-1 keys before the last chunk (the prompt's last
  window): a row that ends at or before that chunk's start (a padded row) reads keys before
  them, so the parts move for that run. Layers whose hop carries the whole prefix hold any
  row."""
  hop_end = sum(chunks[:-1])
  whole = all(kind.hop_keeps_whole_prefix(hop_end) for kind in config.kinds)
  return whole or int(np.min(lengths_B)) > hop_end


@dataclasses.dataclass(frozen=True)
class KVForm(CacheForm):
  """K,V per layer (`FORM`): the hooks of `run_prefill` for a `KVWhole` or `KVParts` past,
  and how a result reads it."""

  def check_layers(self, config) -> None:
    """A layer no K,V program runs (a kind outside every form) is refused by name."""
    check_layers_run(config, "prefill")

  def _result(self, run: PrefillRun, logits_BV, cache: str, past, **fields) -> PrefillResult:
    plan = run.plan
    return PrefillResult(
      logits=logits_BV,
      **result_fields(plan, run.lengths_B),
      cache=cache,
      past=past,
      form=self,
      mesh=plan.mesh,
      config=run.model.config,
      cache_layout=plan.cache_layout,
      kv_heads=run.model.config.num_kv_heads,
      **fields,
    )

  def _parts_and_hop(self, run: PrefillRun, out) -> tuple:
    """(the parts [p, L, 2, B*P, K, H], the last hops where they hold every row, else None)."""
    kv_parts, last_hop = out["kv"], None
    if run.plan.keep_last_hop:
      kv_parts, last_hop = kv_parts
      if not hop_holds_rows(run.model.config, run.plan.chunks, run.lengths_B):
        last_hop = None  # a row's window lies before the windowed layers' last hop: move
    return kv_parts, last_hop

  def held_elsewhere(self, run: PrefillRun, deferred: bool):
    cache = "sharded" if run.plan.cache == "sharded" or deferred else "last"
    return self._result(run, None, cache, None)

  def in_parts(self, run: PrefillRun, logits_pBV, logits_BV, out, deferred: bool):
    """The parts where they lie (with KV-Runahead's last hop: `moved_to_last_rank` joins it
    without a move). A padded row's logits come from one decode step of its last real token
    over the parts (here, before a window's layers keep only their rings); with
    cache="sharded", a window the prompt outgrew keeps its ring alone from here on."""
    plan, model = run.plan, run.model
    mesh, layout = plan.mesh, plan.cache_layout
    kv_parts, last_hop = self._parts_and_hop(run, out)
    if run.padded:  # every row's logits from the step, replicated (no copy of the program's)
      replicated = sharded_decode.last_real_logits_sharded(
        model, model.state_for(mesh), mesh, layout, kv_parts, run.last_tokens_B, run.lengths_B
      )
      logits_BV = piece_on(replicated, rank_device(mesh, last_rank(plan.chunks)))
    else:
      replicated = replicated_logits(plan, logits_pBV)
    # In one process the owner's logits are every process's.
    replicated = replicated if spans_processes(mesh) else None
    past = KVParts(kv_parts, last_hop)
    kept = decode.DecodeLayout.of(model.config, plan.prompt_len)
    if plan.cache == "sharded" and kept.rings != (None,):
      # A window the prompt outgrew: its layers keep only their rings from here on (what
      # decode reads), the parts only the other layers.
      program = sharded_decode.sharded_rings_program(mesh, layout, kept)
      lengths = global_array(np.asarray(run.lengths_B, np.int32), NamedSharding(mesh, jax.P()))
      kv_parts, rings = program(kv_parts, lengths)
      past = KVParts(kv_parts, last_hop, kept, rings)
    return self._result(run, logits_BV, "sharded", past, replicated_logits=replicated)

  def joined(self, run: PrefillRun, logits_BV, out):
    kv_parts, last_hop = self._parts_and_hop(run, out)
    parts = self._result(run, logits_BV, "sharded", KVParts(kv_parts, last_hop))
    return self.moved_to_last_rank(parts)

  def moved_to_last_rank(self, result: PrefillResult) -> PrefillResult:
    """The result in parts as cache="last": the cache brought onto the last rank as
    prefill(cache="last") brings it, from the parts that run_prefill(move_cache=False) leaves.
    Every layer in prompt order, or where a window is shorter than the prompt the
    every-position layers and each window's ring only (kv_cache.kept_on_last_rank:
    KV-Runahead joins its last hop, the peers move only the rings' windows)."""
    parts, mesh, layout = result.past, result.mesh, result.cache_layout
    # The parts move unless KV-Runahead's last hop holds them or one rank holds them all.
    moved = (parts is None or parts.last_hop is None) and mesh.shape[AXIS] > 1
    as_last = functools.partial(
      dataclasses.replace, result, cache="last", moved=moved, replicated_logits=None
    )
    if parts is None:  # another process holds every part (auto's one-device pick)
      return as_last(past=None)
    if parts.kept is not None:  # cut already (cache="sharded"): gather the parts, keep rings
      k, v, rings = cut_on_last_rank(parts.kv_parts, parts.rings, layout, mesh, parts.kept)
      return as_last(past=None if k is None else KVWhole(k, v, parts.kept, rings))
    kept = decode.DecodeLayout.of(result.config, result.prompt_len)
    if kept.rings == (None,):
      k, v = gather_on_last_rank(parts.kv_parts, layout, mesh, last_hop=parts.last_hop)
      return as_last(past=None if k is None else KVWhole(k, v))
    k, v, rings = kept_on_last_rank(
      parts.kv_parts, layout, mesh, kept, result.lengths, parts.last_hop
    )
    return as_last(past=None if k is None else KVWhole(k, v, kept, rings))

  def at_last_real_tokens(self, run: PrefillRun, result):
    """cache="last": the last real tokens' step where the whole cache lies
    (`CacheForm.last_real_tokens_joined`). The parts' rows got theirs in `in_parts`."""
    if result.cache == "sharded":
      return result
    if result.past is None:  # another process holds the cache and the logits
      return dataclasses.replace(result, logits=None)
    return self.last_real_tokens_joined(run, result)

  def with_decoded(self, past: KVWhole, cache: KVCache) -> KVWhole:
    return past.with_groups(cache)

  # --- how a result reads its past ---------------------------------------------------------

  def sharded_decode(self, model, result, max_new_tokens: int):
    """The sharded step of K,V (sharded_decode.sharded_decode_program), the parts as its
    input, and its caches per group of the kept layout: the decoded tokens' tail [L_f, 2, B,
    M, K, H] of the every-position layers, a copy of each window's ring (heads split over
    "model" on a 2-D mesh)."""
    past, mesh = result.past, result.mesh
    B, (L_f, K, H) = len(result.lengths), (past.kv_parts.shape[1], *past.kv_parts.shape[4:])
    kept = past.kept or decode.DecodeLayout.whole(L_f)
    tail = decode.zeros_on(
      (L_f, 2, B, max_new_tokens, K, H), past.kv_parts.dtype, sharded_decode.tail_sharding(mesh)
    )
    groups = tuple(
      tail if ring is None else steppers.copied(past.rings[g]) for g, ring in enumerate(kept.rings)
    )
    program = sharded_decode.sharded_decode_program(model.graphdef, mesh, result.cache_layout, kept)
    return program, (past.kv_parts,), (groups,)

  def decode_past(self, result, lengths_B, capacity: int, consume: bool):
    """The cache grown into a fresh buffer for `capacity` positions (generate's own too: the
    prefill's is never written), a window shorter than the capacity kept as its ring alone
    (decode.decode_caches); with no room to grow and `consume`, the prefill's own buffers
    (`at_last_real_tokens`' step writes into them)."""
    past = result.past
    if consume and capacity == result.prompt_len:
      return past.decode_cache()
    layout = decode.DecodeLayout.of(result.config, capacity)
    return decode.decode_caches(
      past.k_layers, past.v_layers, lengths_B, layout, capacity, past.kept, past.rings
    )

  def decode_cache_spec(self, cache: KVCache) -> KVCache:
    """Every group's K,V split by head over "model" (as the prefill left it)."""
    heads = split_dims("LBSKH", K=MODEL_AXIS)
    return KVCache(cache.layout, tuple((heads, heads) for _ in cache.groups))

  def decode_cache(self, result):
    past = result.past
    if past is None:  # another process holds the cache
      return None, None
    if result.cache == "last":
      return prompt_order(
        past.k_layers, past.v_layers, past.kept, past.rings, result.lengths, result.prompt_len
      )
    if past.kept is None:
      return gather_on_last_rank(
        past.kv_parts, result.cache_layout, result.mesh, last_hop=past.last_hop
      )
    # Windowed layers keep rings: the parts' layers gathered as ever, each ring's positions
    # in prompt order (zeros before its window), stacked by layer, where the every-position
    # layers lie (the last rank's device, or its row's heads).
    k, v, rings = cut_on_last_rank(
      past.kv_parts, past.rings, result.cache_layout, result.mesh, past.kept
    )
    if k is None:
      return None, None  # another process holds the last rank
    kv = prompt_order(k, v, past.kept, rings, result.lengths, result.prompt_len)
    return tuple(jax.device_put(x, k.sharding) for x in kv)

  def gather_cache(self, result):
    return _model_heads(*self.decode_cache(result), result.kv_heads)

  def layer_cache(self, result, layer: int):
    k, v = self.gather_cache(result)
    return k[layer], v[layer]


FORM = KVForm(
  name="kv",
  runs=lambda record: True,  # every registered strategy's own rank body
  caches=("last", "sharded"),
  operands=lambda tokens_BT, ends_B: tokens_BT,  # a causal past is written per position
  joins_apart=True,
)
