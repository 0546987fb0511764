"""Package data: KVR-P tables, <model>__<hardware>__<links>__p<ranks>.json."""
