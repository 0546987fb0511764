"""Which kinds of layer (models/layer_kinds.py) prefill's parallel programs run, checked once
where a plan is made: a model with layers of another kind is refused by name, before
anything compiles, and told how it runs today."""

from __future__ import annotations

from kvr_jax.core.chunks import check_chunks
from models.layer_kinds import GatedDeltaNetKind, unbuilt_kinds


def check_layers_run(config, what: str) -> None:
  """Refuses `what` (a prefill's K,V strategies, tensor parallelism) on a model with layers
  they do not run (each kind says how it runs: linear and latent attention through their
  cache form's programs, kvr_jax.inference.cache_form, which prefill runs for them)."""
  unbuilt = unbuilt_kinds(config)
  if unbuilt:
    names = ", ".join(kind.name for kind in unbuilt)
    runs = "; ".join(dict.fromkeys(kind.runs_today for kind in unbuilt))
    raise ValueError(
      f"{what} of a {config.architecture} model is not built: its layers include {names}, "
      f"which prefill's K,V strategies and decode do not run. {runs}; "
      "one device through its own module: `model.module(tokens)` for logits, "
      "`.forward(tokens, capacity=...)` for the cache, `.decode_step(...)`"
    )


def check_full_partition(config, spec, full_partition, context_len, num_ranks):
  """KV-Runahead's own split of a hybrid model's full-attention layers, checked (one check
  for the programs and the cost model), or None where every layer takes the one partition.
  spec: the strategy's record (strategies.base.Strategy): a split per layer kind is its
  prefix chain's."""
  if full_partition is None:
    return None
  if not spec.prefix_chain:
    raise ValueError(
      "full_partition is KV-Runahead's split of a hybrid model's full layers; "
      f"{spec.name} lays out its own"
    )
  linear = [isinstance(kind, GatedDeltaNetKind) for kind in config.kinds]
  if all(linear) or not any(linear):
    names = ", ".join(kind.name for kind in config.kinds)
    raise ValueError(
      "full_partition splits a hybrid model's full-attention layers apart from its linear "
      f"ones; this model's layers are all {names}"
    )
  return check_chunks(full_partition, context_len, num_ranks)
