"""What compiled_memory's figures share: programs compiled as a GPU would hold them, XLA's
analysis read the same way for every program, the weights placed as prefill places them, and
the head of every report."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from kvr_jax.inference import decode
from kvr_jax.planning.partition import PartitionPlan
from kvr_jax.runtime import tensor_parallel
from kvr_jax.runtime.mesh import AXIS, model_parallel, rank_row_mesh

# KVR's split for the memory report: equal modelled compute on a GPU node (a "balanced"
# partition), not this machine's calibration (which would measure the CPU).
MEMORY_PARTITION = PartitionPlan("balanced", hardware="h100-sxm", links="300GBps")

# XLA:CPU has no bfloat16 (or float16) dot: it converts each layer's weights to float32 where
# they are used, and its while-loop-invariant code motion hoists those converts out of the
# layer loop, so a CPU-compiled program holds a float32 copy of every layer at once (Llama-3.1-
# 8B, KV-Runahead at 16k: 29.2 GiB of temporaries against 3.2 without the hoisting). A GPU
# multiplies bfloat16 natively and keeps no such copy: the figures are compiled without the
# hoisting, so that at most one layer's converted weights count (what the report says).
LOW_PRECISION = ("bfloat16", "float16")
NO_HOISTED_CONVERTS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
HOISTING_NOTE = (
  "compiled without XLA:CPU's while-loop-invariant code motion: the CPU's float32 copies of "
  "low-precision weights (a GPU makes none) count one layer at a time, not all at once"
)


def unhoisted(dtype_name: str) -> bool:
  """Whether programs of `dtype_name` are compiled without the hoisting (see above): low
  precision on a CPU."""
  return dtype_name in LOW_PRECISION and jax.devices()[0].platform == "cpu"


def compile_for_figures(lowered, dtype_name: str):
  """`lowered` compiled as the figures need it (`unhoisted`)."""
  if unhoisted(dtype_name):
    return lowered.compile(compiler_options=NO_HOISTED_CONVERTS)
  return lowered.compile()


def analysis(compiled) -> dict[str, int]:
  stats = compiled.memory_analysis()
  return {
    "argument_bytes": int(stats.argument_size_in_bytes),
    "output_bytes": int(stats.output_size_in_bytes),
    "temp_bytes": int(stats.temp_size_in_bytes),
  }


def placed_state(config, state, mesh, m: int, itemsize: int):
  """The weights' shapes as prefill places them (whole on every device, or split over
  "model", KV heads repeated to m first where fewer), and one device's bytes of them."""
  state = jax.eval_shape(lambda s: tensor_parallel.shard_ready_state(config, s, m), state)
  specs = (
    tensor_parallel.partition_specs(state, m) if m > 1 else jax.tree.map(lambda _: jax.P(), state)
  )
  shapes = jax.tree.map(
    lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
    state,
    specs,
  )
  # One device's share of each weight: split leaves (a "model" entry in their spec) by m.
  weights_bytes = sum(
    np.prod(x.shape)
    * np.dtype(x.dtype).itemsize
    // (m if tensor_parallel.MODEL_AXIS in tuple(spec) else 1)
    for x, spec in zip(jax.tree.leaves(state), jax.tree.leaves(specs), strict=True)
  )
  return shapes, int(weights_bytes)


def struct(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def decode_bytes(stats) -> dict[str, int]:
  """A decode step's memory analysis as compiled_memory reports it: a donated argument's
  output reuses its buffer (the cache, the tail), counted once."""
  return {
    "decode_argument_bytes": int(stats.argument_size_in_bytes),
    "decode_output_bytes": int(stats.output_size_in_bytes - stats.alias_size_in_bytes),
    "decode_temp_bytes": int(stats.temp_size_in_bytes),
  }


def report_head(spec, shape, dtype_name: str, cache: str, chunks, kernel) -> dict:
  """What every report starts with: the program measured and how it was compiled."""
  context_len, num_ranks, _, m, _ = shape
  return {
    **({"cpu_compile": HOISTING_NOTE} if unhoisted(dtype_name) else {}),
    "strategy": spec.name,
    "context_len": context_len,
    "num_ranks": num_ranks,
    "dtype": dtype_name,
    "cache": cache,
    "model_parallel": m,
    "chunks": list(chunks),
    "attention": kernel.name,
  }


def on_last_row(mesh, grown, group_specs):
  """`grown` (shapes) placed on the last rank's device, or split over its model group by
  `group_specs` (`CacheForm.decode_cache_spec`), as generate holds it there."""
  row = rank_row_mesh(mesh, mesh.shape[AXIS] - 1)
  specs = group_specs if model_parallel(mesh) > 1 else jax.tree.map(lambda _: jax.P(), grown)
  return jax.tree.map(
    lambda x, spec: struct(x.shape, x.dtype, NamedSharding(row, spec)), grown, specs
  )


def last_rank_step(config, mesh, model, batch: int, grown, group_specs, itemsize: int):
  """The model's own decode step that generate runs after cache="last" (every model's:
  steppers.last_rank_stepper), lowered from shapes over the joined cache grown by the decoded
  tokens (`grown`, shapes: a `KVCache`, a `HybridCache`, latents): on the last rank's device
  (`decode.decode_step_of`) or its model group (`decode.group_decode_step`, the cache placed
  by `group_specs`: `on_last_row`). model: (graphdef, abstract state, _)."""
  graphdef, state, _ = model
  m = model_parallel(mesh)
  row = rank_row_mesh(mesh, mesh.shape[AXIS] - 1)
  row_state, _ = placed_state(config, state, row, m, itemsize)
  vector = struct((batch,), np.int32, NamedSharding(row, jax.P()))
  if m > 1:
    step = decode.group_decode_step(graphdef, row, group_specs)
  else:  # one device: the model's own decode step, as generate runs it
    step = decode.decode_step_of(graphdef)
  return step.lower(row_state, vector, vector, on_last_row(mesh, grown, group_specs))


def sharded_step(program, state_shapes, mesh, batch: int, inputs: tuple, caches: tuple):
  """A cache="sharded" decode step lowered from shapes, every model's alike (they share
  `sharded_decode.sharded_step_program`'s convention, as `steppers.sharded_stepper` calls
  them): f(state, tokens [B], prompt lengths [B], *inputs, *caches, tail index), tokens,
  lengths and index replicated over `mesh`; inputs (the parts) and caches as shapes placed
  where generate holds them."""
  replicated = NamedSharding(mesh, jax.P())
  rows = struct((batch,), np.int32, replicated)  # tokens and lengths alike
  return program.lower(state_shapes, rows, rows, *inputs, *caches, struct((), np.int32, replicated))
