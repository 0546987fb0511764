"""Building the KVR-P tables: KVR-S searched partitions over a grid of context lengths."""

from __future__ import annotations

import json
import os

from kvr_jax import search
from kvr_jax.loading import preset_config

# Table entries sit between the lengths the paper reports (1k, 2k, 4k, 8k, 12k, 16k), so that
# those are predicted by interpolation, except the two ends of the range.
TABLE_CONTEXT_LENS = tuple(int(1024 * f) for f in (1, 1.5, 2.5, 3.5, 5, 7, 9, 11, 13, 15, 16))
TABLE_MODELS = ("llama-2-7b", "falcon-7b")
TABLE_HARDWARE = ("a100-80gb",)
TABLE_LINKS = ("300GBps", "10GBps")
TABLE_RANKS = (2, 4, 8)


def build_table(
  model: str,
  hardware: str,
  links: str,
  num_ranks: int,
  context_lens=TABLE_CONTEXT_LENS,
  dtype_bytes: int = 2,
) -> dict:
  """KVR-S (modelled objective) at each context length; fp16 as in the paper, batch 1."""
  config = preset_config(model)
  entries = []
  for C in context_lens:
    sim = dict(hardware=hardware, links=links, dtype_bytes=dtype_bytes)
    chunks = search.modelled_search(config, C, num_ranks, **sim)
    ttft = search.modelled_objective(config, C, num_ranks, **sim)(chunks)
    entries.append({"context_len": C, "partition": list(chunks), "modelled_ttft_s": ttft})
  return {
    "model": model,
    "hardware": hardware,
    "links": links,
    "num_ranks": num_ranks,
    "objective": "modelled TTFT (kvr_jax.costmodel), fp16, batch 1",
    "regenerate": "python -m launch.partition_tables",
    "entries": entries,
  }


def write_all_tables(directory: str = search.PARTITION_DIR, log=print) -> list[str]:
  os.makedirs(directory, exist_ok=True)
  written = []
  for model in TABLE_MODELS:
    for hardware in TABLE_HARDWARE:
      for links in TABLE_LINKS:
        for p in TABLE_RANKS:
          table = build_table(model, hardware, links, p)
          path = os.path.join(
            directory, os.path.basename(search.table_path(model, hardware, links, p))
          )
          with open(path, "w") as f:
            json.dump(table, f, indent=1)
          written.append(path)
          log(f"wrote {path}")
  return written
