r"""Speed of ear_jax, measured against baselines measured in the same run.

  python -m experiments.bench              # full table (a few minutes on 2 CPU cores), bench.json
  python -m experiments.bench --quick      # every field on tiny shapes (~30 s; used by a test)
  python -m experiments.bench --suite=scale   # memory at scale, 1k -> 1M
  python -m experiments.bench --suite=accelerator --data_dir=D --cache_dir=C   # the GPU column

The default rows (`ear_jax.experiment.benchmarking`) run on a synthetic stream shaped like LoCoMo
training: `scan`, `loop`, `seeds`, `roofline`, `inference`, `encode`, `memory` and
`suite` (wall time of `experiments.run --suite=main`). Every ratio is printed with its target and
whether it is met; timings are the minimum over repetitions.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

from absl import app
from absl import flags

from ear_jax.experiment import benchmarking as bm
from experiments import cli

_REPO = pathlib.Path(__file__).resolve().parent.parent
_ACCEL_REFERENCE_DEFAULT = "results/accelerator/locomo_main_cpu.json"  # (relative to the repo)

_SUITE = flags.DEFINE_enum(
    "suite", "default", ["default", "scale", "accelerator"],
    "The default rows, memory at scale, or the accelerator column.")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny shapes, one repetition: every field in ~30 s.")
flags.DEFINE_alias("small", "quick")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Benchmark data for `suite` and `encode` "
                                "(default: $EAR_DATA_DIR or ../shared/data).")
# The default rows.
_OUT = flags.DEFINE_string("out", "bench.json", "Where to write the results (JSON).")
_NUM_QUERIES = flags.DEFINE_integer("num_queries", 1232, "Training queries of the stream.",
                                    lower_bound=1)
_DIMS = flags.DEFINE_list("dims", ["384", "768"], "Embedding dimensions for `scan`.")
_SEEDS = flags.DEFINE_integer("seeds", 8, "Seeds of the `seeds` row.", lower_bound=1)
_REPS = flags.DEFINE_integer("reps", 2, "Repetitions of each timing (the minimum is reported).",
                             lower_bound=1)
_SKIP = flags.DEFINE_list("skip", [], f"Rows to skip: any of {', '.join(bm.ROWS)}.")
_SUITE_TIMEOUT = flags.DEFINE_integer("suite_timeout", 900, "Seconds before `suite` gives up.",
                                      lower_bound=1)
flags.register_validator("skip", lambda rows: set(rows) <= set(bm.ROWS),
                         f"--skip takes a comma-separated subset of {', '.join(bm.ROWS)}")
flags.register_validator("dims", lambda dims: bool(dims) and all(d.isdigit() and int(d) > 0
                                                                 for d in dims),
                         "--dims takes a comma-separated list of positive integers")
# --suite=scale: its JSON at --scale_out, markdown beside it.
_SCALE_SIZES = flags.DEFINE_list("scale_sizes", ["1000", "10000", "100000", "1000000"],
                                 "--suite=scale: bank sizes.")
_SCALE_PATHS = flags.DEFINE_list("scale_paths", ["exact", "bf16", "ivf", "ivf_clustered", "pq"],
                                 "--suite=scale: paths (exact, bf16, ivf, ivf_clustered, pq, "
                                 "hnsw).")
_SCALE_OUT = flags.DEFINE_string("scale_out", "results/scale/scale.json", "--suite=scale: JSON "
                                 "output (the plot, .png, is also written beside it).")
# --suite=accelerator (see ear_jax.experiment.accelerator_bench).
_CACHE_DIR = flags.DEFINE_string(
    "cache_dir", None, "--suite=accelerator: one model's embedding cache directory (holding "
    "meta.json; no model needed), else a cache root for MiniLM (default: $EAR_CACHE_DIR).")
_ACCEL_REFERENCE = flags.DEFINE_string(
    "accel_reference", None, "--suite=accelerator: the CPU reference, a JSON of per-seed values "
    f"(default {_ACCEL_REFERENCE_DEFAULT}), or 'cpu': the same command now on the host CPU (the "
    "default with --small).")
_ACCEL_MAKE_REFERENCE = flags.DEFINE_string(
    "accel_make_reference", None, "Write --accel_reference from this results.json of a CPU run of "
    "experiments.run and exit.")
_ACCEL_BUNDLE = flags.DEFINE_string(
    "accel_bundle", None, "Write what an offline accelerator run needs (LoCoMo and its embeddings, "
    "from --data_dir and the --cache_dir root) into this folder of the repository, have git ignore "
    "it, print the device command, and exit.")
_ACCEL_TOLERANCE = flags.DEFINE_float("accel_tolerance", 1.0, "--suite=accelerator: the largest "
                                      "|device - CPU| mean over the seeds, points.", lower_bound=0)
_ACCEL_PRECISION = flags.DEFINE_enum("accel_precision", "highest", ["default", "high", "highest"],
                                     "--suite=accelerator: JAX_DEFAULT_MATMUL_PRECISION of the "
                                     "paper run (highest: float32, no TF32).")
_ACCEL_SKIP = flags.DEFINE_list("accel_skip", [], "--suite=accelerator: steps to leave out (main, "
                                "seeds, search).")
flags.register_validator("accel_skip", lambda steps: set(steps) <= {"main", "seeds", "search"},
                         "--accel_skip takes a comma-separated subset of main, seeds, search")
_ACCEL_TIMEOUT = flags.DEFINE_integer("accel_timeout", 200, "--suite=accelerator: seconds for "
                                      "each paper run.", lower_bound=1)
_ACCEL_OUT = flags.DEFINE_string("accel_out", "results/accelerator/accelerator.json",
                                 "--suite=accelerator: JSON output.")
_ACCEL_MD = flags.DEFINE_string("accel_benchmarks_md", str(_REPO / "BENCHMARKS.md"),
                                "--suite=accelerator: the file whose '## GPU' section is "
                                "replaced (only when the device is not a CPU; '' = none).")


def _data_dir() -> str:
  return _DATA_DIR.value or os.environ.get("EAR_DATA_DIR") or str(_REPO.parent / "shared" / "data")


def _write(res: dict, out: str, table, *more, command: bool = True) -> str:
  """Writes `res`, with this command, as JSON at `out` and `table(res)` as markdown beside it (after
  the command if `command`); prints and returns the table, and prints the files (`more`: others)."""
  res["command"] = cli.command("experiments.bench")
  text = table(res)
  out = cli.write_json(out, res)
  md = out.with_suffix(".md")
  md.write_text((f"Command: `{res['command']}`\n\n" if command else "") + text + "\n")
  print(text)
  print("wrote " + ", ".join(str(p) for p in (out, md, *more)))
  return text


def _default():
  quick = _QUICK.value
  res = {"command": cli.command("experiments.bench"), "quick": quick}
  res.update(bm.run(
      _REPO, _data_dir(), num_queries=32 if quick else _NUM_QUERIES.value,
      dims=[64] if quick else list(map(int, _DIMS.value)), reps=1 if quick else _REPS.value,
      num_seeds=2 if quick else _SEEDS.value,
      inference_dim=64 if quick else 384, inference_calls=20 if quick else 200,
      peak_sizes=(256, 512) if quick else (768, 1024, 1536), peak_reps=2 if quick else 3,
      suite_timeout=_SUITE_TIMEOUT.value,
      skip=set(_SKIP.value) | ({"encode", "memory", "suite"} if quick else set())))
  print(bm.table(res))
  cli.write_json(_OUT.value, res)
  print(f"wrote {_OUT.value}")


def _scale():
  from ear_jax.experiment import scale_bench  # pylint: disable=g-import-not-at-top
  quick, out = _QUICK.value, pathlib.Path(_SCALE_OUT.value)
  saves = out.parent / "saves"  # the timed saves' scratch directory
  out.parent.mkdir(parents=True, exist_ok=True)
  res = scale_bench.run(list(map(int, _SCALE_SIZES.value)), _SCALE_PATHS.value,
                        dim=64 if quick else 384, calls=20, batch=16 if quick else 256,
                        save_dir=str(saves), peak_sizes=(256,) if quick else (768, 1024, 1536),
                        bandwidth_bytes=4e7 if quick else 1.5e9)
  shutil.rmtree(saves, ignore_errors=True)
  res["machine"] = bm.machine()
  scale_bench.plot(res, str(out.with_suffix(".png")))
  _write(res, out, scale_bench.table, out.with_suffix(".png"))


def _accelerator():
  """Also replaces BENCHMARKS.md's "GPU" section when the device is not a CPU."""
  from ear_jax.experiment import accelerator_bench  # pylint: disable=g-import-not-at-top
  small = _QUICK.value
  # Paths inside the repository are passed (and printed) relative to it: the runs start there.
  rel = lambda p: (os.path.relpath(p, _REPO)
                   if os.path.abspath(p).startswith(str(_REPO) + os.sep) else p)
  if small:
    suite_args = ["--benchmark=synthetic", "--method=ear", "--seeds=2", "--synthetic_queries=64",
                  "--eval_every=1000"]
  else:
    cache = _CACHE_DIR.value and rel(_CACHE_DIR.value)
    if cache and (pathlib.Path(cache).expanduser() / "meta.json").is_file():
      encoder = [f"--encoder={cache}"]  # its embeddings, no model
    else:
      encoder = ["--encoder=minilm"] + ([f"--cache_dir={cache}"] if cache else [])
    suite_args = ["--benchmark=locomo", "--suite=main", "--seeds=10",  # (the reference's seeds)
                  "--candidates=dense", f"--data_dir={rel(_data_dir())}", *encoder]
  res = accelerator_bench.run(
      _REPO, suite_args=suite_args, precision=_ACCEL_PRECISION.value,
      reference=_ACCEL_REFERENCE.value or ("cpu" if small else _ACCEL_REFERENCE_DEFAULT),
      tolerance=_ACCEL_TOLERANCE.value, timeout=_ACCEL_TIMEOUT.value,
      seed_counts=[1, 4] if small else [1, 10, 100, 1000],
      cpu_seed_counts=[1] if small else [1, 10],
      stream_queries=32 if small else _NUM_QUERIES.value, dim=64 if small else 384,
      search_sizes=[20_000] if small else [1_000_000, 10_000_000],
      search_chunks=[None] if small else [None, 1 << 20], reps=2 if small else 5,
      bandwidth_bytes=4e7 if small else 4e9, skip=_ACCEL_SKIP.value)
  res["small"] = small
  res["targets"] = accelerator_bench.targets(res)
  text = _write(res, _ACCEL_OUT.value, accelerator_bench.table, command=False)
  if _ACCEL_MD.value and res["environment"]["backend"] != "cpu":
    accelerator_bench.write_section(_ACCEL_MD.value, text)
    print(f"wrote the '## GPU' section of {_ACCEL_MD.value}")
  elif _ACCEL_MD.value:
    print(f"{_ACCEL_MD.value} not written: the device is the CPU")


def _accelerator_reference():
  """`--accel_make_reference`: the CPU reference file from a CPU run's results.json."""
  from ear_jax.experiment import accelerator_paper  # pylint: disable=g-import-not-at-top
  results = json.loads(pathlib.Path(_ACCEL_MAKE_REFERENCE.value).read_text())
  out = cli.write_json(_ACCEL_REFERENCE.value or _REPO / _ACCEL_REFERENCE_DEFAULT,
                       accelerator_paper.reference_from_results(results))
  print(f"wrote {out}")


def _accelerator_bundle():
  """`--accel_bundle=DIR`: `accelerator_paper.write_bundle`, DIR added to git's exclude file (a
  carried folder must be ignored), then the device call to make."""
  from ear_jax.experiment import accelerator_paper  # pylint: disable=g-import-not-at-top
  folder = pathlib.Path(_ACCEL_BUNDLE.value)
  if folder.is_absolute() or ".." in folder.parts or len(folder.parts) != 1:
    raise app.UsageError("--accel_bundle: one folder name at the repository root, e.g. .accel")
  info = accelerator_paper.write_bundle(_REPO / folder, data_dir=_DATA_DIR.value,
                                        cache_dir=_CACHE_DIR.value)
  exclude = _REPO / subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=_REPO,
                                   capture_output=True, text=True, check=True).stdout.strip()
  line = f"/{folder}/"
  if line not in (exclude.read_text().splitlines() if exclude.is_file() else []):
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with open(exclude, "a") as f:
      f.write(f"\n{line}\n")
  cache = os.path.relpath(info["cache_dir"], _REPO)
  command = (f"export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.95; set -o pipefail; "
             f"timeout 560 python3 -m experiments.bench --suite=accelerator "
             f"--data_dir={folder}/data --cache_dir={cache} --accel_out=$OUT/accelerator.json "
             f"2>&1 | tee $OUT/bench.log; rc=$?; cp BENCHMARKS.md $OUT/; exit $rc")
  print(f"wrote {folder}/ ({info['texts']} texts, {info['bytes'] / 2**20:.1f} MiB); {line} is in "
        f"{exclude}")
  print("device call (the repository's checkout with this folder carried; sized for ~6 min on an "
        "H200, each step bounded by --accel_timeout, the whole by `timeout 560`):")
  print(json.dumps({"command": command, "carry": [str(folder)], "timeout_s": 600}, indent=1))


def main(argv):
  del argv
  if _ACCEL_MAKE_REFERENCE.value:
    return _accelerator_reference()
  if _ACCEL_BUNDLE.value:
    return _accelerator_bundle()
  return {"default": _default, "scale": _scale, "accelerator": _accelerator}[_SUITE.value]()


if __name__ == "__main__":
  app.run(main)
