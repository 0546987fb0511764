"""Tensor parallelism inside a rank (kvr_jax.runtime.tensor_parallel): the model's own maths on
Megatron shards of its weights, with the partial sums added by a psum over "model", equals
the whole model within the fixed float32 tolerance, for GQA with fewer KV heads than shards,
MQA, a sliding window, Q/K/V biases (Qwen2) and q/k norms (Qwen3); and on a 2-D mesh
("ranks", "model") each layer reduces exactly as often as the block needs and never gathers a
weight.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

import kvr_jax
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.loading import build_model
from kvr_jax.runtime.mesh import AXIS
from kvr_jax.runtime.tensor_parallel import MODEL_AXIS
from tests.tolerance import assert_close

LLAMA = kvr_jax.preset_config("tiny-llama")  # 4 heads, 2 KV heads, F 352
CONFIGS = {
  "gqa": LLAMA,
  "mqa": kvr_jax.preset_config("tiny-falcon"),  # one KV head, parallel block
  "window": dataclasses.replace(kvr_jax.preset_config("tiny-mistral"), sliding_window=6),
  "qwen2": dataclasses.replace(LLAMA, qkv_bias=True),
  "qwen3": dataclasses.replace(LLAMA, qk_norm=True),
}
TOKENS = np.random.RandomState(0).randint(0, LLAMA.vocab_size, (2, 19))


def perturbed(config):
  """The model with every weight moved off its initial value (biases start at zero and norms
  at one, which would leave them untested)."""
  graphdef, state = nnx.split(build_model(config))
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(state))))
  state = jax.tree.map(lambda w: w + 0.05 * jax.random.normal(next(keys), w.shape, w.dtype), state)
  return graphdef, state


@pytest.fixture(scope="module")
def whole():
  """name -> (graphdef, state, logits, k, v) of the whole model (flash attention)."""
  out = {}
  for name, config in CONFIGS.items():
    graphdef, state = perturbed(config)
    model = nnx.merge(graphdef, state)
    x, k, v = model.forward(jnp.asarray(TOKENS), "flash")
    out[name] = (graphdef, state, model.logits(x), k, v)
  return out


def heads_as_sharded(kv_LBTKH, config, m):
  """The whole model's K or V with each head repeated where the shards repeat it."""
  return np.repeat(np.asarray(kv_LBTKH), max(m // config.num_kv_heads, 1), axis=3)


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_shards_add_up_to_the_whole_model(whole, name, m):
  """Each shard's logits (the psum makes every shard's hidden states whole) and its K,V heads
  (concatenated over shards) equal the whole model's."""
  config = CONFIGS[name]
  graphdef, state, logits, k, v = whole[name]
  shards = tensor_parallel.split_state(tensor_parallel.shard_ready_state(config, state, m), m)

  def one_shard(shard_state):
    model = nnx.merge(graphdef, shard_state)
    x, k, v = model.forward(jnp.asarray(TOKENS), "flash", reduce=tensor_parallel.psum_over_model)
    return model.logits(x), k, v

  logits_m, k_m, v_m = jax.jit(jax.vmap(one_shard, axis_name=MODEL_AXIS))(shards)
  per_shard = tensor_parallel.kv_heads_per_shard(config, m)
  assert k_m.shape[-2] == per_shard
  for j in range(m):
    assert_close(logits_m[j], logits, f"shard {j} logits")
  assert_close(np.concatenate(list(k_m), axis=3), heads_as_sharded(k, config, m), "K heads")
  assert_close(np.concatenate(list(v_m), axis=3), heads_as_sharded(v, config, m), "V heads")


def mesh_2d(ranks, model):
  devices = np.asarray(jax.devices()[: ranks * model]).reshape(ranks, model)
  return jax.sharding.Mesh(devices, (AXIS, MODEL_AXIS), axis_types=(AxisType.Explicit,) * 2)


@pytest.mark.parametrize("name,shape", [("gqa", (2, 4)), ("mqa", (1, 4)), ("qwen3", (4, 2))])
def test_a_2d_mesh_reduces_once_per_partial_sum_and_gathers_no_weight(whole, name, shape):
  """shard_map over ("ranks", "model"), each rank a different prompt row: the same numbers as
  the whole model; the compiled layer holds exactly the block's all-reduces (two for Llama,
  one for Falcon's parallel block) and no all-gather."""
  config = CONFIGS[name]
  graphdef, state, logits, k, v = whole[name]
  ranks, m = shape
  mesh = mesh_2d(ranks, m)
  ready = tensor_parallel.shard_ready_state(config, state, m)
  specs = tensor_parallel.partition_specs(ready)
  kv_spec = PartitionSpec(AXIS, None, None, None, MODEL_AXIS, None)

  def run(shard_state, tokens_1BT):
    model = nnx.merge(graphdef, shard_state)
    x, k, v = model.forward(tokens_1BT[0], "flash", reduce=tensor_parallel.psum_over_model)
    return model.logits(x)[None], k[None], v[None]

  program = jax.jit(
    jax.shard_map(
      run,
      mesh=mesh,
      in_specs=(specs, PartitionSpec(AXIS)),
      out_specs=(PartitionSpec(AXIS), kv_spec, kv_spec),
    )
  )
  rows = np.stack([TOKENS[r % 2 : r % 2 + 1] for r in range(ranks)])  # [ranks, 1, T]
  rows = jax.device_put(rows, jax.NamedSharding(mesh, PartitionSpec(AXIS)))
  placed = jax.device_put(ready, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs))
  logits_r, k_r, v_r = (np.asarray(out) for out in program(placed, rows))
  for r in range(ranks):
    assert_close(logits_r[r], logits[r % 2 : r % 2 + 1], f"rank {r} logits")
    assert_close(k_r[r], heads_as_sharded(k[:, r % 2 : r % 2 + 1], config, m), f"rank {r} K")
    assert_close(v_r[r], heads_as_sharded(v[:, r % 2 : r % 2 + 1], config, m), f"rank {r} V")
  hlo = program.lower(placed, rows).compile().as_text()
  reductions = len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo))
  expected = 1 if name == "mqa" else 2  # the scan body holds one layer
  assert reductions == expected, re.findall(r".*all-reduce.*", hlo)
  assert "all-gather" not in hlo


def test_model_parallel_refused_where_it_does_not_split():
  for m, message in [(3, "model_parallel=3 must divide num_heads (4)"), (0, "integer >= 1")]:
    with pytest.raises(ValueError, match=re.escape(message)):
      tensor_parallel.check_model_parallel(LLAMA, m)
  # 8 shards of 4 query heads cannot be made by repeating KV heads either.
  with pytest.raises(ValueError, match="model_parallel=8"):
    tensor_parallel.shard_ready_state(LLAMA, None, 8)
