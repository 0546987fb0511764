"""A check for a lent GPU (not collected by pytest; the suite runs on CPU devices):

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python tests/gpu_check.py OUT.json

1. Every family's tiny Hugging Face checkpoint (tests/hf_fixtures.py) loaded in float32 and in
   bfloat16 on the GPU: the whole forward's logits against transformers' (float32, on the
   CPU), and where `prefill` runs the family, its single-device prefill (the kernel "auto"
   chose) and 8 greedy tokens against transformers' `generate`.
2. XLA's memory analysis (`compiled_memory`, one rank, from shapes) of real-sized programs as
   the GPU compiles them, to set beside the same call on a CPU (docs/gpu.md).
"""

import json
import sys
import tempfile
import time

import jax
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

import kvr_jax  # noqa: E402
from kvr_jax.tools.memory import compiled_memory  # noqa: E402
from tests import hf_fixtures as h  # noqa: E402
from tests.tolerance import relative_error  # noqa: E402

CASES = [(h.make_hf_model, case) for case in (*h.FAMILY_CASES, "llama-gqa", "falcon-7b-form")]
CASES += [(h.make_gpt_oss_model, case) for case in h.GPT_OSS_CASES]
CASES += [(h.make_qwen35_model, case) for case in h.QWEN35_CASES]
CASES += [(h.make_qwen_moe_model, case) for case in h.QWEN_MOE_CASES]
CASES += [(h.make_deepseek_model, case) for case in h.DEEPSEEK_CASES]
MEMORY = [
  ("llama-3.1-8b", "bfloat16", 16384),
  ("llama-3.1-8b", "bfloat16", 32768),
  ("llama-3.1-8b", "bfloat16", 65536),
  ("llama-3.1-8b", "bfloat16", 131056),
  ("llama-3.1-8b", "float32", 16384),
  ("llama-3.1-8b", "float32", 32768),
  ("qwen3-8b", "bfloat16", 16384),
  ("mistral-7b", "bfloat16", 16384),
  ("gemma-3-12b", "bfloat16", 16384),
]


def parity(make, case, tokens) -> dict:
  row = {"case": case}
  hf = make(case)
  directory = tempfile.mkdtemp()
  hf.save_pretrained(directory)
  want = h.hf_logits(hf, tokens)
  for dtype in ("float32", "bfloat16"):
    ours = kvr_jax.load_model(directory, dtype=dtype)
    got = np.asarray(ours.module(tokens), np.float64)
    row[f"{dtype}_forward_rel_err"] = relative_error(got, want)
    row[f"{dtype}_argmax_agree"] = float((got.argmax(-1) == want.argmax(-1)).mean())
    try:
      result = kvr_jax.prefill(ours, tokens, "single", cache="last")
    except ValueError as refused:  # a family prefill does not run yet
      row[f"{dtype}_prefill"] = str(refused)[:80]
      continue
    row[f"{dtype}_kernel"] = result.attention
    row[f"{dtype}_prefill_rel_err"] = relative_error(np.asarray(result.logits), want[:, -1])
    greedy = kvr_jax.generate(ours, tokens, 8, strategy="single", cache="last").tokens
    row[f"{dtype}_greedy_as_hf"] = bool((greedy == h.hf_greedy(hf, tokens, 8)).all())
  return row


def main(out_path: str) -> None:
  report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "parity": []}
  tokens = np.random.default_rng(0).integers(0, h.VOCAB, size=(2, 100)).astype(np.int32)
  for make, case in CASES:
    report["parity"].append(parity(make, case, tokens))
    print(json.dumps(report["parity"][-1]), flush=True)
  report["memory"] = []
  for model, dtype, context_len in MEMORY:
    started = time.perf_counter()
    figures = compiled_memory(
      model, "single", context_len=context_len, num_ranks=1, dtype=dtype, decode_tokens=16
    )
    row = {"model": model, "dtype": dtype, "context_len": context_len}
    row.update({k: round(v / 2**30, 3) for k, v in figures.items() if k.endswith("bytes")})
    row["compile_s"] = round(time.perf_counter() - started, 1)
    report["memory"].append(row)
    print(json.dumps(row), flush=True)
  with open(out_path, "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
