"""The accelerator column: one run that checks and times the default device (GPU / TPU).

Symbols: `N` seeds (runs), `M` bank rows, `d` dimension, `B` queries per search, `K` candidates.

`run` takes these steps in order and returns one JSON-able dict (`accelerator_table` renders it):
`environment`; `run_core_tests` (the core's fast tests on the device, a subprocess);
`accelerator_paper.run_main_suite` (`--suite=main` on the device beside a CPU reference);
`run_seeds` (episodes/s of `vmap(run_episode)` over `N` seeds, device and host); `run_search`
(exact top-K in float32 and bfloat16 beside the measured bandwidth bound). The two subprocess
steps come first, before this process touches the device, under `JAX_DEFAULT_MATMUL_PRECISION`
(default `highest`: no TF32).
"""
from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import shlex
import subprocess
import sys
import time
from typing import Optional, Sequence

from absl import logging

from ear_jax.experiment import accelerator_paper

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "libtpu", "flax", "optax", "orbax-checkpoint", "chex", "numpy",
            "tokenizers", "safetensors")
_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def _versions() -> dict:
  out = {"python": platform.python_version()}
  for name in PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


def environment() -> dict:
  """The default backend, its devices (kind, count, memory), the host and the versions."""
  import jax  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  stats = {}
  try:
    stats = devices[0].memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    pass
  return {
      "backend": jax.default_backend(), "device_kind": devices[0].device_kind,
      "device_count": len(devices), "device_memory_bytes": stats.get("bytes_limit"),
      "host_cpus": os.cpu_count(), "host": platform.platform(), "processor": platform.processor(),
      "versions": _versions(),
      "matmul_precision_default": str(jax.config.jax_default_matmul_precision),
      "env": {k: os.environ[k] for k in ("JAX_DEFAULT_MATMUL_PRECISION", "NVIDIA_TF32_OVERRIDE",
                                         "XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                         "XLA_PYTHON_CLIENT_PREALLOCATE", "JAX_PLATFORMS")
              if k in os.environ},
  }


# ------------------------------------------------------------------------------------------------
def core_test_files(repo: pathlib.Path) -> list[str]:
  """`tests/test_*.py` (relative to `repo`) that import the project only from `ear_jax.core`."""
  out = []
  for path in sorted((repo / "tests").glob("test_*.py")):
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        mods.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        mods.add(node.module)
    ours = {m for m in mods if m.split(".")[0] in ("ear_jax", "experiments")}
    if ours and all(m == "ear_jax.core" or m.startswith("ear_jax.core.") for m in ours):
      out.append(str(path.relative_to(repo)))
  return out


def run_core_tests(repo: pathlib.Path, files: Sequence[str], precision: str,
                   timeout: float, workers: int = 1) -> dict:
  """`pytest -m "not slow"` on `files` in a subprocess on the default device (`workers` xdist).

  Returns:
    `status` ('passed', 'failed', 'timed out'), the summary counts, failed test ids, seconds, the
    command and the precision.
  """
  cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider",
         *(["-n", str(workers)] if workers > 1 else []), *files]
  out = {"command": shlex.join(["python"] + cmd[1:]), "precision": precision,
         "files": list(files)}
  t = time.perf_counter()
  try:
    proc = subprocess.run(cmd, cwd=str(repo), env=accelerator_paper.subprocess_env(precision),
                          text=True, capture_output=True, timeout=timeout)
  except subprocess.TimeoutExpired as e:
    tail = (e.stdout or b"")[-2000:]
    return {**out, "status": f"timed out after {timeout:.0f} s", "seconds": timeout,
            "tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
  text = proc.stdout + proc.stderr
  last = [l for l in text.splitlines() if _SUMMARY.search(l) and (" in " in l)]
  counts = {}
  for n, what in _SUMMARY.findall(last[-1] if last else ""):
    counts["errors" if what.startswith("error") else what] = int(n)
  return {**out, "status": "passed" if proc.returncode == 0 else f"failed (rc {proc.returncode})",
          "counts": counts, "seconds": round(time.perf_counter() - t, 1),
          "failed_tests": re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)[:50],
          "tail": text[-1500:] if proc.returncode else ""}


# ------------------------------------------------------------------------------------------------
def _peak_bytes(device) -> Optional[int]:
  try:
    return (device.memory_stats() or {}).get("peak_bytes_in_use")
  except Exception:  # pylint: disable=broad-except
    return None


def seed_scaling(stream, config, hparams, counts: Sequence[int], reps: int, device=None) -> list:
  """Episodes/s of one jitted `vmap(run_episode)` over `N` seeds for each `N` in `counts`
  (compile time apart; an `N` that fails ends the list)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ear_jax.core import stream as stream_lib  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import benchmarking as bm  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import sharding  # pylint: disable=g-import-not-at-top
  device = device or jax.devices()[0]
  rows = []
  with jax.default_device(device):
    stream = stream_lib.to_device(stream)
    for n in counts:
      keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(n))
      run = lambda: sharding.unsharded_episodes(keys, stream, config, hparams)[0].params
      try:
        t = time.perf_counter()
        bm.block(run())
        first = time.perf_counter() - t
        seconds = bm.min_time(run, reps)
      except Exception as e:  # pylint: disable=broad-except
        rows.append({"seeds": n, "status": f"failed: {type(e).__name__}: {str(e)[:300]}"})
        break
      rows.append({"seeds": n, "status": "measured", "seconds": seconds,
                   "episodes_per_s": n / seconds, "compile_and_first_s": round(first, 2),
                   "peak_bytes": _peak_bytes(device)})
  base = next((r["episodes_per_s"] for r in rows if r.get("seeds") == 1 and "episodes_per_s" in r),
              None)
  for r in rows:
    if base and "episodes_per_s" in r:
      r["ratio_to_1"] = r["episodes_per_s"] / base
  return rows


def run_seeds(num_queries: int, dim: int, counts: Sequence[int], cpu_counts: Sequence[int],
              reps: int) -> dict:
  """`seed_scaling` on the default device and, when that is not the CPU, on the host CPU."""
  import jax  # pylint: disable=g-import-not-at-top
  from ear_jax.core.config import EARConfig, default_hparams  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import benchmarking as bm  # pylint: disable=g-import-not-at-top
  stream, config, hparams = bm.bench_stream(num_queries, dim), EARConfig(dim=dim), default_hparams()
  out = {"stream": {"num_queries": num_queries, "dim": dim, "K": config.num_candidates,
                    "method": "ear (default EARConfig)",
                    "source": "benchmarking.bench_stream (shaped like LoCoMo training)"},
         "device": seed_scaling(stream, config, hparams, counts, reps)}
  if jax.default_backend() != "cpu":
    out["cpu"] = seed_scaling(stream, config, hparams, cpu_counts, reps, jax.devices("cpu")[0])
  else:
    out["cpu"] = "the device is the CPU"
  return out


# ------------------------------------------------------------------------------------------------
def _bank(key, m: int, dim: int, dtype, block: int = 1_000_000):
  """`[m, d]` random unit rows made on the device as `dtype`, in blocks of `block` rows."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  nb = m // block if m > block and m % block == 0 else 1

  def unit_rows(key):
    x = jax.random.normal(key, (m // nb, dim), jnp.float32)
    return (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(dtype)

  make = jax.jit(lambda key: jax.lax.map(unit_rows, jax.random.split(key, nb)).reshape(m, dim))
  return make(key)


def run_search(sizes: Sequence[int], dim: int, dtypes: Sequence[str], batches: Sequence[int],
               k: int, reps: int, bandwidth_bytes: float, chunks: Sequence[Optional[int]] = (None,)
               ) -> dict:
  """Exact `retrieval.top_k_search` over `M x d` rows beside the bandwidth bound of this run:
  ms per call (minimum of `reps`), the bound, their ratio and bytes read per second."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ear_jax.core import retrieval  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import benchmarking as bm  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import scale_bench  # pylint: disable=g-import-not-at-top
  bw = scale_bench.measure_bandwidth(bandwidth_bytes)
  search = jax.jit(retrieval.top_k_search, static_argnames=("k", "chunk"))
  rows = []
  for m in sizes:
    for dtype in dtypes:
      try:
        bank = _bank(jax.random.PRNGKey(m), m, dim, jnp.dtype(dtype))
        valid = jnp.ones((m,), bool)
        bm.block(bank)
      except Exception as e:  # pylint: disable=broad-except
        rows.append({"rows": m, "dtype": dtype, "status": f"failed: {type(e).__name__}: "
                                                          f"{str(e)[:200]}"})
        continue
      nbytes = m * dim * jnp.dtype(dtype).itemsize
      for b in batches:
        q = _bank(jax.random.PRNGKey(b), b, dim, jnp.float32)
        for chunk in chunks:
          fn = lambda q=q, bank=bank, valid=valid, chunk=chunk: search(q, bank, valid, k=k,
                                                                        chunk=chunk)
          try:
            bm.block(fn())
            sec = bm.min_time(fn, reps)
          except Exception as e:  # pylint: disable=broad-except
            rows.append({"rows": m, "dtype": dtype, "batch": b, "chunk": chunk,
                         "status": f"failed: {type(e).__name__}: {str(e)[:200]}"})
            continue
          bound = nbytes / (bw["gb_per_s"] * 1e9)
          rows.append({"rows": m, "dtype": dtype, "batch": b, "status": "measured",
                       "chunk": chunk or retrieval.block_rows(b), "ms": sec * 1e3,
                       "bound_ms": bound * 1e3, "ratio_to_bound": sec / bound,
                       "gb_per_s": nbytes / sec / 1e9, "bank_bytes": nbytes})
      bank = valid = None  # (freed before the next bank is made)
  return {"bandwidth": bw, "bandwidth_after": scale_bench.measure_bandwidth(bandwidth_bytes),
          "k": k, "dim": dim, "rows": rows}


# ------------------------------------------------------------------------------------------------
def run(repo: pathlib.Path, *, suite_args: Sequence[str], reference: str, tolerance: float,
        precision: str, test_files: Optional[Sequence[str]], test_workers: int,
        test_timeout: float,
        suite_timeout: float, seed_counts: Sequence[int], cpu_seed_counts: Sequence[int],
        stream_queries: int, dim: int, search_sizes: Sequence[int], search_dtypes: Sequence[str],
        search_batches: Sequence[int], search_chunks: Sequence[Optional[int]], k: int, reps: int,
        bandwidth_bytes: float, skip: Sequence[str] = ()) -> dict:
  """Every step not in `skip`, in order; each step's result is logged as JSON when it ends."""
  t0 = time.perf_counter()
  out = {}

  def done(name, value):
    out[name] = value
    logging.info("accelerator step %s (%.0f s in): %s", name, time.perf_counter() - t0,
                 json.dumps(value, default=str))

  if "tests" not in skip:
    files = core_test_files(repo) if test_files is None else list(test_files)
    done("tests", run_core_tests(repo, files, precision, test_timeout, test_workers))
  if "main" not in skip:
    done("main", accelerator_paper.run_main_suite(repo, suite_args, precision, reference, tolerance, suite_timeout))
  done("environment", environment())  # (this process takes the device from here on)
  if "seeds" not in skip:
    done("seeds", run_seeds(stream_queries, dim, seed_counts, cpu_seed_counts, min(reps, 2)))
  if "search" not in skip:
    done("search", run_search(search_sizes, dim, search_dtypes, search_batches, k, reps,
                              bandwidth_bytes, search_chunks))
  out["wall_s"] = round(time.perf_counter() - t0, 1)
  return out
