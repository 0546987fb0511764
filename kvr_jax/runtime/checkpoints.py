"""Hugging Face safetensors import: tensor-name tables and a streaming, memory-mapped reader.

Each Hugging Face tensor maps to one or more stacked model parameters (Falcon's fused
query_key_value feeds wq, wk and wv). Tensors are read through `np.memmap` and written straight
into one preallocated buffer per parameter, so at no point do two full copies of the weights
live in memory.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterator

import ml_dtypes
import numpy as np

from models.config import FalconConfig, LlamaConfig, ModelConfig

# (parameter path in the NNX state, layer index or None, transform of the HF array)
Target = tuple[tuple[str, ...], int | None, Callable[[np.ndarray], np.ndarray]]

_SAFETENSORS_DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U8": np.uint8,
  "BOOL": np.bool_,
}


def _linear(*shape: int) -> Callable[[np.ndarray], np.ndarray]:
  """torch Linear weight [out, in] -> ours [in, *out_split] (x @ W form)."""
  return lambda w: w.T.reshape(shape)


def _same(w: np.ndarray) -> np.ndarray:
  return w


def _llama_targets(cfg: LlamaConfig, name: str) -> list[Target] | None:
  """Llama and the families that share its tensor names (Mistral, Qwen2, Qwen3)."""
  D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  fixed = {
    "model.embed_tokens.weight": [(("embedding",), None, _same)],
    "model.norm.weight": [(("norm",), None, _same)],
  }
  if not cfg.tie_embeddings:
    fixed["lm_head.weight"] = [(("lm_head",), None, lambda w: w.T)]
  if name in fixed:
    return fixed[name]
  m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
  if not m:
    return None
  layer, rest = int(m.group(1)), m.group(2)
  per_layer = {
    "input_layernorm.weight": ("attn_norm", _same),
    "self_attn.q_proj.weight": ("wq", _linear(D, N, H)),
    "self_attn.k_proj.weight": ("wk", _linear(D, K, H)),
    "self_attn.v_proj.weight": ("wv", _linear(D, K, H)),
    "self_attn.o_proj.weight": ("wo", _linear(N, H, D)),
    "post_attention_layernorm.weight": ("mlp_norm", _same),
    "mlp.gate_proj.weight": ("w_gate", _linear(D, F)),
    "mlp.up_proj.weight": ("w_up", _linear(D, F)),
    "mlp.down_proj.weight": ("w_down", _linear(F, D)),
  }
  if cfg.qkv_bias:  # Qwen2: [out] biases -> [heads, H]
    per_layer["self_attn.q_proj.bias"] = ("bq", lambda b: b.reshape(N, H))
    per_layer["self_attn.k_proj.bias"] = ("bk", lambda b: b.reshape(K, H))
    per_layer["self_attn.v_proj.bias"] = ("bv", lambda b: b.reshape(K, H))
  if cfg.qk_norm:  # Qwen3: one [H] scale shared by the heads
    per_layer["self_attn.q_norm.weight"] = ("q_norm", _same)
    per_layer["self_attn.k_norm.weight"] = ("k_norm", _same)
  if rest not in per_layer or layer >= cfg.num_layers:
    return None
  param, fn = per_layer[rest]
  return [(("blocks", param), layer, fn)]


def _split_falcon_qkv(cfg: FalconConfig) -> list[Callable[[np.ndarray], np.ndarray]]:
  """Three views of the fused query_key_value weight [(N + 2K) H, D] -> wq, wk, wv."""
  D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  G = N // K
  if cfg.qkv_layout == "grouped":  # per KV group: G queries, then one key, then one value

    def view(w):
      return w.T.reshape(D, K, G + 2, H)

    return [
      lambda w: view(w)[:, :, :G].reshape(D, N, H),
      lambda w: view(w)[:, :, G],
      lambda w: view(w)[:, :, G + 1],
    ]
  if cfg.qkv_layout == "multi_query":  # N queries, then the one key, then the one value

    def view(w):
      return w.T.reshape(D, N + 2, H)

    return [
      lambda w: view(w)[:, :N],
      lambda w: view(w)[:, N : N + 1],
      lambda w: view(w)[:, N + 1 : N + 2],
    ]

  def view(w):  # interleaved: per head, (q, k, v)
    return w.T.reshape(D, N, 3, H)

  return [lambda w: view(w)[:, :, 0], lambda w: view(w)[:, :, 1], lambda w: view(w)[:, :, 2]]


def _falcon_targets(cfg: FalconConfig, name: str) -> list[Target] | None:
  D, N, H, F = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
  fixed = {
    "transformer.word_embeddings.weight": [(("embedding",), None, _same)],
    "transformer.ln_f.weight": [(("norm_scale",), None, _same)],
    "transformer.ln_f.bias": [(("norm_bias",), None, _same)],
  }
  if not cfg.tie_embeddings:
    fixed["lm_head.weight"] = [(("lm_head",), None, lambda w: w.T)]
  if name in fixed:
    return fixed[name]
  m = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)", name)
  if not m:
    return None
  layer, rest = int(m.group(1)), m.group(2)
  if layer >= cfg.num_layers:
    return None
  if rest == "self_attention.query_key_value.weight":
    q, k, v = _split_falcon_qkv(cfg)
    return [
      (("blocks", "wq"), layer, q),
      (("blocks", "wk"), layer, k),
      (("blocks", "wv"), layer, v),
    ]
  norms = (
    {"ln_attn": "attn_norm", "ln_mlp": "mlp_norm"}
    if cfg.separate_mlp_norm
    else {"input_layernorm": "attn_norm"}
  )
  per_layer = {
    "self_attention.dense.weight": ("wo", _linear(N, H, D)),
    "mlp.dense_h_to_4h.weight": ("w_in", _linear(D, F)),
    "mlp.dense_4h_to_h.weight": ("w_out", _linear(F, D)),
  }
  for hf_norm, ours in norms.items():
    per_layer[f"{hf_norm}.weight"] = (f"{ours}_scale", _same)
    per_layer[f"{hf_norm}.bias"] = (f"{ours}_bias", _same)
  if rest not in per_layer:
    return None
  param, fn = per_layer[rest]
  return [(("blocks", param), layer, fn)]


def hf_targets(cfg: ModelConfig, name: str) -> list[Target] | None:
  """Where Hugging Face tensor `name` goes in our model, or None if it has no place."""
  if isinstance(cfg, LlamaConfig):
    return _llama_targets(cfg, name)
  if isinstance(cfg, FalconConfig):
    return _falcon_targets(cfg, name)
  raise ValueError(f"no weight table for architecture {cfg.architecture!r}")


def ignored_hf_tensor(cfg: ModelConfig, name: str) -> bool:
  """Tensors that legitimately have no place: a tied head saved anyway, rotary buffers."""
  if name.endswith("rotary_emb.inv_freq"):
    return True
  return cfg.tie_embeddings and name == "lm_head.weight"


def safetensors_files(directory: str) -> list[str]:
  """The weight files of a Hugging Face directory (single file or sharded index)."""
  index = os.path.join(directory, "model.safetensors.index.json")
  single = os.path.join(directory, "model.safetensors")
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index}: no `weight_map` in the index")
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not os.path.exists(os.path.join(directory, f))]
    if missing:
      raise ValueError(f"{index} lists shard file(s) that do not exist: {missing}")
    return [os.path.join(directory, f) for f in files]
  if os.path.exists(single):
    return [single]
  raise ValueError(
    f"{directory}: no model.safetensors or model.safetensors.index.json "
    "(PyTorch .bin checkpoints are not read; re-save with safe_serialization)"
  )


def iter_safetensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (name, array) from one safetensors file, memory-mapped (read on access)."""
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise ValueError(f"{path}: truncated safetensors file")
    (header_len,) = struct.unpack("<Q", raw)
    try:
      header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
  data_start = 8 + header_len
  file_size = os.path.getsize(path)
  for name, info in header.items():
    if name == "__metadata__":
      continue
    dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
      raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    begin, end = info["data_offsets"]
    if data_start + end > file_size:
      raise ValueError(f"{path}: tensor {name!r} extends past the end of the file")
    shape = tuple(info["shape"])
    array = np.memmap(path, dtype=dtype, mode="r", offset=data_start + begin, shape=shape)
    yield name, array
