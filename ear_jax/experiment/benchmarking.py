"""Speed measurements of ear_jax: the rows of `experiments.bench`, as library functions.

Every row times the jitted functions users call (training scan and loop, sharded sweeps,
adapter-only and explorer-assisted retrieval); the NumPy baseline is `reference`. Timings are the
minimum over repetitions (the least disturbed run on a shared machine).

Symbols: `n` queries, `M` bank rows, `d` dimension, `K` candidates, `s` slate size.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import critic as critic_lib
from ear_jax.core import episode
from ear_jax.core import learner
from ear_jax.core import policies
from ear_jax.core import retrieval
from ear_jax.core.adapter import AdapterParams
from ear_jax.core.config import EARConfig, HParams, default_hparams
from ear_jax.core.stream import Stream, make_stream
from ear_jax.experiment import reference
from ear_jax.experiment import sharding


# ------------------------------------------------------------------------------------------------
def bench_stream(num_queries: int, dim: int, k: int = 20, seed: int = 0) -> Stream:
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


def block(x):
  """Waits for every array of `x`."""
  return jax.block_until_ready(x)


def timed(fn: Callable[[], object]) -> float:
  """Seconds of one call of `fn`, its result waited for."""
  t = time.perf_counter()
  block(fn())
  return time.perf_counter() - t


def min_time(fn: Callable[[], object], reps: int) -> float:
  """The minimum over `reps` calls of `fn` (waited for), in seconds."""
  return min(timed(fn) for _ in range(reps))


def percentiles(seconds: Sequence[float]) -> dict:
  """p50 / p90 / min in milliseconds, and the count, of timings in seconds."""
  a = np.asarray(seconds) * 1e3
  return {"p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
          "min_ms": float(a.min()), "n": len(a)}


def measure_peak(sizes: Sequence[int] = (768, 1024, 1536), reps: int = 3) -> dict:
  """Peak fp32 matmul GFLOP/s: a jitted square `n x n` matmul, the best over sizes and reps."""
  out = {}
  for n in sizes:
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    block(f(a, b))
    inner = max(1, int(4e9 / (2 * n ** 3)))

    def run():
      r = None
      for _ in range(inner):
        r = f(a, b)
      return r

    out[n] = 2 * n ** 3 * inner / min_time(run, reps) / 1e9
  return {"gflops": max(out.values()), "by_size": {str(k): round(v, 1) for k, v in out.items()}}


_run_episode = jax.jit(episode.run_episode, static_argnames=("config",))
_train_batch = jax.jit(learner.train_batch, static_argnames=("config",))
_retrieve = jax.jit(retrieval.retrieve, static_argnames=("k", "slate_size"))


# ------------------------------------------------------------------------------------------------
def run_scan(stream: Stream, config: EARConfig, hparams: HParams, reps: int):
  """Jitted `episode.run_episode` over the whole stream: `(row, compiled)`; compile timed apart."""
  key = jax.random.PRNGKey(0)
  t = time.perf_counter()
  compiled = _run_episode.lower(key, stream, config, hparams).compile()
  compile_s = time.perf_counter() - t
  block(compiled(key, stream, hparams))
  seconds = min_time(lambda: compiled(key, stream, hparams), reps)
  n = stream.queries.shape[0]
  return {"queries_per_s": n / seconds, "seconds": seconds, "compile_s": compile_s,
          "num_queries": n}, compiled


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


def run_loop(stream: Stream, config: EARConfig, hparams: HParams, reps: int):
  """`learner.train_batch` (jitted) called once per batch from Python: `(row, final state)`.

  The row also times the loop with the state donated: what is left is the per-call dispatch.
  """
  k_init, batches = loop_batches(stream, config, jax.random.PRNGKey(0))
  t = time.perf_counter()
  block(_train_batch(learner.init_learner(k_init, config), *batches[0], config, hparams))
  compile_s = time.perf_counter() - t
  result = {}

  def loop():
    state = learner.init_learner(k_init, config)
    for keys, batch, where in batches:
      state, _ = _train_batch(state, keys, batch, where, config, hparams)
    result["state"] = state
    return state

  seconds = min_time(loop, reps)
  n = stream.queries.shape[0]
  donated = jax.jit(learner.train_batch, static_argnames=("config",), donate_argnames=("state",))
  # No shared leaves (W_q and W_m start as the same zeros array; a buffer cannot be donated twice).
  fresh = lambda: jax.tree_util.tree_map(jnp.copy, learner.init_learner(k_init, config))
  block(donated(fresh(), *batches[0], config, hparams))

  def loop_donated():
    state = fresh()
    for keys, batch, where in batches:
      state, _ = donated(state, keys, batch, where, config, hparams)
    return state

  seconds_donated = min_time(loop_donated, reps)
  return {"queries_per_s": n / seconds, "seconds": seconds, "compile_s": compile_s,
          "donated_queries_per_s": n / seconds_donated, "donated_seconds": seconds_donated}, \
      result["state"]


def run_numpy(stream: Stream, config: EARConfig, hparams: HParams, num_queries: int) -> dict:
  """`reference.numpy_train_stream` on the first `num_queries` (whole batches) of the stream."""
  n = min(num_queries, stream.queries.shape[0])
  n = max(n - n % config.batch_size, config.batch_size)
  sub = {f: np.asarray(getattr(stream, f))[:n] for f in ("queries", "candidates", "mask", "gold")}
  hp = reference.hp_dict(hparams)
  t = time.perf_counter()
  reference.numpy_train_stream(reference.init_numpy_state(config), sub, config, hp,
                               np.random.default_rng(0))
  seconds = time.perf_counter() - t
  return {"queries_per_s": n / seconds, "seconds": seconds, "num_queries": n}


def run_seeds(stream: Stream, config: EARConfig, hparams: HParams, num_seeds: int,
              reps: int) -> dict:
  """`sharding.sharded_episodes` over `num_seeds` seeds vs as many jitted `run_episode` calls."""
  keys = np.asarray(jax.vmap(jax.random.PRNGKey)(jnp.arange(num_seeds)))
  t = time.perf_counter()
  block(sharding.sharded_episodes(keys, stream, config, hparams))
  compile_s = time.perf_counter() - t
  vmapped = min_time(lambda: sharding.sharded_episodes(keys, stream, config, hparams), reps)
  block(_run_episode(jnp.asarray(keys[0]), stream, config, hparams))

  def sequential():
    return [_run_episode(jnp.asarray(k), stream, config, hparams)[0].params
            for k in keys]

  seq = min_time(sequential, reps)
  return {"num_seeds": num_seeds, "vmap_s": vmapped, "sequential_s": seq,
          "speedup": seq / vmapped, "devices": jax.device_count(), "vmap_compile_s": compile_s}


# ------------------------------------------------------------------------------------------------
def explorer_retrieve(key, params, queries, bank, valid, gold, config, hparams, critic):
  """`retrieval.explorer_retrieve` with the shapes taken from `config`."""
  return retrieval.explorer_retrieve(key, params, queries, bank, valid, gold,
                                     config.num_candidates, config.num_rounds, config.slate_size,
                                     hparams, critic)

_explorer_retrieve = jax.jit(explorer_retrieve, static_argnames=("config",))


def _latency(fn, calls: int) -> float:
  """The median of `calls` single calls (dispatch included), in seconds."""
  ts = []
  for _ in range(calls):
    t = time.perf_counter()
    block(fn())
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))


def run_inference(dim: int, bank_sizes: Sequence[int], batches: Sequence[int], reps: int,
                  calls_b1: int) -> dict:
  """Adapter-only and explorer-assisted retrieval from random unit banks, top-K search included.

  Batch 1: median of `calls_b1` calls (latency); larger batches: minimum of `max(reps, 3)`.
  """
  config = EARConfig(dim=dim)
  hparams = default_hparams()
  critic = critic_lib.default_critic()
  rng = np.random.default_rng(1)
  params = AdapterParams(
      w_q=jnp.asarray(0.02 * rng.normal(size=(dim, dim)), jnp.float32),
      w_m=jnp.asarray(0.02 * rng.normal(size=(dim, dim)), jnp.float32))
  unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
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
      fe = lambda: _explorer_retrieve(key, params, q, bank, valid, gold, config, hparams, critic)
      for name, fn in (("adapter", fa), ("explorer", fe)):
        block(fn())
        sec = _latency(fn, calls_b1) if b == 1 else min_time(fn, max(reps, 3))
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
  t = time.perf_counter()
  enc.encode_new(texts, progress=False)
  seconds = time.perf_counter() - t
  return {"status": "measured", "sentences_per_s": len(texts) / seconds, "seconds": seconds,
          "num_sentences": len(texts),
          "source": "LoCoMo turns" if _locomo_file(data_dir) else "synthetic sentences"}


def run_suite(repo: pathlib.Path, data_dir: Optional[str], timeout: int) -> dict:
  """Wall time of `python -m experiments.run --benchmark=locomo --suite=main`, run from `repo`."""
  if data_dir is None or not (pathlib.Path(data_dir) / "locomo10.json").is_file():
    return {"status": "not measured: locomo10.json not found"}
  if not (repo / "experiments" / "run.py").is_file():
    return {"status": "not measured: experiments/run.py not present"}
  with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "experiments.run", "--benchmark=locomo", "--suite=main",
           f"--data_dir={data_dir}", f"--workdir={tmp}/suite", "--progress=false"]
    t = time.perf_counter()
    try:
      proc = subprocess.run(cmd, cwd=str(repo), capture_output=True, text=True, timeout=timeout)
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
