"""The paper run on an accelerator, per seed beside the CPU, and the bundle to run it offline.

`run_main_suite` runs `experiments.run` on the default device in a subprocess and compares its
per-seed values (`compare_per_seed`) with a CPU reference: a file from `reference_from_results`
(committed: results/accelerator/locomo_main_cpu.json) or the same command now on the host CPU.
`write_bundle` copies LoCoMo and exactly its embeddings for a machine with no network.
"""
from __future__ import annotations

import json
import os
import pathlib
import shlex
from typing import Sequence

import numpy as np

from ear_jax.experiment import benchmarking


def per_seed_metrics(results: dict) -> dict:
  """`{run: {metric: [per-seed values]}}` of an `experiments.run` results.json."""
  return {run: {m: v["per_seed"] for m, v in r["metrics"].items()
                if m.startswith(("recall_", "hitrate_"))}
          for run, r in results["runs"].items()}


def reference_from_results(results: dict) -> dict:
  """A CPU reference file's contents from a CPU run's results.json: per-seed values, the command
  (without `--workdir`) and the versions."""
  if results.get("versions", {}).get("backend") != "cpu":
    raise ValueError(f"a CPU reference must come from a CPU run (backend "
                     f"{results.get('versions', {}).get('backend')!r})")
  command = " ".join(a for a in shlex.split(results["command"]) if not a.startswith("--workdir"))
  return {"command": command, "versions": results["versions"], "seeds": results["seeds"],
          "benchmark": results["benchmark"], "suite": results["suite"],
          "per_seed": per_seed_metrics(results)}


def _run_suite(repo: pathlib.Path, args: Sequence[str], precision: str, timeout: float,
               **env) -> dict:
  """`experiments.run <args>` in a subprocess with `env`, the matmul precision and no XLA
  preallocation (processes share the device); the caller's XLA_FLAGS are kept as they are."""
  run = benchmarking.run_experiment(repo, args, timeout, {
      "XLA_FLAGS": "", **os.environ, "JAX_DEFAULT_MATMUL_PRECISION": precision,
      "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1", **env})
  if run["status"] != "ran":
    return {k: run[k] for k in ("status", "tail") if k in run}
  results = run["results"]
  return {"status": "ran", "wall_s": round(run["wall_s"], 1), "versions": results["versions"],
          "seeds": results["seeds"], "per_seed": per_seed_metrics(results),
          "suite_s": results.get("suite_wall_seconds", {}).get(results.get("suite") or "", None)}


def compare_per_seed(device: dict, reference: dict, tolerance: float) -> list[dict]:
  """One row per (run, metric): means, their difference, the largest per-seed difference, seeds
  equal to 4 decimals, and whether the means are within `tolerance` points."""
  rows = []
  for run, metrics in reference.items():
    for metric, ref in metrics.items():
      got = device.get(run, {}).get(metric)
      if got is None or len(got) != len(ref):
        continue
      a, b = np.asarray(ref, float), np.asarray(got, float)
      diff = float(b.mean() - a.mean())
      rows.append({"run": run, "metric": metric, "cpu_mean": round(float(a.mean()), 4),
                   "device_mean": round(float(b.mean()), 4), "diff": round(diff, 4),
                   "max_seed_diff": round(float(np.abs(b - a).max()), 4),
                   "seeds_equal": int((np.abs(b - a) < 5e-4).sum()), "seeds": len(a),
                   "within_tolerance": abs(diff) <= tolerance})
  return rows


def run_main_suite(repo: pathlib.Path, suite_args: Sequence[str], precision: str,
                   reference: str, tolerance: float, timeout: float) -> dict:
  """`experiments.run <suite_args>` on the device beside a CPU reference.

  `reference`: a reference JSON file (`reference_from_results`), or `"cpu"`: the same command now
  on the host CPU. `precision`: `JAX_DEFAULT_MATMUL_PRECISION` of both runs; `tolerance`: points,
  compared on the means over seeds; `timeout`: seconds per subprocess. Returns the device run, the
  reference, the comparison rows and `all_within_tolerance`.
  """
  device = _run_suite(repo, suite_args, precision, timeout)
  out = {"args": list(suite_args), "precision": precision, "tolerance_points": tolerance,
         "device": device}
  if reference == "cpu":
    ref = _run_suite(repo, suite_args, precision, timeout, JAX_PLATFORMS="cpu")
    out["reference"] = {
        "source": "the same command on the host CPU in this run (JAX_PLATFORMS=cpu)",
        **{k: ref.get(k) for k in ("status", "wall_s", "versions")}}
    ref_seeds = ref.get("per_seed")
  else:
    path = pathlib.Path(reference)
    ref = json.loads((path if path.is_absolute() else repo / path).read_text())
    out["reference"] = {"source": reference, "command": ref.get("command"),
                        "versions": ref.get("versions")}
    ref_seeds = ref["per_seed"]
  if device["status"] != "ran" or not ref_seeds:
    return {**out, "status": f"not compared: device {device['status']}, reference "
                             f"{ref.get('status', 'read')}"}
  rows = compare_per_seed(device["per_seed"], ref_seeds, tolerance)
  return {**out, "rows": rows, "status": "compared",
          "all_within_tolerance": bool(rows) and all(r["within_tolerance"] for r in rows)}


def write_bundle(out_dir, *, data_dir=None, cache_dir=None, encoder: str = "minilm") -> dict:
  """Writes `data/locomo10.json` and the embedding cache of exactly LoCoMo's texts to `out_dir`.

  Pass `--data_dir=<out_dir>/data --cache_dir=<cache directory>` to the bench (an encoder with no
  model, `precomputed.CacheDirEncoder`). Returns the two paths and the bundle's bytes.
  """
  import shutil  # pylint: disable=g-import-not-at-top
  from ear_jax.data import candidates  # pylint: disable=g-import-not-at-top
  from ear_jax.data import corpora  # pylint: disable=g-import-not-at-top
  from ear_jax.data import embedding_cache  # pylint: disable=g-import-not-at-top
  from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
  out_dir = pathlib.Path(out_dir)
  src = corpora.find_benchmark_file("locomo", data_dir)
  (out_dir / "data").mkdir(parents=True, exist_ok=True)
  shutil.copyfile(src, out_dir / "data" / src.name)
  enc = encoders.load_encoder(encoder)
  texts, _, _ = candidates.encoded_texts(corpora.load_corpus("locomo", data_dir=out_dir / "data"))
  texts = list(dict.fromkeys(texts))
  emb = encoders.encode(enc, texts, cache_dir=cache_dir, progress=False)
  model_dir = out_dir / "cache" / embedding_cache.EmbeddingCache(out_dir / "cache", enc).dir.name
  shutil.rmtree(model_dir)  # a fresh directory with one shard of exactly these texts
  embedding_cache.EmbeddingCache(out_dir / "cache", enc).add(
      [embedding_cache.text_key(t) for t in texts], emb)
  size = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
  return {"data_dir": str(out_dir / "data"), "cache_dir": str(model_dir), "texts": len(texts),
          "bytes": size}
