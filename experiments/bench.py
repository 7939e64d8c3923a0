r"""Speed of ear_jax, measured against baselines measured in the same run.

  python -m experiments.bench              # full table (a few minutes on 2 CPU cores), bench.json
  python -m experiments.bench --quick      # every field on tiny shapes (~30 s; used by a test)
  python -m experiments.bench --suite=scale   # memory at scale, 1k -> 1M
  python -m experiments.bench --suite=first_stage   # BM25 / hybrid candidates, 10k -> 1M
  python -m experiments.bench --suite=server   # the MCP server under 16 concurrent HTTP clients
  python -m experiments.bench --suite=scopes   # a scoped search among 1M memories in 10k scopes
  python -m experiments.bench --suite=accelerator --data_dir=D --cache_dir=C   # the GPU column

The default rows (`ear_jax.experiment.benchmarking`) run on a synthetic stream shaped like LoCoMo
training: `scan`, `loop`, `numpy`, `seeds`, `roofline`, `inference`, `encode`, `memory` and
`suite` (wall time of `experiments.run --suite=main`). Every ratio is printed with its target and
whether it is met; timings are the minimum over repetitions.
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import shutil
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from ear_jax.core import episode
from ear_jax.core import stream as stream_lib
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.experiment import benchmarking as bm

_REPO = pathlib.Path(__file__).resolve().parent.parent
ROWS = ("scan", "loop", "numpy", "seeds", "inference", "encode", "memory", "suite")

_SUITE = flags.DEFINE_enum("suite", "default", ["default", "scale", "first_stage", "server",
                                                "scopes", "accelerator"],
                           "Which benchmark: the default rows, memory at scale, the first stage, "
                           "the MCP server under load, scoped search, or the accelerator column.")
_SCALE_SIZES = flags.DEFINE_list("scale_sizes", ["1000", "10000", "100000", "1000000"],
                                 "--suite=scale: bank sizes.")
_SCALE_PATHS = flags.DEFINE_list("scale_paths", ["exact", "bf16", "ivf", "ivf_clustered", "pq"],
                                 "--suite=scale: paths (exact, bf16, ivf, ivf_clustered, pq, "
                                 "hnsw).")
_SCALE_OUT = flags.DEFINE_string("scale_out", "results/scale/scale.json", "--suite=scale: JSON "
                                 "output; the table (.md) and plot (.png) are written beside it.")
_SCALE_CALLS = flags.DEFINE_integer("scale_calls", 20, "--suite=scale: searches and round + "
                                    "feedback calls per (path, size).", lower_bound=2)
_FIRST_STAGE_OUT = flags.DEFINE_string(
    "first_stage_out", "results/first_stage/first_stage.json", "--suite=first_stage: JSON "
    "output; the table (.md) is written beside it.")
_SERVER_MEMORIES = flags.DEFINE_integer("server_memories", 100_000, "--suite=server: memories "
                                        "(N).", lower_bound=1)
_SERVER_SCOPES = flags.DEFINE_integer("server_scopes", 100, "--suite=server: scopes (S).",
                                      lower_bound=1)
_SERVER_CLIENTS = flags.DEFINE_integer("server_clients", 16, "--suite=server: concurrent clients "
                                       "(C; also 1 in the same run).", lower_bound=1)
_SERVER_SECONDS = flags.DEFINE_float("server_seconds", 30.0, "--suite=server: seconds per phase.",
                                     lower_bound=0.1)
_SERVER_WINDOW = flags.DEFINE_float("server_batch_window_ms", 5.0, "--suite=server: the "
                                     "micro-batching window (server and in-process).",
                                     lower_bound=0.0)
_SERVER_BATCH_TOKENS = flags.DEFINE_integer("server_encoder_batch_tokens", 512, "--suite=server: "
                                            "the server's --encoder_batch_tokens.", lower_bound=1)
_SERVER_ARGS = flags.DEFINE_list("server_args", [], "--suite=server: more ear-mcp-server "
                                 "flags, e.g. --server_args=--worker_threads=16.")
_SERVER_OUT = flags.DEFINE_string("server_out", "results/server/server.json", "--suite=server: "
                                  "JSON output; the table (.md) is written beside it.")
_SCOPE_MEMORIES = flags.DEFINE_integer("scope_memories", 1_000_000, "--suite=scopes: memories "
                                       "(M).", lower_bound=1)
_SCOPE_SCOPES = flags.DEFINE_integer("scope_scopes", 10_000, "--suite=scopes: scopes (S).",
                                     lower_bound=1)
_SCOPE_STAGES = flags.DEFINE_list("scope_stages", ["exact", "bm25", "hybrid"], "--suite=scopes: "
                                  "first stages (exact, bm25, hybrid).")
_SCOPE_OUT = flags.DEFINE_string("scope_out", "results/scopes/scopes.json", "--suite=scopes: JSON "
                                 "output; the table (.md) is written beside it.")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny shapes, one repetition: every field in ~30 s.")
flags.DEFINE_alias("small", "quick")
_CACHE_DIR = flags.DEFINE_string("cache_dir", None, "--suite=accelerator: the embeddings of the "
                                 "paper run: one model's embedding cache directory (holding "
                                 "meta.json; no model needed), else a cache root for "
                                 "--accel_encoder (default: $EAR_CACHE_DIR or ~/.cache/ear_jax).")
_ACCEL_ENCODER = flags.DEFINE_string("accel_encoder", "minilm", "--suite=accelerator: the encoder "
                                     "when --cache_dir is not a model's cache directory.")
_ACCEL_SEEDS = flags.DEFINE_integer("accel_seeds", 10, "--suite=accelerator: seeds of the paper "
                                    "run (as the reference's).", lower_bound=1)
_ACCEL_REFERENCE = flags.DEFINE_string(
    "accel_reference", None, "--suite=accelerator: the CPU reference, a JSON of per-seed values "
    "(default results/accelerator/locomo_main_cpu.json), or 'cpu': the same command now on the "
    "host CPU (the default with --small).")
_ACCEL_MAKE_REFERENCE = flags.DEFINE_string(
    "accel_make_reference", None, "Write --accel_reference from this results.json of a CPU run of "
    "experiments.run and exit.")
_ACCEL_BUNDLE = flags.DEFINE_string(
    "accel_bundle", None, "Write what an offline accelerator run needs (LoCoMo and its embeddings, "
    "from --data_dir and the --cache_dir root) into this folder of the repository, have git ignore "
    "it, print the device command, and exit.")
_ACCEL_TOLERANCE = flags.DEFINE_float("accel_tolerance", 1.0, "--suite=accelerator: the largest "
                                      "|device mean - CPU mean| over the seeds, in points.",
                                      lower_bound=0.0)
_ACCEL_PRECISION = flags.DEFINE_enum("accel_precision", "highest", ["default", "high", "highest"],
                                     "--suite=accelerator: JAX_DEFAULT_MATMUL_PRECISION of the "
                                     "tests and the paper run (highest: float32, no TF32).")
_ACCEL_SEED_COUNTS = flags.DEFINE_list("accel_seed_counts", ["1", "10", "100", "1000"],
                                       "--suite=accelerator: N of the vmapped seeds.")
_ACCEL_CPU_SEED_COUNTS = flags.DEFINE_list("accel_cpu_seed_counts", ["1", "10"],
                                           "--suite=accelerator: N on the host CPU.")
_ACCEL_SEARCH_SIZES = flags.DEFINE_list("accel_search_sizes", ["1000000", "10000000"],
                                        "--suite=accelerator: bank rows of the exact search.")
_ACCEL_SKIP = flags.DEFINE_list("accel_skip", [], "--suite=accelerator: steps to leave out (tests, "
                                "main, seeds, search).")
_ACCEL_TIMEOUT = flags.DEFINE_integer("accel_timeout", 200, "--suite=accelerator: seconds for the "
                                      "tests, and for each paper run.", lower_bound=1)
_ACCEL_OUT = flags.DEFINE_string("accel_out", "results/accelerator/accelerator.json",
                                 "--suite=accelerator: JSON output; the markdown is written beside "
                                 "it.")
_ACCEL_MD = flags.DEFINE_string("accel_benchmarks_md", str(_REPO / "BENCHMARKS.md"),
                                "--suite=accelerator: the file whose '## GPU' section is "
                                "replaced (only when the device is not a CPU; '' = none).")
_ACCEL_REFERENCE_DEFAULT = "results/accelerator/locomo_main_cpu.json"  # (relative to the repo)
_OUT = flags.DEFINE_string("out", "bench.json", "Where to write the results (JSON).")
_NUM_QUERIES = flags.DEFINE_integer("num_queries", 1232, "Training queries of the stream.",
                                    lower_bound=1)
_DIMS = flags.DEFINE_list("dims", ["384", "768"], "Embedding dimensions for `scan`.")
_SEEDS = flags.DEFINE_integer("seeds", 8, "Seeds of the `seeds` row.", lower_bound=1)
_REPS = flags.DEFINE_integer("reps", 2, "Repetitions of each timing (the minimum is reported).",
                             lower_bound=1)
_NUMPY_QUERIES = flags.DEFINE_integer("numpy_queries", 96, "Queries timed for the `numpy` row.",
                                      lower_bound=1)
_SKIP = flags.DEFINE_list("skip", [], f"Rows to skip: any of {', '.join(ROWS)}.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Benchmark data for `suite` and `encode` "
                                "(default: $EAR_DATA_DIR or ../shared/data).")
_SUITE_TIMEOUT = flags.DEFINE_integer("suite_timeout", 900, "Seconds before `suite` gives up.",
                                      lower_bound=1)
flags.register_validator("skip", lambda rows: set(rows) <= set(ROWS),
                         f"--skip takes a comma-separated subset of {', '.join(ROWS)}")
flags.register_validator("dims", lambda dims: bool(dims) and all(d.isdigit() and int(d) > 0
                                                                 for d in dims),
                         "--dims takes a comma-separated list of positive integers")

PAPER_TABLE8 = {"adapter_only_s_per_query": 2.30, "explorer_s_per_query": 16.88,
                "note": "paper Table 8, per query, including its LLM calls"}
TARGETS = {
    "scan_over_loop": 5.0, "scan_over_numpy": 10.0, "scan_fraction_of_peak": 0.30,
    "seeds_speedup": 4.0, "adapter_b1_ms": 1.0, "adapter_b256_qps": 10000.0, "suite_s": 60.0,
    "memory_search_over_bound": 1.0,
}


def main(argv):
  del argv
  if _SUITE.value == "scopes":
    return _scopes()
  if _ACCEL_MAKE_REFERENCE.value:
    return _accelerator_reference()
  if _ACCEL_BUNDLE.value:
    return _accelerator_bundle()
  if _SUITE.value == "accelerator":
    return _accelerator()
  if _SUITE.value == "scale":
    return _scale()
  if _SUITE.value == "first_stage":
    return _first_stage()
  if _SUITE.value == "server":
    return _server()
  quick = _QUICK.value
  skip = set(_SKIP.value)
  n = 32 if quick else _NUM_QUERIES.value
  dims = [64] if quick else [int(x) for x in _DIMS.value]
  reps = 1 if quick else _REPS.value
  peak_sizes, peak_reps = ((256, 512), 2) if quick else ((768, 1024, 1536), 3)
  hparams = default_hparams()
  data_dir = _DATA_DIR.value or os.environ.get("EAR_DATA_DIR") or str(_REPO.parent / "shared" /
                                                                        "data")
  results = {
      "command": "python -m experiments.bench " + " ".join(sys.argv[1:]),
      "quick": quick, "machine": {
          "platform": platform.platform(), "processor": platform.processor(),
          "cpu_count": os.cpu_count(), "backend": jax.default_backend(),
          "devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
          "xla_flags": os.environ.get("XLA_FLAGS", "")},
      "stream": {"num_queries": n, "K": 20, "s": 5, "T": 4, "B": 4, "batch_size": 4,
                 "dims": dims, "method": "ear (default EARConfig)"},
      "paper_table8": PAPER_TABLE8,
  }
  d0 = dims[0]
  streams = {d: stream_lib.to_device(bm.bench_stream(n, d)) for d in dims}
  configs = {d: EARConfig(dim=d) for d in dims}

  results["peak"] = bm.measure_peak(peak_sizes, reps=peak_reps)
  if "scan" not in skip:
    results["scan"] = {}
    for d in dims:
      row, _ = bm.run_scan(streams[d], configs[d], hparams, reps)
      row["flops_per_query"] = bm.ear_flops_per_query(configs[d])
      row["gflops"] = row["flops_per_query"]["total"] * row["queries_per_s"] / 1e9
      results["scan"][str(d)] = row
      print(f"scan d={d}: {row['queries_per_s']:.1f} q/s, compile {row['compile_s']:.1f} s",
            flush=True)
  peak2 = bm.measure_peak(peak_sizes, reps=peak_reps)
  results["peak"] = max(results["peak"], peak2, key=lambda p: p["gflops"])
  if "loop" not in skip:
    row, state = bm.run_loop(streams[d0], configs[d0], hparams, reps)
    scan_state, _ = jax.jit(episode.run_episode, static_argnames=("config",))(
        jax.random.PRNGKey(0), streams[d0], configs[d0], hparams)
    row["max_abs_param_diff_vs_scan"] = float(max(
        jnp.max(jnp.abs(a - b)) for a, b in zip(jax.tree_util.tree_leaves(state.params),
                                                jax.tree_util.tree_leaves(scan_state.params))))
    results["loop"] = row
    print(f"loop d={d0}: {row['queries_per_s']:.1f} q/s", flush=True)
  if "numpy" not in skip:
    results["numpy"] = bm.run_numpy(streams[d0], configs[d0], hparams,
                                    8 if quick else _NUMPY_QUERIES.value)
    print(f"numpy d={d0}: {results['numpy']['queries_per_s']:.1f} q/s", flush=True)
  if "seeds" not in skip:
    results["seeds"] = bm.run_seeds(streams[d0], configs[d0], hparams,
                                    2 if quick else _SEEDS.value, reps if quick else 1)
    print(f"seeds: speed-up {results['seeds']['speedup']:.2f}x", flush=True)
  if "inference" not in skip:
    results["inference"] = bm.run_inference(64 if quick else 384, (600, 250), (1, 256), reps,
                                            20 if quick else 200)
  if "encode" not in skip and not quick:
    results["encode"] = bm.run_encode(512, data_dir)
  else:
    results["encode"] = {"status": "skipped (--quick or --skip)"}
  if "memory" not in skip and not quick:
    from ear_jax.experiment import memory_latency  # pylint: disable=g-import-not-at-top
    results["memory"] = {"warm": memory_latency.warm_search(data_dir=data_dir),
                         "second_process": memory_latency.second_process(data_dir=data_dir)}
    print(f"memory: {json.dumps(results['memory'])}", flush=True)
  else:
    results["memory"] = {"status": "skipped (--quick or --skip)"}
  if "suite" not in skip and not quick:
    results["suite"] = bm.run_suite(_REPO, data_dir, _SUITE_TIMEOUT.value)
  else:
    results["suite"] = {"status": "skipped (--quick or --skip)"}

  # Roofline at the largest dimension measured.
  if "scan" in results:
    d_top = str(max(dims))
    results["roofline"] = {
        "dim": int(d_top), "flops_per_query": results["scan"][d_top]["flops_per_query"],
        "achieved_gflops": results["scan"][d_top]["gflops"],
        "peak_gflops": results["peak"]["gflops"],
        "fraction_of_peak": results["scan"][d_top]["gflops"] / results["peak"]["gflops"]}
  results["targets"] = _targets(results, str(d0))
  _print_table(results, str(d0))
  with open(_OUT.value, "w") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {_OUT.value}")


def _accelerator_reference():
  """`--accel_make_reference`: the CPU reference file from a CPU run's results.json."""
  from ear_jax.experiment import accelerator_paper  # pylint: disable=g-import-not-at-top
  results = json.loads(pathlib.Path(_ACCEL_MAKE_REFERENCE.value).read_text())
  out = pathlib.Path(_ACCEL_REFERENCE.value or _REPO / _ACCEL_REFERENCE_DEFAULT)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(accelerator_paper.reference_from_results(results), indent=1) + "\n")
  print(f"wrote {out}")
  return 0


def _accelerator_bundle():
  """`--accel_bundle=DIR`: `accelerator_paper.write_bundle`, DIR added to git's exclude file (a
  carried folder must be ignored), then the device call to make."""
  import subprocess  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import accelerator_paper  # pylint: disable=g-import-not-at-top
  folder = pathlib.Path(_ACCEL_BUNDLE.value)
  if folder.is_absolute() or ".." in folder.parts or len(folder.parts) != 1:
    raise app.UsageError("--accel_bundle: one folder name at the repository root, e.g. .accel")
  info = accelerator_paper.write_bundle(_REPO / folder, data_dir=_DATA_DIR.value,
                                        cache_dir=_CACHE_DIR.value, encoder=_ACCEL_ENCODER.value)
  exclude = pathlib.Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"],
                                        cwd=_REPO, capture_output=True, text=True,
                                        check=True).stdout.strip())
  exclude = exclude if exclude.is_absolute() else _REPO / exclude
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
  return 0


def _accelerator():
  """`--suite=accelerator`: JSON at `--accel_out`, markdown beside it, and BENCHMARKS.md's "GPU"
  section when the device is not a CPU."""
  from ear_jax.experiment import accelerator_bench  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import accelerator_table  # pylint: disable=g-import-not-at-top
  small = _QUICK.value
  # Paths inside the repository are passed (and printed) relative to it: the runs start there.
  rel = lambda p: os.path.relpath(p, _REPO) if os.path.abspath(p).startswith(str(_REPO) + os.sep) \
      else p
  data_dir = rel(_DATA_DIR.value or os.environ.get("EAR_DATA_DIR") or str(_REPO.parent / "shared" /
                                                                            "data"))
  if small:
    suite_args = ["--benchmark=synthetic", "--method=ear", f"--seeds={min(_ACCEL_SEEDS.value, 2)}",
                  "--synthetic_queries=64", "--eval_every=1000"]
  else:
    cache = _CACHE_DIR.value and rel(_CACHE_DIR.value)
    if cache and (pathlib.Path(cache).expanduser() / "meta.json").is_file():
      encoder = [f"--encoder={cache}"]  # its embeddings, no model
    else:
      encoder = [f"--encoder={_ACCEL_ENCODER.value}"] + ([f"--cache_dir={cache}"] if cache else [])
    suite_args = ["--benchmark=locomo", "--suite=main", f"--seeds={_ACCEL_SEEDS.value}",
                  "--candidates=dense", f"--data_dir={data_dir}", *encoder]
  reference = _ACCEL_REFERENCE.value or ("cpu" if small else str(_ACCEL_REFERENCE_DEFAULT))
  ints = lambda xs: [int(x) for x in xs]
  res = accelerator_bench.run(
      _REPO, suite_args=suite_args, reference=reference, tolerance=_ACCEL_TOLERANCE.value,
      precision=_ACCEL_PRECISION.value,
      test_files=accelerator_bench.core_test_files(_REPO)[:1] if small else None,
      test_workers=1 if small else max(1, min(8, (os.cpu_count() or 2) // 2)),
      test_timeout=_ACCEL_TIMEOUT.value, suite_timeout=_ACCEL_TIMEOUT.value,
      seed_counts=[1, 4] if small else ints(_ACCEL_SEED_COUNTS.value),
      cpu_seed_counts=[1] if small else ints(_ACCEL_CPU_SEED_COUNTS.value),
      stream_queries=32 if small else _NUM_QUERIES.value, dim=64 if small else 384,
      search_sizes=[20_000] if small else ints(_ACCEL_SEARCH_SIZES.value),
      search_dtypes=["float32", "bfloat16"], search_batches=[1, 64],
      search_chunks=[None] if small else [None, 1 << 20], k=20, reps=2 if small else 5,
      bandwidth_bytes=4e7 if small else 4e9, skip=_ACCEL_SKIP.value)
  res["command"] = "python -m experiments.bench " + " ".join(sys.argv[1:])
  res["small"] = small
  res["targets"] = accelerator_table.targets(res)
  text = accelerator_table.table(res)
  out = pathlib.Path(_ACCEL_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(res, indent=1) + "\n")
  out.with_suffix(".md").write_text(text + "\n")
  print(text)
  print(f"wrote {out}, {out.with_suffix('.md')}")
  if _ACCEL_MD.value and res["environment"]["backend"] != "cpu":
    accelerator_table.write_section(_ACCEL_MD.value, text)
    print(f"wrote the '## GPU' section of {_ACCEL_MD.value}")
  elif _ACCEL_MD.value:
    print(f"{_ACCEL_MD.value} not written: the device is the CPU")
  return 0


def _scopes():
  """`--suite=scopes`: JSON and markdown at `--scope_out`."""
  from ear_jax.experiment import scope_bench  # pylint: disable=g-import-not-at-top
  quick = _QUICK.value
  res = scope_bench.run(2_000 if quick else _SCOPE_MEMORIES.value,
                        20 if quick else _SCOPE_SCOPES.value, _SCOPE_STAGES.value,
                        dim=64 if quick else 384, calls=20 if quick else 200,
                        sample=4 if quick else 20)
  res["command"] = "python -m experiments.bench " + " ".join(sys.argv[1:])
  out = pathlib.Path(_SCOPE_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(res, indent=1))
  md = scope_bench.table(res)
  out.with_suffix(".md").write_text(md + "\n")
  print(md)
  return 0


def _scale():
  """`--suite=scale`: `scale_bench.run`, then the JSON, the markdown table and the plot."""
  from ear_jax.experiment import scale_bench  # pylint: disable=g-import-not-at-top
  sizes = [int(x) for x in _SCALE_SIZES.value]
  out = pathlib.Path(_SCALE_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  quick = _QUICK.value
  res = scale_bench.run(sizes, _SCALE_PATHS.value, dim=64 if quick else 384,
                        calls=_SCALE_CALLS.value, batch=16 if quick else 256,
                        save_dir=str(out.parent / "saves"),
                        peak_sizes=(256,) if quick else (768, 1024, 1536),
                        bandwidth_bytes=4e7 if quick else 1.5e9)
  shutil.rmtree(out.parent / "saves", ignore_errors=True)  # the timed saves' scratch directory
  res["command"] = "python -m experiments.bench " + " ".join(sys.argv[1:])
  res["machine"] = {"cpu_count": os.cpu_count(), "backend": jax.default_backend(),
                    "jax": jax.__version__, "processor": platform.processor()}
  text = scale_bench.table(res)
  out.write_text(json.dumps(res, indent=1))
  out.with_suffix(".md").write_text(f"Command: `{res['command']}`\n\n{text}\n")
  scale_bench.plot(res, str(out.with_suffix(".png")))
  print(text)
  print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


def _first_stage():
  """`--suite=first_stage`: JSON at `--first_stage_out`, markdown beside it."""
  from ear_jax.experiment import first_stage_bench  # pylint: disable=g-import-not-at-top
  quick = _QUICK.value
  res = first_stage_bench.run([2_000] if quick else [10_000, 100_000, 1_000_000],
                              dim=32 if quick else 384, calls=3 if quick else 20,
                              bandwidth_bytes=4e7 if quick else 1.5e9)
  res["command"] = "python -m experiments.bench " + " ".join(sys.argv[1:])
  out = pathlib.Path(_FIRST_STAGE_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  text = first_stage_bench.table(res)
  out.write_text(json.dumps(res, indent=1))
  out.with_suffix(".md").write_text(f"Command: `{res['command']}`\n\n{text}\n")
  print(text)
  print(f"wrote {out}, {out.with_suffix('.md')}")


def _server():
  """`--suite=server`: JSON at `--server_out`, markdown beside it (`--quick`: a small load)."""
  import logging as py_logging  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import server_bench  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)  # (orbax logs each learner save; httpx each request)
  py_logging.getLogger("httpx").setLevel(py_logging.WARNING)
  py_logging.getLogger("mcp").setLevel(py_logging.ERROR)  # (the kill -9 phase's lost sessions)
  out = pathlib.Path(_SERVER_OUT.value)
  quick = _QUICK.value
  out.parent.mkdir(parents=True, exist_ok=True)
  res = server_bench.run(
      _REPO, memories=2_000 if quick else _SERVER_MEMORIES.value,
      scopes=4 if quick else _SERVER_SCOPES.value, clients=4 if quick else _SERVER_CLIENTS.value,
      seconds=3.0 if quick else _SERVER_SECONDS.value, warmup_s=3.0 if quick else 10.0,
      batch_window_ms=_SERVER_WINDOW.value, encoder_batch_tokens=_SERVER_BATCH_TOKENS.value,
      server_args=tuple(_SERVER_ARGS.value))
  res["command"] = "python -m experiments.bench " + " ".join(sys.argv[1:])
  text = server_bench.table(res)
  out.write_text(json.dumps(res, indent=1))
  out.with_suffix(".md").write_text(f"Command: `{res['command']}`\n\n{text}\n")
  print(text)
  print(f"wrote {out}, {out.with_suffix('.md')}")
  return 0 if not (res["errors"] or res["leaks"] or res["missing"]) else 1


# ------------------------------------------------------------------------------------------------
def _verdict(value, target, higher_is_better=True):
  if value is None:
    return None
  ok = value >= target if higher_is_better else value <= target
  return {"value": value, "target": target, "met": bool(ok),
          "direction": ">=" if higher_is_better else "<="}


def _get(results, *path):
  x = results
  for p in path:
    if not isinstance(x, dict) or p not in x:
      return None
    x = x[p]
  return x


def _targets(results, d0):
  scan = _get(results, "scan", d0, "queries_per_s")
  loop = _get(results, "loop", "queries_per_s")
  npy = _get(results, "numpy", "queries_per_s")
  inf = results.get("inference", {})
  b1 = [r["adapter_b1"]["ms_per_query"] for r in inf.values()] if inf else []
  b256 = [r["adapter_b256"]["queries_per_s"] for r in inf.values()] if inf else []
  return {
      "scan_over_loop": _verdict(scan / loop if scan and loop else None,
                                 TARGETS["scan_over_loop"]),
      "scan_over_numpy": _verdict(scan / npy if scan and npy else None,
                                  TARGETS["scan_over_numpy"]),
      "scan_fraction_of_peak": _verdict(_get(results, "roofline", "fraction_of_peak"),
                                        TARGETS["scan_fraction_of_peak"]),
      "seeds_speedup": _verdict(_get(results, "seeds", "speedup"), TARGETS["seeds_speedup"]),
      "adapter_b1_ms": _verdict(max(b1) if b1 else None, TARGETS["adapter_b1_ms"], False),
      "adapter_b256_qps": _verdict(min(b256) if b256 else None, TARGETS["adapter_b256_qps"]),
      "suite_s": _verdict(_get(results, "suite", "suite_s"), TARGETS["suite_s"], False),
      "memory_search_over_bound": _verdict(
          _get(results, "memory", "warm", "search_ms") / _get(results, "memory", "warm",
                                                               "bound_ms")
          if _get(results, "memory", "warm", "bound_ms") else None,
          TARGETS["memory_search_over_bound"], False),
  }


def _print_table(results, d0):
  print("\n| row | measured | note |\n|---|---|---|")
  for d, row in results.get("scan", {}).items():
    print(f"| scan d={d} | {row['queries_per_s']:.1f} q/s ({row['seconds']:.2f} s) | compile "
          f"{row['compile_s']:.1f} s; {row['gflops']:.1f} GFLOP/s |")
  for name in ("loop", "numpy"):
    if name in results:
      r = results[name]
      note = (f"state donated: {r['donated_queries_per_s']:.1f} q/s" if name == "loop" else
              f"first {r['num_queries']} queries")
      print(f"| {name} d={d0} | {r['queries_per_s']:.1f} q/s ({r['seconds']:.2f} s) | {note} |")
  if "seeds" in results:
    r = results["seeds"]
    print(f"| seeds | vmap {r['vmap_s']:.2f} s vs sequential {r['sequential_s']:.2f} s | "
          f"{r['num_seeds']} seeds, {r['devices']} device(s) |")
  print(f"| peak matmul | {results['peak']['gflops']:.1f} GFLOP/s | {results['peak']['by_size']} |")
  for bank, row in results.get("inference", {}).items():
    for name, r in row.items():
      paper = PAPER_TABLE8["adapter_only_s_per_query" if "adapter" in name else
                           "explorer_s_per_query"]
      print(f"| {name} {bank} | {r['ms_per_query']:.4f} ms/query, {r['queries_per_s']:.0f} q/s | "
            f"paper: {paper} s/query |")
  warm = results.get("memory", {}).get("warm")
  if warm:
    print(f"| memory search | {warm['search_ms']:.1f} ms | bound 2 x (encode {warm['encode_ms']:.1f}"
          f" + device search {warm['device_search_ms']:.1f}) = {warm['bound_ms']:.1f} ms, "
          f"{warm['num_memories']} memories |")
  second = results.get("memory", {}).get("second_process", {})
  if second.get("status") == "measured":
    a, b = second["first"], second["second"]
    print(f"| memory first search | {a['first_search_s']:.2f} s, then {b['first_search_s']:.2f} s "
          f"| start to first answer {a['until_first_answer_s']:.1f} s, then "
          f"{b['until_first_answer_s']:.1f} s (compilation cache) |")
  for name in ("encode", "suite"):
    r = results[name]
    val = r.get("sentences_per_s") or r.get("suite_s")
    print(f"| {name} | {f'{val:.1f}' if val else '-'} | {r['status']} |")
  print("\n| target | value | needed | met |\n|---|---|---|---|")
  for name, v in results["targets"].items():
    if v is None:
      print(f"| {name} | not measured | {TARGETS[name]} | - |")
    else:
      print(f"| {name} | {v['value']:.3g} | {v['direction']} {v['target']} | "
            f"{'yes' if v['met'] else 'NO'} |")


if __name__ == "__main__":
  app.run(main)
