"""The cost model on latent-attention models (kvr_jax/strategies/latent_modelled.py): a hop
carries the latent prefix (C numbers per token), every rank pays for expanding what it
attends, KVR-S weighs both, and what is not built is refused by name. No devices."""

import dataclasses

import pytest

from kvr_jax.planning import costmodel, presets, search
from kvr_jax.runtime.loading import preset_config
from kvr_jax.strategies import get_strategy, latent_modelled


@pytest.fixture(scope="module")
def deepseek():
  return preset_config("deepseek-v3")


@pytest.fixture(scope="module")
def setup():
  return presets.make_setup("h100-sxm", "10GBps", dtype_bytes=2, **costmodel.kernel_flags("flash"))


def test_kvr_hops_carry_latents_and_each_rank_expands_its_prefix(deepseek, setup):
  chunks = (6000, 5000, 3000, 2384)
  layer = costmodel.modelled_layer(
    deepseek, "kvr", sum(chunks), setup, num_ranks=4, partition=chunks
  )
  # hop k: S_k latents of 576 bf16 numbers, batch 1 (not 128 x 320 numbers of K and V)
  assert layer.link_bytes == tuple(2 * 576 * s for s in (6000, 11000, 14000))
  ends = (6000, 11000, 14000, 16384)
  for i, c in enumerate(chunks):
    keys = sum(chunks[:i]) + (c + 1) / 2
    phases = latent_modelled.latent_phases(deepseek, c, ends[i], keys, setup)
    assert layer.flops[i] == pytest.approx(sum(w.flops for w in phases.values()))
    # the expansion follows the positions a rank sees: 2 x S_i x 512 x 128 x (128 + 128)
    assert phases["expand"].flops == 2 * ends[i] * 512 * 128 * 256


def test_allgather_expands_the_whole_prompt_on_every_rank(deepseek, setup):
  C, p = 16384, 4
  layer = costmodel.modelled_layer(deepseek, "allgather", C, setup, num_ranks=p)
  assert layer.link_bytes == ((p - 1) * 2 * 576 * (C // p),) * p
  expand = latent_modelled.latent_phases(deepseek, C // p, C, 1.0, setup)["expand"].flops
  assert expand == 2 * C * 512 * 128 * 256
  assert min(layer.flops) > expand


def test_kvr_s_balances_expansion_and_attention(deepseek, setup):
  """KVR-S's split (MODELLED) beats the even one, and its last rank, which expands the whole
  prompt, gets the shortest chunk."""
  C, p = 32768, 8
  chunks = search.modelled_search(deepseek, C, p, setup)
  searched = costmodel.simulate(deepseek, "kvr", C, setup, num_ranks=p, partition=chunks).ttft
  even = costmodel.simulate(deepseek, "kvr", C, setup, num_ranks=p, partition=(C // p,) * p).ttft
  assert searched < 0.85 * even
  assert chunks[-1] == min(chunks)


def test_ring_passes_latents_around_and_tsp_scores_every_key(deepseek, setup):
  """Ring attention on latents (MODELLED): each rank sends p-1 pieces of 2c latents, expands
  and attends what all-gather CP does (the same FLOPs per rank), and overlaps the passing with
  its steps, so on a 10 GB/s link it beats all-gather CP, which waits for its gather. TSP:
  c latents gathered, every query scored against all p c keys (more attention FLOPs than the
  zigzag peers' causal ones). A strategy with no modelled latent layer is refused by name."""
  C, p = 32768, 8
  ring = costmodel.modelled_layer(deepseek, "ring", C, setup, num_ranks=p)
  gather = costmodel.modelled_layer(deepseek, "allgather", C, setup, num_ranks=p)
  assert ring.link_bytes == ((p - 1) * 2 * 576 * (C // p),) * p
  assert ring.flops == pytest.approx(gather.flops, rel=1e-12)
  simulate = costmodel.simulate
  assert (
    simulate(deepseek, "ring", C, setup, num_ranks=p).ttft
    < simulate(deepseek, "allgather", C, setup, num_ranks=p).ttft
  )
  tsp = costmodel.modelled_layer(deepseek, "tsp", C, setup, num_ranks=p)
  assert tsp.link_bytes == ((p - 1) * 2 * 576 * (C // p),) * p
  c, N, h = C // p, deepseek.num_heads, deepseek.qk_nope_head_dim + deepseek.qk_rope_head_dim
  dense = latent_modelled.latent_phases(deepseek, c, C, C, setup)["attention"].flops
  assert dense == 2 * N * c * C * (h + deepseek.v_head_dim)
  assert min(tsp.flops) > max(gather.flops)
  # A strategy whose record has no latent layer is refused by name, not modelled as K,V.
  bare = dataclasses.replace(get_strategy("ring"), kind_layers={})
  with pytest.raises(ValueError, match="'ring' runs no multi-head latent attention layers"):
    costmodel.modelled_layer(deepseek, bare, C, setup, num_ranks=p)


def test_a_latent_model_group_computes_its_share_and_all_reduces():
  """On model groups of 4 (heads, kv_b_proj, experts and shared experts split; the latent's
  projection and the router whole on every device) each rank's modelled FLOPs per layer are
  the whole ones W over 4 plus 3/4 of the whole parts A = 2 c D (C + E) (Moonlight: no q
  low-rank half); its all-reduces over a slow group link lengthen the TTFT; the busiest
  device's routed rows (imbalance 1.5) add half its routed share, not the shared experts'."""
  config, chunks = preset_config("moonlight-16b-a3b"), (5000, 3192)
  D, C, E, k, f = config.d_model, config.cache_width, config.num_experts, 6, config.expert_dim
  kw = dict(dtype_bytes=2, **costmodel.kernel_flags("flash"))

  def simulate(m, model_bw=1e30, imbalance=1.0):
    setup = costmodel.Setup(
      presets.hardware_preset("h100-sxm"),
      presets.links_preset("300GBps"),
      model_parallel=m,
      model_links=costmodel.Links(model_bw, 0.0),
      expert_imbalance=imbalance,
      **kw,
    )
    return costmodel.simulate(config, "kvr", sum(chunks), setup, num_ranks=2, partition=chunks)

  whole, split = simulate(1), simulate(4)
  for c, w, s in zip(chunks, whole.rank_flops, split.rank_flops, strict=True):
    shared = 2 * c * D * (C + E)
    assert s == pytest.approx(shared + (w - shared) / 4, rel=1e-9)
  assert simulate(4, model_bw=1e9).ttft > split.ttft
  heavy = simulate(4, imbalance=1.5)
  for c, even, busy in zip(chunks, split.rank_flops, heavy.rank_flops, strict=True):
    assert busy - even == pytest.approx(0.5 * 2 * c * D * 3 * k * (f // 4), rel=1e-9)


def test_latent_rates_fitted_to_the_model_on_this_device():
  """fitted_latent_hardware times bench-deepseek's experts layer (projections, expansion,
  out-projection and mixture) and the flash kernel over its expanded heads here: positive
  rates, and a KVR-S search on them gives an exact split of the prompt."""
  from kvr_jax.runtime.loading import load_model
  from kvr_jax.tools import phases

  model = load_model("bench-deepseek", dtype="float32")
  hardware = phases.fitted_latent_hardware(model, 512, repeats=1)
  assert hardware.flops > 0 and hardware.fused_attention_flops > 0
  assert "latent layer" in hardware.note
  setup = presets.make_setup(hardware, dtype_bytes=4, **costmodel.kernel_flags("flash"))
  split = search.modelled_search(model.config, 512, 2, setup)
  assert sum(split) == 512 and len(split) == 2 and min(split) > 0
