"""How evenly a prompt's routing loads the devices of a model group whose experts are split
over the model axis (each device E/m whole experts: kvr_jax.runtime.tensor_parallel): the
(token, expert) rows each device runs in every layer, from the model's own router on the
prompt, and a line that says when one device runs far more than its share (it then sets the
layer's pace: every device waits for the psum that follows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvr_jax.runtime import tensor_parallel
from models.base import scan_layers
from models.layer_kinds import unbuilt_kinds

# A device running this many times the mean rows of its group is called out.
UNEVEN = 1.25


def expert_rows_per_device(model, tokens, model_parallel: int) -> np.ndarray:
  """[L, m] int: the (token, expert) rows the m devices of a group run in each layer for
  `tokens` ([B, T] token ids), their experts split evenly in order (device j: experts
  [jE/m, (j+1)E/m)). The whole model on one device (flash attention), the router's choice of
  each layer read where the MLP makes it (`Block.routed_experts`); weights loaded split are
  gathered onto the first device for it (`fits_one_device` says whether they fit)."""
  config = model.config
  E = getattr(config, "num_experts", 0)
  if not E:
    raise ValueError(f"{model}: not a mixture of experts (no experts to split)")
  if model_parallel < 1 or E % model_parallel:
    raise ValueError(f"model_parallel={model_parallel} must divide the {E} experts")
  tokens_BT = jnp.asarray(np.atleast_2d(np.asarray(tokens)))
  per_device = E // model_parallel

  @jax.jit
  def rows(module, tokens_BT):
    B, T = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))

    def layer(block, _, x_BTD):
      q, k, v = block.project_qkv(x_BTD, positions_BT)
      attn_BTNH = block.attend(q, k, v, 0, "flash")
      device_P = block.routed_experts(x_BTD, attn_BTNH).reshape(-1) // per_device
      counts_m = jnp.zeros(model_parallel, jnp.int32).at[device_P].add(1)
      return block.finish(x_BTD, attn_BTNH), counts_m

    _, counts_Lm = scan_layers(module, layer, module.embed(tokens_BT))
    return counts_Lm

  module = nnx.merge(model.graphdef, model.state_on(jax.devices()[0]))
  return np.asarray(rows(module, tokens_BT))


def fits_one_device(model) -> bool:
  """Whether the whole model's weights take at most half of the first device's memory (a CPU
  reports none: host memory), so that `expert_rows_per_device` can run it there."""
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  weights = sum(leaf.nbytes for leaf in jax.tree.leaves(model.state))
  return limit is None or weights <= limit // 2


def routing_imbalance(model, tokens, model_parallel: int) -> float:
  """The cost model's expert_imbalance (costmodel.Setup, PartitionPlan) for `tokens` on
  `model_parallel` devices per rank: the busiest device's rows over its group's mean in each
  layer (that device sets the layer's pace), averaged over the layers, as the modelled layers
  are. 1.0 where nothing is split by expert (a dense model, m = 1, or the columns split)."""
  E = getattr(model.config, "num_experts", 0)
  if model_parallel <= 1 or not E or not tensor_parallel.experts_split_whole(E, model_parallel):
    return 1.0
  return float(_busiest_over_mean(expert_rows_per_device(model, tokens, model_parallel)).mean())


def _busiest_over_mean(rows_Lm: np.ndarray) -> np.ndarray:
  """[L]: each layer's busiest device's rows over its group's mean."""
  return rows_Lm.max(axis=1) / np.maximum(rows_Lm.mean(axis=1), 1e-9)


def describe_expert_load(rows_Lm: np.ndarray) -> str:
  """One line: the busiest device's rows over the mean of its group, at the worst layer and
  over the layers; "UNEVEN" where the worst reaches UNEVEN times the mean."""
  ratio_L = _busiest_over_mean(rows_Lm)
  worst = int(ratio_L.argmax())
  m = rows_Lm.shape[1]
  line = (
    f"expert rows per device (model axis, {m} devices): the busiest runs {ratio_L.mean():.2f}x "
    f"its group's mean over the layers, {ratio_L[worst]:.2f}x at layer {worst} "
    f"({' / '.join(str(r) for r in rows_Lm[worst])} rows)"
  )
  if ratio_L[worst] >= UNEVEN:
    line += f"; UNEVEN: that device sets the layer's pace (>= {UNEVEN}x the mean)"
  return line


def expert_load_line(model, tokens, model_parallel: int) -> str | None:
  """What launch.run and launch.benchmark print after a run whose mixture of experts was split
  over the model axis: `describe_expert_load` of `tokens`, or why it was not counted; None
  where nothing was split (a dense model, or one device per rank)."""
  E = getattr(model.config, "num_experts", 0)
  if model_parallel <= 1 or not E:
    return None
  if not tensor_parallel.experts_split_whole(E, model_parallel):
    return (
      f"expert rows per device: every device runs every row ({model_parallel} does not divide "
      f"the {E} experts: each device holds 1/{model_parallel} of every expert's columns)"
    )
  if unbuilt_kinds(model.config):
    return (
      f"expert rows per device: not counted for a {model.config.architecture} model (the count "
      "walks softmax-attention layers; its linear or latent layers are not walked yet)"
    )
  if not fits_one_device(model):
    return "expert rows per device: not counted (the count runs the whole model on one device)"
  return describe_expert_load(expert_rows_per_device(model, tokens, model_parallel))
