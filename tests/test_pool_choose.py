"""`pool.choose`, the `pool_tune` rule, on the validation means RESULTS.md's "Candidate pool K"
table reports (LoCoMo, hybrid): it picks 'auto' and K = 100, and only a support that never loses."""
import pytest

from ear_jax.experiment.suites import pool

FROZEN = 48.37
# (K, loss_support): (adapter-only R@5, paging R@5 over the served ranking), validation means
TABLE = {(20, "all"): (51.95, 59.27), (20, "labelled"): (50.57, 58.94),
         (50, "all"): (27.32, 44.47), (50, "window"): (48.13, 61.30),
         (50, "labelled"): (50.41, 63.17),
         (100, "all"): (2.60, 7.64), (100, "window"): (46.67, 60.16),
         (100, "labelled"): (49.76, 63.98)}


def _rows(table):
  rows = [{"k": k, "method": "retriever", "adapter": [FROZEN], "paging_served": [59.35]}
          for k in pool.K_VALUES]
  return rows + [{"k": k, "method": pool.TUNED, "loss_support": s, "adapter": [a],
                  "paging_served": [p]} for (k, s), (a, p) in table.items()]


def test_the_rule_picks_auto_and_k_100_on_the_reported_validation_rows():
  out = pool.choose(_rows(TABLE))
  assert out["chosen_support"] == "auto" and out["chosen_k"] == 100
  summed = out["summed_delta"]  # (the table's sums are of per-seed differences: ±0.05)
  for support, value in {"all": -63.25, "window": 1.63, "labelled": 5.61, "auto": 6.99}.items():
    assert summed[support] == pytest.approx(value, abs=0.05)


def test_a_support_that_loses_at_one_k_is_never_chosen():
  table = dict(TABLE)
  table[(100, "labelled")] = (FROZEN - 0.1, 70.0)  # 'labelled' and 'auto' now lose at K = 100
  out = pool.choose(_rows(table))
  assert out["chosen_support"] is None and out["chosen_k"] is None  # 'window' and 'all' lose too
  table[(100, "window")] = (FROZEN + 0.5, 61.0)
  table[(50, "window")] = (FROZEN + 0.5, 62.0)
  out = pool.choose(_rows(table))
  assert out["chosen_support"] == "window" and out["chosen_k"] == 50  # the better paging
