"""kvr-jax: KV-Runahead parallel prefill for Llama and Falcon in JAX.

model = kvr_jax.load_model("tiny-llama")
mesh = kvr_jax.make_mesh(4)
result = kvr_jax.prefill(model, tokens, strategy="kvr", mesh=mesh, partition=[400, 250, 200, 174])
out = kvr_jax.generate(model, tokens, max_new_tokens=32, strategy="kvr", mesh=mesh)
"""

from kvr_jax.inference import STRATEGIES, GenerationResult, PrefillResult, generate, prefill
from kvr_jax.loading import Model, load_model, preset_config, preset_names, save_model
from kvr_jax.mesh import AXIS, make_mesh
from kvr_jax.partition import PartitionPlan, even_partition, resolve_partition

__all__ = [
  "AXIS",
  "GenerationResult",
  "Model",
  "PartitionPlan",
  "PrefillResult",
  "STRATEGIES",
  "even_partition",
  "generate",
  "load_model",
  "make_mesh",
  "prefill",
  "preset_config",
  "preset_names",
  "resolve_partition",
  "save_model",
]
