"""Layer 3: prefill strategies, one module each, one interface (base.Strategy), one registry.

Adding a strategy: write its module (layout, arrange, compile, its modelled
layer for the cost model and a STRATEGY),
add it to REGISTRY below, and add its row to the parity matrix in tests/test_strategies.py.
"""

from kvr_jax.strategies import allgather, ring, runahead, single, tsp
from kvr_jax.strategies.base import TRACE_COUNT, Strategy

REGISTRY: dict[str, Strategy] = {
  s.name: s
  for s in (
    single.STRATEGY,
    tsp.STRATEGY,
    runahead.STRATEGY,
    ring.STRATEGY,
    allgather.STRATEGY,
  )
}
STRATEGIES = tuple(REGISTRY)


def get_strategy(name: str | Strategy) -> Strategy:
  """The registered strategy called `name` (a `Strategy` itself passes through: a variant
  outside the registry, such as runahead.PER_RANK_STRATEGY); a clear error for anything else."""
  if isinstance(name, Strategy):
    return name
  if not isinstance(name, str) or name not in REGISTRY:
    raise ValueError(f"unknown strategy {name!r}; expected one of {STRATEGIES}")
  return REGISTRY[name]


__all__ = ["REGISTRY", "STRATEGIES", "TRACE_COUNT", "Strategy", "get_strategy"]
