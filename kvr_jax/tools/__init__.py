"""Layer 6: what runs on top of prefill: timing and synthetic prompts (timing), the measured
search (measured), the main job's comparison (demo), benchmarks, the paper's modelled figures,
and the multi-process jobs."""
