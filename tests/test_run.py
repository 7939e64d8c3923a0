"""Tests of experiments/run.py and ear_jax/experiment/suites: a method run whose table is checked
against an independent frozen top-5 computation (fast), every suite end to end on the synthetic
benchmark, `main` on a LoCoMo slice with the real encoder, kill-and-resume, and flag errors
(slow)."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from ear_jax.experiment import runner, summaries, suites

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA_DIR = pathlib.Path(os.environ.get("EAR_DATA_DIR", REPO.parent / "shared" / "data"))

TINY = dict(benchmark="synthetic", seeds=2, synthetic_queries=60, synthetic_dim=16, eval_every=16,
            checkpoint_every=16, progress=False, noise_levels=(0.7, 1.0),
            config_overrides={"buffer_capacity": 64})


def frozen_top5_metrics(stream, test_index):
  """Recall@5 / Hitrate@5 (percent, per seed) of the frozen cosine top-5, computed from the raw
  embeddings: the Only Retriever row must equal it (the identity adapter ranks by cosine)."""
  unit = lambda x: x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
  q, c = unit(np.asarray(stream.queries, np.float64)), unit(np.asarray(stream.candidates, np.float64))
  mask, gold = np.asarray(stream.mask), np.asarray(stream.gold)
  num_gold = np.asarray(stream.num_gold)
  recall, hit = [], []
  for idx in np.asarray(test_index):
    cos = np.where(mask[idx], np.einsum("mkd,md->mk", c[idx], q[idx]), -np.inf)
    top5 = np.argsort(-cos, axis=1, kind="stable")[:, :5]
    top5_valid = np.take_along_axis(mask[idx], top5, 1)
    hits = (np.take_along_axis(gold[idx], top5, 1) & top5_valid).sum(1)
    ng = num_gold[idx]
    has = ng > 0
    recall.append(100 * np.mean((hits >= ng)[has]))
    hit.append(100 * np.mean((hits > 0)[has]))
  return np.array(recall), np.array(hit)


def table_rows(md):
  """`{first cell: [cells]}` of every markdown table row (header and rule rows included)."""
  rows = {}
  for line in md.splitlines():
    if line.startswith("|"):
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      rows[cells[0]] = cells
  return rows


def mean_pm_std(cell):
  mean, std = cell.split("±")
  return float(mean), float(std)


def check_cell(cell, per_seed):
  """A `mean ± std` table cell agrees with the per-seed values (population std, 2 decimals)."""
  mean, std = mean_pm_std(cell)
  assert abs(mean - np.mean(per_seed)) <= 0.0051, (cell, per_seed)
  assert abs(std - np.std(per_seed)) <= 0.0051, (cell, per_seed)


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
def test_retriever_method_table_matches_an_independent_frozen_top5(tmp_path):
  res = suites.run(suites.Options(**dict(TINY, workdir=str(tmp_path / "wd"), suite=None,
                                         method="retriever", checkpoint_every=None)))
  (name, run), = res["runs"].items()
  assert run["method"] == "retriever"
  on_disk = json.loads((tmp_path / "wd" / "results.json").read_text())
  assert on_disk["runs"][name]["metrics"] == run["metrics"]
  test_index = np.load(tmp_path / "wd" / "runs" / name / "test_eval.npz")["test_index"]
  assert test_index.shape == (2, run["num_test"])
  bench = suites.Runner(suites.Options(**dict(TINY, workdir=str(tmp_path / "b")))).bench()
  recall, hit = frozen_top5_metrics(bench.stream, test_index)
  assert not np.array_equal(np.sort(test_index[0]), np.sort(test_index[1]))  # per-seed splits
  np.testing.assert_allclose(run["metrics"]["recall_adapter"]["per_seed"], recall, atol=1e-3)
  np.testing.assert_allclose(run["metrics"]["hitrate_adapter"]["per_seed"], hit, atol=1e-3)
  # The printed table: method, R@5 / Hit@5 adapter, R@5 / Hit@5 explorer, Recall@K ceiling.
  row = table_rows((tmp_path / "wd" / "tables.md").read_text())["retriever"]
  check_cell(row[1], recall)
  check_cell(row[2], hit)
  check_cell(row[3], run["metrics"]["recall_explorer"]["per_seed"])
  # The ceiling bounds every reranker of the K candidates, and the explorer is one.
  ceiling = np.array(run["ceiling"]["recall@K"]["per_seed"])
  assert np.all(recall <= ceiling + 1e-3)
  assert np.all(np.array(run["metrics"]["recall_explorer"]["per_seed"]) <= ceiling + 1e-3)


def _check_every_suite_writes_its_table_and_plots(results, wd):
  for suite in suites.ALL_ORDER:
    table = (wd / f"table_{suite}.md").read_text()
    assert "|---" in table and "±" in table, suite
    expected_plots = {"main": ["table2_main"], "ablation": ["table3_ablation"],
                      "hparams": ["table6_T_B", "table7_strategy"],
                      "curves": ["fig3_sample_efficiency", "fig4_critic_budget"],
                      "noise": ["fig5_noise_grid", "fig5_noise_curves"],
                      "multistore": ["fig6_observations_in_top5", "table5_store_recall"]}[suite]
    for name in expected_plots:
      png = wd / "plots" / f"synthetic_{name}.png"
      assert png.read_bytes()[:4] == b"\x89PNG", name
    assert suite in results["suite_wall_seconds"]


def _check_main_suite_table_matches_results_json_and_the_frozen_top5(results, wd):
  runs = results["runs"]
  rows = table_rows((wd / "table_main.md").read_text())
  names = {"Only Retriever": ("retriever", "adapter"), "Reranker + RL update": ("rl_update", "adapter"),
           "EAR (ours)": ("ear", "explorer")}
  for label, (name, mode) in names.items():
    other = "explorer" if mode == "adapter" else "adapter"
    row = rows[label]
    assert row[1] == mode and row[2] == row[4] == "–"  # no paper numbers for synthetic data
    for col, metric in ((3, f"recall_{mode}"), (5, f"hitrate_{mode}"), (6, f"recall_{other}"),
                        (7, f"hitrate_{other}")):
      check_cell(row[col], runs[name]["metrics"][metric]["per_seed"])
  test_index = np.load(wd / "runs" / "retriever" / "test_eval.npz")["test_index"]
  bench = suites.Runner(suites.Options(**dict(TINY, workdir=str(wd / "bench")))).bench()
  recall, _ = frozen_top5_metrics(bench.stream, test_index)
  np.testing.assert_allclose(runs["retriever"]["metrics"]["recall_adapter"]["per_seed"], recall,
                             atol=1e-3)


def _check_a_method_alone_gives_the_same_numbers_per_seed_as_inside_the_all_suite(results, wd,
                                                                                   tmp_path):
  """A method's numbers depend on the method, seeds, data and settings only, not on the suite
  that ran it nor on how training was cut into segments (the all-suite run checkpoints every 16
  queries and evaluates curves; the lone run does neither)."""
  from ear_jax.io import run_checkpoints  # pylint: disable=g-import-not-at-top
  alone = suites.run(suites.Options(**dict(TINY, workdir=str(tmp_path), suite=None, method="ear",
                                           checkpoint_every=None, eval_every=48)))
  (name, lone), = alone["runs"].items()
  curves_run = [r for n, r in results["runs"].items() if n.startswith("ear_eval=")]
  assert curves_run  # the curves suite's EAR run (evaluated every few queries)
  for inside in [results["runs"]["ear"]] + curves_run:
    assert inside["seeds"] == lone["seeds"] == [0, 1]
    for metric, values in lone["metrics"].items():
      assert inside["metrics"][metric]["per_seed"] == values["per_seed"], metric
    np.testing.assert_array_equal(inside["critic_calls"]["per_seed"],
                                  lone["critic_calls"]["per_seed"])
  a, _, _ = run_checkpoints.restore_adapter(wd, run="ear", seed_index=None)
  b, _, _ = run_checkpoints.restore_adapter(tmp_path, run=name, seed_index=None)
  np.testing.assert_array_equal(np.asarray(a.w_q), np.asarray(b.w_q))
  np.testing.assert_array_equal(np.asarray(a.w_m), np.asarray(b.w_m))


def _check_results_json_has_every_field(res, wd):
  for key in ("versions", "options", "runs", "tables", "plots", "wall_seconds", "dataset"):
    assert key in res
  assert {"jax", "flax", "optax", "ear_jax", "python"} <= set(res["versions"])
  run = res["runs"]["ear"]
  for m in ("recall_adapter", "hitrate_adapter", "recall_explorer", "hitrate_explorer"):
    assert len(run["metrics"][m]["per_seed"]) == 2
  assert "recall@K" in run["ceiling"] and run["per_category"] and run["wall_seconds"] >= 0
  log = np.load(wd / "runs" / "ear" / "train_log.npz")
  assert log["loss"].shape == (2, 48)
  # Curves: RL update for T epochs spends as many critic calls as EAR.
  curves = res["runs"]
  budget = [r for n, r in curves.items() if n.startswith("rl_update_budget")][0]
  assert budget["critic_calls"]["mean"] == curves["ear"]["critic_calls"]["mean"]


@pytest.mark.slow
def test_suite_all_on_synthetic_writes_every_table_plot_and_field(tmp_path):
  """`--suite=all` on the tiny benchmark, run once and checked four ways (one test, so one
  pytest-xdist worker builds it while the other runs other tests)."""
  wd = tmp_path / "all_suites"
  suites.run(suites.Options(workdir=str(wd), suite="all", **TINY))
  results = json.loads((wd / "results.json").read_text())
  _check_every_suite_writes_its_table_and_plots(results, wd)
  _check_main_suite_table_matches_results_json_and_the_frozen_top5(results, wd)
  _check_a_method_alone_gives_the_same_numbers_per_seed_as_inside_the_all_suite(
      results, wd, tmp_path / "alone")
  _check_results_json_has_every_field(results, wd)


@pytest.mark.slow
def test_suite_resumed_after_a_kill_matches_the_uninterrupted_run(tmp_path):
  from ear_jax.io import run_checkpoints
  from ear_jax.experiment import runner as experiment
  full_wd = tmp_path / "full"
  full = suites.run(suites.Options(**dict(TINY, workdir=str(full_wd), suite=None, method="ear")))
  tmp_path = tmp_path / "killed"
  opts = dict(TINY, workdir=str(tmp_path), suite=None, method="ear")
  with pytest.raises(experiment.Interrupted):
    suites.run(suites.Options(stop_after_chunks=1, **opts))
  with pytest.raises(ValueError, match="--resume"):  # a fresh run never overwrites checkpoints
    suites.run(suites.Options(**opts))
  resumed = suites.run(suites.Options(resume=True, **opts))
  name = [n for n in resumed["runs"]][0]
  assert resumed["runs"][name]["resumed_from"] == 16
  p1, _, _ = run_checkpoints.restore_adapter(tmp_path, seed_index=None)
  ref = full["runs"][name]
  assert resumed["runs"][name]["metrics"] == ref["metrics"]
  assert resumed["runs"][name]["curve"] == ref["curve"]
  p2, _, _ = run_checkpoints.restore_adapter(full_wd, run="ear_eval=16", seed_index=None)
  np.testing.assert_array_equal(np.asarray(p1.w_q), np.asarray(p2.w_q))


def _dir_bytes(path):
  return sum(p.stat().st_size for p in pathlib.Path(path).rglob("*") if p.is_file())


@pytest.mark.slow
def test_a_default_run_writes_no_training_checkpoints_only_its_small_final_adapter(tmp_path):
  """Training checkpoints only when asked for; the final adapter is always kept (small: the
  adapter alone), restorable, and equal to the last training checkpoint's adapter of the same
  run made with --checkpoint_every (same numbers too: checkpoints change nothing)."""
  from ear_jax.io import run_checkpoints
  opts = {k: v for k, v in TINY.items() if k != "checkpoint_every"}
  plain = suites.run(suites.Options(**dict(opts, workdir=str(tmp_path / "plain"), suite=None,
                                           method="ear")))
  name = "ear_eval=16"
  assert not (tmp_path / "plain" / "checkpoints").exists()
  adapter_dir = tmp_path / "plain" / "runs" / name / "adapter"
  params, _, meta = run_checkpoints.restore_adapter(tmp_path / "plain", seed_index=None)
  assert meta["format"] == run_checkpoints.ADAPTER_FORMAT and meta["position"] == 48
  raw = sum(np.asarray(x).nbytes for x in jax_leaves(params))
  assert raw == 2 * 2 * 16 * 16 * 4  # w_q, w_m: [S=2, 16, 16] float32
  assert _dir_bytes(adapter_dir) < raw + 64_000, _dir_bytes(adapter_dir)  # Orbax files + JSON
  ckpt = suites.run(suites.Options(**dict(opts, workdir=str(tmp_path / "ckpt"), suite=None,
                                          method="ear", checkpoint_every=16)))
  assert ckpt["runs"][name]["metrics"] == plain["runs"][name]["metrics"]
  from_ckpt, _, _ = run_checkpoints.restore_adapter(tmp_path / "ckpt", run=name, seed_index=None,
                                                  position=48)
  for a, b in zip(jax_leaves(params), jax_leaves(from_ckpt)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The training checkpoint is the whole learner state (optimizer, Experience Buffer): larger.
  assert _dir_bytes(tmp_path / "ckpt" / "checkpoints" / name) > 3 * _dir_bytes(adapter_dir)


def jax_leaves(tree):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.tree_util.tree_leaves(tree)


def _cli(*args, env=None):
  return subprocess.Popen([sys.executable, "-m", "experiments.run", *args], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


@pytest.mark.slow
def test_bad_flags_fail_fast_naming_the_flag(tmp_path):
  flagfile = tmp_path / "f.flags"
  flagfile.write_text("--benchmark=synthetic\n--seeds=0\n")
  cases = {
      "--seeds": [f"--flagfile={flagfile}"],
      "--suite": ["--benchmark=synthetic", "--suite=tables"],
      "--method": ["--benchmark=synthetic", "--method=bm25"],
      "--benchmark": ["--benchmark=msmarco"],
      "--data_dir": ["--benchmark=locomo", f"--data_dir={tmp_path / 'nowhere'}"],
      "--eval_every": ["--benchmark=synthetic", "--eval_every=6"],
  }
  procs = {flag: _cli(*args, f"--workdir={tmp_path / 'wd'}") for flag, args in cases.items()}
  for flag, p in procs.items():
    out, _ = p.communicate(timeout=120)
    assert p.returncode != 0, out
    assert flag in out, (flag, out[-2000:])
    assert "Traceback" not in out or flag == "--benchmark", out[-2000:]
  assert not (tmp_path / "wd").exists()  # failed before any work


@pytest.mark.slow
@pytest.mark.skipif(not (DATA_DIR / "locomo10.json").is_file(), reason="LoCoMo file not present")
def test_main_on_a_locomo_slice_with_the_real_encoder(tmp_path):
  try:
    from ear_jax.data import encoders
    encoders.load_encoder("minilm")
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f"MiniLM encoder unavailable: {e}")
  res = suites.run(suites.Options(benchmark="locomo", data_dir=str(DATA_DIR), limit=1, seeds=2,
                                  suite="main", workdir=str(tmp_path), checkpoint_every=None,
                                  progress=False))
  on_disk = json.loads((tmp_path / "results.json").read_text())
  assert on_disk["dataset"]["conversations"] == 1
  assert on_disk["dataset"]["encoding"]["dim"] == 384
  for m in ("retriever", "rl_update", "ear"):
    run = on_disk["runs"][m]
    assert run["metrics"] == res["runs"][m]["metrics"]
    assert list(run["metrics"]) == list(runner.METRIC_NAMES + summaries.PAGING_METRIC_NAMES)
    assert run["per_category"] and run["ceiling"]["recall@K"]["mean"] > 0
  # Every measured cell of the table is the mean ± std of the per-seed values in results.json.
  rows = table_rows(res["tables"]["main"])
  runs = on_disk["runs"]
  for label, (name, mode) in {"Only Retriever": ("retriever", "adapter"),
                              "Reranker + RL update": ("rl_update", "adapter"),
                              "EAR (ours)": ("ear", "explorer")}.items():
    row = rows[label]
    check_cell(row[3], runs[name]["metrics"][f"recall_{mode}"]["per_seed"])
    check_cell(row[5], runs[name]["metrics"][f"hitrate_{mode}"]["per_seed"])
  # The Only Retriever row is the frozen MiniLM cosine top-5, recomputed from the embeddings.
  from ear_jax.data import candidates
  bench = candidates.load_benchmark("locomo", data_dir=str(DATA_DIR), limit=1, progress=False)
  test_index = np.load(tmp_path / "runs" / "retriever" / "test_eval.npz")["test_index"]
  recall, hit = frozen_top5_metrics(bench.stream, test_index)
  np.testing.assert_allclose(runs["retriever"]["metrics"]["recall_adapter"]["per_seed"], recall,
                             atol=1e-3)
  np.testing.assert_allclose(runs["retriever"]["metrics"]["hitrate_adapter"]["per_seed"], hit,
                             atol=1e-3)
  assert (tmp_path / "plots" / "locomo_table2_main.png").read_bytes()[:4] == b"\x89PNG"
