"""strategy="auto": the calibrated cost model picks the strategy (and KV-Runahead's split) for
a prompt length, a mesh size, a model and the links, and says what it predicted for each.

Every figure here is MODELLED (kvr_jax.planning.costmodel), never measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from kvr_jax.core.caches import kept_cache
from kvr_jax.planning import costmodel, search
from kvr_jax.planning.costmodel import Setup
from kvr_jax.strategies import REGISTRY
from models.config import ModelConfig

# What "auto" chooses from: the registered strategies that say so (`auto_candidate`): the
# oracle on one device and the parallel strategies without a fixed kernel.
AUTO_CANDIDATES = tuple(name for name, spec in REGISTRY.items() if spec.auto_candidate)


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
  """What strategy="auto" picked: `strategy`, KV-Runahead's `chunks` where it picked it (on
  a hybrid, the linear layers'; `full_chunks` the full layers' own where that models faster,
  `search.kind_split_search`), and the MODELLED TTFT of every candidate (`predicted_s`,
  seconds)."""

  strategy: str
  chunks: tuple[int, ...] | None
  predicted_s: Mapping[str, float]
  full_chunks: tuple[int, ...] | None = None

  @property
  def partition(self):
    """The split as `prefill(partition=)` takes it: lengths, or one per layer kind."""
    if self.chunks is None:
      return None
    if self.full_chunks is None:
      return list(self.chunks)
    return {"linear": list(self.chunks), "full": list(self.full_chunks)}

  def __str__(self) -> str:
    others = ", ".join(f"{s} {t * 1e3:.3g} ms" for s, t in sorted(self.predicted_s.items()))
    kinds = "" if self.full_chunks is None else f", its full layers on {list(self.full_chunks)}"
    return f"auto picked {self.strategy}{kinds} (modelled TTFT: {others})"


@kept_cache(256)
def choose_strategy(
  config: ModelConfig, context_len: int, num_ranks: int, setup: Setup, *, multiple: int = 1
) -> StrategyChoice:
  """The candidate with the lowest modelled TTFT for `context_len` tokens on `num_ranks`
  ranks (single runs on one of them); KV-Runahead with its modelled search split (on a
  hybrid, per layer kind where that models faster: `search.kind_split_search`). Kept per
  arguments (all frozen): a prefill that asks again, e.g. every timed call, searches once."""
  predicted, chunks, full = {}, None, None
  for name in AUTO_CANDIDATES:
    spec = REGISTRY[name]
    if spec.max_ranks == 1:
      predicted[name] = costmodel.simulate(config, name, context_len, setup).ttft
    elif num_ranks > 1 and context_len >= num_ranks:
      split = split_full = None
      if spec.partitioned:  # its modelled search split (a hybrid's per layer kind)
        split = search.modelled_search(config, context_len, num_ranks, setup, multiple=multiple)
        if search.splits_by_kind(config):
          split, split_full = search.kind_split_search(
            config, context_len, num_ranks, setup, split, multiple=multiple
          )
        chunks, full = split, split_full
      predicted[name] = costmodel.simulate(
        config,
        name,
        context_len,
        setup,
        num_ranks=num_ranks,
        partition=split,
        full_partition=split_full,
      ).ttft
  best = min(predicted, key=predicted.get)
  # Read-only: the choice is kept and handed to every prefill that asks again.
  if not REGISTRY[best].partitioned:
    chunks = full = None
  return StrategyChoice(best, chunks, MappingProxyType(predicted), full)
