"""Tests of ear_jax/experiment/stats.py: paired differences over seeds and their t-intervals."""
import json
import math

import numpy as np
import pytest

from ear_jax.experiment import stats


def test_hand_computed_interval():
  # Differences [1, 2, 3, 4]: mean 2.5, sd (ddof=1) sqrt(5/3) = 1.2910, t_{3, 0.975} = 3.182446,
  # half-width 3.182446 * 1.2910 / 2 = 2.0543.
  d = stats.paired_difference([11.0, 12.0, 13.0, 14.0], [10.0, 10.0, 10.0, 10.0])
  assert d.n == 4
  assert d.mean == pytest.approx(2.5, abs=1e-3)
  assert d.sd == pytest.approx(1.2910, abs=1e-3)
  assert stats.t_quantile(4) == pytest.approx(3.182446, abs=1e-5)
  assert d.lo == pytest.approx(0.4457, abs=1e-3)
  assert d.hi == pytest.approx(4.5543, abs=1e-3)
  assert d.per_seed == [1.0, 2.0, 3.0, 4.0]
  assert d.verdict == "better"
  assert stats.format_difference(d) == "+2.50 [+0.45, +4.55]"
  assert stats.describe_verdict(d) == "better (interval excludes 0)"


def test_confidence_level_widens_interval():
  d95 = stats.paired_difference([1, 2, 3, 4], [0, 0, 0, 0])
  d99 = stats.paired_difference([1, 2, 3, 4], [0, 0, 0, 0], confidence=0.99)
  assert d99.lo < d95.lo and d99.hi > d95.hi
  with pytest.raises(ValueError):
    stats.paired_difference([1, 2], [0, 0], confidence=1.0)


def test_tie_when_interval_contains_zero():
  d = stats.paired_difference([1.0, -2.0, 3.0], [0.0, 0.0, 0.0])
  assert d.lo < 0 < d.hi
  assert d.verdict == "tie"
  assert stats.describe_verdict(d) == "tie (interval includes 0)"
  assert stats.agreement(d, +5.0) == "not separated"


def test_worse():
  d = stats.paired_difference([50.0, 51.0, 49.5, 50.5], [55.0, 55.5, 54.0, 56.0])
  assert d.hi < 0
  assert d.verdict == "worse"
  assert stats.format_difference(d).startswith("-4.")
  assert stats.agreement(d, -2.0) == "holds"
  assert stats.agreement(d, +2.0) == "opposite"
  assert stats.agreement(d, None) is None


def test_single_seed_has_no_interval():
  d = stats.paired_difference([3.0], [1.0])
  assert d.n == 1 and d.mean == 2.0
  assert math.isnan(d.lo) and math.isnan(d.hi) and math.isnan(d.sd)
  assert d.verdict == "tie (n=1)"
  assert stats.format_difference(d) == "+2.00 (n=1)"


def test_equal_inputs_give_zero_width_tie_without_nan():
  d = stats.paired_difference([40.0, 42.0, 44.0], [40.0, 42.0, 44.0])
  assert (d.mean, d.sd, d.lo, d.hi) == (0.0, 0.0, 0.0, 0.0)
  assert d.verdict == "tie"


def test_constant_nonzero_difference_is_a_point_interval():
  # sd = 0: the interval is the point {mean}, which excludes 0 when mean != 0.
  d = stats.paired_difference([41.0, 43.0, 45.0], [40.0, 42.0, 44.0])
  assert d.sd == 0.0 and d.lo == d.hi == d.mean == 1.0
  assert d.verdict == "better"
  assert not any(math.isnan(x) for x in (d.mean, d.sd, d.lo, d.hi))


def test_mismatched_lengths_raise():
  with pytest.raises(ValueError, match="seeds"):
    stats.paired_difference([1.0, 2.0, 3.0], [1.0, 2.0])


def test_missing_seeds_are_dropped_pairwise():
  d = stats.paired_difference([1.0, None, 3.0, float("nan")], [0.0, 0.0, 1.0, 0.0])
  assert d.n == 2 and d.per_seed == [1.0, None, 2.0, None]
  assert d.mean == pytest.approx(1.5)
  empty = stats.paired_difference([None, None], [1.0, 2.0])
  assert empty.n == 0 and empty.verdict == "no data"
  assert stats.format_difference(empty) == "–"


def test_to_json_round_trips_and_formats():
  d = stats.paired_difference([1, 2, 3, 4], [0, 0, 0, 0])
  j = json.loads(json.dumps(d.to_json()))
  assert j["verdict"] == "better" and j["n"] == 4
  assert stats.format_difference(j) == stats.format_difference(d)
  one = json.loads(json.dumps(stats.paired_difference([2.0], [1.0]).to_json()))
  assert one["lo"] is None and stats.format_difference(one) == "+1.00 (n=1)"
  assert stats.describe_verdict(one) == "tie (n=1)"


def test_mean_interval():
  mean, lo, hi, n = stats.mean_interval([11.0, 12.0, None, 13.0, 14.0])
  assert n == 4 and mean == pytest.approx(12.5)
  assert lo == pytest.approx(12.5 - 2.0543, abs=1e-3)
  assert hi == pytest.approx(12.5 + 2.0543, abs=1e-3)
  m1, lo1, hi1, n1 = stats.mean_interval([5.0])
  assert (m1, n1) == (5.0, 1) and np.isnan(lo1) and np.isnan(hi1)


def test_readings_from_records():
  from ear_jax.experiment import results_md  # pylint: disable=g-import-not-at-top
  d = stats.paired_difference([45.0, 47.0, 46.0], [40.0, 41.0, 42.0]).to_json()
  rec = {"treatment": {"label": "EAR (ours)", "mode": "explorer"},
         "baseline": {"label": "Only Retriever", "mode": "adapter"}, "metric": "R@5", **d,
         "paper_delta": 12.46, "expected_sign": 1, "vs_paper": stats.agreement(d, 12.46),
         "primary": True}
  line = results_md.reading(rec)
  assert line.startswith("EAR (ours) [explorer] vs Only Retriever [adapter], R@5: +5.00 [")
  assert "better (interval excludes 0)" in line and "paper +12.46" in line and "holds" in line
  tie = {**rec, **stats.paired_difference([1.0, -1.0, 0.5], [0.0, 0.0, 0.0]).to_json(),
         "vs_paper": "not separated", "primary": False}
  assert "tie (interval includes 0)" in results_md.reading(tie)
  md = results_md.readings_md([rec, tie])
  assert md.count("\n- ") == 1 and "n = 3" in md
  assert results_md.readings_md([tie]) == ""


def test_neutral_verdict_wording():
  d = stats.paired_difference([3.0, 3.1, 2.9], [1.0, 1.0, 1.0])
  assert stats.describe_verdict(d, neutral=True) == "higher (interval excludes 0)"
  w = stats.paired_difference([1.0, 1.0, 1.0], [3.0, 3.1, 2.9])
  assert stats.describe_verdict(w, neutral=True) == "lower (interval excludes 0)"
