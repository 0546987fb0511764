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

from models.config import FalconConfig, GemmaConfig, LlamaConfig, ModelConfig

# (parameter path in the NNX state, layer index (or (layer, expert)) or None, transform of the
# HF array, the shape the HF tensor must have). The shape is checked before any transform: a
# transposed or reshaped tensor with the right element count would otherwise load, silently
# wrong.
Target = tuple[
  tuple[str, ...], int | tuple[int, int] | None, Callable[[np.ndarray], np.ndarray], tuple[int, ...]
]

# A safetensors header longer than this is refused before it is read (the format's own
# reference implementation uses the same bound).
MAX_HEADER_BYTES = 100_000_000

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


def _linear_entry(param: str, in_dims: tuple[int, ...], out_dims: tuple[int, ...]):
  """(param, transform, HF shape) of a torch Linear weight [prod(out), prod(in)] that becomes
  our [*in_dims, *out_dims]."""
  hf_shape = (int(np.prod(out_dims)), int(np.prod(in_dims)))
  return param, _linear(*in_dims, *out_dims), hf_shape


def _same(w: np.ndarray) -> np.ndarray:
  return w


def _llama_targets(cfg: LlamaConfig, name: str) -> list[Target] | None:
  """Llama and the families that share its tensor names (Mistral, Qwen2, Qwen3)."""
  D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  V = cfg.vocab_size
  fixed = {
    "model.embed_tokens.weight": [(("embedding",), None, _same, (V, D))],
    "model.norm.weight": [(("norm",), None, _same, (D,))],
  }
  if not cfg.tie_embeddings:
    fixed["lm_head.weight"] = [(("lm_head",), None, lambda w: w.T, (V, D))]
  if name in fixed:
    return fixed[name]
  m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
  if not m:
    return None
  layer, rest = int(m.group(1)), m.group(2)
  per_layer = {
    "input_layernorm.weight": ("attn_norm", _same, (D,)),
    "self_attn.q_proj.weight": _linear_entry("wq", (D,), (N, H)),
    "self_attn.k_proj.weight": _linear_entry("wk", (D,), (K, H)),
    "self_attn.v_proj.weight": _linear_entry("wv", (D,), (K, H)),
    "self_attn.o_proj.weight": _linear_entry("wo", (N, H), (D,)),
    "post_attention_layernorm.weight": ("mlp_norm", _same, (D,)),
    "mlp.gate_proj.weight": _linear_entry("w_gate", (D,), (F,)),
    "mlp.up_proj.weight": _linear_entry("w_up", (D,), (F,)),
    "mlp.down_proj.weight": _linear_entry("w_down", (F,), (D,)),
  }
  if cfg.qkv_bias:  # Qwen2: [out] biases -> [heads, H]
    per_layer["self_attn.q_proj.bias"] = ("bq", lambda b: b.reshape(N, H), (N * H,))
    per_layer["self_attn.k_proj.bias"] = ("bk", lambda b: b.reshape(K, H), (K * H,))
    per_layer["self_attn.v_proj.bias"] = ("bv", lambda b: b.reshape(K, H), (K * H,))
  if cfg.qk_norm:  # Qwen3: one [H] scale shared by the heads
    per_layer["self_attn.q_norm.weight"] = ("q_norm", _same, (H,))
    per_layer["self_attn.k_norm.weight"] = ("k_norm", _same, (H,))
  if layer >= cfg.num_layers:
    return None
  if cfg.router_dim:  # a mixture of experts
    for dense in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
      del per_layer[dense]
    expert = _expert_target(cfg, rest, layer)
    if expert is not None:
      return expert
  if rest not in per_layer:
    return None
  param, fn, hf_shape = per_layer[rest]
  return [(("blocks", param), layer, fn, hf_shape)]


# A mixture of experts' tensors, per family: the router, and each expert's gate, up and down
# projections (Mixtral's w1, w3, w2).
_EXPERT_NAMES = {
  "mlp": ("gate", {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}),
  "block_sparse_moe": ("gate", {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}),
}


def _expert_target(cfg: LlamaConfig, rest: str, layer: int) -> list[Target] | None:
  """The router [E, D] -> router [D, E] of the layer, or expert e's [F, D] / [D, F] Linear
  weight -> its [D, F] / [F, D] slice of w_gate, w_up or w_down [L, E, ...] (index (l, e))."""
  D, F, E = cfg.d_model, cfg.mlp_dim, cfg.num_experts
  for prefix, (router, projections) in _EXPERT_NAMES.items():
    if rest == f"{prefix}.{router}.weight":
      return [(("blocks", "router"), layer, lambda w: w.T, (E, D))]
    m = re.fullmatch(rf"{re.escape(prefix)}\.experts\.(\d+)\.(\w+)\.weight", rest)
    if m and int(m.group(1)) < E and m.group(2) in projections:
      param = projections[m.group(2)]
      hf_shape = (D, F) if param == "w_down" else (F, D)
      return [(("blocks", param), (layer, int(m.group(1))), lambda w: w.T, hf_shape)]
  return None


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
  D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  V = cfg.vocab_size
  fixed = {
    "transformer.word_embeddings.weight": [(("embedding",), None, _same, (V, D))],
    "transformer.ln_f.weight": [(("norm_scale",), None, _same, (D,))],
    "transformer.ln_f.bias": [(("norm_bias",), None, _same, (D,))],
  }
  if not cfg.tie_embeddings:
    fixed["lm_head.weight"] = [(("lm_head",), None, lambda w: w.T, (V, D))]
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
    fused = ((N + 2 * K) * H, D)
    return [
      (("blocks", "wq"), layer, q, fused),
      (("blocks", "wk"), layer, k, fused),
      (("blocks", "wv"), layer, v, fused),
    ]
  norms = (
    {"ln_attn": "attn_norm", "ln_mlp": "mlp_norm"}
    if cfg.separate_mlp_norm
    else {"input_layernorm": "attn_norm"}
  )
  per_layer = {
    "self_attention.dense.weight": _linear_entry("wo", (N, H), (D,)),
    "mlp.dense_h_to_4h.weight": _linear_entry("w_in", (D,), (F,)),
    "mlp.dense_4h_to_h.weight": _linear_entry("w_out", (F,), (D,)),
  }
  for hf_norm, ours in norms.items():
    per_layer[f"{hf_norm}.weight"] = (f"{ours}_scale", _same, (D,))
    per_layer[f"{hf_norm}.bias"] = (f"{ours}_bias", _same, (D,))
  if rest not in per_layer:
    return None
  param, fn, hf_shape = per_layer[rest]
  return [(("blocks", param), layer, fn, hf_shape)]


# Gemma 3's norms beside Llama's names (the rest of its tensors are named as Llama's).
_GEMMA_NORMS = {
  "post_attention_layernorm.weight": "post_attn_norm",
  "pre_feedforward_layernorm.weight": "mlp_norm",
  "post_feedforward_layernorm.weight": "post_mlp_norm",
}


def _gemma_targets(cfg: GemmaConfig, name: str) -> list[Target] | None:
  m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
  if m and m.group(2) in _GEMMA_NORMS and int(m.group(1)) < cfg.num_layers:
    return [(("blocks", _GEMMA_NORMS[m.group(2)]), int(m.group(1)), _same, (cfg.d_model,))]
  return _llama_targets(cfg, name)


def hf_targets(cfg: ModelConfig, name: str) -> list[Target] | None:
  """Where Hugging Face tensor `name` goes in our model, or None if it has no place."""
  if isinstance(cfg, GemmaConfig):
    return _gemma_targets(cfg, name)
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
  """The weight files of a Hugging Face directory: model.safetensors where it exists (as
  transformers reads a directory holding both it and a sharded index), else the index's
  shards."""
  index = os.path.join(directory, "model.safetensors.index.json")
  single = os.path.join(directory, "model.safetensors")
  if os.path.exists(single):
    return [single]
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
  raise ValueError(
    f"{directory}: no model.safetensors or model.safetensors.index.json "
    "(PyTorch .bin checkpoints are not read; re-save with safe_serialization)"
  )


def iter_safetensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (name, array) from one safetensors file, memory-mapped (read on access).

  The header is checked whole before any tensor is yielded: its length is bounded, every
  tensor's byte range lies inside the data section, is exactly shape x itemsize long and
  overlaps no other (a tensor pointing at another's bytes would load silently wrong).
  """
  file_size = os.path.getsize(path)
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise ValueError(f"{path}: truncated safetensors file")
    (header_len,) = struct.unpack("<Q", raw)
    if header_len > min(MAX_HEADER_BYTES, file_size - 8):
      raise ValueError(
        f"{path}: safetensors header claims {header_len} bytes (file: {file_size} bytes, "
        f"limit {MAX_HEADER_BYTES}): not a safetensors file, or corrupt"
      )
    try:
      header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
  if not isinstance(header, dict):
    raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
  data_start = 8 + header_len
  data_size = file_size - data_start
  tensors = []
  for name, info in header.items():
    if name == "__metadata__":
      continue
    tensors.append((name, *_check_tensor_entry(path, name, info, data_size)))
  previous_end, previous_name = 0, None
  for name, _, _, begin, end in sorted(tensors, key=lambda t: (t[3], t[4])):
    if begin < previous_end:
      raise ValueError(
        f"{path}: tensors {previous_name!r} and {name!r} overlap in the file "
        f"(bytes {begin} < {previous_end}): corrupt safetensors header"
      )
    previous_end, previous_name = end, name
  for name, dtype, shape, begin, _ in tensors:
    yield name, np.memmap(path, dtype=dtype, mode="r", offset=data_start + begin, shape=shape)


def _check_tensor_entry(path: str, name: str, info, data_size: int):
  """(dtype, shape, begin, end) of one header entry, or a ValueError naming what is wrong."""
  if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
    raise ValueError(f"{path}: tensor {name!r} needs dtype, shape and data_offsets in the header")
  dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
  if dtype is None:
    raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
  shape, offsets = info["shape"], info["data_offsets"]
  if not isinstance(shape, list) or not all(
    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
  ):
    raise ValueError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
  if (
    not isinstance(offsets, list)
    or len(offsets) != 2
    or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
  ):
    raise ValueError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
  begin, end = offsets
  if not 0 <= begin <= end:
    raise ValueError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
  if end > data_size:
    raise ValueError(f"{path}: tensor {name!r} extends past the end of the file")
  expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
  if end - begin != expected:
    raise ValueError(
      f"{path}: tensor {name!r} spans {end - begin} bytes but shape {tuple(shape)} of "
      f"{info['dtype']} needs {expected}: corrupt safetensors header"
    )
  return dtype, tuple(shape), begin, end
