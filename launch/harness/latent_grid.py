"""Latent-attention models on 8 GPUs, MODELLED: DeepSeek-V3 (671B) and Moonlight-16B-A3B
prefill with KV-Runahead (its split searched, and even) and all-gather CP, at 32k and 128k
tokens and two link speeds (`python -m launch.paper --grids=mla`). Both move latents (one
C-wide entry per token) and expand them into every head on the receiver
(kvr_jax/strategies/latent_modelled.py). Every figure is the cost model's."""

from __future__ import annotations

import dataclasses

from kvr_jax.planning import costmodel, presets, search
from kvr_jax.runtime.loading import preset_config

LATENT_MODELS = ("deepseek-v3", "moonlight-16b-a3b")
LATENT_RANKS = 8
LATENT_CONTEXT_LENS = (32768, 131072)
LATENT_LINKS = ("300GBps", "10GBps")


@dataclasses.dataclass(frozen=True)
class LatentCell:
  """One MODELLED cell: TTFT of KVR-S, KVR on an even split and all-gather CP; the bytes each
  sends per layer (KVR: its largest hop; all-gather: each rank's gathered latents) and what
  KVR's largest hop would be as per-head K,V."""

  model: str
  links: str
  context_len: int
  ttft_s: dict
  sent: dict
  per_head_hop: float
  chunks: tuple[int, ...]


def latent_cell(model: str, context_len: int, links: str, num_ranks: int = LATENT_RANKS):
  config = preset_config(model)
  setup = presets.make_setup("h100-sxm", links, dtype_bytes=2, **costmodel.kernel_flags("flash"))
  chunks = search.modelled_search(config, context_len, num_ranks, setup)
  even = (context_len // num_ranks,) * num_ranks
  ttft, sent = {}, {}
  for name, strategy, partition in (
    ("kvr", "kvr", chunks),
    ("kvr-even", "kvr", even),
    ("allgather", "allgather", None),
  ):
    kw = dict(num_ranks=num_ranks, partition=partition)
    ttft[name] = costmodel.simulate(config, strategy, context_len, setup, **kw).ttft
    layer = costmodel.modelled_layer(config, strategy, context_len, setup, **kw)
    sent[name] = max(layer.link_bytes)
  heads = config.num_heads * (config.head_dim + config.v_head_dim)
  per_head_hop = sent["kvr"] * heads / config.cache_width
  return LatentCell(model, links, context_len, ttft, sent, per_head_hop, chunks)


def print_latent_grid(models=LATENT_MODELS, context_lens=LATENT_CONTEXT_LENS, links=LATENT_LINKS):
  print(
    f"Latent attention on {LATENT_RANKS} H100s, bf16, flash kernels, MODELLED: TTFT, and MB "
    "each rank sends per layer (KVR: its largest hop of latents, and that hop as per-head "
    "K,V; all-gather CP: each rank's gathered latents)"
  )
  print(
    f"{'model':<20}{'links':<8}{'C':>7} {'KVR-S':>9}{'KVR-E':>9}{'allgath.':>9}  S vs AG"
    f"{'KVR MB':>9}{'as K,V':>9}{'AG MB':>9}"
  )
  cells = []
  for model in models:
    for name in links:
      for C in context_lens:
        c = latent_cell(model, C, name)
        cells.append(c)
        t, mb = c.ttft_s, {k: v / 1e6 for k, v in c.sent.items()}
        print(
          f"{model:<20}{name:<8}{C:>7} {t['kvr']:>8.2f}s{t['kvr-even']:>8.2f}s"
          f"{t['allgather']:>8.2f}s  {t['allgather'] / t['kvr']:>6.2f}x"
          f"{mb['kvr']:>9.1f}{c.per_head_hop / 1e6:>9.0f}{mb['allgather']:>9.1f}"
        )
  return cells
