"""What every decoder-only model here shares: embeddings, the stacked layer scan, the head.

Layers are stored stacked: every block parameter has a leading [L] axis, so `scan_layers` runs
them with one `jax.lax.scan` (one compiled layer body whatever the depth). A block exposes the
two halves of its computation that the parallel strategies need separately:

  block.project_qkv(x_BTD, positions_BT) -> q_BTNH, k_BTKH, v_BTKH   (norm, projections, RoPE)
  block.attend(q, k_prefix, v_prefix, query_offset, kernel)         (models.attention, with the
                                                                     config's sliding window)
  block.attend_partial(...)  -> out, lse (float32)                   (the same, flash/fused,
                                                                     for merging partials)
  block.finish(x_BTD, attn_BTNH) -> x_BTD                            (output proj., MLP, residual)

so a strategy can move K,V between devices in the middle of a layer. Models know nothing
about devices. The block's maths is the same for a tensor-parallel shard of it (fewer heads,
fewer MLP columns: every einsum takes its sizes from the weights): `finish(..., reduce=)`
takes the function that adds up the shards' partial sums of the output projection and the
MLP before each residual (the identity on a whole model; kvr_jax passes a psum).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import attend_partial, attend_static
from models.config import ModelConfig
from models.kv_cache import KVCache
from models.norms import rms_norm
from models.rope import apply_rope

INIT_STD = 0.02

# The most tokens `Block.finish` runs through the output projection and the MLP at once. A
# long chunk (KV-Runahead's rank 0 holds a third of a 131k prompt) would otherwise hold its
# [T, F] MLP intermediates whole: 42k tokens x 14336 x 4 bytes is 2.4 GB per tensor. Rows
# are independent there, so blocks give the same result with O(ROW_BLOCK x F) memory.
ROW_BLOCK = 8192


def no_reduce(partial_BTD: jax.Array) -> jax.Array:
  """The whole model's `reduce`: its partial sums are already whole."""
  return partial_BTD


def shard_index(reduce) -> jax.Array | int:
  """This shard's place among the shards whose partial sums `reduce` adds (0 for a whole
  model): a mixture whose experts are split holds the index-th E/m of them. A `reduce` that
  splits experts carries it as `reduce.shard_index()` (kvr_jax's psum over the model axis)."""
  index = getattr(reduce, "shard_index", None)
  return 0 if index is None else index()


def first_local_expert(local_experts: int, num_experts: int, reduce) -> jax.Array | int | None:
  """None where a block holds all `num_experts` experts (whole, or F/m columns of each where a
  tensor-parallel group's m does not divide E); else the first of the `local_experts` (E/m)
  this shard holds: its experts split over the model axis (w_gate [E/m, D, F])."""
  if local_experts == num_experts:
    return None
  return shard_index(reduce) * local_experts


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> nnx.Param:
  return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * INIT_STD).astype(dtype))


def ones_param(shape: tuple[int, ...], dtype) -> nnx.Param:
  return nnx.Param(jnp.ones(shape, dtype))


def zeros_param(shape: tuple[int, ...], dtype) -> nnx.Param:
  return nnx.Param(jnp.zeros(shape, dtype))


class Block(nnx.Module):
  """One transformer layer (its parameters may carry a leading [L] axis).

  Subclasses call `init_attention` for wq, wk, wv, wo (and the config's switches: Q/K/V
  biases, q/k norms) and define `attention_input` (the pre-attention norm) and `finish`; the
  Q/K/V projection, RoPE and the attention call (with the config's sliding window) are shared.
  """

  config: ModelConfig

  def init_attention(self, num_layers: int, dtype, rngs: nnx.Rngs) -> None:
    cfg = self.config
    L, D, N, K, H = num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.wq = normal_param(rngs, (L, D, N, H), dtype)
    self.wk = normal_param(rngs, (L, D, K, H), dtype)
    self.wv = normal_param(rngs, (L, D, K, H), dtype)
    self.wo = normal_param(rngs, (L, N, H, D), dtype)
    if cfg.qkv_bias:  # Qwen2/2.5
      self.bq = zeros_param((L, N, H), dtype)
      self.bk = zeros_param((L, K, H), dtype)
      self.bv = zeros_param((L, K, H), dtype)
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's H features, before RoPE
      self.q_norm = ones_param((L, H), dtype)
      self.k_norm = ones_param((L, H), dtype)
    if cfg.attention_sinks:  # gpt-oss: one sink logit per query head (models/sinks.py)
      self.sinks = normal_param(rngs, (L, N), dtype)

  @property
  def sinks_N(self) -> jax.Array | None:
    """This layer's sink logits [N] (a tensor-parallel shard's own heads), or None."""
    return self.sinks[...] if self.config.attention_sinks else None

  def attention_input(self, x_BTD: jax.Array) -> jax.Array:  # pragma: no cover - interface
    raise NotImplementedError

  def project_qkv(self, x_BTD: jax.Array, positions_BT: jax.Array):
    """Norm, Q/K/V projections and RoPE at absolute `positions_BT` -> q_BTNH, k_BTKH, v_BTKH."""
    cfg = self.config
    h_BTD = self.attention_input(x_BTD)
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", h_BTD, self.wq[...])
    k_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, self.wk[...])
    v_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, self.wv[...])
    if cfg.qkv_bias:
      q_BTNH, k_BTKH, v_BTKH = q_BTNH + self.bq[...], k_BTKH + self.bk[...], v_BTKH + self.bv[...]
    if cfg.qk_norm:
      q_BTNH = rms_norm(q_BTNH, self.q_norm[...], cfg.norm_eps)
      k_BTKH = rms_norm(k_BTKH, self.k_norm[...], cfg.norm_eps)
    q_BTNH = apply_rope(q_BTNH, positions_BT, self.config.rope)
    k_BTKH = apply_rope(k_BTKH, positions_BT, self.config.rope)
    return q_BTNH, k_BTKH, v_BTKH

  def project_entries(self, x_BTD: jax.Array, positions_BT: jax.Array):
    """(queries, cache entries [M, B, T, K, H]) of rows at `positions_BT`: what the layer
    keeps per position and what a strategy passes between ranks without knowing what it is.
    Here K and V stacked (M = 2); a latent layer keeps one latent (models.latent_attention)."""
    q_BTNH, k_BTKH, v_BTKH = self.project_qkv(x_BTD, positions_BT)
    return q_BTNH, jnp.stack([k_BTKH, v_BTKH])

  def attend_entries(self, queries, entries_MBSKH, query_offset, attention) -> jax.Array:
    """`attend` of `queries` over cache entries as `project_entries` gives them."""
    return self.attend(queries, entries_MBSKH[0], entries_MBSKH[1], query_offset, attention)

  def attend_entries_partial(self, queries, entries_MBSKH, query_offset, attention, lengths=None):
    """`attend_partial` of `queries` over cache entries as `project_entries` gives them:
    (out float32, lse float32), to merge with the same queries' partial over other keys.
    lengths: the inputs' real extent as data (`models.flash.Lengths`)."""
    return self.attend_partial(
      queries, entries_MBSKH[0], entries_MBSKH[1], query_offset, attention, lengths=lengths
    )

  def attend(self, q_BTNH, k_BSKH, v_BSKH, query_offset, attention) -> jax.Array:
    """This model's attention (causal, with its sliding window if any) at `query_offset`
    counted from the first key given; `attention` names the kernel (models.attention)."""
    return attend_static(
      q_BTNH,
      k_BSKH,
      v_BSKH,
      query_offset,
      attention,
      self.config.sliding_window,
      sinks_N=self.sinks_N,
    )

  def attend_partial(
    self,
    q_BTNH,
    k_BSKH,
    v_BSKH,
    query_offset,
    attention,
    lengths=None,
  ):
    """`attend` for the kernels that return their log-sum-exp (flash, fused): (out float32,
    lse float32), to be merged with an attention of the same queries over other keys.
    lengths: the real extent of inputs padded to one shape, as data (`models.flash.Lengths`)."""
    return attend_partial(
      q_BTNH,
      k_BSKH,
      v_BSKH,
      query_offset,
      attention,
      self.config.sliding_window,
      lengths=lengths,
      sinks_N=self.sinks_N,
    )

  def attention_output(self, attn_BTNH: jax.Array) -> jax.Array:
    return jnp.einsum("BTNH,NHD->BTD", attn_BTNH, self.wo[...])

  def finish_rows(self, x_BTD, attn_BTNH, reduce=no_reduce):  # pragma: no cover - interface
    """Output projection, MLP and residuals of every row (the family's own maths); `reduce`
    adds up the tensor-parallel shards' partial sums before each residual."""
    raise NotImplementedError

  def finish(
    self, x_BTD, attn_BTNH, row_block: int | None = ROW_BLOCK, reduce=no_reduce
  ) -> jax.Array:
    """`finish_rows` over blocks of at most `row_block` tokens (`in_row_blocks`). reduce: see
    the module docstring."""
    return in_row_blocks(self.finish_rows, x_BTD, attn_BTNH, row_block, reduce)


def finish_one_row(block, x_BTD, queries, entries_MBSKH, row, query_offset, reduce=no_reduce):
  """A layer's output at one row of x: its queries (`row` of `queries`, at `query_offset`
  counted from the first entry; static or traced) over the cache entries given, then the
  rest (`block.finish`); every other row of x comes back as it came. A prefill's last layer
  needs no more: the first token reads the prompt's last row alone, and every row's cache
  entries were made before the attention. Dense scores for the one row, as a decode step
  attends (its S keys read once; no kernel tiles a single query). Any block with
  `attend_entries` and `finish` (softmax and latent layers alike)."""
  row_queries = jax.tree.map(lambda q: jax.lax.dynamic_slice_in_dim(q, row, 1, axis=1), queries)
  x_B1D = jax.lax.dynamic_slice_in_dim(x_BTD, row, 1, axis=1)
  attn_B1NH = block.attend_entries(row_queries, entries_MBSKH, query_offset, "dense")
  out_B1D = block.finish(x_B1D, attn_B1NH, reduce=reduce).astype(x_BTD.dtype)
  return jax.lax.dynamic_update_slice_in_dim(x_BTD, out_B1D, row, axis=1)


def write_rows(cache, lead: tuple, positions_B, new_B1X):
  """Each row's new entry (new_B1X[b], [1, ...]) written into `cache` [*lead axes, B, S, ...]
  at (*lead, b, positions_B[b]): a dynamic-update-slice per row, where the cache lies. Not a
  scatter: XLA:CPU runs a bfloat16 scatter in float32 over the whole array, converting every
  layer's cache in each decode step (Llama-3.1-8B at 64k: 6.9 GiB of temporaries against
  2.9 this way). Where their types' shardings differ (a jitted program over an explicit
  mesh, outside shard_map) the scatter stays: its operands need not match."""
  new_B1X = new_B1X.astype(cache.dtype)
  if _placement(cache) != _placement(new_B1X):
    rows_B = jnp.arange(new_B1X.shape[0])
    return cache.at[(*lead, rows_B, positions_B)].set(new_B1X[:, 0])
  ones = (1,) * len(lead)
  for b in range(new_B1X.shape[0]):
    start = (*lead, b, positions_B[b]) + (0,) * (new_B1X.ndim - 2)
    row = new_B1X[b : b + 1]
    cache = jax.lax.dynamic_update_slice(cache, row.reshape(ones + row.shape), start)
  return cache


def _placement(x):
  """x's type's mesh and the mesh axes it is split over (its rank aside)."""
  sharding = jax.typeof(x).sharding
  return sharding.mesh, tuple(axis for axis in sharding.spec if axis is not None)


def in_row_blocks(finish_rows, x_BTD, attn_BTNH, row_block: int | None, reduce) -> jax.Array:
  """`finish_rows(x, attn, reduce)` over blocks of at most `row_block` tokens (a `lax.map`: one
  block's intermediates live at a time: an MLP's, a mixture's routed rows); None or a short
  input runs it whole. attn: [B, T, ...], or a tuple of such (every per-row input the rows
  need). The blocks are equal (T = 10,000 with 8192 is two blocks of 5000), so padding is at
  most 7 rows per block."""
  B, T, D = x_BTD.shape
  if row_block is None or T <= row_block:
    return finish_rows(x_BTD, attn_BTNH, reduce)
  n = -(-T // row_block)
  size = -(-T // n)
  pad = n * size - T

  def blocks(rows_BT):  # [B, T, ...] -> [n, B, size, ...]
    padded = jnp.pad(rows_BT, [(0, 0), (0, pad)] + [(0, 0)] * (rows_BT.ndim - 2))
    return padded.reshape(B, n, size, *rows_BT.shape[2:]).swapaxes(0, 1)

  x_nBsD, attn_nBs = blocks(x_BTD), jax.tree.map(blocks, attn_BTNH)
  out_nBsD = jax.lax.map(lambda xa: finish_rows(*xa, reduce), (x_nBsD, attn_nBs))
  return out_nBsD.swapaxes(0, 1).reshape(B, n * size, D)[:, :T]


class LayerStack(NamedTuple):
  """One stack of a model's layer weights (every parameter [L_s, ...]) and the model's layers
  it holds, in order: row i of the stack is layer `layers[i]`."""

  blocks: Block
  layers: tuple[int, ...]


class Layer(NamedTuple):
  """What `scan_layers` tells a body of the layer it runs: its index in the model and its row
  in its stack (traced int32 scalars), and its kind (static: models/layer_kinds.py)."""

  index: jax.Array
  row: jax.Array
  kind: Any


LayerBody = Callable[[Block, Layer, Any], tuple[Any, Any]]


def scan_layers(model, body: LayerBody, carry) -> tuple[Any, Any]:
  """Every layer of `model` in order, with `lax.scan`: body(block, layer, carry) -> (carry,
  y_l); returns (carry, the y_l stacked [L, ...] in layer order). One driver for every model:

  - the weights come from `model.layer_stacks()`, read in place (a scan over a stack, or a
    dynamic slice of it), never copied per layer;
  - a step runs one compiled body per (stack, kind) (`lax.switch`), whose block sees its
    kind's config (`config.of_kind`: a window and its RoPE), so shapes that follow a kind are
    static per kind (KV-Runahead's hops on a windowed layer carry only what the window needs);
  - stacks that follow one another (DeepSeek's dense layers, then its experts) run one scan
    each; stacks whose layers interleave (Qwen3.5's linear and full layers) run one scan over
    every layer, each step its stack's branch."""
  config = model.config
  stacks = model.layer_stacks()
  kind_L = config.layer_kinds
  branches, branch_L, row_L = [], [0] * config.num_layers, [0] * config.num_layers
  for s, stack in enumerate(stacks):
    graphdef, stacked = nnx.split(stack.blocks)
    kinds = [k for k in config.kinds if any(kind_L[l] == k for l in stack.layers)]
    for kind in kinds:
      for row, l in enumerate(stack.layers):
        if kind_L[l] == kind:
          branch_L[l], row_L[l] = len(branches), row
      kind_config = stack.blocks.config.of_kind(kind)
      branches.append((s, _layer_branch(body, graphdef, stacked, kind_config, kind)))
  index_L = jnp.arange(config.num_layers, dtype=jnp.int32)
  branch_L, row_L = jnp.asarray(branch_L, jnp.int32), jnp.asarray(row_L, jnp.int32)

  def step_of(first: int, runs):
    def step(carry, inputs):  # inputs: (index, row, branch, the layer's weights or None)
      index, row, branch, layer_state = inputs
      if len(runs) == 1:
        return runs[0](carry, index, row, layer_state)
      return jax.lax.switch(branch - first, runs, carry, index, row, layer_state)

    return step

  runs = [run for _, run in branches]
  if [l for stack in stacks for l in stack.layers] != list(range(config.num_layers)):
    # Interleaved stacks: one scan over every layer, each branch slicing its own stack.
    return jax.lax.scan(step_of(0, runs), carry, (index_L, row_L, branch_L, None))
  ys = []
  for s, stack in enumerate(stacks):  # one scan per stack, over its weights in place
    which = [b for b, (of, _) in enumerate(branches) if of == s]
    span = slice(stack.layers[0], stack.layers[-1] + 1)
    _, stacked = nnx.split(stack.blocks)
    inputs = (index_L[span], row_L[span], branch_L[span], stacked)
    carry, y = jax.lax.scan(step_of(which[0], runs[which[0] : which[-1] + 1]), carry, inputs)
    ys.append(y)
  return carry, ys[0] if len(ys) == 1 else jax.tree.map(lambda *y: jnp.concatenate(y), *ys)


def _layer_branch(body: LayerBody, graphdef, stacked, kind_config, kind):
  """One (stack, kind)'s step: its layer's weights (given, or read at `row` of the stack),
  the block seeing its kind's config, then `body`."""

  def run(carry, index, row, layer_state):
    if layer_state is None:
      layer_state = jax.tree.map(lambda w: w[row], stacked)
    block = nnx.merge(graphdef, layer_state)
    block.config = kind_config
    return body(block, Layer(index, row, kind), carry)

  return run


class CausalLM(nnx.Module):
  """Token embedding -> L stacked blocks -> final norm -> vocabulary logits."""

  block_class: type[Block]

  def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.dtype = jnp.dtype(dtype)
    V, D = config.vocab_size, config.d_model
    self.embedding = normal_param(rngs, (V, D), dtype)  # [V, D]
    self.blocks = self.block_class(config, num_layers=config.num_layers, dtype=dtype, rngs=rngs)
    self.lm_head = None if config.tie_embeddings else normal_param(rngs, (D, V), dtype)

  # Subclasses define the final norm.
  def final_norm(self, x_BTD: jax.Array) -> jax.Array:  # pragma: no cover - interface
    raise NotImplementedError

  def layer_stacks(self) -> tuple[LayerStack, ...]:
    """The stacks of layer weights `scan_layers` runs, each with the layers it holds."""
    return (LayerStack(self.blocks, tuple(range(self.config.num_layers))),)

  def embed(self, tokens_BT: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], tokens_BT, axis=0)

  def logits(self, x_BTD: jax.Array) -> jax.Array:
    """Final norm and vocabulary projection; float32 logits [B, T, V]."""
    h_BTD = self.final_norm(x_BTD)
    if self.lm_head is None:
      return jnp.einsum(
        "BTD,VD->BTV", h_BTD, self.embedding[...], preferred_element_type=jnp.float32
      )
    return jnp.einsum("BTD,DV->BTV", h_BTD, self.lm_head[...], preferred_element_type=jnp.float32)

  def forward(self, tokens_BT: jax.Array, attention="dense", reduce=no_reduce):
    """The whole prompt on one device (or one tensor-parallel shard of the model, whose
    partial sums `reduce` adds up): final hidden states [B, T, D] and the KV cache.

    attention: "dense" (the T x T score matrix, masked: what the paper's single-device and
    Hugging Face eager baselines compute) or "blocked" (skips masked-out blocks).
    Returns (x_BTD, k_LBTKH, v_LBTKH).
    """
    B, T = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))

    def layer(block: Block, _, x_BTD):
      q, k, v = block.project_qkv(x_BTD, positions_BT)
      attn_BTNH = block.attend(q, k, v, 0, attention)
      return block.finish(x_BTD, attn_BTNH, reduce=reduce), (k, v)

    x_BTD, (k_LBTKH, v_LBTKH) = scan_layers(self, layer, self.embed(tokens_BT))
    return x_BTD, k_LBTKH, v_LBTKH

  def decode_step(self, tokens_B, positions_B, cache: KVCache, reduce=no_reduce):
    """One token per row, row b at `positions_B[b]` (a scalar: every row's), over the cache
    `cache` (its rows' positions before then filled): (logits [B, V] float32, the cache with
    the token's K,V written in). Keys past a row's position are hidden by its causal offset,
    so the unused tail of the cache (and a shorter row's padding, which its later tokens
    overwrite) needs no mask; a window whose layer keeps every position masks the keys
    before it, a ring holds its window alone. `reduce`: as in `forward`."""
    layout = cache.layout
    B = tokens_B.shape[0]
    positions_B = jnp.broadcast_to(jnp.asarray(positions_B, jnp.int32), (B,))
    slots_L = jnp.asarray(layout.slot_of_layer, jnp.int32)  # each layer's row in its group

    def layer(block: Block, at, carry):
      slot = slots_L[at.index]
      # The cache is carried through the layers and written where it lies (one token's row
      # per sequence, by index): with it donated, no second copy exists during the step;
      # attention reads this layer's [B, S_g, K, H] slice.
      x_B1D, groups = carry
      group = layout.group_of_window(block.config.kind.window)
      ring = layout.rings[group]
      q_B1NH, k_B1KH, v_B1KH = block.project_qkv(x_B1D, positions_B[:, None])
      if ring is None:
        k_LBSKH, v_LBSKH = groups[group]
        k_LBSKH = write_rows(k_LBSKH, (slot,), positions_B, k_B1KH)
        v_LBSKH = write_rows(v_LBSKH, (slot,), positions_B, v_B1KH)
        attn_B1NH = block.attend(q_B1NH, k_LBSKH[slot], v_LBSKH[slot], positions_B, "dense")
        kept = (k_LBSKH, v_LBSKH)
      else:
        attn_B1NH, kept = window_ring_attention(
          block, q_B1NH, k_B1KH, v_B1KH, groups[group], slot, positions_B, ring
        )
      groups = (*groups[:group], kept, *groups[group + 1 :])
      return (block.finish(x_B1D, attn_B1NH, reduce=reduce), groups), None

    carry = (self.embed(tokens_B[:, None]), tuple(cache.groups))
    (x_B1D, groups), _ = scan_layers(self, layer, carry)
    return self.logits(x_B1D)[:, 0], KVCache(layout, groups)

  def __call__(self, tokens_BT: jax.Array) -> jax.Array:
    """Logits of every position, [B, T, V] float32."""
    x_BTD, _, _ = self.forward(tokens_BT)
    return self.logits(x_BTD)


def window_ring_attention(block, q_B1NH, k_B1KH, v_B1KH, ring_kv, slot, positions_B, ring: int):
  """A windowed layer's decode attention over its ring (`kv_cache.DecodeLayout`): the new
  token's K,V written at position mod W of layer `slot` of ring_kv ((k, v) [L_g, B, W, K,
  H]), where the ring lies, then its queries attend the ring. Returns (attn [B, 1, N, H],
  ring_kv)."""
  k_LBWKH, v_LBWKH = ring_kv
  written_B = positions_B % ring
  k_LBWKH = write_rows(k_LBWKH, (slot,), written_B, k_B1KH)
  v_LBWKH = write_rows(v_LBWKH, (slot,), written_B, v_B1KH)
  # The ring holds exactly the window's positions once it is full, in slot order (the softmax
  # does not care which): nothing to mask then; before, slots past the token's position are
  # empty, hidden as a causal offset hides them.
  attn_B1NH = attend_static(
    q_B1NH,
    k_LBWKH[slot],
    v_LBWKH[slot],
    jnp.minimum(positions_B, ring - 1),
    "dense",
    sinks_N=block.sinks_N,
  )
  return attn_B1NH, (k_LBWKH, v_LBWKH)
