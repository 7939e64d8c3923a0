"""`--suite=side_init_tune`: `ear_tuned`'s side_init and learning rate on every benchmark's
validation part at every K; the rule in `side_init.choose`."""
import json

import numpy as np
import pytest

from ear_jax.experiment.suites import pool
from ear_jax.experiment.suites import side_init


def _row(bench, k, si, lr, delta):
  return {"benchmark": bench, "k": k, "side_init": si, "learning_rate": lr,
          "frozen": [50.0] * len(delta), "delta": list(delta)}


def test_the_command_line_knows_the_suite():
  from experiments import run  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import suites  # pylint: disable=g-import-not-at-top
  assert "side_init_tune" in run.SUITES and "side_init_tune" in suites.SUITES
  assert "side_init_tune" not in suites.suite_names("all", "locomo")


def test_choose_wants_every_cell_safe_then_the_largest_sum():
  rows = [
      # 0.05: the largest sum, but one cell's mean is below 0
      _row("a", 20, 0.05, 1e-4, [9, 9, 9]), _row("b", 20, 0.05, 1e-4, [-1, 0, 0.5]),
      # 0.1: every mean >= 0, but one lower bound below -1 (a wide spread)
      _row("a", 20, 0.1, 1e-4, [4, 4, 4]), _row("b", 20, 0.1, 1e-4, [-6, 6, 1]),
      # 0.25: safe everywhere
      _row("a", 20, 0.25, 1e-4, [2, 2, 3]), _row("b", 20, 0.25, 1e-4, [0.4, 0.5, 0.6]),
      # 0.5: safe everywhere, a smaller sum
      _row("a", 20, 0.5, 1e-4, [1, 1, 1]), _row("b", 20, 0.5, 1e-4, [0, 0, 0]),
  ]
  out = side_init.choose(rows)
  assert out["chosen"] == {"side_init": 0.25, "learning_rate": 1e-4}
  safe = {s["side_init"]: s["safe"] for s in out["summed_delta"]}
  assert safe == {0.05: False, 0.1: False, 0.25: True, 0.5: True}
  assert side_init.choose(rows[:4])["chosen"] is None  # nothing safe: no choice


@pytest.mark.slow  # trains on a LoCoMo slice (MiniLM encoding, BM25)
def test_suite_scores_every_setting_on_validation_and_writes_its_choice(locomo_path, tmp_path,
                                                                       monkeypatch):
  from ear_jax.experiment import suites  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(side_init, "BENCHMARKS", ("locomo",))
  monkeypatch.setattr(side_init, "SIDE_INITS", (0.05, 0.25))
  monkeypatch.setattr(pool, "K_VALUES", (20, 50))
  opts = suites.Options(benchmark="locomo", data_dir=str(locomo_path.parent.resolve()), limit=1,
                        seeds=2, candidates="hybrid", workdir=str(tmp_path / "w"),
                        suite="side_init_tune", checkpoint_every=None, progress=False)
  res = suites.run(opts)
  md = res["tables"]["side_init_tune"]
  saved = json.loads((tmp_path / "w" / "side_init_tune.json").read_text())
  rows = saved["rows"]
  assert {(r["k"], r["side_init"], r["learning_rate"]) for r in rows} == {
      (k, si, lr) for k in (20, 50) for si in (0.05, 0.25) for lr in side_init.LEARNING_RATES}
  for r in rows:
    assert len(r["delta"]) == 2 and np.all(np.isfinite(r["delta"]))
    assert len(set(map(tuple, [x["frozen"] for x in rows if x["k"] == r["k"]]))) == 1
  assert saved["chosen"] == side_init.choose(rows)["chosen"]
  assert saved["preset"] == {"side_init": 0.25, "learning_rate": 1e-4}
  assert "| 0.25 | 0.0001 |" in md and "locomo, K = 50" in md
