"""The command lines end to end on tiny sizes, including their error paths."""

import json
import os
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
  out = tmp_path / "run.json"
  proc = run(
    "launch.run",
    "--context_len=96",
    "--num_devices=4",
    "--repeats=1",
    "--max_new_tokens=3",
    f"--output_json={out}",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "emulated CPU devices" in proc.stdout
  rows = json.loads(out.read_text())
  assert [r["strategy"] for r in rows] == ["single", "tsp", "kvr"]
  assert rows[2]["partition"] is not None and sum(rows[2]["partition"]) == 96
  assert all(r["max_logit_diff_vs_single"] < 1e-4 for r in rows)
  assert rows[0]["first_tokens"] == rows[1]["first_tokens"] == rows[2]["first_tokens"]


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--model=tiny-gpt"], "unknown preset 'tiny-gpt'"),
    (["--model=./no/such/dir"], "no such directory"),
    (["--partition=3,3", "--context_len=12", "--num_devices=4"], "2 chunks but the mesh has 4"),
    (["--partition=fast"], "--partition must be one of"),
    (["--context_len=100000"], "exceeds the model's max_position_embeddings"),
    (["--strategy=single,ulysses"], "unknown strategy"),
    (["--num_devices=64"], "only 8 devices"),
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
    "--context_lens=64,128",
    "--repeats=1",
    "--num_devices=2",
    f"--output_dir={tmp_path}",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "MEASURED" in proc.stdout and "vs Hugging Face transformers" in proc.stdout
  assert (tmp_path / "devices.csv").exists() and (tmp_path / "devices.png").exists()
  assert (tmp_path / "vs_transformers.csv").exists()


def test_benchmark_multiprocess_mode(tmp_path):
  proc = run(
    "launch.benchmark",
    "--mode=multiprocess",
    "--model=tiny-llama",
    "--context_lens=128",
    "--repeats=1",
    "--variants=tsp,kvr-even,kvr-search",
    f"--output_dir={tmp_path}",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  table = json.loads((tmp_path / "multiprocess.json").read_text())
  assert {r["variant"] for r in table} == {
    "single",
    "single-dense",
    "tsp",
    "kvr-even",
    "kvr-search",
  }
  assert all(r["ttft_s"] > 0 for r in table)


def test_paper_reproduction(tmp_path):
  proc = run("launch.paper", f"--output_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "MODELLED" in proc.stdout
  assert "KVR-S faster than TSP in every cell: yes" in proc.stdout
  assert "KVR-P within 2% of KVR-S in every cell: yes" in proc.stdout
  for name in ("paper_ttft.csv", "paper_ttft_300GBps.png", "paper_ttft_10GBps.png"):
    assert (tmp_path / name).exists()
