"""Where the KV cache lives after a prefill: every rank keeps only its own part.

Both layouts (cache="last": the parts moved onto the last rank in prompt order; "sharded": the
parts left where they were computed) give the logits and K,V of the single-device oracle, for
every strategy on 1, 2, 3, 4 and 8 ranks (uneven KVR partitions); decode from a sharded cache
gives the single-device decode's logits and greedy tokens (GQA, MQA, a sliding window shorter
than some chunks); and XLA's memory analysis shows no rank's output growing with the mesh.

Tolerance (fixed): 1e-5 relative to the largest magnitude of the reference tensor.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import kvr_jax
from kvr_jax.inference import auto as auto_module
from kvr_jax.inference import decode, kv_cache, prefill_plan, sharded_decode
from kvr_jax.inference.kv_cache import gather_on_last_rank
from kvr_jax.inference.kv_form import KVParts, KVWhole
from kvr_jax.inference.prefill import plan_prefill, run_prefill
from kvr_jax.runtime.cache_layout import contiguous_layout
from kvr_jax.runtime.loading import build_model, preset_config
from kvr_jax.tools.memory import compiled_memory
from models import scan_layers
from tests.tolerance import assert_close

CONTEXT = 29  # not a multiple of 2, 3, 4 or 8 (zigzag and TSP pad, KVR splits unevenly)
WINDOW = 6


def windowed_model():
  config = dataclasses.replace(preset_config("tiny-mistral"), sliding_window=WINDOW)
  return kvr_jax.Model(build_model(config), source="tiny-mistral-window-6")


@pytest.fixture(scope="module")
def models():
  return {
    "gqa": kvr_jax.load_model("tiny-llama"),  # 4 query heads over 2 KV heads
    "mqa": kvr_jax.load_model("tiny-falcon"),  # one KV head
    "window": windowed_model(),
  }


@pytest.fixture(scope="module")
def prompt():
  return np.random.RandomState(3).randint(0, 512, (2, CONTEXT))


@pytest.fixture(scope="module")
def oracle(models, prompt):
  return {name: kvr_jax.prefill(model, prompt) for name, model in models.items()}


# (strategy, p, partition): uneven KVR partitions, every peer, TSP; p in {1, 2, 3, 4, 8}.
MATRIX = [
  ("kvr", 1, None),
  ("kvr", 2, [20, 9]),
  ("kvr", 3, [14, 9, 6]),
  ("kvr", 4, [1, 12, 10, 6]),
  ("kvr", 8, [8, 5, 4, 3, 3, 2, 2, 2]),
  ("tsp", 3, None),
  ("tsp", 8, None),  # ceil(29/8) = 4: the last rank holds 1 real token
  ("ring", 2, None),
  ("ring", 3, None),
  ("ring", 8, None),  # 16 chunks of 2: the last chunks are padding only
  ("allgather", 1, None),
  ("allgather", 4, None),
  ("allgather", 8, None),
]


def run(model, prompt, strategy, p, partition, cache):
  kwargs = {"partition": partition} if partition is not None else {}
  mesh = kvr_jax.make_mesh(p)
  return kvr_jax.prefill(model, prompt, strategy=strategy, mesh=mesh, cache=cache, **kwargs)


@pytest.mark.default_cases("kvr-3-partition2", "allgather-8-None")
@pytest.mark.parametrize("strategy,p,partition", MATRIX)
def test_both_layouts_match_single(models, prompt, oracle, strategy, p, partition):
  model, ref = models["gqa"], oracle["gqa"]
  last = run(model, prompt, strategy, p, partition, "last")
  sharded = run(model, prompt, strategy, p, partition, "sharded")
  mesh_devices = list(kvr_jax.make_mesh(p).devices.reshape(-1))
  for result in (last, sharded):
    assert_close(result.logits, ref.logits, "logits")
    assert result.device == mesh_devices[-1]
  # cache="last": the whole cache, in prompt order, on the last rank's device only.
  assert_close(last.k_cache, ref.k_cache, "K cache")
  assert_close(last.v_cache, ref.v_cache, "V cache")
  assert last.k_cache.sharding.device_set == {mesh_devices[-1]}
  # KV-Runahead joins its last hop where it was received; the peers' parts move there.
  assert last.moved == (strategy != "kvr" and p > 1) and not sharded.moved
  assert last.full_partition is None and sharded.full_partition is None  # one split, K,V
  # cache="sharded": no whole cache anywhere; each rank's part holds its own positions.
  assert isinstance(sharded.past, KVParts) and not hasattr(sharded, "k_cache")
  layout = sharded.cache_layout
  L, B, C, K, H = ref.k_cache.shape
  assert sharded.past.kv_parts.shape == (p, L, 2, B * layout.part_len, K, H)
  by_device = {
    s.device: np.asarray(s.data[0]).reshape(L, 2, B, layout.part_len, K, H)
    for s in sharded.past.kv_parts.addressable_shards
  }
  assert set(by_device) == set(mesh_devices)
  want_kv = np.stack([np.asarray(ref.k_cache), np.asarray(ref.v_cache)], axis=1)
  covered = np.zeros(C, int)
  for rank, runs in enumerate(layout.segments):
    part = by_device[mesh_devices[rank]]
    for position, length, row in runs:
      covered[position : position + length] += 1
      assert_close(
        part[:, :, :, row : row + length],
        want_kv[:, :, :, position : position + length],
        f"rank {rank}'s rows {row}..{row + length}",
      )
  assert (covered == 1).all(), covered  # every position in exactly one part
  # The part is the rank's own share, not a prompt-long buffer.
  assert layout.part_len < C or p == 1
  k, v = sharded.gather_cache()
  assert_close(k, ref.k_cache, "gathered K cache")
  assert_close(v, ref.v_cache, "gathered V cache")


@pytest.mark.default_cases("kvr-3-partition0")
@pytest.mark.parametrize("strategy,p,partition", [("kvr", 3, [14, 9, 6]), ("ring", 4, None)])
def test_collective_move_equals_copy(models, prompt, strategy, p, partition):
  """The multi-process path (each rank's part sent to the last rank, one small ppermute
  program per sender) gives the one-process copy."""
  result = run(models["gqa"], prompt, strategy, p, partition, "sharded")
  mesh = kvr_jax.make_mesh(p)
  copied = gather_on_last_rank(result.past.kv_parts, result.cache_layout, mesh, method="copy")
  collected = gather_on_last_rank(
    result.past.kv_parts, result.cache_layout, mesh, method="collective"
  )
  for got, want in zip(collected, copied, strict=True):
    assert got.sharding.device_set == {mesh.devices.reshape(-1)[-1]}
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_move_across_processes_allocates_no_prompt_long_output():
  """XLA's analysis (shapes only) of what the move across processes runs: each sender's
  program outputs one part per device (the received part on the last rank, zeros
  elsewhere), an eighth of the prompt on 8 even ranks (on a 2-D mesh one shard of a part);
  the one-program move it replaced (collect_program) outputs the whole prompt on every
  device."""
  L, B, K, H, p, c = 2, 1, 2, 8, 8, 64
  mesh = kvr_jax.make_mesh(p)
  parts = jax.ShapeDtypeStruct(
    (p, L, 2, B * c, K, H), np.float32, sharding=NamedSharding(mesh, jax.P("ranks"))
  )
  part_bytes = L * 2 * B * c * K * H * 4
  for sender in (0, 3, 6):
    stats = kv_cache.send_to_last_program(mesh, sender).lower(parts).compile().memory_analysis()
    assert stats.output_size_in_bytes == part_bytes, sender
  layout = contiguous_layout((c,) * p)
  stats = kv_cache.collect_program(mesh, layout).lower(parts).compile().memory_analysis()
  assert stats.output_size_in_bytes >= p * part_bytes  # K and V of all 512 positions
  # On a 4 x 2 ("ranks", "model") mesh each device sends and receives its own head's share.
  mesh_2d = kvr_jax.make_mesh(4, model=2)
  heads = NamedSharding(mesh_2d, jax.P("ranks", None, None, None, "model", None))
  parts_2d = jax.ShapeDtypeStruct((4, L, 2, B * c, K, H), np.float32, sharding=heads)
  program = kv_cache.send_to_last_program(mesh_2d, 1)
  stats = program.lower(parts_2d).compile().memory_analysis()
  assert stats.output_size_in_bytes == part_bytes // 2


@pytest.mark.default_cases("partition2")
@pytest.mark.parametrize("partition", [[20, 9], [14, 9, 6], [8, 5, 4, 3, 3, 2, 2, 2]])
def test_kvr_last_cache_is_joined_where_the_hops_left_it(models, prompt, oracle, partition):
  """KV-Runahead's last hop already carried every earlier position to the last rank: its
  cache="last" is joined there from that message and its own part, with no device-to-device
  transfer at all (any copy between devices, explicit or not, raises under the guard). The
  peers' parts have to move: the same guard stops their move."""
  model, ref = models["gqa"], oracle["gqa"]
  mesh = kvr_jax.make_mesh(len(partition))
  plan = plan_prefill(model, prompt, strategy="kvr", mesh=mesh, partition=partition)
  deferred = run_prefill(model, plan, prompt, move_cache=False)
  L, B, C, K, H = ref.k_cache.shape
  assert deferred.past.last_hop.shape == (len(partition), L, 2, B * (C - partition[-1]), K, H)
  with jax.transfer_guard_device_to_device("disallow_explicit"):
    k, v = deferred.gather_cache()
    ring = run(model, prompt, "ring", 2, None, "sharded")
    with pytest.raises(Exception, match="[Dd]isallowed"):
      jax.block_until_ready(ring.gather_cache())
  assert_close(k, ref.k_cache, "K cache")
  assert_close(v, ref.v_cache, "V cache")
  assert k.sharding.device_set == {mesh.devices.reshape(-1)[-1]}


@pytest.mark.default_cases("partition0")
@pytest.mark.parametrize("partition", [[20, 9], [8, 5, 4, 3, 3, 2, 2, 2]])
def test_kvr_last_moves_where_the_join_does_not_fit(models, prompt, oracle, partition, monkeypatch):
  """On a device too small for the join's zeros on the other ranks (here: pretended, 64 KiB),
  one process moves the parts instead (real rows only), and the cache is the same."""
  monkeypatch.setattr(prefill_plan, "device_memory_bytes", lambda device: 64 * 1024)
  model, ref = models["gqa"], oracle["gqa"]
  mesh = kvr_jax.make_mesh(len(partition))
  kwargs = dict(strategy="kvr", mesh=mesh, partition=partition, cache="last")
  assert not plan_prefill(model, prompt, **kwargs).keep_last_hop
  last = kvr_jax.prefill(model, prompt, **kwargs)
  assert last.moved  # the parts, not the last hop
  assert_close(last.k_cache, ref.k_cache, "K cache")
  assert_close(last.v_cache, ref.v_cache, "V cache")
  assert last.k_cache.sharding.device_set == {mesh.devices.reshape(-1)[-1]}


def test_where_each_prompt_position_lies_hand_worked():
  """A strategy's CacheLayout says where each prompt position lies, for every kind of past:
  ring on 10 tokens over 2 ranks (zigzag chunks of 3: rank 0 holds chunks 0 and 3, of which
  only position 9 is real; rank 1 chunks 1 and 2), TSP over 3 ranks (shards of 4)."""
  ring = kvr_jax.strategies.get_strategy("ring")
  layout = ring.cache_layout(10, ring.layout(10, 2, None))
  assert layout.positions().tolist() == [[0, 1, 2, 9, -1, -1], [3, 4, 5, 6, 7, 8]]
  assert layout.holder(9) == (0, 3) and layout.holder(3) == (1, 0)
  # The parts rank after rank (rank 1's rows from 6): position 3 is rank 1's row 0.
  assert layout.rows_in_prompt_order().tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 11, 3]
  tsp = kvr_jax.strategies.get_strategy("tsp")
  layout = tsp.cache_layout(10, tsp.layout(10, 3, None))
  assert layout.positions().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -1, -1]]
  assert layout.holder(9) == (2, 1)
  assert layout.rows_in_prompt_order().tolist() == list(range(10))
  with pytest.raises(ValueError, match="outside the prompt of 10 tokens"):
    layout.holder(10)


def test_join_affordable_hand_worked():
  """Llama-3.1-8B (32 layers, 8 KV heads x 128) at 131,072 tokens on 8 even ranks in float32:
  the last hop is 7/8 of the prompt, 32 * 2 * 114,688 * 8 * 128 * 4 bytes = 28 GiB on every
  rank, over a sixteenth of an 80 GB GPU: the parts move (in one process or across: the
  move across processes no longer allocates the whole cache on every rank). A hop 10,000
  times smaller joins."""
  config = preset_config("llama-3.1-8b")
  chunks = (16384,) * 8
  hop = kv_cache.last_hop_bytes(config, chunks, 1, 4, config.num_kv_heads)
  assert hop == 32 * 2 * 114688 * 8 * 128 * 4
  assert not kv_cache.join_affordable(hop, device_memory=80 * 10**9)
  assert kv_cache.join_affordable(hop // 10**4, device_memory=80 * 10**9)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_kvr_last_outputs_no_prompt_long_zeros_where_the_join_does_not_fit():
  """XLA's analysis (shapes only): planned for a small device (1 MiB), KV-Runahead's
  cache="last" program at 8 ranks outputs a rank's part and nothing prompt-long (its parts
  move); where the join fits, its outputs hold the last hop too (part + hop >= the cache)."""
  cfg = preset_config("tiny-llama")
  logits_bytes = cfg.vocab_size * 4
  small = 2**20
  eight = compiled_memory(
    cfg, "kvr", context_len=MEMORY_CONTEXT, num_ranks=8, cache="last", device_memory=small
  )
  assert not eight["joins_last_hop"]
  part = eight["kv_cache_bytes"] * max(eight["chunks"]) / MEMORY_CONTEXT  # the longest chunk's
  assert eight["output_bytes"] <= 1.05 * part + logits_bytes, eight
  two = compiled_memory(
    cfg, "kvr", context_len=MEMORY_CONTEXT, num_ranks=2, cache="last", partition="even"
  )
  assert two["joins_last_hop"]
  assert two["output_bytes"] >= two["kv_cache_bytes"], two  # part + last hop: the whole cache


def test_kvr_joins_its_last_hop_on_windowed_layers(models, prompt, oracle, monkeypatch):
  """A window shorter than the prefix cuts the last hop to its last W-1 keys: the last rank
  still joins what it holds (no move), whole from S_{p-2} - W + 1 on (every key a query from
  the prompt's end sees) and zeros before; decode from it gives single's greedy tokens. With
  a padded row that ends before the last chunk (its window lies before the hop) that run's
  parts move; padded rows that all reach into the last chunk still join."""
  mesh, model = kvr_jax.make_mesh(2), models["window"]
  kwargs = dict(strategy="kvr", mesh=mesh, partition=[20, 9], cache="last")
  assert plan_prefill(model, prompt, **kwargs).keep_last_hop
  last = kvr_jax.prefill(model, prompt, **kwargs)
  kept = 20 - WINDOW + 1
  ref = oracle["window"]
  for got, want in ((last.k_cache, ref.k_cache), (last.v_cache, ref.v_cache)):
    assert_close(got[:, :, kept:], want[:, :, kept:], "the kept positions")
    np.testing.assert_array_equal(got[:, :, :kept], 0)
  greedy = kvr_jax.generate(model, prompt, 3 * WINDOW, **kwargs).tokens
  want = kvr_jax.generate(model, prompt, 3 * WINDOW, cache="last").tokens
  np.testing.assert_array_equal(greedy, want)
  ragged = [prompt[0], prompt[1, :20]]  # row 1 ends where the last chunk starts: its window
  # [20 - W, 20) begins one key before what the hop carries [21 - W, 20)
  assert plan_prefill(model, ragged, **kwargs).keep_last_hop  # decided per run
  moved = kvr_jax.prefill(model, ragged, **kwargs)
  reference = kvr_jax.prefill(model, ragged)
  assert_close(moved.k_cache, reference.k_cache, "K cache")
  np.testing.assert_array_equal(
    kvr_jax.generate(model, ragged, 3 * WINDOW, **kwargs).tokens,
    kvr_jax.generate(model, ragged, 3 * WINDOW, cache="last").tokens,
  )
  # Row 1 ends at 24, inside the last chunk [20, 29): the hop and the chunk hold its window,
  # so the padded run joins with nothing moved, and decodes single's tokens.
  reaching = [prompt[0], prompt[1, :24]]

  def no_move(*args, **kwargs):
    raise AssertionError("the hop holds every row's window: nothing moves")

  want_tokens = kvr_jax.generate(model, reaching, 3 * WINDOW, cache="last").tokens
  want_logits = kvr_jax.prefill(model, reaching).logits
  monkeypatch.setattr(kv_cache, "gather_on_last_rank", no_move)
  monkeypatch.setattr(kv_cache, "send_onto_last_rank", no_move)
  monkeypatch.setattr(sharded_decode, "sharded_rings_program", no_move)
  joined = kvr_jax.prefill(model, reaching, **kwargs)
  assert_close(joined.logits, want_logits, "a padded row's logits")
  np.testing.assert_array_equal(
    kvr_jax.generate(model, reaching, 3 * WINDOW, **kwargs).tokens, want_tokens
  )


def test_cache_layout_refused_before_compiling(models, prompt):
  with pytest.raises(ValueError, match="unknown cache layout 'rank0'"):
    kvr_jax.prefill(models["gqa"], prompt, strategy="kvr", cache="rank0")
  with pytest.raises(ValueError, match="unknown cache layout"):
    kvr_jax.generate(models["gqa"], prompt, 2, cache=None)


NEW_TOKENS = 5
# (model, strategy, p, partition): the windowed case has chunks longer and shorter than the
# window, so rank 0's part lies wholly before the window of every decoded token.
DECODE_CASES = [
  ("gqa", "kvr", 3, [14, 9, 6]),
  ("gqa", "ring", 4, None),
  ("mqa", "kvr", 4, [12, 8, 5, 4]),
  ("mqa", "tsp", 8, None),
  ("window", "kvr", 3, [17, 8, 4]),
  ("window", "allgather", 2, None),
]


def single_decode_logits(model, ref, tokens):
  """The single-device decode's logits after feeding `tokens` (teacher forcing)."""
  grow = ((0, 0), (0, 0), (0, len(tokens)), (0, 0), (0, 0))
  k, v = (jax.device_put(np.pad(np.asarray(c), grow), ref.device) for c in ref.gather_cache())
  state = model.state_on(ref.device)
  out = []
  for i, token in enumerate(tokens):
    token = jax.device_put(token, ref.device)
    logits, k, v = decode.decode_step(model.graphdef, state, token, ref.prompt_len + i, k, v)
    out.append(np.asarray(logits))
  return out


@pytest.mark.default_cases("gqa-kvr-3-partition0")
@pytest.mark.parametrize("name,strategy,p,partition", DECODE_CASES)
def test_sharded_decode_matches_single(models, prompt, oracle, name, strategy, p, partition):
  model, ref = models[name], oracle[name]
  # Windowed: more tokens decoded than the window holds, so the last steps' windows drop
  # decoded tokens as well as prompt positions.
  new_tokens = WINDOW + 3 if name == "window" else NEW_TOKENS
  if name == "window" and partition is not None:
    # The case's point: rank 0's part lies wholly before the first decoded token's window.
    assert model.config.sliding_window == WINDOW and partition[0] < CONTEXT - WINDOW + 1
  single = kvr_jax.generate(model, prompt, new_tokens)
  kwargs = {"partition": partition} if partition is not None else {}
  mesh = kvr_jax.make_mesh(p)
  got = kvr_jax.generate(
    model, prompt, new_tokens, strategy=strategy, mesh=mesh, cache="sharded", **kwargs
  )
  assert got.prefill.cache == "sharded" and isinstance(got.prefill.past, KVParts)
  np.testing.assert_array_equal(got.tokens, single.tokens)
  # Step by step, the same tokens fed to both: every step's logits within tolerance.
  tokens = [np.asarray(t, np.int32) for t in single.tokens.T[:-1]]
  want = single_decode_logits(model, ref, tokens)
  L_f, K, H = got.prefill.past.kv_parts.shape[1], *got.prefill.past.kv_parts.shape[4:]
  # A window shorter than the prompt keeps its ring only: no layer left in the parts.
  kept = got.prefill.past.kept or decode.DecodeLayout.whole(L_f)
  windowed = name == "window"
  assert kept.rings == ((WINDOW,) if windowed else (None,))
  assert L_f == (0 if windowed else model.config.num_layers)
  program = sharded_decode.sharded_decode_program(
    model.graphdef, mesh, got.prefill.cache_layout, kept
  )
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  state = model.state_on(replicated)
  B = prompt.shape[0]
  tail = jax.numpy.zeros((L_f, 2, B, len(tokens), K, H), device=replicated)
  caches = jax.tree.map(jax.numpy.copy, got.prefill.past.rings[0]) if windowed else tail
  prompt_lens = jax.device_put(np.full(B, ref.prompt_len, np.int32), replicated)
  for i, token in enumerate(tokens):
    token = jax.device_put(token, replicated)
    logits, (caches,) = program(state, token, prompt_lens, got.prefill.past.kv_parts, (caches,), i)
    assert_close(logits, want[i], f"{name} {strategy} decode step {i}")


# --- XLA's memory analysis: outputs are each rank's share, not a prompt-long copy ----------

MEMORY_CONTEXT = 1024


class _MemoryFigures(dict):
  """(strategy, p, L) -> compiled_memory of tiny-llama at C=1024 with L layers on p ranks,
  compiled the first time it is asked for (a test compiles only its own strategy's)."""

  def __missing__(self, key):
    strategy, p, layers = key
    shaped = dataclasses.replace(preset_config("tiny-llama"), num_layers=layers)
    self[key] = compiled_memory(
      shaped, strategy, context_len=MEMORY_CONTEXT, num_ranks=p, partition="even", cache="sharded"
    )
    return self[key]


@pytest.fixture(scope="module")
def memory():
  return _MemoryFigures()


@pytest.mark.default_cases("kvr")
@pytest.mark.parametrize("strategy", ["kvr", "tsp", "ring", "allgather"])
def test_outputs_shrink_with_ranks(memory, strategy):
  """A rank's outputs are its share of the cache (about C/p tokens) plus the logits: a
  quarter at 8 ranks of what they are at 2. A prompt-long cache output per rank would keep
  them constant."""
  logits_bytes = preset_config("tiny-llama").vocab_size * 4
  for p in (2, 8):
    got = memory[strategy, p, 4]
    cache_share = got["kv_cache_bytes"] / p
    assert got["output_bytes"] <= 1.05 * cache_share + logits_bytes, (p, got)
    assert got["output_bytes"] >= cache_share, (p, got)  # it does return its share


@pytest.mark.default_cases("kvr")
@pytest.mark.parametrize("strategy", ["kvr", "tsp", "ring", "allgather"])
def test_no_stacked_temporary(memory, strategy):
  """Temporaries do not grow with the layers: four more layers add four layers of parts to
  the outputs and (almost) nothing to the temporaries. A layer-stacked temporary, of the parts
  (a copy of the output) or of a prompt-long cache, would add at least as much again."""
  short, deep = memory[strategy, 2, 4], memory[strategy, 2, 8]
  output_growth = deep["output_bytes"] - short["output_bytes"]
  assert output_growth >= 4 * short["kv_cache_bytes"] / 4 / 2  # 4 layers of a half-prompt part
  assert deep["temp_bytes"] - short["temp_bytes"] < 0.25 * output_growth, (short, deep)


@pytest.mark.default_cases("mqa")
@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_finish_in_row_blocks_equals_whole(models, name):
  """Block.finish over token blocks (what bounds a long chunk's MLP memory) is the same maths
  as over the whole chunk: 23 tokens in blocks of at most 5 (five blocks, two padded rows)."""
  model = nnx.merge(models[name].graphdef, models[name].state_on(jax.devices()[0]))
  cfg = model.config
  rng = np.random.RandomState(0)
  x_BTD = jax.numpy.asarray(rng.randn(2, 23, cfg.d_model), jax.numpy.float32)
  attn_BTNH = jax.numpy.asarray(rng.randn(2, 23, cfg.num_heads, cfg.head_dim), jax.numpy.float32)

  def both(block, _, carry):
    return carry, (
      block.finish(x_BTD, attn_BTNH, row_block=5),
      block.finish(x_BTD, attn_BTNH, None),
    )

  _, (blocked, whole) = jax.jit(lambda: scan_layers(model, both, 0))()
  assert_close(blocked, whole, "finish in row blocks")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_memory_report_refuses_what_prefill_refuses_with_the_same_error():
  """compiled_memory: a partition for a strategy that lays the prompt out itself is refused
  (not ignored); numpy integers are integers; a user's mistake is the same ValueError
  whether the report runs here or re-runs itself on 16 emulated devices."""
  with pytest.raises(ValueError, match="lays the prompt out itself"):
    compiled_memory("tiny-llama", "ring", context_len=256, num_ranks=2, partition=[128, 128])
  got = compiled_memory(
    "tiny-llama", "kvr", context_len=64, num_ranks=16, partition=np.full(16, 4, np.int64)
  )
  assert got["chunks"] == [4] * 16
  for ranks in (2, 16):  # in this process, and in a subprocess
    with pytest.raises(ValueError, match="sums to"):
      compiled_memory("tiny-llama", "kvr", context_len=64, num_ranks=ranks, partition=[1] * ranks)


def test_numpy_partition_with_buckets_names_the_bucket(models):
  """A partition of numpy integers is summed like one of ints: the error names the bucket."""
  tokens = np.arange(100)[None] % 64
  with pytest.raises(ValueError, match="sums to 100, but the prompt runs padded to its bucket"):
    kvr_jax.prefill(
      models["gqa"],
      tokens,
      "kvr",
      mesh=kvr_jax.make_mesh(2),
      partition=np.array([60, 40]),
      buckets="auto",
    )


def test_the_layout_chooser_on_hand_worked_memory():
  """cache="auto": the whole cache on the last rank only while weights + cache fit within
  WHOLE_CACHE_SHARE (0.8) of its device; Llama-3.1-8B in bfloat16 on an 80 GB GPU: at 128k
  tokens 16 GiB of cache beside 16 GB of weights ("last"), at 1M tokens 128 GiB ("sharded")."""
  assert kv_cache.WHOLE_CACHE_SHARE == 0.8
  assert kv_cache.choose_cache_layout(50, 30, 100) == "last"  # 80 <= 80
  assert kv_cache.choose_cache_layout(51, 30, 100) == "sharded"
  config = preset_config("llama-3.1-8b")  # 32 layers, 8 KV heads of 128
  weights = config.num_params() * 2
  at_128k = kv_cache.whole_cache_bytes(config, 131072, 1, 2)
  at_1m = kv_cache.whole_cache_bytes(config, 1048576, 1, 2)
  assert (at_128k, at_1m) == (16 * 2**30, 128 * 2**30)
  assert kv_cache.choose_cache_layout(at_128k, weights, 80e9) == "last"
  assert kv_cache.choose_cache_layout(at_1m, weights, 80e9) == "sharded"
  # A window shorter than the prompt keeps its ring only: Gemma-3-27B (62 layers: 10 full, 52
  # windowed at 1024; 16 KV heads of 128) at 128k holds 10 x 131072 + 52 x 1024 positions of
  # 8 KiB (K and V, bfloat16): 10.4 GiB, not 62 GiB, so it fits "last" on a 141 GB H200.
  gemma = preset_config("gemma-3-27b")
  at_128k = kv_cache.whole_cache_bytes(gemma, 131072, 1, 2)
  assert at_128k == (10 * 131072 + 52 * 1024) * 8192
  assert kv_cache.choose_cache_layout(at_128k, gemma.num_params() * 2, 141e9) == "last"
  # A latent per position: DeepSeek-V3 (61 layers, 512 latent + 64 rope numbers) at 128k
  # holds 61 x 131072 x 576 bfloat16 numbers, 8.6 GiB (K,V of its 128 heads would be 71x).
  latent = preset_config("deepseek-v3")
  assert kv_cache.whole_cache_bytes(latent, 131072, 1, 2) == 61 * 131072 * 576 * 2
  # A linear layer's past does not grow with the prompt: Qwen3-Next-80B (12 full layers of 2
  # KV heads of 256; 36 Gated DeltaNet layers, 32 value heads of a 128 x 128 float32 state
  # and a 3-row halo of 8192 channels) at 128k: 3 GiB of K,V and 74 MiB of linear pasts;
  # on a model group of 2 each device holds half of both.
  hybrid = preset_config("qwen3-next-80b-a3b")
  kv, linear = 12 * 2 * 131072 * 2 * 256 * 2, 36 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)
  assert kv_cache.whole_cache_bytes(hybrid, 131072, 1, 2) == kv + linear
  assert kv_cache.whole_cache_bytes(hybrid, 131072, 1, 2, shards=2) == (kv + linear) // 2


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_auto_cache_keeps_the_parts_when_the_last_device_cannot_hold_them(monkeypatch):
  """A tiny model fits: cache="auto" is "last". With the last device's memory made smaller
  than the weights and the cache, it is "sharded" (also by default: "auto" is the default),
  and decode from it gives single's tokens."""
  model = kvr_jax.load_model("tiny-llama")
  tokens = np.random.RandomState(2).randint(0, 512, (1, 40))
  mesh = kvr_jax.make_mesh(2)
  kw = dict(strategy="kvr", mesh=mesh, partition=[24, 16], cache="auto")
  assert isinstance(kvr_jax.prefill(model, tokens, **kw).past, KVWhole)
  weights = model.config.num_params() * 4
  monkeypatch.setattr(auto_module, "device_memory_bytes", lambda device: weights)
  assert isinstance(kvr_jax.prefill(model, tokens, **kw).past, KVParts)
  del kw["cache"]  # "auto" is the default
  assert isinstance(kvr_jax.prefill(model, tokens, **kw).past, KVParts)
  got = kvr_jax.generate(model, tokens, 5, **kw).tokens
  np.testing.assert_array_equal(got, kvr_jax.generate(model, tokens, 5).tokens)


def test_compiled_memory_reports_each_layouts_decode_step():  # 2 s: in the default tier
  """decode_tokens: XLA's analysis of one decode step of each layout, by hand. cache="last":
  the last rank's device takes the weights and the whole K and V caches grown by the new
  tokens; cache="sharded": every device takes the weights, its part and the new tokens' K,V
  (the tail), so it holds about half the cache here; the scalars are tokens, positions and
  the step's index (int32)."""
  cfg = preset_config("tiny-llama")
  L, K, H, B, C, M = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, 512, 32
  kw = dict(context_len=C, num_ranks=2, partition=[256, 256], decode_tokens=M)
  last = compiled_memory(cfg, "kvr", cache="last", **kw)
  sharded = compiled_memory(cfg, "kvr", cache="sharded", **kw)
  weights = last["weights_bytes"]
  grown_cache = 2 * L * B * (C + M) * K * H * 4
  assert last["decode_argument_bytes"] == weights + grown_cache + 2 * 4 * B
  part = L * 2 * B * 256 * K * H * 4
  tail = L * 2 * B * M * K * H * 4
  assert sharded["decode_argument_bytes"] == weights + part + tail + 2 * 4 * B + 4
  assert "decode_temp_bytes" in last and "decode_output_bytes" in sharded
  with pytest.raises(ValueError, match="decode_tokens=-1"):
    compiled_memory(cfg, "kvr", cache="sharded", **{**kw, "decode_tokens": -1})


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_decode_steps_write_the_cache_where_it_lies():
  """Both decode steps carry the cache (the tail) through the layers and write the new token
  by index: their temporaries do not grow with the layers (before: the whole-cache step
  restacked the cache, 6.7 MB at 4 layers to 19.7 MB at 16 here), and the whole-cache step's
  are under two of one layer's K,V (one layer's K,V plus the step's activations)."""
  C, M = 2048, 64
  temps = {}
  for L in (4, 16):
    cfg = dataclasses.replace(preset_config("tiny-llama"), num_layers=L)
    for cache in ("last", "sharded"):
      kw = dict(context_len=C, num_ranks=2, cache=cache, decode_tokens=M)
      temps[L, cache] = compiled_memory(cfg, "kvr", **kw)["decode_temp_bytes"]
  assert temps[16, "last"] == temps[4, "last"] and temps[16, "sharded"] == temps[4, "sharded"]
  cfg = preset_config("tiny-llama")
  one_layer_kv = 2 * (C + M) * cfg.num_kv_heads * cfg.head_dim * 4
  assert temps[4, "last"] < 2 * one_layer_kv, (temps, one_layer_kv)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_low_precision_figures_hold_no_float32_copy_of_every_layer():
  """XLA:CPU converts bfloat16 weights to float32 and would hoist every layer's copy out of
  the layer loop (a GPU makes none): the bfloat16 program's temporaries exceed its float32
  twin's by at most one layer's float32 weights (here 145 MB before, 23.7 against 18.0 + 15.2
  after), and the report says how it was compiled."""
  cfg = dataclasses.replace(
    preset_config("tiny-llama"),
    d_model=512,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    mlp_dim=2048,
    num_layers=8,
  )
  kw = dict(context_len=256, num_ranks=2, cache="sharded")
  f32 = compiled_memory(cfg, "kvr", dtype="float32", **kw)
  bf16 = compiled_memory(cfg, "kvr", dtype="bfloat16", **kw)
  D, F = cfg.d_model, cfg.mlp_dim
  one_layer_f32 = (cfg.attention_params() + cfg.mlp_matrices * D * F + 2 * D) * 4
  assert bf16["temp_bytes"] <= f32["temp_bytes"] + one_layer_f32, (bf16, f32, one_layer_f32)
  assert "while-loop-invariant code motion" in bf16["cpu_compile"]
  assert "cpu_compile" not in f32
