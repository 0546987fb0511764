"""Analytic FLOPs and bytes of one layer on one rank (the input of the TTFT cost model).

Counts are multiply-adds x 2 of the matmuls; elementwise work (norms, RoPE, softmax) is
O(T*D + N*T*S) and is left out, which is why compiled programs count a few percent more.
"""

from __future__ import annotations

import dataclasses

from models.config import FalconConfig, ModelConfig


@dataclasses.dataclass(frozen=True)
class LayerFlops:
  projections: float  # Q, K, V and the output projection
  attention: float  # QK^T and PV over the prefix
  mlp: float

  @property
  def total(self) -> float:
    return self.projections + self.attention + self.mlp


def layer_flops(config: ModelConfig, num_queries: int, num_keys: int, batch: int = 1) -> LayerFlops:
  """One layer, `num_queries` tokens attending to `num_keys` keys (c_i and S_i for KVR rank i;
  C/p and C for TSP; T and T on one device)."""
  D, N, K, H, F = (
    config.d_model,
    config.num_heads,
    config.num_kv_heads,
    config.head_dim,
    config.mlp_dim,
  )
  T, S, B = num_queries, num_keys, batch
  projections = 2 * B * T * D * (N + 2 * K) * H + 2 * B * T * N * H * D
  attention = 2 * (2 * B * N * H * T * S)
  mlp_matrices = 2 if isinstance(config, FalconConfig) else 3
  mlp = 2 * B * T * D * config.mlp_dim * mlp_matrices
  del F
  return LayerFlops(float(projections), float(attention), float(mlp))


def kv_bytes(config: ModelConfig, num_tokens: int, batch: int, dtype_bytes: int) -> int:
  """Bytes of K and V for `num_tokens` tokens of one layer (what a hop or all-gather moves)."""
  return 2 * batch * num_tokens * config.num_kv_heads * config.head_dim * dtype_bytes
