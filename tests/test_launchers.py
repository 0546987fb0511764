"""The command lines end to end on tiny sizes, including their error paths."""

import json
import os
import subprocess
import sys

import pytest

# Launched command lines: slow by nature, the end-to-end tier (`-m e2e`).
pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(module, *flags, timeout=600):
  return subprocess.run(
    [sys.executable, "-m", module, *flags],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def test_run_main_job(tmp_path):
  """README's first command as written (plus --output_json to read its numbers back)."""
  out = tmp_path / "run.json"
  proc = run("launch.run", f"--output_json={out}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "emulated CPU devices" in proc.stdout
  rows = json.loads(out.read_text())
  assert [r["strategy"] for r in rows] == ["single", "tsp", "kvr"]
  assert rows[2]["partition"] is not None and sum(rows[2]["partition"]) == 2048
  assert all(r["max_logit_diff_vs_single"] < 1e-4 for r in rows)
  assert rows[0]["first_tokens"] == rows[1]["first_tokens"] == rows[2]["first_tokens"]
  # The printed table shows what the API returns: the partition `prefill` resolves for the
  # same plan (the default --partition=search on the `local` presets, flash kernel), whole,
  # and the JSON's numbers.
  import kvr_jax
  from kvr_jax.planning.partition import resolve_partition
  from kvr_jax.runtime.loading import preset_config

  config = preset_config("tiny-llama")
  api = resolve_partition(
    kvr_jax.PartitionPlan("search"),
    2048,
    8,
    config=config,
    dtype_bytes=4,
    model_name="tiny-llama",
    scores_in_memory=False,
    causal_skip=True,
  )
  assert list(api) == rows[2]["partition"]
  printed = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[3:]}
  kvr_row = printed["kvr"]
  assert kvr_row[1] == rows[2]["attention"] == "flash"  # --attention=auto on a CPU
  assert printed["tsp"][1] == "dense"
  assert kvr_row[2] == ",".join(map(str, api))
  assert kvr_row[3] == f"{rows[2]['ttft_median_s'] * 1e3:.1f}ms"
  assert kvr_row[4] == f"{rows[2]['plan_s']:.2f}s"
  assert kvr_row[6] == rows[2]["compile_cache"]
  assert float(kvr_row[7]) == pytest.approx(rows[2]["max_logit_diff_vs_single"], rel=0.01)
  assert kvr_row[8] == "yes" and printed["single"][8] == "-"  # the same tokens as single's
  assert [int(t) for t in kvr_row[9:]] == rows[2]["first_tokens"]


def test_run_without_single_says_n_a(tmp_path):
  out = tmp_path / "kvr.json"
  proc = run(
    "launch.run",
    "--strategy=kvr",
    "--context_len=40",
    "--num_devices=8",
    "--partition=even",
    "--repeats=1",
    "--max_new_tokens=1",
    f"--output_json={out}",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  (row,) = [line for line in proc.stdout.splitlines() if line.startswith("kvr ")]
  # 40 tokens run in their bucket of 48 (--buckets=auto), split evenly over the 8 ranks.
  assert "padded to 48 (buckets=auto)" in proc.stdout
  assert "6,6,6,6,6,6,6,6" in row and " n/a " in row and "nan" not in proc.stdout
  assert json.loads(out.read_text())[0]["max_logit_diff_vs_single"] is None


def test_a_second_process_reads_its_programs_from_the_persistent_cache(tmp_path):
  """launch.run twice with the same shapes: the first process compiles, the second reads
  every prefill program the first wrote from JAX's persistent cache; --nocompilation_cache
  compiles again and says the cache was not asked."""
  flags = ["--strategy=kvr", "--context_len=256", "--num_devices=2", "--partition=even"]
  flags += ["--repeats=1"]
  flags += ["--max_new_tokens=1", f"--compilation_cache_dir={tmp_path / 'xla'}"]

  def row(*extra):
    out = tmp_path / "run.json"
    proc = run("launch.run", *flags, *extra, f"--output_json={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())[0]

  first, second = row(), row()
  assert first["compile_cache"] == "compiled" and first["compile_cache_written"] >= 1
  # Every program the first process wrote is read back. (A program that compiled just under
  # the writing threshold the first time and just over it the second, on a loaded machine, is
  # written then: "k/n" instead of "cache", which is what happened once in CI.)
  assert second["compile_cache_hits"] == first["compile_cache_written"], (first, second)
  # (No timing assertion: the time saved is one program's compile, which a loaded machine
  # hides; the counts are JAX's own record of what was read.)
  flags.pop()  # --compilation_cache_dir
  assert row("--nocompilation_cache")["compile_cache"] == "-"


def test_run_with_tensor_parallel_ranks(tmp_path):
  """--model_parallel=2 on 8 devices: 4 ranks of 2 devices, the weights loaded straight into
  their shards, every strategy's logits and greedy tokens those of single (on one device,
  the weights gathered whole)."""
  out = tmp_path / "run.json"
  flags = ["--model_parallel=2", "--num_devices=8", "--context_len=96", "--repeats=1"]
  flags += ["--strategy=single,kvr,ring,allgather", "--partition=40,24,20,12"]
  proc = run("launch.run", *flags, "--max_new_tokens=3", f"--output_json={out}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "4 ranks x 2 devices (model)" in proc.stdout
  assert "split over 4 ranks x 2 model shards" in proc.stdout
  rows = json.loads(out.read_text())
  assert [r["strategy"] for r in rows] == ["single", "kvr", "ring", "allgather"]
  assert all(r["max_logit_diff_vs_single"] < 1e-4 for r in rows)
  assert all(r["first_tokens"] == rows[0]["first_tokens"] for r in rows)


def test_convert_then_run_from_orbax(tmp_path):
  from tests import hf_fixtures

  hf_dir = tmp_path / "hf"
  hf_fixtures.make_hf_model("llama-gqa").save_pretrained(hf_dir)
  ckpt = tmp_path / "orbax"
  proc = run("launch.convert", f"--hf_dir={hf_dir}", f"--output_dir={ckpt}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  proc = run(
    "launch.run",
    f"--model={ckpt}",
    "--context_len=40",
    "--num_devices=2",
    "--repeats=1",
    "--max_new_tokens=2",
    "--partition=even",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "orbax:" in proc.stdout
  proc = run("launch.convert", f"--hf_dir={tmp_path / 'missing'}", f"--output_dir={ckpt}2")
  assert proc.returncode == 2 and "no such directory" in proc.stderr
  # An output that cannot be written is refused before the weights are read, and it ends.
  for output, why in ((ckpt, "already holds a checkpoint"), ("/dev/null", "is a file")):
    proc = run("launch.convert", f"--hf_dir={hf_dir}", f"--output_dir={output}", timeout=60)
    assert proc.returncode == 2 and why in proc.stderr and "loaded" not in proc.stdout


def test_run_with_a_text_prompt(tmp_path):
  from tests import hf_fixtures

  hf_fixtures.make_hf_model("falcon-7b-form").save_pretrained(tmp_path)
  flags = [
    f"--model={tmp_path}",
    "--num_devices=2",
    "--strategy=single,kvr",  # the oracle and one partitioned strategy: the prompt is the point
    "--repeats=1",
    "--max_new_tokens=2",
    "--prompt=w5 w6 w7 w8 w9 w10 w11 w12",
    "--batch=2",
  ]
  proc = run("launch.run", *flags)
  assert proc.returncode == 2 and "--prompt needs a model with a tokenizer" in proc.stderr
  hf_fixtures.save_word_tokenizer(tmp_path)
  # Two prompts of different lengths: one ragged batch in the bucket of the longer.
  ragged = [*flags[:-1], "--prompt=w3 w4 w5", f"--output_json={tmp_path}/r.json"]
  proc = run("launch.run", *ragged)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "2 prompts of 8/3 tokens, padded to 16 (buckets=auto)" in proc.stdout
  rows = json.loads((tmp_path / "r.json").read_text())
  assert all(r["max_logit_diff_vs_single"] < 1e-4 for r in rows)
  # The answers as text: the first strategy's streamed before the table, row 1's after it,
  # the same in the JSON, and kvr's new tokens those of single ("same": yes).
  assert rows[0]["text"] and rows[1]["text"] == rows[0]["text"]
  assert rows[1]["same_as_first"] is True and rows[1]["new_tokens"] == rows[0]["new_tokens"]
  streamed = proc.stdout.split("single's answer, as it is decoded:\n", 1)[1]
  assert streamed.startswith(rows[0]["text"][0] + "\nrow 1: " + rows[0]["text"][1] + "\n")
  (kvr_line,) = [line for line in proc.stdout.splitlines() if line.startswith("kvr ")]
  assert " yes " in kvr_line
  proc = run("launch.run", *flags[:-1], "--prompt=w3", "--batch=2", timeout=60)
  assert proc.returncode == 2 and "--batch copies one --prompt" in proc.stderr
  # A document from a file, then a question: one prompt; kvr alone by default; sampling
  # with --top_k and --top_p.
  (tmp_path / "doc.txt").write_text("w20 w21 w22 w23\nw24 w25\n")
  sampled = [f"--model={tmp_path}", "--num_devices=2", "--repeats=1", "--max_new_tokens=3"]
  sampled += [f"--prompt_file={tmp_path / 'doc.txt'}", "--prompt=w26 w27", "--temperature=0.7"]
  sampled += ["--top_k=5", "--top_p=0.9", f"--output_json={tmp_path}/s.json"]
  proc = run("launch.run", *sampled)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "prompt 8 tokens" in proc.stdout and "kvr's answer, as it is decoded:" in proc.stdout
  (row,) = json.loads((tmp_path / "s.json").read_text())
  assert row["strategy"] == "kvr" and len(row["new_tokens"][0]) == 3


def test_run_refuses_a_negative_temperature_before_any_strategy_compiles():
  """Decoding's arguments are checked before the first strategy's prefill compiles (the
  error used to come after it had compiled and run)."""
  env = dict(os.environ, JAX_LOG_COMPILES="1")
  proc = subprocess.run(
    [sys.executable, "-m", "launch.run", "--temperature=-1", "--strategy=kvr", "--repeats=1"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "`temperature` must be a finite number >= 0" in proc.stderr
  assert "jit(program)" not in proc.stderr  # no prefill program was compiled
