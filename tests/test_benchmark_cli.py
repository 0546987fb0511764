"""The benchmark, paper and partition-table command lines end to end on tiny sizes (split
from test_launchers.py so that the two pytest workers share the subprocess-heavy tests)."""

import csv
import json
import re

import pytest

from kvr_jax.tools.timing import interval_verdict
from tests.test_launchers import run


@pytest.mark.e2e  # a launched command line
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


@pytest.mark.e2e  # a launched command line
def test_benchmark_memory_mode_with_tensor_parallel_ranks():
  """--mode=memory --model_parallel=2 on 8 devices: KV-Runahead's program compiled for 4 ranks
  of 2 devices beside single on one device, one row each."""
  proc = run(
    "launch.benchmark",
    "--mode=memory",
    "--model=tiny-llama",
    "--context_lens=256",
    "--strategy=kvr,single",
    "--model_parallel=2",
    "--dtype=bfloat16",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "bfloat16 shapes" in proc.stdout  # --dtype is compiled, not ignored
  rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("kvr", "single"))]
  assert [row[:3] for row in rows] == [["kvr", "256", "4x2"], ["single", "256", "1"]], rows


@pytest.mark.e2e  # a launched command line
def test_benchmark_phases_mode_times_every_kernel_asked_for():
  proc = run(
    "launch.benchmark",
    "--mode=phases",
    "--model=tiny-llama",
    "--partitions=40/24",
    "--kernels=dense,flash",
    "--repeats=1",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [line.split()[:3] for line in proc.stdout.splitlines() if line.startswith("40/24")]
  assert rows == [["40/24", k, str(r)] for k in ("dense", "flash") for r in (0, 1)], rows


@pytest.mark.e2e  # a launched command line
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


@pytest.mark.serial  # waits on timeouts or times a span: run alone
@pytest.mark.e2e  # a launched command line
def test_benchmark_multiprocess_mode(tmp_path):
  proc = run(
    "launch.benchmark",
    "--mode=multiprocess",
    "--model=tiny-llama",
    "--context_lens=128",
    "--repeats=2",
    "--single_variants=single",
    "--variants=tsp,ring,kvr-search,auto",
    f"--output_dir={tmp_path}",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  table = json.loads((tmp_path / "multiprocess.json").read_text())
  assert {r["variant"] for r in table} == {"single", "tsp", "ring", "kvr-search", "auto"}
  # auto ran one pick on both processes, and is judged against the fastest of the others.
  (auto,) = [r for r in table if r["variant"] == "auto"]
  assert auto["strategy"] in ("single", "kvr", "ring", "allgather")
  fastest = min((r for r in table if r["variant"] != "auto"), key=lambda r: r["ttft_s"])
  assert auto["vs_peer"].split()[1:] == [fastest["variant"]], auto
  assert all(r["ttft_s"] > 0 for r in table)
  # Every interleaved sample is kept; the median is theirs; KVR gets a verdict on the peer.
  assert all(len(r["samples_s"]) == 2 for r in table)
  assert all(r["ttft_s"] == pytest.approx(sum(r["samples_s"]) / 2) for r in table)
  (kvr,) = [r for r in table if r["variant"] == "kvr-search"]
  assert kvr["vs_peer"] in ("ahead ring", "tie ring", "behind ring"), kvr
  # The printed rows are the JSON's numbers.
  for r in table:
    (line,) = [
      ln for ln in proc.stdout.splitlines() if ln.split()[:3] == [r["variant"], r["link"], "128"]
    ]
    assert f"{r['ttft_s']:.3f}s" in line and f"{r['speedup_vs_single']:.2f}x" in line
    # Which kernel each ran is in the JSON and the table: TSP its dense scores, the rest flash.
    assert r["kernel"] == ("dense" if r["strategy"] == "tsp" else "flash"), r
    assert f" {r['kernel']} " in line, line


@pytest.mark.e2e  # a launched command line
def test_paper_reproduction(tmp_path):
  proc = run("launch.paper", "--grids=paper", f"--output_dir={tmp_path}")
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


@pytest.mark.e2e  # a launched command line
def test_tensor_parallel_grid(tmp_path):
  """The 2-D grid at 32k: every factorization of 8 and 16 GPUs, printed as in its CSV, and the
  issue's modelled target judged from those numbers."""
  proc = run("launch.paper", "--grids=tp", "--tp_context_lens=32768", f"--output_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "MODELLED" in proc.stdout and "paper_ttft" not in proc.stdout
  with open(tmp_path / "tp_grid.csv") as f:
    rows = list(csv.DictReader(line for line in f if not line.lstrip('"').startswith("#")))
  factorizations = {(r["gpus"], r["num_ranks"], r["model_parallel"]) for r in rows}
  assert factorizations == {("8", str(p), str(8 // p)) for p in (1, 2, 4, 8)} | {
    ("16", str(p), str(16 // p)) for p in (1, 2, 4, 8, 16)
  }
  for r in rows:  # the printed table carries the CSV's numbers
    between = "1 node" if r["gpus"] == "8" else f"{float(r['between_Bps']) / 1e9:.0f}GB/s"
    p, m = r["num_ranks"], r["model_parallel"]
    key = f"{r['gpus']:>4} {between:>8}{r['context_len']:>7} {p:>2}x{m:<3}"
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith(key)]
    assert f"{float(r['ttft_s']) * 1e3:.0f}ms" in line
  at_50 = [r for r in rows if r["gpus"] == "16" and float(r["between_Bps"]) == 50e9]
  fits = [r for r in at_50 if r["fits"] == "True"]
  best = {s: min(float(r["ttft_s"]) for r in fits if r["strategy"] == s) for s in ("tp", "kvr")}
  peers = min(float(r["ttft_s"]) for r in fits if r["strategy"] in ("ring", "allgather"))
  met = best["tp"] / best["kvr"] >= 1.3 and peers > best["kvr"]
  assert "32k: best TP x KVR >= 1.3x" in proc.stdout
  assert ("): holds (modelled)" in proc.stdout) == met


def test_interval_verdict_on_synthetic_samples():
  """Ahead or behind only where the min-max intervals separate; overlapping ones tie."""
  assert interval_verdict([1.0, 1.1, 1.2], [1.3, 1.4]) == "ahead"
  assert interval_verdict([1.3, 1.4], [1.0, 1.1, 1.2]) == "behind"
  assert interval_verdict([1.0, 1.25], [1.2, 1.4]) == "tie"  # medians 10% apart, overlap
  assert interval_verdict([1.0], [1.0]) == "tie"
  with pytest.raises(ValueError, match="samples on both sides"):
    interval_verdict([], [1.0])


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_round_order_varies_who_runs_first_and_who_runs_before_whom(n):
  """Over four rounds every variant runs first once (n >= 4; each of the n first otherwise)
  and, where it has two others, runs right after at least two different ones: a plain
  rotation put each right after the same one in every round it did not start."""
  from kvr_jax.tools.timing import round_order

  names = list(range(n))
  rounds = [round_order(names, r) for r in range(4)]
  assert all(sorted(order) == names for order in rounds)
  assert {order[0] for order in rounds} == set(names[:4])
  for name in names:
    before = {order[order.index(name) - 1] for order in rounds if order.index(name) > 0}
    assert len(before) >= min(2, n - 1), (name, rounds)


def test_interleaved_rounds_rotate_and_keep_only_the_last_results(monkeypatch):
  """time_interleaved: each round starts one variant later, every odd round's rest reversed
  (`round_order`), every sample's time is kept, and of the results only each
  variant's last (a result holds its whole cache; keeping all of them grew the processes by
  gigabytes and slowed the later variants' moves)."""
  import weakref

  from kvr_jax.tools import timing

  class Result:
    cache = "last"

  calls, results, alive_at_call = [], [], []

  def fake_call(model, tokens, cache, kwargs):
    calls.append(kwargs["name"])
    alive_at_call.append(sum(ref() is not None for ref in results))
    results.append(weakref.ref(result := Result()))
    return result, float(len(calls)), 0.5

  monkeypatch.setattr(timing, "_timed_call", fake_call)
  variants = {name: {"name": name} for name in "ABC"}
  timings = timing.time_interleaved(None, None, variants, rounds=3)
  assert calls == list("ABC" + "ABC" + "BAC" + "CAB")  # compiles, then the rounds
  assert timings["B"].runs_s == [5.0, 7.0, 12.0] and timings["A"].moves_s == [0.5] * 3
  # During the run: when a variant runs again, only the other variants' last results live.
  assert max(alive_at_call) == len(variants) - 1, alive_at_call
  alive = [ref() is not None for ref in results]
  assert alive == [False] * 9 + [True] * 3  # only the last round's results remain
  assert {id(t.result) for t in timings.values()} == {id(ref()) for ref in results[-3:]}


def test_the_cost_model_variants_plan_for_the_throttled_link():
  """Under a throttled loopback the cost-model variants (auto, kvr-search) plan for the rate
  the launcher set (the `local` calibration measured the link unthrottled); the others do not
  plan at all."""
  import numpy as np

  import kvr_jax
  from kvr_jax.planning import presets
  from launch.harness import jobs

  local = presets.links_preset("local")
  slow = jobs._links_at("500mbit")
  assert slow.bandwidth == 500e6 / 8 and slow.latency == local.latency
  assert jobs._links_at("unthrottled") == "local"
  plan = kvr_jax.PartitionPlan("search", links=slow)
  model, mesh = kvr_jax.load_model("tiny-llama"), kvr_jax.make_mesh(2)
  tokens = np.zeros((1, 64), np.int32)

  def partition_of(variant):
    return jobs._variant_arguments(variant, model, tokens, mesh, 64, plan)[0].get("partition")

  assert partition_of("auto") is plan and partition_of("kvr-search") is plan
  assert partition_of("kvr-per-rank-search") is plan and partition_of("kvr-even") == "even"
  assert partition_of("ring") is None


def test_variants_are_records_whose_fields_make_the_prefill_arguments():
  """Every variant name is one frozen record (launch.harness.variants); its prefill arguments
  follow from its fields (strategy, split, body, kernel, cache), and a bad name or record is
  refused by name before anything loads."""
  import numpy as np

  import kvr_jax
  from kvr_jax.strategies import runahead
  from launch.harness import jobs, variants

  model, mesh = kvr_jax.load_model("tiny-llama"), kvr_jax.make_mesh(2)
  tokens = np.zeros((1, 64), np.int32)
  plan = kvr_jax.PartitionPlan("search")

  def arguments(name):
    return jobs._variant_arguments(name, model, tokens, mesh, 64, plan)[0]

  assert arguments("single-dense") == {"strategy": "single", "mesh": None, "attention": "dense"}
  assert arguments("kvr-one-body-even") == {
    "strategy": runahead.ONE_BODY_STRATEGY,
    "mesh": mesh,
    "partition": "even",
  }
  assert arguments("kvr-per-rank-search:sharded") == {
    "strategy": runahead.PER_RANK_STRATEGY,
    "mesh": mesh,
    "partition": plan,
    "cache": "sharded",
  }
  assert arguments("allgather:sharded") == {
    "strategy": "allgather",
    "mesh": mesh,
    "cache": "sharded",
  }
  record = variants.get_variant("kvr-search:sharded")
  assert (record.strategy, record.split, record.cache) == ("kvr", "search", "sharded")
  assert variants.get_variant(record) is record and len(set(variants.NAMES)) == 17
  for bad, message in (
    ("kvr-serch", "unknown variant 'kvr-serch'; expected some of"),
    ("ring:last", "the only suffix is ':sharded'"),
  ):
    with pytest.raises(ValueError, match=message):
      variants.get_variant(bad)
  with pytest.raises(ValueError, match="a program body .* is KV-Runahead's"):
    variants.Variant("x", "ring", body="one")
  with pytest.raises(ValueError, match="unknown strategy 'zigzag'"):
    variants.Variant("x", "zigzag")
  with pytest.raises(ValueError, match="unknown variant 'nope'"):
    jobs.bench_job("no-such-model", [64], ["ring", "nope"])  # before the model loads


def test_the_multiprocess_table_judges_each_layout_and_prints_all_done_and_kind_splits():
  """Each KV-Runahead row against the faster peer of its own cache layout on its link and
  against single; the time until every process was done, and a hybrid's split per layer
  kind, printed beside it."""
  import statistics

  from launch.harness import multiprocess_report as report

  def row(variant, samples, link, partition=None, full=None, done=None):
    ttft = statistics.median(samples)
    cache = "sharded" if variant.endswith(":sharded") else "last"
    strategy = variant.partition("-")[0].partition(":")[0]
    return dict(variant=variant, context_len=8192, samples_s=samples, ttft_s=ttft, link=link) | {
      "cache": cache,
      "partition": partition,
      "full_partition": full,
      "done_s": done or ttft,
      "strategy": strategy,
      "kernel": "flash",
    }

  rows = [
    row("single", [2.2, 2.2, 2.2], "-"),
    row("kvr-fitted:sharded", [1.0, 1.2, 1.1], "500mbit", [5000, 3192], [4096, 4096], 1.5),
    row("ring:sharded", [1.6, 1.5, 1.4], "500mbit"),
    row("allgather:sharded", [1.8, 1.7, 1.9], "500mbit"),
    row("kvr-fitted", [1.0, 1.0, 1.0], "500mbit", [5000, 3192]),
    row("ring", [0.5, 0.5, 0.5], "500mbit"),
  ]
  table = report.multiprocess_table(rows)
  lines = report.ttft_table(table, "bench-qwen3.5", 2).lines
  sharded, last = lines[1].split(), lines[4].split()
  assert sharded[:5] == ["kvr-fitted:sharded", "500mbit", "8192", "1.100s", "1.000-1.200"]
  # single's 2.2 s / 1.1; every process done after 1.5 s; ahead of ring:sharded (1.4-1.6 s),
  # not of the whole-cache ring (0.5 s), which the whole-cache KV-Runahead row meets instead
  assert sharded[5:8] == ["0.000s", "1.500s", "2.00x"]
  assert " ".join(sharded[-6:]) == "ahead ring:sharded linear 5000,3192 full 4096,4096"
  assert last[-4:] == ["behind", "ring", "[5000,", "3192]"]
  assert [r["speedup_vs_single"] for r in table][:2] == [1.0, pytest.approx(2.0)]


@pytest.mark.e2e  # a launched command line
def test_benchmark_hybrid_mode_times_a_hybrids_programs_on_one_fitted_split(tmp_path):
  from kvr_jax.runtime.loading import preset_config
  from launch.harness.variants import own_past_variants

  proc = run(
    "launch.benchmark",
    "--mode=hybrid",
    "--model=bench-qwen3.5",
    "--context_lens=256",
    "--repeats=1",
    f"--output_dir={tmp_path}",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  table = json.loads((tmp_path / "multiprocess.json").read_text())
  rows = {r["variant"]: r for r in table}
  assert set(rows) == {"single", *own_past_variants(preset_config("bench-qwen3.5"))}
  # One fitting per length: both layouts of kvr-fitted ran the same split of the prompt.
  fitted, sharded = rows["kvr-fitted"], rows["kvr-fitted:sharded"]
  assert (fitted["partition"], fitted["full_partition"]) == (
    sharded["partition"],
    sharded["full_partition"],
  )
  assert (
    sum(fitted["partition"]) == 256 and rows["kvr-one-fitted:sharded"]["full_partition"] is None
  )
  # Every process done no sooner than the last rank's logits; the join is inside the call.
  assert all(r["done_s"] >= r["ttft_s"] > 0 for r in table)
  assert rows["ring"]["move_s"] is None and rows["ring:sharded"]["move_s"] == 0.0


@pytest.mark.parametrize(
  ("model", "one_split"), [("bench-qwen3.5", True), ("bench-deepseek", False)]
)
def test_the_hybrid_mode_runs_the_peers_and_kvr_in_both_layouts(model, one_split):
  from kvr_jax.runtime.loading import preset_config
  from launch.harness.variants import get_variant, own_past_variants

  names = own_past_variants(preset_config(model), measured=True)
  records = [get_variant(name) for name in names]  # every one a variant the job runs
  for strategy in ("ring", "allgather", "kvr"):
    layouts = {r.cache for r in records if r.strategy == strategy}
    assert layouts == {None, "sharded"}, (strategy, names)
  assert ("kvr-one-fitted:sharded" in names) == one_split and names[-1] == "kvr-measured"


def test_kernels_are_timed_on_a_chunk_after_a_prefix_and_rated_per_pair(monkeypatch):
  """A later rank's shape: C queries after P keys; the table's rate is the pairs seen (the
  prefix whole, the chunk's own block causally) per second, the same for every kernel."""
  from launch.harness import kernel_timing

  seen, attend = [], kernel_timing.attend_static

  def recorded(q, k, v, offset, record):
    seen.append((q.shape[1], k.shape[1], offset))
    return attend(q, k, v, offset, record)

  monkeypatch.setattr(kernel_timing, "attend_static", recorded)
  rows = kernel_timing.time_attention_kernels(
    [64], ("dense", "flash"), ((32, 32),), repeats=1, progress=False, prefix_len=128
  )
  assert [(r.kernel, r.prefix_len) for r in rows] == [("dense", 128), ("flash", 128)]
  assert set(seen) == {(64, 192, 128)}  # the queries at 128.. over the prefix and their own
  assert {r.pairs for r in rows} == {64 * 128 + 64 * 65 // 2}
  table = kernel_timing.kernel_table(rows, 1)
  for r, line in zip(rows, table.lines, strict=True):
    assert line.split()[2:4] == ["64", "128"]
    assert line.split()[5] == f"{r.pairs / r.seconds / 1e6:.1f}"
  with pytest.raises(ValueError, match="prefix length must be >= 0"):
    kernel_timing.time_attention_kernels([64], ("dense",), prefix_len=-1)


def test_a_report_table_prints_what_it_writes(tmp_path, capsys):
  """The one report type: its printed text is title, header, rows, notes in that order, and
  its CSV and JSON hold the same rows as values (the title as comments in the CSV)."""
  from launch.harness.report import Table

  table = Table(
    title=("MEASURED something",),
    header="a   b",
    lines=("1   x", "2   y"),
    records=({"a": 1, "b": "x"}, {"a": 2, "b": "y"}),
    notes=("a note",),
  )
  table.print()
  assert capsys.readouterr().out == "MEASURED something\na   b\n1   x\n2   y\na note\n"
  table.write_csv(tmp_path / "t.csv")
  assert (tmp_path / "t.csv").read_text().splitlines() == [
    "# MEASURED something",
    "a,b",
    "1,x",
    "2,y",
  ]
  table.write_json(tmp_path / "t.json")
  assert json.loads((tmp_path / "t.json").read_text()) == {
    "title": ["MEASURED something"],
    "rows": [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}],
  }


@pytest.mark.parametrize("plotting", [True, False])
def test_a_sweep_is_written_with_or_without_matplotlib(tmp_path, monkeypatch, capsys, plotting):
  """Plotting is the `harness` extra: with matplotlib the sweep writes its CSV and PNG; without
  it the CSV alone, and a line says why the plot is missing (the paths returned are the files
  that exist)."""
  import importlib.util

  from launch.harness import report, sweep

  if not plotting:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
      report.importlib.util,
      "find_spec",
      lambda name, *a: None if name == "matplotlib" else find_spec(name, *a),
    )
  rows = [sweep.SweepRow("kvr", C, 2, "even", 0.01 * C, 100.0, "-") for C in (64, 128)]
  written = sweep.write_sweep(rows, str(tmp_path), "tiny-llama", "MEASURED here")
  names = ["devices.csv", "devices.png"] if plotting else ["devices.csv"]
  assert written == [str(tmp_path / n) for n in names]
  assert sorted(p.name for p in tmp_path.iterdir()) == names
  assert (report.NO_PLOT in capsys.readouterr().out) is not plotting


def test_every_mode_name_runs_its_own_function():
  """--mode's choices (MODE_NAMES, what --help lists) are exactly the modes MODES runs."""
  from launch import benchmark, benchmark_flags

  assert tuple(benchmark.MODES) == benchmark_flags.MODE_NAMES
  assert len(set(benchmark.MODES.values())) == len(benchmark.MODES)
