r"""Speed of ear_jax, measured against baselines measured in the same run (issue 5).

  python -m experiments.bench              # full table (a few minutes on 2 CPU cores), bench.json
  python -m experiments.bench --quick      # every field on tiny shapes (~30 s; used by a test)

Everything runs on one fixed synthetic stream shaped like LoCoMo training (1,232 queries, K = 20,
s = 5, T = 4, B = 4, batch 4; d = 384 and d = 768; EAR with the default config):
  scan       EAR training as one jitted `lax.scan` over the stream (`run_episode_jit`), queries/s;
             compile time reported separately.
  loop       the same jitted per-batch step (`train_batch_jit`) called from a Python loop.
  numpy      the independent NumPy implementation (`tests/numpy_reference.py`), queries/s.
  seeds      8 seeds with `vmap` in one call (`sharding.sharded_episodes`: all devices) vs 8
             sequential `run_episode_jit` calls.
  roofline   FLOPs of one EAR training query (counted by `ear_flops_per_query`), achieved GFLOP/s
             of `scan`, and the peak fp32 matmul GFLOP/s of this machine measured in the same run.
  inference  adapter-only and explorer-assisted retrieval (simulated critic) from a bank of 600 and
             of 250 memories, including the top-K retrieval, batch 1 latency and batch 256
             throughput; the paper's Table 8 beside them.
  encode     MiniLM sentences/s (`ear_jax.data.encoders`).
  suite      wall time of `experiments.run --benchmark=locomo --suite=main` (3 seeds x 3 methods).

Timings take the minimum over repetitions (the machine is shared; the minimum is the least
disturbed run). Every ratio is printed with its target and whether it is met.
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

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import ear_jax as ej
from ear_jax.core import inference
from ear_jax.core import learner
from ear_jax.experiment import sharding

_REPO = pathlib.Path(__file__).resolve().parent.parent

_QUICK = flags.DEFINE_bool("quick", False, "Tiny shapes, one repetition: every field in ~30 s.")
_OUT = flags.DEFINE_string("out", "bench.json", "Where to write the results (JSON).")
_NUM_QUERIES = flags.DEFINE_integer("num_queries", 1232, "Training queries of the stream.")
_DIMS = flags.DEFINE_list("dims", ["384", "768"], "Embedding dimensions for `scan`.")
_SEEDS = flags.DEFINE_integer("seeds", 8, "Seeds of the `seeds` row.")
_REPS = flags.DEFINE_integer("reps", 2, "Repetitions of each timing (the minimum is reported).")
_NUMPY_QUERIES = flags.DEFINE_integer("numpy_queries", 96, "Queries timed for the `numpy` row.")
_SKIP = flags.DEFINE_list("skip", [], "Rows to skip: any of scan, loop, numpy, seeds, inference, "
                          "encode, suite.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Benchmark data for `suite` and `encode` "
                                "(default: $EAR_DATA_DIR or ../shared/data).")
_SUITE_TIMEOUT = flags.DEFINE_integer("suite_timeout", 900, "Seconds before `suite` gives up.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process "
                                   "0 (or 'auto'); also $EAR_COORDINATOR_ADDRESS.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")

PAPER_TABLE8 = {"adapter_only_s_per_query": 2.30, "explorer_s_per_query": 16.88,
                "note": "paper Table 8, per query, including its LLM calls"}
TARGETS = {
    "scan_over_loop": 5.0, "scan_over_numpy": 10.0, "scan_fraction_of_peak": 0.30,
    "seeds_speedup": 4.0, "adapter_b1_ms": 1.0, "adapter_b256_qps": 10000.0, "suite_s": 60.0,
}


# ------------------------------------------------------------------------------------------------
def bench_stream(num_queries: int, dim: int, k: int = 20, seed: int = 0) -> ej.Stream:
  """A fixed synthetic stream shaped like LoCoMo training: unit vectors, 1-2 gold, some padding."""
  rng = np.random.default_rng([seed, dim])
  unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
  q = unit(rng.normal(size=(num_queries, dim)))
  c = unit(q[:, None, :] + 4.5 * rng.normal(size=(num_queries, k, dim)) / np.sqrt(dim))
  num_valid = np.where(rng.random(num_queries) < 0.9, k, rng.integers(8, k + 1, num_queries))
  mask = np.arange(k)[None] < num_valid[:, None]
  gold = np.zeros((num_queries, k), bool)
  for i in range(num_queries):
    gold[i, rng.choice(num_valid[i], size=rng.integers(1, 3), replace=False)] = True
  return ej.make_stream(q, np.where(mask[..., None], c, 0.0), mask, gold)


def ear_flops_per_query(config: ej.EARConfig) -> dict:
  """Floating-point operations of one EAR training query (multiply-add = 2), by component.

  Counted: the matmuls with `d x d` adapters (forward and the weight gradient; no input gradient is
  needed), the logits, the Gram matrix of the Explorer and the similarity selection of Eq. (15).
  Elementwise work (normalisation, softmaxes, Adam) is O(K d) or O(d^2 / b) and left out.
  """
  d, k, b, c = config.dim, config.num_candidates, config.replay_size, config.buffer_capacity
  rows_q = 1 + (b if config.use_replay else 0)  # current query + replayed queries (W_q)
  rows_m = k * rows_q  # their candidates (W_m)
  adapter_fwd = 2 * (rows_q + rows_m) * d * d
  out = {
      "adapter_forward": adapter_fwd,
      "adapter_weight_grad": adapter_fwd,
      "logits": 2 * rows_m * d,
      "explorer_gram": 2 * k * k * d if config.train_slate == "explorer" else 0,
      "replay_similarity": 2 * c * d if config.use_replay else 0,
  }
  out["total"] = int(sum(out.values()))
  return out


def _block(x):
  return jax.block_until_ready(x)


def _min_time(fn, reps: int) -> float:
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    _block(fn())
    best = min(best, time.perf_counter() - t)
  return best


def measure_peak(sizes=(768, 1024, 1536), reps: int = 3) -> dict:
  """Peak fp32 matmul GFLOP/s: a jitted square `n x n` matmul, the best over sizes and reps."""
  out = {}
  for n in sizes:
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    _block(f(a, b))
    inner = max(1, int(4e9 / (2 * n ** 3)))

    def run():
      r = None
      for _ in range(inner):
        r = f(a, b)
      return r

    out[n] = 2 * n ** 3 * inner / _min_time(run, reps) / 1e9
  return {"gflops": max(out.values()), "by_size": {str(k): round(v, 1) for k, v in out.items()}}


# ------------------------------------------------------------------------------------------------
def run_scan(stream, config, hparams, reps):
  key = jax.random.PRNGKey(0)
  t = time.perf_counter()
  compiled = learner.run_episode_jit.lower(key, stream, config, hparams).compile()
  compile_s = time.perf_counter() - t
  _block(compiled(key, stream, hparams))
  seconds = _min_time(lambda: compiled(key, stream, hparams), reps)
  n = stream.queries.shape[0]
  return {"queries_per_s": n / seconds, "seconds": seconds, "compile_s": compile_s,
          "num_queries": n}, compiled


def _loop_batches(stream, config, key):
  """The stream cut into batches exactly as `train_stream` does, as device arrays (not timed)."""
  n, b = stream.queries.shape[0], config.batch_size
  k_init, keys = learner.episode_keys(key, n)
  nb = -(-n // b)
  idx = np.minimum(np.arange(nb * b), n - 1)
  where = (np.arange(nb * b) < n).reshape(nb, b)
  host = jax.tree_util.tree_map(lambda x: np.asarray(x)[idx].reshape((nb, b) + x.shape[1:]),
                                (np.asarray(keys), stream))
  batches = [jax.device_put(jax.tree_util.tree_map(lambda x: x[i], host) + (where[i],))
             for i in range(nb)]
  return k_init, batches


def run_loop(stream, config, hparams, reps):
  """`train_batch_jit` called once per batch from Python; returns rate and final params."""
  k_init, batches = _loop_batches(stream, config, jax.random.PRNGKey(0))
  t = time.perf_counter()
  _block(learner.train_batch_jit(learner.init_learner(k_init, config), *batches[0], config,
                                 hparams))
  compile_s = time.perf_counter() - t
  result = {}

  def loop():
    state = learner.init_learner(k_init, config)
    for keys, batch, where in batches:
      state, _ = learner.train_batch_jit(state, keys, batch, where, config, hparams)
    result["state"] = state
    return state

  seconds = _min_time(loop, reps)
  n = stream.queries.shape[0]
  # The same loop with the state donated (XLA may then update the [C, K, d] buffer in place
  # instead of copying it on every call): what is left is the per-call dispatch.
  donated = jax.jit(learner.train_batch, static_argnames=("config", "critic"),
                    donate_argnames=("state",))
  fresh = lambda: jax.tree_util.tree_map(jnp.copy, learner.init_learner(k_init, config))  # no
  # shared leaves (W_q and W_m start as the same zeros array; a buffer cannot be donated twice)
  _block(donated(fresh(), *batches[0], config, hparams))

  def loop_donated():
    state = fresh()
    for keys, batch, where in batches:
      state, _ = donated(state, keys, batch, where, config, hparams)
    return state

  seconds_donated = _min_time(loop_donated, reps)
  return {"queries_per_s": n / seconds, "seconds": seconds, "compile_s": compile_s,
          "donated_queries_per_s": n / seconds_donated, "donated_seconds": seconds_donated}, \
      result["state"]


def run_numpy(stream, config, hparams, num_queries):
  sys.path.insert(0, str(_REPO / "tests"))
  try:
    import numpy_reference as npr  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  n = min(num_queries, stream.queries.shape[0])
  n -= n % config.batch_size or 0
  n = max(n, config.batch_size)
  sub = {f: np.asarray(getattr(stream, f))[:n] for f in ("queries", "candidates", "mask", "gold")}
  hp = npr.hp_dict(hparams)
  t = time.perf_counter()
  npr.numpy_train_stream(npr.init_numpy_state(config), sub, config, hp,
                         np.random.default_rng(0))
  seconds = time.perf_counter() - t
  return {"queries_per_s": n / seconds, "seconds": seconds, "num_queries": n}


def run_seeds(stream, config, hparams, num_seeds, reps):
  keys = np.asarray(jax.vmap(jax.random.PRNGKey)(jnp.arange(num_seeds)))
  t = time.perf_counter()
  _block(sharding.sharded_episodes(keys, stream, config, hparams))
  compile_s = time.perf_counter() - t
  vmapped = _min_time(lambda: sharding.sharded_episodes(keys, stream, config, hparams), reps)
  _block(learner.run_episode_jit(jnp.asarray(keys[0]), stream, config, hparams))

  def sequential():
    return [learner.run_episode_jit(jnp.asarray(k), stream, config, hparams)[0].params
            for k in keys]

  seq = _min_time(sequential, reps)
  return {"num_seeds": num_seeds, "vmap_s": vmapped, "sequential_s": seq,
          "speedup": seq / vmapped, "devices": jax.device_count(), "vmap_compile_s": compile_s}


# ------------------------------------------------------------------------------------------------
def _retrieve(params, queries, bank, k, s):
  """Top-K by frozen cosine from the bank (Eq. (1)), then the adapter's top-s: memory ids.

  When the batch's `b K` candidate rows outnumber the bank's `M` memories, the bank is adapted once
  (`M` rows through `W_m`) and the candidates' adapted rows are gathered from it; otherwise the
  `b K` candidates are adapted. Both give the same `z` (Eq. (3)-(4) is row-wise).
  """
  scores = queries @ bank.T
  _, cand = jax.lax.top_k(scores, k)  # [b, K]
  where = jnp.ones(cand.shape, bool)
  if cand.size > bank.shape[0]:
    bank_t = ej.adapt_memories(params, bank)  # [M, d]
    q_t = ej.adapt_queries(params, queries)  # [b, d]
    z = jnp.einsum("bkd,bd->bk", bank_t[cand], q_t)
    slate, slate_mask = jax.vmap(ej.top_s_slate, in_axes=(0, 0, None))(z, where, s)
  else:
    slate, slate_mask, _ = jax.vmap(inference.adapter_only_slate,
                                    in_axes=(None, 0, 0, 0, None))(
        params, queries, bank[cand], where, s)
  return jnp.where(slate_mask, jnp.take_along_axis(cand, jnp.maximum(slate, 0), 1), -1)


def _retrieve_explorer(key, params, queries, bank, gold, config, hparams):
  """Top-K retrieval, then T Explorer rounds with the simulated critic: final slates' ids."""
  _, cand = jax.lax.top_k(queries @ bank.T, config.num_candidates)
  cands = bank[cand]
  cand_gold = jnp.take_along_axis(gold, cand, 1)
  where = jnp.ones(cand.shape, bool)

  def one(k, q, c, g, w):
    def feedback(kk, slate, slate_mask):
      return ej.simulated_critic(kk, ej.explorer.gather_slate(g, slate, slate_mask, False),
                                 slate_mask, hparams)
    out = inference.explorer_slate(k, params, q, c, w, feedback, config, hparams)
    return out.slates[-1]

  slate = jax.vmap(one)(jax.random.split(key, queries.shape[0]), queries, cands, cand_gold, where)
  return jnp.take_along_axis(cand, jnp.maximum(slate, 0), 1)


_retrieve_jit = jax.jit(_retrieve, static_argnames=("k", "s"))
_retrieve_explorer_jit = jax.jit(_retrieve_explorer, static_argnames=("config",))


def run_inference(dim, bank_sizes, batches, reps, calls_b1):
  config = ej.EARConfig(dim=dim)
  hparams = ej.default_hparams()
  rng = np.random.default_rng(1)
  params = ej.AdapterParams(
      w_q=jnp.asarray(0.02 * rng.normal(size=(dim, dim)), jnp.float32),
      w_m=jnp.asarray(0.02 * rng.normal(size=(dim, dim)), jnp.float32))
  unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
  out = {}
  for m in bank_sizes:
    bank = jnp.asarray(unit(rng.normal(size=(m, dim))))
    row = {}
    for b in batches:
      q = jnp.asarray(unit(rng.normal(size=(b, dim))))
      gold = jnp.asarray(rng.random((b, m)) < 2.0 / m)
      key = jax.random.PRNGKey(b)
      fa = lambda: _retrieve_jit(params, q, bank, k=config.num_candidates, s=config.slate_size)
      fe = lambda: _retrieve_explorer_jit(key, params, q, bank, gold, config, hparams)
      for name, fn in (("adapter", fa), ("explorer", fe)):
        _block(fn())
        if b == 1:  # latency: the median of many single calls, dispatch included
          ts = []
          for _ in range(calls_b1):
            t = time.perf_counter()
            _block(fn())
            ts.append(time.perf_counter() - t)
          sec = float(np.median(ts))
        else:
          sec = _min_time(fn, max(reps, 3))
        row[f"{name}_b{b}"] = {"ms_per_call": sec * 1e3, "ms_per_query": sec * 1e3 / b,
                               "queries_per_s": b / sec}
    out[f"bank{m}"] = row
  return out


def run_encode(num_sentences, data_dir):
  from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
  texts = []
  path = pathlib.Path(data_dir) / "locomo10.json" if data_dir else None
  if path is not None and path.is_file():
    for conv in json.load(open(path)):
      for key, turns in conv["conversation"].items():
        if key.startswith("session_") and isinstance(turns, list):
          texts += [f"{t['speaker']}: {t['text']}" for t in turns]
      if len(texts) >= num_sentences:
        break
  while len(texts) < num_sentences:
    texts.append(f"Speaker {len(texts)}: I went hiking with my dog near the lake last weekend.")
  texts = texts[:num_sentences]
  try:
    enc = encoders.load_encoder("minilm")
  except Exception as e:  # pylint: disable=broad-except
    return {"status": f"not measured: MiniLM not available ({e})"}
  enc.encode_new(texts[:32], progress=False)  # compile the shape buckets used below
  enc.encode_new(texts, progress=False)
  t = time.perf_counter()
  enc.encode_new(texts, progress=False)
  seconds = time.perf_counter() - t
  return {"status": "measured", "sentences_per_s": len(texts) / seconds, "seconds": seconds,
          "num_sentences": len(texts), "source": "LoCoMo turns" if path and path.is_file()
          else "synthetic sentences"}


def run_suite(data_dir, timeout):
  if data_dir is None or not (pathlib.Path(data_dir) / "locomo10.json").is_file():
    return {"status": "not measured: locomo10.json not found"}
  if not (_REPO / "experiments" / "run.py").is_file():
    return {"status": "not measured: experiments/run.py not present"}
  with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "experiments.run", "--benchmark=locomo", "--suite=main",
           f"--data_dir={data_dir}", f"--workdir={tmp}/suite", "--progress=false"]
    t = time.perf_counter()
    try:
      proc = subprocess.run(cmd, cwd=str(_REPO), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
      return {"status": f"not measured: timed out after {timeout} s", "command": " ".join(cmd)}
    wall = time.perf_counter() - t
    if proc.returncode != 0:
      return {"status": f"failed (rc {proc.returncode}): {proc.stderr[-500:]}",
              "command": " ".join(cmd)}
    res = json.load(open(pathlib.Path(tmp) / "suite" / "results.json"))
  return {"status": "measured", "suite_s": float(res["suite_wall_seconds"]["main"]),
          "process_wall_s": wall, "command": " ".join(cmd[1:]).replace(tmp, "<tmp>"),
          "note": "suite_s = the runner's own timing of the main suite (embeddings read from the "
                  "encoder cache; includes JIT compilation); process_wall_s adds interpreter "
                  "start-up and data loading"}


# ------------------------------------------------------------------------------------------------
def _verdict(value, target, higher_is_better=True):
  if value is None:
    return None
  ok = value >= target if higher_is_better else value <= target
  return {"value": value, "target": target, "met": bool(ok),
          "direction": ">=" if higher_is_better else "<="}


def main(argv):
  del argv
  sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  quick = _QUICK.value
  skip = set(_SKIP.value)
  n = 32 if quick else _NUM_QUERIES.value
  dims = [64] if quick else [int(x) for x in _DIMS.value]
  reps = 1 if quick else _REPS.value
  hparams = ej.default_hparams()
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
  streams = {d: ej.stream.to_device(bench_stream(n, d)) for d in dims}
  configs = {d: ej.EARConfig(dim=d) for d in dims}

  results["peak"] = measure_peak((256, 512) if quick else (768, 1024, 1536), reps=2 if quick else 3)
  if "scan" not in skip:
    results["scan"] = {}
    for d in dims:
      row, _ = run_scan(streams[d], configs[d], hparams, reps)
      row["flops_per_query"] = ear_flops_per_query(configs[d])
      row["gflops"] = row["flops_per_query"]["total"] * row["queries_per_s"] / 1e9
      results["scan"][str(d)] = row
      print(f"scan d={d}: {row['queries_per_s']:.1f} q/s, compile {row['compile_s']:.1f} s",
            flush=True)
  peak2 = measure_peak((256, 512) if quick else (768, 1024, 1536), reps=2 if quick else 3)
  results["peak"] = max(results["peak"], peak2, key=lambda p: p["gflops"])
  if "loop" not in skip:
    row, state = run_loop(streams[d0], configs[d0], hparams, reps)
    scan_state, _ = learner.run_episode_jit(jax.random.PRNGKey(0), streams[d0], configs[d0],
                                            hparams)
    row["max_abs_param_diff_vs_scan"] = float(max(
        jnp.max(jnp.abs(a - b)) for a, b in zip(jax.tree_util.tree_leaves(state.params),
                                                jax.tree_util.tree_leaves(scan_state.params))))
    results["loop"] = row
    print(f"loop d={d0}: {row['queries_per_s']:.1f} q/s", flush=True)
  if "numpy" not in skip:
    results["numpy"] = run_numpy(streams[d0], configs[d0], hparams,
                                 8 if quick else _NUMPY_QUERIES.value)
    print(f"numpy d={d0}: {results['numpy']['queries_per_s']:.1f} q/s", flush=True)
  if "seeds" not in skip:
    results["seeds"] = run_seeds(streams[d0], configs[d0], hparams, 2 if quick else _SEEDS.value,
                                 reps if quick else 1)
    print(f"seeds: speed-up {results['seeds']['speedup']:.2f}x", flush=True)
  if "inference" not in skip:
    results["inference"] = run_inference(64 if quick else 384, (600, 250), (1, 256), reps,
                                         20 if quick else 200)
  if "encode" not in skip and not quick:
    results["encode"] = run_encode(512, data_dir)
  else:
    results["encode"] = {"status": "skipped (--quick or --skip)"}
  if "suite" not in skip and not quick:
    results["suite"] = run_suite(data_dir, _SUITE_TIMEOUT.value)
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
      print(f"| {name} {bank} | {r['ms_per_query']:.4f} ms/query, {r['queries_per_s']:.0f} q/s | "
            f"paper: {PAPER_TABLE8['adapter_only_s_per_query' if 'adapter' in name else 'explorer_s_per_query']} s/query |")
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
