"""Presets, Hugging Face import errors, and the Orbax round trip."""

import collections
import gc
import json
import os
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kvr_jax
from kvr_jax.runtime import loading
from kvr_jax.runtime.loading import preset_config
from tests import hf_fixtures


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp("llama-gqa")
  hf_fixtures.make_hf_model("llama-gqa").save_pretrained(directory)
  return str(directory)


def _copy_with(hf_dir, tmp_path, *, tensors=None, config=None):
  for name in os.listdir(hf_dir):
    shutil.copy(os.path.join(hf_dir, name), tmp_path / name)
  if tensors is not None:
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    tensors(weights)
    save_file(weights, str(tmp_path / "model.safetensors"))
  if config is not None:
    with open(os.path.join(hf_dir, "config.json")) as f:
      data = json.load(f)
    config(data)
    with open(tmp_path / "config.json", "w") as f:
      json.dump(data, f)
  return str(tmp_path)


@pytest.mark.default_cases("tiny-falcon", "tiny-gemma")
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-falcon", "tiny-gemma"])
def test_tiny_presets_are_about_one_million_parameters(name):
  model = kvr_jax.load_model(name)
  count = sum(x.size for x in __import__("jax").tree.leaves(model.state))
  assert count == model.config.num_params()
  assert 0.5e6 < count < 1.5e6


def test_presets_are_deterministic():
  a = kvr_jax.load_model("tiny-llama")
  b = kvr_jax.load_model("tiny-llama")
  np.testing.assert_array_equal(
    np.asarray(a.state["embedding"][...]), np.asarray(b.state["embedding"][...])
  )


@pytest.mark.parametrize(
  "name,params", [("llama-2-7b", 6.74e9), ("llama-3-8b", 8.03e9), ("falcon-7b", 6.92e9)]
)
def test_real_shape_presets(name, params):
  assert preset_config(name).num_params() == pytest.approx(params, rel=2e-3)


@pytest.mark.parametrize(
  "name,params",
  # The parameter counts the Hugging Face model cards state for these checkpoints.
  [("mistral-7b", 7_241_732_096), ("qwen2.5-7b", 7_615_616_512), ("qwen3-8b", 8_190_735_360)],
)
def test_family_presets_have_the_published_parameter_counts(name, params):
  config = preset_config(name)
  assert config.num_params() == params
  switches = (config.sliding_window, config.qkv_bias, config.qk_norm)
  assert (
    switches
    == {
      "mistral-7b": (4096, False, False),
      "qwen2.5-7b": (None, True, False),
      "qwen3-8b": (None, False, True),
    }[name]
  )


@pytest.mark.parametrize(
  "name,params",
  # The published (safetensors) parameter counts of Meta's Llama 3.1 checkpoints.
  [("llama-3.1-8b", 8_030_261_248), ("llama-3.1-70b", 70_553_706_496)],
)
def test_long_context_presets(name, params):
  config = preset_config(name)
  assert config.num_params() == params
  assert config.max_position_embeddings == 131_072
  assert (config.rope.type, config.rope.factor, config.rope.theta) == ("llama3", 8.0, 500_000.0)


def test_a_directory_named_like_a_preset_is_refused_not_preferred(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  os.mkdir("tiny-llama")
  with pytest.raises(ValueError, match="both a preset and a directory here; pass ./tiny-llama"):
    kvr_jax.load_model("tiny-llama")
  with pytest.raises(ValueError, match="neither a Hugging Face directory"):
    kvr_jax.load_model("./tiny-llama")  # the directory, as asked


def test_saving_into_an_unwritable_or_file_path_is_refused_before_orbax(tmp_path):
  """Orbax's writer threads, failing on an unwritable directory, used to keep the
  interpreter alive after its traceback (a hang); the checks come first."""
  model = kvr_jax.load_model("tiny-llama")
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="is a file"):
    kvr_jax.save_model(model, str(tmp_path / "file"))
  locked = tmp_path / "locked"
  locked.mkdir()
  locked.chmod(0o500)
  try:
    # Root ignores the mode bits; /proc/self is a directory nobody may write.
    target = "/proc/self" if os.access(locked, os.W_OK) else str(locked)
    with pytest.raises(ValueError, match="not writable"):
      kvr_jax.save_model(model, target)
  finally:
    locked.chmod(0o700)


def test_unknown_preset_and_dtype():
  with pytest.raises(ValueError, match="unknown preset 'tiny-gpt'"):
    kvr_jax.load_model("tiny-gpt")
  with pytest.raises(ValueError, match="unknown dtype 'float8'"):
    kvr_jax.load_model("tiny-llama", dtype="float8")
  with pytest.raises(ValueError, match="no such directory"):
    kvr_jax.load_model("./does/not/exist")


def test_unknown_tensor_is_named(hf_dir, tmp_path):
  def add(weights):
    weights["model.layers.0.self_attn.rotary_extra.weight"] = np.zeros(3, np.float32)

  path = _copy_with(hf_dir, tmp_path, tensors=add)
  with pytest.raises(ValueError, match="rotary_extra"):
    kvr_jax.load_model(path)


def test_missing_tensor_is_named(hf_dir, tmp_path):
  path = _copy_with(hf_dir, tmp_path, tensors=lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(ValueError, match=r"blocks\.w_up \(layers \[1\]"):
    kvr_jax.load_model(path)


def test_shape_mismatch_is_named(hf_dir, tmp_path):
  def shrink(weights):
    weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)

  path = _copy_with(hf_dir, tmp_path, tensors=shrink)
  with pytest.raises(ValueError, match="k_proj.weight.*shape"):
    kvr_jax.load_model(path)


@pytest.mark.parametrize(
  "edit,message",
  [
    (lambda c: c.update(model_type="gpt2"), "model_type"),
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(rope_parameters={"rope_type": "longrope", "factor": 4.0}), "longrope"),
    # Both layouts naming two different scalings: a reader may honour either, so it is
    # refused (a default `rope_parameters` beside YaRN's `rope_scaling` reads as YaRN, as
    # transformers reads it: tests/test_config_fidelity.py).
    (
      lambda c: c.update(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        rope_scaling={"rope_type": "yarn", "factor": 4.0},
      ),
      r"`rope_scaling` \('yarn'\) and `rope_parameters` \('linear'\) disagree",
    ),
  ],
)
def test_unsupported_config_fields(hf_dir, tmp_path, edit, message):
  path = _copy_with(hf_dir, tmp_path, config=edit)
  with pytest.raises(ValueError, match=message):
    kvr_jax.load_model(path)


def test_alibi_falcon_refused():
  from models.families import config_from_hf

  with pytest.raises(ValueError, match="ALiBi"):
    config_from_hf(
      {
        "model_type": "falcon",
        "alibi": True,
        "vocab_size": 8,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
      }
    )


def test_orbax_round_trip(hf_dir, tmp_path):
  model = kvr_jax.load_model(hf_dir)
  kvr_jax.save_model(model, str(tmp_path / "ckpt"))
  restored = kvr_jax.load_model(str(tmp_path / "ckpt"))
  assert restored.config == model.config
  tokens = np.arange(20)[None] % model.config.vocab_size
  np.testing.assert_array_equal(
    np.asarray(restored.module(tokens)), np.asarray(model.module(tokens))
  )
  with pytest.raises(ValueError, match="already holds a checkpoint"):
    kvr_jax.save_model(model, str(tmp_path / "ckpt"))


def test_corrupt_or_partial_orbax_checkpoint(tmp_path):
  model = kvr_jax.load_model("tiny-llama")
  ckpt = tmp_path / "ckpt"
  kvr_jax.save_model(model, str(ckpt))
  # Truncate every data file: the restore must fail with a clear error, not return garbage.
  for root, _, files in os.walk(ckpt / "state"):
    for name in files:
      with open(os.path.join(root, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(root, name)) // 3)
  with pytest.raises(ValueError, match="corrupt or partial"):
    kvr_jax.load_model(str(ckpt))
  shutil.rmtree(ckpt / "state")
  with pytest.raises(ValueError, match="incomplete"):
    kvr_jax.load_model(str(ckpt))


def test_tokenizer_files_are_used_when_present(hf_dir, tmp_path):
  """A Hugging Face directory with tokenizer files gets a tokenizer: text in, text out."""
  path = _copy_with(hf_dir, tmp_path)
  hf_fixtures.save_word_tokenizer(path)
  model = kvr_jax.load_model(path)
  assert model.tokenizer is not None
  out = kvr_jax.generate(model, "w1 w2 w3 w4", max_new_tokens=4)
  ids = np.asarray([model.tokenizer("w1 w2 w3 w4")["input_ids"]])
  np.testing.assert_array_equal(out.tokens, kvr_jax.generate(model, ids, 4).tokens)
  assert isinstance(out.text[0], str) and len(out.text[0].split()) == 4


def test_loading_holds_one_copy_of_the_weights(tmp_path):
  """Peak host memory while loading stays near one copy of the weights: tensors are
  memory-mapped and written straight into one buffer per parameter (numpy allocations are
  traced; reading every tensor into a dict first and then stacking would show 2x)."""
  import tracemalloc

  import transformers

  config = transformers.LlamaConfig(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
  )
  transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)  # about 55 MB of float32
  weights_bytes = os.path.getsize(tmp_path / "model.safetensors")
  loading.load_hf_model(str(tmp_path))  # warm caches so only the load itself is traced
  tracemalloc.start()
  try:
    loading.load_hf_model(str(tmp_path))
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < 1.3 * weights_bytes, (peak, weights_bytes)


def device_buffers() -> set[tuple[int, int, int]]:
  """(device id, buffer address, bytes) of every live device buffer; buffers that several
  arrays share (a placement assembled from another's) appear once."""
  return {
    (shard.device.id, shard.data.unsafe_buffer_pointer(), shard.data.nbytes)
    for array in jax.live_arrays()
    for shard in array.addressable_shards
  }


@pytest.mark.e2e  # slow (compiling): the end-to-end tier
def test_at_most_one_weight_copy_per_device_whatever_strategies_ran():
  """After single, tsp, kvr and ring prefills and decodes on 4 of 8 emulated devices, each of
  the 4 holds one copy of the weights and the others nothing (outputs dropped): the weights
  loaded on the default device are the mesh replica's copy there, and the single-device
  oracle reuses it."""
  gc.collect()
  before = device_buffers()
  model = kvr_jax.load_model("tiny-llama")
  weight_bytes = sum(a.nbytes for a in jax.tree.leaves(model.state))
  tokens = kvr_jax.synthetic_prompt(model.config.vocab_size, 32)
  mesh = kvr_jax.make_mesh(4)  # devices 4-7 must hold nothing new
  for strategy in ("single", "tsp", "kvr", "ring"):
    result = kvr_jax.generate(model, tokens, 1, strategy=strategy, mesh=mesh)
    del result
  gc.collect()
  per_device = collections.Counter()
  for device, _, nbytes in device_buffers() - before:
    per_device[device] += nbytes
  copies = {d: round(b / weight_bytes, 2) for d, b in per_device.items()}
  assert copies == {d.id: 1.0 for d in mesh.devices.flat}, copies


def test_auto_dtype_is_float32_on_cpus_and_bfloat16_on_accelerators():
  assert kvr_jax.load_model("tiny-llama").dtype == jnp.float32  # this machine: a CPU
  assert kvr_jax.load_model("tiny-llama", dtype="auto").dtype == jnp.float32
  assert loading.auto_dtype("gpu") == jnp.bfloat16
  assert loading.auto_dtype("tpu") == jnp.bfloat16
  assert loading.auto_dtype("cpu") == jnp.float32


# --- nothing loads silently wrong -------------------------------------------------------------


def test_orbax_restores_the_saved_dtype_unless_asked(tmp_path):
  kvr_jax.save_model(kvr_jax.load_model("tiny-llama", dtype="bfloat16"), str(tmp_path / "bf16"))
  assert kvr_jax.load_model(str(tmp_path / "bf16")).dtype == jnp.bfloat16
  assert kvr_jax.load_model(str(tmp_path / "bf16"), dtype="float32").dtype == jnp.float32
  assert kvr_jax.load_model("tiny-llama").dtype == jnp.float32  # presets: float32 by default


@pytest.mark.parametrize(
  "name,shape",
  [
    ("model.layers.0.self_attn.k_proj.weight", "transposed"),  # (32, 64) stored as (64, 32)
    ("model.layers.0.self_attn.q_proj.weight", (32, 128)),  # (64, 64): same element count
  ],
)
def test_a_tensor_with_the_right_size_but_the_wrong_shape_is_refused(hf_dir, tmp_path, name, shape):
  def reshape(weights):
    w = weights[name]
    weights[name] = np.ascontiguousarray(w.T if shape == "transposed" else w.reshape(shape))

  path = _copy_with(hf_dir, tmp_path, tensors=reshape)
  with pytest.raises(ValueError, match=re.escape(name) + r".*has shape .* needs \("):
    kvr_jax.load_model(path)


def _rewrite_header(path, edit):
  """Rewrites a safetensors file's JSON header in place through `edit(header)`."""
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    data = f.read()
  edit(header)
  raw = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + data)


def _point_at(header, name, other):
  header[name]["data_offsets"] = list(header[other]["data_offsets"])


@pytest.mark.parametrize(
  "edit,message",
  [
    # One tensor pointed at another's bytes (same shape): would load silently wrong.
    (
      lambda h: _point_at(
        h, "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"
      ),
      "overlap",
    ),
    (lambda h: h["model.norm.weight"].update(data_offsets=[0, 4]), "spans 4 bytes"),
    (lambda h: h["model.norm.weight"].update(data_offsets=[10**12, 10**12 + 256]), "past the end"),
    (lambda h: h["model.norm.weight"].update(data_offsets=[8, 4]), "invalid data_offsets"),
    (lambda h: h["model.norm.weight"].update(shape=[-64]), "invalid shape"),
  ],
)
def test_safetensors_offsets_are_checked(hf_dir, tmp_path, edit, message):
  path = _copy_with(hf_dir, tmp_path)
  _rewrite_header(os.path.join(path, "model.safetensors"), edit)
  with pytest.raises(ValueError, match=message):
    kvr_jax.load_model(path)


def test_a_huge_safetensors_header_length_is_refused(hf_dir, tmp_path):
  path = _copy_with(hf_dir, tmp_path)
  with open(os.path.join(path, "model.safetensors"), "r+b") as f:
    f.write(struct.pack("<Q", 2**62))
  with pytest.raises(ValueError, match="header claims"):
    kvr_jax.load_model(path)


def test_config_json_that_is_not_an_object(hf_dir, tmp_path):
  path = _copy_with(hf_dir, tmp_path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump([1, 2], f)
  with pytest.raises(ValueError, match="config.json holds a JSON list"):
    kvr_jax.load_model(path)


def test_save_into_a_hugging_face_directory_is_refused(hf_dir, tmp_path):
  path = _copy_with(hf_dir, tmp_path)
  with pytest.raises(ValueError, match="holds a Hugging Face checkpoint"):
    kvr_jax.save_model(kvr_jax.load_model(path), path)
  assert kvr_jax.load_model(path).source.startswith("hf:")


def test_a_failed_orbax_restore_prints_no_tracebacks(tmp_path, capfd):
  kvr_jax.save_model(kvr_jax.load_model("tiny-llama"), str(tmp_path / "ckpt"))
  for root, _, files in os.walk(tmp_path / "ckpt" / "state"):
    for name in files:
      if os.path.basename(root) == "d":  # the array data, not the metadata
        with open(os.path.join(root, name), "r+b") as f:
          f.truncate(100)
  capfd.readouterr()
  with pytest.raises(ValueError, match="corrupt or partial"):
    kvr_jax.load_model(str(tmp_path / "ckpt"))
  captured = capfd.readouterr()
  assert "Traceback" not in captured.err and len(captured.err.splitlines()) < 5, captured.err


def test_a_directory_with_a_single_file_and_a_sharded_index_loads_as_transformers_does(tmp_path):
  """Both model.safetensors and an index with its shards, holding different weights:
  transformers reads the single file, and so does the loader (logits within 1e-4)."""
  import transformers

  hf_fixtures.make_hf_model("llama-gqa", seed=0).save_pretrained(tmp_path, max_shard_size="20KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  other = tmp_path / "other"
  hf_fixtures.make_hf_model("llama-gqa", seed=1).save_pretrained(other)
  shutil.copy(other / "model.safetensors", tmp_path / "model.safetensors")
  tokens = np.random.RandomState(2).randint(0, hf_fixtures.VOCAB, (1, 10))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
  want = hf_fixtures.hf_logits(hf_model, tokens)
  got = np.asarray(kvr_jax.load_model(str(tmp_path), "float32").module(tokens))
  assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4


def test_the_memory_report_takes_a_model_directory(hf_dir, tmp_path):
  """compiled_memory reads a Hugging Face or kvr-jax directory's architecture (no weights) as
  load_model would; a directory holding neither is refused by name."""
  from kvr_jax.runtime.loading import config_of

  model = kvr_jax.load_model(hf_dir, "float32")
  kvr_jax.save_model(model, str(tmp_path / "orbax"))
  assert config_of(hf_dir) == model.config == config_of(str(tmp_path / "orbax"))
  kwargs = dict(context_len=64, num_ranks=2, dtype="float32")
  assert kvr_jax.compiled_memory(hf_dir, "kvr", **kwargs) == kvr_jax.compiled_memory(
    model.config, "kvr", **kwargs
  )
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="holds neither a Hugging Face config.json"):
    kvr_jax.compiled_memory(str(tmp_path / "empty"), "kvr", **kwargs)


@pytest.mark.parametrize(
  "name,params",
  # transformers' own count of the published text decoders (Gemma3ForCausalLM on the meta
  # device; the released checkpoints add a ~0.4B vision tower).
  [("gemma-3-27b", 27_009_346_304), ("gemma-3-12b", 11_766_034_176)],
)
def test_gemma_presets_have_the_published_shapes(name, params):
  config = preset_config(name)
  assert config.num_params() == params
  # Five layers of 1024-token windows to one full layer, each kind with its own RoPE.
  assert config.windows[:6] == (1024,) * 5 + (None,)
  assert sum(w is None for w in config.windows) == config.num_layers // 6
  assert (config.rope.theta, config.local_rope.theta) == (1e6, 1e4)
