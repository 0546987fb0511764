"""Tiny random Hugging Face checkpoints written with save_pretrained (no model hub)."""

from __future__ import annotations

import numpy as np
import torch
import transformers

VOCAB = 128


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
  """Every parameter random, norms around 1: a swapped or ignored tensor changes the logits."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn(param.shape, generator=gen)
      if param.ndim == 1 and ("norm" in name or "ln" in name) and name.endswith("weight"):
        param.copy_(1.0 + 0.1 * noise)
      elif param.ndim == 1:
        param.copy_(0.1 * noise)
      else:
        param.copy_(0.1 * noise)
  return model.eval()


LLAMA_CASES = {
  "llama-mha": dict(num_attention_heads=4, num_key_value_heads=4),
  "llama-gqa": dict(num_attention_heads=4, num_key_value_heads=2),
  "llama3-rope": dict(
    num_attention_heads=4,
    num_key_value_heads=1,
    rope_parameters={
      "rope_type": "llama3",
      "rope_theta": 10000.0,
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64,
    },
  ),
  "llama-linear-rope": dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
  ),
  "llama-tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}

FALCON_CASES = {
  # Falcon-7B form: multi-query, one input LayerNorm, parallel attention + MLP.
  "falcon-7b-form": dict(
    num_attention_heads=4, multi_query=True, parallel_attn=True, new_decoder_architecture=False
  ),
  # Older multi-head Falcon (RW): per-head interleaved q, k, v in query_key_value.
  "falcon-mha-form": dict(
    num_attention_heads=4, multi_query=False, parallel_attn=True, new_decoder_architecture=False
  ),
  # Falcon-40B form: grouped KV heads, ln_attn and ln_mlp.
  "falcon-40b-form": dict(num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True),
}


# The families that are the Llama decoder with switches: (transformers classes, config).
# The Mistral window (6) is shorter than the prompts and than some ranks' chunks.
FAMILY_CASES = {
  "mistral-window": (
    "MistralConfig",
    "MistralForCausalLM",
    dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=6),
  ),
  "qwen2-bias": (
    "Qwen2Config",
    "Qwen2ForCausalLM",
    dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, use_sliding_window=False),
  ),
  # Gemma 3: layer 0 windowed (6 keys, local RoPE base), layer 1 full (global base, linear
  # scaling); softmax scale from query_pre_attn_scalar, not head_dim.
  "gemma3-local-global": (
    "Gemma3TextConfig",
    "Gemma3ForCausalLM",
    dict(
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      sliding_window=6,
      layer_types=["sliding_attention", "full_attention"],
      query_pre_attn_scalar=24,
      rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
      },
    ),
  ),
  # head_dim 24 with d_model 64 and 4 heads: N x H (96) is not d_model.
  "qwen3-qknorm": (
    "Qwen3Config",
    "Qwen3ForCausalLM",
    dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, use_sliding_window=False),
  ),
}


def make_hf_model(case: str, seed: int = 0):
  if case in FAMILY_CASES:
    config_class, model_class, kwargs = FAMILY_CASES[case]
    config = getattr(transformers, config_class)(
      vocab_size=VOCAB,
      hidden_size=64,
      intermediate_size=96,
      num_hidden_layers=2,
      max_position_embeddings=256,
      rms_norm_eps=1e-5,
      eos_token_id=None,
      bos_token_id=None,
      pad_token_id=None,
      tie_word_embeddings=False,
      **kwargs,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize(getattr(transformers, model_class)(config), seed)
  if case in LLAMA_CASES:
    config = transformers.LlamaConfig(
      vocab_size=VOCAB,
      hidden_size=64,
      intermediate_size=96,
      num_hidden_layers=2,
      max_position_embeddings=256,
      rms_norm_eps=1e-5,
      eos_token_id=None,
      bos_token_id=None,
      pad_token_id=None,
      **LLAMA_CASES[case],
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize(transformers.LlamaForCausalLM(config), seed)
  config = transformers.FalconConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    max_position_embeddings=256,
    alibi=False,
    bias=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    ffn_hidden_size=128,
    **FALCON_CASES[case],
  )
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  return randomize(transformers.FalconForCausalLM(config), seed)


# Qwen3.5 text, hybrid: d_model 64, full layers of 4 query heads (2 KV) of 16 features with
# partial rotary (0.25: 4 rotated), linear layers of 2 key heads and 4 value heads (grouped),
# head dims 8 and 12. "default" follows transformers' default pattern (3 linear, 1 full);
# "types" gives a list that is not it, and no grouping.
QWEN35_CASES = {
  "qwen3_5-default": dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4),
  "qwen3_5-types": dict(
    num_hidden_layers=5,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    layer_types=[
      "full_attention",
      "linear_attention",
      "full_attention",
      "linear_attention",
      "linear_attention",
    ],
  ),
}


def make_qwen35_model(case: str, seed: int = 0, **overrides):
  """A tiny random `Qwen3_5ForCausalLM` (model_type qwen3_5_text); `overrides` replace config
  fields."""
  config = transformers.Qwen3_5TextConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
    **{**QWEN35_CASES[case], **overrides},
  )
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = randomize(transformers.Qwen3_5ForCausalLM(config), seed)
  return with_slow_decays(model)


def with_slow_decays(model):
  """Slow decays, as trained models have: g = -exp(A_log) softplus(a + dt_bias) near -0.003
  per token, so a linear layer's state outlives a chunk (with randomize's values it halves
  every token and no test could see a state that arrived stale or not at all)."""
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
        param.add_(-4.0)
  return model


# The Qwen hybrids with a mixture of experts in every layer: Qwen3.5-MoE (its text model)
# and Qwen3-Next (its fused in-projections), four experts of 24 columns, two per token, and a
# shared expert of 40; the rest as QWEN35_CASES' "default" (Qwen3-Next's linear layers with
# two value heads per key head, so that its per-key-head layout is not the identity).
QWEN_MOE_CASES = {
  "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
  "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}


def make_qwen_moe_model(case: str, seed: int = 0, **overrides):
  """A tiny random hybrid mixture of experts (`QWEN_MOE_CASES`), slow decays as
  `make_qwen35_model`'s; `overrides` replace config fields."""
  config_name, model_name = QWEN_MOE_CASES[case]
  fields = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
  )
  config = getattr(transformers, config_name)(**{**fields, **overrides})
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = randomize(getattr(transformers, model_name)(config), seed)
  return with_slow_decays(model)


def make_qwen3_moe_model(seed: int = 0):
  """A tiny random `Qwen3MoeForCausalLM`: 4 experts of 24 columns, 2 per token, each expert
  stored as its own tensors (as transformers 5 writes them)."""
  config = transformers.Qwen3MoeConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
  )
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  return randomize(transformers.Qwen3MoeForCausalLM(config), seed)


# DeepSeek-V3 (latent attention, DeepSeek's router): d_model 64, 4 heads of 16 no-rope and 8
# rope features, values of 12, a latent of 16; 8 experts of 24 columns in 4 groups, 2 groups
# and 3 experts per token, one shared expert; the first layer dense. "default" has the q
# low-rank path and interleaved RoPE (DeepSeek's checkpoints); "direct-q" neither; "yarn"
# YaRN with mscale_all_dim (the softmax scale's mscale squared). The router's correction
# bias is random (zero at init, and a zero bias could not tell a lost one).
DEEPSEEK_CASES = {
  "deepseek-default": dict(),
  "deepseek-direct-q": dict(q_lora_rank=None, rope_interleave=False),
  "deepseek-yarn": dict(
    rope_parameters=dict(
      rope_type="yarn",
      factor=4.0,
      original_max_position_embeddings=64,
      mscale=1.0,
      mscale_all_dim=1.0,
      rope_theta=10000.0,
    )
  ),
}


def make_deepseek_model(case: str, seed: int = 0):
  """A tiny random `DeepseekV3ForCausalLM` (`DEEPSEEK_CASES`)."""
  shape = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=12,
    qk_nope_head_dim=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
  )
  config = transformers.DeepseekV3Config(**{**shape, **DEEPSEEK_CASES[case]})
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = randomize(transformers.DeepseekV3ForCausalLM(config), seed)
  with torch.no_grad():
    for name, buffer in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed)) / 10)
  return model


def hf_last_logits_float64(hf_model, tokens) -> np.ndarray:
  """transformers' logits at the last position [B, V], computed in float64 (on a copy: the
  model stays float32), a reference for float32 programs that each err by a few 1e-6."""
  import copy

  import torch

  with torch.no_grad():
    logits = copy.deepcopy(hf_model).double()(torch.tensor(np.asarray(tokens))).logits
  return logits[:, -1].numpy()


def saved_checkpoints(make, cases, tmp_path_factory) -> dict:
  """case -> (torch model `make(case)`, the directory it was saved to with save_pretrained,
  that directory loaded by kvr_jax's own loader)."""
  import kvr_jax

  out = {}
  for case in cases:
    hf_model = make(case)
    directory = tmp_path_factory.mktemp(case)
    hf_model.save_pretrained(directory)
    out[case] = (hf_model, str(directory), kvr_jax.load_model(str(directory)))
  return out


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  """transformers' logits at every position, uncached (a Qwen3.5 model of linear layers
  alone has no cache transformers can measure)."""
  with torch.no_grad():
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    return model(tokens, use_cache=False).logits.float().numpy()


def hf_greedy(model, tokens: np.ndarray, n: int) -> np.ndarray:
  with torch.no_grad():
    out = model.generate(
      torch.as_tensor(tokens, dtype=torch.long), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
  return out[:, tokens.shape[1] :].numpy()


def hf_sampled(model, tokens: np.ndarray, n: int, temperature: float, top_k: int, seed: int):
  """n tokens drawn from transformers' uncached logits as kvr_jax.generate draws them: step i
  from (logits - max) / temperature, the top_k kept, with the key fold_in(key(seed), i).
  [B, n]: what any strategy's cache must give with the same seed."""
  import jax

  out = np.asarray(tokens)
  for i in range(n):
    with torch.no_grad():
      logits = model(torch.as_tensor(out, dtype=torch.long)).logits[:, -1].float().numpy()
    scaled = (logits - logits.max(-1, keepdims=True)) / temperature
    kth = np.sort(scaled, axis=-1)[:, -top_k][:, None]
    scaled = np.where(scaled < kth, -np.inf, scaled)
    key = jax.random.fold_in(jax.random.key(seed), i)
    drawn = np.asarray(jax.random.categorical(key, scaled, axis=-1), np.int64)
    out = np.concatenate([out, drawn[:, None]], axis=1)
  return out[:, tokens.shape[1] :]


def save_word_tokenizer(directory) -> None:
  """A word-level tokenizer over "w0".."w{VOCAB-2}" (plus <unk>), saved as tokenizer files."""
  import tokenizers

  words = ["<unk>"] + [f"w{i}" for i in range(VOCAB - 1)]
  core = tokenizers.Tokenizer(
    tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
  )
  core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  core.decoder = tokenizers.decoders.WordPiece()
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
  fast.save_pretrained(directory)


GPT_OSS_CASES = {
  # YaRN (as the published models), windows of 6 on even layers, a low clamp that binds.
  "gpt-oss-yarn": dict(
    num_key_value_heads=2,
    sliding_window=6,
    swiglu_limit=0.3,
    rope_parameters=dict(
      rope_type="yarn",
      factor=4.0,
      beta_fast=32.0,
      beta_slow=1.0,
      truncate=False,
      original_max_position_embeddings=64,
      rope_theta=150000.0,
    ),
  ),
  # Plain RoPE, one KV head, every layer windowed but the last.
  "gpt-oss-mqa": dict(
    num_key_value_heads=1,
    sliding_window=9,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
  ),
}


def make_gpt_oss_model(case: str, seed: int = 0, **shape_overrides):
  """A tiny random `GptOssForCausalLM` (`GPT_OSS_CASES`): sinks, biases and router bias all
  random (none of them zero), four experts (or `num_local_experts=`), two per token."""
  shape = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
  )
  config = transformers.GptOssConfig(**{**shape, **shape_overrides, **GPT_OSS_CASES[case]})
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = randomize(transformers.GptOssForCausalLM(config), seed)
  gen = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():  # sinks of the scale of the scores, so that they weigh
    for layer in model.model.layers:
      layer.self_attn.sinks.copy_(2.0 * torch.randn(layer.self_attn.sinks.shape, generator=gen))
  return model
