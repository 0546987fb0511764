"""The single-device oracle: the whole prompt on one device, as a one-rank SPMD program.

It runs under the same interface as the parallel strategies (a mesh of one device), so
`prefill` treats every strategy alike and the oracle's cache lands where decode runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvr_jax.core.caches import kept_cache
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.cache_layout import fold_batch
from kvr_jax.runtime.mesh import model_parallel
from kvr_jax.runtime.roofline import (
  Compute,
  ModelledLayer,
  phase_seconds,
  phase_work,
  total_work,
  work_kwargs,
)
from kvr_jax.strategies import latent_modelled, linear_modelled
from kvr_jax.strategies.base import (
  CAUSAL_KERNELS,
  KindLayers,
  RankBody,
  Strategy,
  refuse,
)
from models.base import finish_one_row, no_reduce
from models.layer_kinds import GatedDeltaNetKind, LatentAttentionKind


def layout(context_len: int, num_ranks: int, chunks=None) -> tuple[int, ...]:
  del num_ranks, chunks  # one rank, the whole prompt
  return (context_len,)


def arrange(tokens_BC, chunks) -> np.ndarray:
  return np.asarray(tokens_BC)[None]


def single_body(graphdef, chunks, attention, timeline, keep_last_hop):
  """The whole prompt on one device: every layer attends causally from position 0; the
  model's last layer attends and finishes the prompt's last row alone (nothing reads the
  others; their K,V are made before the attention)."""
  del graphdef, chunks
  refuse("single", timeline, keep_last_hop)

  def make_body(model, rank, tokens_BC, reduce):
    B, C = tokens_BC.shape
    positions_BC = jnp.broadcast_to(jnp.arange(C), (B, C))

    last_layer = model.config.num_layers - 1

    def layer(block, x_BCD, carry, at):
      l = at.index
      q_BCNH, k_BCKH, v_BCKH = block.project_qkv(x_BCD, positions_BC)
      kv_2BCKH = jnp.stack([k_BCKH, v_BCKH])

      def every_row(x_BCD):
        attn_BCNH = block.attend(q_BCNH, k_BCKH, v_BCKH, 0, attention)
        return block.finish(x_BCD, attn_BCNH, reduce=reduce)

      def last_row(x_BCD):  # the model's last layer: only the prompt's last row is read
        return finish_one_row(block, x_BCD, q_BCNH, kv_2BCKH, C - 1, C - 1, reduce)

      x_BCD = jax.lax.cond(l == last_layer, last_row, every_row, x_BCD)
      return x_BCD, carry, fold_batch(kv_2BCKH)

    return RankBody(tokens_BC, layer, lambda x_BCD: x_BCD[:, -1], owner=0)

  return make_body


def modelled_layer(config, context_len: int, setup, chunks) -> ModelledLayer:
  """One layer on one device: qkv, causal attention over the whole prompt, the rest."""
  del chunks  # (context_len,)
  phases = phase_work(config, context_len, context_len, **work_kwargs(setup))
  seconds = phase_seconds(config, phases, context_len, setup)
  total = total_work(phases)
  steps = tuple(Compute(name, seconds[name]) for name in ("qkv", "attention", "rest"))
  return ModelledLayer((steps,), (context_len,), (total.flops,), (total.bytes,))


STRATEGY = Strategy(
  name="single",
  auto_candidate=True,
  description="one device, the oracle (whole prompt, causal attention)",
  partitioned=False,
  attention_kinds=CAUSAL_KERNELS,
  layout=layout,
  arrange=arrange,
  rank_body=single_body,
  modelled_layer=modelled_layer,
  max_ranks=1,
  # Its program on these kinds is the model's own forward (`one_group_forward`).
  kind_layers={
    LatentAttentionKind: KindLayers(latent_modelled.single_latent_layer),
    GatedDeltaNetKind: KindLayers(linear_modelled.single_linear_layer),
  },
)


@kept_cache(8)
def one_group_forward(graphdef, mesh, attention, cache_spec, capacity: int, row_ends: bool = False):
  """strategy="single" for a model whose cache has its own form (a hybrid, a latent model):
  (state, tokens [B, T]) -> (the last position's logits [B, V], the model's cache of
  `capacity` positions), its own `forward` on the mesh of one rank: one device, or a model
  group whose shards run their heads and experts (the partial sums added over "model") and
  keep the cache as `cache_spec` places it. row_ends:
  a third operand, each row's end [B], where the model's past stops (`forward(lengths_B=)`:
  every row's hidden states computed; the logits at T - 1 are then a padded row's)."""
  m = model_parallel(mesh)

  def forward(state, tokens_BT, *ends_B, reduce=no_reduce):
    model = nnx.merge(graphdef, state)
    lengths = dict(lengths_B=ends_B[0]) if row_ends else dict(last_row_only=True)
    x_BTD, cache = model.forward(
      tokens_BT, attention=attention, reduce=reduce, capacity=capacity, **lengths
    )
    return model.logits(x_BTD[:, -1:])[:, 0], cache

  if m == 1:
    return jax.jit(forward)

  @jax.jit
  def split(state, tokens_BT, *ends_B):
    # check_vma=False: the psums make the hidden states whole on every shard (as in the rank
    # programs: strategies.base.spmd).
    return jax.shard_map(
      functools.partial(forward, reduce=tensor_parallel.psum_over_model),
      mesh=mesh,
      in_specs=(tensor_parallel.partition_specs(state, m), jax.P(), *(jax.P(),) * row_ends),
      out_specs=(jax.P(), cache_spec),
      check_vma=False,
    )(state, tokens_BT, *ends_B)

  return split
