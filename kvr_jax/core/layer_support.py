"""Which kinds of layer (models/layer_kinds.py) prefill's parallel programs run, checked once
where a plan is made: a model with layers of another kind is refused by name, before
anything compiles, and told how it runs today."""

from __future__ import annotations

from models.layer_kinds import unbuilt_kinds


def check_layers_run(config, what: str) -> None:
  """Refuses `what` (a prefill, tensor parallelism) on a model with layers prefill's
  strategies do not run yet (linear attention: KV-Runahead's state hop has its own program,
  kvr_jax.strategies.hybrid)."""
  unbuilt = unbuilt_kinds(config)
  if unbuilt:
    names = ", ".join(kind.name for kind in unbuilt)
    raise ValueError(
      f"{what} of a {config.architecture} model is not built: its layers include {names}, "
      "which prefill's strategies, decode and tensor parallelism do not run yet. "
      "KV-Runahead runs it through kvr_jax.inference.hybrid (prefill_hybrid, "
      "generate_hybrid); one device through its own module: `model.module(tokens)` for "
      "logits, `.forward(tokens, capacity=...)` for the cache, `.decode_step(...)`"
    )
