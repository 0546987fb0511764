"""Every attention kernel timed on its own, on the same queries and keys. MEASURED."""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from launch.harness.report import Table
from models.attention import attend_static
from models.kernels import get_kernel


@dataclasses.dataclass
class KernelTiming:
  kernel: str
  context_len: int
  query_block: int | None
  key_block: int | None
  seconds: float  # median of warm runs
  compile_s: float
  prefix_len: int = 0  # keys before the queries' own causal block, every one seen

  @property
  def pairs(self) -> int:
    """The query-key pairs a query sees, summed: the prefix whole, its own block causally."""
    C = self.context_len
    return C * self.prefix_len + C * (C + 1) // 2


def time_attention_kernels(
  context_lens,
  kernels=("dense", "blocked", "flash"),
  flash_blocks=((256, 512),),
  *,
  num_heads: int = 4,
  num_kv_heads: int = 4,
  head_dim: int = 64,
  repeats: int = 5,
  progress: bool = True,
  prefix_len: int = 0,
) -> list[KernelTiming]:
  """Causal self-attention alone on one device (batch 1, float32), per kernel and, for
  flash, per (query_block, key_block): what the block sizes are chosen from. prefix_len:
  the C queries sit after that many keys, as a KV-Runahead rank's chunk attends the prefix
  it received (unmasked) and then its own causal block."""
  if prefix_len < 0:
    raise ValueError(f"the prefix length must be >= 0, got {prefix_len}")
  rows = []
  cases = [
    (C, kernel, blocks)
    for C in context_lens
    for kernel in kernels
    # the kernels with query and key blocks are timed at every block pair asked for
    for blocks in (flash_blocks if get_kernel(kernel).key_block else [(None, None)])
  ]
  for C, kernel, (bq, bk) in tqdm(cases, desc="kernels", disable=not progress):
    rng = np.random.RandomState(0)
    q = jax.device_put(rng.randn(1, C, num_heads, head_dim).astype(np.float32))
    S = prefix_len + C
    k, v = (
      jax.device_put(rng.randn(1, S, num_kv_heads, head_dim).astype(np.float32)) for _ in range(2)
    )
    record = get_kernel(kernel)
    if bq is not None:
      record = dataclasses.replace(record, query_block=bq, key_block=bk)
    fn = jax.jit(lambda q, k, v, record=record: attend_static(q, k, v, prefix_len, record))
    start = time.perf_counter()
    jax.block_until_ready(fn(q, k, v))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(q, k, v))
      times.append(time.perf_counter() - start)
    median = statistics.median(times)
    rows.append(KernelTiming(kernel, C, bq, bk, median, max(first - median, 0.0), prefix_len))
  return rows


# Per-phase times of a KV-Runahead partition: kvr_jax.tools.phases.rank_phase_times.


# --- one accelerator: every kernel against transformers, MFU, modelled multi-device TTFT -------


def kernel_table(
  rows: list[KernelTiming], threads: int, num_heads: int = 4, head_dim: int = 64
) -> Table:
  """The kernels' times as launch.benchmark --mode=kernels prints them, with the query-key
  pairs each second covers (comparable across shapes: a prefix block against a causal one)."""
  lines = []
  for r in rows:
    blocks = "-" if r.query_block is None else f"{r.query_block}x{r.key_block}"
    lines.append(
      f"{r.kernel:<8}{blocks:>10}{r.context_len:>7}{r.prefix_len:>8}  "
      f"{r.seconds * 1e3:>7.1f}ms  {r.pairs / r.seconds / 1e6:>9.1f}  {r.compile_s:>7.2f}s"
    )
  return Table(
    title=(
      f"MEASURED causal attention alone, 1 device, {threads} thread(s), "
      f"{num_heads} heads x {head_dim}, float32, median of warm runs (C queries after a "
      "prefix of P keys; pairs/us: query-key pairs seen, in millions per second):",
    ),
    header=f"{'kernel':<8}{'blocks':>10}{'C':>7}{'P':>8}  {'time':>9}  {'pairs/us':>9}  "
    f"{'compile':>8}",
    lines=tuple(lines),
    records=tuple(dict(dataclasses.asdict(r), pairs=r.pairs) for r in rows),
  )
