"""Paired comparisons over seeds: each suite compares its methods with a baseline.

Seed i of every method sees the same split and keys (`Runner.bench`, `PRNGKey(seeds[i])`); runs
with another number of epochs draw different critic noise, and multi-store runs pair only with
multi-store runs. `pair` records each comparison in `Runner.paired[suite]` (results.json
"paired"); `primary` ones feed the readings (`results_md.readings_md`). `paging_rows` pairs a
table's explorer-assisted row with its two paging baselines (the same T critic calls over the
first-stage or adapted ranking).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ear_jax.experiment import stats
from ear_jax.experiment.suites.run_cache import Runner


def get_metric(summary, metric):
  """`summary["metrics"][metric]`: a `mean_std` dict of a run summary."""
  return summary["metrics"][metric]


DELTA_NOTE = ("Δ columns: mean over seeds of the per-seed paired difference method − baseline "
              "(same seed = same train/test split and PRNG keys), in points, with its "
              f"[{stats.INTERVAL_LABEL}] (Student t, n−1 dof; 'better'/'worse' only when the "
              "interval excludes 0, otherwise a tie).")


METRIC_LABELS = {"recall": "R@5", "hitrate": "Hit@5"}

# A paired difference as a table cell: '+1.23 [-0.45, +2.91]'.
fd = stats.format_difference


def _sign(v):
  return None if v is None or not np.isfinite(v) or v == 0 else (1 if v > 0 else -1)


def pair(r: Runner, suite: str, treatment: dict, baseline: dict, metric: str, t_values,
         b_values, *, paper_delta=None, expected_sign=None, primary: bool = True,
         score: bool = True) -> dict:
  """Paired difference `treatment - baseline` of per-seed values, recorded in `r.paired[suite]`.

  Args:
    treatment, baseline: `{"label", "run", "mode"}` describing each side (JSON, `side`).
    t_values, b_values: per-seed values, in the seed order `r.seeds`.
    paper_delta: the paper's difference, if it reports both numbers.
    expected_sign: the paper's direction (+1 / -1) (default: the sign of `paper_delta`).
    primary: list this comparison in the suite's readings.
    score: higher is better; False reads verdicts as 'higher' / 'lower'.

  Returns:
    The `PairedDifference.to_json()` dict.
  """
  d = stats.paired_difference(t_values, b_values).to_json()
  sign = expected_sign if expected_sign is not None else _sign(paper_delta)
  r.paired.setdefault(suite, []).append({
      "treatment": treatment, "baseline": baseline, "metric": metric, **d,
      "paper_delta": None if paper_delta is None else round(float(paper_delta), 2),
      "expected_sign": sign, "vs_paper": stats.agreement(d, sign), "primary": primary,
      "score": score})
  return d


# Paging test modes (`summaries.PAGING_METRIC_NAMES`) -> their row label.
PAGING_MODES = {"paging_first_stage": "paging over the first stage ({t} pages of {s})",
                "paging_adapted": "paging over the adapted ranking ({t} pages of {s})"}

# Printed under a table with paging rows, after its own note.
PAGING_NOTE = ("Paging rows: the same run's critic reads the first stage's (or the "
               "adapted) ranking's top T x 5 in T pages of 5 and the answer puts the cited "
               "memories first: the same T critic calls per test query and as many memories shown "
               "as the explorer-assisted row above them, with common random numbers (page t and "
               "explorer round t share the critic's key). Their last column is paired per seed "
               "with that explorer-assisted row (positive: paging wins).")

PAGING_DELTA_HEADER = "Δ R@5 vs the explorer-assisted row [95% CI]"


def paging_note(summary: dict, k: int) -> str:
  """`PAGING_NOTE`, and when the T pages cover all `k` candidates of a query, what that means."""
  s = summary["config"]["slate_size"]
  shown = explorer_rounds(summary) * s
  if shown < k:
    return PAGING_NOTE
  return PAGING_NOTE + (f" Here T x {s} = {shown} ≥ K = {k}: the pages show every candidate, so "
                        "paging is the critic labelling the whole candidate set once; the two "
                        "paging rows differ only in where the critic's noise falls and in the "
                        "ranking's order among the answer's memories.")


def explorer_rounds(summary: dict) -> int:
  """`T` of a run's explorer-assisted inference: its config's `test_rounds`, else `num_rounds`."""
  cfg = summary["config"]
  return cfg.get("test_rounds") or cfg["num_rounds"]


def paging_rows(r: Runner, suite: str, label: str, summary: dict) -> list:
  """`[(mode, row label, Δ R@5 dict)]` of `PAGING_MODES`: the two paging neighbours of a run's
  explorer-assisted row, each paired with it (primary)."""
  t, s = explorer_rounds(summary), summary["config"]["slate_size"]
  return [(mode, text.format(t=t, s=s),
           pair_runs(r, suite, (label, summary, mode), (label, summary, "explorer"),
                     metrics=("recall",))["recall"])
          for mode, text in PAGING_MODES.items()]


def insert_rows(rows: list, additions: list) -> list:
  """`rows` with each `(i, new_rows)` of `additions` inserted right below `rows[i]`."""
  out = list(rows)
  for i, new in sorted(additions, key=lambda a: a[0], reverse=True):
    out[i + 1:i + 1] = new
  return out


def side(label: str, summary: dict, mode: Optional[str]) -> dict:
  """JSON description of one side of a comparison: label, run name and test mode."""
  return {"label": label, "run": summary.get("run"), "mode": mode}


def pair_runs(r: Runner, suite: str, t: tuple, b: tuple, metrics=("recall", "hitrate"),
              paper: Optional[dict] = None, primary=True,
              expected: Optional[dict] = None) -> dict:
  """`pair` of the test metrics of two runs, `t` and `b` each `(label, summary, test mode)`.

  `metrics`: 'recall' (R@5) and / or 'hitrate' (Hit@5); `paper` / `expected`: optional
  `{metric: paper difference / +1 / -1}`; `primary`: a bool or the metrics that feed the readings.
  Returns `{metric: difference dict}`.

  Raises:
    ValueError: when the two runs do not share seeds and test-set size (not paired).
  """
  (tl, ts, tm), (bl, bs, bm) = t, b
  if ts.get("seeds") != bs.get("seeds") or ts.get("num_test") != bs.get("num_test"):
    raise ValueError(f"{tl} and {bl} are not paired: seeds {ts.get('seeds')} vs "
                     f"{bs.get('seeds')}, test sizes {ts.get('num_test')} vs {bs.get('num_test')}")
  return {metric: pair(r, suite, side(tl, ts, tm), side(bl, bs, bm), METRIC_LABELS[metric],
                       get_metric(ts, f"{metric}_{tm}")["per_seed"],
                       get_metric(bs, f"{metric}_{bm}")["per_seed"],
                       paper_delta=(paper or {}).get(metric),
                       expected_sign=(expected or {}).get(metric),
                       primary=primary if isinstance(primary, bool) else metric in primary)
          for metric in metrics}
