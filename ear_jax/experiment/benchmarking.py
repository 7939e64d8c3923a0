"""Speed measurements of ear_jax: the default rows of `experiments.bench` and the timing helpers of
every suite.

`run` measures the rows (`ROWS`, and the scan's `roofline` against the measured matmul peak),
`targets` judges them against `TARGETS` and `table` renders them. Every row times the jitted
functions users call (training scan and loop, sharded sweeps, adapter-only and explorer-assisted
retrieval). Timings are the minimum over repetitions (the least disturbed run on a shared
machine).

Symbols: `n` queries, `M` bank rows, `d` dimension, `K` candidates, `s` slate size.
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Callable, Collection, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import critic as critic_lib
from ear_jax.core import episode
from ear_jax.core import learner
from ear_jax.core import policies
from ear_jax.core import retrieval
from ear_jax.core import stream as stream_lib
from ear_jax.core.adapter import AdapterParams
from ear_jax.core.config import EARConfig, HParams, default_hparams
from ear_jax.core.stream import Stream, make_stream
from ear_jax.experiment import sharding

ROWS = ("scan", "loop", "seeds", "inference", "encode", "memory", "suite")
PAPER_TABLE8 = {"adapter_only_s_per_query": 2.30, "explorer_s_per_query": 16.88,
                "note": "paper Table 8, per query, including its LLM calls"}
TARGETS = {  # name -> (direction, threshold)
    "scan_over_loop": (">=", 5.0),
    "scan_fraction_of_peak": (">=", 0.30), "seeds_speedup": (">=", 4.0),
    "adapter_b1_ms": ("<=", 1.0), "adapter_b256_qps": (">=", 10000.0), "suite_s": ("<=", 60.0),
    "memory_search_over_bound": ("<=", 1.0)}


# ------------------------------------------------------------------------------------------------
def unit(x: np.ndarray) -> np.ndarray:
  """`x`'s rows scaled to unit norm, as float32."""
  return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def bench_stream(num_queries: int, dim: int, k: int = 20, seed: int = 0) -> Stream:
  """A fixed synthetic stream shaped like LoCoMo training: unit vectors, 1-2 gold, some padding."""
  rng = np.random.default_rng([seed, dim])
  q = unit(rng.normal(size=(num_queries, dim)))
  c = unit(q[:, None, :] + 4.5 * rng.normal(size=(num_queries, k, dim)) / np.sqrt(dim))
  num_valid = np.where(rng.random(num_queries) < 0.9, k, rng.integers(8, k + 1, num_queries))
  mask = np.arange(k)[None] < num_valid[:, None]
  gold = np.zeros((num_queries, k), bool)
  for i in range(num_queries):
    gold[i, rng.choice(num_valid[i], size=rng.integers(1, 3), replace=False)] = True
  return make_stream(q, np.where(mask[..., None], c, 0.0), mask, gold)


def ear_flops_per_query(config: EARConfig) -> dict:
  """Floating-point operations of one EAR training query (multiply-add = 2), by component.

  Counted: the `d x d` adapter matmuls (forward and weight gradient), the logits, the Explorer's
  Gram matrix and the similarity selection of Eq. (15); O(K d) elementwise work is left out.
  Returns FLOPs by component and their `total`.
  """
  d, k, b, c = config.dim, config.num_candidates, config.replay_size, config.buffer_capacity
  rows_q = 1 + (b if config.use_replay else 0)  # current query + replayed queries (W_q)
  rows_m = k * rows_q  # their candidates (W_m)
  adapter_fwd = 2 * (rows_q + rows_m) * d * d
  out = {
      "adapter_forward": adapter_fwd,
      "adapter_weight_grad": adapter_fwd,
      "logits": 2 * rows_m * d,
      "explorer_gram": 2 * k * k * d if policies.train_slate_policy(config.train_slate)
                      is policies.explorer_slates else 0,
      "replay_similarity": 2 * c * d if config.use_replay else 0,
  }
  out["total"] = int(sum(out.values()))
  return out


block = jax.block_until_ready  # waits for every array of its argument


def timed(fn: Callable[[], object]) -> float:
  """Seconds of one call of `fn`, its result waited for."""
  t = time.perf_counter()
  block(fn())
  return time.perf_counter() - t


def min_time(fn: Callable[[], object], reps: int) -> float:
  """The minimum over `reps` calls of `fn` (waited for), in seconds."""
  return min(timed(fn) for _ in range(reps))


def percentiles(seconds: Sequence[float]) -> dict:
  """p50 / p90 / p99 / min in milliseconds (None without timings), and the count, of `seconds`."""
  if not len(seconds):
    return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "min_ms": None, "n": 0}
  a = np.asarray(seconds) * 1e3
  return {**{f"p{q}_ms": float(np.percentile(a, q)) for q in (50, 90, 99)},
          "min_ms": float(a.min()), "n": len(a)}


def timed_calls(fn: Callable[[int], object], calls: int, warmup: int = 0) -> dict:
  """`percentiles` of `fn(i)` for `i < calls`, after untimed calls `fn(i)` for `i < warmup`."""
  for i in range(warmup):
    fn(i)
  return percentiles([timed(lambda i=i: fn(i)) for i in range(calls)])


def measure_peak(sizes: Sequence[int] = (768, 1024, 1536), reps: int = 3) -> dict:
  """Peak fp32 matmul GFLOP/s: a jitted square `n x n` matmul, the best over sizes and reps."""
  out = {}
  f = jax.jit(jnp.matmul)
  for n in sizes:
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    block(f(a, b))
    inner = max(1, int(4e9 / (2 * n ** 3)))

    def run():
      r = None
      for _ in range(inner):
        r = f(a, b)
      return r

    out[n] = 2 * n ** 3 * inner / min_time(run, reps) / 1e9
  return {"gflops": max(out.values()), "by_size": {str(k): round(v, 1) for k, v in out.items()}}


def machine() -> dict:
  """The host, the JAX backend and its devices."""
  return {"platform": platform.platform(), "processor": platform.processor(),
          "cpu_count": os.cpu_count(), "backend": jax.default_backend(),
          "devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


_run_episode = jax.jit(episode.run_episode, static_argnames=("config",))
_train_batch = jax.jit(learner.train_batch, static_argnames=("config",))
_retrieve = jax.jit(retrieval.retrieve, static_argnames=("k", "slate_size"))
_explorer_retrieve = jax.jit(retrieval.explorer_retrieve,
                             static_argnames=("k", "num_rounds", "slate_size"))


# ------------------------------------------------------------------------------------------------
def run_scan(stream: Stream, config: EARConfig, hparams: HParams, reps: int) -> dict:
  """Jitted `episode.run_episode` over the whole stream (compile timed apart), FLOPs and rate."""
  key = jax.random.PRNGKey(0)
  t = time.perf_counter()
  compiled = _run_episode.lower(key, stream, config, hparams).compile()
  compile_s = time.perf_counter() - t
  block(compiled(key, stream, hparams))
  seconds = min_time(lambda: compiled(key, stream, hparams), reps)
  n = stream.queries.shape[0]
  flops = ear_flops_per_query(config)
  return {"queries_per_s": n / seconds, "seconds": seconds, "compile_s": compile_s,
          "num_queries": n, "flops_per_query": flops, "gflops": flops["total"] * n / seconds / 1e9}


def loop_batches(stream: Stream, config: EARConfig, key: jax.Array):
  """The stream cut into batches exactly as `train_stream` does, as device arrays (not timed)."""
  n, b = stream.queries.shape[0], config.batch_size
  k_init, keys = episode.episode_keys(key, n)
  nb = -(-n // b)
  idx = np.minimum(np.arange(nb * b), n - 1)
  where = (np.arange(nb * b) < n).reshape(nb, b)
  host = jax.tree_util.tree_map(lambda x: np.asarray(x)[idx].reshape((nb, b) + x.shape[1:]),
                                (np.asarray(keys), stream))
  batches = [jax.device_put(jax.tree_util.tree_map(lambda x: x[i], host) + (where[i],))
             for i in range(nb)]
  return k_init, batches


def run_loop(stream: Stream, config: EARConfig, hparams: HParams, reps: int) -> dict:
  """`learner.train_batch` (jitted) called once per batch from Python, then with the state donated
  (what is left is the per-call dispatch); its parameters' largest difference from the scan's."""
  k_init, batches = loop_batches(stream, config, jax.random.PRNGKey(0))
  init = lambda: learner.init_learner(k_init, config)
  # No shared leaves (W_q and W_m start as the same zeros array; a buffer cannot be donated twice).
  fresh = lambda: jax.tree_util.tree_map(jnp.copy, init())
  donated = jax.jit(learner.train_batch, static_argnames=("config",), donate_argnames=("state",))
  last = {}

  def loop(step, make):
    state = make()
    for keys, batch, where in batches:
      state, _ = step(state, keys, batch, where, config, hparams)
    last["params"] = state.params
    return state

  compile_s = timed(lambda: _train_batch(init(), *batches[0], config, hparams))
  seconds = min_time(lambda: loop(_train_batch, init), reps)
  scan_params = _run_episode(jax.random.PRNGKey(0), stream, config, hparams)[0].params
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree_util.tree_leaves(last["params"]), jax.tree_util.tree_leaves(scan_params)))
  block(donated(fresh(), *batches[0], config, hparams))
  seconds_donated = min_time(lambda: loop(donated, fresh), reps)
  n = stream.queries.shape[0]
  return {"queries_per_s": n / seconds, "seconds": seconds, "compile_s": compile_s,
          "donated_queries_per_s": n / seconds_donated, "donated_seconds": seconds_donated,
          "max_abs_param_diff_vs_scan": diff}


def run_seeds(stream: Stream, config: EARConfig, hparams: HParams, num_seeds: int,
              reps: int) -> dict:
  """`sharding.sharded_episodes` over `num_seeds` seeds vs as many jitted `run_episode` calls."""
  keys = np.asarray(jax.vmap(jax.random.PRNGKey)(jnp.arange(num_seeds)))
  compile_s = timed(lambda: sharding.sharded_episodes(keys, stream, config, hparams))
  vmapped = min_time(lambda: sharding.sharded_episodes(keys, stream, config, hparams), reps)
  block(_run_episode(jnp.asarray(keys[0]), stream, config, hparams))
  seq = min_time(lambda: [_run_episode(jnp.asarray(k), stream, config, hparams)[0].params
                          for k in keys], reps)
  return {"num_seeds": num_seeds, "vmap_s": vmapped, "sequential_s": seq,
          "speedup": seq / vmapped, "devices": jax.device_count(), "vmap_compile_s": compile_s}


# ------------------------------------------------------------------------------------------------
def run_inference(dim: int, bank_sizes: Sequence[int], batches: Sequence[int], reps: int,
                  calls_b1: int) -> dict:
  """Adapter-only and explorer-assisted retrieval from random unit banks, top-K search included.

  Batch 1: median of `calls_b1` calls (latency, dispatch included); larger batches: minimum of
  `max(reps, 3)`.
  """
  config, hparams, critic = EARConfig(dim=dim), default_hparams(), critic_lib.default_critic()
  rng = np.random.default_rng(1)
  weights = lambda: jnp.asarray(0.02 * rng.normal(size=(dim, dim)), jnp.float32)
  params = AdapterParams(w_q=weights(), w_m=weights())
  out = {}
  for m in bank_sizes:
    bank = jnp.asarray(unit(rng.normal(size=(m, dim))))
    valid = jnp.ones((m,), bool)
    row = {}
    for b in batches:
      q = jnp.asarray(unit(rng.normal(size=(b, dim))))
      gold = jnp.asarray(rng.random((b, m)) < 2.0 / m)
      key = jax.random.PRNGKey(b)
      fa = lambda: _retrieve(params, q, bank, valid, k=config.num_candidates,
                              slate_size=config.slate_size)
      fe = lambda: _explorer_retrieve(key, params, q, bank, valid, gold, config.num_candidates,
                                      config.num_rounds, config.slate_size, hparams, critic)
      for name, fn in (("adapter", fa), ("explorer", fe)):
        block(fn())
        sec = (float(np.median([timed(fn) for _ in range(calls_b1)])) if b == 1
               else min_time(fn, max(reps, 3)))
        row[f"{name}_b{b}"] = {"ms_per_call": sec * 1e3, "ms_per_query": sec * 1e3 / b,
                               "queries_per_s": b / sec}
    out[f"bank{m}"] = row
  return out


# ------------------------------------------------------------------------------------------------
def _locomo_file(data_dir: Optional[str]) -> Optional[pathlib.Path]:
  """LoCoMo's file in `data_dir`, or None when there is none."""
  path = pathlib.Path(data_dir) / "locomo10.json" if data_dir else None
  return path if path is not None and path.is_file() else None


def locomo_turns(num: int, data_dir: Optional[str]) -> list[str]:
  """`num` LoCoMo turns ('speaker: text'), or synthetic sentences without the data."""
  path = _locomo_file(data_dir)
  texts = []
  if path is not None:
    for conv in json.load(open(path)):
      for key, turns in conv["conversation"].items():
        if key.startswith("session_") and isinstance(turns, list):
          texts += [f"{t['speaker']}: {t['text']}" for t in turns]
      if len(texts) >= num:
        break
  while len(texts) < num:
    texts.append(f"Speaker {len(texts)}: I went hiking with my dog near the lake last weekend.")
  return texts[:num]


def run_encode(num_sentences: int, data_dir: Optional[str]) -> dict:
  """MiniLM sentences/s on LoCoMo turns (synthetic sentences without the data), no cache."""
  from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
  texts = locomo_turns(num_sentences, data_dir)
  try:
    enc = encoders.load_encoder("minilm")
  except Exception as e:  # pylint: disable=broad-except
    return {"status": f"not measured: MiniLM not available ({e})"}
  enc.encode_new(texts[:32], progress=False)  # compile the shape buckets used below
  enc.encode_new(texts, progress=False)
  seconds = timed(lambda: enc.encode_new(texts, progress=False))
  return {"status": "measured", "sentences_per_s": len(texts) / seconds, "seconds": seconds,
          "num_sentences": len(texts),
          "source": "LoCoMo turns" if _locomo_file(data_dir) else "synthetic sentences"}


def run_experiment(repo: pathlib.Path, args: Sequence[str], timeout: float,
                   env: Optional[dict] = None) -> dict:
  """`python -m experiments.run <args>` from `repo` with a temporary `--workdir`.

  Returns:
    `status` ('ran', 'experiments/run.py not present', 'timed out after T s' or 'failed (rc N)'),
    `command` (the workdir as `<tmp>`), `wall_s` and `results` (its results.json) when it ran,
    else the output's `tail`.
  """
  if not (repo / "experiments" / "run.py").is_file():
    return {"command": "python -m experiments.run", "status": "experiments/run.py not present"}
  with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "experiments.run", *args, f"--workdir={tmp}/run",
           "--progress=false"]
    out = {"command": " ".join(cmd[1:]).replace(tmp, "<tmp>")}
    t = time.perf_counter()
    try:
      proc = subprocess.run(cmd, cwd=str(repo), env=env, capture_output=True, text=True,
                            timeout=timeout)
    except subprocess.TimeoutExpired:
      return {**out, "status": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
      return {**out, "status": f"failed (rc {proc.returncode})",
              "tail": (proc.stdout + proc.stderr)[-1500:]}
    return {**out, "status": "ran", "wall_s": time.perf_counter() - t,
            "results": json.loads((pathlib.Path(tmp) / "run" / "results.json").read_text())}


def run_suite(repo: pathlib.Path, data_dir: Optional[str], timeout: int) -> dict:
  """Wall time of `python -m experiments.run --benchmark=locomo --suite=main`, run from `repo`."""
  if _locomo_file(data_dir) is None:
    return {"status": "not measured: locomo10.json not found"}
  run = run_experiment(repo, ["--benchmark=locomo", "--suite=main", f"--data_dir={data_dir}"],
                       timeout)
  if run["status"] != "ran":
    return {"status": f"not measured: {run['status']}: {run.get('tail', '')[-500:]}",
            "command": run["command"]}
  return {"status": "measured", "suite_s": float(run["results"]["suite_wall_seconds"]["main"]),
          "process_wall_s": run["wall_s"], "command": run["command"],
          "note": "suite_s = the runner's own timing of the main suite (embeddings read from the "
                  "encoder cache; includes JIT compilation); process_wall_s adds interpreter "
                  "start-up and data loading"}


# ------------------------------------------------------------------------------------------------
def run(repo: pathlib.Path, data_dir: Optional[str], *, num_queries: int, dims: Sequence[int],
        reps: int, num_seeds: int, inference_dim: int, inference_calls: int,
        peak_sizes: Sequence[int], peak_reps: int, suite_timeout: int,
        skip: Collection[str] = ()) -> dict:
  """The rows of `ROWS` not in `skip`, their `roofline` and `targets`.

  The training rows run on `bench_stream(num_queries, d)` for each `d` of `dims` (`loop` and
  `seeds` at `dims[0]`); `encode` and `memory` read LoCoMo turns from `data_dir`, `suite` runs
  `experiments.run` from `repo`. The matmul peak is the best of one measure before the scan and
  one after.
  """
  d0, hparams = dims[0], default_hparams()
  streams = {d: stream_lib.to_device(bench_stream(num_queries, d)) for d in dims}
  configs = {d: EARConfig(dim=d) for d in dims}
  res = {"machine": machine(), "paper_table8": PAPER_TABLE8,
         "stream": {"num_queries": num_queries, "K": 20, "s": 5, "T": 4, "B": 4, "batch_size": 4,
                    "dims": list(dims), "method": "ear (default EARConfig)"}}
  res["peak"] = measure_peak(peak_sizes, reps=peak_reps)
  if "scan" not in skip:
    res["scan"] = {}
    for d in dims:
      row = res["scan"][str(d)] = run_scan(streams[d], configs[d], hparams, reps)
      print(f"scan d={d}: {row['queries_per_s']:.1f} q/s, compile {row['compile_s']:.1f} s",
            flush=True)
  res["peak"] = max(res["peak"], measure_peak(peak_sizes, reps=peak_reps),
                    key=lambda p: p["gflops"])
  if "loop" not in skip:
    res["loop"] = run_loop(streams[d0], configs[d0], hparams, reps)
    print(f"loop d={d0}: {res['loop']['queries_per_s']:.1f} q/s", flush=True)
  if "seeds" not in skip:
    res["seeds"] = run_seeds(streams[d0], configs[d0], hparams, num_seeds, 1)
    print(f"seeds: speed-up {res['seeds']['speedup']:.2f}x", flush=True)
  if "inference" not in skip:
    res["inference"] = run_inference(inference_dim, (600, 250), (1, 256), reps, inference_calls)
  skipped = {"status": "skipped (--quick or --skip)"}
  res["encode"] = skipped if "encode" in skip else run_encode(512, data_dir)
  if "memory" in skip:
    res["memory"] = skipped
  else:
    from ear_jax.experiment import memory_latency  # pylint: disable=g-import-not-at-top
    res["memory"] = {"warm": memory_latency.warm_search(data_dir=data_dir),
                     "second_process": memory_latency.second_process(data_dir=data_dir)}
    print(f"memory: {json.dumps(res['memory'])}", flush=True)
  res["suite"] = skipped if "suite" in skip else run_suite(repo, data_dir, suite_timeout)
  if "scan" in res:
    top = res["scan"][str(max(dims))]
    res["roofline"] = {"dim": max(dims), "flops_per_query": top["flops_per_query"],
                       "achieved_gflops": top["gflops"], "peak_gflops": res["peak"]["gflops"],
                       "fraction_of_peak": top["gflops"] / res["peak"]["gflops"]}
  res["targets"] = targets(res)
  return res


def targets(res: dict) -> dict:
  """Each of `TARGETS`: `{value, target, met, direction}`, or None when its rows were not run."""
  get = lambda row, key: res.get(row, {}).get(key)
  ratio = lambda a, b: a / b if a and b else None
  scan = res.get("scan", {}).get(str(res["stream"]["dims"][0]), {}).get("queries_per_s")
  inference = res.get("inference", {}).values()
  warm = res.get("memory", {}).get("warm", {})
  values = {
      "scan_over_loop": ratio(scan, get("loop", "queries_per_s")),
      "scan_fraction_of_peak": get("roofline", "fraction_of_peak"),
      "seeds_speedup": get("seeds", "speedup"),
      "adapter_b1_ms": max((r["adapter_b1"]["ms_per_query"] for r in inference), default=None),
      "adapter_b256_qps": min((r["adapter_b256"]["queries_per_s"] for r in inference),
                              default=None),
      "suite_s": get("suite", "suite_s"),
      "memory_search_over_bound": ratio(warm.get("search_ms"), warm.get("bound_ms")),
  }
  return {name: verdict(value, *TARGETS[name]) for name, value in values.items()}


def verdict(value: Optional[float], direction: str, target: float) -> Optional[dict]:
  """`{value, target, direction, met}` of `value` against `target` (`direction` '>=' or '<='),
  or None without a value."""
  if value is None:
    return None
  return {"value": value, "target": target, "direction": direction,
          "met": bool(value >= target if direction == ">=" else value <= target)}


def table(res: dict) -> str:
  """The markdown of `run`'s results: the rows, then the targets."""
  d0 = res["stream"]["dims"][0]
  lines = ["", "| row | measured | note |", "|---|---|---|"]
  for d, r in res.get("scan", {}).items():
    lines.append(f"| scan d={d} | {r['queries_per_s']:.1f} q/s ({r['seconds']:.2f} s) | compile "
                 f"{r['compile_s']:.1f} s; {r['gflops']:.1f} GFLOP/s |")
  if "loop" in res:
    r = res["loop"]
    lines.append(f"| loop d={d0} | {r['queries_per_s']:.1f} q/s ({r['seconds']:.2f} s) | state "
                 f"donated: {r['donated_queries_per_s']:.1f} q/s |")
  if "seeds" in res:
    r = res["seeds"]
    lines.append(f"| seeds | vmap {r['vmap_s']:.2f} s vs sequential {r['sequential_s']:.2f} s | "
                 f"{r['num_seeds']} seeds, {r['devices']} device(s) |")
  lines.append(f"| peak matmul | {res['peak']['gflops']:.1f} GFLOP/s | {res['peak']['by_size']} |")
  for bank, row in res.get("inference", {}).items():
    for name, r in row.items():
      paper = PAPER_TABLE8["adapter_only_s_per_query" if "adapter" in name else
                           "explorer_s_per_query"]
      lines.append(f"| {name} {bank} | {r['ms_per_query']:.4f} ms/query, {r['queries_per_s']:.0f} "
                   f"q/s | paper: {paper} s/query |")
  warm, second = res["memory"].get("warm"), res["memory"].get("second_process", {})
  if warm:
    lines.append(f"| memory search | {warm['search_ms']:.1f} ms | bound 2 x (encode "
                 f"{warm['encode_ms']:.1f} + device search {warm['device_search_ms']:.1f}) = "
                 f"{warm['bound_ms']:.1f} ms, {warm['num_memories']} memories |")
  if second.get("status") == "measured":
    a, b = second["first"], second["second"]
    lines.append(f"| memory first search | {a['first_search_s']:.2f} s, then "
                 f"{b['first_search_s']:.2f} s | start to first answer "
                 f"{a['until_first_answer_s']:.1f} s, then {b['until_first_answer_s']:.1f} s "
                 "(compilation cache) |")
  for name in ("encode", "suite"):
    r = res[name]
    val = r.get("sentences_per_s") or r.get("suite_s")
    lines.append(f"| {name} | {f'{val:.1f}' if val else '-'} | {r['status']} |")
  lines += ["", "| target | value | needed | met |", "|---|---|---|---|"]
  for name, v in res["targets"].items():
    lines.append(f"| {name} | not measured | {TARGETS[name][1]} | - |" if v is None else
                 f"| {name} | {v['value']:.3g} | {v['direction']} {v['target']} | "
                 f"{'yes' if v['met'] else 'NO'} |")
  return "\n".join(lines)
