"""KV-Runahead's modelled layer (kvr_jax.planning.costmodel): each rank's phases, each hop's
bytes and seconds, and the steps in the program's order."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvr_jax.core.caches import kept_cache
from kvr_jax.core.chunks import prefix_ends
from kvr_jax.runtime.roofline import (
  Compute,
  ModelledLayer,
  Receive,
  Send,
  phase_seconds,
  phase_work,
  total_work,
  visible_keys,
  work_kwargs,
)
from kvr_jax.strategies.runahead.schedule import rows_before_hop


def layer_work(config, chunks: tuple[int, ...], setup):
  """One layer of KV-Runahead (of `config.kind`): each rank's `RankWork`, and each hop's bytes
  and seconds. Rank i attends from the first key its chunk's queries see and hop k carries
  the kind's span of [0, S_k) (`AttentionKind.hop_span`: with a sliding window the last W-1
  keys, bounded by W). With a kernel whose partials merge
  (`Setup.diagonal_first`) rank i > 0 has a "diagonal" phase (its first `rows_before_hop`
  rows, before the hop) and its "attention" is the prefix and the rest of its diagonal."""
  links = setup.links
  p, ends, kind = len(chunks), prefix_ends(chunks), config.kind
  keys = [ends[i] - kind.first_key(ends[i] - chunks[i]) for i in range(p)]
  early_rows = rows_before_hop(config, chunks) if setup.diagonal_first else (0,) * p
  ranks = [rank_work(config, setup, chunks[i], keys[i], early_rows[i]) for i in range(p)]
  hop_bytes = [
    kind.hop_bytes(config, ends[k], setup.batch, setup.dtype_bytes) for k in range(p - 1)
  ]
  hop_seconds = [hop_bytes[k] / links.link_bandwidth(k) + links.latency for k in range(p - 1)]
  return ranks, hop_bytes, hop_seconds


@dataclasses.dataclass(frozen=True)
class RankWork:
  """One rank's modelled layer: its phases' Work, their seconds on the setup, and the sum."""

  phases: dict
  seconds: dict
  total: Any  # roofline.Work


@kept_cache(8192)
def rank_work(config, setup, c: int, keys: int, early_rows: int) -> RankWork:
  """The `RankWork` of a rank with c queries over `keys` keys (its prefix: keys - c) whose
  first `early_rows` rows attend their diagonal before the hop (`layer_work`). Kept: a
  partition search weighs thousands of splits, and a transfer of tokens between two ranks
  leaves every rank before the donor and after the taker as it was (tiny-llama's modelled
  search on 16 ranks: 1.6 s -> 1.0 s). Its dicts are shared: read them, never change them."""
  kw = work_kwargs(setup)
  window = config.kind.window
  phases = phase_work(config, c, keys, **kw)
  prefix = keys - c
  if setup.diagonal_first and prefix > 0:
    r = early_rows
    # Before the hop: rows [0, r) of the diagonal, a causal r x r square.
    diagonal = phase_work(config, r, r, **kw)["attention"]
    # The prefix lies wholly before the queries: the keys they see there, on average.
    seen = visible_keys(prefix, c, window) - visible_keys(0, c, window)
    unmasked = dict(kw, causal_skip=False)
    attention = phase_work(config, c, prefix, **unmasked, scored_keys=seen)["attention"]
    if r < c:  # after it: rows [r, c) at the end of the chunk's c keys
      attention = attention + phase_work(config, c - r, c, **kw)["attention"]
    phases = dict(phases, diagonal=diagonal, attention=attention)
  return RankWork(phases, phase_seconds(config, phases, c, setup), total_work(phases))


def hop_chain_steps(qkv, diagonal, attention, rest, hop_seconds) -> tuple[tuple, ...]:
  """Each rank's steps in the program's order, from per-rank seconds: its qkv, its early
  diagonal rows (where it has any), the prefix from rank i-1, the longer prefix on to rank
  i+1 (hop i), then attention and the rest."""
  p = len(qkv)
  ranks = []
  for i in range(p):
    steps = [Compute("qkv", qkv[i])]
    if diagonal[i] > 0:
      steps.append(Compute("diagonal", diagonal[i]))
    if i > 0:
      steps.append(Receive(i - 1))
    if i < p - 1:
      steps.append(Send(i + 1, hop_seconds[i], f"hop{i}"))
    steps += [Compute("attention", attention[i]), Compute("rest", rest[i])]
    ranks.append(tuple(steps))
  return tuple(ranks)


def modelled_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  """Ranks run independently; hop k couples only ranks k and k+1 (`hop_chain_steps`)."""
  del context_len  # sum(chunks)
  ranks, hop_bytes, hop_seconds = layer_work(config, chunks, setup)
  steps = hop_chain_steps(
    *(
      [rank.seconds.get(name, 0.0) for rank in ranks]
      for name in ("qkv", "diagonal", "attention", "rest")
    ),
    hop_seconds,
  )
  totals = [rank.total for rank in ranks]
  return ModelledLayer(
    steps,
    tuple(chunks),
    tuple(w.flops for w in totals),
    tuple(w.bytes for w in totals),
    tuple(float(b) for b in hop_bytes),
  )
