"""kvr_jax.prefill / generate / decode_from on the models whose cache has its own form
(kvr_jax.inference.cache_form: hybrid.FORM, latent.FORM): a hybrid (Qwen3.5's Gated DeltaNet
and full layers) and a latent-attention model (DeepSeek-V3), under every strategy their
programs run, "auto", both meshes and both cache layouts, against the model's own one-device
forward (1e-5) and transformers' greedy and sampled tokens; and what is not built, refused
by name."""

import dataclasses
import functools
import inspect

import jax
import numpy as np
import pytest

import kvr_jax
from kvr_jax.inference import auto as auto_module
from kvr_jax.inference import decode, kv_cache
from kvr_jax.inference.cache_form import OwnParts, OwnWhole
from kvr_jax.inference.generate import decode_from
from kvr_jax.inference.prefill import plan_prefill
from kvr_jax.inference.prefill_plan import cache_form_of
from kvr_jax.strategies import base as strategies_base
from kvr_jax.strategies import runahead
from models.kernels import get_kernel
from models.layer_kinds import FULL_ATTENTION
from tests import hf_fixtures
from tests.tolerance import assert_close

T, NEW = 30, 5
HYBRID, LATENT = "qwen3_5-types", "deepseek-default"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """case -> (torch model, our loaded model): a hybrid whose layer_types are not the default
  pattern, and a latent model with q_lora, dense first layers and group routing."""
  hybrid = hf_fixtures.saved_checkpoints(hf_fixtures.make_qwen35_model, [HYBRID], tmp_path_factory)
  latent = hf_fixtures.saved_checkpoints(
    hf_fixtures.make_deepseek_model, [LATENT], tmp_path_factory
  )
  return {case: (hf, ours) for case, (hf, _, ours) in {**hybrid, **latent}.items()}


@pytest.fixture(scope="module")
def tokens():
  return np.random.RandomState(1).randint(0, hf_fixtures.VOCAB, (2, T))


@pytest.fixture(scope="module")
def oracle(models, tokens):
  """case -> (the last position's logits and the cache from the model's own forward on one
  device, transformers' greedy tokens), computed without kvr_jax.prefill."""
  out = {}
  for case, (hf_model, ours) in models.items():
    x_BTD, cache = jax.jit(lambda m, t: m.forward(t, "flash"))(ours.module, tokens)
    logits_BV = ours.module.logits(x_BTD[:, -1:])[:, 0]
    greedy = hf_fixtures.hf_greedy(hf_model, tokens, NEW)
    # No end-of-sequence token among them: generate would stop there, transformers does not.
    assert not np.isin(greedy, ours.config.eos_ids).any()
    out[case] = (logits_BV, cache, greedy)
  return out


def _assert_cache_close(case, got, want):
  if case == HYBRID:
    assert_close(got.kv_2BSKH, want.kv_2BSKH, "full layers' K,V")
    assert_close(got.linear.state_Bhkv, want.linear.state_Bhkv, "linear states")
    assert_close(got.linear.halo_BwC, want.linear.halo_BwC, "convolution halos")
  else:
    assert_close(got, want, "latents")


RUNS = [
  (HYBRID, "single", None, None, "auto"),
  (HYBRID, "kvr", (2, 1), [18, 12], "last"),
  (HYBRID, "ring", (2, 1), None, "auto"),
  (HYBRID, "allgather", (3, 1), None, "last"),
  (HYBRID, "kvr", (2, 2), "search", "auto"),
  (HYBRID, "single", (1, 2), None, "last"),
  (HYBRID, "kvr", (3, 1), [10, 12, 8], "sharded"),
  (HYBRID, "ring", (2, 2), None, "sharded"),
  (LATENT, "kvr", (2, 1), [18, 12], "last"),
  (LATENT, "kvr", (3, 1), [10, 12, 8], "sharded"),
  (LATENT, "tsp", (2, 1), None, "last"),
  (LATENT, "allgather", (2, 2), None, "auto"),
  (LATENT, "single", (1, 2), None, "sharded"),
]


@pytest.mark.default_cases("deepseek-default-tsp-shape10-None-last")
@pytest.mark.parametrize("case, strategy, shape, partition, cache", RUNS)
def test_generate_runs_hybrid_and_latent_models_as_one_device(
  models, tokens, oracle, case, strategy, shape, partition, cache
):
  """The same call as for any model: the prefill's logits within 1e-5 of the model's own
  one-device forward, its cache (cache="last") too, and transformers' greedy tokens decoded
  from it."""
  _, ours = models[case]
  mesh = None if shape is None else kvr_jax.make_mesh(shape[0], model=shape[1])
  out = kvr_jax.generate(
    ours, tokens, NEW, strategy=strategy, mesh=mesh, partition=partition, cache=cache
  )
  result = out.prefill
  # One result type: every prefill's is a PrefillResult, its past here in the model's form.
  assert type(result) is kvr_jax.PrefillResult and result.form is cache_form_of(ours.config)
  assert isinstance(result.past, OwnWhole if result.cache == "last" else OwnParts)
  for per_layer in (lambda: result.layer_cache(0), result.decode_cache):
    with pytest.raises(ValueError, match="not \\(K, V\\) per layer"):
      per_layer()
  assert (result.strategy, result.cache) == (strategy, "last" if cache == "auto" else cache)
  if isinstance(partition, list):
    assert result.partition == tuple(partition)
  want_logits, want_cache, want_tokens = oracle[case]
  assert_close(result.logits, want_logits, "last logits")
  np.testing.assert_array_equal(out.tokens, want_tokens)
  # generate's decode wrote into its prefill's cache; the same prefill again, for its cache
  # (the compiled program kept from generate's)
  result = kvr_jax.prefill(ours, tokens, strategy, mesh, partition, cache=cache)
  if result.cache == "last":
    _assert_cache_close(case, result.gather_cache(), want_cache)
    # What cache="auto" counts is what one device of the last rank's group holds.
    m = 1 if shape is None else shape[1]
    held = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(result.past.cache))
    itemsize = np.dtype(ours.dtype).itemsize
    assert held == kv_cache.whole_cache_bytes(
      ours.config, result.past.capacity, tokens.shape[0], itemsize, m
    )
  elif case == LATENT:  # each rank's part where it was computed, its rows at their positions
    parts, positions = np.asarray(result.past.parts), result.past.part_positions
    for rank in range(parts.shape[0]):
      rows = positions[rank] >= 0
      assert_close(
        parts[rank][:, :, rows], np.asarray(want_cache)[:, :, positions[rank][rows]], "part"
      )
    assert sorted(positions[positions >= 0].tolist()) == list(range(T))
  else:  # the full layers' K,V in each rank's part, every run at its prompt positions; the
    # linear pasts on every rank (split by head on a 2-D mesh: one device's order compared)
    kv = np.asarray(want_cache.kv_2BSKH)
    layout, B = result.cache_layout, tokens.shape[0]
    parts = np.asarray(result.past.parts)
    m = 1 if shape is None else shape[1]
    kv = np.repeat(kv, max(m // ours.config.num_kv_heads, 1), axis=-2)  # as the shards hold
    covered = []
    for rank, runs in enumerate(layout.segments):
      part = parts[rank].reshape(*parts.shape[1:3], B, layout.part_len, *parts.shape[4:])
      for position, length, row in runs:
        got = part[:, :, :, row : row + length]
        assert_close(got, kv[:, :, :, position : position + length], f"rank {rank}'s K,V")
        covered += range(position, position + length)
    assert sorted(covered) == list(range(T))
    linear = result.past.linear_state
    assert_close(linear.state_Bhkv, want_cache.linear.state_Bhkv, "linear states")
    if m == 1:
      assert_close(linear.halo_BwC, want_cache.linear.halo_BwC, "convolution halos")


@pytest.mark.parametrize("case", [HYBRID, LATENT])
def test_cache_auto_keeps_the_whole_cache_only_where_it_fits(
  models, tokens, oracle, case, monkeypatch
):
  """cache="auto" weighs each layer's past as the model's own forward holds it (the full
  layers' K,V and the linear layers' states and halos; the latents): "last" while the
  weights and the whole cache fit within WHOLE_CACHE_SHARE of the last rank's device,
  "sharded" when they do not."""
  _, ours = models[case]
  itemsize = np.dtype(ours.dtype).itemsize
  held = sum(a.nbytes for a in jax.tree.leaves(oracle[case][1]))
  assert kv_cache.whole_cache_bytes(ours.config, T, tokens.shape[0], itemsize) == held
  needed = (ours.config.num_params() * itemsize + held) / kv_cache.WHOLE_CACHE_SHARE
  mesh = kvr_jax.make_mesh(2)
  for memory, want in ((int(needed) + 2, "last"), (int(needed) - 2, "sharded")):
    monkeypatch.setattr(auto_module, "device_memory_bytes", lambda device, m=memory: m)
    assert plan_prefill(ours, tokens, "kvr", mesh, [18, 12]).cache == want, memory


PADDED_RUNS = [
  (LATENT, "kvr", [12, 10, 8], None, "last"),
  (LATENT, "kvr", [12, 10, 8], None, "sharded"),
  (LATENT, "allgather", None, (32,), "last"),
  (LATENT, "tsp", None, (32,), "sharded"),
  (LATENT, "single", None, (32,), "last"),
  (LATENT, "single", None, None, "sharded"),
  # Rows that end on the first, second or last rank, a bucket's padding on the last.
  (HYBRID, "kvr", [12, 10, 8], None, "last"),
  (HYBRID, "kvr", [4, 20, 8], (32,), "sharded"),
  (HYBRID, runahead.ONE_BODY_STRATEGY, [5, 5, 5, 17], (32,), "last"),
  (HYBRID, runahead.PER_RANK_STRATEGY, [12, 10, 8], None, "sharded"),
  (HYBRID, "ring", None, (32,), "last"),
  (HYBRID, "allgather", None, (32,), "sharded"),
  (HYBRID, "single", None, (32,), "last"),
  (HYBRID, "single", None, None, "sharded"),
]


@pytest.mark.default_cases(
  "deepseek-default-kvr-partition0-None-last",
  "deepseek-default-kvr-partition1-None-sharded",
  "qwen3_5-types-kvr-partition6-None-last",
  "qwen3_5-types-kvr-partition7-buckets7-sharded",
)
@pytest.mark.parametrize(
  "case, strategy, partition, buckets, cache",
  PADDED_RUNS,
  ids=lambda value: getattr(value, "name", None),  # a record by its name
)
def test_padded_rows_decode_as_each_row_alone(models, case, strategy, partition, buckets, cache):
  """A ragged batch (rows of 30 and 19 tokens), or the same rows in a bucket of 32, in either
  cache layout, on a latent model and a hybrid: each row's logits within 1e-5 of the model's
  own forward on the row alone, and each row's greedy tokens transformers' for the row alone
  (its decode starts at its own length; the sharded parts are read up to it; a hybrid's
  linear states and halos stop at each row's end, not at the bucket's), and the logits the
  last token was drawn from the forward's on the row and its new tokens (every cache entry
  the decode read, within 1e-5: greedy tokens of a tiny model survive small errors)."""
  mesh = None if strategy == "single" else kvr_jax.make_mesh(len(partition) if partition else 2)
  kw = dict(strategy=strategy, mesh=mesh, partition=partition, buckets=buckets, cache=cache)
  _check_padded_rows(models, case, kw)


@pytest.mark.default_cases(
  "kvr-sharded-qwen3_5-types", "allgather-last-deepseek-default", "single-sharded-qwen3_5-types"
)
@pytest.mark.parametrize("case", [HYBRID, LATENT])
@pytest.mark.parametrize(
  "strategy, cache",
  [("kvr", "last"), ("kvr", "sharded"), ("allgather", "last"), ("single", "sharded")],
)
def test_padded_rows_on_a_2d_mesh_decode_as_each_row_alone(models, case, strategy, cache):
  """The same ragged rows on a ("ranks", "model") mesh (2 x 2; "single": its first rank's
  row): the last real tokens' step runs on the last rank's model group, or over the parts
  with the tail split by KV head as the parts are; each row as the model's own forward on it
  alone (1e-5) and transformers' greedy tokens."""
  kw = dict(strategy=strategy, mesh=kvr_jax.make_mesh(2, model=2), cache=cache)
  _check_padded_rows(models, case, kw)


def _check_padded_rows(models, case, kw):
  hf_model, ours = models[case]
  rng = np.random.RandomState(4)
  rows = [rng.randint(0, hf_fixtures.VOCAB, n) for n in (30, 19)]
  buckets, cache = kw.get("buckets"), kw["cache"]
  out = kvr_jax.generate(ours, rows, NEW, **kw)
  assert out.prefill.cache == cache and list(out.prefill.lengths) == [30, 19]
  assert out.prefill.prompt_len == (30 if buckets is None else 32)
  forward = jax.jit(lambda m, t: m.forward(t, "flash")[0])
  for b, row in enumerate(rows):
    want_logits = ours.module.logits(forward(ours.module, row[None])[:, -1:])[:, 0]
    assert_close(out.prefill.logits[b : b + 1], want_logits, f"row {b}'s last logits")
    want = hf_fixtures.hf_greedy(hf_model, row[None], NEW)
    assert not np.isin(want, ours.config.eos_ids).any()
    np.testing.assert_array_equal(out.tokens[b : b + 1], want, f"row {b}'s tokens")
    decoded = np.concatenate([row, out.tokens[b, :-1]])[None]
    want_last = ours.module.logits(forward(ours.module, decoded)[:, -1:])[:, 0]
    assert_close(out.last_logits[b : b + 1], want_last, f"row {b}'s last decoded logits")


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_decode_from_one_prefill_twice_samples_transformers_draws(models, tokens):
  """Sampled decoding (temperature, top-k, seed) from one KV-Runahead prefill of the hybrid,
  twice: the same tokens both times (the first decode left the cache as it was), and those
  transformers' uncached logits give with generate's key schedule, not the greedy ones."""
  hf_model, ours = models[HYBRID]
  prompt = tokens[:1]
  result = kvr_jax.prefill(ours, prompt, "kvr", kvr_jax.make_mesh(2), [12, 18])
  want = hf_fixtures.hf_sampled(hf_model, prompt, NEW, temperature=1.5, top_k=40, seed=5)
  assert not np.array_equal(want, hf_fixtures.hf_greedy(hf_model, prompt, NEW))
  for _ in range(2):
    got = decode_from(ours, result, NEW, temperature=1.5, top_k=40, seed=5)
    np.testing.assert_array_equal(got.tokens, want)


def test_generate_decodes_into_its_prefills_cache_and_decode_from_into_a_copy(
  models, tokens, oracle
):
  """generate's prefill keeps room for its new tokens and its decode writes them there (one
  copy of the cache: the result's stepper consumes it); decode_from decodes from a grown
  copy, the prefill's cache left as it was, and decodes the same tokens."""
  _, ours = models[LATENT]
  out = kvr_jax.generate(ours, tokens, NEW)
  written = np.asarray(out.prefill.past.cache)  # [L, B, T + NEW, C]
  assert written.shape[2] == T + NEW
  # Every fed token's latents (the new ones but the last, which is drawn, never fed).
  assert (np.abs(written[:, :, T : T + NEW - 1]).sum(-1) > 0).all()
  assert not written[:, :, T + NEW - 1].any()
  result = kvr_jax.prefill(ours, tokens)
  before = np.asarray(result.past.cache)
  again = decode_from(ours, result, NEW)
  np.testing.assert_array_equal(again.tokens, oracle[LATENT][2])
  np.testing.assert_array_equal(np.asarray(result.past.cache), before)


@pytest.mark.default_cases("deepseek-default")
@pytest.mark.parametrize("case", [HYBRID, LATENT])
def test_auto_runs_the_cost_models_pick(models, tokens, oracle, case):
  """strategy="auto" on a hybrid and a latent model: the cost model's pick among single,
  KV-Runahead and both peers (each modelled), run and decoded as that strategy runs."""
  _, ours = models[case]
  out = kvr_jax.generate(ours, tokens, NEW, strategy="auto", mesh=kvr_jax.make_mesh(2))
  choice = out.prefill.choice
  assert set(choice.predicted_s) == {"single", "kvr", "ring", "allgather"}
  assert (
    out.prefill.strategy == choice.strategy == min(choice.predicted_s, key=choice.predicted_s.get)
  )
  assert_close(out.prefill.logits, oracle[case][0], "last logits")
  np.testing.assert_array_equal(out.tokens, oracle[case][2])


@pytest.mark.default_cases("per-rank-3-qwen3_5-types")
@pytest.mark.parametrize("case", [HYBRID, LATENT])
@pytest.mark.parametrize("body, ranks", [("per-rank", 3), ("one", 2)])
def test_kvr_with_a_fixed_body_runs_that_body(
  models, tokens, oracle, monkeypatch, case, body, ranks
):
  """KV-Runahead's record with its body fixed (`runahead.with_body`: the benchmark's
  kvr-per-rank and kvr-one-body, each against the other's default rank count) reaches the
  family's program builder as that body, and the prefill is one device's: its cache within
  1e-5 of the one-device forward's, and its logits of the one device's, on the hybrid
  within 1e-5 of transformers' in float64 as the one device's are: the linear layers'
  chunked, entry-map and recurrent forms round apart, and two float32 logits that each err
  by 5e-6 can differ by 1e-5 (per-rank on 3 ranks and the one device's did, on opposite
  sides of the float64 ones, 2026-12-01). DeepSeek's experts do not run in float64 in
  transformers."""
  from kvr_jax.strategies import by_kind

  module, name = by_kind, "compile_by_kind"  # what the plan's program asks (compile_plan)
  asked, builder = [], getattr(module, name)

  def recording(*args, **kwargs):
    asked.append(inspect.signature(builder).bind(*args, **kwargs).arguments.get("body"))
    return builder(*args, **kwargs)

  monkeypatch.setattr(module, name, recording)
  _, ours = models[case]
  split = [10, 12, 8] if ranks == 3 else [18, 12]
  result = kvr_jax.prefill(
    ours, tokens, runahead.with_body(body), kvr_jax.make_mesh(ranks), split, "flash"
  )
  assert asked == [body]
  want_logits = oracle[case][0]
  if case == HYBRID:
    want_logits = hf_fixtures.hf_last_logits_float64(models[case][0], tokens)
    assert_close(oracle[case][0], want_logits, "the one device's last logits")
  assert_close(result.logits, want_logits, f"{body}: last logits")
  _assert_cache_close(case, result.gather_cache(), oracle[case][1])


@pytest.mark.parametrize("strategy", ["kvr", "single"])
@pytest.mark.parametrize("case", [HYBRID, LATENT])
def test_a_kernel_record_reaches_the_familys_program_whole(
  models, tokens, oracle, monkeypatch, case, strategy
):
  """A kernel given as a record (its own block sizes) is the kernel the family's program
  runs, not the registry's record of its name: the builder (or the one device's forward)
  is asked for that record, and the logits are still the one device's."""
  from kvr_jax.strategies import by_kind, single

  small = dataclasses.replace(get_kernel("flash"), query_block=8, key_block=8)
  if strategy == "single":
    module, name, argument = single, "one_group_forward", "attention"
  else:
    module, name, argument = by_kind, "compile_by_kind", "kernel"
  asked, builder = [], getattr(module, name)

  def recording(*args, **kwargs):
    asked.append(inspect.signature(builder).bind(*args, **kwargs).arguments[argument])
    return builder(*args, **kwargs)

  monkeypatch.setattr(module, name, recording)
  _, ours = models[case]
  mesh, split = (None, None) if strategy == "single" else (kvr_jax.make_mesh(2), [18, 12])
  result = kvr_jax.prefill(ours, tokens, strategy, mesh, split, small)
  assert [get_kernel(kernel) for kernel in asked] == [small]
  assert_close(result.logits, oracle[case][0], f"{strategy} with 8-row blocks: last logits")


@pytest.mark.parametrize("case", [HYBRID, LATENT])
def test_a_kvr_record_brings_its_options_to_the_familys_program(models, case):
  """The families' builders take a strategy's record as the K,V path does: KV-Runahead's
  record with a fixed body, or its split as data, is the registered program with that body
  or envelope (one cached program, not a second compile), and a name outside the family is
  refused with the family's own strategies."""
  from kvr_jax.strategies.by_kind import compile_by_kind

  _, ours = models[case]
  builder = functools.partial(compile_by_kind, kinds=ours.config.kinds)
  mesh, chunks, flash = kvr_jax.make_mesh(3), (10, 12, 8), get_kernel("flash")
  by_record = builder(runahead.with_body("one"), ours.graphdef, mesh, chunks, flash)
  assert by_record is builder("kvr", ours.graphdef, mesh, chunks, flash, body="one")
  assert by_record is not builder("kvr", ours.graphdef, mesh, chunks, flash, body="per-rank")
  config = ours.config.of_kind(FULL_ATTENTION) if case == HYBRID else ours.config
  shape = runahead.OneBodyShape.envelope(config, chunks, flash, 16)
  as_data = runahead.split_as_data_strategy(ours.config, shape)
  options = dict(keep_last_hop=False)  # a split as data keeps no last hop
  by_record = builder(as_data, ours.graphdef, mesh, None, flash, **options)
  given = builder("kvr", ours.graphdef, mesh, None, flash, **options, split_shape=shape)
  assert by_record is given
  # The records that run the family (a rank body lent for full layers; a chain or a latent
  # rank layer for latents), in the registry's order; single is the model's own forward.
  runs = "'kvr', 'ring', 'allgather'" if case == HYBRID else "'tsp', 'kvr', 'ring', 'allgather'"
  with pytest.raises(ValueError, match=rf"models run under \({runs}\), not 'single'"):
    builder("single", ours.graphdef, mesh, chunks, flash)


def test_a_kvr_record_keeps_its_timeline_rule_on_the_families(models, tokens):
  """A fixed body marks its phases on a hybrid as KV-Runahead does; the split as data marks
  none (its hops' sizes are data): refused by name at the plan."""
  _, ours = models[HYBRID]
  mesh = kvr_jax.make_mesh(2)
  plan = plan_prefill(ours, tokens, runahead.PER_RANK_STRATEGY, mesh, [18, 12], timeline=True)
  assert plan.timeline
  shape = runahead.OneBodyShape.envelope(ours.config, (18, 12), get_kernel("flash"), 20)
  as_data = runahead.split_as_data_strategy(ours.config, shape)
  with pytest.raises(ValueError, match="'kvr-split-as-data' has no timeline probes"):
    plan_prefill(ours, tokens, as_data, mesh, [18, 12], timeline=True)


@pytest.mark.parametrize("case", [HYBRID, LATENT])
def test_compiled_memory_measures_the_kernel_the_prefill_runs(models, tokens, monkeypatch, case):
  """attention="auto" (compiled_memory's default) where the platform's table puts another
  kernel ("dense") first: the prefill's plan runs the table's first, as on any model, and
  the figures are that kernel's."""
  monkeypatch.setitem(strategies_base.AUTO_KERNELS, "cpu", ("dense", "flash"))
  _, ours = models[case]
  mesh = kvr_jax.make_mesh(2)
  runs = plan_prefill(ours, tokens, "kvr", mesh, [18, 12]).kernel.name
  assert runs == "dense"
  figures = kvr_jax.compiled_memory(
    ours.config, "kvr", context_len=T, num_ranks=2, batch=2, partition=[18, 12]
  )
  assert figures["attention"] == runs


@pytest.mark.parametrize("strategy", ["kvr", "allgather"])
def test_compiled_memory_measures_a_latent_models_move_onto_the_last_rank(models, strategy):
  """cache="last" on a latent model: compiled_memory's move figures are what the last rank's
  device holds to make the cache there, as prefill makes it: KV-Runahead's last hop (the
  first 18 positions) and its own part (12 real rows of 18) where they lie; all-gather CP's
  two parts of 2 x 8 zigzag rows each, sent there at once, and the prompt's row order.
  cache="sharded" moves nothing."""
  config = models[LATENT][1].config
  L, C, B = config.num_layers, config.cache_width, 2
  partition = [18, 12] if strategy == "kvr" else None
  shape = dict(context_len=T, num_ranks=2, batch=B, partition=partition)
  figures = kvr_jax.compiled_memory(config, strategy, cache="last", **shape)
  latent_bytes = L * B * C * 4  # float32, one position
  held = (18 + 18) * latent_bytes if strategy == "kvr" else 2 * 16 * latent_bytes + T * 4
  assert held <= figures["move_argument_bytes"] < held + 64
  assert figures["move_temp_bytes"] >= 0
  sharded = kvr_jax.compiled_memory(config, strategy, cache="sharded", **shape)
  assert "move_argument_bytes" not in sharded


@pytest.mark.parametrize("strategy", ["kvr", "allgather"])
def test_compiled_memory_measures_a_hybrid_models_move_onto_the_last_rank(models, strategy):
  """cache="last" on a hybrid: the move figures are what one device of the last rank holds to
  make the cache there, as prefill makes it: KV-Runahead's full layers' last hop (18
  positions) and own part (18 rows) and its linear states where they lie; all-gather CP's
  two parts of 16 zigzag rows and both ranks' states, sent there at once. On a 2 x 2 mesh
  each device of the last rank's row holds its heads' share: half the K,V."""
  from models.layer_kinds import GatedDeltaNetKind

  config = models[HYBRID][1].config
  full_layers = sum(not isinstance(kind, GatedDeltaNetKind) for kind in config.layer_kinds)
  B = 2
  position_bytes = full_layers * 2 * B * config.num_kv_heads * config.head_dim * 4  # K and V
  partition = [18, 12] if strategy == "kvr" else None
  for m in (1, 2):
    figures = kvr_jax.compiled_memory(
      config, strategy, context_len=T, num_ranks=2, batch=B, partition=partition, model_parallel=m
    )
    states = figures["state_cache_bytes"]  # one device's share of the linear layers' states
    if strategy == "kvr":
      held = (18 + 18) * position_bytes // m + states
    else:
      held = 2 * 16 * position_bytes // m + 2 * states
    assert held <= figures["move_argument_bytes"] < held + 64, m


@pytest.mark.parametrize("case", [HYBRID, LATENT])
@pytest.mark.parametrize("cache", ["last", "sharded"])
def test_compiled_memory_counts_the_cache_each_decode_step_reads(models, case, cache):
  """With decode tokens, every kind's report counts the cache its decode step reads on one
  device (`decode_cache_bytes`, as for K,V): cache="last" the whole cache grown by the new
  tokens on the last rank's device, cache="sharded" a part (KV-Runahead's longest chunk, 18
  rows) and the new tokens' tail; a hybrid's linear states and halos beside its full
  layers' K,V, a latent model's C numbers per position and layer. Whether KV-Runahead joins
  its last hops is reported for every kind."""
  from models.layer_kinds import GatedDeltaNetKind

  config = models[case][1].config
  B, M = 2, 4
  shape = dict(context_len=T, num_ranks=2, batch=B, partition=[18, 12], decode_tokens=M)
  figures = kvr_jax.compiled_memory(config, "kvr", cache=cache, **shape)
  positions = T + M if cache == "last" else 18 + M
  if case == HYBRID:
    full_layers = sum(not isinstance(kind, GatedDeltaNetKind) for kind in config.layer_kinds)
    position_bytes = full_layers * 2 * B * config.num_kv_heads * config.head_dim * 4
    want = positions * position_bytes + figures["state_cache_bytes"]
  else:
    want = positions * config.num_layers * B * config.cache_width * 4
  assert figures["decode_cache_bytes"] == want
  assert figures["joins_last_hop"] is (cache == "last")
  assert figures["decode_argument_bytes"] >= want


@pytest.mark.e2e  # slow (two hybrid programs compiled from shapes): the end-to-end tier
def test_compiled_memory_measures_a_hybrids_split_per_layer_kind(models):
  """compiled_memory plans as prefill does, a split per layer kind too: with the linear layers
  on [10, 20] and the full layers on [22, 8], the busiest device's K,V part (cache="sharded")
  is 22 positions, not 20, and KV-Runahead's join on the last rank (cache="last") holds a
  last hop and own part of 22 rows each beside the linear states."""
  from models.layer_kinds import GatedDeltaNetKind

  config = models[HYBRID][1].config
  full_layers = sum(not isinstance(kind, GatedDeltaNetKind) for kind in config.layer_kinds)
  position_bytes = full_layers * 2 * 2 * config.num_kv_heads * config.head_dim * 4  # B = 2
  split = {"linear": [10, 20], "full": [22, 8]}
  shape = dict(context_len=T, num_ranks=2, batch=2, partition=split)
  sharded = kvr_jax.compiled_memory(config, "kvr", cache="sharded", **shape)
  assert sharded["chunks"] == [10, 20] and sharded["kv_cache_bytes"] == 22 * position_bytes
  last = kvr_jax.compiled_memory(config, "kvr", cache="last", **shape)
  held = (22 + 22) * position_bytes + last["state_cache_bytes"]
  assert held <= last["move_argument_bytes"] < held + 64


@pytest.mark.parametrize(
  "case, partition",
  [
    (HYBRID, [18, 12]),
    (HYBRID, {"linear": [10, 12, 8], "full": [14, 10, 6]}),  # the K,V parts by the full split
    (LATENT, [10, 12, 8]),
  ],
)
def test_kvr_last_moves_where_the_join_does_not_fit(models, tokens, oracle, case, partition):
  """On a device too small for the last hops' zeros on the other ranks (here: pretended, 64
  KiB; a hybrid's full layers' K,V and a latent prefix counted as their kinds keep them),
  KV-Runahead's parts move onto the last rank and are put in prompt order: the cache is one
  device's."""
  from kvr_jax.inference.prefill import run_prefill
  from kvr_jax.inference.prefill_plan import plan_from_shape
  from kvr_jax.inference.shape import PrefillShape

  _, ours = models[case]
  mesh = kvr_jax.make_mesh(len(partition["full"] if isinstance(partition, dict) else partition))
  shape = PrefillShape.of_model(ours, np.full(2, T), T)
  assert plan_from_shape(shape, "kvr", mesh, partition, cache="last").keep_last_hop
  small = plan_from_shape(shape, "kvr", mesh, partition, cache="last", device_memory=64 * 1024)
  assert not small.keep_last_hop
  result = run_prefill(ours, small, tokens)
  assert result.moved and result.past.cache is not None
  assert_close(result.logits, oracle[case][0], "last logits")
  _assert_cache_close(case, result.gather_cache(), oracle[case][1])


class _FakeGPU:
  """An NVIDIA GPU as the kernel records see one (this machine has none)."""

  platform = "gpu"
  client = type("Client", (), {"platform_version": "cuda 12.8"})()


@pytest.mark.parametrize("case", [HYBRID, LATENT])
def test_auto_kernel_is_the_platforms_and_fused_runs_every_strategy(
  models, tokens, oracle, case, monkeypatch
):
  """attention="auto" on a hybrid or latent model resolves per platform as on any model:
  cuDNN on an NVIDIA GPU in bfloat16 for every strategy that runs it (TSP: dense scores by
  definition), flash on this CPU; and "fused", cuDNN's two pieces in XLA, runs each of them
  as one device does."""
  from kvr_jax.inference.prefill_plan import planned_kernel
  from kvr_jax.inference.shape import PrefillShape
  from kvr_jax.strategies import get_strategy
  from models import kernels

  _, ours = models[case]
  monkeypatch.setattr(kernels, "cudnn_available", lambda: True)
  shape = PrefillShape(ours.config, "bfloat16", T, 2, T)
  names = cache_form_of(ours.config).strategies
  for name in names:
    want = "dense" if name == "tsp" else "cudnn"
    assert planned_kernel(shape, get_strategy(name), "auto", _FakeGPU()).name == want, name
  mesh = kvr_jax.make_mesh(2)
  assert kvr_jax.prefill(ours, tokens, "kvr", mesh).attention == "flash"
  for name in (n for n in names if n not in ("single", "tsp")):
    result = kvr_jax.prefill(ours, tokens, name, mesh, attention="fused")
    assert_close(result.logits, oracle[case][0], f"{name}: last logits")


@pytest.mark.parametrize("case", [HYBRID, LATENT])
@pytest.mark.parametrize("strategy, partition", [("kvr", [18, 12]), ("allgather", None)])
def test_run_prefill_can_leave_the_cache_where_the_program_put_it(
  models, tokens, oracle, case, strategy, partition
):
  """run_prefill(move_cache=False), what the benchmark times: the last rank's logits as one
  device's, no cache joined (the result refuses to be read or decoded, by why); padded rows,
  whose logits come from the joined cache, refused before anything runs."""
  from kvr_jax.inference.prefill import run_prefill

  _, ours = models[case]
  mesh = kvr_jax.make_mesh(2)
  plan = plan_prefill(ours, tokens, strategy, mesh, partition, cache="last")
  result = run_prefill(ours, plan, tokens, move_cache=False)
  assert_close(result.logits, oracle[case][0], "last logits")
  assert result.past is None and result.logits.devices() == {mesh.devices.flat[-1]}
  with pytest.raises(ValueError, match="move_cache=False"):
    result.gather_cache()
  with pytest.raises(ValueError, match="holds no cache"):
    decode_from(ours, result, 2)
  ragged = [tokens[0, :20], tokens[1]]
  padded = plan_prefill(ours, ragged, strategy, mesh, partition, cache="last")
  with pytest.raises(ValueError, match="rows of one length"):
    run_prefill(ours, padded, ragged, move_cache=False)


def test_what_is_not_built_is_refused_by_name(models, tokens):
  _, hybrid = models[HYBRID]
  _, latent = models[LATENT]
  mesh = kvr_jax.make_mesh(2)
  with pytest.raises(ValueError, match=r"runs under \['single', 'kvr', 'ring', 'allgather'\]"):
    kvr_jax.prefill(hybrid, tokens, "tsp", mesh)
  with pytest.raises(ValueError, match=r"strategy 'tsp' has no timeline probes"):
    plan_prefill(latent, tokens, "tsp", mesh, timeline=True)
  with pytest.raises(ValueError, match=r"strategy 'single' has no timeline probes"):
    plan_prefill(hybrid, tokens, "single", timeline=True)
  with pytest.raises(ValueError, match="convolution halo"):
    kvr_jax.prefill(hybrid, tokens[:, :20], "allgather", kvr_jax.make_mesh(4))
  result = kvr_jax.prefill(latent, tokens[:1, :8], "single")
  with pytest.raises(ValueError, match="decode it with the model that made it"):
    decode_from(hybrid, result, 2)


@pytest.mark.parametrize("case", ["kv", HYBRID, LATENT])
def test_every_model_decodes_cache_last_by_its_own_decode_step(models, tokens, monkeypatch, case):
  """One decode path after cache="last": a K,V model, a hybrid and a latent model each run
  their own `decode_step` over their own cache (a K,V model's `KVCache` too), through
  `decode.decode_step_of`, and the tokens are single's."""
  ours = kvr_jax.load_model("tiny-llama") if case == "kv" else models[case][1]
  seen = []
  model_class = type(ours.module)
  own_step = model_class.decode_step

  def recorded(module, tokens_B, positions_B, cache, **kwargs):
    seen.append("latents" if isinstance(cache, jax.Array) else type(cache).__name__)
    return own_step(module, tokens_B, positions_B, cache, **kwargs)

  monkeypatch.setattr(model_class, "decode_step", recorded)
  decode.decode_step_of.cache_clear()  # its steps traced afresh, with the recording method
  out = kvr_jax.generate(ours, tokens, NEW, strategy="kvr", mesh=kvr_jax.make_mesh(2), cache="last")
  want = {"kv": "KVCache", HYBRID: "HybridCache", LATENT: "latents"}[case]
  assert seen and set(seen) == {want}, seen  # traced once per compiled step
  single = kvr_jax.generate(ours, tokens, NEW)
  np.testing.assert_array_equal(out.tokens, single.tokens)
