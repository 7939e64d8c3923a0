"""`python -m experiments.bench --quick` runs and writes every field (no timing assertions)."""
import json
import os
import pathlib
import subprocess
import sys

_REPO = pathlib.Path(__file__).resolve().parent.parent


def test_bench_quick_produces_every_field(tmp_path):
  out = tmp_path / "bench.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "experiments.bench", "--quick", f"--out={out}"],
                        cwd=str(_REPO), capture_output=True, text=True, env=env, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  res = json.loads(out.read_text())
  for field in ("command", "machine", "stream", "peak", "scan", "loop", "numpy", "seeds",
                "roofline", "inference", "encode", "suite", "targets", "paper_table8"):
    assert field in res, field
  for row in res["scan"].values():
    assert row["queries_per_s"] > 0 and row["compile_s"] > 0
    assert row["flops_per_query"]["total"] > 0 and row["gflops"] > 0
  assert res["loop"]["queries_per_s"] > 0
  assert res["loop"]["max_abs_param_diff_vs_scan"] < 1e-5  # the two paths did the same work
  assert res["numpy"]["queries_per_s"] > 0
  assert res["seeds"]["speedup"] > 0 and res["seeds"]["num_seeds"] >= 2
  assert res["peak"]["gflops"] > 0
  assert 0 < res["roofline"]["fraction_of_peak"]
  for bank in ("bank600", "bank250"):
    for name in ("adapter_b1", "adapter_b256", "explorer_b1", "explorer_b256"):
      assert res["inference"][bank][name]["queries_per_s"] > 0, (bank, name)
  assert set(res["targets"]) == {"scan_over_loop", "scan_over_numpy", "scan_fraction_of_peak",
                                 "seeds_speedup", "adapter_b1_ms", "adapter_b256_qps", "suite_s"}
  for name, verdict in res["targets"].items():
    if verdict is not None:
      assert isinstance(verdict["met"], bool), name
  # The printed table names every target.
  for name in res["targets"]:
    assert name in proc.stdout, name
