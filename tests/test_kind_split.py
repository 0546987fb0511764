"""KV-Runahead on a hybrid with a split per layer kind: the hidden states laid out again
between the linear layers' split and the full layers' (`strategies.base.reshard_rows`, the
pieces `core.chunks.moved_rows` lists), and the cost model that prices those moves and
searches the pair (`costmodel.simulate(full_partition=)`, `search.kind_split_search`), and
the plans that search it (partition "search", strategy "auto"). The programs' exactness is
in tests/test_qwen3_5.py."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from kvr_jax.core.chunks import chunk_starts, moved_rows
from kvr_jax.inference.prefill_plan import plan_from_shape
from kvr_jax.inference.shape import PrefillShape
from kvr_jax.planning import costmodel, presets, search
from kvr_jax.planning.partition import PartitionPlan
from kvr_jax.runtime.loading import preset_config
from kvr_jax.runtime.mesh import AXIS, make_mesh
from kvr_jax.runtime.roofline import Compute, Links, ModelledLayer, Receive, Send
from kvr_jax.strategies.base import reshard_rows
from models.layer_kinds import FULL_ATTENTION


def test_moved_rows_lists_each_overlap_between_different_ranks():
  # Rank 1's first two rows go to rank 0; the rest stays.
  assert moved_rows((4, 4), (6, 2)) == [(1, 0, 0, 4, 2)]
  assert moved_rows((6, 2), (4, 4)) == [(0, 1, 4, 0, 2)]
  assert moved_rows((3, 3, 3), (3, 3, 3)) == []
  # Rank 0's new chunk takes all of rank 1's old one and part of rank 2's.
  assert moved_rows((2, 3, 5), (7, 2, 1)) == [
    (1, 0, 0, 2, 3),
    (2, 0, 0, 5, 2),
    (2, 1, 2, 0, 2),
  ]


@pytest.mark.parametrize(
  "from_chunks, to_chunks",
  [
    ((8, 8), (11, 5)),
    ((11, 5), (8, 8)),
    ((2, 9, 1, 4), (9, 1, 3, 3)),
    ((4, 4, 4, 4), (4, 4, 4, 4)),
  ],
)
def test_reshard_rows_lays_the_rows_out_by_the_new_split(from_chunks, to_chunks):
  """Every rank's rows (each row its prompt position, twice over D) laid out by `to_chunks`:
  rank i holds positions [start_i, start_i + c_i) then zeros to the longest chunk."""
  p = len(from_chunks)
  mesh = make_mesh(p)

  def laid_out(chunks):
    rows = np.zeros((p, 1, max(chunks), 2), np.float32)
    for i, (start, c) in enumerate(zip(chunk_starts(chunks), chunks, strict=True)):
      rows[i, 0, :c] = 1.0 + np.arange(start, start + c)[:, None]
    return rows

  def rank(x_1BcD):
    return reshard_rows(x_1BcD[0], from_chunks, to_chunks, jax.lax.axis_index(AXIS))[None]

  run = jax.jit(jax.shard_map(rank, mesh=mesh, in_specs=jax.P(AXIS), out_specs=jax.P(AXIS)))
  got = run(jax.device_put(laid_out(from_chunks), NamedSharding(mesh, jax.P(AXIS))))
  np.testing.assert_array_equal(np.asarray(got), laid_out(to_chunks))


def _layer(*ranks) -> ModelledLayer:
  return ModelledLayer(tuple(tuple(r) for r in ranks), (1, 1), (0.0, 0.0), (0.0, 0.0))


@pytest.mark.parametrize("held_send, want", [(False, [1.0, 12.0]), (True, [13.0, 13.0])])
def test_two_messages_on_one_link_land_in_order(held_send, want):
  """Rank 0 sends "a" (2 s) and after 1 s of work "b" (1 s, behind "a" on the link); rank 1
  takes "a", works 10 s, takes "b". Its first receive is "a"'s landing (2 s), not "b"'s.
  Held (a rendezvous), "b" starts when rank 1 reaches its second receive (12 s)."""
  layer = _layer(
    [Send(1, 2.0, "a"), Compute("x", 1.0), Send(1, 1.0, "b")],
    [Receive(0), Compute("y", 10.0), Receive(0)],
  )
  assert costmodel.layer_timeline(layer, 1, held_send) == want


@pytest.fixture(scope="module")
def hybrid():
  return preset_config("bench-qwen3.5-8")


def _setup(bandwidth: float, held_send: bool = False, dtype_bytes: int = 4):
  links = Links(bandwidth, 10e-6, held_send=held_send)
  flags = costmodel.kernel_flags("flash")
  return presets.make_setup("h100-sxm", links, dtype_bytes=dtype_bytes, **flags)


def _ttft(config, C, setup, linear, full=None):
  return costmodel.simulate(
    config, "kvr", C, setup, num_ranks=len(linear), partition=linear, full_partition=full
  ).ttft


def test_simulate_prices_each_full_layers_moves(hybrid):
  """One split for both kinds models as no split per kind; another full split adds to each
  full layer a move of the rows between the splits in and (but the model's last layer) out,
  D float32 numbers a row over the link."""
  C, setup = 16384, _setup(10e9)
  linear, full = (8192, 8192), (11000, 5384)
  assert _ttft(hybrid, C, setup, linear, linear) == _ttft(hybrid, C, setup, linear)
  intervals = []
  sim = costmodel.simulate(
    hybrid,
    "kvr",
    C,
    setup,
    num_ranks=2,
    partition=linear,
    full_partition=full,
    intervals=intervals,
  )
  # The bytes it reports, per layer over the 8: rank 0 sends 2808 rows out of layer 3,
  # rank 1 sends them in to layers 3 and 7. The hops' bytes stay what the hops carry.
  row_bytes = hybrid.d_model * 4
  assert sim.moved_bytes == pytest.approx([2808 * row_bytes / 8, 2 * 2808 * row_bytes / 8])
  one = costmodel.simulate(hybrid, "kvr", C, setup, num_ranks=2, partition=linear)
  assert one.moved_bytes == [0.0, 0.0]
  linear_hop, full_hop = (
    costmodel.modelled_layer(
      hybrid.of_kind(kind), "kvr", C, setup, num_ranks=2, partition=split
    ).link_bytes[0]
    for kind, split in ((hybrid.linear_kind, linear), (FULL_ATTENTION, full))
  )
  assert sim.link_bytes[0] == pytest.approx((6 * linear_hop + 2 * full_hop) / 8)
  moves = sorted(
    (layer, rank, end - start) for rank, layer, phase, start, end in intervals if phase == "move"
  )
  seconds = 2808 * hybrid.d_model * 4 / 10e9 + 10e-6
  # On the sender's row: full layer 3's move in (rank 1 to 0) and out (rank 0 to 1), full
  # layer 7's in (the model's last layer: nothing back).
  assert [(layer, rank) for layer, rank, _ in moves] == [(3, 0), (3, 1), (7, 1)]
  assert [s for *_, s in moves] == pytest.approx([seconds] * 3)


def test_kind_split_search_splits_the_full_layers_apart_where_the_moves_are_cheap():
  """Qwen3.5-27B at 128k on two H100s whose hops are rendezvous (every layer at its slower
  rank's pace): on a fast link the full layers' split puts more of the prompt on rank 0
  than the linear layers' (its causal attention is heavier late) and models faster than one
  split; on a link so slow that the moves cost more than they save, one split."""
  qwen, C = preset_config("qwen3.5-27b"), 131072
  fast = _setup(300e9, held_send=True, dtype_bytes=2)
  one = search.modelled_search(qwen, C, 2, fast)
  linear, full = search.kind_split_search(qwen, C, 2, fast, one)
  assert full is not None and full[0] > linear[0]
  assert _ttft(qwen, C, fast, linear, full) < 0.95 * _ttft(qwen, C, fast, one)
  slow = _setup(1e5, held_send=True, dtype_bytes=2)
  one = search.modelled_search(qwen, C, 2, slow)
  assert search.kind_split_search(qwen, C, 2, slow, one) == (one, None)


def test_a_split_per_kind_is_kv_runaheads_on_a_hybrid(hybrid):
  with pytest.raises(ValueError, match="full_partition is KV-Runahead's"):
    costmodel.simulate(hybrid, "ring", 1024, _setup(10e9), num_ranks=2, full_partition=(512, 512))
  llama = preset_config("bench-llama")
  with pytest.raises(ValueError, match="this model's layers are all full attention"):
    costmodel.simulate(llama, "kvr", 1024, _setup(10e9), num_ranks=2, full_partition=(512, 512))
  with pytest.raises(ValueError, match="sums to"):
    _ttft(hybrid, 1024, _setup(10e9), (512, 512), (500, 500))


def _fast_plan(**held) -> PartitionPlan:
  """A modelled search on two H100s whose hops are rendezvous at `bandwidth` (300 GB/s)."""
  bandwidth = held.pop("bandwidth", 300e9)
  links = Links(bandwidth, 10e-6, held_send=True)
  return PartitionPlan("search", hardware="h100-sxm", links=links, **held)


def test_search_on_a_hybrid_plans_a_split_per_kind():
  """partition "search" on a hybrid (Qwen3.5-27B at 128k; a plan, nothing compiles) gives the
  full layers their own split where it models faster: rank 0's longer, the boundaries held
  to the plan's multiple and cap. On a link too slow for the moves it keeps one split;
  "even" never splits."""
  qwen, C, mesh = preset_config("qwen3.5-27b"), 131072, make_mesh(2)
  shape = PrefillShape(qwen, "bfloat16", C, 1, C)
  fast = plan_from_shape(shape, "kvr", mesh, _fast_plan(multiple=128))
  linear, full = fast.chunks, fast.full_chunks
  assert full is not None and full[0] > linear[0] and sum(full) == C
  assert all(c % 128 == 0 for c in (*linear[:-1], *full[:-1]))
  capped = plan_from_shape(shape, "kvr", mesh, _fast_plan(max_chunk=80_000))
  assert capped.full_chunks is not None and max(*capped.chunks, *capped.full_chunks) <= 80_000
  slow = plan_from_shape(shape, "kvr", mesh, _fast_plan(bandwidth=1e5))
  assert slow.full_chunks is None
  assert plan_from_shape(shape, "kvr", mesh, "even").full_chunks is None


def test_auto_on_a_hybrid_runs_kv_runahead_on_its_split_per_kind():
  """strategy "auto" models KV-Runahead with its split per layer kind (Qwen3.5-27B at 16k on
  two rendezvous H100s: ahead of the peers there) and the plan runs that pair."""
  qwen, C, mesh = preset_config("qwen3.5-27b"), 16384, make_mesh(2)
  plan = plan_from_shape(PrefillShape(qwen, "bfloat16", C, 1, C), "auto", mesh, _fast_plan())
  choice = plan.choice
  assert plan.strategy.name == choice.strategy == "kvr"
  assert choice.full_chunks is not None and choice.full_chunks[0] > choice.chunks[0]
  assert (plan.chunks, plan.full_chunks) == (choice.chunks, choice.full_chunks)
  assert "its full layers on" in str(choice)
  setup = presets.make_setup(
    "h100-sxm", _fast_plan().links, dtype_bytes=2, **costmodel.kernel_flags(plan.kernel)
  )
  assert choice.predicted_s["kvr"] == pytest.approx(
    _ttft(qwen, C, setup, choice.chunks, choice.full_chunks)
  )
