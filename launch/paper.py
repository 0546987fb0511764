"""Reproduces the paper's TTFT figures with the cost model. Every number is MODELLED.

  python -m launch.paper --output_dir=results/paper

Prints the table, a summary next to the paper's reported speed-ups, and writes CSV and PNG;
then (`--grids=tp`) the 2-D grid: Llama-3.1-70B on 8 and 16 H100s, tensor parallelism alone
against KV-Runahead, ring and all-gather CP over model groups of every size.
Intentionally kept short: the logic is launch.harness.paper.
"""

import os
import sys
import time

from absl import app, flags

from launch import common
from launch.harness import hybrid_grid, latent_grid, paper
from launch.harness import tp_grid as tp_lib

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", "results/paper", "Where to write paper_ttft.csv and plots.")
flags.DEFINE_list(
  "grids",
  ["paper", "tp"],
  "paper: the paper's figures; tp: the 70B tensor-parallel grid; gemma: Gemma 3 27B's "
  "windowed layers on 8 GPUs; gpt-oss: gpt-oss-120b's (windows and sinks) on 8 GPUs; "
  "qwen3.5: Qwen3.5-27B's linear layers on 8 GPUs; mla: DeepSeek-V3 and Moonlight's latent "
  "attention on 8 GPUs.",
)
flags.DEFINE_list(
  "tp_context_lens", [str(c) for c in tp_lib.TP_CONTEXT_LENS], "Prompt lengths of the tp grid."
)
flags.DEFINE_string(
  "tp_model",
  tp_lib.TP_MODEL,
  "Preset of the tp grid (a mixture of experts, e.g. qwen3-30b-a3b or mixtral-8x7b, splits its "
  "experts over each model group).",
)
flags.DEFINE_list(
  "tp_gpus",
  [str(n) for n in tp_lib.TP_GPUS],
  f"GPU counts of the tp grid ({tp_lib.TP_DEVICES_PER_NODE} per node; more than one node is "
  "linked between nodes at each of the grid's speeds).",
)
flags.DEFINE_float(
  "expert_imbalance",
  1.0,
  "tp grid, a mixture split by expert: the busiest GPU's routed rows over its group's mean "
  "(kvr_jax.tools.expert_load.routing_imbalance measures it on a prompt); 1: balanced.",
)


def main(argv):
  del argv
  start = time.perf_counter()
  with common.user_errors():
    common.check_output_dir(FLAGS.output_dir)
    unknown = sorted(set(FLAGS.grids) - {"paper", "tp", "gemma", "gpt-oss", "qwen3.5", "mla"})
    if unknown or not FLAGS.grids:
      raise ValueError(
        f"--grids takes paper, tp, gemma, gpt-oss, qwen3.5 and/or mla, got {FLAGS.grids}"
      )
    tp_lens = common.positive_ints(FLAGS.tp_context_lens, "--tp_context_lens")
    tp_gpus = tuple(common.positive_ints(FLAGS.tp_gpus, "--tp_gpus"))
    tp_lib.check_tp_context_lens(tp_lens, gpus=tp_gpus, model=FLAGS.tp_model)
    if not FLAGS.expert_imbalance >= 1:
      raise ValueError(f"--expert_imbalance must be >= 1, got {FLAGS.expert_imbalance}")
  ok = True
  if "paper" in FLAGS.grids:
    ok = paper_grid()
  if "tp" in FLAGS.grids:
    tp_grid(tp_lens, tp_gpus)
  for windowed in ("gemma", "gpt-oss"):
    if windowed in FLAGS.grids:
      print()
      paper.print_windowed_grid(windowed)
  if "qwen3.5" in FLAGS.grids:
    print()
    hybrid_grid.print_hybrid_grid()
  if "mla" in FLAGS.grids:
    print()
    latent_grid.print_latent_grid()
  print(f"done in {time.perf_counter() - start:.1f}s")
  return 0 if ok else 1


def paper_grid() -> bool:
  print("MODELLED TTFT (kvr_jax.planning.costmodel: A100 80GB, fp16, batch 1); not a measurement.")
  print(
    f"{'links':<8}{'model':<12}{'p':>2}{'C':>7} {'TSP':>10}{'KVR-E':>10}{'KVR-S':>10}"
    f"{'KVR-P':>10}{'bal.':>10}{'bound':>10}  S/TSP  P-S"
  )

  def show(c):
    mark = "*" if c.predicted_by_interpolation else " "
    print(
      f"{c.links:<8}{c.model:<12}{c.num_ranks:>2}{c.context_len:>7} "
      f"{c.tsp_s * 1e3:>8.1f}ms{c.kvr_even_s * 1e3:>8.1f}ms{c.kvr_search_s * 1e3:>8.1f}ms"
      f"{c.kvr_predict_s * 1e3:>8.1f}ms{c.kvr_balanced_s * 1e3:>8.1f}ms"
      f"{c.lower_bound_s * 1e3:>8.1f}ms  {c.speedup:>4.2f}x {c.predict_gap * 100:+.2f}%{mark}"
    )

  cells = paper.all_cells(progress=show)
  print("(* = KVR-P interpolated between table entries; bal. = balanced split)")
  print()
  ok_faster = paper.print_summary(cells)
  print()
  paper.print_against_peers(cells)
  print()
  paper.print_slow_links()
  csv_path = os.path.join(FLAGS.output_dir, "paper_ttft.csv")
  paper.write_csv(cells, csv_path)
  print(f"wrote {', '.join([csv_path, *paper.plot(cells, FLAGS.output_dir)])}")
  return ok_faster


def tp_grid(context_lens, gpus) -> None:
  print()
  print(
    f"KV-Runahead x tensor parallelism, MODELLED: {FLAGS.tp_model}, bf16, {tp_lib.TP_HARDWARE} "
    f"({tp_lib.TP_DEVICES_PER_NODE} per node, {tp_lib.TP_INSIDE / 1e9:.0f} GB/s per GPU inside a "
    "node), flash kernels, batch 1. p x m: p ranks (model groups) of m GPUs; TP-only is 1 x "
    "all. GB/GPU: weights and the whole prompt's cache on one GPU of the last rank; '!' does "
    f"not fit ({tp_lib.TP_FITS_SHARE:.0%} of 80 GB)."
  )
  print(
    f"{'GPUs':>4} {'between':>8}{'C':>7} {'p x m':>6}{'TP-only':>10}{'KVR-S':>10}{'ring':>10}"
    f"{'allgath.':>10}{'GB/GPU':>8}"
  )

  def show(c):
    between = f"{c.between / 1e9:.0f}GB/s" if c.gpus > tp_lib.TP_DEVICES_PER_NODE else "1 node"
    times = [c.ttft_s.get(s) for s in ("tp", "kvr") + tp_lib.PEERS]
    cols = "".join(f"{'-':>10}" if t is None else f"{t * 1e3:>8.0f}ms" for t in times)
    print(
      f"{c.gpus:>4} {between:>8}{c.context_len:>7} {c.num_ranks:>2}x{c.model_parallel:<3}{cols}"
      f"{c.device_memory_bytes / 1e9:>7.1f}{'' if c.fits else '!'}"
    )

  if FLAGS.expert_imbalance != 1:
    print(f"Experts split whole: the busiest GPU runs {FLAGS.expert_imbalance}x its share.")
  cells = tp_lib.tp_grid(
    gpus=gpus,
    context_lens=context_lens,
    progress=show,
    model=FLAGS.tp_model,
    expert_imbalance=FLAGS.expert_imbalance,
  )
  _print_best_factorizations(cells)
  csv_path = os.path.join(FLAGS.output_dir, "tp_grid.csv")
  tp_lib.write_tp_csv(cells, csv_path)
  print(f"wrote {csv_path}")


def _print_best_factorizations(cells) -> None:
  """Each strategy's fastest factorization that fits, per (GPUs, link, C), and the claim."""
  print()
  print("Best factorization of each strategy that fits (MODELLED):")
  groups = {}
  for c in cells:
    groups.setdefault((c.gpus, c.between, c.context_len), []).append(c)
  for (n, between, C), group in groups.items():
    best = tp_lib.best_by_strategy(group)

    def describe(strategy, best=best):
      if strategy not in best:
        return "no factorization fits"
      c = best[strategy]
      return f"{c.ttft_s[strategy] * 1e3:.0f}ms ({c.num_ranks}x{c.model_parallel})"

    where = f"{between / 1e9:.0f}GB/s" if n > tp_lib.TP_DEVICES_PER_NODE else "1 node"
    line = (
      f"  {n} GPUs {where} C={C}: TP-only {describe('tp')}, KVR-S {describe('kvr')}, ring "
      f"{describe('ring')}, all-gather CP {describe('allgather')}"
    )
    if "kvr" in best:
      kvr = best["kvr"].ttft_s["kvr"]
      if "tp" in best:
        line += f": KVR-S {best['tp'].ttft_s['tp'] / kvr:.2f}x TP-only"
      peer = min(best[s].ttft_s[s] for s in tp_lib.PEERS if s in best)
      line += f", {peer / kvr:.3f}x the faster peer"
    print(line)
  target = groups.get((16, 50e9, 32768)) if FLAGS.tp_model == tp_lib.TP_MODEL else None
  if target:
    best = tp_lib.best_by_strategy(target)
    kvr = best["kvr"].ttft_s["kvr"]
    met = best["tp"].ttft_s["tp"] / kvr >= 1.3 and all(
      best[s].ttft_s[s] > kvr for s in tp_lib.PEERS
    )
    print(
      "Claim (16 GPUs, 50 GB/s between nodes, 32k: best TP x KVR >= 1.3x TP-only and faster "
      f"than TP x ring and TP x all-gather): {'holds' if met else 'does not hold'} (modelled)"
    )


if __name__ == "__main__":
  sys.exit(app.run(main))
