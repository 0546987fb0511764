"""Which kinds of layer (models/layer_kinds.py) kvr_jax's parallel programs run, checked once
where a plan is made: a model with layers of another kind is refused by name, before
anything compiles, and told how it runs today."""

from __future__ import annotations

from models.layer_kinds import unbuilt_kinds


def check_layers_run(config, what: str) -> None:
  """Refuses `what` (a prefill, a plan, tensor parallelism) on a model with layers the
  strategies do not run yet (linear attention: its state hop is not built)."""
  unbuilt = unbuilt_kinds(config)
  if unbuilt:
    names = ", ".join(kind.name for kind in unbuilt)
    raise ValueError(
      f"{what} of a {config.architecture} model is not built: its layers include {names}, "
      "which kvr-jax's strategies, decode and planning do not run yet. It runs on one "
      "device through its own module: `model.module(tokens)` for logits, "
      "`model.module.forward(tokens, capacity=...)` for the cache and "
      "`model.module.decode_step(...)` to decode from it"
    )
