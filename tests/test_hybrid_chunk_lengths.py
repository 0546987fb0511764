"""KV-Runahead on a hybrid model at every chunk length: a linear layer's chunk passes its
leaving state and the last w = kernel - 1 inputs (the convolution's halo) to the next rank,
and a chunk may be shorter than the halo, as long, up to twice as long or longer. Each
length 1..2w+1 is swept in the first, a middle and the last position for convolution
kernels 2-5, against the model's own one-device forward, and decoded against transformers;
the 2-D mesh, cache="sharded" and a split per layer kind take the same short chunks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import kvr_jax
from kvr_jax.runtime.mesh import AXIS, global_array
from kvr_jax.strategies import TRACE_COUNT, runahead
from kvr_jax.strategies.by_kind import compile_by_kind
from kvr_jax.strategies.linear_chain import chain_linear_layer, chain_linear_layer_one_body
from kvr_jax.strategies.runahead.schedule import OneBodyShape
from models.gated_deltanet_layer import LinearState
from models.kernels import get_kernel
from models.layer_kinds import FULL_ATTENTION
from tests import hf_fixtures
from tests.tolerance import assert_close

DEFAULT_KERNEL = 4  # Qwen3.5's linear_conv_kernel_dim
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]


@functools.cache
def _checkpoint(kernel: int, tmp_root: str):
  """(torch model, its directory, our model) of a 3-layer hybrid whose convolution has
  `kernel` taps."""
  hf_model = hf_fixtures.make_qwen35_model(
    "qwen3_5-default", num_hidden_layers=3, layer_types=LAYER_TYPES, linear_conv_kernel_dim=kernel
  )
  directory = f"{tmp_root}/qwen3_5-kernel{kernel}"
  hf_model.save_pretrained(directory)
  return hf_model, directory, kvr_jax.load_model(directory)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("chunk_lengths"))
  return lambda kernel: _checkpoint(kernel, root)


def rotations(kernel: int) -> list[tuple[int, int, int]]:
  """Splits over 3 ranks in which every length 1..2w+1 stands once first, once in the middle
  and once last: the lengths' cyclic rotations taken three at a time."""
  lengths = list(range(1, 2 * (kernel - 1) + 2))
  n = len(lengths)
  return [tuple(lengths[(i + j) % n] for j in range(3)) for i in range(n)]


def test_rotations_put_every_length_in_every_position():
  for kernel in (2, 3, 4, 5):
    splits, w = rotations(kernel), kernel - 1
    for position in range(3):
      assert sorted(s[position] for s in splits) == list(range(1, 2 * w + 2))


def first_linear_block(model):
  graphdef, stacked = nnx.split(model.module.linear_blocks)
  return nnx.merge(graphdef, jax.tree.map(lambda w: w[0], stacked))


@functools.partial(jax.jit, static_argnums=(2, 3))
def chained(block, parts_pBcD, chunks: tuple[int, ...], mesh):
  """KV-Runahead's linear layer per rank over `chunks` (rank r's rows in parts[r], padded):
  each rank's (x [B, c_max, D], leaving state, halo)."""

  def per_rank(block, x_1BcD):
    rank = jax.lax.axis_index(AXIS)
    out = chain_linear_layer(block, x_1BcD[0], rank, chunks)
    return jax.tree.map(lambda a: a[None], out)

  return jax.shard_map(per_rank, mesh=mesh, in_specs=(jax.P(), jax.P(AXIS)), out_specs=jax.P(AXIS))(
    block, parts_pBcD
  )


@functools.partial(jax.jit, static_argnums=(3,))
def chained_one_body(block, parts_pBcD, lengths_p, mesh):
  """The same in the one body, the split's lengths as data: one program for every split
  whose chunks fit the parts' rows."""

  def per_rank(block, x_1BcD, lengths_p):
    rank = jax.lax.axis_index(AXIS)
    # blocks of 4 rows: most chunks span several, and some end inside one
    out = chain_linear_layer_one_body(
      block, x_1BcD[0], rank, lengths_p[rank], lengths_p.shape[0], row_block=4
    )
    return jax.tree.map(lambda a: a[None], out)

  specs = (jax.P(), jax.P(AXIS), jax.P())
  return jax.shard_map(per_rank, mesh=mesh, in_specs=specs, out_specs=jax.P(AXIS))(
    block, parts_pBcD, lengths_p
  )


@pytest.fixture(scope="module")
def one_device_layer(checkpoint):
  """kernel -> (block, x [2, T, D], one device's outputs [2, T, D], run), once per kernel:
  run(block, x, lengths) is the layer on one device from a zero past, compiled once, and with
  every row's length set to a chunk's end it gives the past that prefix leaves."""
  made = {}

  def of(kernel: int):
    if kernel not in made:
      block = first_linear_block(checkpoint(kernel)[2])
      w, D, cfg = kernel - 1, block.w_out.shape[-1], block.config
      x_BTD = np.random.RandomState(kernel).normal(size=(2, 3 * (2 * w + 1), D))
      x_BTD = x_BTD.astype(np.float32)
      channels = block.conv_kernel().shape[-1]
      heads = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
      zero_past = LinearState(jnp.zeros((2, *heads)), jnp.zeros((2, w, channels)))
      run = jax.jit(lambda block, x, lengths: block.run(x, zero_past, lengths))
      want_x, _ = run(block, x_BTD, jnp.full((2,), x_BTD.shape[1]))  # causal: any prefix's
      made[kernel] = (block, x_BTD, np.asarray(want_x), run)
    return made[kernel]

  return of


# (kernel, split): the default kernel's splits in the default tier, the others' in e2e.
SWEEP = [
  pytest.param(
    kernel,
    split,
    marks=() if kernel == DEFAULT_KERNEL else pytest.mark.e2e,
    id=f"kernel{kernel}-split{'-'.join(map(str, split))}",
  )
  for kernel in (2, 3, 4, 5)
  for split in rotations(kernel)
]


@pytest.mark.default_cases("kernel4-split7-1-2-per-rank", "kernel4-split1-2-3-one-body")
@pytest.mark.parametrize("form", ["per-rank", "one-body"])
@pytest.mark.parametrize("kernel, split", SWEEP)
def test_every_chunk_length_in_every_position(one_device_layer, kernel, split, form):
  """One linear layer chained over 3 ranks at a split of `rotations`, in either form: every
  rank's outputs, and the state and halo each leaves, as the layer run on one device over
  the prompt up to that rank's chunk's end."""
  block, x_BTD, want_x, run = one_device_layer(kernel)
  mesh = kvr_jax.make_mesh(3)
  ends = np.cumsum(split)
  # The one body's parts are as long as the sweep's longest chunk (2w + 1): one program.
  rows = max(split) if form == "per-rank" else 2 * (kernel - 1) + 1
  parts = np.stack([pad_to(x_BTD[:, e - c : e], rows) for c, e in zip(split, ends, strict=True)])
  parts = global_array(parts, NamedSharding(mesh, jax.P(AXIS)))
  if form == "per-rank":
    outs = chained(block, parts, split, mesh)
  else:
    outs = chained_one_body(block, parts, jnp.asarray(split, jnp.int32), mesh)
  x_pBcD, leaving_pBhkv, halo_pBwC = map(np.asarray, outs)
  for r, (c, end) in enumerate(zip(split, ends, strict=True)):
    _, want_past = run(block, x_BTD, jnp.full((2,), end))
    where = f"{form}: kernel {kernel}, split {split}, rank {r}"
    assert_close(x_pBcD[r, :, :c], want_x[:, end - c : end], f"{where}: outputs")
    assert_close(leaving_pBhkv[r], want_past.state_Bhkv, f"{where}: leaving state")
    assert_close(halo_pBwC[r], want_past.halo_BwC, f"{where}: halo")


def pad_to(x_BcD, rows: int):
  return np.pad(x_BcD, ((0, 0), (0, rows - x_BcD.shape[1]), (0, 0)))


def every_prefix_logits(model, tokens):
  """[B, T, V]: the one-device forward's logits at every position; a prompt of its first n
  tokens ends with column n - 1."""
  x_BTD, _ = jax.jit(lambda m, t: m.forward(t))(model.module, tokens)
  return np.asarray(model.module.logits(x_BTD))


def constant_sum_splits(kernel: int) -> list[tuple[int, int, int]]:
  """Splits over 3 ranks of one prompt, 3(w + 1) tokens, in which every length 1..2w+1
  stands once first, once in the middle and once last: zero-based (x, (x + w) mod n,
  3w - both) for n = 2w + 1 (one prompt length: one program of the split as data serves
  them all)."""
  w = kernel - 1
  n = 2 * w + 1
  zero_based = [(x, (x + w) % n) for x in range(n)]
  return [tuple(v + 1 for v in (a, b, 3 * w - a - b)) for a, b in zero_based]


def test_constant_sum_splits_put_every_length_in_every_position():
  for kernel in (2, 3, 4, 5):
    splits, w = constant_sum_splits(kernel), kernel - 1
    assert {sum(split) for split in splits} == {3 * (w + 1)}
    for position in range(3):
      assert sorted(s[position] for s in splits) == list(range(1, 2 * w + 2))


def split_as_data(model, splits, kernel: int):
  """KV-Runahead's record whose one program takes every split of `splits` as data."""
  full_config = model.config.of_kind(FULL_ATTENTION)
  shape = OneBodyShape.envelope(full_config, splits[0], get_kernel("flash"), 2 * kernel - 1)
  return runahead.split_as_data_strategy(model.config, shape)


@pytest.mark.e2e
@pytest.mark.parametrize(
  "kernel, form",
  [(kernel, "split as data") for kernel in (2, 3, 4, 5)] + [(DEFAULT_KERNEL, "static")],
)
def test_every_chunk_length_through_the_whole_model(checkpoint, kernel, form):
  """kvr_jax.prefill at every split of `constant_sum_splits`: the last logits as one
  device's. The split as data (`runahead.split_as_data_strategy`) runs them all on one
  program, traced once; the static split (the default kernel's) compiles one per split."""
  model = checkpoint(kernel)[2]
  splits = constant_sum_splits(kernel)
  tokens = np.random.RandomState(kernel).randint(0, hf_fixtures.VOCAB, (2, sum(splits[0])))
  want = every_prefix_logits(model, tokens)[:, -1]
  mesh = kvr_jax.make_mesh(3)
  strategy = split_as_data(model, splits, kernel) if form == "split as data" else "kvr"
  traced = TRACE_COUNT["kvr-hybrid"]
  for split in splits:
    got = kvr_jax.prefill(model, tokens, strategy=strategy, mesh=mesh, partition=list(split))
    assert_close(got.logits, want, f"{form}: kernel {kernel}, split {split}")
  if form == "split as data":
    assert TRACE_COUNT["kvr-hybrid"] - traced <= 1, "a program per split"


@pytest.mark.e2e
@pytest.mark.parametrize("cache", ["last", "sharded"])
def test_the_split_as_data_decodes_transformers_tokens(checkpoint, cache):
  """Decoding from the split as data's cache: its parts moved onto the last rank and joined
  (cache="last": no last hop is kept, its size being data) or left where they lie
  (cache="sharded"), at splits with a short first, middle and last chunk."""
  hf_model, _, model = checkpoint(DEFAULT_KERNEL)
  splits = constant_sum_splits(DEFAULT_KERNEL)
  prompt = np.random.RandomState(11).randint(0, hf_fixtures.VOCAB, (1, sum(splits[0])))
  want = hf_fixtures.hf_greedy(hf_model, prompt, 5)
  strategy = split_as_data(model, splits, DEFAULT_KERNEL)
  for split in (splits[0], splits[3], splits[4]):
    got = kvr_jax.generate(
      model,
      prompt,
      5,
      strategy=strategy,
      mesh=kvr_jax.make_mesh(3),
      partition=list(split),
      cache=cache,
    )
    np.testing.assert_array_equal(got.tokens, want, err_msg=f"split {split}")


def test_the_split_as_data_refuses_what_its_one_program_cannot_run(checkpoint):
  """Refused by name before anything compiles: a peer, a split per layer kind (its moves are
  static slices), a 2-D mesh, a kept last hop or timeline probes (the hops' sizes are data)."""
  model = checkpoint(DEFAULT_KERNEL)[2]
  splits = constant_sum_splits(DEFAULT_KERNEL)
  strategy = split_as_data(model, splits, DEFAULT_KERNEL)
  tokens = np.zeros((1, sum(splits[0])), np.int32)
  split = list(splits[0])
  with pytest.raises(ValueError, match="one split for every kind of layer"):
    kvr_jax.prefill(
      model,
      tokens,
      strategy=strategy,
      mesh=kvr_jax.make_mesh(3),
      partition={"linear": split, "full": split},
    )
  two = split_as_data(model, [(6, 6)], DEFAULT_KERNEL)
  with pytest.raises(ValueError, match="runs on a 1-D mesh"):
    kvr_jax.prefill(
      model, tokens, strategy=two, mesh=kvr_jax.make_mesh(2, model=2), partition=[6, 6]
    )
  shape = strategy.options.split_shape
  mesh, kinds = kvr_jax.make_mesh(3), model.config.kinds
  build = functools.partial(compile_by_kind, graphdef=model.graphdef, mesh=mesh, chunks=None)
  with pytest.raises(ValueError, match="a split as data is KV-Runahead's"):
    build("ring", kernel="flash", kinds=kinds, split_shape=shape)
  with pytest.raises(ValueError, match="keeps no last hop and marks no timeline"):
    build("kvr", kernel="flash", kinds=kinds, split_shape=shape)
  with pytest.raises(ValueError, match="keeps no last hop and marks no timeline"):
    build("kvr", kernel="flash", kinds=kinds, keep_last_hop=False, timeline=True, split_shape=shape)
  with pytest.raises(ValueError, match="no per-rank body"):
    build(
      "kvr", kernel="flash", kinds=kinds, keep_last_hop=False, body="per-rank", split_shape=shape
    )


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
@pytest.mark.parametrize("kernel", [2, 4, 5])
def test_short_later_chunks_decode_transformers_tokens(checkpoint, kernel):
  """Chunks of 1, w+1 and w-or-more tokens (kernel 2: w = 1): greedy tokens from the last
  rank's cache are transformers'."""
  hf_model, _, model = checkpoint(kernel)
  w = kernel - 1
  split = [w + 1, 1, w + 1, 2 * w]
  prompt = np.random.RandomState(7).randint(0, hf_fixtures.VOCAB, (1, sum(split)))
  want = hf_fixtures.hf_greedy(hf_model, prompt, 5)
  got = kvr_jax.generate(
    model, prompt, 5, strategy="kvr", mesh=kvr_jax.make_mesh(len(split)), partition=split
  )
  np.testing.assert_array_equal(got.tokens, want)


@pytest.mark.default_cases("default split of 10 tokens-2-1-None-last")
@pytest.mark.parametrize(
  "label, ranks, model_shards, partition, cache",
  [
    ("default split of 10 tokens", 2, 1, None, "last"),
    ("2-D mesh", 2, 2, [36, 4], "last"),
    ("cache sharded", 4, 1, [5, 5, 4, 26], "sharded"),
    ("a split per layer kind", 2, 1, {"linear": [35, 5], "full": [36, 4]}, "last"),
  ],
)
def test_short_later_chunks_on_every_path(checkpoint, label, ranks, model_shards, partition, cache):
  """The lengths a probe found wrong (w < c < 2w), on each path that runs the chain."""
  _, directory, model = checkpoint(DEFAULT_KERNEL)
  T = 10 if partition is None else 40
  tokens = np.random.RandomState(3).randint(0, hf_fixtures.VOCAB, (1, T))
  want = every_prefix_logits(model, tokens)[:, -1]
  mesh = kvr_jax.make_mesh(ranks, model=model_shards)
  if model_shards > 1:
    model = kvr_jax.load_model(directory, mesh=mesh)
  got = kvr_jax.prefill(model, tokens, strategy="kvr", mesh=mesh, partition=partition, cache=cache)
  assert_close(got.logits, want, label)


@pytest.mark.e2e
def test_the_planners_splits_run(checkpoint):
  """partition="search" and "balanced" may give a chunk shorter than the halo (27 tokens on 3
  ranks): the split they choose runs and gives one device's logits."""
  _, _, model = checkpoint(DEFAULT_KERNEL)
  tokens = np.random.RandomState(5).randint(0, hf_fixtures.VOCAB, (1, 27))
  want = every_prefix_logits(model, tokens)[:, -1]
  mesh = kvr_jax.make_mesh(3)
  for method in ("search", "balanced"):
    got = kvr_jax.prefill(model, tokens, strategy="kvr", mesh=mesh, partition=method)
    assert sum(got.partition) == 27, (method, got.partition)
    assert_close(got.logits, want, f"partition={method} {got.partition}")
