"""Layer 3: prefill strategies, one module each, one interface (base.Strategy), one registry.

Adding a strategy: write its module (layout, arrange, its rank body, its modelled
layer for the cost model and a STRATEGY; its program is the one builder's, by_kind),
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


def registered_record(strategy) -> Strategy | None:
  """The registered record whose program `strategy` (a name or a record: a variant resolves
  to the record it was made from, `Strategy.registered_name`) runs; None for an unknown
  name. What a family's programs ask of a strategy is then its record's, never its name."""
  name = strategy.registered_name if isinstance(strategy, Strategy) else strategy
  return REGISTRY.get(name) if isinstance(name, str) else None


def family_program(strategy, body: str | None = None, split_shape=None) -> tuple:
  """What a model's own program (strategies.hybrid, strategies.latent) runs for `strategy` (a
  name or a record): (the registered record whose program it is, KV-Runahead's body, its
  split as data's envelope), the body and envelope as given or else from a KV-Runahead
  record's options (`runahead.with_body`, `runahead.split_as_data_strategy`). One record per
  program, so that a variant and its options given apart compile once."""
  spec = get_strategy(strategy)
  options = spec.options if isinstance(spec.options, runahead.Options) else None
  if options is not None:
    body = options.body if body is None else body
    split_shape = options.split_shape if split_shape is None else split_shape
  return get_strategy(spec.registered_name), body, split_shape


__all__ = [
  "REGISTRY",
  "STRATEGIES",
  "TRACE_COUNT",
  "Strategy",
  "family_program",
  "get_strategy",
]
