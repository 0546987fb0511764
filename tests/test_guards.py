"""Guards for mechanisms that no other test held: each test below was watched failing
with its mechanism broken on purpose.

Also one-line refusals: kernel records that cannot claim what their maths does
not do, configs typed and (for checkpoints) complete, a plan that is not a plan, an envelope
longer than the prompt, and a lost peer reported in one line.
"""

import dataclasses
import json
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvr_jax
from kvr_jax.core import caches
from kvr_jax.inference import auto as auto_lib
from kvr_jax.inference.prefill import plan_prefill, run_prefill
from kvr_jax.inference.shape import PrefillShape
from kvr_jax.planning import costmodel, presets, search
from kvr_jax.runtime import faults
from kvr_jax.runtime.loading import preset_config
from kvr_jax.runtime.model import build_model
from kvr_jax.runtime.roofline import Compute, ModelledLayer, Receive, Send
from kvr_jax.strategies import runahead
from kvr_jax.tools import measured
from kvr_jax.tools.memory import compiled_memory
from models.attention import merge_partials
from models.experts import mixture_of_experts
from models.families import config_from_dict
from models.kernels import KERNELS, AttentionKernel, get_kernel
from tests.subprocess_env import launcher_env
from tests.tolerance import assert_close

# --- kernel records that cannot lie ---------------------------------------------------------


@pytest.mark.parametrize(
  "make,field",
  [
    (lambda: dataclasses.replace(KERNELS["fused"], takes_window=True), "takes_window"),
    (lambda: dataclasses.replace(KERNELS["dense"], returns_lse=True), "returns_lse"),
    (lambda: dataclasses.replace(KERNELS["blocked"], lengths_as_data=True), "lengths_as_data"),
    (lambda: AttentionKernel("mine", "sparse"), "computes"),
    (lambda: AttentionKernel("mine", "dense", implementation="triton"), "implementation"),
    (lambda: AttentionKernel("mine", "flash", implementation="cudnn"), "computes"),
    (lambda: AttentionKernel("mine", "two-piece", "cudnn", platforms=("cpu",)), "platforms"),
    (lambda: AttentionKernel("mine", "dense", query_block=64), "query_block"),
    *[
      (lambda b=bad: dataclasses.replace(KERNELS["flash"], query_block=b), "query_block")
      for bad in (0, -64, 64.0, "64", True)
    ],
    (lambda: dataclasses.replace(KERNELS["blocked"], query_block=0), "query_block"),
    (lambda: dataclasses.replace(KERNELS["flash"], key_block=-1), "key_block"),
  ],
)
def test_a_kernel_record_that_claims_what_its_maths_does_not_is_refused(make, field):
  with pytest.raises(ValueError, match=f"`{field}`"):
    make()


def test_a_kernel_records_capabilities_follow_from_what_it_computes():
  mine = AttentionKernel("mine", "flash")
  assert (mine.takes_window, mine.returns_lse, mine.lengths_as_data) == (True, True, True)
  assert (mine.query_block, mine.key_block) == (512, 512)  # the flash way's defaults
  assert not AttentionKernel("mine", "two-piece").takes_window
  assert KERNELS["cudnn"].platforms == ("gpu",) and KERNELS["dense"].dtypes is None
  # What the memory tool sends to its subprocess (every field) builds the same record.
  for kernel in KERNELS.values():
    assert AttentionKernel(**json.loads(json.dumps(dataclasses.asdict(kernel)))) == kernel


# --- configs from dicts: typed, and whole for a checkpoint ------------------------------------


@pytest.mark.parametrize(
  "edit,field",
  [
    (lambda d: d.update(local_rope="10000"), "local_rope"),
    (lambda d: d["rope"].update(theta="1e4"), "theta"),
    (lambda d: d.update(layer_windows=[4, "a", None, None]), "layer_windows"),
    (lambda d: d.update(tie_embeddings="true"), "tie_embeddings"),
    (lambda d: d.update(num_layers=2.0), "num_layers"),
  ],
)
def test_an_ill_typed_config_field_is_refused_by_name(edit, field):
  data = json.loads(json.dumps(preset_config("tiny-gemma").to_dict()))
  edit(data)
  with pytest.raises(ValueError, match=f"`{field}`"):
    config_from_dict(data)


def test_a_saved_config_must_be_whole(tmp_path):
  """A hand-edited kvr_config.json without `layer_windows` would load every layer windowless
  (1.66 relative on every logit): refused naming the field; the saved file is whole."""
  model = kvr_jax.load_model("tiny-gemma")
  kvr_jax.save_model(model, str(tmp_path))
  path = tmp_path / "kvr_config.json"
  meta = json.loads(path.read_text())
  assert config_from_dict(meta["config"], complete=True) == model.config
  del meta["config"]["layer_windows"]
  path.write_text(json.dumps(meta))
  with pytest.raises(ValueError, match="layer_windows"):
    kvr_jax.load_model(str(tmp_path))
  meta["config"]["layer_windows"] = list(model.config.layer_windows)
  meta["config"]["local_rope"] = "10000"
  path.write_text(json.dumps(meta))
  with pytest.raises(ValueError, match="local_rope"):
    kvr_jax.load_model(str(tmp_path))


# --- refusals before anything compiles or allocates ------------------------------------------


def test_run_prefill_refuses_what_is_not_a_plan():
  model = kvr_jax.load_model("tiny-llama")
  with pytest.raises(ValueError, match="PrefillPlan"):
    run_prefill(model, {"strategy": "kvr"}, np.zeros((1, 8), np.int32))


def test_an_envelope_longer_than_the_prompt_is_clamped_and_a_bad_one_refused():
  config, kernel = preset_config("tiny-llama"), get_kernel("flash")
  shape = runahead.OneBodyShape.envelope(config, (50, 50, 50), kernel, 1_000_000)
  assert shape.chunk_len <= 150 + shape.block and shape.buffer_len < 1000
  for longest, message in ((50.5, "integer"), (True, "integer"), (40, "shorter")):
    with pytest.raises(ValueError, match=message):
      runahead.OneBodyShape.envelope(config, (50, 50, 50), kernel, longest)


def test_the_memory_tool_compiles_the_model_group_decode_step():
  """KV-Runahead on a 2 x 2 mesh, cache="last", with decode: its step's cache sharding was a
  tuple, not a PartitionSpec (AttributeError inside jax)."""
  report = compiled_memory(
    preset_config("tiny-llama"),
    "kvr",
    context_len=128,
    num_ranks=2,
    model_parallel=2,
    cache="last",
    decode_tokens=8,
  )
  assert report["decode_temp_bytes"] > 0 and report["decode_argument_bytes"] > 0


def test_gather_cache_has_singles_shape_on_a_mesh_with_more_shards_than_kv_heads():
  """tiny-gemma has 2 KV heads; on make_mesh(2, model=4) each head is repeated on 2 shards:
  gather_cache() returns single's 2 heads (and values), both layouts."""
  model = kvr_jax.load_model("tiny-gemma")
  tokens = np.random.RandomState(3).randint(0, model.config.vocab_size, (1, 64))
  want = kvr_jax.prefill(model, tokens)
  mesh = kvr_jax.make_mesh(2, model=4)
  for cache in ("sharded", "last"):
    k, v = kvr_jax.prefill(model, tokens, "kvr", mesh, cache=cache).gather_cache()
    assert k.shape == want.k_cache.shape, cache
    assert_close(k, want.k_cache, f"{cache} k")
    assert_close(v, want.v_cache, f"{cache} v")


LOST_PEER = """
import jax
from kvr_jax.runtime import distributed, faults

class JaxRuntimeError(RuntimeError):
  pass

with faults.worker_failures():
  with faults.stage("decode kvr, cache=sharded"):
    raise JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: Read error: Connection reset by peer")
"""


@pytest.mark.serial  # waits on timeouts or times a span: run alone
@pytest.mark.e2e  # a launched cluster
def test_a_lost_peer_is_one_line_naming_the_step_and_a_non_zero_status():
  """What a survivor of a killed process prints (measured by hand on a two-process cluster,
  process 1 killed mid-decode: the same line): one line, the step, status 4; an error that
  is not a lost peer keeps its traceback and status 1."""
  env = {**launcher_env(), "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(
    [sys.executable, "-c", LOST_PEER], env=env, capture_output=True, text=True, check=False
  )
  assert done.returncode == faults.EXIT_PEER_LOST, done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1, done.stderr
  assert "process 0: lost" in lines[0] and "during decode kvr, cache=sharded" in lines[0]
  other = LOST_PEER.replace("Gloo all-reduce failed: Read error: Connection reset by peer", "oops")
  done = subprocess.run(
    [sys.executable, "-c", other], env=env, capture_output=True, text=True, check=False
  )
  assert done.returncode == faults.EXIT_JOB_FAILED and "Traceback" in done.stderr


# --- the twelve mechanisms --------------------------------------------------------------------

# 1, 2: the one program's hops cut at the row block (four ranks of 150 tokens), and its buffer
# rounded to the block granule (eight ranks of 130 tokens, a one-token last rank).
ONE_PROGRAM_SPLITS = {
  4: [(40, 30, 50, 30), (1, 1, 1, 147), (100, 20, 20, 10)],
  8: [(18, 18, 18, 18, 19, 19, 19, 1)],
}


@pytest.mark.default_cases("8")
@pytest.mark.parametrize("num_ranks", sorted(ONE_PROGRAM_SPLITS))
def test_the_one_program_hops_and_buffer_hold_every_split(num_ranks):
  model = kvr_jax.load_model("tiny-llama")
  splits = ONE_PROGRAM_SPLITS[num_ranks]
  tokens = np.random.RandomState(7).randint(0, model.config.vocab_size, (1, sum(splits[0])))
  want = kvr_jax.prefill(model, tokens)
  longest = max(max(s) for s in splits)
  shape = runahead.OneBodyShape.envelope(model.config, splits[0], get_kernel("flash"), longest)
  strategy = runahead.split_as_data_strategy(model.config, shape)
  mesh = kvr_jax.make_mesh(num_ranks)
  for split in splits:
    got = kvr_jax.prefill(model, tokens, strategy=strategy, mesh=mesh, partition=list(split))
    assert_close(got.logits, want.logits, f"{split} logits")
    assert_close(got.k_cache, want.k_cache, f"{split} k cache")


def test_a_splits_modelled_ttft_does_not_depend_on_what_was_weighed_before():
  """3: the kept rank work is keyed by all that makes it (its early rows come from the whole
  split): (2400, 600, 1096) weighs the same fresh and after (2000, 1000, 1096), where bench-
  llama's last rank has the same chunk and keys but 1000 early rows against 832."""
  config = preset_config("bench-llama")
  assert (
    runahead.rows_before_hop(config, (2400, 600, 1096))[2]
    != (runahead.rows_before_hop(config, (2000, 1000, 1096))[2])
  )
  # The flash kernel's setup: ranks attend their diagonal's early rows before the hop.
  setup = presets.make_setup(
    "a100-80gb", "10GBps", dtype_bytes=2, scores_in_memory=False, causal_skip=True
  )
  assert setup.diagonal_first

  def ttft(split):
    return costmodel.simulate(config, "kvr", 4096, setup, num_ranks=3, partition=split).ttft

  caches.clear_caches()
  fresh = ttft((2400, 600, 1096))
  caches.clear_caches()
  ttft((2000, 1000, 1096))
  assert ttft((2400, 600, 1096)) == fresh


def test_gemmas_embedding_scale_is_rounded_to_the_weights_dtype():
  """5: transformers multiplies by sqrt(D) cast to the weights' dtype: in bfloat16 at D = 128
  (sqrt = 11.3137 -> 11.3125) the unrounded scale changes about 3% of the values."""
  config = dataclasses.replace(
    preset_config("tiny-gemma"), d_model=128, num_heads=2, num_kv_heads=1, head_dim=64
  )
  model = build_model(config, "bfloat16", seed=0)
  tokens = jnp.arange(64, dtype=jnp.int32)[None] % config.vocab_size
  got = model.embed(tokens)
  rows = model.embedding[...][tokens]
  want = rows * jnp.asarray(np.sqrt(128.0), jnp.float32).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_the_routers_softmax_is_float32_under_bfloat16():
  """6: 64 experts, bfloat16 hidden states and router: the expert each token goes to is the
  float32 softmax's of the bfloat16 logits (a bfloat16 softmax ties and reroutes tokens)."""
  rng = np.random.RandomState(0)
  S, D, E, F = 2048, 64, 64, 8
  h = rng.randn(S, D)
  h[:, 0] = 1.0  # every expert's output below is its index times silu(1) * 1
  h = jnp.asarray(h, jnp.bfloat16)
  router = jnp.asarray(rng.randn(D, E) * 0.05, jnp.bfloat16).at[0].set(0)
  gate = jnp.zeros((E, D, F), jnp.bfloat16).at[:, 0, 0].set(1.0)
  up = jnp.zeros((E, D, F), jnp.bfloat16).at[:, 0, 0].set(1.0)
  down = jnp.zeros((E, F, D), jnp.bfloat16).at[:, 0, 0].set(jnp.arange(E, dtype=jnp.bfloat16))
  out = mixture_of_experts(h[None], router, gate, up, down, 1, True)[0]
  chosen = np.rint(np.asarray(out[:, 0], np.float32) / float(jax.nn.silu(1.0))).astype(int)
  logits = jnp.einsum("SD,DE->SE", h, router).astype(jnp.float32)
  want = np.asarray(jax.lax.top_k(jax.nn.softmax(logits, axis=-1), 1)[1][:, 0])
  assert (chosen != want).sum() == 0, f"{(chosen != want).sum()} of {S} tokens rerouted"


def test_merging_partials_shifts_by_their_max():
  """7: two partials at a log-sum-exp of 100 (e^100 overflows float32): exact, no NaN."""
  out1 = jnp.ones((1, 1, 1, 4), jnp.float32)
  out2 = 3 * jnp.ones((1, 1, 1, 4), jnp.float32)
  lse = jnp.full((1, 1, 1), 100.0, jnp.float32)
  out, merged = merge_partials(out1, lse, out2, lse)
  np.testing.assert_allclose(np.asarray(out), 2.0, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(merged), 100.0 + np.log(2.0), rtol=1e-6)


def test_the_cache_chooser_counts_one_shard_of_the_weights_on_a_2d_mesh(monkeypatch):
  """8: on a 2 x 4 mesh the last rank's device holds a quarter of the weights: with memory
  for that quarter and the cache, but not for the whole weights, cache="auto" is "last"."""
  model = kvr_jax.load_model("tiny-llama")
  mesh = kvr_jax.make_mesh(2, model=4)
  weights = model.config.num_params() * 4
  monkeypatch.setattr(auto_lib, "device_memory_bytes", lambda device: weights // 2)
  assert auto_lib.plan_cache(PrefillShape.of_model(model, [64], 64), mesh) == "last"


def test_a_padded_prompt_on_a_plan_made_unpadded_is_the_plans_refusal_on_a_2d_mesh():
  """9: the refusal, not jax's ShardingTypeError from inside the program."""
  model = kvr_jax.load_model("tiny-llama")
  mesh = kvr_jax.make_mesh(2, model=2)
  tokens = np.random.RandomState(1).randint(0, model.config.vocab_size, (2, 64))
  plan = plan_prefill(model, tokens, "kvr", mesh, buckets=None, cache="sharded")
  ragged = [tokens[0], tokens[1, :50]]
  with pytest.raises(ValueError, match="padded past their lengths"):
    run_prefill(model, plan, ragged)


def _two_rank_layer(rank1_first: float, rank1_rest: float) -> ModelledLayer:
  """Rank 0 computes 1 s and sends (no time in flight) to rank 1, which computes, waits for
  the message, and computes again."""
  steps = (
    (Compute("qkv", 1.0), Send(1, 0.0, "hop0")),
    (Compute("qkv", rank1_first), Receive(0), Compute("rest", rank1_rest)),
  )
  return ModelledLayer(steps, (1, 1), (0.0, 0.0), (0.0, 0.0))


def test_the_steady_state_skip_gives_the_timeline_it_skips():
  """10: a layer that advances every clock as the one before is skipped only when no max can
  change its winner. Here rank 1 starts 5 s behind (its first layer) and gains 9 ms a layer on
  rank 0 while its own work wins its wait: near layer 555 the message starts to win. The
  skipped timeline equals the one walked layer by layer (`intervals` turns the skip off)."""
  first, steady = _two_rank_layer(5.5, 0.0), _two_rank_layer(0.5, 0.491)
  layers_ = [first] + [steady] * 599
  skipped = costmodel.layer_timeline(layers_, 600)
  walked = costmodel.layer_timeline(layers_, 600, intervals=[])
  assert skipped == pytest.approx(walked, rel=1e-12)
  assert walked[1] > 599.0  # rank 1 was held to rank 0's pace at the end


def test_the_measured_descent_moves_to_the_fastest_neighbour_shown_faster():
  """11: three ranks, two neighbours shown faster: the descent takes the faster of them."""
  target = (28, 20, 48)
  bests = []

  def distance(chunks):
    return sum(abs(a - b) for a, b in zip(chunks, target, strict=True))

  def compare(best, candidates):
    bests.append((best, candidates))
    return [
      ("ahead" if distance(c) < distance(best) else "behind", distance(c)) for c in candidates
    ]

  assert search.descend_by_comparison(compare, 96, 3, first_step=8) == target
  (start, offered), (moved_to, _) = bests[0], bests[1]
  faster = [c for c in offered if distance(c) < distance(start)]
  assert len(faster) >= 2 and moved_to == min(faster, key=distance)


def test_a_candidate_just_past_the_first_batch_reuses_the_envelope():
  """12: at 8k the envelope reaches an eighth of the context past the first batch's longest
  chunk: a candidate one token longer runs on the same program."""
  handle = types.SimpleNamespace(config=preset_config("tiny-llama"))
  setup = {"program": runahead.SPLIT_AS_DATA, "kernel": "flash"}
  runs_on = measured._candidates_program(handle, None, setup)
  first_split = (2880, 2820, 2492)  # its longest chunk is a whole number of its blocks
  block = runahead.one_body_block(handle.config, first_split, get_kernel("flash"))
  assert first_split[0] % block == 0
  first = runs_on([first_split])
  assert runs_on([(2881, 2819, 2492)]) is first


def test_yarn_takes_its_pretraining_context_from_inside_rope_parameters(tmp_path):
  """4: YaRN's original_max_position_embeddings inside rope_parameters beats the model's
  max_position_embeddings (transformers' order): logits within 1e-4 of transformers."""
  import transformers

  from tests import hf_fixtures
  from tests.test_config_fidelity import MODEL_TOL, TOKENS, write_variant

  write_variant("llama-yarn", tmp_path)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path, attn_implementation="eager"
  )
  want = hf_fixtures.hf_logits(hf_model, TOKENS).astype(np.float64)
  ours = kvr_jax.load_model(str(tmp_path), dtype="float32")
  assert ours.config.rope.original_max_position_embeddings == 4
  got = np.asarray(ours.module(TOKENS), np.float64)
  assert np.abs(got - want).max() / np.abs(want).max() <= MODEL_TOL


def test_a_fixed_kernel_strategy_keeps_its_kernel_in_a_comparison():
  """TSP's dense kernel is part of its definition (Strategy.fixed_kernel): a comparison that
  names another kernel for every strategy leaves TSP's out; any other strategy refuses a kernel
  it does not run, by name."""
  from kvr_jax.inference.prefill import prefill_arguments

  assert prefill_arguments("tsp", attention="flash") == {"strategy": "tsp", "mesh": None}
  assert prefill_arguments("ring", attention="flash")["attention"] == "flash"
  with pytest.raises(ValueError, match="dense"):
    prefill_arguments("ring", attention="dense")
