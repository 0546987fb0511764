"""A KV-Runahead partition's per-rank compute phases timed apart (`rank_phase_times`), and
`fitted_hardware`, which turns such a measurement into cost-model figures for this model on
this device: the search then models what the layers actually cost here, not what a large
matmul does (`fitted_hybrid_hardware`: the same for a hybrid model's two kinds of layer)."""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from kvr_jax.core.chunks import chunk_starts, even_partition, prefix_ends
from kvr_jax.planning import costmodel, presets
from kvr_jax.runtime.loading import Model
from kvr_jax.strategies import latent_modelled, linear_modelled
from models.attention import attend_static
from models.flash import attend_flash
from models.gated_deltanet_layer import LinearState
from models.kernels import get_kernel, kernels_where
from models.layer_kinds import FULL_ATTENTION, past_kind
from models.masks import window_start


@dataclasses.dataclass
class RankPhases:
  """One rank's compute per prefill (all layers), measured on this process's first device."""

  rank: int
  chunk: int
  prefix: int
  qkv_s: float  # norm, Q/K/V projections, RoPE on the rank's c_i tokens
  attention_s: float  # c_i queries over the S_i-key prefix, with `attention`
  rest_s: float  # output projection, MLP, residuals

  @property
  def total_s(self) -> float:
    return self.qkv_s + self.attention_s + self.rest_s


def rank_phase_times(
  model: Model, chunks, attention: str = "flash", *, repeats: int = 3
) -> list[RankPhases]:
  """Each rank's three compute phases of KV-Runahead with `chunks`, timed apart on one device
  (layer 0's weights, times the number of layers): where a partition's time goes, next to the
  measured TTFT. Communication is not included (it is what the TTFT adds on top)."""
  cfg = model.config
  graphdef, stacked = nnx.split(model.module.blocks)
  # Layer 0 on this process's first device: with several processes the weights are global
  # (replicated) arrays, whose local copy is the first addressable shard.
  layer0 = jax.tree.map(lambda a: jnp.asarray(a.addressable_shards[0].data[0]), stacked)

  def timed(fn, *args):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - start)
    return statistics.median(times) * cfg.num_layers

  rows = []
  for i, (c, start, end) in enumerate(
    zip(chunks, chunk_starts(chunks), prefix_ends(chunks), strict=True)
  ):
    x = jnp.ones((1, c, cfg.d_model), model.dtype)
    positions = jnp.arange(start, end)[None]
    qkv = jax.jit(lambda s, x, pos: nnx.merge(graphdef, s).project_qkv(x, pos))
    q, k, v = qkv(layer0, x, positions)
    # As the program does (strategies.runahead): keys from the chunk's window start.
    first = window_start(start, cfg.sliding_window)
    k_prefix = jnp.ones((1, end - first, cfg.num_kv_heads, cfg.head_dim), model.dtype)
    attend = jax.jit(
      lambda q, k, v, offset=start - first: attend_static(
        q, k, v, offset, attention, cfg.sliding_window
      )
    )
    attn = attend(q, k_prefix, k_prefix)
    finish = jax.jit(lambda s, x, a: nnx.merge(graphdef, s).finish(x, a))
    rows.append(
      RankPhases(
        i,
        c,
        end,
        timed(qkv, layer0, x, positions),
        timed(attend, q, k_prefix, k_prefix),
        timed(finish, layer0, x, attn),
      )
    )
  return rows


def fitted_hardware(
  model: Model,
  context_len: int,
  num_ranks: int = 2,
  attention: str = "flash",
  repeats: int = 3,
  base: costmodel.Hardware | None = None,
) -> costmodel.Hardware:
  """Cost-model hardware fitted to what this model's layers cost on this process's device.

  Times the per-rank phases of an even KV-Runahead split of `context_len` over `num_ranks`
  (`rank_phase_times`, a few seconds) and sets the FLOP/s of the linear phases (qkv, rest) and
  of the attention kernel to the measured FLOPs per second; memory bandwidth stays `base`'s
  (default: the `local` calibration's). Why: the `local` calibration times a 1024^3 matmul
  and one flash shape, and a small model's projections (norms, RoPE, narrow matmuls) run
  several times slower than that while its attention runs faster, so the modelled split gave
  the first rank too many tokens. Pass the result as `PartitionPlan("search", hardware=...)`.
  """
  kernel = get_kernel(attention)
  if kernel.scores_in_memory:
    raise ValueError(
      "fitted_hardware models kernels that do not write their scores, "
      f"{kernels_where(scores_in_memory=False)}; got {kernel.name!r}"
    )
  cfg, db = model.config, jnp.dtype(model.dtype).itemsize
  chunks = even_partition(context_len, num_ranks)
  rows = rank_phase_times(model, chunks, attention, repeats=repeats)
  linear_flops = attention_flops = 0.0
  for row in rows:
    first = window_start(row.prefix - row.chunk, cfg.sliding_window)
    work = costmodel.phase_work(
      cfg, row.chunk, row.prefix - first, 1, db, **costmodel.kernel_flags(kernel)
    )
    linear_flops += cfg.num_layers * (work["qkv"].flops + work["rest"].flops)
    attention_flops += cfg.num_layers * work["attention"].flops
  linear_rate = linear_flops / sum(r.qkv_s + r.rest_s for r in rows)
  attention_rate = attention_flops / sum(r.attention_s for r in rows)
  base = base or presets.hardware_preset(presets.LOCAL)
  return costmodel.Hardware(
    "fitted",
    linear_rate,
    base.memory_bandwidth,
    1.0,
    1.0,
    f"fitted to {cfg.num_layers}-layer phases at C={context_len}: linear "
    f"{linear_rate / 1e9:.1f} GFLOP/s, attention {attention_rate / 1e9:.1f} GFLOP/s",
    fused_attention_fraction=attention_rate / linear_rate,
  )


def fitted_hybrid_hardware(
  model: Model, context_len: int, repeats: int = 3, base: costmodel.Hardware | None = None
) -> costmodel.Hardware:
  """Cost-model hardware fitted to a hybrid model's layers (linear and full attention) on
  this process's first device, at `context_len` tokens on one device:
    matmul rate       a linear layer's output phase (gated norm, out_proj, MLP) timed apart:
                      the model's own narrow matmuls, which the full layers share;
    linear-rule rate  what the rest of a whole linear layer takes, its projections at the
                      matmul rate taken off;
    attention rate    the flash kernel over the full layers' heads, causal.
  Why: the `local` calibration's 1024^3 matmul and its one flash and rule shape put a small
  hybrid's linear layers at well under their real cost beside its attention (measured for
  bench-qwen3.5 at 8k on one core: a linear layer 0.25 s against 0.15 modelled, the
  attention 0.60 s against 0.75), so the search gave the first rank nearly every token."""
  cfg = model.config
  linear_cfg, full_cfg = cfg.of_kind(cfg.linear_kind), cfg.of_kind(FULL_ATTENTION)
  T, db = context_len, jnp.dtype(model.dtype).itemsize
  graphdef, stacked = nnx.split(model.module.linear_blocks)
  first = jax.tree.map(lambda w: w[0], stacked)
  x_BTD = jnp.ones((1, T, cfg.d_model), model.dtype)
  h, d_k, d_v = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
  past = LinearState(
    jnp.zeros((1, h, d_k, d_v), jnp.float32),
    jnp.zeros((1, cfg.linear_conv_kernel - 1, cfg.conv_channels), model.dtype),
  )
  o_BThv = jnp.ones((1, T, h, d_v), jnp.float32)

  @jax.jit
  def whole_layer(state, x_BTD):
    return nnx.merge(graphdef, state).run(x_BTD, past)[0]

  @jax.jit
  def output(state, x_BTD, o_BThv):
    return nnx.merge(graphdef, state).output(x_BTD, o_BThv, o_BThv)

  N, K, H = full_cfg.num_heads, full_cfg.num_kv_heads, full_cfg.head_dim
  q_BTNH, kv_BTKH = jnp.ones((1, T, N, H), model.dtype), jnp.ones((1, T, K, H), model.dtype)
  flash = jax.jit(lambda q, kv: attend_flash(q, kv, kv, 0)[0])
  base = base or presets.hardware_preset(presets.LOCAL)
  setup = costmodel.Setup(base, presets.links_preset(presets.LOCAL), dtype_bytes=db)
  work = linear_modelled.linear_phases(linear_cfg, T, setup, entry_map=False)
  output_s = presets.best_time(output, first, x_BTD, o_BThv, repeats=repeats)
  layer_s = presets.best_time(whole_layer, first, x_BTD, repeats=repeats)
  flash_s = presets.best_time(flash, q_BTNH, kv_BTKH, repeats=repeats)
  matmul_rate = work["rest"].flops / output_s
  rule_s = layer_s - (work["linear"].flops + work["rest"].flops) / matmul_rate
  # A rule faster than the matmuls (noise on a tiny model) is taken at the matmul rate.
  rule_rate = work["rule"].flops / max(rule_s, work["rule"].flops / matmul_rate)
  attention = costmodel.phase_work(full_cfg, T, T, 1, db, **costmodel.kernel_flags("flash"))
  attention_rate = attention["attention"].flops / flash_s
  return _fitted(
    base,
    f"one linear layer and the flash kernel at C={T}",
    matmul_rate,
    attention_rate,
    rule_rate,
  )


def _fitted(base, what: str, matmul_rate, attention_rate, rule_rate=None) -> costmodel.Hardware:
  """Hardware running at the fitted rates (FLOP/s): the matmul rate as its peak at fraction 1,
  attention's (and a linear rule's) as fractions of it; `base`'s memory bandwidth."""
  rates = f"matmul {matmul_rate / 1e9:.1f} GFLOP/s, "
  if rule_rate is not None:
    rates += f"linear rule {rule_rate / 1e9:.1f} GFLOP/s, "
  return costmodel.Hardware(
    "fitted",
    matmul_rate,
    base.memory_bandwidth,
    1.0,
    1.0,
    f"fitted to {what}: {rates}attention {attention_rate / 1e9:.1f} GFLOP/s",
    fused_attention_fraction=attention_rate / matmul_rate,
    linear_rule_fraction=None if rule_rate is None else rule_rate / matmul_rate,
  )


def fitted_latent_hardware(
  model: Model, context_len: int, repeats: int = 3, base: costmodel.Hardware | None = None
) -> costmodel.Hardware:
  """Cost-model hardware fitted to a latent-attention model's layer (DeepSeek-V3's: an
  experts layer, its first) on this process's first device, at `context_len` tokens:
    matmul rate      its queries and latents, the expansion of every latent into the heads'
                     K,V and the out-projection and mixture, timed apart, against their
                     modelled FLOPs (`latent_modelled.latent_phases`);
    attention rate   the flash kernel over the expanded heads, causal.
  Why: as for the hybrids (`fitted_hybrid_hardware`), the `local` calibration's 1024^3 matmul
  is not what a small model's narrow matmuls and grouped experts run at, so KVR-S split
  bench-deepseek by rates it does not run at (KV-Runahead 5-7% behind the peers)."""
  cfg = model.config
  T, db = context_len, jnp.dtype(model.dtype).itemsize
  stack = model.module.blocks if model.module.blocks is not None else model.module.dense_blocks
  graphdef, stacked = nnx.split(stack)
  first = jax.tree.map(lambda w: w[0], stacked)
  x_BTD = jax.random.normal(jax.random.key(0), (1, T, cfg.d_model), model.dtype)
  positions_BT = jnp.arange(T)[None]

  @jax.jit
  def project(state, x_BTD):
    block = nnx.merge(graphdef, state)
    h_BTD = block.attention_input(x_BTD)
    return block.queries(h_BTD, positions_BT), block.latents(h_BTD, positions_BT)

  (q_nope, q_rope), latents_BTC = project(first, x_BTD)

  @jax.jit
  def expand(state, latents_BTC):
    return nnx.merge(graphdef, state).expanded_keys_values(latents_BTC)

  k_BTNh, v_BTNh = expand(first, latents_BTC)
  q_BTNh = jax.jit(lambda s, a, b: nnx.merge(graphdef, s).expanded_queries(a, b))(
    first, q_nope, q_rope
  )
  flash = jax.jit(lambda q, k, v: attend_flash(q, k, v, 0)[0])
  attn_BTNv = flash(q_BTNh, k_BTNh, v_BTNh)[..., : cfg.v_head_dim]

  @jax.jit
  def rest(state, x_BTD, attn_BTNv):
    return nnx.merge(graphdef, state).finish(x_BTD, attn_BTNv)

  base = base or presets.hardware_preset(presets.LOCAL)
  setup = costmodel.Setup(base, presets.links_preset(presets.LOCAL), dtype_bytes=db)
  work = latent_modelled.latent_phases(cfg, T, T, (T + 1) / 2, setup)
  matmul_s = sum(
    presets.best_time(fn, *args, repeats=repeats)
    for fn, args in (
      (project, (first, x_BTD)),
      (expand, (first, latents_BTC)),
      (rest, (first, x_BTD, attn_BTNv)),
    )
  )
  flash_s = presets.best_time(flash, q_BTNh, k_BTNh, v_BTNh, repeats=repeats)
  matmul_rate = sum(work[name].flops for name in ("qkv", "expand", "rest")) / matmul_s
  attention_rate = work["attention"].flops / flash_s
  return _fitted(base, f"one latent layer at C={T}", matmul_rate, attention_rate)


def fitted_model_hardware(
  model: Model, context_len: int, num_ranks: int = 2, repeats: int = 3
) -> costmodel.Hardware:
  """Cost-model hardware fitted to this model's own layers here, as its layer kinds are timed:
  a hybrid's (any Gated DeltaNet layer: `fitted_hybrid_hardware`), a latent-attention
  model's (`fitted_latent_hardware`), else a softmax-attention model's phases on an even
  split over `num_ranks` (`fitted_hardware`, the flash kernel)."""
  past = past_kind(model.config)
  if past == "hybrid":
    return fitted_hybrid_hardware(model, context_len, repeats)
  if past == "latent":
    return fitted_latent_hardware(model, context_len, repeats)
  return fitted_hardware(model, context_len, num_ranks, repeats=repeats)
