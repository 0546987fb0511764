"""The cost model on hybrid models (kvr_jax/strategies/linear_modelled.py): a linear layer's
work is linear in its tokens, running ahead of the state costs the ranks that do it, and what
each strategy sends on a linear layer does not follow the prompt. No devices, no compile."""

import pytest

from kvr_jax.planning import costmodel, presets
from kvr_jax.runtime.loading import preset_config
from kvr_jax.strategies import linear_modelled
from models.layer_kinds import FULL_ATTENTION


@pytest.fixture(scope="module")
def qwen():
  return preset_config("qwen3.5-27b")


@pytest.fixture(scope="module")
def setup():
  return presets.make_setup("h100-sxm", "10GBps", dtype_bytes=2, **costmodel.kernel_flags("flash"))


def linear_layer(config, strategy, C, setup, p, partition=None):
  return costmodel.modelled_layer(
    config.of_kind(config.linear_kind), strategy, C, setup, num_ranks=p, partition=partition
  )


def test_linear_work_is_linear_in_tokens_and_the_entry_map_costs_extra(qwen, setup):
  def flops(tokens, ahead):
    phases = linear_modelled.linear_phases(qwen, tokens, setup, entry_map=ahead)
    return sum(w.flops for w in phases.values())

  for ahead in (False, True):
    assert flops(2048, ahead) == pytest.approx(2 * flops(1024, ahead))  # no quadratic term
  # Ahead of the state (k = v = 128): the step-matrix chain and Q_eff per chunk, then the
  # correction per token; a sizeable share of the mixer, not of the layer's MLP.
  extra = flops(1024, True) - flops(1024, False)
  h, k = qwen.linear_num_value_heads, qwen.linear_key_head_dim
  assert extra == pytest.approx(2 * 1024 * h * (k**3 / 64 + k * k + k * k))


def test_the_rule_runs_at_the_hardwares_linear_rule_rate(qwen, setup):
  """A linear layer's mixer step is its projections at the matmul rate plus its rule at the
  linear-rule rate (the `local` calibration measures it apart: far below a matmul's on a
  CPU); at a lower rate the step grows by exactly the rule's extra seconds."""
  import dataclasses

  hw = setup.hardware
  slow = dataclasses.replace(setup, hardware=dataclasses.replace(hw, linear_rule_fraction=0.06))
  phases = linear_modelled.linear_phases(qwen, 4096, setup, entry_map=False)
  assert phases["rule"].linear_rule and not phases["linear"].linear_rule
  step = {
    name: linear_layer(qwen, "single", 4096, s, 1).steps[0][0].seconds
    for name, s in (("fast", setup), ("slow", slow))
  }
  rule_flops = phases["rule"].flops
  assert step["fast"] == pytest.approx(phases["linear"].time(hw) + rule_flops / hw.flops)
  extra = rule_flops / hw.peak_flops * (1 / 0.06 - 1 / hw.flops_fraction)
  assert step["slow"] - step["fast"] == pytest.approx(extra)


def test_kvr_rank_zero_runs_no_entry_map(qwen, setup):
  layer = linear_layer(qwen, "kvr", 4096, setup, 2, [2048, 2048])
  assert layer.flops[0] < layer.flops[1]
  single = linear_layer(qwen, "single", 2048, setup, 1)
  assert layer.flops[0] == pytest.approx(single.flops[0])


def test_what_a_linear_layer_sends_does_not_follow_the_prompt(qwen, setup):
  """KV-Runahead: p-1 hops of one float32 state; the peers: each rank's all-gather of its two
  chunks' entry maps; both the same at 64k and 1M. A full layer's hops grow with the prompt."""
  state = linear_modelled.state_bytes(qwen, 1)
  assert state == 48 * 128 * 128 * 4
  maps = linear_modelled.map_bytes(qwen, 1)
  for C in (65536, 1048576):
    even = [C // 8] * 8
    assert linear_layer(qwen, "kvr", C, setup, 8, even).link_bytes == (state,) * 7
    assert linear_layer(qwen, "ring", C, setup, 8).link_bytes == (7 * 2 * maps,) * 8
  full = [
    max(
      costmodel.modelled_layer(
        qwen.of_kind(FULL_ATTENTION), "kvr", C, setup, num_ranks=8, partition=[C // 8] * 8
      ).link_bytes
    )
    for C in (65536, 1048576)
  ]
  assert full[1] == 16 * full[0]


def test_simulate_models_each_kind_of_a_hybrid_as_its_own(qwen, setup):
  """A hybrid's TTFT is its 48 linear and 16 full layers, each as its kind's: less than the
  same model with every layer full (at 128k a full layer's attention is the larger cost), more
  than its 16 full layers alone."""
  import dataclasses

  C, even = 131072, [131072 // 8] * 8
  kw = dict(num_ranks=8, partition=even)
  hybrid = costmodel.simulate(qwen, "kvr", C, setup, **kw).ttft
  every_full = dataclasses.replace(qwen, layer_types=("full_attention",) * 64)
  only_full = dataclasses.replace(qwen, num_layers=16, layer_types=("full_attention",) * 16)
  assert costmodel.simulate(only_full, "kvr", C, setup, **kw).ttft < hybrid
  assert hybrid < costmodel.simulate(every_full, "kvr", C, setup, **kw).ttft


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_hybrid_rates_fitted_to_the_model_on_this_device():
  """fitted_hybrid_hardware times a linear layer, its output phase and the flash kernel of
  bench-qwen3.5 here: positive rates, the rule's no faster than the model's matmuls (its
  floor), and a KVR-S search on them gives an exact split of the prompt."""
  from kvr_jax.planning import search
  from kvr_jax.runtime.loading import load_model
  from kvr_jax.tools import phases

  model = load_model("bench-qwen3.5", dtype="float32")
  hardware = phases.fitted_hybrid_hardware(model, 1024, repeats=1)
  assert hardware.flops > 0 and hardware.fused_attention_flops > 0
  assert 0 < hardware.linear_rule_flops <= hardware.flops * (1 + 1e-9)
  assert "linear rule" in hardware.note
  setup = presets.make_setup(hardware, dtype_bytes=4, **costmodel.kernel_flags("flash"))
  split = search.modelled_search(model.config, 1024, 2, setup)
  assert sum(split) == 1024 and len(split) == 2 and min(split) > 0


def test_a_model_group_splits_a_linear_layer_by_key_head(qwen):
  """On m = 2 shards a linear layer's hop is each shard's own state (B h/2 k v, float32:
  half the bytes), its mixer and MLP FLOPs halve (the rule's work is per value head), and
  its step ends in the group's all-reduces (out_proj and the MLP: two of [B, c, D])."""
  flash = costmodel.kernel_flags("flash")
  one, two = (
    presets.make_setup("h100-sxm", "10GBps", dtype_bytes=2, model_parallel=m, **flash)
    for m in (1, 2)
  )
  whole, split = (linear_layer(qwen, "kvr", 8192, s, 2, [4608, 3584]) for s in (one, two))
  h, k, v = qwen.linear_num_value_heads, qwen.linear_key_head_dim, qwen.linear_value_head_dim
  assert whole.link_bytes == (h * k * v * 4,)
  assert split.link_bytes == (h // 2 * k * v * 4,)
  # The last rank's work: everything but the (whole) norms and the router splits.
  assert split.flops[1] == pytest.approx(whole.flops[1] / 2, rel=1e-3)
  reduce_s = costmodel.model_reduce_time(qwen, 3584, two)
  assert reduce_s > 0
  rest = lambda layer: next(s for s in layer.steps[1] if getattr(s, "phase", "") == "rest")  # noqa: E731
  shard = costmodel.model_shard(qwen.of_kind(qwen.linear_kind), 2)
  work = linear_modelled.linear_phases(shard, 3584, two, entry_map=True)["rest"]
  assert rest(split).seconds == pytest.approx(work.time(two.hardware) + reduce_s)


def test_device_memory_of_a_hybrid_counts_states_not_kv_on_linear_layers(qwen):
  """Qwen3.5-27B over 2 shards, bf16, 32768 tokens: half of every weight, the full layers'
  K,V (2 of 4 KV heads per shard) and each linear layer's state (float32) and halo (its
  heads' channels): not K,V of every layer."""
  setup = presets.make_setup("h100-sxm", "10GBps", dtype_bytes=2, model_parallel=2)
  C, B = 32768, 1
  full = len(qwen.layers_of("full_attention"))
  linear = qwen.num_layers - full
  kv = 2 * C * (qwen.num_kv_heads // 2) * qwen.head_dim * 2
  h, k, v = qwen.linear_num_value_heads // 2, qwen.linear_key_head_dim, qwen.linear_value_head_dim
  state = h * k * v * 4 + (qwen.linear_conv_kernel - 1) * (qwen.conv_channels // 2) * 2
  expected = qwen.num_params() / 2 * 2 + B * (full * kv + linear * state)
  assert costmodel.device_memory(qwen, C, setup) == expected


def test_the_fitting_follows_the_models_layer_kinds(monkeypatch):
  """fitted_model_hardware, what the benchmarks' fitted splits use, times a hybrid's layers
  as a hybrid's, a latent model's as a latent model's and a K,V model's phases otherwise."""
  import types

  from kvr_jax.runtime.loading import preset_config
  from kvr_jax.tools import phases

  for name in ("fitted_hybrid_hardware", "fitted_latent_hardware", "fitted_hardware"):
    monkeypatch.setattr(phases, name, lambda *args, name=name, **kwargs: name)
  picked = {
    preset: phases.fitted_model_hardware(
      types.SimpleNamespace(config=preset_config(preset)), 512, 2
    )
    for preset in ("bench-qwen3.5", "bench-deepseek", "bench-llama")
  }
  assert picked == {
    "bench-qwen3.5": "fitted_hybrid_hardware",
    "bench-deepseek": "fitted_latent_hardware",
    "bench-llama": "fitted_hardware",
  }
