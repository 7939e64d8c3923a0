"""Tests of ear_jax/experiment/plots.py: the legend says what the error bars are (the QA plot
must not claim '95 % t-interval over seeds' for bars of one value each)."""
import numpy as np
import pytest

from ear_jax.experiment import plots
from ear_jax.experiment import stats
from ear_jax.experiment.suites import paper


@pytest.fixture
def legend_titles(monkeypatch):
  titles = []
  real_save = plots._save  # pylint: disable=protected-access

  def save(fig, *args):
    titles.append(fig.axes[0].get_legend().get_title().get_text())
    real_save(fig, *args)

  monkeypatch.setattr(plots, "_save", save)
  return titles


def test_bars_of_one_value_claim_no_interval(tmp_path, legend_titles):
  plots.grouped_bars(tmp_path / "one.png", ["F1", "J"], {"A": {"F1": [40.0], "J": [50.0]},
                                                        "B": {"F1": [42.0], "J": [55.0]}})
  assert legend_titles == ["one value per bar: no interval"]
  assert (tmp_path / "one.png").read_bytes()[:4] == b"\x89PNG"


def test_bars_say_what_their_interval_is_over(tmp_path, legend_titles):
  seeds = {"A": {"R@5": [40.0, 41.0, 43.0]}}
  plots.grouped_bars(tmp_path / "seeds.png", ["R@5"], seeds)
  questions = {"A": {"F1": list(np.linspace(0, 100, 15))}}
  plots.grouped_bars(tmp_path / "q.png", ["F1"], questions,
                     interval="95% t-interval over questions")
  assert legend_titles == [f"error bars: {stats.INTERVAL_LABEL}",
                           "error bars: 95% t-interval over questions"]
  assert "seeds" in stats.INTERVAL_LABEL


def test_tables_with_mean_std_cells_say_what_the_cells_are():
  table = paper.md_table(["method", "R@5"], [["ear", "41.17 ± 2.03"]])
  noted = paper.with_cell_note(table)
  assert noted.startswith(table) and "standard deviation over the seeds" in noted
  assert paper.with_cell_note("| a |\n|---|\n| 1.00 |") == "| a |\n|---|\n| 1.00 |"
