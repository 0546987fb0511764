"""Layer 6: what runs on top of prefill and a notebook calls: timing and synthetic prompts
(timing), the measured search and the per-rank phases it fits (measured, phases), per-device
memory from XLA's analysis (memory), probed timelines (timeline), the main job's comparison
(demo) and the experts' load per device (expert_load). The benchmark and report harness is
launch/harness/, beside its launchers."""
