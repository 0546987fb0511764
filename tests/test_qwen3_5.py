"""Qwen3.5 text (hybrid Gated DeltaNet and softmax attention) against transformers, through
the project's own loader: logits of every position, ragged rows, decode from the hybrid cache,
`layer_types` as transformers reads it, and what kvr_jax refuses by name."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvr_jax
from kvr_jax.strategies import TRACE_COUNT, runahead
from kvr_jax.strategies.runahead.schedule import OneBodyShape
from models import qwen3_5
from models.families import config_from_hf
from models.kernels import get_kernel
from tests import hf_fixtures
from tests.measured_checks import assert_candidates_on_one_program
from tests.own_prefill import prefilled
from tests.tolerance import assert_close, relative_error

MODEL_TOL = 1e-4  # whole models against transformers, float32
CASES = list(hf_fixtures.QWEN35_CASES)
T = 70  # no multiple of the 64-token chunk, and longer than one


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """case -> (torch model, directory written with save_pretrained, our loaded model)."""
  return hf_fixtures.saved_checkpoints(hf_fixtures.make_qwen35_model, CASES, tmp_path_factory)


@pytest.fixture(scope="module")
def tokens():
  return np.random.RandomState(1).randint(0, hf_fixtures.VOCAB, (2, T))


@pytest.fixture(scope="module")
def forward():
  """The model's logits and cache, compiled once per model (graphdef static)."""

  @jax.jit
  def run(module, tokens_BT, lengths_B, capacity_like):
    x_BTD, cache = module.forward(tokens_BT, lengths_B=lengths_B, capacity=capacity_like.shape[0])
    return module.logits(x_BTD), cache

  return lambda module, tokens, lengths=None, capacity=None: run(
    module,
    jnp.asarray(tokens),
    None if lengths is None else jnp.asarray(lengths),
    jnp.zeros(capacity or tokens.shape[1]),
  )


@pytest.mark.default_cases("qwen3_5-types")
@pytest.mark.parametrize("case", CASES)
def test_logits_every_position_match_transformers(checkpoints, tokens, forward, case):
  hf_model, _, ours = checkpoints[case]
  logits, _ = forward(ours.module, tokens)
  err = relative_error(logits, hf_fixtures.hf_logits(hf_model, tokens))
  assert err <= MODEL_TOL, f"{case}: relative error {err:.2e} > {MODEL_TOL}"


def test_ragged_rows_match_each_row_alone(checkpoints, tokens, forward):
  """Rows of 70 and 45 tokens, the second right-padded: each row's real positions as
  transformers gives that row alone, and its cache as that row's own."""
  hf_model, _, ours = checkpoints["qwen3_5-default"]
  lengths = np.array([T, 45])
  padded = tokens.copy()
  padded[1, 45:] = 0
  logits, cache = forward(ours.module, padded, lengths)
  alone = hf_fixtures.hf_logits(hf_model, tokens[1:, :45])
  assert relative_error(logits[1, :45], alone[0]) <= MODEL_TOL
  _, short_cache = forward(ours.module, tokens[1:, :45])
  assert_close(cache.linear.state_Bhkv[:, 1], short_cache.linear.state_Bhkv[:, 0], "state")
  assert_close(cache.linear.halo_BwC[:, 1], short_cache.linear.halo_BwC[:, 0], "halo")


@pytest.fixture(scope="module")
def decoded(checkpoints, tokens, forward):
  """Greedy decoding of 8 tokens from a ragged prefill (rows of 30 and 22 tokens) through
  the hybrid cache: (tokens [2, 8], each step's logits [8, 2, V])."""
  _, _, ours = checkpoints["qwen3_5-types"]
  lengths = np.array([30, 22])
  prompt = tokens[:, :30].copy()
  prompt[1, 22:] = 0
  logits, cache = forward(ours.module, prompt, lengths, capacity=30 + 8)
  step = jax.jit(lambda module, t, p, c: module.decode_step(t, p, c))
  positions = jnp.asarray(lengths)
  next_B = jnp.argmax(logits[jnp.arange(2), positions - 1], axis=-1)
  out, steps = [], []
  for _ in range(8):
    out.append(next_B)
    step_logits, cache = step(ours.module, next_B, positions, cache)
    steps.append(step_logits)
    next_B, positions = jnp.argmax(step_logits, axis=-1), positions + 1
  return np.stack(out, axis=1), np.stack(steps), lengths


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_decode_from_the_hybrid_cache_equals_the_uncached_forward(
  checkpoints, tokens, forward, decoded
):
  """Each decode step's logits (recurrent form, K,V written in place) equal the forward's
  logits over the prompt and the tokens decoded so far (chunked form), per row."""
  _, _, ours = checkpoints["qwen3_5-types"]
  new_tokens, step_logits, lengths = decoded
  for row, length in enumerate(lengths):
    sequence = np.concatenate([tokens[row, :length], new_tokens[row]])[None]
    logits, _ = forward(ours.module, sequence)
    want = np.asarray(logits[0, length : length + 8])
    assert_close(step_logits[:, row], want, f"row {row}'s decode logits")


def test_greedy_decode_matches_transformers(checkpoints, tokens, decoded):
  hf_model, _, _ = checkpoints["qwen3_5-types"]
  new_tokens, _, lengths = decoded
  for row, length in enumerate(lengths):
    want = hf_fixtures.hf_greedy(hf_model, tokens[row : row + 1, :length], 8)
    np.testing.assert_array_equal(new_tokens[row : row + 1], want)


def test_layer_types_read_as_transformers_reads_them(checkpoints):
  _, directory, ours = checkpoints["qwen3_5-types"]
  assert ours.config.layer_types == tuple(hf_fixtures.QWEN35_CASES["qwen3_5-types"]["layer_types"])
  with open(f"{directory}/config.json") as f:
    hf = json.load(f)
  del hf["layer_types"]
  hf["full_attention_interval"] = 2
  hf["num_hidden_layers"] = 5
  import transformers

  want = transformers.Qwen3_5TextConfig(**{k: v for k, v in hf.items() if k != "model_type"})
  assert config_from_hf(hf).layer_types == tuple(want.layer_types)
  del hf["full_attention_interval"]  # transformers' default interval is 4
  assert config_from_hf(hf).layer_types == tuple(
    transformers.Qwen3_5TextConfig(num_hidden_layers=5).layer_types
  )
  hf["layer_types"] = ["linear_attention"] * 4 + ["sliding_attention"]
  with pytest.raises(ValueError, match="layer_types"):
    config_from_hf(hf)


def test_partial_rotary_and_head_counts_read(checkpoints):
  cfg = checkpoints["qwen3_5-default"][2].config
  assert (cfg.rotary_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (4, 2, 4)
  assert cfg.num_params() == sum(p.numel() for p in checkpoints["qwen3_5-default"][0].parameters())


def test_multimodal_checkpoint_loads_its_language_model_and_says_what_it_ignores(
  checkpoints, tokens, tmp_path
):
  """A `qwen3_5` checkpoint (with a vision tower): the language model loads, with the same
  logits as the text checkpoint it holds; the vision tensors are named in a warning."""
  import safetensors.numpy as st

  hf_model, directory, ours = checkpoints["qwen3_5-default"]
  with open(f"{directory}/config.json") as f:
    text = json.load(f)
  (tmp_path / "config.json").write_text(
    json.dumps({"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 1}})
  )
  tensors = st.load_file(f"{directory}/model.safetensors")
  renamed = {
    name.replace("model.", "model.language_model.", 1): value for name, value in tensors.items()
  }
  renamed["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
  st.save_file(renamed, str(tmp_path / "model.safetensors"))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    multimodal = kvr_jax.load_model(str(tmp_path))
  assert any("vision tower" in str(w.message) for w in caught)
  np.testing.assert_array_equal(multimodal.module(tokens[:, :8]), ours.module(tokens[:, :8]))


def test_bad_linear_config_refused_by_name():
  base = qwen3_5.Qwen35Config(
    vocab_size=8,
    d_model=8,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    mlp_dim=8,
    max_position_embeddings=16,
    norm_eps=1e-6,
    layer_types=("linear_attention",),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=4,
    linear_value_head_dim=4,
  )
  import dataclasses

  with pytest.raises(ValueError, match="linear_num_value_heads"):
    dataclasses.replace(base, linear_num_value_heads=3)
  with pytest.raises(ValueError, match="partial_rotary_factor"):
    dataclasses.replace(base, partial_rotary_factor=0.1)
  with pytest.raises(ValueError, match="layer_types"):
    dataclasses.replace(base, layer_types=("mamba",))


# --- KV-Runahead on the hybrid model (kvr_jax.inference.hybrid)


@pytest.fixture(scope="module")
def one_device(checkpoints, tokens):
  """The single-device reference of "qwen3_5-types": the last position's logits and the
  cache (room for 4 more positions), compiled once."""
  module = checkpoints["qwen3_5-types"][2].module
  x_BTD, cache = jax.jit(lambda m, t: m.forward(t, capacity=T + 4))(module, tokens)
  return module.logits(x_BTD)[:, -1], cache


@pytest.mark.default_cases("kvr-2-partition0-dense", "allgather-4-None-dense")
@pytest.mark.parametrize(
  "strategy, ranks, partition, attention",
  [
    ("kvr", 2, [40, 30], "dense"),
    ("kvr", 3, [30, 25, 15], "flash"),
    ("kvr", 4, [12, 30, 3, 25], "dense"),
    ("ring", 3, None, "flash"),
    ("allgather", 4, None, "dense"),
  ],
)
def test_hybrid_prefill_equals_one_device(
  checkpoints, tokens, one_device, strategy, ranks, partition, attention
):
  """KV-Runahead on uneven chunks (the last of 3 tokens, the convolution's halo) and the
  peers on their zigzag chunks (the last 7 tokens long at 4 ranks), full and linear layers
  interleaved: the last rank's logits and its whole cache (K,V of the full layers, each
  linear layer's state and halo) as one device computes them; KV-Runahead's with no move."""
  ours = checkpoints["qwen3_5-types"][2]
  mesh = kvr_jax.make_mesh(ranks)
  result = prefilled(ours, tokens, mesh, partition, attention, 4, strategy)
  want_logits, want = one_device
  assert_close(result.logits, want_logits, "last logits")
  assert_close(result.past.cache.kv_2BSKH, want.kv_2BSKH, "full layers' K,V")
  assert_close(result.past.cache.linear.state_Bhkv, want.linear.state_Bhkv, "linear states")
  assert_close(result.past.cache.linear.halo_BwC, want.linear.halo_BwC, "convolution halos")
  assert result.logits.devices() == {mesh.devices.flat[-1]}
  assert result.moved == (strategy != "kvr")


@pytest.mark.default_cases("kvr-3-partition0", "allgather-2-None")
@pytest.mark.parametrize(
  "strategy, ranks, partition",
  [
    ("kvr", 3, [30, 25, 15]),
    ("kvr", 4, [12, 30, 3, 25]),
    ("ring", 3, None),
    ("allgather", 2, None),
  ],
)
def test_padded_rows_stop_each_linear_state_at_their_end(
  checkpoints, tokens, forward, strategy, ranks, partition
):
  """Rows that end before the prompt does (`prefill.program_result(ends_B=)`: at 2, inside the
  convolution's halo, and at 41, on an inner rank): each linear layer's state and halo are
  the model's own forward's with the same ends, and every full layer's K,V before each row's
  end, within 1e-5: the state passes the padding unchanged, the halo is the last inputs
  before the row's end wherever they lie."""
  from kvr_jax.inference.cache_form import PrefillRun
  from kvr_jax.inference.prefill import plan_prefill, program_result

  ours, ends = checkpoints["qwen3_5-types"][2], np.array([2, 41])
  mesh = kvr_jax.make_mesh(ranks)
  plan = plan_prefill(ours, tokens, strategy, mesh, partition, "flash", "last")
  run = PrefillRun(ours, plan, np.asarray(tokens), np.full(len(tokens), T))
  got = program_result(run, ends_B=ends).past.cache
  _, want = forward(ours.module, tokens, ends)
  assert_close(got.linear.state_Bhkv, want.linear.state_Bhkv, "linear states")
  assert_close(got.linear.halo_BwC, want.linear.halo_BwC, "convolution halos")
  for b, end in enumerate(ends):
    got_kv, want_kv = got.kv_2BSKH[:, :, b, :end], want.kv_2BSKH[:, :, b, :end]
    assert_close(got_kv, want_kv, f"row {b}'s full layers' K,V before its end")
  with pytest.raises(ValueError, match="lengths must be 2 row ends"):
    program_result(run, ends_B=[3, T + 1])


def test_the_split_as_data_equals_one_device(checkpoints, tokens, one_device):
  """KV-Runahead with the split as data (`runahead.split_as_data_strategy`: one program for
  every split that fits its envelope), both kinds of layer in its one body: at two splits,
  the last rank's logits and its whole cache (its parts moved there and joined: no last hop
  is kept, its size being data) as one device computes them, on one trace."""
  ours, mesh = checkpoints["qwen3_5-types"][2], kvr_jax.make_mesh(3)
  shape = OneBodyShape.envelope(ours.config, (30, 25, 15), get_kernel("flash"), 32)
  as_data = runahead.split_as_data_strategy(ours.config, shape)
  traced = TRACE_COUNT["kvr-hybrid"]
  for split in ([30, 25, 15], [6, 32, 32]):
    result = prefilled(ours, tokens, mesh, split, "flash", 4, as_data)
    want_logits, (want_kv, want_linear) = one_device
    assert_close(result.logits, want_logits, f"{split}: last logits")
    assert_close(result.past.cache.kv_2BSKH, want_kv, f"{split}: full layers' K,V")
    got_linear = result.past.cache.linear
    assert_close(got_linear.state_Bhkv, want_linear.state_Bhkv, f"{split}: states")
    assert_close(got_linear.halo_BwC, want_linear.halo_BwC, f"{split}: halos")
    assert result.moved and result.logits.devices() == {mesh.devices.flat[-1]}
  assert TRACE_COUNT["kvr-hybrid"] - traced <= 1, "a program per split"


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_the_measured_search_times_a_hybrids_candidates_on_one_program(
  checkpoints, tokens, tmp_path
):
  """objective='measured' on a hybrid: its candidates run on the split as data's program,
  not a program each (the one program is traced again only where a candidate outgrows its
  envelope)."""
  ours, mesh = checkpoints["qwen3_5-types"][2], kvr_jax.make_mesh(2)
  assert_candidates_on_one_program(ours, tokens, mesh, "kvr-hybrid", tmp_path)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize("strategy, partition", [("kvr", [40, 30]), ("ring", None)])
def test_a_second_prefill_traces_nothing_again(checkpoints, tokens, strategy, partition):
  """The same prefill again (cache "last") reuses its program and its join of the cache: a
  join traced per call cost 0.2 s of a 2.8 s TTFT at 16k (docs/measurements.md)."""
  ours, mesh = checkpoints["qwen3_5-types"][2], kvr_jax.make_mesh(2)
  first = prefilled(ours, tokens, mesh, partition, "flash", 4, strategy)
  before = dict(TRACE_COUNT)
  again = prefilled(ours, tokens, mesh, partition, "flash", 4, strategy)
  assert TRACE_COUNT["hybrid-join"] == before["hybrid-join"] >= 1
  assert TRACE_COUNT[f"{strategy}-hybrid"] == before[f"{strategy}-hybrid"]
  assert_close(again.past.cache.kv_2BSKH, first.past.cache.kv_2BSKH, "the same cache")


@pytest.mark.parametrize(
  "strategy, kwargs", [("kvr", {"partition": [18, 12]}), ("ring", {"attention": "flash"})]
)
def test_a_hybrid_decodes_transformers_greedy_tokens(checkpoints, tokens, strategy, kwargs):
  """Greedy tokens from KV-Runahead's and ring's caches on a hybrid are transformers'."""
  hf_model, _, ours = checkpoints["qwen3_5-default"]
  want = hf_fixtures.hf_greedy(hf_model, tokens[:1, :30], 6)
  mesh = kvr_jax.make_mesh(2)
  got = kvr_jax.generate(ours, tokens[:1, :30], 6, strategy=strategy, mesh=mesh, **kwargs)
  np.testing.assert_array_equal(got.tokens, want)


def test_hybrid_samples_transformers_draws_whatever_the_strategy(checkpoints, tokens):
  """Sampled decoding (temperature, top-k, seed) from KV-Runahead's and ring's caches draws
  the tokens that transformers' uncached logits give with kvr_jax.generate's key schedule;
  the draw is not the greedy one (the temperature is applied)."""
  hf_model, _, ours = checkpoints["qwen3_5-default"]
  prompt, mesh = tokens[:1, :30], kvr_jax.make_mesh(2)
  want = hf_fixtures.hf_sampled(hf_model, prompt, 6, temperature=1.5, top_k=40, seed=5)
  assert not np.array_equal(want, hf_fixtures.hf_greedy(hf_model, prompt, 6))
  sampling = dict(temperature=1.5, top_k=40, seed=5)
  got = kvr_jax.generate(ours, prompt, 6, strategy="kvr", mesh=mesh, partition=[18, 12], **sampling)
  np.testing.assert_array_equal(got.tokens, want)
  got = kvr_jax.generate(ours, prompt, 6, strategy="ring", mesh=mesh, **sampling)
  np.testing.assert_array_equal(got.tokens, want)
  with pytest.raises(ValueError, match="temperature"):
    kvr_jax.generate(ours, prompt, 6, strategy="kvr", mesh=mesh, temperature=-1.0)


def _collective_shapes(model, strategy, partition, op="collective-permute"):
  """The result shapes of every `op` in the compiled hybrid program of `strategy`."""
  import re

  from kvr_jax.runtime.mesh import AXIS
  from kvr_jax.strategies import get_strategy
  from kvr_jax.strategies.by_kind import compile_by_kind
  from models.kernels import get_kernel

  mesh = kvr_jax.make_mesh(len(partition))
  spec, partition = get_strategy(strategy), tuple(partition)
  chunks = spec.layout(sum(partition), len(partition), partition)
  program = compile_by_kind(
    strategy, model.graphdef, mesh, chunks, get_kernel("flash"), model.config.kinds
  )
  tokens_pBc = spec.arrange(np.zeros((2, sum(partition)), np.int32), chunks)
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  by_rank = jax.sharding.NamedSharding(mesh, jax.P(AXIS))
  hlo = (
    program.lower(model.state_on(replicated), jax.device_put(tokens_pBc, by_rank))
    .compile()
    .as_text()
  )
  pattern = rf"= \w+\[([\d,]+)\]\{{[\d,]*\}} {op}(?:-start)?\("
  return [tuple(int(d) for d in m.group(1).split(",")) for m in re.finditer(pattern, hlo)]


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_linear_layers_hop_a_state_whose_size_does_not_follow_the_prompt(checkpoints):
  """Compiled programs at two prompt lengths: the linear layers' collective-permutes (each
  hop of the chain carries the state [B, h, k, v] and the halo [B, w, C]) are the same; only
  the full layers' K,V hops [2, B, S_k, K, H] grow with the prompt."""
  cfg = checkpoints["qwen3_5-types"][2].config
  model = checkpoints["qwen3_5-types"][2]
  B, h = 2, cfg.linear_num_value_heads
  state = (B, h, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
  halo = (B, cfg.linear_conv_kernel - 1, cfg.conv_channels)
  shapes = {n: _collective_shapes(model, "kvr", [n, n, n]) for n in (16, 48)}
  for n, found in shapes.items():
    linear = sorted(s for s in found if s in (state, halo))
    assert linear == sorted([state, state, halo, halo]), (n, found)  # p-1 hops of both
    kv = sorted(s[2] for s in found if s not in (state, halo))
    assert kv == [n, 2 * n], (n, found)  # the full layers' hops carry S_0 and S_1 keys
  # The peers: a linear layer all-gathers every rank's two entry maps (A [B, h, k, k] and
  # B [B, h, k, v] per chunk): [p, 2, ...], the same at both lengths.
  gathered = {
    n: sorted(s for s in _collective_shapes(model, "ring", [n] * 3, "all-gather") if len(s) == 6)
    for n in (24, 48)
  }
  d_k = cfg.linear_key_head_dim
  assert gathered[24] == gathered[48] == sorted([(3, 2, *state[:3], d_k), (3, 2, *state)])


def _scans(jaxpr) -> set[tuple[int, int]]:
  """(length, carries) of every `lax.scan` in a jaxpr and the jaxprs inside it."""
  found = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      found.add((eqn.params["length"], eqn.params["num_carry"]))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found |= _scans(inner)
  return found


def test_kvr_runs_each_linear_layer_at_its_ranks_own_length(checkpoints):
  """On a split of 66 and 4 tokens, rank 0 runs the plain chunked form over its two 64-token
  chunks and rank 1 its entry map over one chunk: not over the longest rank's rows (the
  padding a searched split's short rank would otherwise pay in full). The entry map's scan
  carries two states (P, R), the plain form's one."""
  from kvr_jax.runtime.mesh import AXIS
  from kvr_jax.strategies import get_strategy
  from kvr_jax.strategies.by_kind import compile_by_kind
  from models.kernels import get_kernel

  model = checkpoints["qwen3_5-types"][2]
  mesh, chunks = kvr_jax.make_mesh(2), (66, 4)
  program = compile_by_kind(
    "kvr", model.graphdef, mesh, chunks, get_kernel("flash"), model.config.kinds
  )
  tokens_pBc = get_strategy("kvr").arrange(np.zeros((1, 70), np.int32), chunks)
  jaxpr = jax.make_jaxpr(program)(
    model.state_on(jax.sharding.NamedSharding(mesh, jax.P())),
    jax.device_put(tokens_pBc, jax.sharding.NamedSharding(mesh, jax.P(AXIS))),
  )
  scans = _scans(jaxpr.jaxpr)
  assert {scan for scan in scans if scan[1] == 2} == {(1, 2)}, scans  # rank 1's entry map
  assert (2, 1) in scans, scans  # rank 0's plain form


def test_the_one_bodys_linear_layers_loop_over_their_real_chunks_alone(checkpoints):
  """In the one body (3 ranks, flash) every rank runs one program at the longest chunk's
  width, 130 rows on a split of 130, 4 and 4 tokens: its entry map runs in a loop whose trip
  count is its own rows (`chunked_with_entry_map_upto`, a while loop), never a scan over the
  width's 64-token chunks, which would cost the short ranks the long rank's work."""
  from kvr_jax.runtime.mesh import AXIS
  from kvr_jax.strategies import get_strategy
  from kvr_jax.strategies.by_kind import compile_by_kind, program_body
  from models.kernels import get_kernel

  model = checkpoints["qwen3_5-types"][2]
  mesh, chunks, flash = kvr_jax.make_mesh(3), (130, 4, 4), get_kernel("flash")
  assert program_body(get_strategy("kvr"), mesh, flash, chunks, None, None, None) == "one"
  program = compile_by_kind("kvr", model.graphdef, mesh, chunks, flash, model.config.kinds)
  tokens_pBc = get_strategy("kvr").arrange(np.zeros((1, 138), np.int32), chunks)
  jaxpr = jax.make_jaxpr(program)(
    model.state_on(jax.sharding.NamedSharding(mesh, jax.P())),
    jax.device_put(tokens_pBc, jax.sharding.NamedSharding(mesh, jax.P(AXIS))),
  )
  chunk_scans = {scan for scan in _scans(jaxpr.jaxpr) if scan[0] > 1 and scan[1] in (1, 2)}
  # (3, 1): the head's recurrence over its w = 3 rows; an entry map's scan would be (3, 2)
  # (the 133 rows after the head in 64-token chunks), the plain form's (3, 1) too.
  assert chunk_scans <= {(3, 1)}, chunk_scans


def test_hybrid_prefill_refuses_by_name(checkpoints, tokens):
  ours = checkpoints["qwen3_5-types"][2]
  # 20 tokens in 8 zigzag chunks of 3: the last two hold 2 and 0 real tokens, less than the
  # halo of 3 that a peer's chunk takes from one neighbour (KV-Runahead runs any split).
  with pytest.raises(ValueError, match="as short as 0 tokens.*convolution halo of 3"):
    kvr_jax.prefill(ours, tokens[:, :20], strategy="ring", mesh=kvr_jax.make_mesh(4))
  with pytest.raises(ValueError, match="outside the vocabulary"):
    kvr_jax.prefill(ours, tokens + 1000, strategy="kvr", mesh=kvr_jax.make_mesh(2))


def test_qwen35_27b_preset_is_the_published_model():
  """The preset's shape (Qwen/Qwen3.5-27B's text config) has transformers' own parameter
  count, counted on the meta device."""
  import torch
  import transformers

  from kvr_jax.runtime.loading import preset_config

  cfg = preset_config("qwen3.5-27b")
  hf = transformers.Qwen3_5TextConfig(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.d_model,
    intermediate_size=cfg.mlp_dim,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=cfg.num_heads,
    num_key_value_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    linear_num_key_heads=cfg.linear_num_key_heads,
    linear_num_value_heads=cfg.linear_num_value_heads,
    linear_key_head_dim=cfg.linear_key_head_dim,
    linear_value_head_dim=cfg.linear_value_head_dim,
    tie_word_embeddings=False,
  )
  with torch.device("meta"):
    hf_model = transformers.Qwen3_5ForCausalLM(hf)
  assert cfg.layer_types == tuple(hf.layer_types)
  assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters()) == 26_895_998_464


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize(
  "case, partition, full_partition",
  [
    ("qwen3_5-types", [30, 40], [52, 18]),  # the first layer full: the tokens move before it
    ("qwen3_5-types", [12, 30, 3, 25], [40, 20, 6, 4]),  # pieces that cross two ranks
    ("qwen3_5-default", [20, 20, 30], [40, 20, 10]),  # the last layer full: no move after it
  ],
)
def test_kvr_with_a_split_per_layer_kind_equals_one_device(
  checkpoints, tokens, case, partition, full_partition
):
  """KV-Runahead's full layers on their own split, the linear layers on theirs (the hidden
  states moved between the two at every full layer): the last rank's logits and whole
  cache, and cache="sharded"'s parts laid out by the full layers' split, as one device."""
  ours = checkpoints[case][2]
  module = ours.module
  x_BTD, want = jax.jit(lambda m, t: m.forward(t, capacity=T + 4))(module, tokens)
  want_logits = module.logits(x_BTD)[:, -1]
  mesh = kvr_jax.make_mesh(len(partition))
  kinds = {"linear": partition, "full": full_partition}
  got = prefilled(ours, tokens, mesh, kinds, "dense", 4)
  assert_close(got.logits, want_logits, "last logits")
  assert_close(got.past.cache.kv_2BSKH, want.kv_2BSKH, "full layers' K,V")
  assert_close(got.past.cache.linear.state_Bhkv, want.linear.state_Bhkv, "linear states")
  assert_close(got.past.cache.linear.halo_BwC, want.linear.halo_BwC, "convolution halos")
  assert got.partition == tuple(partition) and got.full_partition == tuple(full_partition)
  sharded = prefilled(ours, tokens, mesh, kinds, "dense", 4, cache="sharded")
  assert_close(sharded.logits, want_logits, "last logits, cache='sharded'")
  assert sharded.cache_layout == kvr_jax.strategies.get_strategy("kvr").cache_layout(
    T, tuple(full_partition)
  )


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_kvr_with_a_split_per_layer_kind_decodes_transformers_tokens(checkpoints, tokens):
  """kvr_jax.prefill and generate take {"linear": .., "full": ..}: greedy tokens from the
  joined cache and from the ranks' parts (laid out by the full layers' split) are
  transformers'; the result says which split each kind ran."""
  hf_model, _, ours = checkpoints["qwen3_5-default"]
  prompt, mesh = tokens[:1, :30], kvr_jax.make_mesh(2)
  want = hf_fixtures.hf_greedy(hf_model, prompt, 6)
  kinds = {"linear": [18, 12], "full": [23, 7]}
  result = kvr_jax.prefill(ours, prompt, strategy="kvr", mesh=mesh, partition=kinds)
  assert result.partition == (18, 12) and result.full_partition == (23, 7)
  # The program ran the full layers on their split: the K,V parts lie as it cut them.
  sharded = kvr_jax.prefill(
    ours, prompt, strategy="kvr", mesh=mesh, partition=kinds, cache="sharded"
  )
  kvr = kvr_jax.strategies.get_strategy("kvr")
  assert sharded.cache_layout == kvr.cache_layout(30, (23, 7)) != kvr.cache_layout(30, (18, 12))
  for cache in ("last", "sharded"):
    got = kvr_jax.generate(ours, prompt, 6, strategy="kvr", mesh=mesh, partition=kinds, cache=cache)
    np.testing.assert_array_equal(got.tokens, want)


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_search_runs_the_split_per_kind_it_models(checkpoints, tokens, one_device):
  """partition "search" on a hybrid runs the pair of splits it models faster: with attention
  100 times slower than the matmuls, the 70-token prompt's full layers take a split of
  their own (rank 0 longer), the result says so, and the logits are one device's."""
  from kvr_jax.runtime.roofline import Hardware, Links

  slow_attention = Hardware(
    "slow attention",
    1e12,
    1e12,
    0.5,
    0.5,
    fused_attention_fraction=0.005,
    linear_rule_fraction=0.5,
  )
  plan = kvr_jax.PartitionPlan(
    "search", hardware=slow_attention, links=Links(1e12, 1e-9, held_send=True)
  )
  ours, mesh = checkpoints["qwen3_5-types"][2], kvr_jax.make_mesh(2)
  result = kvr_jax.prefill(ours, tokens, strategy="kvr", mesh=mesh, partition=plan)
  linear, full = result.partition, result.full_partition
  assert full is not None and full[0] > linear[0] and sum(full) == sum(linear) == T
  assert_close(result.logits, one_device[0], "last logits")
  # launch.run's table names both splits.
  from kvr_jax.tools import demo

  (report,) = demo.compare_strategies(
    ours, tokens, ["kvr"], num_devices=2, partition=plan, repeats=1, max_new_tokens=1
  )
  assert (report.partition, report.full_partition) == (linear, full)
  row = demo.format_table([report]).splitlines()[2]
  assert f"{linear[0]},{linear[1]} / {full[0]},{full[1]}" in row


def test_a_split_per_layer_kind_refused_by_name(checkpoints, tokens):
  ours, prompt, mesh = checkpoints["qwen3_5-default"][2], tokens[:1, :30], kvr_jax.make_mesh(2)
  kinds = {"linear": [18, 12], "full": [23, 7]}
  with pytest.raises(ValueError, match="'ring' lays the prompt out itself"):
    kvr_jax.prefill(ours, prompt, strategy="ring", mesh=mesh, partition=kinds)
  with pytest.raises(ValueError, match="names \\['linear', 'full'\\]"):
    kvr_jax.prefill(ours, prompt, strategy="kvr", mesh=mesh, partition={"linear": [18, 12]})
  with pytest.raises(ValueError, match="sums to 31"):
    kvr_jax.prefill(ours, prompt, strategy="kvr", mesh=mesh, partition={**kinds, "full": [24, 7]})
  with pytest.raises(ValueError, match="strategy='auto' chooses"):
    kvr_jax.prefill(ours, prompt, strategy="auto", mesh=mesh, partition=kinds)
