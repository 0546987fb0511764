"""Layer 5: `prefill` (any registered strategy) and `generate` / `decode_from`."""
