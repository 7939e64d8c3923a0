"""Paging as the test-time baseline in the tables: every run summary carries the paging means, and
every explorer-assisted row of the main, ablation, beyond and first-stage tables gets its two paging
neighbours right below it, paired per seed with it.

Fast: the suites run on hand-made run summaries (a fake `Runner`, plots switched off); the real
runs are covered by the suites' own slow tests.
"""
import types

import numpy as np
import pytest

from ear_jax.data import first_stage as first_stage_lib
from ear_jax.experiment import plots
from ear_jax.experiment import runner
from ear_jax.experiment import stats
from ear_jax.experiment import summaries
from ear_jax.experiment.suites import beyond
from ear_jax.experiment.suites import first_stage
from ear_jax.experiment.suites import main_ablation
from ear_jax.experiment.suites import pairing
from ear_jax.experiment.suites.paper import fmt

SEEDS = [0, 1, 2]
MODES = ("adapter", "explorer", "paging_first_stage", "paging_adapted")


def fake_summary(name: str, offset: float, rounds: int = 4) -> dict:
  """A run summary whose metric `<recall|hitrate>_<mode>` per seed is distinct per run and mode."""
  metrics = {}
  for j, mode in enumerate(MODES):
    for k, metric in enumerate(("recall", "hitrate")):
      metrics[f"{metric}_{mode}"] = summaries.mean_std(
          [offset + 3.0 * j + 10.0 * k + 0.7 * i * (j + 1) for i in range(len(SEEDS))])
  ceil = summaries.mean_std([50.0, 51.0, 52.0])
  return {"run": name, "seeds": SEEDS, "num_test": 10, "num_train": 40,
          "config": {"num_rounds": rounds, "slate_size": 5}, "metrics": metrics,
          "ceiling": {"recall@K": ceil, "recall@5": ceil, "hitrate@K": ceil},
          "critic_calls": summaries.mean_std([160, 160, 160])}


class FakeRunner:
  """What the suites read of a `Runner`: runs by method, the paired records, options."""

  def __init__(self, runs: dict, benchmark: str = "synthetic"):
    self.runs, self.paired, self.seeds = runs, {}, SEEDS
    self.opts = types.SimpleNamespace(benchmark=benchmark, k=20)

  def run(self, method, **unused):
    del unused
    return self.runs[method]

  def paper_key(self):
    return None

  def bench(self):
    return types.SimpleNamespace(stats={"encoding": {"encoder": "fake"}})

  def plot_path(self, name):
    return name


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
  for name in ("grouped_bars", "paired_differences"):
    monkeypatch.setattr(plots, name, lambda *a, **k: None)


def table(md: str) -> list:
  """The rows (lists of cells) of the first markdown table in `md`, header first."""
  lines = [l for l in md.splitlines() if l.startswith("|")]
  end = next((i for i in range(1, len(lines)) if lines[i].startswith("|---")
              and i > 1), len(lines))
  return [[c.strip() for c in l.strip().strip("|").split("|")] for l in lines[:end]
          if not l.startswith("|---")]


def delta(s: dict, mode: str, b: dict, base_mode: str, metric: str = "recall") -> str:
  return stats.format_difference(stats.paired_difference(
      s["metrics"][f"{metric}_{mode}"]["per_seed"],
      b["metrics"][f"{metric}_{base_mode}"]["per_seed"]))


def paging_labels(rounds: int = 4) -> list:
  return [f"paging over the first stage ({rounds} pages of 5)",
          f"paging over the adapted ranking ({rounds} pages of 5)"]


def test_summarize_appends_the_paging_means_after_the_papers_metrics():
  m = runner.build_method("ear", dim=4, num_candidates=6)
  rng = np.random.default_rng(0)
  ev = {}
  for field in ("adapter", "explorer", "paging_first_stage", "paging_adapted"):
    all_gold = rng.random((2, 8)) < 0.5
    ev[f"{field}_all_gold"] = all_gold
    ev[f"{field}_any_gold"] = all_gold | (rng.random((2, 8)) < 0.3)
  for name in runner.METRIC_NAMES + summaries.PAGING_METRIC_NAMES:
    metric, mode = name.split("_", 1)
    ev[name] = ev[f"{mode}_{'all' if metric == 'recall' else 'any'}_gold"].mean(-1)
  stream = types.SimpleNamespace(num_gold=np.ones(20, np.int32), gold=np.zeros((20, 6), bool))
  result = runner.RunResult(
      name="ear", config=m.config, hparams=m.hparams, seeds=[0, 1],
      train_index=np.zeros((2, 4), np.int64), test_index=np.arange(16).reshape(2, 8), eval=ev,
      curve=[], train_log={}, final_state=None, critic_calls=np.array([4, 4]), wall_seconds=1.0)
  out = summaries.summarize(result, stream, categories=np.array(["a", "b"] * 10))
  assert list(out["metrics"]) == list(runner.METRIC_NAMES + summaries.PAGING_METRIC_NAMES)
  for name in summaries.PAGING_METRIC_NAMES:
    np.testing.assert_allclose(out["metrics"][name]["per_seed"], 100 * ev[name], atol=1e-4)
  # Per category (test queries 0, 2, .. are 'a'): the paging fields follow the paper's four.
  entry = out["per_category"]["a"]
  assert list(entry)[:5] == ["n", "recall_adapter", "hitrate_adapter", "recall_explorer",
                             "hitrate_explorer"]
  np.testing.assert_allclose(entry["recall_paging_adapted"]["per_seed"],
                             100 * ev["paging_adapted_all_gold"][:, ::2].mean(-1), atol=1e-4)


def test_paging_rows_pair_each_paging_mode_with_the_same_runs_explorer():
  s = fake_summary("ear", 40.0, rounds=3)
  r = FakeRunner({})
  rows = pairing.paging_rows(r, "main", "EAR (ours)", s)
  assert [label for _, label, _ in rows] == paging_labels(3)
  recs = r.paired["main"]
  assert [(x["treatment"]["mode"], x["baseline"]["mode"]) for x in recs] == [
      ("paging_first_stage", "explorer"), ("paging_adapted", "explorer")]
  assert all(x["primary"] and x["metric"] == "R@5" and x["baseline"]["label"] == "EAR (ours)"
             for x in recs)
  for (mode, _, d), rec in zip(rows, recs):
    assert d["mean"] == pytest.approx(np.mean(np.subtract(
        s["metrics"][f"recall_{mode}"]["per_seed"], s["metrics"]["recall_explorer"]["per_seed"])))
    assert rec["mean"] == d["mean"]


def test_insert_rows_puts_each_addition_right_below_its_row():
  assert pairing.insert_rows(["a", "b", "c"], [(0, ["a1"]), (2, ["c1", "c2"])]) == [
      "a", "a1", "b", "c", "c1", "c2"]


def test_main_table_has_the_paging_rows_right_below_ear_and_its_paper_rows_as_before():
  runs = {"retriever": fake_summary("retriever", 30.0), "rl_update": fake_summary("rl", 25.0),
          "ear": fake_summary("ear", 41.0)}
  r = FakeRunner(runs)
  rows = table(main_ablation.suite_main(r))
  assert rows[0][-1] == pairing.PAGING_DELTA_HEADER and len(rows[0]) == 11
  assert [row[0] for row in rows[1:]] == (["Only Retriever", "Reranker + RL update", "EAR (ours)"]
                                          + paging_labels())
  ear = rows[3]
  assert ear[1] == "explorer" and ear[3] == fmt(runs["ear"]["metrics"]["recall_explorer"])
  assert ear[8] == delta(runs["ear"], "explorer", runs["retriever"], "adapter")
  assert [row[-1] for row in rows[1:4]] == ["–", "–", "(reference)"]
  for row, mode in zip(rows[4:], ("paging_first_stage", "paging_adapted")):
    assert row[3] == fmt(runs["ear"]["metrics"][f"recall_{mode}"])
    assert row[5] == fmt(runs["ear"]["metrics"][f"hitrate_{mode}"])
    assert row[8] == delta(runs["ear"], mode, runs["retriever"], "adapter")
    assert row[-1] == delta(runs["ear"], mode, runs["ear"], "explorer")
  # The paper's comparisons keep their records' positions; the paging ones come after them.
  recs = [(x["treatment"]["label"], x["treatment"]["mode"], x["baseline"]["label"], x["metric"])
          for x in r.paired["main"]]
  assert recs[:6] == [("Reranker + RL update", "adapter", "Only Retriever", "R@5"),
                      ("Reranker + RL update", "adapter", "Only Retriever", "Hit@5"),
                      ("EAR (ours)", "explorer", "Only Retriever", "R@5"),
                      ("EAR (ours)", "explorer", "Only Retriever", "Hit@5"),
                      ("EAR (ours)", "explorer", "Reranker + RL update", "R@5"),
                      ("EAR (ours)", "explorer", "Reranker + RL update", "Hit@5")]
  assert all(mode.startswith("paging") for _, mode, _, _ in recs[6:]) and len(recs) == 6 + 6


def test_ablation_table_gives_both_explorer_rows_their_paging_neighbours():
  methods = ("retriever", "rl_update", "ear_no_replay", "ear_no_explorer", "ear")
  runs = {m: fake_summary(m, 20.0 + 4 * i) for i, m in enumerate(methods)}
  r = FakeRunner(runs)
  rows = table(main_ablation.suite_ablation(r))[1:]
  assert [row[0] for row in rows[4:]] == (["Only Explorer at test time"] + paging_labels()
                                          + ["EAR (ours)"] + paging_labels())
  for start, method in ((4, "retriever"), (7, "ear")):
    assert rows[start][-1] == "(reference)"
    for row, mode in zip(rows[start + 1:start + 3], ("paging_first_stage", "paging_adapted")):
      assert row[1] == "paging" and row[4] == fmt(runs[method]["metrics"][f"recall_{mode}"])
      assert row[-1] == delta(runs[method], mode, runs[method], "explorer")
  assert [row[-1] for row in rows[:4]] == ["–"] * 4


def test_beyond_table_gives_both_ear_variants_their_paging_neighbours():
  runs = {"retriever": fake_summary("retriever", 30.0), "ear": fake_summary("ear", 40.0),
          "ear_tuned": fake_summary("ear_tuned", 45.0)}
  r = FakeRunner(runs, benchmark="locomo")
  rows = table(beyond.suite_beyond(r))[1:]
  assert [row[1] for row in rows] == (
      ["frozen top-5", "adapter only", "explorer-assisted, T = 4"] + paging_labels()
      + ["adapter only", "explorer-assisted, T = 4"] + paging_labels())
  for start, method in ((2, "ear"), (6, "ear_tuned")):
    assert rows[start][-1] == "(reference)"
    for row, mode in zip(rows[start + 1:start + 3], ("paging_first_stage", "paging_adapted")):
      assert row[0] == rows[start][0] and row[2] == fmt(runs[method]["metrics"][f"recall_{mode}"])
      assert row[-1] == delta(runs[method], mode, runs[method], "explorer")
  assert rows[7][4] == delta(runs["ear_tuned"], "paging_first_stage", runs["ear"],
                             "paging_first_stage")


def test_first_stage_table_gives_every_explorer_row_its_paging_neighbours(monkeypatch):
  subs = {g: FakeRunner({m: fake_summary(f"{m}_{g}", 30.0 + 5 * i + 2 * j)
                         for j, m in enumerate(("retriever", "ear", "ear_tuned"))})
          for i, g in enumerate(first_stage.GENERATORS_SHOWN)}
  monkeypatch.setattr(first_stage, "sub_runner", lambda r, g, **o: subs[g])
  r = FakeRunner({}, benchmark="locomo")
  r.opts.first_stage_options = first_stage_lib.FirstStageOptions
  rows = table(first_stage.suite_first_stage(r))[1:]
  per_generator = ["top-5", "adapter only", "explorer-assisted, T = 4"] + paging_labels() + [
      "adapter only", "explorer-assisted, T = 4"] + paging_labels()
  assert [row[2] for row in rows] == per_generator * 3
  for i, row in enumerate(rows):
    if row[2].startswith("paging"):
      explorer = rows[i - 1] if "first stage" in row[2] else rows[i - 2]
      run = subs[row[0]].runs[row[1]]
      mode = "paging_first_stage" if "first stage" in row[2] else "paging_adapted"
      assert explorer[2] == "explorer-assisted, T = 4" and explorer[-1] == "(reference)"
      assert row[-1] == delta(run, mode, run, "explorer")
      assert row[4] == delta(run, mode, subs[row[0]].runs["retriever"], "adapter")
  assert len([x for x in r.paired["first_stage"] if x["primary"]
              and x["treatment"]["mode"].startswith("paging")]) == 12


def test_paging_note_says_when_the_pages_cover_every_candidate():
  assert pairing.paging_note(fake_summary("ear", 40.0, rounds=4), k=20).endswith(
      "in the ranking's order among the answer's memories.")
  assert "every candidate" not in pairing.paging_note(fake_summary("ear", 40.0, rounds=3), k=20)
