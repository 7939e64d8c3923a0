"""`--suite=guard`: ear_safe against the frozen first stage and paging, test split."""
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
  opts = suites.Options(benchmark="locomo", data_dir=str(locomo_path.parent.resolve()), limit=1,
                        seeds=2, workdir=str(tmp_path / "w"), suite="guard",
                        checkpoint_every=None, progress=False)
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
  # The guarded row is the plain ear_safe run's and the frozen row the retriever's own top-5, per
  # seed (run summaries keep 4 decimals).
  r = Runner(dataclasses.replace(opts, suite=None))
  for g in ("dense", "hybrid"):
    rows = cached[(g, "default critic (P .88, R .86)")]["rows"]
    sub = first_stage.sub_runner(r, g)
    safe = sub.run("ear_safe")["metrics"]
    np.testing.assert_allclose(rows["ear_safe adapter-only (guarded)"]["recall"],
                               safe["recall_adapter"]["per_seed"], atol=1e-3)
    frozen = sub.run("retriever")["metrics"]
    np.testing.assert_allclose(rows["frozen first stage"]["recall"],
                               frozen["recall_adapter"]["per_seed"], atol=1e-3)
  # --resume reuses every cached run and prints the same table.
  again = suites.run(dataclasses.replace(opts, resume=True))
  assert again["tables"]["guard"] == md
