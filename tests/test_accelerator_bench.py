"""Tests for `python -m experiments.bench --suite=accelerator` (ear_jax/experiment/accelerator_*)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from ear_jax.experiment import accelerator_bench
from ear_jax.experiment import accelerator_paper

REPO = pathlib.Path(__file__).resolve().parents[1]
# Not on the accelerator image: the suite must run without them (transformers: no Flax classes).
ABSENT = ("bm25s", "faiss", "mcp", "transformers")


def test_compare_per_seed_counts_equal_seeds_and_judges_the_mean_by_the_tolerance():
  ref = {"ear": {"recall_explorer": [40.0, 42.0, 44.0], "recall_adapter": [30.0, 30.0, 30.0]}}
  dev = {"ear": {"recall_explorer": [40.0, 42.0, 44.0], "recall_adapter": [30.0, 33.0, 30.3]},
         "other": {"recall_adapter": [1.0, 1.0, 1.0]}}
  rows = {r["metric"]: r for r in accelerator_paper.compare_per_seed(dev, ref, tolerance=1.0)}
  assert set(rows) == {"recall_explorer", "recall_adapter"}  # only what both hold
  assert rows["recall_explorer"]["seeds_equal"] == 3 and rows["recall_explorer"]["diff"] == 0
  adapter = rows["recall_adapter"]
  assert adapter["seeds_equal"] == 1 and adapter["max_seed_diff"] == 3.0
  assert adapter["diff"] == pytest.approx(1.1) and not adapter["within_tolerance"]


def test_a_reference_must_come_from_a_cpu_run():
  results = {"command": "c", "versions": {"backend": "gpu"}, "seeds": [0], "benchmark": "locomo",
             "suite": "main", "runs": {}}
  with pytest.raises(ValueError, match="CPU run.*'gpu'"):
    accelerator_paper.reference_from_results(results)
  results["versions"]["backend"] = "cpu"
  results["runs"] = {"ear": {"metrics": {"recall_adapter": {"per_seed": [1.0], "mean": 1.0},
                                         "ceiling": {"per_seed": [2.0]}}}}
  ref = accelerator_paper.reference_from_results(results)
  assert ref["per_seed"] == {"ear": {"recall_adapter": [1.0]}}


def test_the_committed_cpu_reference_is_ten_seeds_of_the_locomo_main_suite_on_cpu():
  ref = json.loads((REPO / "results/accelerator/locomo_main_cpu.json").read_text())
  assert ref["versions"]["backend"] == "cpu" and ref["seeds"] == list(range(10))
  assert (ref["benchmark"], ref["suite"]) == ("locomo", "main")
  assert set(ref["per_seed"]) == {"retriever", "rl_update", "ear"}
  assert all(len(v) == 10 for run in ref["per_seed"].values() for v in run.values())


def test_write_section_replaces_only_the_gpu_section(tmp_path):
  md = tmp_path / "B.md"
  md.write_text("# T\n\n## CPU\nkeep\n\n## GPU\nNo GPU was available.\n\n## After\nkeep too\n")
  accelerator_bench.write_section(md, "| a | b |\n|---|---|")
  accelerator_bench.write_section(md, "| new | table |\n|---|---|")  # idempotent place
  text = md.read_text()
  assert text == ("# T\n\n## CPU\nkeep\n\n## GPU\n\n| new | table |\n|---|---|\n\n## After\n"
                  "keep too\n")
  other = tmp_path / "C.md"
  other.write_text("# T\n")
  accelerator_bench.write_section(other, "x")
  assert other.read_text() == "# T\n\n## GPU\n\nx\n"


def test_targets_use_the_largest_n_and_the_largest_bank_at_batch_64():
  result = {
      "seeds": {"device": [{"seeds": 1, "status": "measured", "episodes_per_s": 2.0},
                           {"seeds": 1000, "status": "measured", "episodes_per_s": 500.0}],
                "cpu": [{"seeds": 1, "status": "measured", "episodes_per_s": 4.0},
                        {"seeds": 10, "status": "measured", "episodes_per_s": 5.0}]},
      "search": {"rows": [
          {"rows": 10, "batch": 64, "dtype": "float32", "status": "measured",
           "ratio_to_bound": 9.0, "chunk": 8},
          {"rows": 100, "batch": 64, "dtype": "float32", "status": "measured",
           "ratio_to_bound": 1.5, "chunk": 8},
          {"rows": 100, "batch": 1, "dtype": "float32", "status": "measured",
           "ratio_to_bound": 7.0, "chunk": 8},
          {"rows": 100, "batch": 64, "dtype": "bfloat16", "status": "measured",
           "ratio_to_bound": 2.5, "chunk": 8}]}}
  tg = accelerator_bench.targets(result)
  assert tg["seeds_speedup_vs_cpu"]["value"] == 100.0 and tg["seeds_speedup_vs_cpu"]["met"]
  assert [(r["value"], r["met"]) for r in tg["search_ratio_to_bound"]] == [(1.5, True),
                                                                            (2.5, False)]


@pytest.mark.slow
def test_small_suite_runs_on_cpu_without_the_optional_packages(tmp_path):
  """`--suite=accelerator --small` end to end in a subprocess where bm25s, faiss, mcp and
  transformers cannot be imported (also in the program it starts): every step runs, the CPU
  "device" equals the CPU reference seed for seed, and BENCHMARKS.md is not written on a CPU."""
  blocked = tmp_path / "blocked"
  for name in ABSENT:
    (blocked / name).mkdir(parents=True)
    (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed')\n")
  md = tmp_path / "BENCHMARKS.md"
  md.write_text("## GPU\nNo GPU.\n")
  out = tmp_path / "acc.json"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked), str(REPO)]),
             JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.bench", "--suite=accelerator", "--small",
       f"--accel_out={out}", f"--accel_benchmarks_md={md}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  res = json.loads(out.read_text())
  main = res["main"]
  assert main["status"] == "compared" and main["all_within_tolerance"]
  assert main["precision"] == "highest"
  assert all(r["seeds_equal"] == r["seeds"] == 2 for r in main["rows"])
  seeds = res["seeds"]["device"]
  assert [r["seeds"] for r in seeds] == [1, 4] and seeds[1]["ratio_to_1"] > 0
  assert res["seeds"]["cpu"] == "the device is the CPU"
  rows = res["search"]["rows"]
  assert {(r["dtype"], r["batch"]) for r in rows if r["status"] == "measured"} == {
      ("float32", 1), ("float32", 64), ("bfloat16", 1), ("bfloat16", 64)}
  assert res["search"]["bandwidth"]["gb_per_s"] > 0
  assert res["environment"]["backend"] == "cpu"
  text = out.with_suffix(".md").read_text()
  assert "JAX_DEFAULT_MATMUL_PRECISION=highest" in text and "ratio to bound" in text
  assert md.read_text() == "## GPU\nNo GPU.\n" and "not written: the device is the CPU" in proc.stdout


@pytest.mark.slow
def test_bundle_holds_locomo_and_exactly_its_embeddings_for_a_run_with_no_model(locomo_path,
                                                                               tmp_path):
  """`write_bundle` copies LoCoMo and one cache directory with the embeddings of every text the
  benchmark encodes; that directory, as the encoder, gives the model's embeddings bit for bit."""
  from ear_jax.data import candidates  # pylint: disable=g-import-not-at-top
  from ear_jax.data import corpora  # pylint: disable=g-import-not-at-top
  from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
  from tests import encoder_fixtures  # pylint: disable=g-import-not-at-top
  model = encoder_fixtures.write_tiny_checkpoint(tmp_path / "tiny", "bert")
  info = accelerator_paper.write_bundle(tmp_path / "bundle", data_dir=locomo_path.parent,
                                        cache_dir=tmp_path / "cache", encoder=str(model))
  assert (tmp_path / "bundle/data/locomo10.json").read_bytes() == locomo_path.read_bytes()
  texts, _, _ = candidates.encoded_texts(corpora.load_corpus("locomo",
                                                             data_dir=locomo_path.parent))
  assert info["texts"] == len(set(texts))
  cached = encoders.load_encoder(info["cache_dir"])
  enc = encoders.load_encoder(str(model))
  assert cached.identity_hash == enc.identity_hash
  some = texts[:5] + texts[-5:]
  got = encoders.encode(cached, some, progress=False)
  want = encoders.encode(enc, some, cache_dir=tmp_path / "cache", progress=False)
  assert (got == want).all()
