"""DeepSeek-V3's configuration (`DeepseekV3Config`: latent attention's ranks and head dims,
the dense first layers, the router's groups and scaling) and its translation from a Hugging
Face `config.json` as transformers reads it; models/deepseek_v3.py holds the module, the
tensor names and the family's record."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from models.config import ModelConfig
from models.hf_config import or_default, rope_from_hf
from models.layer_kinds import LatentAttentionKind


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(ModelConfig):
  """DeepSeek-V3: latent attention's ranks and head dims; the experts and their router.
  `head_dim` is a query's (and an expanded key's) width, nope + rope; `num_kv_heads` is
  `num_heads` (every head expands its own key and value from the shared latent); `mlp_dim`
  is the dense layers' F."""

  architecture: ClassVar[str] = "deepseek_v3"
  mlp_matrices: ClassVar[int] = 3
  reductions_per_layer: ClassVar[int] = 2
  q_lora_rank: int  # 0: a direct q projection
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  rope_interleave: bool = True
  first_dense_layers: int = 0
  num_experts: int = 0
  experts_per_token: int = 0
  expert_dim: int = 0
  shared_experts: int = 0
  num_expert_groups: int = 1
  groups_per_token: int = 1
  normalize_expert_weights: bool = True
  routed_scaling_factor: float = 1.0

  def __post_init__(self):
    super().__post_init__()
    ints = (
      ("q_lora_rank", 0),
      ("kv_lora_rank", 1),
      ("qk_nope_head_dim", 1),
      ("qk_rope_head_dim", 2),
      ("v_head_dim", 1),
      ("first_dense_layers", 0),
      ("num_experts", 0),
      ("experts_per_token", 0),
      ("expert_dim", 0),
      ("shared_experts", 0),
      ("num_expert_groups", 1),
      ("groups_per_token", 1),
    )
    for name, smallest in ints:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < smallest:
        raise ValueError(f"config field `{name}` must be an integer >= {smallest}, got {value!r}")
    if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
      raise ValueError(
        f"`head_dim` ({self.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
        f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim})"
      )
    if self.num_kv_heads != self.num_heads:
      raise ValueError("latent attention expands a key per head: `num_kv_heads` = `num_heads`")
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"`qk_rope_head_dim` must be even, got {self.qk_rope_head_dim}")
    if self.sliding_window is not None or self.layer_windows is not None:
      raise ValueError("DeepSeek-V3 has no sliding window")
    if self.first_dense_layers > self.num_layers:
      raise ValueError(
        f"`first_dense_layers` ({self.first_dense_layers}) exceeds the {self.num_layers} layers"
      )
    if self.moe_layers:
      self._check_experts()

  def _check_experts(self) -> None:
    E, k = self.num_experts, self.experts_per_token
    G, g = self.num_expert_groups, self.groups_per_token
    if not E or not self.expert_dim:
      raise ValueError(
        f"{self.moe_layers} layers are a mixture of experts: `num_experts` and `expert_dim` "
        "must be > 0"
      )
    if E % G or not 1 <= g <= G:
      raise ValueError(
        f"{E} experts in `num_expert_groups`={G} groups (config.json `n_group`), "
        f"`groups_per_token`={g} (`topk_group`): the groups must divide the experts and a "
        "token choose 1 to all of them"
      )
    if E // G < 2:
      raise ValueError(f"a group's score is its two best experts': groups of {E // G} cannot")
    if not 1 <= k <= g * (E // G):
      raise ValueError(
        f"`experts_per_token`={k} (config.json `num_experts_per_tok`) must be in "
        f"[1, {g * (E // G)}] (the experts of the {g} groups a token chooses)"
      )

  @property
  def moe_layers(self) -> int:
    return self.num_layers - self.first_dense_layers

  @property
  def layer_kinds(self) -> tuple[LatentAttentionKind, ...]:
    return (LatentAttentionKind(self.kv_lora_rank, self.qk_rope_head_dim),) * self.num_layers

  @property
  def kinds(self) -> tuple[LatentAttentionKind, ...]:
    return self.layer_kinds[:1]

  @property
  def kind(self) -> LatentAttentionKind:
    return self.layer_kinds[0]

  def of_kind(self, kind) -> DeepseekV3Config:
    return self

  @property
  def cache_width(self) -> int:
    """C: one token's cache entry per layer (the latent and the shared rope key)."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def softmax_scale(self) -> float:
    """1/sqrt(nope + rope), times YaRN's mscale(factor, mscale_all_dim) squared where the
    rope scales (transformers' `yarn_apply_mscale`)."""
    scale = self.head_dim**-0.5
    rope = self.rope
    if rope.type != "default" and rope.mscale_all_dim and rope.factor > 1:
      mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
      scale *= mscale * mscale
    return scale

  # What the cost model counts of the MLP: the mixture's layers (most of them): a token's k
  # experts and the shared ones; the router's E columns.
  @property
  def active_mlp_dim(self) -> int:
    if not self.moe_layers:
      return self.mlp_dim
    return self.expert_dim * (self.experts_per_token + self.shared_experts)

  def mlp_weight_dim(self, num_tokens: float) -> float:
    if not self.moe_layers:
      return self.mlp_dim
    routed = min(self.num_experts, num_tokens * self.experts_per_token)
    return self.expert_dim * (routed + self.shared_experts)

  @property
  def router_dim(self) -> int:
    return self.num_experts if self.moe_layers else 0

  def attention_params(self) -> int:
    D, N, Q, R = self.d_model, self.num_heads, self.q_lora_rank, self.kv_lora_rank
    n, r, v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
    q = D * Q + Q + Q * N * (n + r) if Q else D * N * (n + r)
    return q + D * (R + r) + R + R * N * (n + v) + N * v * D

  def num_params(self) -> int:
    D, E, f = self.d_model, self.num_experts, self.expert_dim
    dense = self.first_dense_layers * self.mlp_matrices * D * self.mlp_dim
    moe = self.moe_layers * (self.mlp_matrices * D * f * (E + self.shared_experts) + D * E)
    head = 0 if self.tie_embeddings else self.vocab_size * D
    per_layer = self.attention_params() + 2 * D
    return self.vocab_size * D + self.num_layers * per_layer + dense + moe + D + head


MODEL_TYPES = ("deepseek_v3",)


def deepseek_v3_from_hf(
  hf: dict[str, Any], model_type: str, common: dict[str, Any]
) -> DeepseekV3Config:
  """DeepSeek-V3 as transformers reads it (its defaults where a key is absent)."""
  if hf.get("attention_bias", False):
    raise ValueError("config.json: `attention_bias`=true is not supported (DeepSeek-V3 has none)")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: `hidden_act`={hf['hidden_act']!r} is not supported (silu)")
  get = lambda key: or_default(hf, key, model_type)  # noqa: E731
  num_heads = common["num_heads"]
  kv_heads = get("num_key_value_heads") or num_heads  # absent: transformers' 128
  if kv_heads != num_heads:
    raise ValueError(
      f"config.json: `num_key_value_heads`={kv_heads} != num_attention_heads={num_heads}: "
      "latent attention expands a key per head (transformers would repeat them)"
    )
  nope, rope_dim = get("qk_nope_head_dim"), get("qk_rope_head_dim")
  rope_hf = dict(hf)
  rope_hf.pop("partial_rotary_factor", None)
  return DeepseekV3Config(
    **common,
    num_kv_heads=num_heads,
    head_dim=nope + rope_dim,
    mlp_dim=get("intermediate_size"),
    norm_eps=get("rms_norm_eps"),
    rope=rope_from_hf(rope_hf, common["max_position_embeddings"], model_type),
    tie_embeddings=hf.get("tie_word_embeddings", False),
    q_lora_rank=get("q_lora_rank") or 0,
    kv_lora_rank=get("kv_lora_rank"),
    qk_nope_head_dim=nope,
    qk_rope_head_dim=rope_dim,
    v_head_dim=get("v_head_dim"),
    rope_interleave=bool(get("rope_interleave")),
    first_dense_layers=min(get("first_k_dense_replace") or 0, common["num_layers"]),
    num_experts=get("n_routed_experts"),
    experts_per_token=get("num_experts_per_tok"),
    expert_dim=get("moe_intermediate_size"),
    shared_experts=get("n_shared_experts") or 0,
    num_expert_groups=get("n_group") or 1,
    groups_per_token=get("topk_group") or 1,
    normalize_expert_weights=bool(get("norm_topk_prob")),
    routed_scaling_factor=float(get("routed_scaling_factor")),
  )
