"""`python -m experiments.bench --quick`: every field, and the relations its numbers must satisfy.

No speed targets are asserted (the machine is shared); what is checked can fail when the benchmark
is wrong: the loop and the scan trained the same adapter, rates agree with their times, the FLOP
count and the roofline are consistent, no measured rate beats the measured matmul peak, and every
target's verdict is the ratio of the rows it names compared with its threshold.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

_REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench") / "bench.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")  # (the tests' compile-speed XLA flags: the
  #   relations checked here hold whatever the compiler, and it compiles in half the time)
  proc = subprocess.run([sys.executable, "-m", "experiments.bench", "--quick", f"--out={out}"],
                        cwd=str(_REPO), capture_output=True, text=True, env=env, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(out.read_text()), proc.stdout


def _close(a, b, rel=1e-6):
  return abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.slow
def test_bench_quick_fields_and_the_relations_between_them(quick_bench):
  res, stdout = quick_bench
  for field in ("command", "machine", "stream", "peak", "scan", "loop", "seeds",
                "roofline", "inference", "encode", "suite", "targets", "paper_table8"):
    assert field in res, field
  assert res["quick"] is True and res["machine"]["backend"] == "cpu"
  n = res["stream"]["num_queries"]
  peak = res["peak"]["gflops"]
  assert peak > 0 and abs(peak - max(res["peak"]["by_size"].values())) <= 0.051  # rounded to 0.1
  # The scan: rate = queries / time; GFLOP/s = counted FLOPs x rate; never above the peak.
  assert set(res["scan"]) == {str(d) for d in res["stream"]["dims"]}
  for d, row in res["scan"].items():
    assert row["num_queries"] == n and row["compile_s"] > 0 and row["seconds"] > 0
    assert _close(row["queries_per_s"] * row["seconds"], n)
    flops = row["flops_per_query"]
    assert flops["total"] == sum(v for k, v in flops.items() if k != "total") > 0
    assert flops["adapter_forward"] == flops["adapter_weight_grad"] > flops["logits"] > 0
    assert _close(row["gflops"], flops["total"] * row["queries_per_s"] / 1e9)
    assert row["gflops"] <= 1.2 * peak, (d, row["gflops"], peak)
  d_top = str(max(res["stream"]["dims"]))
  roof = res["roofline"]
  assert roof["dim"] == int(d_top) and roof["peak_gflops"] == peak
  assert _close(roof["achieved_gflops"], res["scan"][d_top]["gflops"])
  assert _close(roof["fraction_of_peak"], roof["achieved_gflops"] / peak)
  assert 0 < roof["fraction_of_peak"] <= 1.2
  # The Python loop over the jitted step trained the same adapter as the scan.
  loop = res["loop"]
  assert loop["max_abs_param_diff_vs_scan"] < 1e-5
  assert _close(loop["queries_per_s"] * loop["seconds"], n)
  assert _close(loop["donated_queries_per_s"] * loop["donated_seconds"], n)
  seeds = res["seeds"]
  assert seeds["num_seeds"] >= 2 and seeds["devices"] >= 1
  assert _close(seeds["speedup"], seeds["sequential_s"] / seeds["vmap_s"])
  for bank in ("bank600", "bank250"):
    for name in ("adapter_b1", "adapter_b256", "explorer_b1", "explorer_b256"):
      r = res["inference"][bank][name]
      b = int(name.rsplit("_b", 1)[1])
      assert r["queries_per_s"] > 0, (bank, name)
      assert _close(r["ms_per_query"] * b, r["ms_per_call"])
      assert _close(r["queries_per_s"] * r["ms_per_query"], 1e3)
  # --quick measures neither the encoder nor the suite, and says so.
  assert res["encode"]["status"].startswith("skipped") and res["suite"]["status"].startswith(
      "skipped")
  # Each target's value is the ratio of the rows it names, and `met` compares it with the target.
  d0 = str(res["stream"]["dims"][0])
  scan0 = res["scan"][d0]["queries_per_s"]
  expected = {
      "scan_over_loop": scan0 / loop["queries_per_s"],
      "scan_fraction_of_peak": roof["fraction_of_peak"],
      "seeds_speedup": seeds["speedup"],
      "adapter_b1_ms": max(r["adapter_b1"]["ms_per_query"] for r in res["inference"].values()),
      "adapter_b256_qps": min(r["adapter_b256"]["queries_per_s"]
                              for r in res["inference"].values()),
  }
  assert set(res["targets"]) == set(expected) | {"suite_s", "memory_search_over_bound"}
  assert res["targets"]["suite_s"] is None  # not measured with --quick
  assert res["targets"]["memory_search_over_bound"] is None  # (nor the memory's first calls)
  for name, value in expected.items():
    v = res["targets"][name]
    assert _close(v["value"], value), (name, v, value)
    higher = v["direction"] == ">="
    assert higher == (name != "adapter_b1_ms"), name
    assert v["met"] == (value >= v["target"] if higher else value <= v["target"]), (name, v)
  # The printed table names every target with its verdict.
  for name, v in res["targets"].items():
    line = [l for l in stdout.splitlines() if l.startswith(f"| {name} |")]
    assert line, name
    if v is not None:
      assert line[0].rstrip().endswith("| yes |" if v["met"] else "| NO |"), line


def test_accel_skip_refuses_a_step_the_suite_does_not_have():
  proc = subprocess.run([sys.executable, "-m", "experiments.bench", "--suite=accelerator",
                         "--accel_skip=tests"], cwd=str(_REPO), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode != 0 and "--accel_skip takes" in proc.stderr, proc.stderr[-2000:]
