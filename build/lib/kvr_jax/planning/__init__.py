"""Layer 4: choosing chunk lengths. A pure cost model over Hardware/Links objects (costmodel),
named presets and the on-disk `local` calibration (presets), the KVR-S engine (search), KVR-P
tables (tables) and partition plans (partition)."""
