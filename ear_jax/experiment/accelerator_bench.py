"""The accelerator column: one run that checks and times the default device (GPU / TPU).

Symbols: `N` seeds (runs), `M` bank rows, `d` dimension, `B` queries per search, `K` candidates.

`run` takes these steps in order and returns one JSON-able dict: `accelerator_paper.run_main_suite`
(`--suite=main` on the device beside a CPU reference, a subprocess under
`JAX_DEFAULT_MATMUL_PRECISION`, default `highest`: no TF32; it runs before this process touches
the device); `environment`; `run_seeds` (episodes/s of `vmap(run_episode)` over `N` seeds, device
and host); `run_search` (exact top-K in float32 and bfloat16 beside the measured bandwidth bound).
`targets` judges them (`TARGETS`: vmapped seeds against the host CPU, search against its bound),
`table` renders the result and `write_section` puts it in BENCHMARKS.md's "GPU" section.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import platform
import time
from typing import Optional, Sequence

from absl import logging
import jax
import jax.numpy as jnp

from ear_jax.core import retrieval
from ear_jax.core import stream as stream_lib
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.experiment import accelerator_paper
from ear_jax.experiment import benchmarking as bm
from ear_jax.experiment import scale_bench
from ear_jax.experiment import sharding

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "libtpu", "flax", "optax", "orbax-checkpoint", "chex", "numpy",
            "tokenizers", "safetensors")
TARGETS = {"seeds_speedup_vs_cpu": (">=", 50.0), "search_ratio_to_bound": ("<=", 2.0)}
HEADING = "## GPU"


def _memory_stats(device) -> dict:
  try:
    return device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except  (a backend without them)
    return {}


def _failed(e: Exception) -> str:
  return f"failed: {type(e).__name__}: {str(e)[:300]}"


def environment() -> dict:
  """The default backend, its devices (kind, count, memory), the host and the versions."""
  devices = jax.devices()
  versions = {"python": platform.python_version()}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return {
      "backend": jax.default_backend(), "device_kind": devices[0].device_kind,
      "device_count": len(devices),
      "device_memory_bytes": _memory_stats(devices[0]).get("bytes_limit"),
      "host_cpus": os.cpu_count(), "host": platform.platform(), "processor": platform.processor(),
      "versions": versions,
      "matmul_precision_default": str(jax.config.jax_default_matmul_precision),
      "env": {k: os.environ[k] for k in ("JAX_DEFAULT_MATMUL_PRECISION", "NVIDIA_TF32_OVERRIDE",
                                         "XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                         "XLA_PYTHON_CLIENT_PREALLOCATE", "JAX_PLATFORMS")
              if k in os.environ},
  }


# ------------------------------------------------------------------------------------------------
def seed_scaling(stream, config, hparams, counts: Sequence[int], reps: int, device=None) -> list:
  """Episodes/s of one jitted `vmap(run_episode)` over `N` seeds for each `N` in `counts`, and the
  ratio to `N = 1` (compile time apart; an `N` that fails ends the list)."""
  device = device or jax.devices()[0]
  rows = []
  with jax.default_device(device):
    stream = stream_lib.to_device(stream)
    for n in counts:
      keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(n))
      run = lambda: sharding.unsharded_episodes(keys, stream, config, hparams)[0].params
      try:
        first = bm.timed(run)
        seconds = bm.min_time(run, reps)
      except Exception as e:  # pylint: disable=broad-except
        rows.append({"seeds": n, "status": _failed(e)})
        break
      rows.append({"seeds": n, "status": "measured", "seconds": seconds,
                   "episodes_per_s": n / seconds, "compile_and_first_s": round(first, 2),
                   "peak_bytes": _memory_stats(device).get("peak_bytes_in_use")})
  base = next((r["episodes_per_s"] for r in rows if r["seeds"] == 1 and "episodes_per_s" in r),
              None)
  for r in rows:
    if base and "episodes_per_s" in r:
      r["ratio_to_1"] = r["episodes_per_s"] / base
  return rows


def run_seeds(num_queries: int, dim: int, counts: Sequence[int], cpu_counts: Sequence[int],
              reps: int) -> dict:
  """`seed_scaling` on the default device and, when that is not the CPU, on the host CPU."""
  stream, config, hparams = bm.bench_stream(num_queries, dim), EARConfig(dim=dim), default_hparams()
  return {"stream": {"num_queries": num_queries, "dim": dim, "K": config.num_candidates,
                     "method": "ear (default EARConfig)",
                     "source": "benchmarking.bench_stream (shaped like LoCoMo training)"},
          "device": seed_scaling(stream, config, hparams, counts, reps),
          "cpu": (seed_scaling(stream, config, hparams, cpu_counts, reps, jax.devices("cpu")[0])
                  if jax.default_backend() != "cpu" else "the device is the CPU")}


def _bank(key, m: int, dim: int, dtype, block: int = 1_000_000):
  """`[m, d]` random unit rows made on the device as `dtype`, in blocks of `block` rows."""
  nb = m // block if m > block and m % block == 0 else 1

  def unit_rows(key):
    x = jax.random.normal(key, (m // nb, dim), jnp.float32)
    return (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(dtype)

  return jax.jit(lambda key: jax.lax.map(unit_rows, jax.random.split(key, nb)).reshape(m, dim))(key)


def run_search(sizes: Sequence[int], dim: int, reps: int, bandwidth_bytes: float,
               chunks: Sequence[Optional[int]] = (None,), dtypes=("float32", "bfloat16"),
               batches: Sequence[int] = (1, 64), k: int = 20) -> dict:
  """Exact `retrieval.top_k_search` over `M x d` rows beside the bandwidth bound of this run:
  ms per call (minimum of `reps`), the bound, their ratio and bytes read per second."""
  bw = scale_bench.measure_bandwidth(bandwidth_bytes)
  search = jax.jit(retrieval.top_k_search, static_argnames=("k", "chunk"))
  rows = []
  for m in sizes:
    for dtype in dtypes:
      try:
        bank = bm.block(_bank(jax.random.PRNGKey(m), m, dim, jnp.dtype(dtype)))
      except Exception as e:  # pylint: disable=broad-except
        rows.append({"rows": m, "dtype": dtype, "status": _failed(e)})
        continue
      valid = jnp.ones((m,), bool)
      nbytes = m * dim * jnp.dtype(dtype).itemsize
      bound = nbytes / (bw["gb_per_s"] * 1e9)
      for b in batches:
        q = _bank(jax.random.PRNGKey(b), b, dim, jnp.float32)
        for chunk in chunks:
          row = {"rows": m, "dtype": dtype, "batch": b, "chunk": chunk}
          fn = lambda: search(q, bank, valid, k=k, chunk=chunk)
          try:
            bm.block(fn())
            sec = bm.min_time(fn, reps)
          except Exception as e:  # pylint: disable=broad-except
            rows.append({**row, "status": _failed(e)})
            continue
          rows.append({**row, "status": "measured", "chunk": chunk or retrieval.block_rows(b),
                       "ms": sec * 1e3, "bound_ms": bound * 1e3, "ratio_to_bound": sec / bound,
                       "gb_per_s": nbytes / sec / 1e9, "bank_bytes": nbytes})
      bank = valid = None  # (freed before the next bank is made)
  return {"bandwidth": bw, "bandwidth_after": scale_bench.measure_bandwidth(bandwidth_bytes),
          "k": k, "dim": dim, "rows": rows}


# ------------------------------------------------------------------------------------------------
def run(repo: pathlib.Path, *, suite_args: Sequence[str], reference: str, tolerance: float,
        precision: str, timeout: float, seed_counts: Sequence[int],
        cpu_seed_counts: Sequence[int], stream_queries: int, dim: int,
        search_sizes: Sequence[int], search_chunks: Sequence[Optional[int]], reps: int,
        bandwidth_bytes: float, skip: Sequence[str] = ()) -> dict:
  """Every step ('main', 'seeds', 'search') not in `skip`, in order, each logged as JSON when it
  ends.

  `suite_args`, `reference`, `tolerance`, `precision` and `timeout` go to
  `accelerator_paper.run_main_suite`; `seed_counts` / `cpu_seed_counts` are `N` on the device /
  the host CPU, on `stream_queries` queries at `d = dim`; `search_sizes` and `search_chunks` are
  `run_search`'s; `reps` repeats each timing (at most 2 for the seeds).
  """
  t0 = time.perf_counter()
  out = {}

  def done(name, value):
    out[name] = value
    logging.info("accelerator step %s (%.0f s in): %s", name, time.perf_counter() - t0,
                 json.dumps(value, default=str))

  if "main" not in skip:
    done("main", accelerator_paper.run_main_suite(repo, suite_args, precision, reference,
                                                  tolerance, timeout))
  done("environment", environment())  # (this process takes the device from here on)
  if "seeds" not in skip:
    done("seeds", run_seeds(stream_queries, dim, seed_counts, cpu_seed_counts, min(reps, 2)))
  if "search" not in skip:
    done("search", run_search(search_sizes, dim, reps, bandwidth_bytes, search_chunks))
  out["wall_s"] = round(time.perf_counter() - t0, 1)
  return out


def _measured(rows) -> list:
  """The measured rows of `rows` (a list, or a string saying why there are none)."""
  return [r for r in rows if isinstance(r, dict) and r.get("status") == "measured"]


def targets(result: dict) -> dict:
  """`TARGETS`' verdicts, each `{value, target, direction, met, what}`: the seeds' speed-up (None
  without both device and CPU rows) and the search at the largest bank and batch 64 (a list)."""
  out = {"seeds_speedup_vs_cpu": None, "search_ratio_to_bound": []}
  seeds = result.get("seeds", {})
  dev = _measured(seeds.get("device", []))
  cpu = _measured(seeds.get("cpu", []))
  if dev and cpu:
    top = max(dev, key=lambda r: r["seeds"])
    v = top["episodes_per_s"] / max(r["episodes_per_s"] for r in cpu)
    out["seeds_speedup_vs_cpu"] = {
        **bm.verdict(v, *TARGETS["seeds_speedup_vs_cpu"]),
        "what": f"device episodes/s at N = {top['seeds']} / the host CPU's best episodes/s "
                f"(N in {[r['seeds'] for r in cpu]})"}
  rows = _measured(result.get("search", {}).get("rows", []))
  m = max((r["rows"] for r in rows), default=None)
  for r in rows:
    if r["rows"] == m and r["batch"] == 64:
      out["search_ratio_to_bound"].append({
          **bm.verdict(r["ratio_to_bound"], *TARGETS["search_ratio_to_bound"]),
          "what": f"{m:,} rows, {r['dtype']}, batch 64, chunk {r['chunk']}"})
  return out


def table(result: dict) -> str:
  """The markdown of one accelerator run (what BENCHMARKS.md's GPU section holds)."""
  env = result.get("environment", {})
  v = env.get("versions", {})
  plugin = ", ".join(f"{k} {v[k]}" for k in v if k.startswith(("jax-cuda", "libtpu"))) or "none"
  mem = env.get("device_memory_bytes")
  lines = [
      f"Written by `{result.get('command', '')}` (wall {result.get('wall_s', '?')} s); rerun it to "
      "refresh this section, never edit it by hand.", "",
      f"Device: {env.get('device_kind')} x {env.get('device_count')} (backend "
      f"{env.get('backend')}{f', {mem / 2**30:.0f} GiB usable' if mem else ''}); host "
      f"{env.get('host_cpus')} CPUs. jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, plugin: "
      f"{plugin}; flax {v.get('flax')}, optax {v.get('optax')}, orbax-checkpoint "
      f"{v.get('orbax-checkpoint')}, Python {v.get('python')}. Environment: "
      f"{env.get('env') or 'nothing set'}. The seeds and the search run in the bench's own process "
      f"at matmul precision {env.get('matmul_precision_default')} (None: JAX's default, which lets "
      "float32 products use TF32 on recent NVIDIA GPUs and bfloat16 passes on TPU); the paper run "
      "at the precision stated with it."]
  m = result.get("main")
  if m:
    dev, ref = m.get("device", {}), m.get("reference", {})
    lines += ["", f"**Paper run on the device**: `python -m experiments.run {' '.join(m['args'])}` "
              f"with `JAX_DEFAULT_MATMUL_PRECISION={m['precision']}`: {dev.get('status')}"
              + (f", {dev['wall_s']} s (process)" if dev.get("wall_s") else "")
              + f". CPU reference: {ref.get('source')}"
              + (f" (`{ref['command']}`" if ref.get("command") else " (")
              + f"; jax {(ref.get('versions') or {}).get('jax')}). Tolerance: |device mean - CPU "
              f"mean| <= {m['tolerance_points']} points over the seeds; 'equal seeds': per-seed "
              "values equal to the 4 decimals results.json keeps."]
    if m.get("rows"):
      lines += ["", "| run | metric | CPU mean | device mean | difference | largest per-seed "
                "difference | equal seeds | within tolerance |",
                "|---|---|---|---|---|---|---|---|"]
      lines += [f"| {r['run']} | {r['metric']} | {r['cpu_mean']:.2f} | {r['device_mean']:.2f} | "
                f"{r['diff']:+.2f} | {r['max_seed_diff']:.2f} | {r['seeds_equal']} / {r['seeds']} "
                f"| {'yes' if r['within_tolerance'] else 'NO'} |"
                for r in m["rows"] if r["metric"].startswith("recall_")]
    else:
      lines.append(f"Not compared: {m.get('status')}.")
  s = result.get("seeds")
  if s:
    st = s["stream"]
    lines += ["", f"**Seeds in one call**: one jitted `vmap(run_episode)` over N seeds "
              f"(`sharding.unsharded_episodes`), {st['method']}, {st['num_queries']} queries, "
              f"d = {st['dim']}, K = {st['K']} ({st['source']}); minimum over repetitions, "
              "compilation apart.", "",
              "| where | N | seconds | episodes/s | ratio to N = 1 | compile + first call (s) |",
              "|---|---|---|---|---|---|"]
    for where, label in (("device", env.get("device_kind", "device")), ("cpu", "host CPU")):
      for r in s[where] if isinstance(s.get(where), list) else []:
        if r["status"] != "measured":
          lines.append(f"| {label} | {r['seeds']} | {r['status']} | | | |")
          continue
        ratio = f"{r['ratio_to_1']:.1f}x" if "ratio_to_1" in r else "-"
        lines.append(f"| {label} | {r['seeds']:,} | {r['seconds']:.3f} | "
                     f"{r['episodes_per_s']:.2f} | {ratio} | {r['compile_and_first_s']} |")
  se = result.get("search")
  if se:
    bw = se["bandwidth"]
    lines += ["", f"**Exact candidate search** (`retrieval.top_k_search`, K = {se['k']}, "
              f"d = {se['dim']}, random unit rows): bound = bank bytes / bandwidth, the bandwidth "
              f"measured in this run by a reduction over a resident {bw['bytes'] / 1e9:.2f} GB "
              f"array: {bw['gb_per_s']:.0f} GB/s ({se['bandwidth_after']['gb_per_s']:.0f} GB/s "
              "at the end).", "",
              "| rows | dtype | batch | chunk | ms / call | bound (ms) | ratio to bound | GB/s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in se["rows"]:
      if r["status"] != "measured":
        lines.append(f"| {r['rows']:,} | {r['dtype']} | {r.get('batch', '')} | "
                     f"{r.get('chunk') or ''} | {r['status']} | | | |")
        continue
      lines.append(f"| {r['rows']:,} | {r['dtype']} | {r['batch']} | {r['chunk']:,} | "
                   f"{r['ms']:.3f} | {r['bound_ms']:.3f} | {r['ratio_to_bound']:.2f} | "
                   f"{r['gb_per_s']:.0f} |")
  tg = result.get("targets") or targets(result)
  sp, search = tg.get("seeds_speedup_vs_cpu"), tg.get("search_ratio_to_bound", [])
  if sp or search:
    lines += ["", "| target | value | needed | met |", "|---|---|---|---|"]
    if sp:
      lines.append(f"| vmapped seeds: {sp['what']} | {sp['value']:.1f}x | >= {sp['target']:.0f}x "
                   f"| {'yes' if sp['met'] else 'NO'} |")
    lines += [f"| exact search: {r['what']} | {r['value']:.2f}x the bound | <= {r['target']:.0f}x "
              f"| {'yes' if r['met'] else 'NO'} |" for r in search]
  return "\n".join(lines)


def write_section(path, text: str, heading: str = HEADING) -> None:
  """Replaces the body of `path`'s `heading` section with `text`, or appends the section."""
  path = pathlib.Path(path)
  lines = path.read_text().splitlines()
  body = [heading, "", *text.splitlines(), ""]
  if heading in lines:
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    lines[start:end] = body
  else:
    lines += ["", *body]
  path.write_text("\n".join(lines).rstrip("\n") + "\n")
