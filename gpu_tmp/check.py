"""One-off GPU checks for the cache-layout issue (not part of the project)."""

import json
import os
import time

import jax
import jax.numpy as jnp

import kvr_jax
from kvr_jax.runtime.loading import build_model
from kvr_jax.tools.memory import compiled_memory
from kvr_jax.tools.timing import time_prefill

out = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__}
G = 2**30
# 1. Parity on the GPU: tiny-llama, both layouts and sharded decode on a one-device mesh.
m = kvr_jax.load_model("tiny-llama")
toks = kvr_jax.synthetic_prompt(512, 300, 2)
ref = kvr_jax.prefill(m, toks)
sh = kvr_jax.prefill(m, toks, strategy="kvr", mesh=kvr_jax.make_mesh(1), cache="sharded")
k, v = sh.gather_cache()
out["tiny_kvr_sharded_max_abs_k"] = float(jnp.abs(k - ref.k_cache).max())
g0 = kvr_jax.generate(m, toks, 8)
g1 = kvr_jax.generate(m, toks, 8, strategy="kvr", mesh=kvr_jax.make_mesh(1), cache="sharded")
out["tiny_tokens_equal"] = bool((g0.tokens == g1.tokens).all())
# 2. XLA:GPU memory analysis from shapes, bf16 and f32, Llama-3.1-8B single at 32k.
for dtype in ("bfloat16", "float32"):
  r = compiled_memory(
    "llama-3.1-8b", "single", context_len=32768, num_ranks=1, dtype=dtype, cache="sharded"
  )
  out[f"mem_single_32k_{dtype}"] = {
    k2: round(v2 / G, 3) for k2, v2 in r.items() if k2.endswith("bytes")
  }
# 3. Real: Llama-3.1-8B-shaped random weights in bf16, single prefill at 32k, peak memory vs XLA.
cfg = kvr_jax.preset_config("llama-3.1-8b")
t0 = time.time()
big = kvr_jax.Model(build_model(cfg, "bfloat16"), source="preset:llama-3.1-8b")
jax.block_until_ready(big.state_on(jax.devices()[0]))
out["build_s"] = time.time() - t0
dev = jax.devices()[0]
base = dev.memory_stats()["bytes_in_use"]
for C in (8192, 32768):
  toks = kvr_jax.synthetic_prompt(cfg.vocab_size, C)
  timing = time_prefill(big, toks, 2, cache="sharded")
  stats = dev.memory_stats()
  out[f"real_single_{C}"] = {
    "median_s": timing.median_s,
    "first_s": timing.first_s,
    "peak_GiB": round(stats["peak_bytes_in_use"] / G, 3),
    "base_GiB": round(base / G, 3),
  }
  del timing
print(json.dumps(out, indent=1))
with open(os.path.join(os.environ.get("OUT", "."), "gpu_check.json"), "w") as f:
  json.dump(out, f, indent=1)
