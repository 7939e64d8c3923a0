"""`--suite=pool_tune`, `--suite=pool` and `--suite=first_stage_tune` end to end on one LoCoMo
conversation (grids cut to two values): their tables, their choices and the paired records."""
import json

import numpy as np
import pytest

from ear_jax.experiment import suites
from ear_jax.experiment.suites import first_stage
from ear_jax.experiment.suites import pool


def _opts(locomo_path, tmp_path, suite):
  return suites.Options(benchmark="locomo", data_dir=str(locomo_path.parent.resolve()), limit=1,
                        seeds=2, workdir=str(tmp_path / suite), suite=suite,
                        checkpoint_every=None, progress=False)


@pytest.mark.slow
def test_pool_tune_and_pool_run_every_k_and_pair_every_preset(locomo_path, tmp_path, monkeypatch):
  monkeypatch.setattr(pool, "K_VALUES", (20, 50))
  tuned = suites.run(_opts(locomo_path, tmp_path, "pool_tune"))
  rows = json.loads((tmp_path / "pool_tune" / "pool_tune.json").read_text())["rows"]
  # K = 20: the retriever, 'all' and 'labelled' ('window' is 'all' there); K = 50: all four.
  assert sorted((r["k"], r.get("loss_support", "-")) for r in rows) == [
      (20, "-"), (20, "all"), (20, "labelled"), (50, "-"), (50, "all"), (50, "labelled"),
      (50, "window")]
  assert all(len(r["adapter"]) == 2 and np.all(np.isfinite(r["adapter"])) for r in rows)
  assert "loss_support = " in tuned["tables"]["pool_tune"]
  res = suites.run(_opts(locomo_path, tmp_path, "pool"))
  md = res["tables"]["pool"]
  for k in (20, 50):
    for m in pool.PRESETS:
      assert f"| {k} | {m} |" in md
  assert "| 20 | ear_tuned, loss_support=all |" not in md  # the extra rows only at K > T s
  assert "| 50 | ear_tuned, loss_support=all |" in md and "| 50 | ear, loss_support=auto |" in md
  records = res["paired"]["pool"]
  assert records and all(len(rec["per_seed"]) == 2 for rec in records)


@pytest.mark.slow
def test_first_stage_tune_scores_every_fusion_and_chooses_from_its_grids(locomo_path, tmp_path,
                                                                      monkeypatch):
  monkeypatch.setattr(first_stage, "LEXICAL_WEIGHT_GRID", (0.4, 0.6))
  monkeypatch.setattr(first_stage, "SIDE_INIT_GRID", (0.05, 0.5))
  res = suites.run(_opts(locomo_path, tmp_path, "first_stage_tune"))
  out = json.loads((tmp_path / "first_stage_tune" / "first_stage_tune.json").read_text())
  assert [row["first_stage"] for row in out["fusion"]] == [
      "dense", "bm25", "hybrid rrf", "hybrid weighted 0.4", "hybrid weighted 0.6"]
  assert out["chosen_fusion"] in [row["options"] for row in out["fusion"][2:]]
  assert len(out["side_init"]) == 4 and out["chosen_side_init"]["ear"] in (0.05, 0.5)
  assert "Chosen hybrid fusion" in res["tables"]["first_stage_tune"]
