"""What a model whose cache is not (K, V) per layer says of it: its `CacheForm`.

A hybrid (Qwen3.5, Qwen3-Next: Gated DeltaNet's fixed-size state and halo beside full
layers' K,V, kvr_jax.inference.hybrid.FORM) and latent attention (DeepSeek-V3, Kimi K2,
Moonlight: one latent per position, kvr_jax.inference.latent.FORM) are planned and run by
the same `kvr_jax.prefill` as any model; the form says what their programs run and how their
cache is placed, grown, decoded and read, and their result is a
`kvr_jax.inference.results.ModelCache`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from kvr_jax.strategies import REGISTRY, family_program, registered_record


@dataclasses.dataclass(frozen=True)
class CacheForm:
  """One model cache form's contract with the prefill and decode paths.

  runs(record): whether its programs run a registered strategy's record (the parallel ones by
  what the record lends; every one-rank record runs as the model's own forward on one device
  or one rank's model group); `strategies` names them. caches: the layouts its decode reads
  ("last": joined on the last rank; "sharded": left in the ranks' parts). group_cache_spec:
  how the joined cache lies over a model group (a PartitionSpec or a pytree of them).
  How the past travels after the program (`prefill.prefill_outputs` runs one of them on the
  program's outputs `out`, per rank [p, ...], for a plan): left_in_parts(out, plan) ->
  cache="sharded"'s `ModelCache` fields; joined_from_last_hop(out, plan, capacity) -> the
  cache of `capacity` positions from the last rank's outputs alone (KV-Runahead's kept last
  hops: no move); joined_from_parts(out, plan, capacity) -> the cache from every rank's
  parts moved onto the last rank in prompt order (None in a process without it).
  operands(tokens_BT, ends_B, m) -> the program's tokens operand (where rows end before the
  prompt, what the past needs to stop there). grown(cache, capacity) -> the cache with room
  for `capacity` positions (a fresh buffer: the decode steps donate theirs).
  sharded_stepper(model, result, max_new_tokens, seed): decode from cache="sharded"
  (`steppers.model_cache_stepper`'s return)."""

  name: str
  runs: Callable
  caches: tuple[str, ...]
  group_cache_spec: Any
  operands: Callable
  left_in_parts: Callable
  joined_from_last_hop: Callable
  joined_from_parts: Callable
  grown: Callable
  one_device_layout: Callable  # (config, cache split over m, m) -> the model's own layout
  prompt_part: Callable  # (cache, T) -> its first T positions (the room for decoding cut)
  sharded_stepper: Callable
  # (a one-rank prefill's cache, T, its mesh) -> cache="sharded"'s ModelCache fields
  one_rank_parts: Callable
  # The layer kinds whose outputs the cache holds even where no layer of the model is of
  # them (a hybrid's full layers' K,V: empty, as decode reads it), beside the model's own
  # (`strategies.by_kind.compile_plan`, the plan's program).
  also_kinds: tuple = ()
  # Whether KV-Runahead's split as data runs (`runahead.split_as_data_strategy`'s record:
  # one program for every split that fits its envelope).
  takes_split_as_data: bool = False
  # Whether KV-Runahead takes a split per layer kind ({"linear": .., "full": ..}: a hybrid's
  # two kinds of layer balance on different splits, strategies.kind_program.KindSplit).
  splits_per_kind: bool = False
  # A fixed-size past that a row's padding would advance (a linear layer's state and halo,
  # where a causal K,V or latent past is written per position): the prefill of padded rows
  # stops it before each row's last real token, whose decode step then runs it from there.
  stops_at_row_ends: bool = False
  # (config, strategy record, T, p, the full layers' own chunks or None) -> None: what the
  # form's programs refuse of a split, by name, once the plan has made it.
  check_split: Callable | None = None
  # (result, the caches the sharded step returned) -> the result's fields that the step of
  # a padded row's last real token changed (prefill's `_at_last_real_tokens`).
  after_sharded_step: Callable = lambda result, caches: {}

  @property
  def strategies(self) -> tuple[str, ...]:
    """The registered strategies this form's programs run, by name (messages, tests)."""
    return tuple(name for name, record in REGISTRY.items() if self._runs(record))

  def _runs(self, record) -> bool:
    return record.max_ranks == 1 or self.runs(record)

  def check_plan(self, config, spec, cache: str) -> None:
    """What a plan for this form runs, refused by name before anything compiles: its
    strategies and cache layouts. Timeline probes are the record's (`Strategy.timeline_probes`,
    checked by the plan for every model): these programs mark what the K,V ones do. Rows
    padded past their length (a bucket, a ragged batch) run in both layouts, as on K,V
    models."""
    what = f"a {config.architecture} model ({self.name} cache)"
    record, (_, _, split_shape) = registered_record(spec), family_program(spec)
    if record is None or not self._runs(record):
      raise ValueError(f"{what} runs under {list(self.strategies)}, not {spec.name!r}")
    if split_shape is not None and not self.takes_split_as_data:
      raise ValueError(f"{what} does not take KV-Runahead's split as data ({spec.name!r})")
    if cache not in self.caches:
      raise ValueError(f"{what} keeps its cache as {list(self.caches)}, not cache={cache!r}")


def padded_positions(array, axis: int, capacity: int):
  """`array` with room for `capacity` positions on `axis` (never fewer than it has)."""
  pad = [(0, 0)] * array.ndim
  pad[axis] = (0, max(capacity - array.shape[axis], 0))
  return jnp.pad(array, pad)
