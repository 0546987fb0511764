"""Package data: model presets (<name>.json) and partitions/ (the shipped KVR-P tables).

Read through kvr_jax.core.resources (importlib.resources), so an installed wheel finds them.
"""
