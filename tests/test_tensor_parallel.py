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
from kvr_jax.inference.prefill import plan_prefill
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.loading import build_model, preset_config
from kvr_jax.runtime.mesh import AXIS, check_mesh, rank_row_mesh, split_dims
from kvr_jax.runtime.tensor_parallel import MODEL_AXIS
from kvr_jax.strategies.by_kind import compile_by_kind
from models import scan_layers
from tests.lazy import LazyDict
from tests.tolerance import assert_close

LLAMA = preset_config("tiny-llama")  # 4 heads, 2 KV heads, F 352
CONFIGS = {
  "gqa": LLAMA,
  "mqa": preset_config("tiny-falcon"),  # one KV head, parallel block
  "window": dataclasses.replace(preset_config("tiny-mistral"), sliding_window=6),
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


def _whole(name):
  graphdef, state = perturbed(CONFIGS[name])
  model = nnx.merge(graphdef, state)
  x, k, v = model.forward(jnp.asarray(TOKENS), "flash")
  return graphdef, state, model.logits(x), k, v


@pytest.fixture(scope="module")
def whole():
  """name -> (graphdef, state, logits, k, v) of the whole model (flash attention), made when a
  test first asks for it."""
  return LazyDict(_whole)


def heads_as_sharded(kv_LBTKH, config, m):
  """The whole model's K or V with each head repeated where the shards repeat it."""
  return np.repeat(np.asarray(kv_LBTKH), max(m // config.num_kv_heads, 1), axis=3)


@pytest.mark.default_cases("qwen3-2")
@pytest.mark.parametrize(
  "name,m", [("gqa", 2), ("gqa", 4), ("mqa", 4), ("window", 2), ("qwen2", 4), ("qwen3", 2)]
)
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


@pytest.mark.default_cases("mqa")
@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_a_shards_row_blocked_finish_reduces_every_block(whole, name):
  """Block.finish over row blocks (the lax.map a prompt longer than models.base.ROW_BLOCK
  takes; here blocks of 5 rows) on tensor-parallel shards: every block's partial sums are
  reduced, so the logits are the whole model's."""
  config = CONFIGS[name]
  graphdef, state, logits, _, _ = whole[name]
  shards = tensor_parallel.split_state(tensor_parallel.shard_ready_state(config, state, 2), 2)
  tokens_BT = jnp.asarray(TOKENS)
  assert tokens_BT.shape[1] > 5  # at least two row blocks
  positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)

  def one_shard(shard_state):
    model = nnx.merge(graphdef, shard_state)

    def layer(block, _, x_BTD):
      q_BTNH, k_BTKH, v_BTKH = block.project_qkv(x_BTD, positions_BT)
      attn_BTNH = block.attend(q_BTNH, k_BTKH, v_BTKH, 0, "flash")
      x_BTD = block.finish(x_BTD, attn_BTNH, 5, reduce=tensor_parallel.psum_over_model)
      return x_BTD, None

    x_BTD, _ = scan_layers(model, layer, model.embed(tokens_BT))
    return model.logits(x_BTD)

  logits_m = jax.jit(jax.vmap(one_shard, axis_name=MODEL_AXIS))(shards)
  for j in range(2):
    assert_close(logits_m[j], logits, f"shard {j} logits")


def mesh_2d(ranks, model):
  devices = np.asarray(jax.devices()[: ranks * model]).reshape(ranks, model)
  return jax.sharding.Mesh(devices, (AXIS, MODEL_AXIS), axis_types=(AxisType.Explicit,) * 2)


@pytest.mark.default_cases("mqa-shape1")
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
  specs = tensor_parallel.partition_specs(ready, m)
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


def test_a_partition_spec_is_named_by_the_arrays_dimension_letters():
  """split_dims: each named letter on its mesh axis, the others replicated, by position in the
  array's letters; a letter the array lacks or a repeated one is refused."""
  assert split_dims("LBSKH", K=MODEL_AXIS) == jax.P(None, None, None, MODEL_AXIS, None)
  assert split_dims("L2BTKH", K=MODEL_AXIS, L=AXIS) == jax.P(
    AXIS, None, None, None, MODEL_AXIS, None
  )
  assert split_dims("LBwC", C=MODEL_AXIS) == jax.P(None, None, None, MODEL_AXIS)
  assert split_dims("BT") == jax.P(None, None)
  for dims, axes in (("LBSKH", {"N": MODEL_AXIS}), ("LBSKK", {"K": MODEL_AXIS})):
    with pytest.raises(ValueError, match="one distinct letter"):
      split_dims(dims, **axes)


def test_model_parallel_refused_where_it_does_not_split():
  for m, message in [(3, "model_parallel=3 must divide num_heads (4)"), (0, "integer >= 1")]:
    with pytest.raises(ValueError, match=re.escape(message)):
      tensor_parallel.check_model_parallel(LLAMA, m)
  # 8 shards of 4 query heads cannot be made by repeating KV heads either.
  with pytest.raises(ValueError, match="model_parallel=8"):
    tensor_parallel.shard_ready_state(LLAMA, None, 8)


# --- every strategy on a ("ranks", "model") mesh, through prefill ------------------------------

# 8 query heads (2 KV heads) so that 8 shards fit: the 1 x 8 mesh.
WIDE = dataclasses.replace(LLAMA, num_heads=8, head_dim=16)
PREFILL_MODELS = {
  "gqa": LLAMA,  # 2 KV heads: 4 shards repeat each twice
  "mqa": CONFIGS["mqa"],
  "window": CONFIGS["window"],
  "qwen3": CONFIGS["qwen3"],
  "wide": WIDE,
}
# (model, strategy, ranks x model, partition): KVR's partitions uneven, the windowed one with
# chunks longer and shorter than the window of 6.
PROMPT = np.random.RandomState(1).randint(0, LLAMA.vocab_size, (2, 37))
PREFILL_CASES = [
  ("gqa", "kvr", (2, 4), [23, 14]),
  ("gqa", "kvr", (4, 2), [13, 10, 8, 6]),
  ("gqa", "tsp", (2, 4), None),
  ("gqa", "ring", (4, 2), None),
  ("gqa", "allgather", (2, 4), None),
  ("mqa", "kvr", (2, 4), [20, 17]),
  ("mqa", "ring", (2, 4), None),
  ("window", "kvr", (4, 2), [16, 12, 5, 4]),
  ("window", "allgather", (2, 4), None),
  ("qwen3", "kvr", (2, 2), [25, 12]),
  ("wide", "single", (1, 8), None),
]


def _prefill_model(name):
  graphdef, state = perturbed(PREFILL_MODELS[name])
  model = kvr_jax.Model(nnx.merge(graphdef, state), source=f"perturbed-{name}")
  return model, kvr_jax.prefill(model, PROMPT, "single")


@pytest.fixture(scope="module")
def prefill_models():
  """name -> (model, its one-device prefill), made when a test first asks for it."""
  return LazyDict(_prefill_model)


def cache_in_prompt_order(result):
  """The cache parts [p, L, 2, B*P, K, H] (host) laid out in prompt order: (k, v) [L, B, C,
  K, H], from the result's CacheLayout."""
  parts = np.asarray(result.past.kv_parts)
  L, K, H, P = parts.shape[1], parts.shape[-2], parts.shape[-1], result.cache_layout.part_len
  parts = parts.reshape(parts.shape[0], L, 2, parts.shape[3] // P, P, K, H)
  runs = result.cache_layout.runs_in_prompt_order()
  kv = np.concatenate([parts[r, :, :, :, row : row + n] for r, row, _, n in runs], axis=3)
  return kv[:, 0], kv[:, 1]


@pytest.mark.default_cases("window-kvr-shape7-partition7")
@pytest.mark.parametrize("name,strategy,shape,partition", PREFILL_CASES)
def test_strategies_on_a_2d_mesh_match_single(prefill_models, name, strategy, shape, partition):
  """Logits and every rank's K,V part (its heads split over its row) within 1e-5 of the
  single-device prefill of the whole model."""
  model, oracle = prefill_models[name]
  ranks, m = shape
  mesh = kvr_jax.make_mesh(ranks, model=m)
  kw = {} if partition is None else {"partition": partition}
  result = kvr_jax.prefill(model, PROMPT, strategy, mesh=mesh, cache="sharded", **kw)
  assert_close(result.logits, oracle.logits, "logits")
  assert result.past.kv_parts.sharding.spec == PartitionSpec(
    AXIS, None, None, None, MODEL_AXIS, None
  )
  config = model.config
  # The parts hold the layers that keep every position: all of them, or none where a window
  # shorter than the prompt keeps a ring instead (then zeros before it in prompt order).
  in_parts = np.arange(config.num_layers) if result.past.kept is None else []
  assert (result.past.kept is None) == (name != "window")
  k, v = cache_in_prompt_order(result)
  assert k.shape[0] == len(in_parts)
  if len(in_parts):
    want_k, want_v = (np.asarray(x)[in_parts] for x in (oracle.k_cache, oracle.v_cache))
    assert_close(k, heads_as_sharded(want_k, config, m), "K cache")
    assert_close(v, heads_as_sharded(want_v, config, m), "V cache")
  want_k, want_v = (as_kept(x, config.sliding_window) for x in (oracle.k_cache, oracle.v_cache))
  # cache="last": moved onto the last rank's row of devices, heads split over "model" (each
  # head repeated on m/K shards where K < m) as decode reads it; gather_cache() gives single's
  # K heads on that row.
  k, v = result.decode_cache()
  assert set(k.devices()) == set(mesh.devices[-1]) and k.sharding.spec[3] == MODEL_AXIS
  assert_close(k, heads_as_sharded(want_k, config, m), "K cache on the last rank")
  assert_close(v, heads_as_sharded(want_v, config, m), "V cache on the last rank")
  k, v = result.gather_cache()
  assert set(k.devices()) == set(mesh.devices[-1]) and k.shape == oracle.k_cache.shape
  assert_close(k, want_k, "gathered K cache")
  assert_close(v, want_v, "gathered V cache")


def as_kept(cache_LBCKH, window: int | None) -> np.ndarray:
  """Single's cache as a windowed model keeps it once the prompt outgrew the window (every
  layer windowed, rows of one length): each layer's last W positions, zeros before."""
  cache = np.array(cache_LBCKH)
  if window is not None and window < cache.shape[2]:
    cache[:, :, : cache.shape[2] - window] = 0
  return cache


@pytest.mark.parametrize(
  "name, shape, partition",
  [("gqa", (2, 4), [23, 14]), ("gqa", (4, 2), [13, 10, 8, 6]), ("window", (2, 4), [23, 14])],
)
def test_kvr_joins_its_last_hop_on_a_2d_mesh_without_a_move(
  prefill_models, monkeypatch, name, shape, partition
):
  """cache="last" under KV-Runahead on a ("ranks", "model") mesh: each device of the last
  rank's row joins its heads' last hop and own part where they lie (nothing moves: the
  parts' move and the rings' psum are made to fail), and the cache on that row, heads
  split over "model", is the single-device one within 1e-5; with a window shorter than the
  prompt (6 of 37), each layer's ring of it, zeros before."""
  from kvr_jax.inference import kv_cache, sharded_decode

  model, oracle = prefill_models[name]
  mesh = kvr_jax.make_mesh(shape[0], model=shape[1])
  kw = dict(mesh=mesh, partition=partition, cache="last")
  assert plan_prefill(model, PROMPT, "kvr", **kw).keep_last_hop

  def no_move(*args, **kwargs):
    raise AssertionError("a part was sent to the last rank")

  monkeypatch.setattr(kv_cache, "send_onto_last_rank", no_move)  # the parts' move
  monkeypatch.setattr(sharded_decode, "sharded_rings_program", no_move)  # the rings' psum
  result = kvr_jax.prefill(model, PROMPT, "kvr", **kw)
  assert_close(result.logits, oracle.logits, "logits")
  assert (result.past.kept is None) == (name != "window")
  config, m = model.config, shape[1]
  want_k, want_v = (as_kept(x, config.sliding_window) for x in (oracle.k_cache, oracle.v_cache))
  k, v = result.k_cache, result.v_cache
  assert set(k.devices()) == set(mesh.devices[-1]) and k.sharding.spec[3] == MODEL_AXIS
  assert_close(k, heads_as_sharded(want_k, config, m), "K cache on the last rank")
  assert_close(v, heads_as_sharded(want_v, config, m), "V cache on the last rank")
  k, v = result.gather_cache()
  assert_close(k, want_k, "gathered K cache")
  assert_close(v, want_v, "gathered V cache")


def test_kvr_hops_carry_each_shards_own_kv_heads(prefill_models):
  """On 2 x 4 with 2 KV heads (repeated to 4), every collective-permute of the compiled KVR
  program carries one head per shard: [2, B, prefix, 1, H] (the 2 x 1 program's carry 2)."""
  model, _ = prefill_models["gqa"]
  hops = {}
  for ranks, m in [(2, 4), (2, 1)]:
    mesh = kvr_jax.make_mesh(ranks, model=m)
    kinds = model.config.kinds
    program = compile_by_kind("kvr", model.graphdef, mesh, (23, 14), "flash", kinds, False)
    replicated = jax.NamedSharding(mesh, PartitionSpec())
    state = model.state_split_over(mesh) if m > 1 else model.state_on(replicated)
    by_rank = jax.NamedSharding(mesh, PartitionSpec(AXIS))
    tokens = jax.ShapeDtypeStruct((ranks, 2, 23), jnp.int32, sharding=by_rank)  # [p, B, c_max]
    hlo = program.lower(state, tokens).compile().as_text()
    # The K,V heads axis of every [2, B, keys, K, H] operand a collective-permute moves.
    permutes = [line for line in hlo.splitlines() if "collective-permute" in line]
    shapes = [dims.split(",") for line in permutes for dims in re.findall(r"f32\[([\d,]+)\]", line)]
    hops[m] = [dims[3] for dims in shapes if len(dims) == 5]
  assert hops[4] and set(hops[4]) == {"1"}, hops
  assert hops[1] and set(hops[1]) == {"2"}, hops


def test_2d_mesh_inputs_are_checked_before_compiling(prefill_models):
  model, _ = prefill_models["gqa"]  # 4 query heads
  with pytest.raises(ValueError, match=re.escape("model_parallel=8 must divide num_heads (4)")):
    kvr_jax.prefill(model, TOKENS, "tsp", mesh=kvr_jax.make_mesh(1, model=8), cache="sharded")
  with pytest.raises(ValueError, match="4 ranks x model=4 needs 16 devices but only 8"):
    kvr_jax.make_mesh(4, model=4)
  with pytest.raises(ValueError, match="runs on a 1-D mesh"):
    check_mesh(kvr_jax.make_mesh(2, model=2))  # what every other consumer of a mesh asks


def test_a_2d_program_compiles_once_per_shape(prefill_models):
  """A second prefill with the same shapes on an equal (new) 2-D mesh traces nothing."""
  from kvr_jax.strategies.base import TRACE_COUNT

  model, _ = prefill_models["gqa"]

  def run():
    mesh = kvr_jax.make_mesh(2, model=4)
    kvr_jax.prefill(model, PROMPT, "kvr", mesh=mesh, partition=[23, 14], cache="sharded")
    return TRACE_COUNT["kvr"]

  first = run()
  assert run() == first and first >= 1


@pytest.mark.default_cases("gqa-kvr-shape2-sharded")
@pytest.mark.parametrize(
  "name,strategy,shape,cache",
  [
    ("gqa", "kvr", (2, 4), "last"),
    ("mqa", "allgather", (4, 2), "sharded"),
    ("gqa", "kvr", (2, 4), "sharded"),
    # Window 6 shorter than the prompt: rings of it, heads split, on the last row ("last") and
    # replicated over the ranks ("sharded").
    ("window", "allgather", (2, 4), "last"),
    ("window", "kvr", (4, 2), "sharded"),
  ],
)
def test_greedy_decode_on_a_2d_mesh_is_single_devices(prefill_models, name, strategy, shape, cache):
  """generate on a ("ranks", "model") mesh: with cache="last" the last rank's row decodes as
  model shards; with cache="sharded" every rank's row runs each step as model shards over its
  own part (each shard's heads merged across the ranks). The greedy tokens are the
  single-device ones, and so are the last step's logits."""
  model, _ = prefill_models[name]
  want = kvr_jax.generate(model, PROMPT, max_new_tokens=6, strategy="single")
  mesh = kvr_jax.make_mesh(shape[0], model=shape[1])
  got = kvr_jax.generate(model, PROMPT, max_new_tokens=6, strategy=strategy, mesh=mesh, cache=cache)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert_close(got.last_logits, want.last_logits, "the last step's logits")
  # The decoding row's weights are the prefill's own shards on those devices (no second copy).
  prefill_state = model.state_split_over(mesh)
  decode_state = model.state_split_over(rank_row_mesh(mesh, shape[0] - 1))
  for held, used in zip(jax.tree.leaves(prefill_state), jax.tree.leaves(decode_state), strict=True):
    pointers = {s.device: s.data.unsafe_buffer_pointer() for s in held.addressable_shards}
    assert all(
      pointers[s.device] == s.data.unsafe_buffer_pointer() for s in used.addressable_shards
    )


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_compiled_memory_on_a_2d_mesh_is_one_devices_share():
  """XLA's analysis of the 2-D program sees one device's shard: tiny-llama over 2 shards holds
  the whole embedding, head and norms but half of every block matrix (by hand: per layer
  2*D*N*H + 2*D*K*H + 3*D*F = 184,320 parameters, 4 bytes each, 4 layers), its arguments are
  those weights plus the same tokens, and each K,V part holds one of the two KV heads. One
  split for both (the searched one models the shards' all-reduces, so it differs with m)."""
  kw = dict(context_len=512, num_ranks=2, cache="sharded", partition=[265, 247])
  whole = kvr_jax.compiled_memory("tiny-llama", "kvr", **kw)
  split = kvr_jax.compiled_memory("tiny-llama", "kvr", model_parallel=2, **kw)
  D, N, K, H, F, L = 128, 4, 2, 32, 352, 4
  block_matrices = L * (2 * D * N * H + 2 * D * K * H + 3 * D * F) * 4
  assert split["weights_bytes"] == whole["weights_bytes"] - block_matrices // 2
  tokens = whole["argument_bytes"] - whole["weights_bytes"]
  assert split["argument_bytes"] == split["weights_bytes"] + tokens
  assert split["kv_cache_bytes"] * 2 == whole["kv_cache_bytes"]
  # The outputs differ by one of the two heads of every part [L, 2, B*P, K, H] (P the
  # longest chunk); the logits and the rest are the same.
  P = max(whole["chunks"])
  assert whole["output_bytes"] - split["output_bytes"] == L * 2 * P * 1 * H * 4


def test_a_model_loaded_split_prefills_like_the_whole_one():
  """tiny-llama loaded straight into 2 x 4 shards (load_model(mesh=); its 2 KV heads whole on
  every shard until the prefill repeats them): KV-Runahead's logits equal the whole preset's
  single-device ones; the prefill runs on the loaded arrays themselves but for the KV weights
  it repeats; single gathers the weights whole. On 4 x 2 (K = m) nothing is placed again."""
  mesh = kvr_jax.make_mesh(2, model=4)
  whole = kvr_jax.load_model("tiny-llama", "float32")
  split = kvr_jax.load_model("tiny-llama", "float32", mesh=mesh)
  want = kvr_jax.prefill(whole, PROMPT, "single")
  got = kvr_jax.prefill(split, PROMPT, "kvr", mesh=mesh, partition=[23, 14], cache="sharded")
  assert_close(got.logits, want.logits, "logits")
  placed = split.state_split_over(mesh)
  loaded_leaves = jax.tree_util.tree_leaves_with_path(split.state)
  moved = {
    tensor_parallel.path_names(path)[1]
    for (path, loaded), used in zip(loaded_leaves, jax.tree.leaves(placed), strict=True)
    if loaded is not used
  }
  assert moved == {"wk", "wv"}, moved
  assert_close(kvr_jax.prefill(split, PROMPT, "single").logits, want.logits, "single, gathered")
  mesh_4x2 = kvr_jax.make_mesh(4, model=2)
  split_4x2 = kvr_jax.load_model("tiny-llama", "float32", mesh=mesh_4x2)
  placed = split_4x2.state_split_over(mesh_4x2)
  pairs = zip(jax.tree.leaves(split_4x2.state), jax.tree.leaves(placed), strict=True)
  assert all(loaded is used for loaded, used in pairs)
