"""KVR-P tables: searched partitions over a grid of context lengths, loaded, predicted, built.

predict   linear interpolation of searched boundaries, as fractions of C, between the entries
          of a table: shipped under configs/partitions/ (found with importlib.resources), or
          built on this machine into the cache (local_partition_dir) by `python -m
          launch.partition_tables --model=... --hardware=... --links=... --num_ranks=...`.
build     KVR-S (modelled objective) at each context length of the grid.
"""

from __future__ import annotations

import json
import os

from kvr_jax.core import resources
from kvr_jax.core.chunks import check_multiple, prefix_ends, round_to_multiple
from kvr_jax.planning import presets, search
from kvr_jax.runtime.loading import preset_config

PARTITION_DIR = str(resources.partition_dir())


def local_partition_dir() -> str | None:
  """KVR-P tables built on this machine (any preset, any hardware/links preset); None when
  the cache directory cannot be used."""
  directory = resources.cache_dir()
  return None if directory is None else str(directory / "partitions")


def table_path(
  model: str, hardware: str, links: str, num_ranks: int, directory: str = PARTITION_DIR
) -> str:
  return os.path.join(directory, f"{model}__{hardware}__{links}__p{num_ranks}.json")


def build_command(model: str, hardware: str, links: str, num_ranks: int) -> str:
  """The command line that builds this table into the local cache."""
  return (
    f"python -m launch.partition_tables --model={model} --hardware={hardware} "
    f"--links={links} --num_ranks={num_ranks}"
  )


def load_table(
  model: str, hardware: str, links: str, num_ranks: int, directory: str | None = None
) -> dict:
  """The KVR-P table for (model, hardware, links, p); checks it is the table it claims.

  directory None: those built on this machine (`launch.partition_tables`), then the shipped
  tables; a table rebuilt here answers for this machine."""
  if directory is None:
    directories = [d for d in (local_partition_dir(), PARTITION_DIR) if d is not None]
  else:
    directories = [directory]
  paths = [table_path(model, hardware, links, num_ranks, d) for d in directories]
  path = next((p for p in paths if os.path.exists(p)), None)
  if path is None:
    have = sorted(
      f[:-5] for d in directories if os.path.isdir(d) for f in os.listdir(d) if f.endswith(".json")
    )
    raise ValueError(
      f"no partition table for model={model!r}, hardware={hardware!r}, "
      f"links={links!r}, p={num_ranks}; tables: {have}. Build it on this machine with "
      f"`{build_command(model, hardware, links, num_ranks)}` (written to "
      f"{local_partition_dir() or 'the kvr-jax cache directory'}, where 'predict' finds it)"
    )
  try:
    with open(path) as f:
      table = json.load(f)
    entries_ok = all(len(e["partition"]) == num_ranks for e in table["entries"])
    # Every entry a partition of its own length into positive integer chunks: a table that
    # is valid JSON but not that would otherwise give nonsense fractions, silently.
    bad = [
      e
      for e in table["entries"]
      if not isinstance(e["context_len"], int)
      or not all(isinstance(c, int) and c >= 1 for c in e["partition"])
      or sum(e["partition"]) != e["context_len"]
    ]
  except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"{path}: corrupt partition table ({e!r})") from None
  if not entries_ok or not table["entries"]:
    raise ValueError(f"{path}: corrupt partition table (entries must have {num_ranks} chunks)")
  if bad:
    raise ValueError(
      f"{path}: corrupt partition table (entry {bad[0]!r}: its chunks must be positive "
      "integers summing to its context_len)"
    )
  expected = {"model": model, "hardware": hardware, "links": links, "num_ranks": num_ranks}
  for key, value in expected.items():
    if table.get(key) != value:
      raise ValueError(f"{path}: table is for {key}={table.get(key)!r}, not {value!r}")
  return table


def predict_partition(table: dict, context_len: int, multiple: int = 1) -> tuple[int, ...]:
  """KVR-P: boundaries as fractions of C, linearly interpolated between the two table
  entries around C. Outside the table's range the nearest entry's fractions are used
  (clamped, not extrapolated). Exact at table points."""
  p = table["num_ranks"]
  check_multiple(context_len, p, multiple)
  entries = sorted(table["entries"], key=lambda e: e["context_len"])
  for e in entries:
    if e["context_len"] == context_len:
      return round_to_multiple(e["partition"], context_len, multiple)

  def fractions(e):
    return [b / e["context_len"] for b in prefix_ends(e["partition"])[:-1]]

  if context_len <= entries[0]["context_len"]:
    frac = fractions(entries[0])
  elif context_len >= entries[-1]["context_len"]:
    frac = fractions(entries[-1])
  else:
    hi = next(i for i, e in enumerate(entries) if e["context_len"] > context_len)
    a, b = entries[hi - 1], entries[hi]
    w = (context_len - a["context_len"]) / (b["context_len"] - a["context_len"])
    frac = [(1 - w) * x + w * y for x, y in zip(fractions(a), fractions(b), strict=True)]
  bounds = [f * context_len for f in frac]
  edges = [0.0, *bounds, float(context_len)]
  return round_to_multiple([edges[i + 1] - edges[i] for i in range(p)], context_len, multiple)


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
  """KVR-S (modelled objective) at each context length; fp16 by default as in the paper,
  batch 1."""
  config = preset_config(model)
  entries = []
  for C in context_lens:
    setup = presets.make_setup(hardware, links, dtype_bytes=dtype_bytes)
    chunks = search.modelled_search(config, C, num_ranks, setup)
    ttft = search.modelled_objective(config, C, num_ranks, setup)(chunks)
    entries.append({"context_len": C, "partition": list(chunks), "modelled_ttft_s": ttft})
  return {
    "model": model,
    "hardware": hardware,
    "links": links,
    "num_ranks": num_ranks,
    "objective": f"modelled TTFT (kvr_jax.planning.costmodel), {dtype_bytes}-byte values, batch 1",
    "regenerate": (
      "python -m launch.partition_tables --shipped"
      if (model, hardware, links) in _shipped_keys()
      else build_command(model, hardware, links, num_ranks)
    ),
    "entries": entries,
  }


def _shipped_keys():
  return {(m, h, ln) for m in TABLE_MODELS for h in TABLE_HARDWARE for ln in TABLE_LINKS}


def write_table(table: dict, directory: str) -> str:
  os.makedirs(directory, exist_ok=True)
  key = (table["model"], table["hardware"], table["links"], table["num_ranks"])
  path = table_path(*key, directory)
  resources.write_json_atomically(path, table)
  return path


def write_all_tables(directory: str = PARTITION_DIR, log=print) -> list[str]:
  """The shipped tables (the paper's models and links), regenerated."""
  written = []
  for model in TABLE_MODELS:
    for hardware in TABLE_HARDWARE:
      for links in TABLE_LINKS:
        for p in TABLE_RANKS:
          written.append(write_table(build_table(model, hardware, links, p), directory))
          log(f"wrote {written[-1]}")
  return written
