"""Helpers shared by the launchers: device setup before jax loads, user-error reporting."""

from __future__ import annotations

import contextlib
import os
import sys

import jax
import numpy as np

from kvr_jax.core import resources
from kvr_jax.inference.text import encode_text
from kvr_jax.planning.partition import METHODS, PartitionPlan
from kvr_jax.planning.presets import check_preset_names
from kvr_jax.runtime import compilation
from kvr_jax.tools.timing import synthetic_prompt

DEFAULT_EMULATED_DEVICES = 8


def setup_devices(num_devices: int | None) -> bool:
  """On a CPU-only machine, asks XLA for emulated CPU devices. Must run before JAX's backend
  starts (importing jax and kvr_jax does not start it; the first device query does).

  Returns True when the devices are emulated CPU devices.
  """
  wanted = max(num_devices or DEFAULT_EMULATED_DEVICES, 1)
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    try:
      jax.config.update("jax_num_cpu_devices", wanted)
    except RuntimeError:  # the backend already runs (a notebook, a test): keep its devices
      pass
  return jax.devices()[0].platform == "cpu"


@contextlib.contextmanager
def user_errors():
  """A user mistake (ValueError) becomes one clear line on stderr and exit status 2."""
  try:
    yield
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def compilation_cache(enabled: bool, directory: str | None) -> str | None:
  """--compilation_cache / --compilation_cache_dir: turns JAX's persistent compilation cache
  on (kvr_jax.runtime.compilation) and returns its directory; None when turned off."""
  if not enabled:
    if directory is not None:
      raise ValueError("--compilation_cache_dir was given with --nocompilation_cache")
    compilation.disable()
    return None
  return compilation.enable(directory)


def parse_partition(text: str, hardware: str = "local", links: str = "local", extra=()):
  """--partition: a method name (with the cost-model presets) or comma-separated lengths;
  a name in `extra` (a launcher's own, like the benchmark's "fitted") is returned as is."""
  if text in extra:
    return text
  if text in METHODS:
    try:
      check_preset_names(hardware, links)
    except ValueError as e:
      raise ValueError(f"--hardware/--links: {e}") from None
    return PartitionPlan(text, hardware=hardware, links=links)
  try:
    return [int(x) for x in text.split(",")]
  except ValueError:
    raise ValueError(
      f"--partition must be one of {METHODS} or comma-separated integers, got {text!r}"
    ) from None


def prompt_tokens(
  model, prompts, context_lens, batch: int, seed: int, chat_template: bool = True
) -> list[np.ndarray]:
  """The prompt rows of --prompt (texts, repeatable; the chat template applied where the
  tokenizer has one and chat_template) or --context_len (synthetic lengths, a comma list),
  --batch copies of a single one; rows may differ in length (a ragged batch)."""
  if batch < 1:
    raise ValueError(f"--batch must be >= 1, got {batch}")
  if prompts:
    if model.tokenizer is None:
      raise ValueError("--prompt needs a model with a tokenizer; use --context_len instead")
    if len(prompts) > 1 and batch > 1:
      raise ValueError("--batch copies one --prompt; with several --prompt flags leave it out")
    rows = []
    for text in prompts:
      if not text.strip():
        raise ValueError(f"--prompt {text!r} is empty (no tokens)")
      rows.append(encode_text(model.tokenizer, text, chat_template))
    return rows * batch
  lengths = positive_ints(context_lens, "--context_len")
  if len(lengths) > 1 and batch > 1:
    raise ValueError("--batch copies one --context_len; with a comma list leave it out")
  limit = model.config.max_position_embeddings
  for length in lengths:
    if length > limit:
      raise ValueError(
        f"--context_len={length} exceeds the model's max_position_embeddings={limit}"
      )
  if len(lengths) == 1:
    return list(synthetic_prompt(model.config.vocab_size, lengths[0], batch, seed))
  return [
    synthetic_prompt(model.config.vocab_size, n, 1, seed + i)[0] for i, n in enumerate(lengths)
  ]


def prompt_texts(prompts: list[str] | None, prompt_file: str | None) -> list[str] | None:
  """--prompt (repeatable) and --prompt_file: the file's text is one prompt, followed on the
  next line by --prompt's text where there is exactly one (a document, then its question)."""
  if prompt_file is None:
    return prompts
  if len(prompts or []) > 1:
    raise ValueError("--prompt_file makes one prompt; give at most one --prompt with it")
  try:
    with open(prompt_file, encoding="utf-8") as f:
      document = f.read()
  except OSError as e:
    raise ValueError(f"--prompt_file {prompt_file}: {e.strerror}") from None
  except UnicodeDecodeError:
    raise ValueError(f"--prompt_file {prompt_file}: not UTF-8 text") from None
  if not document.strip():
    raise ValueError(f"--prompt_file {prompt_file} is empty")
  return [document.rstrip("\n") + "\n" + prompts[0] if prompts else document]


def parse_buckets(text: str):
  """--buckets: "auto", "none" or comma-separated lengths (checked against the model later)."""
  if text == "auto":
    return "auto"
  if text == "none":
    return None
  try:
    return tuple(int(x) for x in text.split(","))
  except ValueError:
    raise ValueError(
      f"--buckets must be auto, none or comma-separated lengths, got {text!r}"
    ) from None


def positive_ints(values, flag: str) -> list[int]:
  """A comma-list flag of positive integers, or one clear error naming the flag."""
  try:
    out = [int(v) for v in values]
  except ValueError:
    raise ValueError(f"{flag} must be comma-separated positive integers, got {values!r}") from None
  if not out or min(out) < 1:
    raise ValueError(f"{flag} must be comma-separated positive integers, got {values!r}")
  return out


def check_output_dir(directory: str, flag: str = "--output_dir") -> str:
  """Before any work: the directory exists or can be made, and can be written."""
  return resources.writable_directory(directory, f"{flag}={directory}")


def output_file_in(directory: str, name: str, flag: str = "--output_dir") -> str:
  """Before any work: `directory` made (it must not be a file) and `name` in it writable;
  returns the file's path."""
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise ValueError(f"{flag}={directory} is a file; give a directory")
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, name)
  check_output_file(path, flag)
  return path


def check_output_file(path: str | None, flag: str) -> None:
  """Before any work: the file can be written (its directory exists and is writable, it is
  not a directory), so that a long run never ends in a traceback that loses its results."""
  if path is None:
    return
  directory = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise ValueError(f"{flag}={path} is a directory; give a file name")
  if not os.path.isdir(directory):
    raise ValueError(f"{flag}={path}: the directory {directory} does not exist")
  if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
    raise ValueError(f"{flag}={path}: not writable")
