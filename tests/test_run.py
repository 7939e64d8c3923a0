"""Tests of experiments/run.py and experiments/suites.py: every suite end to end on the synthetic
benchmark, `main` on a LoCoMo slice with the real encoder, kill-and-resume, and flag errors."""
import json
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                      "--xla_llvm_disable_expensive_passes=true")

import numpy as np
import pytest

from experiments import suites

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA_DIR = pathlib.Path(os.environ.get("EAR_DATA_DIR", REPO.parent / "shared" / "data"))

TINY = dict(benchmark="synthetic", seeds=2, synthetic_queries=60, synthetic_dim=16, eval_every=16,
            checkpoint_every=16, progress=False, noise_levels=(0.7, 1.0),
            config_overrides={"buffer_capacity": 64})


@pytest.fixture(scope="module")
def all_suites(tmp_path_factory):
  wd = tmp_path_factory.mktemp("all")
  return suites.run(suites.Options(workdir=str(wd), suite="all", **TINY)), wd


@pytest.mark.parametrize("suite", suites.ALL_ORDER)
def test_every_suite_writes_its_table_and_plots_on_synthetic(all_suites, suite):
  results, wd = all_suites
  table = (wd / f"table_{suite}.md").read_text()
  assert "|---" in table and "±" in table
  expected_plots = {"main": ["table2_main"], "ablation": ["table3_ablation"],
                    "hparams": ["table6_T_B", "table7_strategy"],
                    "curves": ["fig3_sample_efficiency", "fig4_critic_budget"],
                    "noise": ["fig5_noise_grid", "fig5_noise_curves"],
                    "multistore": ["fig6_observations_in_top5", "table5_store_recall"]}[suite]
  for name in expected_plots:
    png = wd / "plots" / f"synthetic_{name}.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
  assert suite in results["suite_wall_seconds"]


def test_results_json_has_every_field(all_suites):
  _, wd = all_suites
  res = json.loads((wd / "results.json").read_text())
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


def test_suite_resumed_after_a_kill_matches_the_uninterrupted_run(tmp_path):
  from ear_jax.experiment import checkpointing
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
  p1, _, _ = checkpointing.restore_adapter(tmp_path, seed_index=None)
  ref = full["runs"][name]
  assert resumed["runs"][name]["metrics"] == ref["metrics"]
  assert resumed["runs"][name]["curve"] == ref["curve"]
  p2, _, _ = checkpointing.restore_adapter(full_wd, run="ear_eval=16", seed_index=None)
  np.testing.assert_array_equal(np.asarray(p1.w_q), np.asarray(p2.w_q))


def _cli(*args, env=None):
  return subprocess.Popen([sys.executable, "-m", "experiments.run", *args], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


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
    assert set(run["metrics"]) == {"recall_adapter", "hitrate_adapter", "recall_explorer",
                                   "hitrate_explorer"}
    assert run["per_category"] and run["ceiling"]["recall@K"]["mean"] > 0
  assert "Only Retriever" in res["tables"]["main"] and "42.60" in res["tables"]["main"]
  assert (tmp_path / "plots" / "locomo_table2_main.png").is_file()
