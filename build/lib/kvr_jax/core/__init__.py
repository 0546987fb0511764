"""Layer 1: chunk arithmetic, validation and shipped resources. No JAX, no devices."""
