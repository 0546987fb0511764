"""Hybrid models on 8 GPUs, MODELLED: Qwen3.5-27B's prefill with KV-Runahead (its split
searched), the peers (ring, all-gather CP: an all-gather of the linear layers' entry maps)
and the linear layers replicated on every rank (tpu-inference's way), at long prompts and two
link speeds (`python -m launch.paper --grids=qwen3.5`). Every figure is the cost model's."""

from __future__ import annotations

import dataclasses

from kvr_jax.planning import costmodel, presets, search
from kvr_jax.runtime.loading import preset_config
from kvr_jax.runtime.roofline import head_work
from kvr_jax.strategies import get_strategy
from kvr_jax.strategies.linear_modelled import replicated_linear_layer, state_bytes
from models.layer_kinds import FULL_ATTENTION

HYBRID_MODEL = "qwen3.5-27b"
HYBRID_RANKS = 8
HYBRID_CONTEXT_LENS = (131072, 524288, 1048576)
HYBRID_LINKS = ("300GBps", "10GBps")
PEERS = ("ring", "allgather")


@dataclasses.dataclass(frozen=True)
class HybridCell:
  """One MODELLED cell: TTFT per approach ("kvr", "ring", "allgather", "replicated") and
  the bytes each rank sends per layer kind (KVR: its largest hop; the peers: each rank's
  all-gather; replicated: the hidden states' all-gather before a linear run)."""

  links: str
  context_len: int
  ttft_s: dict
  sent_linear: dict
  sent_full: dict
  chunks: tuple[int, ...]


def replicated_ttft(config, context_len: int, setup, num_ranks: int, peer: str) -> float:
  """The linear layers on every rank over the whole prompt, the full layers by `peer` (its
  zigzag split); each run of linear layers after a full one starts with an all-gather of
  the hidden states. Timed by the same `layer_timeline` as every strategy."""
  full = costmodel.modelled_layer(
    config.of_kind(FULL_ATTENTION), peer, context_len, setup, num_ranks=num_ranks
  )
  layers, previous_full = [], True  # the embedding leaves each rank its own rows
  for kind in config.layer_kinds:
    if kind == FULL_ATTENTION:
      layers.append(full)
      previous_full = True
    else:
      gathered = replicated_linear_layer(config, context_len, setup, num_ranks, previous_full)
      layers.append(gathered)
      previous_full = False
  finish = costmodel.layer_timeline(layers, config.num_layers, setup.links.held_send)
  head = head_work(config, setup.batch, setup.dtype_bytes).time(setup.hardware)
  return finish[-1] + full.after_layers + head


def hybrid_cell(context_len: int, links: str, num_ranks: int = HYBRID_RANKS) -> HybridCell:
  config = preset_config(HYBRID_MODEL)
  setup = presets.make_setup("h100-sxm", links, dtype_bytes=2, **costmodel.kernel_flags("flash"))
  chunks = search.modelled_search(config, context_len, num_ranks, setup)
  ttft, linear, full = {}, {}, {}
  for strategy in ("kvr", *PEERS):
    kw = dict(num_ranks=num_ranks, partition=chunks if get_strategy(strategy).partitioned else None)
    ttft[strategy] = costmodel.simulate(config, strategy, context_len, setup, **kw).ttft
    for kind, out in ((config.linear_kind, linear), (FULL_ATTENTION, full)):
      layer = costmodel.modelled_layer(config.of_kind(kind), strategy, context_len, setup, **kw)
      out[strategy] = max(layer.link_bytes)
  best_peer = min(PEERS, key=lambda s: ttft[s])
  ttft["replicated"] = replicated_ttft(config, context_len, setup, num_ranks, best_peer)
  rows = setup.batch * (context_len / num_ranks) * config.d_model * setup.dtype_bytes
  linear["replicated"], full["replicated"] = (num_ranks - 1) * rows, full[best_peer]
  assert linear["kvr"] == state_bytes(config, setup.batch)
  return HybridCell(links, context_len, ttft, linear, full, chunks)


def print_hybrid_grid(context_lens=HYBRID_CONTEXT_LENS, links=HYBRID_LINKS) -> list[HybridCell]:
  print(
    f"Qwen3.5-27B on {HYBRID_RANKS} H100s (48 Gated DeltaNet layers, 16 full), bf16, flash "
    "kernels, MODELLED: TTFT, and MB each rank sends per layer (KVR: its largest hop; the "
    "peers: the all-gather of maps or K,V; replicated: the hidden states' all-gather) on a "
    "linear / a full layer"
  )
  names = ("kvr", "ring", "allgather", "replicated")
  print(
    f"{'links':<8}{'C':>8} {'KVR-S':>9}{'ring':>9}{'allgath.':>9}{'replic.':>9}"
    f"  vs peer  vs repl.   " + "".join(f"{n[:8] + ' MB':>16}" for n in names)
  )
  cells = []
  for name in links:
    for C in context_lens:
      c = hybrid_cell(C, name)
      cells.append(c)
      t = c.ttft_s
      peer = min(t[s] for s in PEERS)
      sent = "".join(f"{c.sent_linear[s] / 1e6:>8.1f}/{c.sent_full[s] / 1e6:<7.0f}" for s in names)
      print(
        f"{name:<8}{C:>8} "
        + "".join(f"{t[s]:>8.2f}s" for s in names)
        + f"  {peer / t['kvr']:>6.2f}x {t['replicated'] / t['kvr']:>6.2f}x   {sent}"
      )
  return cells
