"""Which form a rank attends its latent prefix in: expanded or absorbed, measured.

A KV-Runahead rank with c queries receives the latents of its S-position prefix. It can
expand every latent into each head's keys and values with kv_b_proj and attend as multi-head
attention (what prefill runs: `LatentAttention.attend_expanded`), or take its queries into the
latent space and attend the C-wide latents as one shared key head (the absorbed form decode
runs: `LatentAttention.attend_absorbed_chunk`). Per layer, in multiply-adds:

  expanded  (S + c) R N (n + v)        building the keys and values, once per key
            + c (S + c) N (n + r + v)  attention over them (dense; flash skips the masked half)
  absorbed  c N n R + c N R v          the queries in, the output out
            + c (S + c) N (2R + r)     attention over the latents

so the absorbed form saves the per-key expansion and pays (2R + r) against (n + r + v) per
query and key: on DeepSeek-V3 and Moonlight (R 512, n 128, r 64, v 128) it is the cheaper
sum only below about c = R (n + v) / (2R + r - n - r - v) = 171 queries, whatever S.
`time_latent_forms` times both on this machine at one layer of a model's real attention
shapes; `latent_forms_table` prints them beside those modelled sums.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvr_jax.runtime.loading import preset_config
from models.deepseek_v3 import DeepseekV3Block


@dataclasses.dataclass(frozen=True)
class FormTiming:
  """One rank's latent attention of `chunk_len` queries after a `prefix_len` prefix, median
  seconds of each form on this machine, and each form's modelled multiply-adds."""

  chunk_len: int
  prefix_len: int
  expanded_flash_s: float
  expanded_dense_s: float
  absorbed_s: float
  expanded_macs: int
  absorbed_macs: int

  @property
  def absorbed_over_expanded(self) -> float:
    """The absorbed form's time over the faster expanded kernel's (< 1: absorbed is faster)."""
    return self.absorbed_s / min(self.expanded_flash_s, self.expanded_dense_s)


def modelled_macs(config, chunk_len: int, prefix_len: int) -> tuple[int, int]:
  """(expanded, absorbed) multiply-adds of one layer's attention (dense scores), as the
  module docstring counts them."""
  c, keys = chunk_len, prefix_len + chunk_len
  N, R = config.num_heads, config.kv_lora_rank
  n, r, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
  expanded = keys * R * N * (n + v) + c * keys * N * (n + r + v)
  absorbed = c * N * n * R + c * N * R * v + c * keys * N * (2 * R + r)
  return expanded, absorbed


def one_latent_layer(config, seed: int = 0):
  """(graphdef, state) of one layer's latent attention with random weights (a dense MLP of
  one column beside it: only the attention is timed)."""
  config = dataclasses.replace(config, mlp_dim=1)
  block = DeepseekV3Block(
    config, num_layers=1, experts=False, dtype=jnp.float32, rngs=nnx.Rngs(seed)
  )
  graphdef, stacked = nnx.split(block)
  return graphdef, jax.tree.map(lambda x: x[0], stacked)


def _median_seconds(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - start)
  return statistics.median(samples)


def time_latent_forms(
  model: str = "moonlight-16b-a3b",
  prefix_len: int = 4096,
  chunk_lens=(16, 64, 256, 1024),
  repeats: int = 5,
  seed: int = 0,
) -> list[FormTiming]:
  """Both forms of one layer of `model`'s latent attention (a preset's shapes, float32,
  random weights and inputs), for a rank of each of `chunk_lens` queries after `prefix_len`
  positions: the expanded form with the flash and the dense kernel, the absorbed form (dense
  scores), each jitted once per shape and timed `repeats` times after a warm-up."""
  config = preset_config(model)
  if getattr(config, "kv_lora_rank", None) is None:
    raise ValueError(f"{model!r} has no latent attention (a deepseek_v3 preset has)")
  if prefix_len < 1 or any(int(c) < 1 for c in chunk_lens):
    raise ValueError(f"prefix_len and chunk_lens must be positive, got {prefix_len}, {chunk_lens}")
  graphdef, state = one_latent_layer(config, seed)
  N, C = config.num_heads, config.kv_lora_rank + config.qk_rope_head_dim
  n, r = config.qk_nope_head_dim, config.qk_rope_head_dim
  rng = np.random.default_rng(seed)
  rows = []
  for c in (int(c) for c in chunk_lens):

    def form(kind, c=c):
      def run(state, q_nope, q_rope, cache):
        layer = nnx.merge(graphdef, state)
        if kind == "absorbed":
          return layer.attend_absorbed_chunk(q_nope, q_rope, cache, prefix_len)
        return layer.attend_expanded(q_nope, q_rope, cache, prefix_len, kind)

      return jax.jit(run)

    q_nope = jnp.asarray(rng.standard_normal((1, c, N, n)), jnp.float32)
    q_rope = jnp.asarray(rng.standard_normal((1, c, N, r)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((1, prefix_len + c, C)), jnp.float32)
    args = (state, q_nope, q_rope, cache)
    seconds = {kind: _median_seconds(form(kind), args, repeats) for kind in KINDS}
    rows.append(
      FormTiming(
        c,
        prefix_len,
        seconds["flash"],
        seconds["dense"],
        seconds["absorbed"],
        *modelled_macs(config, c, prefix_len),
      )
    )
  return rows


KINDS = ("flash", "dense", "absorbed")


def latent_forms_table(rows: list[FormTiming]) -> str:
  """The MEASURED seconds of each form and the MODELLED multiply-adds' ratio, one row per
  chunk length."""
  lines = [
    "MEASURED seconds on this machine (median), one layer, float32; MODELLED: the forms' "
    "multiply-adds (dense scores)",
    f"{'c':>6} {'S':>7} {'expanded flash':>15} {'expanded dense':>15} {'absorbed':>10} "
    f"{'absorbed/expanded':>18} {'modelled absorbed/expanded':>27}",
  ]
  for row in rows:
    lines.append(
      f"{row.chunk_len:>6} {row.prefix_len:>7} {row.expanded_flash_s:>14.4f}s "
      f"{row.expanded_dense_s:>14.4f}s {row.absorbed_s:>9.4f}s "
      f"{row.absorbed_over_expanded:>17.2f}x {row.absorbed_macs / row.expanded_macs:>26.2f}x"
    )
  return "\n".join(lines)
