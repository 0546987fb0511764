"""The command lines end to end on tiny sizes, including their error paths."""

import csv
import json
import os
import re
import subprocess
import sys

import pytest

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

  config = kvr_jax.preset_config("tiny-llama")
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
  assert kvr_row[5] == rows[2]["compile_cache"]
  assert float(kvr_row[6]) == pytest.approx(rows[2]["max_logit_diff_vs_single"], rel=0.01)
  assert [int(t) for t in kvr_row[7:]] == rows[2]["first_tokens"]


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
  assert "5,5,5,5,5,5,5,5" in row and " n/a " in row and "nan" not in proc.stdout
  assert json.loads(out.read_text())[0]["max_logit_diff_vs_single"] is None


def test_a_second_process_reads_its_programs_from_the_persistent_cache(tmp_path):
  """launch.run twice with the same shapes: the first process compiles, the second reads
  every prefill program from JAX's persistent cache and spends far less on compiling;
  --nocompilation_cache compiles again and says the cache was not asked."""
  flags = ["--strategy=kvr", "--context_len=256", "--num_devices=2", "--partition=even"]
  flags += ["--repeats=1"]
  flags += ["--max_new_tokens=1", f"--compilation_cache_dir={tmp_path / 'xla'}"]

  def row(*extra):
    out = tmp_path / "run.json"
    proc = run("launch.run", *flags, *extra, f"--output_json={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())[0]

  first, second = row(), row()
  assert first["compile_cache"] == "compiled" and second["compile_cache"] == "cache"
  # What is left is tracing and the small eager programs (not worth a disk entry).
  assert second["compile_s"] < 0.7 * first["compile_s"], (first, second)
  flags.pop()  # --compilation_cache_dir
  assert row("--nocompilation_cache")["compile_cache"] == "-"


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--model=tiny-gpt"], "unknown preset 'tiny-gpt'"),
    (["--nocompilation_cache", "--compilation_cache_dir=/tmp/x"], "--nocompilation_cache"),
    (["--strategy=ring,allgather", "--partition=1,2,3"], "partition lengths apply to ['kvr']"),
    (["--strategy=ring", "--attention=dense"], "strategy 'ring' runs attention in ('flash',)"),
    (["--compilation_cache_dir=/dev/null"], "is a file"),
    (["--model=./no/such/dir"], "no such directory"),
    (["--partition=3,3", "--context_len=12", "--num_devices=4"], "2 chunks but the mesh has 4"),
    (["--partition=fast"], "--partition must be one of"),
    (["--context_len=100000"], "exceeds the model's max_position_embeddings"),
    (["--strategy=single,ulysses"], "unknown strategy"),
    (["--num_devices=64"], "only 8 devices"),
    (["--output_json=/nonexistent-dir/x.json"], "/nonexistent-dir does not exist"),
  ],
)
def test_run_user_errors_are_one_line(flags, message):
  proc = run("launch.run", "--repeats=1", *flags)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert message in proc.stderr
  assert "Traceback" not in proc.stderr


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


def test_run_with_a_text_prompt(tmp_path):
  from tests import hf_fixtures

  hf_fixtures.make_hf_model("falcon-7b-form").save_pretrained(tmp_path)
  flags = [
    f"--model={tmp_path}",
    "--num_devices=2",
    "--repeats=1",
    "--max_new_tokens=2",
    "--prompt=w5 w6 w7 w8 w9 w10 w11 w12",
    "--batch=2",
  ]
  proc = run("launch.run", *flags)
  assert proc.returncode == 2 and "--prompt needs a model with a tokenizer" in proc.stderr
  hf_fixtures.save_word_tokenizer(tmp_path)
  proc = run("launch.run", *flags)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "prompt 8 tokens x batch 2" in proc.stdout


def test_benchmark_devices_mode(tmp_path):
  proc = run(
    "launch.benchmark",
    "--model=tiny-llama",
    "--context_lens=64",
    "--kernels=flash",
    "--repeats=1",
    "--num_devices=2",
    f"--output_dir={tmp_path}",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "MEASURED" in proc.stdout and "vs Hugging Face transformers" in proc.stdout
  assert (tmp_path / "devices.csv").exists() and (tmp_path / "devices.png").exists()
  assert (tmp_path / "vs_transformers.csv").exists()


def test_benchmark_accelerator_mode(tmp_path):
  """One device of this machine (a CPU here): our flash prefill beside transformers on the
  same weights and tokens, with MFU against the `local` calibration's peak, then modelled
  2-rank TTFT from the rank programs timed here; refuses a kernel this device cannot run."""
  flags = ["--mode=accelerator", "--model=tiny-llama", "--context_lens=128", "--repeats=1"]
  proc = run("launch.benchmark", *flags, "--ranks=2", f"--output_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  with open(tmp_path / "accelerator.json") as f:
    report = json.load(f)
  assert report["platform"] == "cpu" and report["dtype"] == "float32"
  measured = {r["implementation"]: r for r in report["measured"]}
  assert set(measured) == {"transformers/sdpa", "kvr-jax/flash"}  # "auto" on a CPU: flash
  ours = measured["kvr-jax/flash"]
  assert ours["max_logit_diff"] < 1e-4  # same weights and tokens as transformers (float32)
  assert 0 < ours["mfu"] < 1 and ours["ttft_s"] > 0
  modelled = {(r["strategy"], r["links"]) for r in report["modelled"]}
  assert modelled == {
    (s, links) for s in ("kvr", "ring", "allgather") for links in ("300GBps", "10GBps")
  }
  assert all(r["num_ranks"] == 2 and r["ttft_s"] > 0 for r in report["modelled"])
  kvr = next(r for r in report["modelled"] if r["strategy"] == "kvr")
  assert sum(map(int, kvr["partition"].split("/"))) == 128
  assert "MODELLED" in proc.stdout and "MEASURED" in proc.stdout
  proc = run("launch.benchmark", *flags, "--kernels=cudnn", f"--output_dir={tmp_path}")
  assert proc.returncode == 2 and "kernel 'cudnn' does not run on cpu" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_benchmark_multiprocess_mode(tmp_path):
  proc = run(
    "launch.benchmark",
    "--mode=multiprocess",
    "--model=tiny-llama",
    "--context_lens=128",
    "--repeats=1",
    "--single_variants=single",
    "--variants=tsp,kvr-search",
    f"--output_dir={tmp_path}",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  table = json.loads((tmp_path / "multiprocess.json").read_text())
  assert {r["variant"] for r in table} == {"single", "tsp", "kvr-search"}
  assert all(r["ttft_s"] > 0 for r in table)
  # The printed rows are the JSON's numbers.
  for r in table:
    (line,) = [
      ln for ln in proc.stdout.splitlines() if ln.split()[:3] == [r["variant"], r["link"], "128"]
    ]
    assert f"{r['ttft_s']:.3f}s" in line and f"{r['speedup_vs_single']:.2f}x" in line


def test_paper_reproduction(tmp_path):
  proc = run("launch.paper", f"--output_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "MODELLED" in proc.stdout
  assert "KVR-S faster than TSP in every cell: yes" in proc.stdout
  assert "KVR-P within 2% of KVR-S (either way) in every cell: yes" in proc.stdout
  for name in ("paper_ttft.csv", "paper_ttft_300GBps.png", "paper_ttft_10GBps.png"):
    assert (tmp_path / name).exists()
  # The printed verdict is the CSV's numbers: the gap of largest magnitude, either sign.
  with open(tmp_path / "paper_ttft.csv") as f:
    rows = list(csv.DictReader(line for line in f if not line.lstrip('"').startswith("#")))
  worst = max((float(r["predict_gap"]) for r in rows), key=abs)
  printed = re.search(r"KVR-P within 2% .*\(worst ([+-][\d.]+)%\)", proc.stdout).group(1)
  assert float(printed) == pytest.approx(worst * 100, abs=0.006)
  assert " ms" not in proc.stdout.split("\n\n")[0] and "ms" in proc.stdout.splitlines()[3]


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--num_ranks=4"], "--num_ranks apply with --model"),
    (["--model=tiny-llama", "--dtype_bytes=0"], "--dtype_bytes must be 1, 2, 4 or 8"),
    (["--model=tiny-llama", "--output_dir=/dev/null"], "is a file"),
    (["--model=tiny-llama", "--num_ranks=0"], "--num_ranks must be"),
  ],
)
def test_partition_tables_user_errors_are_one_line(flags, message):
  """Nothing written, no traceback: a flag the shipped set would ignore is refused."""
  proc = run("launch.partition_tables", *flags, timeout=120)
  assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-1000:]
  assert message in proc.stderr and "Traceback" not in proc.stderr
