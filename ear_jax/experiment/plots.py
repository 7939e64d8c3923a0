"""PNG plots of EAR experiments (matplotlib, Agg): means over seeds with 95% t-intervals
(`stats.mean_interval`), learning curves (Figs. 3-5), bars, paired differences and heat maps.
"""
from __future__ import annotations

import pathlib
import textwrap
from typing import Mapping, Optional, Sequence

import numpy as np

from ear_jax.experiment import stats


def _plt():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def learning_curves(path, curves: Mapping[str, list], *, metric: str = "recall_adapter",
                    x: str = "queries_seen", title: str = "", xlabel: Optional[str] = None,
                    hlines: Optional[Mapping[str, float]] = None, ylabel: str = "Recall@5 (%)"):
  """One line per run: mean over seeds of `metric` against mean `x`, with a 95% interval band.

  Args:
    curves: `{label: curve}`; a curve is a list of points `{x: [S], metric: [S], ...}`.
    metric: which metric (percent).
    x: 'queries_seen' or 'critic_calls'.
    hlines: `{label: value}` horizontal reference lines (e.g. the frozen retriever).
  """
  plt = _plt()
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for label, curve in curves.items():
    if not curve:
      continue
    xs = np.array([np.mean(p[x]) for p in curve])
    mean, lo, hi, _ = np.array([stats.mean_interval(p[metric]) for p in curve], np.float64).T
    line, = ax.plot(xs, mean, label=label, marker="o", ms=2.5, lw=1.4)
    if np.isfinite(lo).any():
      ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
  for i, (label, value) in enumerate((hlines or {}).items()):
    ax.axhline(value, ls="--", lw=1.0, color=f"C{7 + i}", label=label)
  ax.set_xlabel(xlabel or {"queries_seen": "training queries seen",
                           "critic_calls": "critic (LLM) calls"}.get(x, x))
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, title=f"bands: {stats.INTERVAL_LABEL}", title_fontsize=7)
  _save(fig, ax, path, title)


def grouped_bars(path, groups: Sequence[str], series: Mapping[str, Mapping[str, Sequence[float]]],
                 *, title: str = "", ylabel: str = "", paper: Optional[Mapping] = None,
                 interval: str = stats.INTERVAL_LABEL):
  """Grouped bars: per group one bar per series, the mean with its 95% t-interval.

  `series`: `{series_label: {group: [n] values}}` (per seed, or e.g. per question); `paper`:
  optional `{series_label: {group: value}}` drawn as black markers; `interval` names what the
  values are samples of, for the legend.
  """
  plt = _plt()
  fig, ax = plt.subplots(figsize=(max(6.4, 1.2 * len(groups) * max(1, len(series)) / 2), 4.2))
  width = 0.8 / max(1, len(series))
  xs = np.arange(len(groups))
  any_interval = False
  for i, (label, vals) in enumerate(series.items()):
    ivs = [stats.mean_interval(vals.get(g, [])) for g in groups]  # (mean, lo, hi, n)
    any_interval |= any(np.isfinite(lo) for _, lo, _, _ in ivs)
    means = np.array([m for m, _, _, _ in ivs])
    yerr = np.array([[m - lo, hi - m] if np.isfinite(lo) else [0.0, 0.0]
                     for m, lo, hi, _ in ivs]).T.reshape(2, -1)
    pos = xs - 0.4 + width * (i + 0.5)
    ax.bar(pos, means, width, yerr=yerr, capsize=3, label=label, color=f"C{i}")
    if paper and label in paper:
      pv = [paper[label].get(g, np.nan) for g in groups]
      ax.scatter(pos, pv, marker="_", s=200, color="k", zorder=3,
                 label="paper" if i == 0 else None)
  ax.set_xticks(xs, groups, fontsize=8, rotation=15)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3, axis="y")
  ax.legend(fontsize=8, title=f"error bars: {interval}" if any_interval else
            "one value per bar: no interval", title_fontsize=7)
  _save(fig, ax, path, title)


def paired_differences(path, diffs: Mapping[str, Mapping[str, Mapping]], *, title: str = "",
                       ylabel: str = "difference (points)", baseline: str = "baseline"):
  """Paired differences vs a baseline: one marker per (comparison, metric), 95% interval bars.

  `diffs`: `{comparison_label: {metric: d}}`, `d` a `PairedDifference` or its `to_json()` dict.
  """
  plt = _plt()
  labels = list(diffs)
  metrics = list(dict.fromkeys(m for per in diffs.values() for m in per))  # in first-seen order
  fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(labels) + 2), 4.2))
  xs = np.arange(len(labels))
  width = 0.6 / max(1, len(metrics))
  for j, metric in enumerate(metrics):
    pos, mean, err, open_ = [], [], [], []
    for i, lab in enumerate(labels):
      d = diffs[lab].get(metric)
      if d is None:
        continue
      g = d.get if isinstance(d, Mapping) else lambda k, _d=d: getattr(_d, k)
      m, lo, hi = (np.nan if g(k) is None else float(g(k)) for k in ("mean", "lo", "hi"))
      pos.append(xs[i] - 0.3 + width * (j + 0.5))
      mean.append(m)
      err.append([m - lo, hi - m] if np.isfinite(lo) and np.isfinite(hi) else [0.0, 0.0])
      open_.append(g("verdict") not in (stats.BETTER, stats.WORSE))
    if not pos:
      continue
    pos, mean, err, open_ = np.array(pos), np.array(mean), np.array(err).T, np.array(open_)
    ax.errorbar(pos, mean, yerr=err, fmt="none", ecolor=f"C{j}", capsize=4, lw=1.4)
    filled = (~open_).any()
    if filled:
      ax.scatter(pos[~open_], mean[~open_], color=f"C{j}", zorder=3, s=30, label=metric)
    if open_.any():
      ax.scatter(pos[open_], mean[open_], facecolors="white", edgecolors=f"C{j}", zorder=3, s=30,
                 label=None if filled else metric)
  ax.axhline(0.0, color="k", lw=1.0)
  ax.set_xticks(xs, [textwrap.fill(lab, 22) for lab in labels], fontsize=8)
  ax.set_ylabel(f"{ylabel}\nvs {baseline}")
  ax.grid(alpha=0.3, axis="y")
  ax.legend(fontsize=8, title=f"mean ± {stats.INTERVAL_LABEL}\n(open marker: tie)",
            title_fontsize=7)
  _save(fig, ax, path, title)


def heatmap(path, rows: Sequence[float], cols: Sequence[float], values: np.ndarray, *,
            title: str = "", row_label: str = "", col_label: str = "",
            marks: Optional[Sequence[Sequence[str]]] = None, marks_note: str = ""):
  """An annotated heat map of `values [len(rows), len(cols)]` (e.g. Recall@5 over P x R).

  `marks`: optional `[len(rows)][len(cols)]` strings under each value, explained by `marks_note`.
  """
  plt = _plt()
  fig, ax = plt.subplots(figsize=(5.2, 4.2))
  im = ax.imshow(values, cmap="viridis", origin="lower")
  ax.set_xticks(range(len(cols)), [f"{c:g}" for c in cols])
  ax.set_yticks(range(len(rows)), [f"{r:g}" for r in rows])
  ax.set_xlabel(col_label)
  ax.set_ylabel(row_label)
  for i in range(len(rows)):
    for j in range(len(cols)):
      text = f"{values[i, j]:.1f}"
      if marks is not None and marks[i][j]:
        text += f"\n{marks[i][j]}"
      bright = np.isfinite(values[i, j]) and im.norm(values[i, j]) > 0.6
      ax.text(j, i, text, ha="center", va="center", color="k" if bright else "w", fontsize=8)
  fig.colorbar(im, ax=ax)
  if marks_note:
    fig.text(0.01, 0.01, marks_note, fontsize=7, ha="left", va="bottom")
  _save(fig, ax, path, title)


def per_seed_scatter(path, series: Mapping[str, tuple], *, xlabel: str, ylabel: str,
                     title: str = ""):
  """One point per seed and series (`{name: (x values, y values)}`) with the diagonal y = x."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(4.6, 4.2))
  lo, hi = np.inf, -np.inf
  for name, (xs, ys) in series.items():
    xs, ys = _floats(xs), _floats(ys)
    ax.scatter(xs, ys, s=22, label=name, alpha=0.8)
    lo, hi = min(lo, np.nanmin(xs), np.nanmin(ys)), max(hi, np.nanmax(xs), np.nanmax(ys))
  pad = 0.05 * (hi - lo + 1e-9)
  ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="gray", lw=1, ls="--")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=8)
  _save(fig, ax, path, title)


def _floats(values) -> np.ndarray:
  """Values as float64 with None -> NaN."""
  return np.asarray([np.nan if v is None else v for v in np.ravel(np.asarray(values, object))],
                    np.float64)


def _save(fig, ax, path, title):
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  _plt().close(fig)
