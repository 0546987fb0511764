"""kvr-jax: KV-Runahead parallel prefill for Llama and Falcon in JAX.

model = kvr_jax.load_model("tiny-llama")
mesh = kvr_jax.make_mesh(4)
result = kvr_jax.prefill(model, tokens, strategy="kvr", mesh=mesh, partition=[400, 250, 200, 174])
out = kvr_jax.generate(model, tokens, max_new_tokens=32, strategy="kvr", mesh=mesh)
out = kvr_jax.generate(model, [row_a, row_b], 32, strategy="kvr", mesh=mesh, buckets="auto")

Layers, each importing only from those above it in this list's reverse (see WORKSPACE.md):
core (chunks) -> runtime (mesh, loading) -> strategies -> planning -> inference -> tools.
"""

from kvr_jax.core.chunks import even_partition
from kvr_jax.inference.buckets import bucket_length
from kvr_jax.inference.generate import GenerationResult, decode_from, generate
from kvr_jax.inference.prefill import PrefillResult, prefill, prefill_arguments
from kvr_jax.planning.partition import PartitionPlan, resolve_partition
from kvr_jax.runtime.loading import Model, load_model, preset_config, preset_names, save_model
from kvr_jax.runtime.mesh import AXIS, make_mesh
from kvr_jax.strategies import REGISTRY, STRATEGIES, Strategy, get_strategy
from kvr_jax.tools.measured import measured_partition
from kvr_jax.tools.memory import compiled_memory
from kvr_jax.tools.timing import synthetic_prompt

__all__ = [
  "AXIS",
  "bucket_length",
  "compiled_memory",
  "REGISTRY",
  "GenerationResult",
  "Model",
  "PartitionPlan",
  "PrefillResult",
  "STRATEGIES",
  "Strategy",
  "decode_from",
  "even_partition",
  "generate",
  "get_strategy",
  "load_model",
  "make_mesh",
  "measured_partition",
  "prefill",
  "prefill_arguments",
  "preset_config",
  "preset_names",
  "resolve_partition",
  "save_model",
  "synthetic_prompt",
]
