"""Per-device memory of a prefill program, from XLA's own analysis of it compiled from shapes.

Nothing is allocated: the weights and tokens are `ShapeDtypeStruct`s, the program is the one
`prefill` runs (the same `PrefillPlan.compile`), and `compiled.memory_analysis()` reports what
XLA will allocate on each device: its arguments (the replicated weights and the rank's
tokens), its outputs (the logits and the rank's part of the KV cache) and its temporaries
(every buffer the program needs while it runs, at XLA's peak). On a CPU host with fewer
devices than ranks it runs itself again in a subprocess with emulated CPU devices.

CPU caveat: XLA:CPU turns bfloat16 matmul operands into float32 temporaries (a CPU-only
artifact that would double the weights), so measure float32 shapes and halve them for a
bfloat16 estimate, and say so (docs/cache.md does).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from kvr_jax.core.chunks import check_ranks
from kvr_jax.inference.kv_cache import (
  check_cache,
)
from kvr_jax.inference.prefill_plan import check_partition_applies, plan_from_shape
from kvr_jax.inference.shape import PrefillShape
from kvr_jax.planning.partition import PartitionPlan
from kvr_jax.runtime.loading import abstract_model, config_of, resolve_dtype
from kvr_jax.runtime.mesh import AXIS, make_mesh
from kvr_jax.runtime.tensor_parallel import check_model_parallel
from kvr_jax.strategies import get_strategy
from kvr_jax.tools.past_memory import PAST_MEMORY, Measured, past_figures
from kvr_jax.tools.xla_memory import (
  HOISTING_NOTE,
  LOW_PRECISION,
  MEMORY_PARTITION,
  NO_HOISTED_CONVERTS,
  analysis,
  compile_for_figures,
  placed_state,
  report_head,
  struct,
)
from models.config import ModelConfig
from models.families import config_from_dict
from models.kernels import AttentionKernel

__all__ = [
  "HOISTING_NOTE",
  "LOW_PRECISION",
  "MEMORY_PARTITION",
  "NO_HOISTED_CONVERTS",
  "compiled_memory",
]


def _config(model) -> ModelConfig:
  if isinstance(model, ModelConfig):
    return model
  if isinstance(model, str):
    return config_of(model)
  raise ValueError(
    f"`model` must be a preset name, a model directory or a ModelConfig, got {type(model).__name__}"
  )


def _check_arguments(config, spec, cache, partition, context_len, num_ranks, batch):
  """compiled_memory's arguments, each refused by name; the partition with numpy integers
  made ints (they travel to a subprocess as JSON)."""
  check_cache(cache)
  if isinstance(partition, (list, tuple, np.ndarray)):
    partition = [
      int(c) if isinstance(c, np.integer) and not isinstance(c, np.bool_) else c for c in partition
    ]
  # The default plan (also as it comes back from a subprocess's JSON) is no choice of the
  # user's; lengths, another plan or method are, and a non-partitioned strategy refuses them.
  explicit = not (
    partition is None
    or (isinstance(partition, PartitionPlan) and partition == MEMORY_PARTITION)
    or (isinstance(partition, str) and partition == "even")
  )
  if not spec.partitioned and not explicit:
    partition = None
  check_partition_applies(spec, partition)
  for name, value in (("context_len", context_len), ("num_ranks", num_ranks), ("batch", batch)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
  if spec.max_ranks is not None and num_ranks > spec.max_ranks:
    raise ValueError(f"strategy {spec.name!r} runs on at most {spec.max_ranks} rank(s)")
  check_ranks(int(context_len), int(num_ranks))
  if context_len > config.max_position_embeddings:
    raise ValueError(
      f"context_len={context_len} exceeds max_position_embeddings="
      f"{config.max_position_embeddings} (pass a ModelConfig with more positions)"
    )
  return partition


def compiled_memory(
  model,
  strategy: str = "kvr",
  *,
  context_len: int,
  num_ranks: int,
  dtype: str = "float32",
  cache: str = "last",
  batch: int = 1,
  attention: str | None = None,
  partition=MEMORY_PARTITION,
  model_parallel: int = 1,
  device_memory: int | None = None,
  decode_tokens: int = 0,
) -> dict:
  """XLA's per-device memory of `strategy`'s prefill program, compiled from shapes only.

  model: a preset name or a ModelConfig. Returns a dict: per device `argument_bytes`,
  `output_bytes`, `temp_bytes` (of the prefill program as that layout runs it: KV-Runahead's
  cache="last" program also outputs its last hops), `weights_bytes`, `kv_cache_bytes` (the
  whole prompt's cache), the chunks, and for cache="last" `move_argument_bytes` and
  `move_temp_bytes`: the move of the parts onto the last rank's device (after the program),
  which then holds the whole cache and one run; for KV-Runahead the join of its last hops and
  its part where they lie.

  device_memory: the bytes of the device the prefill is planned for (e.g. 80e9 for an H100),
  default this machine's: KV-Runahead's cache="last" joins its last hops only where their
  zeros on the other ranks fit a share of it (kv_cache.join_affordable; `joins_last_hop`),
  as prefill decides in one process; otherwise its parts move.

  model_parallel: devices per rank (a ("ranks", "model") mesh of num_ranks x m devices, the
  weights split as prefill splits them): every figure is then one device's, `weights_bytes`
  its shard of the weights, `kv_cache_bytes` its shard of the whole prompt's cache, and the
  move that of writing one run into one device's heads of the cache on the last rank's row
  (KV-Runahead's: one device's join of its heads' last hop and own part).

  decode_tokens > 0: also `decode_argument_bytes`, `decode_output_bytes` (those not written
  into a donated argument's buffer), `decode_temp_bytes`: one decode step of the layout with
  room for that many new tokens (cache="last": on the last rank's device, the whole cache
  grown by them among its arguments, a windowed layer's window only where it is shorter;
  cache="sharded": on every device, its part and the decoded tokens' K,V among them); and
  `decode_cache_bytes`, the cache among those arguments (one device's share).

  Every kind of past is measured alike (kvr_jax.tools.past_memory: the kind gives its
  shapes, the programs are the ones prefill and generate run). A latent-attention model
  (DeepSeek-V3) reports `latent_cache_bytes` in place of `kv_cache_bytes` (its cache is
  headless, so whole on every device of a model group); its move figures are KV-Runahead's
  join of its last hop and own part, or a peer's parts all on the last rank's device at once.
  A hybrid model (Qwen3.5, Qwen3-Next) reports `kv_cache_bytes` for its full layers' K,V and
  `state_cache_bytes` for its linear layers' states and halos (one device's heads of each);
  its move figures as a latent model's, with the states.
  """
  config = _config(model)
  spec = get_strategy(strategy)
  partition = _check_arguments(config, spec, cache, partition, context_len, num_ranks, batch)
  context_len, num_ranks, batch, m = int(context_len), int(num_ranks), int(batch), model_parallel
  check_model_parallel(config, m)
  attention = spec.check_attention(attention)
  dtype_name = np.dtype(resolve_dtype(dtype)).name
  if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, (int, np.integer)):
    raise ValueError(f"`decode_tokens` must be an integer >= 0, got {decode_tokens!r}")
  if decode_tokens < 0 or context_len + decode_tokens > config.max_position_embeddings:
    raise ValueError(
      f"decode_tokens={decode_tokens}: must be >= 0 and fit with the prompt in "
      f"max_position_embeddings={config.max_position_embeddings}"
    )
  if len(jax.devices()) < num_ranks * m:
    arguments = (context_len, num_ranks, dtype_name, cache, batch, attention, partition, m)
    return _in_subprocess(config, strategy, *arguments, device_memory, int(decode_tokens))
  shape = (context_len, num_ranks, batch, m, int(decode_tokens))
  return _measure(config, spec, shape, dtype_name, cache, attention, partition, device_memory)


def _measure(config, spec, shape, dtype_name, cache, attention, partition, device_memory):
  """compiled_memory on this process's devices (enough of them): the plan prefill would make
  for this shape, its program (`PrefillPlan.compile`: the strategy's, or a hybrid's or latent
  model's own) compiled from shapes and XLA's analysis of it, then the figures of the model's
  past (`past_memory.past_figures`, its kind's shapes from `PAST_MEMORY`): its cache's bytes,
  the move after the program and the decode step."""
  context_len, num_ranks, batch, m, decode_tokens = shape
  graphdef, state = nnx.split(abstract_model(config, dtype_name))
  mesh = make_mesh(num_ranks) if m == 1 else make_mesh(num_ranks, model=m)
  # The plan prefill would make for this shape (one process: no answer to agree on).
  prompt = PrefillShape(config, dtype_name, context_len, batch, longest=context_len)
  plan = plan_from_shape(
    prompt, spec, mesh, partition, attention, cache, device_memory=device_memory
  )
  state_shapes, weights_bytes = placed_state(config, state, mesh, m, prompt.itemsize)
  tokens_shape = spec.arrange(np.zeros((batch, context_len), np.int32), plan.chunks).shape
  tokens = struct(tokens_shape, np.int32, NamedSharding(mesh, jax.P(AXIS)))
  lowered = plan.compile(graphdef).lower(state_shapes, tokens)
  model = (graphdef, state, state_shapes)
  measured = Measured(config, plan, shape, dtype_name, lowered.out_info[1], model)
  return {
    **report_head(spec, shape, dtype_name, cache, plan.chunks, plan.kernel),
    **analysis(compile_for_figures(lowered, dtype_name)),
    "weights_bytes": weights_bytes,
    **past_figures(measured, PAST_MEMORY[plan.cache_form.name]),
  }


def _in_subprocess(
  config,
  strategy,
  context_len,
  num_ranks,
  dtype,
  cache,
  batch,
  attention,
  plan,
  model_parallel,
  device_memory,
  decode_tokens,
):
  """The same call in a fresh interpreter with num_ranks x model_parallel emulated CPU
  devices."""
  arguments = {
    "config": config.to_dict(),
    "strategy": strategy,
    "context_len": context_len,
    "num_ranks": num_ranks,
    "dtype": dtype,
    "cache": cache,
    "batch": batch,
    # A kernel travels as its name, or as its fields where it is a record (its block sizes).
    "attention": attention if isinstance(attention, str) else dataclasses.asdict(attention),
    "model_parallel": model_parallel,
    "device_memory": None if device_memory is None else int(device_memory),
    "decode_tokens": decode_tokens,
    # A plan travels as its name, its lengths or its fields.
    "plan": dataclasses.asdict(plan) if isinstance(plan, PartitionPlan) else plan,
  }
  if isinstance(plan, (tuple, np.ndarray)):
    arguments["plan"] = [int(c) for c in plan]
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={num_ranks * model_parallel}"
  ).strip()
  done = subprocess.run(
    [sys.executable, "-m", "kvr_jax.tools.memory", json.dumps(arguments)],
    env=env,
    capture_output=True,
    text=True,
    check=False,
  )
  if done.returncode != 0:
    last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    if last.startswith("ValueError: "):  # the user's mistake: the same error as in process
      raise ValueError(last[len("ValueError: ") :])
    raise RuntimeError(f"compiled_memory on {num_ranks} emulated devices failed: {last}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def _main(argument: str) -> None:
  arguments = json.loads(argument)
  plan = arguments.pop("plan")
  if isinstance(plan, dict):
    plan = PartitionPlan(**plan)
  if isinstance(arguments["attention"], dict):
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in arguments["attention"].items()}
    arguments["attention"] = AttentionKernel(**fields)
  config = config_from_dict(arguments.pop("config"))
  print(json.dumps(compiled_memory(config, partition=plan, **arguments)))


if __name__ == "__main__":
  _main(sys.argv[1])
