"""`python -m experiments.bench --suite=first_stage --quick`: every field of the table, tiny shapes."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_first_stage_suite_quick_writes_every_field(tmp_path):
  out = tmp_path / "first_stage" / "first_stage.json"
  proc = subprocess.run([sys.executable, "-m", "experiments.bench", "--suite=first_stage", "--quick",
                         f"--first_stage_out={out}"], cwd=REPO, capture_output=True, text=True,
                        timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads(out.read_text())
  (row,) = res["rows"]
  for key in ("dense", "bm25", "hybrid_rrf", "hybrid_weighted", "bm25_host", "index_add_one",
              "index_delete_one", "hybrid_weighted_after_add"):
    assert row[key]["p50_ms"] > 0, key
  assert row["index_build_s"] > 0 and row["bound_ms"] > 0
  for cand in ("bm25", "hybrid"):
    mem = row[f"memory_{cand}"]
    for key in ("search", "add_one", "search_after_add", "delete_one", "search_after_delete"):
      assert mem[key]["p50_ms"] > 0, (cand, key)
  assert 0 < row["matching_mean"] <= row["M"]
  assert res["bandwidth"]["gb_per_s"] > 0 and len(res["loadavg_before"]) == 3
  md = out.with_suffix(".md").read_text()
  assert "| 2,000 |" in md and "| 2,000 | hybrid |" in md
