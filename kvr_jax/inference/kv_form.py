"""The K,V cache form, `FORM`: a model of softmax attention layers alone (Llama, Mistral,
Qwen2/3 and their MoE, Mixtral, Gemma 3, Falcon, gpt-oss). Each layer keeps (K, V) per
position, or where its window is shorter than the prompt a ring of its window
(decode.DecodeLayout); the result is a `WholeCache` (cache="last": the cache in prompt order
on the last rank, KV-Runahead's joined from its last hop without a move) or `CacheParts`
(cache="sharded", and run_prefill(move_cache=False): each rank's part where it was
computed). Every registered strategy runs it, on 1-D and 2-D meshes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.core.layer_support import check_layers_run
from kvr_jax.inference import decode, sharded_decode
from kvr_jax.inference.cache_form import CacheForm, PrefillRun, replicated_logits, result_fields
from kvr_jax.inference.results import CacheParts, WholeCache
from kvr_jax.runtime.mesh import global_array, rank_device, spans_processes
from kvr_jax.strategies.base import last_rank


def hop_holds_rows(config, chunks, lengths_B) -> bool:
  """Whether KV-Runahead's last hop and the last chunk hold what every row decodes from. A
  windowed layer's hop carries only the W-1 keys before the last chunk (the prompt's last
  window): a row that ends at or before that chunk's start (a padded row) reads keys before
  them, so the parts move for that run. Layers whose hop carries the whole prefix hold any
  row."""
  hop_end = sum(chunks[:-1])
  whole = all(kind.hop_keeps_whole_prefix(hop_end) for kind in config.kinds)
  return whole or int(np.min(lengths_B)) > hop_end


def _piece_on(array: jax.Array, device):
  """`device`'s copy of a replicated array as a single-device array; None where `device` is
  another process's."""
  piece = next((s.data for s in array.addressable_shards if s.device == device), None)
  if piece is None:
    return None
  return jax.device_put(piece, jax.sharding.SingleDeviceSharding(device))


@dataclasses.dataclass(frozen=True)
class KVForm(CacheForm):
  """K,V per layer (`FORM`): the hooks of `run_prefill` for `WholeCache` and `CacheParts`."""

  def check_layers(self, config) -> None:
    """A layer no K,V program runs (a kind outside every form) is refused by name."""
    check_layers_run(config, "prefill")

  def _fields(self, run: PrefillRun) -> dict:
    plan = run.plan
    return dict(
      **result_fields(plan, run.lengths_B),
      cache_layout=plan.cache_layout,
      kv_heads=run.model.config.num_kv_heads,
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
    if run.plan.cache == "sharded" or deferred:
      return CacheParts(None, **self._fields(run), kv_parts=None, mesh=run.plan.mesh)
    return WholeCache(None, **self._fields(run), k_layers=None, v_layers=None)

  def in_parts(self, run: PrefillRun, logits_pBV, logits_BV, out, deferred: bool):
    """The parts where they lie (with KV-Runahead's last hop: `CacheParts.moved_to_last_rank`
    joins it without a move). A padded row's logits come from one decode step of its last
    real token over the parts (here, before a window's layers keep only their rings); with
    cache="sharded", a window the prompt outgrew keeps its ring alone from here on."""
    plan, model = run.plan, run.model
    mesh, layout = plan.mesh, plan.cache_layout
    kv_parts, last_hop = self._parts_and_hop(run, out)
    if run.padded:  # every row's logits from the step, replicated (no copy of the program's)
      replicated = sharded_decode.last_real_logits_sharded(
        model, model.state_for(mesh), mesh, layout, kv_parts, run.last_tokens_B, run.lengths_B
      )
      logits_BV = _piece_on(replicated, rank_device(mesh, last_rank(plan.chunks)))
    else:
      replicated = replicated_logits(plan, logits_pBV)
    # In one process the owner's logits are every process's.
    replicated = replicated if spans_processes(mesh) else None
    parts = dict(kv_parts=kv_parts, mesh=mesh, last_hop=last_hop, replicated_logits=replicated)
    kept = decode.DecodeLayout.of(model.config, plan.prompt_len)
    if plan.cache == "sharded" and kept.rings != (None,):
      # A window the prompt outgrew: its layers keep only their rings from here on (what
      # decode reads), the parts only the other layers.
      program = sharded_decode.sharded_rings_program(mesh, layout, kept)
      lengths = global_array(np.asarray(run.lengths_B, np.int32), NamedSharding(mesh, jax.P()))
      parts["kv_parts"], rings = program(kv_parts, lengths)
      parts.update(kept=kept, rings=rings)
    return CacheParts(logits_BV, **self._fields(run), **parts)

  def joined(self, run: PrefillRun, logits_BV, out):
    kv_parts, last_hop = self._parts_and_hop(run, out)
    parts = CacheParts(
      logits_BV, **self._fields(run), kv_parts=kv_parts, mesh=run.plan.mesh, last_hop=last_hop
    )
    return parts.moved_to_last_rank(run.model.config)

  def at_last_real_tokens(self, run: PrefillRun, result):
    """cache="last": one decode step of each row's last real token at its own position, where
    the whole cache lies (its K,V, already in the cache, are written again identically). The
    parts' rows got theirs in `in_parts`."""
    if isinstance(result, CacheParts):
      return result
    if result.k_layers is None:  # another process holds the cache and the logits
      return dataclasses.replace(result, logits=None)
    logits_BV, caches = decode.last_real_logits(
      run.model, *result.groups(), run.last_tokens_B, run.lengths_B
    )
    return result.with_groups(logits_BV, caches)


FORM = KVForm(
  name="kv",
  runs=lambda record: True,  # every registered strategy's own rank body
  caches=("last", "sharded"),
  operands=lambda tokens_BT, ends_B, m: tokens_BT,  # a causal past is written per position
  joins_apart=True,
)
