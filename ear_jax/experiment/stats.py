"""Paired comparisons over seeds: the mean per-seed difference and its Student-t interval.

Seed `i` is the same for every method (split and PRNG keys), so methods are compared on
`d_i = treatment_i - baseline_i`, with the interval `m ± t_{n-1, (1 + c) / 2} · sd / sqrt(n)`
(`sd` with ddof = 1, confidence `c` = 0.95 by default) over seeds as independent draws.

Verdicts: 'better' / 'worse' when the interval lies entirely above / below 0, otherwise 'tie'.
`n = 1`: no interval (nan), 'tie (n=1)'; `n = 0`: all nan, 'no data'; `sd = 0`: the interval is
the point `mean` (the verdict by its sign; 'tie' at 0), never NaN.
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np
from scipy import stats as sp_stats

BETTER, WORSE, TIE, TIE_N1, NO_DATA = "better", "worse", "tie", "tie (n=1)", "no data"

INTERVAL_LABEL = "95% t-interval over seeds"


class PairedDifference(NamedTuple):
  """Paired difference `treatment - baseline` over seeds.

  Attributes:
    n: seeds with a finite value in both runs.
    mean, sd: mean and sample standard deviation (ddof = 1) of the per-seed differences.
    lo, hi: the ends of the t-interval (nan for n < 2; `sd` too).
    per_seed: the per-seed differences, in the given seed order (None where a value is missing).
    verdict: 'better', 'worse', 'tie', 'tie (n=1)' or 'no data'.
    confidence: the interval's confidence level.
  """
  n: int
  mean: float
  sd: float
  lo: float
  hi: float
  per_seed: list
  verdict: str
  confidence: float

  def to_json(self, digits: int = 4) -> dict:
    """A JSON-able dict; nan -> None, floats rounded to `digits`."""
    return {"n": self.n, "mean": _round(self.mean, digits), "sd": _round(self.sd, digits),
            "lo": _round(self.lo, digits), "hi": _round(self.hi, digits),
            "per_seed": [_round(v, digits) for v in self.per_seed], "verdict": self.verdict,
            "confidence": self.confidence,
            "interval": f"t-interval over seeds (n={self.n}, ddof=1)"}


def _round(v, digits):
  return None if v is None or not math.isfinite(v) else round(float(v), digits)


def _floats(values) -> np.ndarray:
  return np.asarray([np.nan if v is None else float(v)
                     for v in np.ravel(np.asarray(values, object))], np.float64)


def t_quantile(n: int, confidence: float = 0.95) -> float:
  """`t_{n-1, (1 + confidence) / 2}` (nan for n < 2)."""
  return float("nan") if n < 2 else float(sp_stats.t.ppf(0.5 * (1.0 + confidence), n - 1))


def mean_interval(values: Sequence[Optional[float]], confidence: float = 0.95):
  """Mean of `values` over seeds and its t-interval (NaN / None seeds dropped).

  Returns:
    `(mean, lo, hi, n)`; `lo = hi = nan` for n < 2, `lo = hi = mean` when all values are equal.
  """
  v = _floats(values)
  v = v[np.isfinite(v)]
  n = int(v.size)
  if n == 0:
    return float("nan"), float("nan"), float("nan"), 0
  mean = float(v.mean())
  if n < 2:
    return mean, float("nan"), float("nan"), n
  half = t_quantile(n, confidence) * float(v.std(ddof=1)) / math.sqrt(n)
  return mean, mean - half, mean + half, n


def paired_difference(treatment: Sequence[Optional[float]], baseline: Sequence[Optional[float]],
                      confidence: float = 0.95) -> PairedDifference:
  """Mean per-seed difference `treatment - baseline` with its t-interval over seeds.

  `treatment` and `baseline` hold one value per seed in the same order; seeds where either is None
  / NaN are dropped (their `per_seed` entry is None). Returns a `PairedDifference` (see the module
  docstring for the degenerate cases).

  Raises:
    ValueError: when the lengths differ or `confidence` is outside (0, 1).
  """
  if not 0.0 < confidence < 1.0:
    raise ValueError(f"confidence must be in (0, 1), got {confidence}")
  t, b = _floats(treatment), _floats(baseline)
  if t.shape != b.shape:
    raise ValueError(f"treatment has {t.size} seeds but baseline has {b.size}: a paired "
                     "difference needs one value per seed in both")
  diff = t - b
  ok = np.isfinite(diff)
  per_seed = [float(x) if f else None for x, f in zip(diff, ok)]
  d = diff[ok]
  n = int(d.size)
  nan = float("nan")
  if n == 0:
    return PairedDifference(0, nan, nan, nan, nan, per_seed, NO_DATA, confidence)
  mean = float(d.mean())
  if n == 1:
    return PairedDifference(1, mean, nan, nan, nan, per_seed, TIE_N1, confidence)
  sd = float(d.std(ddof=1))
  half = t_quantile(n, confidence) * sd / math.sqrt(n)
  lo, hi = mean - half, mean + half
  verdict = BETTER if lo > 0 else WORSE if hi < 0 else TIE
  return PairedDifference(n, mean, sd, lo, hi, per_seed, verdict, confidence)


DifferenceLike = Union[PairedDifference, Mapping]


def _get(d: DifferenceLike, field: str):
  v = d[field] if isinstance(d, Mapping) else getattr(d, field)
  return float("nan") if v is None else v


def format_difference(d: Optional[DifferenceLike], digits: int = 2) -> str:
  """Table cell of a paired difference (or its `to_json()` dict): `"+3.21 [+0.85, +5.57]"`,
  `"+3.21 (n=1)"` without an interval, `"–"` without data."""
  if d is None or _get(d, "n") == 0:
    return "–"
  mean, lo, hi = _get(d, "mean"), _get(d, "lo"), _get(d, "hi")
  if not (math.isfinite(lo) and math.isfinite(hi)):
    return f"{mean:+.{digits}f} (n={_get(d, 'n')})"
  return f"{mean:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def describe_verdict(d: DifferenceLike, neutral: bool = False) -> str:
  """The verdict in words, e.g. 'better (interval excludes 0)'; `neutral`: 'higher' / 'lower'."""
  v = _get(d, "verdict")
  if v in (BETTER, WORSE):
    if neutral:
      v = "higher" if v == BETTER else "lower"
    return f"{v} (interval excludes 0)"
  if v == TIE:
    return "tie (interval includes 0)"
  return v


def agreement(d: DifferenceLike, expected_sign: Optional[float]) -> Optional[str]:
  """Whether a verdict matches the paper's direction (`expected_sign`; None or 0: no claim).

  Returns:
    'holds', 'opposite', 'not separated' (tie) or None without a paper direction.
  """
  if expected_sign is None or expected_sign == 0 or not math.isfinite(expected_sign):
    return None
  v = _get(d, "verdict")
  if v not in (BETTER, WORSE):
    return "not separated"
  return "holds" if (v == BETTER) == (expected_sign > 0) else "opposite"
