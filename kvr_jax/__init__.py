"""kvr-jax: KV-Runahead parallel prefill in JAX.

What a notebook needs (the rest stays importable from its submodule, see WORKSPACE.md):

  model = kvr_jax.load_model("tiny-llama")        # preset, Hugging Face or Orbax directory
  mesh = kvr_jax.make_mesh(4)                     # 1-D mesh; make_mesh(2, model=4) for 2-D
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, 1024)
  result = kvr_jax.prefill(model, tokens, strategy="kvr", mesh=mesh, partition="search")
  out = kvr_jax.generate(model, tokens, max_new_tokens=32, strategy="kvr", mesh=mesh)
  kvr_jax.compiled_memory("tiny-llama", "kvr", context_len=4096, num_ranks=4)
  kvr_jax.generate(hf_model, "a question", 64, on_token=kvr_jax.TextStream(hf_model)).text

Layers, each importing only from those above it in this list's reverse (see WORKSPACE.md):
models -> core -> runtime -> strategies -> planning -> inference -> tools.
"""

from kvr_jax.inference.generate import GenerationResult, generate
from kvr_jax.inference.prefill import prefill
from kvr_jax.inference.results import PrefillResult
from kvr_jax.inference.text import TextStream
from kvr_jax.planning.partition import PartitionPlan
from kvr_jax.runtime.loading import Model, load_model, save_model
from kvr_jax.runtime.mesh import make_mesh
from kvr_jax.tools.memory import compiled_memory
from kvr_jax.tools.timing import synthetic_prompt

__all__ = [
  "GenerationResult",
  "Model",
  "PartitionPlan",
  "PrefillResult",
  "TextStream",
  "compiled_memory",
  "generate",
  "load_model",
  "make_mesh",
  "prefill",
  "save_model",
  "synthetic_prompt",
]
