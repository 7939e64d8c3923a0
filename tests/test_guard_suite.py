"""`--suite=guard`: ear_safe against the frozen first stage and paging (issue 27), test split."""
import dataclasses
import json

import numpy as np
import pytest

from ear_jax.experiment import suites
from ear_jax.experiment.suites import first_stage
from ear_jax.experiment.suites import guard
from ear_jax.experiment.suites.run_cache import Runner


def test_guard_suite_is_registered_by_name_only():
  from experiments import run  # pylint: disable=import-outside-toplevel
  assert suites.SUITES["guard"] is guard.suite_guard
  assert "guard" in run.SUITES and "guard" in suites.SUITE_NAMES
  assert "guard" not in suites.ALL_ORDER and "guard" not in suites.suite_names("all", "locomo")


@pytest.mark.slow
def test_guard_suite_rows_are_paired_per_seed_and_match_the_plain_runs(locomo_path, tmp_path):
  # (the prequential guard, `ear_safe` before session 11: its training is ear_tuned's)
  opts = suites.Options(benchmark="locomo", data_dir=str(locomo_path.parent.resolve()), limit=1,
                        seeds=2, workdir=str(tmp_path / "w"), suite="guard",
                        checkpoint_every=None, progress=False,
                        config_overrides={"guard_holdout": 0, "guard_z": 0.5,
                                          "guard_evidence": "items"})
  res = suites.run(opts)
  md = res["tables"]["guard"]
  for g in first_stage.GENERATORS_SHOWN:
    for critic in guard.TEST_CRITICS:
      for row in guard.TEST_ROWS:
        assert f"| {g} | {critic} | {row} |" in md
  assert md.count("safety: ") == 6 and md.count("paging: ") == 6
  records = res["paired"]["guard"]
  assert len(records) == 6 * (len(guard.TEST_ROWS) - 1 + 2)
  assert all(len(rec["per_seed"]) == 2 for rec in records)
  cached = {(c["candidates"], c["critic"]): c for c in
            json.loads((tmp_path / "w" / "guard.json").read_text())}
  # The guard-off row is an ear_tuned run (the guard changes nothing in training) and the frozen
  # row the retriever's own top-5, per seed (run summaries keep 4 decimals).
  r = Runner(dataclasses.replace(opts, suite=None))
  for g in ("dense", "hybrid"):
    rows = cached[(g, "default critic (P .88, R .86)")]["rows"]
    sub = first_stage.sub_runner(r, g)
    tuned = sub.run("ear_tuned")["metrics"]
    np.testing.assert_allclose(rows["ear_tuned adapter-only (guard off)"]["recall"],
                               tuned["recall_adapter"]["per_seed"], atol=1e-3)
    frozen = sub.run("retriever")["metrics"]
    np.testing.assert_allclose(rows["frozen first stage"]["recall"],
                               frozen["recall_adapter"]["per_seed"], atol=1e-3)
  # --resume reuses every cached run and prints the same table.
  again = suites.run(dataclasses.replace(opts, resume=True))
  assert again["tables"]["guard"] == md


def test_guard_diagnosis_is_registered_by_name_only():
  from experiments import run  # pylint: disable=import-outside-toplevel
  from ear_jax.experiment.suites import guard_diagnosis  # pylint: disable=import-outside-toplevel
  assert suites.SUITES["guard_diagnosis"] is guard_diagnosis.suite_guard_diagnosis
  assert "guard_diagnosis" in run.SUITES and "guard_diagnosis" not in suites.ALL_ORDER


@pytest.mark.slow
def test_guard_diagnosis_reports_every_variant_and_seed(tmp_path):
  from ear_jax.experiment.suites import guard_diagnosis  # pylint: disable=import-outside-toplevel
  from ear_jax.experiment.suites.options import Options  # pylint: disable=import-outside-toplevel
  r = Runner(Options(benchmark="synthetic", synthetic_queries=120, seeds=2,
                     workdir=str(tmp_path), progress=False))
  md = guard_diagnosis.suite_guard_diagnosis(r)
  saved = json.loads((tmp_path / "guard_diagnosis.json").read_text())
  assert set(saved) == set(guard_diagnosis.VARIANTS) and all(
      len(v["evidence_mean_d"]) == 2 and len(v["validation_recall_diff"]) == 2
      for v in saved.values())
  # The probe leaves training unchanged: the same adapters, so the same held-out columns.
  assert saved["probe"]["test_recall_diff"] == saved["training slates"]["test_recall_diff"]
  assert md.count("\n| ") == 2 * (1 + len(guard_diagnosis.VARIANTS))  # 2 tables: header, rows
  for v in saved.values():  # along the stream: 4 quarters; the 100 % prefix is the run itself
    assert len(v["evidence_by_quarter"]) == 4
    assert len(v["test_recall_diff_by_prefix"]) == len(guard_diagnosis.PREFIXES)
    assert v["test_recall_diff_by_prefix"][-1] == pytest.approx(np.mean(v["test_recall_diff"]))
