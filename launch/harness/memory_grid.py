"""The memory tool's grid: `compiled_memory` over strategies and prompt lengths, and its
table (`launch.benchmark --mode=memory`)."""

from __future__ import annotations

import dataclasses

from kvr_jax.strategies import get_strategy
from kvr_jax.strategies.base import AUTO
from kvr_jax.tools.memory import MEMORY_PARTITION, compiled_memory
from launch.harness.report import Table
from models.config import ModelConfig


def memory_grid(
  config: ModelConfig,
  strategies,
  context_lens,
  *,
  num_devices: int,
  model_parallel: int = 1,
  cache: str = "last",
  dtype="float32",
  max_chunk: int | None = None,
  decode_tokens: int = 0,
) -> list[dict]:
  """`compiled_memory` of every strategy at every length on `num_devices` devices (ranks of
  `model_parallel` devices; single on one). A length past the model's positions is compiled
  with the positions extended, as long-context variants of the model do (said once per
  length on stdout)."""
  if num_devices < 1:
    raise ValueError(f"num_devices={num_devices}: give at least 1 device to compile for")
  if num_devices % model_parallel:
    raise ValueError(
      f"{num_devices} devices do not split into ranks of model_parallel={model_parallel}"
    )
  plan = dataclasses.replace(MEMORY_PARTITION, max_chunk=max_chunk)
  rows = []
  for C in context_lens:
    shaped = config
    if C > config.max_position_embeddings:
      print(
        f"NOTE: the model has {config.max_position_embeddings} positions; its shapes are "
        f"compiled at C={C} with the positions extended (as long-context variants do)"
      )
      shaped = dataclasses.replace(config, max_position_embeddings=C + decode_tokens)
    for strategy in strategies:
      one = strategy != AUTO and get_strategy(strategy).max_ranks == 1  # the one-device row
      row = compiled_memory(
        shaped,
        strategy,
        context_len=C,
        num_ranks=1 if one else num_devices // model_parallel,
        cache=cache,
        dtype=dtype,
        partition=plan if get_strategy(strategy).partitioned else None,
        model_parallel=1 if one else model_parallel,
        decode_tokens=decode_tokens,
      )
      rows.append(row)
  return rows


def memory_table(rows: list[dict], model: str, cache: str) -> Table:
  """The rows of `memory_grid`, GiB per device (the last columns: the cache and, for
  cache="last", what the move onto the last rank needs there)."""
  gib = 2**30
  dtype_name = rows[0]["dtype"] if rows else "float32"
  title = (
    f"XLA memory analysis (compiled from shapes, nothing allocated), {model}, "
    f"{dtype_name} shapes, per device, GiB; cache={cache}"
    + (
      "; bfloat16 would halve every column but the softmax statistics (not shown apart)"
      if dtype_name == "float32"
      else ""
    )
  )
  header = f"{'strategy':<10}{'C':>9}{'ranks':>7}  {'weights':>8}{'outputs':>9}{'temps':>8}"
  header += f"{'out+tmp':>9}{'cache':>8}  {'(out+tmp)/cache':>15}"
  decodes = any("decode_temp_bytes" in r for r in rows)
  header += (f"  {'move on last':>12}" if cache == "last" else "") + (
    f"  {'decode step':>11}" if decodes else ""
  )
  lines = []
  for r in rows:
    total = r["output_bytes"] + r["temp_bytes"]
    ranks = str(r["num_ranks"]) + (f"x{r['model_parallel']}" if r["model_parallel"] > 1 else "")
    line = (
      f"{r['strategy']:<10}{r['context_len']:>9}{ranks:>7}  "
      f"{r['weights_bytes'] / gib:>8.2f}{r['output_bytes'] / gib:>9.2f}"
      f"{r['temp_bytes'] / gib:>8.2f}{total / gib:>9.2f}{r['kv_cache_bytes'] / gib:>8.2f}  "
      f"{total / r['kv_cache_bytes']:>15.2f}"
    )
    if cache == "last":
      line += f"  {(r['move_argument_bytes'] + r['move_temp_bytes']) / gib:>12.2f}"
    if decodes:  # arguments (weights, cache or part, tail) + temporaries of one step
      step = r["decode_argument_bytes"] + r["decode_temp_bytes"] + r["decode_output_bytes"]
      line += f"  {step / gib:>11.2f}"
    lines.append(line)
  return Table((title,), header, tuple(lines), tuple(rows))
