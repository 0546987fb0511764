"""Layer kinds as data (models/layer_kinds.py): the record's answers, a model's kinds, and the
strategies, the cost model and the cache join reading them. No program is compiled here."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvr_jax.core.chunks import prefix_ends
from kvr_jax.inference import kv_form, latent
from kvr_jax.inference.prefill_plan import cache_form_of
from kvr_jax.planning import costmodel
from kvr_jax.planning.presets import make_setup
from kvr_jax.runtime.loading import preset_config
from kvr_jax.strategies import runahead
from kvr_jax.strategies.runahead import schedule
from kvr_jax.strategies.runahead.hops import hop_chain
from models.base import scan_layers
from models.families import model_class
from models.gemma import GemmaConfig
from models.layer_kinds import FULL_ATTENTION, AttentionKind, kinds_in_order, past_kind
from models.llama import LlamaConfig

TINY = dict(
  vocab_size=64,
  d_model=32,
  num_layers=4,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  mlp_dim=48,
  max_position_embeddings=4096,
  norm_eps=1e-6,
)


@pytest.mark.parametrize("window", [0, -3, True, 2.5, "8"])
def test_a_bad_window_is_refused_by_the_record(window):
  with pytest.raises(ValueError, match="sliding window must be a positive integer or None"):
    AttentionKind(window)


def test_what_a_softmax_layer_carries_and_reads():
  full, windowed = FULL_ATTENTION, AttentionKind(16)
  # A hop into a chunk at 100 carries the whole prefix, or only the last W-1 keys of it.
  assert full.hop_span(100) == (0, 100) and windowed.hop_span(100) == (85, 100)
  assert windowed.hop_span(10) == (0, 10)  # a prefix shorter than the window: all of it
  assert full.hop_keeps_whole_prefix(100) and not windowed.hop_keeps_whole_prefix(100)
  # Into a chunk at 15 the hop is [0, 15): query 15 sees [0, 15]; at 16 key 0 is out of reach.
  assert windowed.hop_keeps_whole_prefix(15) and windowed.hop_span(16) == (1, 16)
  assert not windowed.hop_keeps_whole_prefix(16)
  config = LlamaConfig(**TINY)  # K=2, H=8: K and V of one token are 2 * 2 * 8 numbers
  assert full.hop_bytes(config, 100, batch=3, dtype_bytes=2) == 2 * 3 * 100 * 2 * 8 * 2
  assert windowed.hop_bytes(config, 100, batch=1, dtype_bytes=4) == 2 * 15 * 2 * 8 * 4
  assert (full.decode_keys(1000), windowed.decode_keys(1000), windowed.decode_keys(5)) == (
    1000,
    16,
    5,
  )
  assert full.name == "full attention" and windowed.name == "attention, window 16"


def test_a_models_kinds_in_compile_order():
  gemma = GemmaConfig(**TINY, layer_windows=(8, 8, None, 4))
  assert gemma.layer_kinds == (AttentionKind(8), AttentionKind(8), FULL_ATTENTION, AttentionKind(4))
  assert gemma.kinds == (AttentionKind(4), AttentionKind(8), FULL_ATTENTION)
  assert gemma.kinds == kinds_in_order(reversed(gemma.layer_kinds))
  with pytest.raises(ValueError, match="3 kinds \\(attention, window 4, .*full attention\\)"):
    _ = gemma.kind
  # A kind's config: its window, and Gemma's local RoPE on the windowed layers.
  local = gemma.of_kind(AttentionKind(8))
  assert (local.kind, local.rope) == (AttentionKind(8), gemma.local_rope)
  assert (gemma.of_kind(FULL_ATTENTION).kind, gemma.of_kind(FULL_ATTENTION).rope) == (
    FULL_ATTENTION,
    gemma.rope,
  )
  assert LlamaConfig(**TINY, sliding_window=6).kind == AttentionKind(6)


def test_what_a_models_past_is_follows_its_layer_kinds():
  # One answer for the cache form, the cost model and the fitting alike.
  assert past_kind(GemmaConfig(**TINY, layer_windows=(8, None) * 2)) == "kv"
  assert past_kind(preset_config("bench-qwen3.5")) == "hybrid"
  assert past_kind(preset_config("bench-deepseek")) == "latent"
  assert cache_form_of(preset_config("bench-deepseek")) is latent.FORM
  # Every model has a form, each named as its past (what compiled_memory's figures key on).
  assert cache_form_of(LlamaConfig(**TINY)) is kv_form.FORM
  for config in (LlamaConfig(**TINY), *map(preset_config, ("bench-qwen3.5", "bench-deepseek"))):
    assert cache_form_of(config).name == past_kind(config)


def test_the_last_hop_holds_the_cache_on_every_kind_past_one_rank():
  """The last hop carries [0, 70) on a full layer, and on a windowed one its last W-1 keys,
  which with the last chunk [70, 90) hold every key a query from position 89 on sees."""
  chunks = (40, 30, 20)
  for kinds in ((FULL_ATTENTION,), (AttentionKind(71), FULL_ATTENTION), (AttentionKind(8),)):
    assert schedule.last_hop_holds_cache(chunks, kinds)
  assert not schedule.last_hop_holds_cache((90,), (FULL_ATTENTION,))  # one rank: no hop
  with pytest.raises(ValueError, match="one rank receives no hop"):
    schedule.check_keep_last_hop(True, (90,), (AttentionKind(8), FULL_ATTENTION))
  spec = runahead.STRATEGY
  assert spec.keeps_last_hop("last", chunks, (AttentionKind(8),))
  assert not spec.keeps_last_hop("sharded", chunks, (AttentionKind(8),))
  # A hybrid's kinds (a linear layer's past is the state its rank computes) and a latent
  # model's (the hop is the latent prefix) answer too; a kind that says no is heard.
  for name in ("bench-qwen3.5", "bench-deepseek"):
    kinds = preset_config(name).kinds
    assert spec.keeps_last_hop("last", chunks, kinds), name
    assert not spec.keeps_last_hop("last", (90,), kinds), name
    assert not spec.keeps_last_hop("last", chunks, (*kinds, _HopShort())), name


@dataclasses.dataclass(frozen=True)
class _HopShort(AttentionKind):
  """A made-up kind whose last hop never holds what decode reads."""

  def last_hop_holds(self, hop_end: int, last: int) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class _HalfPrefix(AttentionKind):
  """A made-up kind whose hops carry the second half of the prefix: what the strategies do
  must follow the record, not a window they compute themselves."""

  def first_key(self, position: int) -> int:
    return position // 2


def test_the_modelled_hops_are_the_kinds_answers(monkeypatch):
  setup = make_setup("a100-80gb", "300GBps", dtype_bytes=2)
  chunks = (500, 300, 200)
  ends = prefix_ends(chunks)
  for config in (LlamaConfig(**TINY), LlamaConfig(**TINY, sliding_window=64)):
    _, hop_bytes, _ = runahead.layer_work(config, chunks, setup)
    assert hop_bytes == [config.kind.hop_bytes(config, ends[k], 1, 2) for k in (0, 1)]
    assert hop_bytes[1] == 2 * (ends[1] - config.kind.first_key(ends[1])) * 2 * 8 * 2
  # A made-up kind (no window, so the kept per-rank work is that of full attention).
  config = dataclasses.replace(LlamaConfig(**TINY), vocab_size=65)
  monkeypatch.setattr(LlamaConfig, "kind", property(lambda self: _HalfPrefix()))
  _, hop_bytes, _ = runahead.layer_work(config, chunks, setup)
  assert hop_bytes == [2 * (end - end // 2) * 2 * 8 * 2 for end in ends[:2]]
  monkeypatch.undo()
  # The cost model models each kind's layers as theirs: a windowed layer costs less.
  mixed = GemmaConfig(**TINY, layer_windows=(64, None, 64, None))
  full = dataclasses.replace(mixed, layer_windows=None)
  run = dict(num_ranks=3, partition=chunks)
  windowed_ttft = costmodel.simulate(mixed, "kvr", 1000, setup, **run).ttft
  assert windowed_ttft < costmodel.simulate(full, "kvr", 1000, setup, **run).ttft


def test_the_hop_chain_sends_the_kinds_span(monkeypatch):
  """hop_chain slices each message at the kind's span: traced with a fake ppermute."""
  import jax.numpy as jnp

  sent = []

  def fake_ppermute(message, axis, perm):
    sent.append((perm[0], message.shape[2]))
    return message

  monkeypatch.setattr("jax.lax.ppermute", fake_ppermute)
  chunks = (40, 30, 20)
  buffer = jnp.zeros((2, 1, schedule.buffer_len(chunks), 1, 2))
  own = jnp.zeros((2, 1, 40, 1, 2))
  cases = ((FULL_ATTENTION, [40, 70]), (AttentionKind(16), [15, 15]), (_HalfPrefix(), [20, 35]))
  for kind, lengths in cases:
    sent.clear()
    hop_chain(buffer, own, jnp.int32(0), chunks, kind)
    assert sent == [((0, 1), lengths[0]), ((1, 2), lengths[1])], kind


def _layers_seen(config):
  """What `scan_layers` hands each layer of a small model of `config`: (index, row, the kind's
  place in config.kinds, the block's window, a checksum of the block's weights), and the
  checksums of every stack's rows, for the expected order."""
  model = model_class(config)(config, rngs=nnx.Rngs(0))

  def checksum(state):
    return sum(jnp.sum(jnp.abs(w.astype(jnp.float32))) for w in jax.tree.leaves(state))

  def body(block, layer, count):
    seen = (
      layer.index,
      layer.row,
      jnp.int32(config.kinds.index(layer.kind)),
      jnp.int32(getattr(block.config.kind, "window", None) or -1),
      checksum(nnx.state(block)),
    )
    return count + 1, seen

  count, seen = jax.jit(lambda: scan_layers(model, body, jnp.int32(0)))()
  rows = {
    layer: checksum(jax.tree.map(lambda w, r=row: w[r], nnx.state(stack.blocks)))
    for stack in model.layer_stacks()
    for row, layer in enumerate(stack.layers)
  }
  return int(count), [np.asarray(s) for s in seen], rows


@pytest.mark.parametrize(
  "name, replace, rows",
  [
    ("tiny-gemma", {}, [0, 1, 2, 3]),  # one stack, two kinds (a window of 64, full)
    ("bench-deepseek", {}, [0, 0, 1, 2]),  # two stacks in turn: 1 dense layer, 3 of experts
    ("bench-qwen3.5", {}, [0, 1, 2, 0]),  # two stacks in turn: 3 linear layers, then 1 full
    # Interleaved stacks: one scan, each step its stack's row.
    ("bench-qwen3.5", {"layer_types": ("full_attention", "linear_attention") * 2}, [0, 0, 1, 1]),
  ],
)
def test_one_scan_driver_runs_every_models_layers_in_order(name, replace, rows):
  """models.base.scan_layers, the one layer driver of every model: each layer in model order
  (its index), from its own stack's row (the weights' checksum), with its kind, its block
  seeing that kind's config (a window of 64 or none), and the outputs stacked in layer order."""
  config = dataclasses.replace(preset_config(name), **replace)
  count, (index_L, row_L, kind_L, window_L, weights_L), stack_rows = _layers_seen(config)
  L = config.num_layers
  assert count == L
  np.testing.assert_array_equal(index_L, np.arange(L))
  np.testing.assert_array_equal(row_L, rows)
  np.testing.assert_array_equal(kind_L, [config.kinds.index(k) for k in config.layer_kinds])
  windows = [getattr(k, "window", None) for k in config.layer_kinds]
  np.testing.assert_array_equal(window_L, [-1 if w is None else w for w in windows])
  np.testing.assert_allclose(weights_L, [stack_rows[l] for l in range(L)], rtol=1e-6)
  assert len(set(np.round(weights_L, 3))) == L  # every layer's weights differ: the check can fail
