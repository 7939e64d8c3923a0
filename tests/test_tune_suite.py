"""`--suite=tune` and `--suite=beyond` end to end on the synthetic benchmark (tiny grids)."""
import json

import numpy as np
import pytest

from ear_jax.experiment import results_md
from ear_jax.experiment import runner
from ear_jax.experiment import suites
from ear_jax.experiment.suites import tune


@pytest.mark.slow
def test_tune_then_beyond_on_synthetic(tmp_path, monkeypatch):
  monkeypatch.setattr(tune, "LR_GRID", (1e-3, 1e-2))
  monkeypatch.setattr(tune, "B_GRID", (0.0, 0.5))
  monkeypatch.setattr(tune, "STATIC_VARIANTS", {"sequential loss": {"loss_form": "sequential"}})
  monkeypatch.setattr(tune, "REFINE", {"alpha=1": {"alpha": 1.0}})
  common = dict(benchmark="synthetic", seeds=2, workdir=str(tmp_path / "tune"),
                checkpoint_every=None, progress=False, synthetic_queries=80, synthetic_dim=8)
  res = suites.run(suites.Options(suite="tune", **common))
  md = res["tables"]["tune"]
  assert "Only Retriever" in md and "**chosen**" in md
  rows = json.loads((tmp_path / "tune" / "tune" / "sweep_table.json").read_text())
  chosen = json.loads((tmp_path / "tune" / "tune" / "chosen.json").read_text())
  # The chosen setting is the best mean validation Recall@5 (adapter) among the scored rows.
  best = max(np.mean(r["adapter"]) for r in rows if r["method"] == "ear")
  assert np.mean(chosen["validation_recall_adapter"]) == pytest.approx(best)
  # Every sweep was trained / scored on the validation protocol's indices, never a test query.
  train, test = runner.seed_splits(80, [0, 1])
  fit, val = runner.validation_split(train)
  for f in (tmp_path / "tune" / "tune").glob("[0-9]_*.json"):
    ident = json.loads(f.read_text())["ident"]
    assert ident["fit"] == fit.tolist() and ident["validation"] == val.tolist()
    for i in range(2):
      assert not set(ident["validation"][i]) & set(test[i].tolist())
  # --resume reuses the cached sweeps and gives the same table.
  again = suites.run(suites.Options(suite="tune", resume=True, **common))
  assert again["tables"]["tune"] == md
  common["workdir"] = str(tmp_path / "beyond")
  res = suites.run(suites.Options(suite="beyond", **common))
  assert "ear_tuned" in res["tables"]["beyond"]
  assert any(p["treatment"]["label"].startswith("ear_tuned") for p in res["paired"]["beyond"])
  root = tmp_path / "RESULTS.md"
  root.write_text("# Results\n\nkept text\n")
  results_md.write_beyond_md([tmp_path / "tune", tmp_path / "beyond"], root, tmp_path / "res")
  text = root.read_text()
  assert "kept text" in text and results_md.BEYOND_BEGIN in text and "test split" in text
  results_md.write_beyond_md([tmp_path / "beyond"], root, tmp_path / "res")
  assert root.read_text().count(results_md.BEYOND_BEGIN) == 1
