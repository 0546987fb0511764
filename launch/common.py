"""Helpers shared by the launchers: device setup before jax loads, user-error reporting."""

from __future__ import annotations

import contextlib
import os
import sys

DEFAULT_EMULATED_DEVICES = 8


def setup_devices(num_devices: int | None) -> bool:
  """On a CPU-only machine, asks XLA for emulated devices. Must run before jax is imported.

  Returns True when the devices are emulated CPU devices.
  """
  if "jax" in sys.modules:
    import jax

    return jax.devices()[0].platform == "cpu"
  wanted = max(num_devices or DEFAULT_EMULATED_DEVICES, 1)
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={wanted}".strip()
  import jax

  return jax.devices()[0].platform == "cpu"


@contextlib.contextmanager
def user_errors():
  """A user mistake (ValueError) becomes one clear line on stderr and exit status 2."""
  try:
    yield
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def parse_partition(text: str):
  if text in ("even", "search", "predict", "balanced"):
    return text
  try:
    return [int(x) for x in text.split(",")]
  except ValueError:
    raise ValueError(
      f"--partition must be even, search, predict, balanced or comma-separated "
      f"integers, got {text!r}"
    ) from None


def prompt_tokens(model, prompt: str | None, context_len: int, batch: int, seed: int):
  import numpy as np

  from kvr_jax import demo

  if batch < 1:
    raise ValueError(f"--batch must be >= 1, got {batch}")
  if prompt is not None:
    if model.tokenizer is None:
      raise ValueError("--prompt needs a model with a tokenizer; use --context_len instead")
    ids = model.tokenizer(prompt)["input_ids"]
    if not ids:
      raise ValueError("--prompt is empty")
    return np.asarray([ids] * batch, np.int32)
  if context_len < 1:
    raise ValueError(f"--context_len must be >= 1, got {context_len}")
  if context_len > model.config.max_position_embeddings:
    raise ValueError(
      f"--context_len={context_len} exceeds the model's max_position_embeddings="
      f"{model.config.max_position_embeddings}"
    )
  return demo.synthetic_prompt(model.config.vocab_size, context_len, batch, seed)
