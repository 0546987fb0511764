"""Layer 2: devices and weights. The 1-D mesh and array placement (mesh), Hugging Face
checkpoints (checkpoints), loading and saving models (loading), jax.distributed (distributed)."""
