"""Hugging Face safetensors import: where each tensor goes (its family's
`Family.tensor_targets`, models/) and a streaming, memory-mapped reader.

Tensors are read through `np.memmap` and written straight into one preallocated buffer per
parameter, so at no point do two full copies of the weights
live in memory.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

from models.config import ModelConfig
from models.families import family_of
from models.tensor_names import Target

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


def hf_targets(cfg: ModelConfig, name: str) -> list[Target] | None:
  """Where Hugging Face tensor `name` goes in our model (its family's `tensor_targets`), or
  None if it has no place."""
  return family_of(cfg).tensor_targets(cfg, name)


def ignored_hf_tensor(cfg: ModelConfig, name: str) -> bool:
  """Tensors that legitimately have no place: a tied head saved anyway, rotary buffers (and
  what the family does not load: `family_ignores`)."""
  if name.endswith("rotary_emb.inv_freq") or family_ignores(cfg, name):
    return True
  return cfg.tie_embeddings and name == "lm_head.weight"


def family_ignores(cfg: ModelConfig, name: str) -> str | None:
  """Why the family does not load tensor `name` (a vision tower), or None."""
  ignores = family_of(cfg).ignores
  return None if ignores is None else ignores(cfg, name)


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
