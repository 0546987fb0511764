"""Weights read straight into their tensor-parallel shards (`load_model(..., mesh=)`): every
Hugging Face tensor and Orbax slice lands on its ("ranks", "model") devices as the piece
kvr_jax.runtime.tensor_parallel gives it, equal to the weights loaded whole; no device holds a
whole split parameter, and the host never holds more than a few tensors (what makes a 70B
checkpoint loadable over devices that cannot hold it). The prefill on such a model is in
test_tensor_parallel (test_a_model_loaded_split_prefills_like_the_whole_one).
"""

import collections
import os
import re
import subprocess
import sys
import tracemalloc

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import kvr_jax
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.mesh import MODEL_AXIS
from tests import hf_fixtures


def _llama(**sizes):
  """A random transformers Llama (seed 0): by default large enough that one tensor (the
  2048 x 256 embedding, 2 MiB) is a small part of the whole (19 MiB), with 8 query heads and
  2 KV heads (fewer than 4 shards); `sizes` override the config's fields."""
  fields = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
  )
  config = transformers.LlamaConfig(**{**fields, **sizes})
  config._attn_implementation = "eager"
  torch.manual_seed(0)
  return hf_fixtures.randomize(transformers.LlamaForCausalLM(config), 0)


def _llama_dir(directory):
  _llama().save_pretrained(directory)
  return str(directory)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  return _llama_dir(tmp_path_factory.mktemp("llama-split"))


def _load_traced(*args, **kwargs):
  """load_model's result and the peak of the host memory numpy and Python allocated during
  it (tracemalloc sees numpy's buffers; memory-mapped file pages and device buffers are not
  allocations)."""
  tracemalloc.start()
  try:
    model = kvr_jax.load_model(*args, **kwargs)
    return model, tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()


def assert_split_like(split, whole, mesh):
  """Every leaf of the split model equals the whole one's, and each device holds exactly
  its tensor-parallel piece of it: the split axis cut m ways, KV weights whole where K < m."""
  m = mesh.shape[MODEL_AXIS]
  specs = tensor_parallel.own_state_specs(whole.config, whole.state, m)
  leaves = jax.tree_util.tree_leaves_with_path(whole.state)
  for (path, want), got, spec in zip(
    leaves, jax.tree.leaves(split.state), jax.tree.leaves(specs), strict=True
  ):
    name = ".".join(tensor_parallel.path_names(path)[:2])
    assert got.sharding.mesh == mesh and got.sharding.spec == spec, (name, got.sharding)
    piece = list(want.shape)
    if MODEL_AXIS in spec:
      piece[list(spec).index(MODEL_AXIS)] //= m
    assert {s.data.shape for s in got.addressable_shards} == {tuple(piece)}, name
    assert got.dtype == want.dtype, name
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


def _bytes_sent_per_device(monkeypatch):
  """Counts, per device, the bytes of every array `jax.device_put` places on it."""
  sent = collections.Counter()
  device_put = jax.device_put

  def counting(*args, **kwargs):
    out = device_put(*args, **kwargs)
    for array in jax.tree.leaves(out):
      for shard in array.addressable_shards:
        sent[shard.device] += shard.data.nbytes
    return out

  monkeypatch.setattr(jax, "device_put", counting)
  return sent


@pytest.mark.default_cases("shape1")
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_hugging_face_tensors_go_straight_to_their_shards(llama_dir, shape, monkeypatch):
  """2 x 4 (2 KV heads whole on every shard) and 4 x 2 (one KV head per shard): the split
  weights equal the whole ones; every device is sent its pieces only; and the host's peak
  while loading split stays under two of the largest tensor (one read and its transposed
  copy), where loading whole holds every weight."""
  mesh = kvr_jax.make_mesh(*shape[:1], model=shape[1])
  kvr_jax.load_model(llama_dir, "float32", mesh=mesh)  # imports and the stacking programs
  whole, whole_peak = _load_traced(llama_dir, "float32")
  sent = _bytes_sent_per_device(monkeypatch)
  split, split_peak = _load_traced(llama_dir, "float32", mesh=mesh)
  monkeypatch.undo()
  # Each device was sent exactly its own pieces, never a whole tensor to cut there.
  held = collections.Counter()
  for leaf in jax.tree.leaves(split.state):
    for shard in leaf.addressable_shards:
      held[shard.device] += shard.data.nbytes
  assert sent == held, (sent, held)
  assert split.split_mesh == mesh and whole.split_mesh is None
  assert "split over" in repr(split)
  assert_split_like(split, whole, mesh)
  weights = sum(x.nbytes for x in jax.tree.leaves(whole.state))
  largest = max(x.nbytes for x in load_file(os.path.join(llama_dir, "model.safetensors")).values())
  assert whole_peak >= weights  # the probe sees host copies
  assert split_peak < 2 * largest < weights / 4, (split_peak, largest, weights)


def test_falcon_fused_qkv_and_bfloat16_split(tmp_path):
  """Falcon-40B form (one fused query_key_value tensor feeding wq, wk, wv; 2 KV heads) read
  into 1 x 2 shards in bfloat16: equal to the whole bfloat16 load."""
  directory = tmp_path / "falcon"
  hf_fixtures.make_hf_model("falcon-40b-form").save_pretrained(directory)
  mesh = kvr_jax.make_mesh(1, model=2)
  whole = kvr_jax.load_model(str(directory), "bfloat16")
  assert_split_like(kvr_jax.load_model(str(directory), "bfloat16", mesh=mesh), whole, mesh)


@pytest.mark.default_cases("float32")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_restores_each_devices_slices(llama_dir, tmp_path, dtype):
  """An Orbax checkpoint (saved float32) restored onto 2 x 4: each device reads its slices,
  cast on the way (bfloat16) or not; equal to the whole restore."""
  saved = str(tmp_path / "orbax")
  kvr_jax.save_model(kvr_jax.load_model(llama_dir, "float32"), saved)
  mesh = kvr_jax.make_mesh(2, model=4)
  whole = kvr_jax.load_model(saved, dtype)
  split = kvr_jax.load_model(saved, dtype, mesh=mesh)
  assert split.source == whole.source and split.dtype == whole.dtype
  assert_split_like(split, whole, mesh)


def test_a_split_model_saves_and_restores_whole(tmp_path):
  """A model loaded split saves like any other: restored whole, it is the preset."""
  mesh = kvr_jax.make_mesh(2, model=2)
  split = kvr_jax.load_model("tiny-llama", "float32", mesh=mesh)
  kvr_jax.save_model(split, str(tmp_path / "saved"))
  restored = kvr_jax.load_model(str(tmp_path / "saved"))
  assert restored.split_mesh is None
  for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(split.state), strict=True):
    assert len(got.sharding.device_set) == 1  # whole, not split as it was saved
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # On a machine with fewer devices than the mesh it was saved from: restored whole too.
  script = (
    "import kvr_jax, jax, numpy as np\n"
    f"m = kvr_jax.load_model({str(tmp_path / 'saved')!r})\n"
    "print(len(jax.devices()), m.split_mesh, float(np.asarray(m.state.embedding[...]).sum()))\n"
  )
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  devices, split_mesh, total = proc.stdout.split()[-3:]
  want = float(np.asarray(restored.state.embedding[...]).sum())
  assert (devices, split_mesh) == ("1", "None") and float(total) == pytest.approx(want)


def test_split_loading_refuses_meshes_it_cannot_use(llama_dir):
  """Before any tensor is read: a 1-D mesh, a non-mesh, and a model axis that does not split
  the heads (8 query heads, 2 KV heads: model=3 on 6 devices)."""
  with pytest.raises(ValueError, match=re.escape("over a ('ranks', 'model') mesh")):
    kvr_jax.load_model("tiny-llama", mesh=kvr_jax.make_mesh(4))
  with pytest.raises(ValueError, match="must be a jax.sharding.Mesh"):
    kvr_jax.load_model("tiny-llama", mesh="2x4")
  with pytest.raises(ValueError, match=re.escape("model_parallel=3 must divide num_heads (8)")):
    kvr_jax.load_model(llama_dir, mesh=kvr_jax.make_mesh(2, model=3))
  with pytest.raises(ValueError, match=re.escape("model_parallel=8 must divide num_heads (4)")):
    kvr_jax.load_model("tiny-llama", mesh=kvr_jax.make_mesh(1, model=8))
  assert os.path.isdir(llama_dir)


def test_kv_heads_are_repeated_into_their_shards_without_a_whole_copy(monkeypatch):
  """K = 2 < m = 4: the prefill's placement repeats the loaded (whole per shard) wk and wv
  inside one program per weight whose per-device output is only the device's head and whose
  temporaries are nothing: never the m/K-times-larger repeated weight on a device."""
  from kvr_jax.runtime import model as loading  # where the Model handle places its weights

  mesh = kvr_jax.make_mesh(2, model=4)
  split = kvr_jax.load_model("tiny-llama", "float32", mesh=mesh)
  programs = []
  repeater = loading._head_repeater

  def recording(sharding, repeats, axis):
    program = repeater(sharding, repeats, axis)
    programs.append(program)
    return program

  monkeypatch.setattr(loading, "_head_repeater", recording)
  placed = split.state_split_over(mesh)
  assert len(programs) == 2  # wk and wv
  for name, program in zip(("wk", "wv"), programs, strict=True):  # placed in state order
    loaded, used = split.state["blocks"][name][...], placed["blocks"][name][...]
    analysis = program.lower(loaded).compile().memory_analysis()
    shard_bytes = used.addressable_shards[0].data.nbytes
    assert used.shape[2] == 4 and shard_bytes == loaded.nbytes // 2, name
    assert analysis.output_size_in_bytes == shard_bytes, name
    assert analysis.temp_size_in_bytes < shard_bytes, name


def test_eleven_layers_load_in_layer_order_whole_and_split(tmp_path):
  """A checkpoint of 11 layers: `layers.10` sorts before `layers.2` as text, so stacking the
  per-layer tensors in file order would put layer 10 third. Whole and split over a 2 x 2
  mesh, the logits match transformers' within 1e-4."""
  sizes = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_attention_heads=4)
  hf_model = _llama(**sizes, num_hidden_layers=11, max_position_embeddings=64)
  hf_model.save_pretrained(tmp_path)
  tokens = np.random.RandomState(3).randint(0, 128, (1, 12))
  want = hf_fixtures.hf_logits(hf_model, tokens)
  for mesh in (None, kvr_jax.make_mesh(2, model=2)):
    model = kvr_jax.load_model(str(tmp_path), "float32", mesh=mesh)
    result = kvr_jax.prefill(model, tokens, "kvr", mesh=mesh or kvr_jax.make_mesh(2))
    got = np.asarray(result.logits)
    err = np.abs(got - want[:, -1]).max() / np.abs(want).max()
    assert err <= 1e-4, (mesh, err)
