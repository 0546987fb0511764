"""KV-Runahead x tensor parallelism: a 70B model (or any preset: a mixture of experts splits its
experts over each model group) on H100 nodes, MODELLED with kvr_jax.planning.costmodel. Every
factorization of the GPUs into ranks x model groups, each strategy's TTFT and whether its
memory fits; `launch.paper --grids=tp [--tp_model=...]` prints and writes it. Nothing here is
measured."""

from __future__ import annotations

import csv
import dataclasses

from kvr_jax.planning import costmodel, presets, search
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.loading import preset_config
from kvr_jax.runtime.roofline import shard_expert_imbalance

MODELS = ("llama-2-7b", "falcon-7b")
RANKS = (2, 4, 8)
CONTEXT_LENS = (1024, 2048, 4096, 8192, 12288, 16384)
LINK_PRESETS = ("300GBps", "10GBps")
HARDWARE = "a100-80gb"
# What the paper reports (from its abstract and secondary summaries; DESIGN.md section 3).
PAPER = {
  "llama-2-7b": "1.4x headline; best cell 1.42x (4 GPUs, 12k, 300 GB/s)",
  "falcon-7b": "1.6x headline; best cell 1.63x (8 GPUs, 8k)",
  "10GBps": "larger gains at 10 GB/s, up to 1.79x",
  "slow link": "TSP loses up to 11.8%, KVR 2.7%",
}

TP_MODEL = "llama-3.1-70b"
TP_HARDWARE = "h100-sxm"
TP_GPUS = (8, 16)
TP_CONTEXT_LENS = (4096, 8192, 16384, 32768, 65536, 131072)
TP_DEVICES_PER_NODE = 8  # 8 GPUs: one node; 16: two
TP_INSIDE = 400e9  # bytes/s per GPU inside a node (NVLink-class)
TP_BETWEEN = (25e9, 50e9)  # bytes/s per GPU between nodes (each GPU's own NIC)
# Chunks on a multiple of a GPU flash kernel's block (and a faster search at 128k tokens).
TP_MULTIPLE = 128
# A factorization fits when one GPU's weights and cache take at most this share of its memory
# (the rest for the prefill's activations and the runtime; device_memory leaves them out).
TP_FITS_SHARE = 0.9
PEERS = ("ring", "allgather")


@dataclasses.dataclass
class TPCell:
  """One factorization of `gpus` GPUs into num_ranks x model_parallel for one prompt length
  and one link between nodes. num_ranks = 1 is tensor parallelism alone ("tp": the whole
  prompt on one model group of all the GPUs); otherwise KV-Runahead (its modelled search),
  zigzag ring and all-gather CP over the ranks, each rank a model group. Flash kernels."""

  gpus: int
  between: float
  context_len: int
  num_ranks: int
  model_parallel: int
  ttft_s: dict[str, float]
  kvr_partition: tuple[int, ...] | None
  device_memory_bytes: float
  fits: bool


def check_tp_context_lens(context_lens, gpus=TP_GPUS, model: str = TP_MODEL) -> None:
  """Every length must hold a chunk of TP_MULTIPLE tokens per rank and fit the model."""
  shortest = (max(gpus) - 1) * TP_MULTIPLE + 1
  longest = preset_config(model).max_position_embeddings
  for C in context_lens:
    if not shortest <= C <= longest:
      raise ValueError(
        f"tp grid lengths must lie in [{shortest}, {longest}] ({max(gpus)} ranks of "
        f"{TP_MULTIPLE}-token multiples, {model}'s positions), got {C}"
      )


def tp_setup(
  gpus: int, num_ranks: int, between: float, expert_imbalance: float = 1.0
) -> costmodel.Setup:
  """bf16 on H100s with flash kernels, `gpus` // num_ranks GPUs per model group;
  expert_imbalance: a mixture split by expert (Setup.expert_imbalance)."""
  model_parallel = gpus // num_ranks
  ranks, model = presets.cluster_links(
    num_ranks,
    model_parallel,
    devices_per_node=TP_DEVICES_PER_NODE,
    inside=TP_INSIDE,
    between=between,
  )
  return costmodel.Setup(
    presets.hardware_preset(TP_HARDWARE),
    ranks,
    dtype_bytes=2,
    **costmodel.kernel_flags("flash"),
    model_parallel=model_parallel,
    model_links=model,
    expert_imbalance=expert_imbalance,
  )


def tp_cell(
  gpus: int,
  num_ranks: int,
  context_len: int,
  between: float,
  model: str = TP_MODEL,
  expert_imbalance: float = 1.0,
) -> TPCell:
  config = preset_config(model)
  m = gpus // num_ranks
  imbalance = shard_expert_imbalance(config, m, expert_imbalance)
  setup = tp_setup(gpus, num_ranks, between, imbalance)
  partition = None
  if num_ranks == 1:
    ttft = {"tp": costmodel.simulate(config, "single", context_len, setup).ttft}
  else:
    partition = search.modelled_search(config, context_len, num_ranks, setup, multiple=TP_MULTIPLE)
    ttft = {
      "kvr": costmodel.simulate(
        config, "kvr", context_len, setup, num_ranks=num_ranks, partition=partition
      ).ttft
    }
    for peer in PEERS:
      ttft[peer] = costmodel.simulate(config, peer, context_len, setup, num_ranks=num_ranks).ttft
  memory = costmodel.device_memory(config, context_len, setup)
  fits = memory <= TP_FITS_SHARE * setup.hardware.memory_bytes
  return TPCell(
    gpus, between, context_len, num_ranks, setup.model_parallel, ttft, partition, memory, fits
  )


def tp_grid(
  gpus=TP_GPUS,
  context_lens=TP_CONTEXT_LENS,
  betweens=TP_BETWEEN,
  progress=None,
  model: str = TP_MODEL,
  expert_imbalance: float = 1.0,
) -> list[TPCell]:
  """Every factorization num_ranks x model_parallel of each GPU count (every model_parallel
  the model splits over: tensor_parallel.check_model_parallel), at every length and link
  between nodes. expert_imbalance: see costmodel.Setup (where the experts split whole)."""
  config = preset_config(model)
  cells = []
  for n in gpus:
    for between in betweens if n > TP_DEVICES_PER_NODE else betweens[:1]:
      for C in context_lens:
        for p in (p for p in range(1, n + 1) if n % p == 0 and _splits(config, n // p)):
          cells.append(tp_cell(n, p, C, between, model, expert_imbalance))
          if progress:
            progress(cells[-1])
  return cells


def _splits(config, model_parallel: int) -> bool:
  """Whether the model runs on model groups of `model_parallel` devices."""
  try:
    tensor_parallel.check_model_parallel(config, model_parallel)
  except ValueError:
    return False
  return True


def best_by_strategy(cells: list[TPCell]) -> dict[str, TPCell]:
  """Among the cells that fit (one GPU count, link and length), the fastest factorization of
  each strategy ("tp", "kvr", "ring", "allgather")."""
  best: dict[str, TPCell] = {}
  for cell in cells:
    if not cell.fits:
      continue
    for strategy, seconds in cell.ttft_s.items():
      if strategy not in best or seconds < best[strategy].ttft_s[strategy]:
        best[strategy] = cell
  return best


def write_tp_csv(cells: list[TPCell], path: str) -> None:
  """One row per cell and strategy."""
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["# MODELLED with kvr_jax.planning.costmodel, not measured"])
    writer.writerow(
      ["gpus", "between_Bps", "context_len", "num_ranks", "model_parallel", "strategy"]
      + ["ttft_s", "kvr_partition", "device_memory_bytes", "fits"]
    )
    for c in cells:
      for strategy, seconds in c.ttft_s.items():
        chunks = " ".join(map(str, c.kvr_partition)) if strategy == "kvr" else ""
        writer.writerow(
          [c.gpus, c.between, c.context_len, c.num_ranks, c.model_parallel, strategy]
          + [seconds, chunks, c.device_memory_bytes, c.fits]
        )


# --- what launch.paper prints ---------------------------------------------------------------
