"""Tensor parallelism inside a rank: a model's weights split Megatron-style over a mesh axis.

On a 2-D mesh ("ranks", "model") every rank is a group of m devices that share each layer:

  wq, wk, wv (and their biases)   split by head        (column-parallel: local heads)
  wo                              split by query head  (row-parallel: a partial sum)
  w_gate, w_up / w_in             split by MLP column  (column-parallel)
  w_down / w_out                  split by MLP column  (row-parallel: a partial sum)
  a mixture's experts             split by expert      (E/m whole experts per shard: a partial
    (w_gate, w_up, w_down [L, E, ...]  and their biases)   sum, the other shards' experts)
    where m does not divide E:    split by column      (F/m columns of every expert, as a
                                                        dense MLP's; the down bias whole)
  sinks                           split by query head
  Gated DeltaNet (q, k, v, their    split by key head with its value heads (state and halo
    convolution, z, a, b, decay)    per shard); out_proj row-parallel (a partial sum)
  norms, q/k norms, embedding, head, router    whole on every shard

so each shard runs the block's own maths on its heads and columns (models/ take every size
from the weights) and adds the partial sums with one psum over "model" before each residual
(`Block.finish(..., reduce=)`: two per Llama layer, one per Falcon layer). A mixture of
experts needs no other collective: the MLP's input is whole on every shard of a group, so every
shard routes every token alike (the router is whole) and runs only the rows routed to its own
E/m experts (`models.base.shard_index(reduce)` tells it which); the psum that follows adds the
experts' outputs as it adds a dense MLP's column sums. Where m does not divide E (six experts
on four shards) each shard holds F/m columns of every expert instead and runs every routed row
through them: the same psum adds the columns' partial sums, and an expert's down bias is added
by shard 0 alone (models see the split in their weights' shapes). A model with fewer
KV heads than shards has them repeated (`shard_ready_state`) to m, so that shard j holds the
KV head its query heads use: query head n reads KV head n // (N/K), and shard j's query heads
[jN/m, (j+1)N/m) all read KV head j // (m/K), which is what repeating each head m/K times
puts at index j. Each shard's K,V are then its own heads: what KV-Runahead's hops carry.

This module only splits and describes; placing the weights and compiling the programs is the
strategies' and loading's business.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from kvr_jax.runtime.mesh import MODEL_AXIS
from models.config import ModelConfig

# The axis of each block parameter's stacked array ([L, ...]) that is split over the model
# axis; parameters not named here are whole on every shard.
SPLIT_AXIS = {
  "wq": 2,  # [L, D, N, H]
  "wk": 2,  # [L, D, K, H]
  "wv": 2,
  "bq": 1,  # [L, N, H]
  "bk": 1,  # [L, K, H]
  "bv": 1,
  "sinks": 1,  # [L, N]: each shard's own heads' sinks
  "wo": 1,  # [L, N, H, D]
  "wq_gate": 2,  # [L, D, N, H]: Qwen3.5's output gate, per query head
  # Gated DeltaNet (Qwen3.5, Qwen3-Next) by key head and its value heads: q, k, v and their
  # convolution per head (w_q, w_k [L, D, g, k], w_v [L, D, h, v], conv_* [L, W, ...]), z, a,
  # b, the decay's parameters; out_proj row-parallel (w_out [L, h, v, D]); the gated norm's
  # weight ([L, v], shared by the heads) whole. Key head j's value heads are [j r, (j+1) r)
  # (r = h / g), so a shard's g/m key heads and h/m value heads are the same group: its state
  # [h/m, k, v] and its halo (its heads' channels) are its own, what a hop carries.
  "w_q": 2,
  "w_k": 2,
  "w_v": 2,
  "conv_q": 2,
  "conv_k": 2,
  "conv_v": 2,
  "w_z": 2,  # [L, D, h, v]
  "w_a": 2,  # [L, D, h]
  "w_b": 2,
  "dt_bias": 1,  # [L, h]
  "A_log": 1,
  # Latent attention (DeepSeek-V3): the q projection (wq above, or wq_b [L, Q, N, n + r] after
  # its whole low-rank half) and kv_b_proj's halves (wk_b [L, R, N, n], wv_b [L, R, N, v]) by
  # head; the latent's projection and norm (wkv_a, kv_a_norm) whole: every shard of a group
  # computes the same headless latent, what the hops carry and the cache holds.
  "wq_b": 2,
  "wk_b": 2,
  "wv_b": 2,
  "w_gate": 2,  # [L, D, F]
  "w_up": 2,
  "w_in": 2,
  "w_down": 1,  # [L, F, D]
  "w_out": 1,
  # A shared expert (DeepSeek-V3, Qwen3.5-MoE, Qwen3-Next): a dense SwiGLU beside the routed
  # experts, split by column like one; its sigmoid gate (shared_gate [L, D]) whole.
  "w_shared_gate": 2,  # [L, D, Fs]
  "w_shared_up": 2,
  "w_shared_down": 1,  # [L, Fs, D]
}
KV_PARAMS = ("wk", "wv", "bk", "bv")
# The state's stacks of layers whose parameters split (DeepSeek-V3 keeps its dense first
# layers in a stack of their own).
BLOCK_STACKS = ("blocks", "dense_blocks", "linear_blocks")
# A mixture's experts, stacked [L, E, ...] (a dense MLP's are [L, D, F] / [L, F, D]): split
# over their expert axis, E/m whole experts per shard, where m divides E.
EXPERT_PARAMS = {"w_gate": 4, "w_up": 4, "w_down": 4, "b_gate": 3, "b_up": 3, "b_down": 3}
EXPERT_AXIS = 1
# Where m does not divide E: each expert's F columns split (w_gate, w_up [L, E, D, F], w_down
# [L, E, F, D], b_gate, b_up [L, E, F]); b_down [L, E, D] stays whole (added by one shard).
EXPERT_COLUMN_AXIS = {"w_gate": 3, "w_up": 3, "w_down": 2, "b_gate": 2, "b_up": 2}


def experts_split_whole(num_experts: int, model_parallel: int) -> bool:
  """Whether m shards hold E/m whole experts each (m divides E), rather than F/m columns of
  every expert."""
  return num_experts % model_parallel == 0


def split_axis(name: str | None, shape: tuple[int, ...], model_parallel: int) -> int | None:
  """The axis of block parameter `name` (of `shape`, with its [L] axis) split over a model
  axis of `model_parallel` shards, or None where it is whole on every shard. A mixture's
  experts split by expert where m divides their count (shape[1]), else by column."""
  if EXPERT_PARAMS.get(name) == len(shape):
    if experts_split_whole(shape[EXPERT_AXIS], model_parallel):
      return EXPERT_AXIS
    return EXPERT_COLUMN_AXIS.get(name)
  return SPLIT_AXIS.get(name)


def check_model_parallel(config: ModelConfig, model_parallel: int) -> None:
  """m must split the query heads and MLP columns evenly, and divide the KV heads or be a
  multiple of them (then each KV head is repeated on m/K shards)."""
  m = model_parallel
  if isinstance(m, bool) or not isinstance(m, int) or m < 1:
    raise ValueError(f"model_parallel must be an integer >= 1, got {m!r}")
  unsplit = [kind for kind in config.kinds if not kind.splits_over_model]
  if m > 1 and unsplit:
    names = ", ".join(dict.fromkeys(kind.name for kind in unsplit))
    raise ValueError(
      f"tensor parallelism (model_parallel={m}) of a {config.architecture} model is not built: "
      f"its layers include {names}, which no program splits over a model axis yet; run it on "
      "a 1-D mesh (make_mesh(p))"
    )
  E = getattr(config, "num_experts", 0)
  expert_F = getattr(config, "expert_dim", 0) or config.mlp_dim  # one expert's columns
  if m > 1 and E and E % m and expert_F % m:
    raise ValueError(
      f"model_parallel={m} must divide the {E} experts (each shard then holds E/m whole "
      f"experts) or each expert's {expert_F} columns (each shard then holds F/m columns of "
      "every expert)"
    )
  N, K = config.num_heads, config.num_kv_heads
  if N % m or (K % m and m % K):
    raise ValueError(
      f"model_parallel={m} must divide num_heads ({N}), and divide or be a multiple of "
      f"num_kv_heads ({K})"
    )
  key_heads = getattr(config, "linear_num_key_heads", 0)
  if m > 1 and key_heads and key_heads % m:
    raise ValueError(
      f"model_parallel={m} must divide linear_num_key_heads ({key_heads}): the linear "
      "layers split by key head, each with its value heads"
    )
  for name, columns in _columns_split(config, m).items():
    if columns % m:
      raise ValueError(f"model_parallel={m} must divide {name} ({columns}): split by column")


def _columns_split(config: ModelConfig, m: int) -> dict[str, int]:
  """The MLP widths split by column over m shards: a dense MLP's (every dense layer: Llama's,
  DeepSeek-V3's first layers), the experts' where m does not divide E, a shared expert's."""
  E = getattr(config, "num_experts", 0)
  widths = {}
  if not E or getattr(config, "first_dense_layers", 0):
    widths["mlp_dim"] = config.mlp_dim
  if E and not experts_split_whole(E, m):
    expert_dim = getattr(config, "expert_dim", 0)
    widths["expert_dim" if expert_dim else "mlp_dim"] = expert_dim or config.mlp_dim
  shared = getattr(config, "shared_expert_dim", 0) or getattr(config, "expert_dim", 0) * getattr(
    config, "shared_experts", 0
  )
  if E and shared:
    widths["the shared experts' columns"] = shared
  return widths


def kv_heads_per_shard(config: ModelConfig, model_parallel: int) -> int:
  """K/m, or one (repeated) head per shard when there are fewer KV heads than shards."""
  check_model_parallel(config, model_parallel)
  return max(config.num_kv_heads // model_parallel, 1)


def _block_param(path) -> str | None:
  """The block parameter a state leaf belongs to ('wq', ...), or None outside the blocks."""
  keys = path_names(path)
  return keys[1] if len(keys) > 1 and keys[0] in BLOCK_STACKS else None


def shard_ready_state(config: ModelConfig, state, model_parallel: int):
  """The state with its KV heads repeated to m where the model has fewer (K < m); otherwise
  the state itself. Repeating is exact: a repeated head gives the same keys and values."""
  check_model_parallel(config, model_parallel)
  repeats = model_parallel // config.num_kv_heads
  if repeats <= 1:
    return state

  def repeat(path, leaf):
    name = _block_param(path)
    if name in KV_PARAMS:
      return jnp.repeat(leaf, repeats, axis=SPLIT_AXIS[name])
    return leaf

  return jax.tree_util.tree_map_with_path(repeat, state)


def param_spec(
  names: tuple[str, ...],
  shape: tuple[int, ...],
  model_parallel: int,
  axis: str = MODEL_AXIS,
  *,
  whole_kv=False,
):
  """The PartitionSpec of the parameter at `names` (its path in the state, such as
  ("blocks", "wq")) of `shape`, on `model_parallel` shards: its split axis over `axis`, or
  whole (replicated) outside the blocks' split parameters. whole_kv: the KV parameters whole
  too."""
  name = names[1] if len(names) > 1 and names[0] in BLOCK_STACKS else None
  split = split_axis(name, tuple(shape), model_parallel)
  if split is None or (whole_kv and name in KV_PARAMS):
    return PartitionSpec()
  dims = [None] * len(shape)
  dims[split] = axis
  return PartitionSpec(*dims)


def path_names(path) -> tuple[str, ...]:
  """A pytree key path in the state (("blocks", "wq", "value")) as its names."""
  return tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)


def partition_specs(state, model_parallel: int, axis: str = MODEL_AXIS):
  """A PartitionSpec per leaf of a shard-ready state (`shard_ready_state`) on `model_parallel`
  shards: the split axis of the block parameters over `axis`, everything else whole."""
  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: param_spec(path_names(path), leaf.shape, model_parallel, axis), state
  )


def stores_kv_whole(config: ModelConfig, model_parallel: int) -> bool:
  """Whether the model's own KV weights (K heads) cannot be split over m shards (K < m):
  a placement of its own state then holds them whole on every shard, and each shard repeats
  the head it needs (`shard_ready_state`) when the weights are made ready for a program."""
  check_model_parallel(config, model_parallel)
  return config.num_kv_heads % model_parallel != 0


def own_state_specs(config: ModelConfig, state, model_parallel: int, axis: str = MODEL_AXIS):
  """A PartitionSpec per leaf of the model's own state (K KV heads, as loaded): as
  `partition_specs`, with the KV weights whole where K < m (`stores_kv_whole`). The layout
  weights are loaded into over a mesh; every leaf keeps its logical shape."""
  whole_kv = stores_kv_whole(config, model_parallel)
  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: param_spec(
      path_names(path), leaf.shape, model_parallel, axis, whole_kv=whole_kv
    ),
    state,
  )


def split_state(state, model_parallel: int):
  """The m shards' states stacked on a new leading axis (host-side slicing, for programs that
  map over shards, such as `jax.vmap(..., axis_name=MODEL_AXIS)`); whole leaves repeated."""
  m = model_parallel

  def split(path, leaf):
    name = _block_param(path)
    axis = split_axis(name, leaf.shape, m)
    if axis is None:
      return jnp.broadcast_to(leaf, (m, *leaf.shape))
    if leaf.shape[axis] % m:
      raise ValueError(f"{name} has {leaf.shape[axis]} entries on axis {axis}, not split by {m}")
    return jnp.stack(jnp.split(leaf, m, axis=axis))

  return jax.tree_util.tree_map_with_path(split, state)


def psum_over_model(partial_BTD: jax.Array) -> jax.Array:
  """The `reduce` of a shard inside a program mapped or sharded over MODEL_AXIS (its
  `shard_index`: the shard's place in its group, which E/m experts it holds)."""
  return jax.lax.psum(partial_BTD, MODEL_AXIS)


psum_over_model.shard_index = lambda: jax.lax.axis_index(MODEL_AXIS)
