"""PNG plots of EAR experiments (matplotlib, Agg backend): mean ± std over seeds.

Learning curves (Figs. 3-5) take the `curve` lists of `experiment.summarize` (one point per
evaluation, each metric `[S]`); bar charts take `{label: [S] values}`.
"""
from __future__ import annotations

import pathlib
from typing import Mapping, Optional, Sequence

import numpy as np


def _plt():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def learning_curves(path, curves: Mapping[str, list], *, metric: str = "recall_adapter",
                    x: str = "queries_seen", title: str = "", xlabel: Optional[str] = None,
                    hlines: Optional[Mapping[str, float]] = None, ylabel: str = "Recall@5 (%)"):
  """One line per run: mean over seeds of `metric` against mean `x`, with a ± std band.

  Args:
    path: output PNG path.
    curves: `{label: curve}`; a curve is a list of points `{x: [S], metric: [S], ...}`.
    metric: which metric (percent).
    x: 'queries_seen' or 'critic_calls'.
    title: plot title.
    xlabel: axis label (default from `x`).
    hlines: `{label: value}` horizontal reference lines (e.g. the frozen retriever).
    ylabel: axis label.
  """
  plt = _plt()
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for label, curve in curves.items():
    if not curve:
      continue
    xs = np.array([np.mean(p[x]) for p in curve])
    ys = np.stack([_floats(p[metric]) for p in curve])  # [P, S]
    mean, std = np.nanmean(ys, 1), np.nanstd(ys, 1)
    line, = ax.plot(xs, mean, label=label, marker="o", ms=2.5, lw=1.4)
    ax.fill_between(xs, mean - std, mean + std, color=line.get_color(), alpha=0.2, lw=0)
  for i, (label, value) in enumerate((hlines or {}).items()):
    ax.axhline(value, ls="--", lw=1.0, color=f"C{7 + i}", label=label)
  ax.set_xlabel(xlabel or {"queries_seen": "training queries seen",
                           "critic_calls": "critic (LLM) calls"}.get(x, x))
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  _save(fig, path)


def grouped_bars(path, groups: Sequence[str], series: Mapping[str, Mapping[str, Sequence[float]]],
                 *, title: str = "", ylabel: str = "", paper: Optional[Mapping] = None):
  """Grouped bars: for every group, one bar per series, height mean over seeds, error bar std.

  Args:
    path: output PNG path.
    groups: x-axis groups (e.g. question categories).
    series: `{series_label: {group: [S] values}}`.
    title, ylabel: labels.
    paper: optional `{series_label: {group: value}}` drawn as black markers (the paper's numbers).
  """
  plt = _plt()
  fig, ax = plt.subplots(figsize=(max(6.4, 1.2 * len(groups) * max(1, len(series)) / 2), 4.2))
  width = 0.8 / max(1, len(series))
  xs = np.arange(len(groups))
  for i, (label, vals) in enumerate(series.items()):
    arrs = [_floats(vals.get(g, [])) for g in groups]
    means = [np.nanmean(a) if np.isfinite(a).any() else np.nan for a in arrs]
    stds = [np.nanstd(a) if np.isfinite(a).any() else 0.0 for a in arrs]
    pos = xs - 0.4 + width * (i + 0.5)
    ax.bar(pos, means, width, yerr=stds, capsize=3, label=label, color=f"C{i}")
    if paper and label in paper:
      pv = [paper[label].get(g, np.nan) for g in groups]
      ax.scatter(pos, pv, marker="_", s=200, color="k", zorder=3,
                 label="paper" if i == 0 else None)
  ax.set_xticks(xs)
  ax.set_xticklabels(groups, fontsize=8, rotation=15)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3, axis="y")
  ax.legend(fontsize=8)
  fig.tight_layout()
  _save(fig, path)


def heatmap(path, rows: Sequence[float], cols: Sequence[float], values: np.ndarray, *,
            title: str = "", row_label: str = "", col_label: str = ""):
  """A annotated heat map of `values [len(rows), len(cols)]` (e.g. Recall@5 over P x R)."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(5.2, 4.2))
  im = ax.imshow(values, cmap="viridis", origin="lower")
  ax.set_xticks(range(len(cols)))
  ax.set_xticklabels([f"{c:g}" for c in cols])
  ax.set_yticks(range(len(rows)))
  ax.set_yticklabels([f"{r:g}" for r in rows])
  ax.set_xlabel(col_label)
  ax.set_ylabel(row_label)
  for i in range(len(rows)):
    for j in range(len(cols)):
      ax.text(j, i, f"{values[i, j]:.1f}", ha="center", va="center", color="w", fontsize=8)
  fig.colorbar(im, ax=ax)
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  _save(fig, path)


def _floats(values) -> np.ndarray:
  """Values as float64 with None -> NaN."""
  return np.asarray([np.nan if v is None else v for v in np.ravel(np.asarray(values, object))],
                    np.float64)


def _save(fig, path):
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  _plt().close(fig)


__all__ = ["grouped_bars", "heatmap", "learning_curves"]
