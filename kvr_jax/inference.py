"""`prefill` and `generate`: one API over the single-device oracle, TSP and KV-Runahead.

Every input is validated here, before anything is traced or compiled.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from kvr_jax import decode, runahead, tsp
from kvr_jax.loading import Model, global_array
from kvr_jax.mesh import AXIS, check_mesh, last_rank_device, make_mesh
from kvr_jax.partition import PartitionPlan, resolve_partition
from models.layers import ATTENTION_KINDS

STRATEGIES = ("single", "tsp", "kvr")
TRACE_COUNT = {"single": 0}
_MEASURED_PARTITIONS: dict = {}


@dataclasses.dataclass
class PrefillResult:
  """What a prefill hands to decode.

  logits: [B, V] float32, the last prompt position. k_cache, v_cache: [L, B, S, K, H] with
  S = prompt_len, on `device` (for KV-Runahead: the last rank's device, where the paper leaves
  the cache). With a mesh spanning processes, only the process of the last rank holds them;
  elsewhere they are None (`is_local` is False).
  """

  logits: jax.Array
  k_cache: jax.Array
  v_cache: jax.Array
  prompt_len: int
  strategy: str
  partition: tuple[int, ...] | None = None

  @property
  def is_local(self) -> bool:
    return self.logits is not None

  @property
  def device(self):
    return next(iter(self.k_cache.devices()))

  def layer_cache(self, layer: int) -> tuple[jax.Array, jax.Array]:
    """(K, V) of one layer, each [B, S, K, H]."""
    return self.k_cache[layer], self.v_cache[layer]


@dataclasses.dataclass
class GenerationResult:
  """tokens: [B, n] new token ids (rows that hit EOS early are padded with EOS);
  text: the decoded new tokens per row when the model has a tokenizer. Both are None in the
  processes that do not hold the last rank (jax.distributed)."""

  tokens: np.ndarray | None
  text: list[str] | None
  prefill: PrefillResult


def _check_tokens(model: Model, tokens) -> np.ndarray:
  try:
    array = np.asarray(tokens)
  except ValueError:  # numpy refuses ragged nested lists
    raise ValueError(
      "`tokens` must be a [B, T] array of token ids with equal-length rows "
      "(batched prompts must have the same length)"
    ) from None
  if array.dtype == object:
    raise ValueError("`tokens` must be a [B, T] array of token ids with equal-length rows")
  if array.ndim == 1:
    array = array[None]
  if array.ndim != 2:
    raise ValueError(f"`tokens` must be [B, T] token ids, got shape {array.shape}")
  if array.size == 0 or array.shape[1] == 0:
    raise ValueError(f"the prompt is empty (tokens of shape {array.shape})")
  if not np.issubdtype(array.dtype, np.integer):
    raise ValueError(f"`tokens` must be integer token ids, got dtype {array.dtype}")
  vocab = model.config.vocab_size
  bad = (array < 0) | (array >= vocab)
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
      f"token id {int(array[first])} at {first} is outside the vocabulary [0, {vocab})"
    )
  if array.shape[1] > model.config.max_position_embeddings:
    raise ValueError(
      f"prompt of {array.shape[1]} tokens exceeds max_position_embeddings="
      f"{model.config.max_position_embeddings}"
    )
  return array.astype(np.int32)


@functools.lru_cache(maxsize=32)
def _compiled_single(graphdef, attention: str = "dense"):
  @jax.jit
  def run(state, tokens_BT):
    TRACE_COUNT["single"] += 1
    model = nnx.merge(graphdef, state)
    x_BTD, k_LBTKH, v_LBTKH = model.forward(tokens_BT, attention)
    return model.logits(x_BTD[:, -1:])[:, 0], k_LBTKH, v_LBTKH

  return run


def _shard_on(array: jax.Array, device) -> jax.Array | None:
  """The single-device piece of a rank-sharded output that lives on `device`; None when that
  device belongs to another process (jax.distributed)."""
  for shard in array.addressable_shards:
    if shard.device == device:
      return shard.data[0]
  return None


def _result(logits, kv, last, T, strategy, chunks) -> PrefillResult:
  kv_L2BSKH = _shard_on(kv, last)
  if kv_L2BSKH is None:  # the last rank is another process's: it holds the answer
    return PrefillResult(None, None, None, T, strategy, chunks)
  return PrefillResult(
    _shard_on(logits, last), kv_L2BSKH[:, 0], kv_L2BSKH[:, 1], T, strategy, chunks
  )


def prefill(
  model: Model,
  tokens,
  strategy: str = "single",
  mesh=None,
  partition: Any = None,
  attention: str = "dense",
) -> PrefillResult:
  """Runs the prompt phase and returns the last position's logits and the KV cache.

  tokens: [B, T] (or [T]) token ids, equal-length prompts.
  strategy: "single" (one device, the oracle), "tsp" (all-gather baseline) or "kvr"
    (KV-Runahead). mesh: from `make_mesh(p)`; default all local devices.
  partition (kvr only): p chunk lengths summing to T (rank 0 the earliest tokens), or
    "even", "search", "balanced", "predict", or a `PartitionPlan` (see kvr_jax.partition).
  attention: "dense" computes each rank's whole query x key rectangle and masks it (the
    paper's accounting, and the default) or "blocked", which also skips fully masked blocks
    inside it (single and kvr; TSP is dense by definition).
  """
  if strategy not in STRATEGIES:
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
  if attention not in ATTENTION_KINDS:
    raise ValueError(f"unknown attention {attention!r}; expected one of {ATTENTION_KINDS}")
  if strategy == "tsp" and attention != "dense":
    raise ValueError(
      "TSP computes dense masked scores by definition; attention='blocked' "
      "applies to 'single' and 'kvr'"
    )
  if not isinstance(model, Model):
    raise ValueError(f"`model` must come from kvr_jax.load_model, got {type(model).__name__}")
  tokens_BT = _check_tokens(model, tokens)
  B, T = tokens_BT.shape
  if strategy == "single":
    if partition is not None:
      raise ValueError("`partition` applies only to strategy='kvr'")
    # This process's first device (of the mesh, if one is given): with jax.distributed every
    # process can run the single-device oracle on its own device.
    local = [
      d
      for d in (jax.local_devices() if mesh is None else mesh.devices.reshape(-1))
      if d.process_index == jax.process_index()
    ]
    if not local:
      raise ValueError("strategy='single': the mesh has no device of this process")
    device = local[0]
    state = model.state_on(device)
    run = _compiled_single(model.graphdef, attention)
    logits, k, v = run(state, jax.device_put(tokens_BT, device))
    return PrefillResult(logits, k, v, T, strategy)

  mesh = make_mesh() if mesh is None else mesh
  p = check_mesh(mesh)
  if p > T:
    raise ValueError(
      f"{p} ranks but only {T} prompt tokens: every rank needs at least one "
      "token; use a smaller mesh"
    )
  replicated = NamedSharding(mesh, jax.P())
  by_rank = NamedSharding(mesh, jax.P(AXIS))
  state = model.state_on(replicated)
  last = last_rank_device(mesh)
  if strategy == "tsp":
    if partition not in (None, "even"):
      raise ValueError("TSP always splits evenly; `partition` applies only to strategy='kvr'")
    run, _ = tsp.compiled_prefill(model.graphdef, mesh, T)
    logits, kv = run(state, global_array(tsp.pad_shards(tokens_BT, p), by_rank))
    # Every rank holds the whole cache after the all-gather; decode from the last rank's copy
    # (the program also moved the last position's logits there).
    return _result(logits, kv, last, T, strategy, None)

  if isinstance(partition, PartitionPlan) and partition.objective == "measured":
    # A measured search times dozens of prefills: run it once per (model, mesh, shape) in this
    # process (and, with a cache_path, once ever).
    key = (id(model), model.graphdef, mesh, B, T, partition)
    if key not in _MEASURED_PARTITIONS:
      from kvr_jax import search

      _MEASURED_PARTITIONS[key] = search.measured_search(
        model, tokens_BT, mesh, multiple=partition.multiple, cache_path=partition.cache_path
      )
    partition = list(_MEASURED_PARTITIONS[key])
  preset = model.source[len("preset:") :] if model.source.startswith("preset:") else None
  chunks = resolve_partition(
    partition,
    T,
    p,
    config=model.config,
    batch=B,
    dtype_bytes=jnp.dtype(model.dtype).itemsize,
    model_name=preset,
  )
  if jax.process_count() > 1:
    # Cost-model partitions use per-process measurements; every process must compile the same
    # program, so all take process 0's choice.
    from jax.experimental import multihost_utils

    chunks = tuple(int(c) for c in multihost_utils.broadcast_one_to_all(np.asarray(chunks)))
  run = runahead.compiled_prefill(model.graphdef, mesh, chunks, attention)
  logits, kv = run(state, global_array(runahead.pad_chunks(tokens_BT, chunks), by_rank))
  return _result(logits, kv, last, T, strategy, chunks)


def _encode_prompt(model: Model, prompt) -> np.ndarray:
  if isinstance(prompt, str) or (
    isinstance(prompt, Sequence) and prompt and all(isinstance(p, str) for p in prompt)
  ):
    if model.tokenizer is None:
      raise ValueError(
        "a text prompt needs a tokenizer, and this model has none (load a "
        "Hugging Face directory with tokenizer files, or pass token ids)"
      )
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    if any(not t for t in texts):
      raise ValueError("the prompt is empty")
    ids = [model.tokenizer(t)["input_ids"] for t in texts]
    if len({len(i) for i in ids}) != 1:
      raise ValueError(
        f"text prompts tokenize to different lengths {[len(i) for i in ids]}; "
        "batched prompts must have equal length"
      )
    return np.asarray(ids, np.int32)
  return prompt


def _check_sampling(model: Model, max_new_tokens, temperature, top_k, top_p) -> None:
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"`max_new_tokens` must be a positive integer, got {max_new_tokens!r}")
  if not temperature >= 0:
    raise ValueError(f"`temperature` must be >= 0, got {temperature!r}")
  vocab = model.config.vocab_size
  if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= vocab):
    raise ValueError(f"`top_k` must be an integer in [1, {vocab}], got {top_k!r}")
  if top_p is not None and not 0 < top_p <= 1:
    raise ValueError(f"`top_p` must be in (0, 1], got {top_p!r}")


def _check_length(model: Model, prompt_len: int, max_new_tokens: int) -> None:
  limit = model.config.max_position_embeddings
  if prompt_len + max_new_tokens > limit:
    raise ValueError(
      f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
      f"max_position_embeddings={limit}"
    )


def generate(
  model: Model,
  prompt,
  max_new_tokens: int,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  seed: int = 0,
  strategy: str = "single",
  mesh=None,
  partition: Any = None,
  attention: str = "dense",
) -> GenerationResult:
  """Prefill with `strategy`, then decode token by token from the KV cache.

  prompt: token ids [T] or [B, T], or text (a string or equal-length list of strings; needs a
  tokenizer). Stops when every row has produced EOS or after `max_new_tokens`. Temperature 0
  is greedy and deterministic; otherwise top-k then top-p filter the temperature-scaled logits.
  """
  _check_sampling(model, max_new_tokens, temperature, top_k, top_p)
  tokens_BT = _check_tokens(model, _encode_prompt(model, prompt))
  _check_length(model, tokens_BT.shape[1], max_new_tokens)
  result = prefill(
    model, tokens_BT, strategy=strategy, mesh=mesh, partition=partition, attention=attention
  )
  return decode_from(model, result, max_new_tokens, temperature, top_k, top_p, seed)


def decode_from(
  model: Model,
  result: PrefillResult,
  max_new_tokens: int,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  seed: int = 0,
) -> GenerationResult:
  """Decodes from a prefill's KV cache, on the device that holds it (see `generate`)."""
  _check_sampling(model, max_new_tokens, temperature, top_k, top_p)
  _check_length(model, result.prompt_len, max_new_tokens)
  if not result.is_local:  # another process holds the cache and generates
    return GenerationResult(None, None, result)
  B, T = result.logits.shape[0], result.prompt_len
  device = result.device
  state = model.state_on(device)
  # Room for the new tokens, allocated where the cache already is.
  grow = ((0, 0), (0, 0), (0, max_new_tokens), (0, 0), (0, 0))
  k_cache, v_cache = jnp.pad(result.k_cache, grow), jnp.pad(result.v_cache, grow)
  eos = np.asarray(model.config.eos_ids, np.int32)
  key = jax.device_put(jax.random.key(seed), device)
  logits = result.logits
  out = np.zeros((B, max_new_tokens), np.int32)
  done = np.zeros(B, bool)
  n = 0
  for step in range(max_new_tokens):
    if temperature == 0:
      token_B = decode.greedy(logits)
    else:
      token_B = decode.sample(
        logits,
        jax.random.fold_in(key, step),
        float(temperature),
        top_k=top_k,
        top_p=None if top_p is None else float(top_p),
      )
    token_np = np.asarray(token_B)
    out[:, step] = np.where(done, eos[0] if eos.size else 0, token_np)
    n = step + 1
    done |= np.isin(token_np, eos)
    if done.all() or step == max_new_tokens - 1:
      break
    logits, k_cache, v_cache = decode.decode_step(
      model.graphdef, state, token_B, T + step, k_cache, v_cache
    )
  out = out[:, :n]
  text = None
  if model.tokenizer is not None:
    text = [model.tokenizer.decode(row, skip_special_tokens=True) for row in out]
  return GenerationResult(out, text, result)
