"""Memory at scale: add / retrieve / feedback / save costs against bank size, with bounds.

Symbols: `M` memories, `d` dimension, `K` candidates, `n` queries per call.

For each bank size and each path (`PATHS`: exact fp32, exact bf16, the faiss IVF, PQ fast-scan
with exact re-ranking, and HNSW searchers), a `Memory(None, config=EARConfig(dim=d), ...)` is filled with unit embeddings through
`Memory.add(..., embeddings=...)` and timed as an agent uses it: `retrieve(query_embedding=q, k=5)`
then `feedback` (p50 / p90 of `calls` rounds), the candidate search alone (`Bank.search`, what the
bandwidth bound applies to), `retrieve_batch` of 256 queries, and (exact fp32) the first save and
the save after adding 1,000 memories. The bounds are measured in the same run: memory bandwidth
from a resident-array reduction (`jnp.sum` over a ~1.5 GB device array, minimum of repetitions) and
the fp32 matmul peak (`benchmarking.measure_peak`). An exact search must read the bank once
(`M d` values), so its bound is `bank bytes / bandwidth`; 256 queries also need `2 n M d` FLOPs.

Data: `random` (unit Gaussian directions; the issue's setup and the hardest case for an ANN index:
no structure to exploit) and `clustered` (unit vectors around `M / 1000` centres, the kind of
structure real sentence embeddings have), the ANN paths' recall@K measured against the exact
top-K of the same bank.
"""
from __future__ import annotations

import gc
import pathlib
import shutil
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from ear_jax.agent.memory import Memory
from ear_jax.core import retrieval
from ear_jax.core.config import EARConfig
from ear_jax.experiment import benchmarking

# IVF: 512 lists (k-means on the first 39 x 512 vectors of a store, 10 iterations), 8 probed: a
# query scans ~1/64 of the bank. One build thread: on a shared small machine faiss's threads
# waiting for each other made building slower (BUILD_NOTES, "memory at scale").
IVF = {"nlist": 512, "nprobe": 8, "build_threads": 1}
# name -> (Memory keyword options, data)
PATHS = {
    "exact": ({}, "random"),
    "bf16": ({"bank_dtype": "bfloat16"}, "random"),
    "ivf": ({"index": "faiss_ivf", "index_options": IVF}, "random"),
    "ivf_clustered": ({"index": "faiss_ivf", "index_options": IVF}, "clustered"),
    # PQ fast-scan (d / 2 sub-quantizers x 4 bits: 96 B per memory at d = 384) proposing
    # 50 K = 1,000 rows that the bank re-scores exactly: a compressed exhaustive scan, the ANN path
    # for data without structure.
    "pq": ({"index": "faiss_pq", "index_options": {"rerank": 50}}, "random"),
    "hnsw": ({"index": "faiss_hnsw", "index_options": {
        "hnsw_m": 32, "ef_construction": 80, "ef_search": 256, "build_threads": 1}}, "random"),
}
ADD_BATCH = 1 << 16

_top_k_search = jax.jit(retrieval.top_k_search, static_argnames=("k", "chunk"))


def _unit(x: np.ndarray) -> np.ndarray:
  return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def embeddings(kind: str, start: int, stop: int, dim: int, total: int, seed: int = 0):
  """Rows `start:stop` of a reproducible `[total, d]` unit bank (generated block by block)."""
  rng = np.random.default_rng([seed, start, dim])
  x = rng.standard_normal((stop - start, dim), np.float32)
  if kind == "clustered":
    num = max(1, total // 1000)
    centres = np.random.default_rng([seed, dim, 7]).standard_normal((num, dim), np.float32)
    x = centres[rng.integers(0, num, stop - start)] + 0.5 * x
  return _unit(x)


def queries(kind: str, n: int, dim: int, total: int, seed: int = 1) -> np.ndarray:
  """`[n, d]` unit queries: random directions, or (clustered) new points of the bank's clusters
  (rows far beyond the bank from the same generator: the same centres, other noise)."""
  if kind == "clustered":
    return embeddings(kind, 10 * total + 1000 * seed, 10 * total + 1000 * seed + n, dim, total)
  return _unit(np.random.default_rng([seed, 9]).standard_normal((n, dim), np.float32))


def measure_bandwidth(nbytes: float = 1.5e9, reps: int = 5) -> dict:
  """Memory bandwidth (GB/s) of a jitted `jnp.sum` over a resident float32 array."""
  x = jnp.ones((int(nbytes) // 4 // 384, 384), jnp.float32)
  f = jax.jit(jnp.sum)
  benchmarking.block(f(x))
  secs = benchmarking.min_time(lambda: f(x), reps)
  size = x.size * 4
  del x
  return {"gb_per_s": size / secs / 1e9, "bytes": size, "seconds": secs}


def _pct(ts: Sequence[float]) -> dict:
  a = np.asarray(ts) * 1e3
  return {"p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
          "min_ms": float(a.min()), "n": len(a)}


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
  t = time.perf_counter()
  out = benchmarking.block(fn())
  return time.perf_counter() - t, out


def _fill(mem: Memory, kind: str, m: int, dim: int) -> float:
  """Adds `m` memories in batches of `ADD_BATCH`; returns the total seconds of the `add` calls."""
  total = 0.0
  for start in range(0, m, ADD_BATCH):
    stop = min(m, start + ADD_BATCH)
    emb = embeddings(kind, start, stop, dim, m)
    ids = [f"m{i}" for i in range(start, stop)]
    t = time.perf_counter()
    mem.add(ids, ids=ids, embeddings=emb)  # the texts are the ids
    benchmarking.block(mem._bank.emb)  # pylint: disable=protected-access  (dispatched async)
    total += time.perf_counter() - t
  return total


def _recall(mem: Memory, qs: np.ndarray, k: int) -> float:
  """Recall@K of the memory's candidate search against the exact top-K of the same bank."""
  bank = mem._bank  # pylint: disable=protected-access
  rows, _, _ = bank.search(qs, k, False)
  where = bank.valid & (bank.stores == 0)
  exact, _, _ = _top_k_search(jnp.asarray(qs), bank.emb, where, k=k)
  exact = np.asarray(exact)
  return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(rows, exact)]))


def _bench_save(mem: Memory, kind: str, m: int, dim: int, path: pathlib.Path,
                reps: int = 3) -> dict:
  """The first save (the whole bank), then `reps` x (add 1,000, save) and `reps` saves with nothing
  added (the learner state and sessions alone: the part that does not depend on the bank)."""
  shutil.rmtree(path, ignore_errors=True)
  out = {"save_first_s": _timed(lambda: mem.save(path))[0]}
  added, empty = [], []
  for i in range(reps):
    extra = embeddings(kind, m + 1000 * i, m + 1000 * (i + 1), dim, m)
    mem.add([f"x{i}_{j}" for j in range(1000)], embeddings=extra)
    benchmarking.block(mem._bank.emb)  # pylint: disable=protected-access  (the add's async copy)
    added.append(_timed(lambda: mem.save(path))[0])
    empty.append(_timed(lambda: mem.save(path))[0])
  shard_dirs = sorted((path / "bank_shards").iterdir(), key=lambda p: int(p.name))
  step_dirs = sorted((p for p in path.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
  size = lambda d: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
  out.update(save_after_1000_s=float(np.median(added)), save_after_1000_all_s=added,
             save_nothing_added_s=float(np.median(empty)), last_shard_bytes=size(shard_dirs[-1]),
             last_step_bytes=size(step_dirs[-1]))
  shutil.rmtree(path, ignore_errors=True)
  return out


def bench_path(name: str, m: int, dim: int, calls: int, batch: int, save_dir: Optional[str],
               bandwidth: dict, peak: dict) -> dict:
  """One (path, bank size) row: add, search, retrieve (1 and `batch`), feedback, save, bytes."""
  options, kind = PATHS[name]
  config = EARConfig(dim=dim)
  mem = Memory(None, config=config, initial_capacity=m, **options)
  row = {"path": name, "data": kind, "M": m, "options": options}
  row["add_s"] = _fill(mem, kind, m, dim)
  bank = mem._bank  # pylint: disable=protected-access
  row["bytes_per_memory"] = bank.nbytes() / m
  k = config.num_candidates
  qs = queries(kind, max(calls, batch) + 1, dim, m)
  bank.search(qs[:1], k, False)  # compile
  row["search_b1"] = _pct([_timed(lambda q=q: bank.search(q[None], k, False))[0]
                           for q in qs[:calls]])
  for q in qs[-config.batch_size:]:  # compile retrieve and the learner step (b sessions)
    r = mem.retrieve(query_embedding=q, k=5)
    mem.feedback(r, [r.ids[0]])
  t_ret, t_fb, t_step = [], [], []
  for q in qs[:calls]:
    dt, r = _timed(lambda q=q: mem.retrieve(query_embedding=q, k=5))
    t_ret.append(dt)
    t = time.perf_counter()
    stepped = mem.feedback(r, [r.ids[0]])
    benchmarking.block(mem._driver.state)  # pylint: disable=protected-access  (the learner step
    # is dispatched asynchronously: wait for it; `mem.state` would time a copy of the state too)
    (t_step if stepped else t_fb).append(time.perf_counter() - t)
  row["retrieve_b1"], row["feedback"] = _pct(t_ret), _pct(t_fb)
  row["feedback_learner_step"] = _pct(t_step) if t_step else None
  qb = qs[:batch]
  mem.retrieve_batch(query_embeddings=qb, k=5)  # compile
  tb = [_timed(lambda: mem.retrieve_batch(query_embeddings=qb, k=5))[0] for _ in range(2)]
  row["retrieve_batch"] = {"n": batch, **_pct(tb),
                           "queries_per_s": batch / float(np.median(tb))}
  read = m * dim * (2 if options.get("bank_dtype") == "bfloat16" else 4)
  row["bound_b1_ms"] = read / (bandwidth["gb_per_s"] * 1e9) * 1e3
  row["bound_batch_ms"] = max(row["bound_b1_ms"], 2 * batch * m * dim / (peak["gflops"] * 1e9) * 1e3)
  if "index" in options:
    row["recall_at_k"] = _recall(mem, qs[:100], k)
    row["k"] = k
  if save_dir is not None and name == "exact":
    row.update(_bench_save(mem, kind, m, dim, pathlib.Path(save_dir) / f"mem_{m}"))
  logging.info("scale %s M=%d: %s", name, m, {k2: v for k2, v in row.items() if k2 != "options"})
  del mem, bank
  gc.collect()
  return row


def run(sizes: Sequence[int], paths: Sequence[str], dim: int = 384, calls: int = 20,
        batch: int = 256, save_dir: Optional[str] = None, peak_sizes=(768, 1024, 1536),
        bandwidth_bytes: float = 1.5e9) -> dict:
  """Every (path, size) row plus the bounds measured in this run (see the module docstring)."""
  unknown = set(paths) - set(PATHS)
  if unknown:
    raise ValueError(f"unknown scale paths {sorted(unknown)}; expected some of {list(PATHS)}")
  out = {"dim": dim, "calls": calls, "batch": batch, "sizes": list(sizes), "paths": list(paths)}
  out["bandwidth"] = measure_bandwidth(bandwidth_bytes)
  out["peak"] = benchmarking.measure_peak(peak_sizes)
  logging.info("bandwidth %.1f GB/s, matmul peak %.1f GFLOP/s", out["bandwidth"]["gb_per_s"],
               out["peak"]["gflops"])
  rows = []
  for m in sizes:
    for name in paths:
      rows.append(bench_path(name, m, dim, calls, batch, save_dir, out["bandwidth"], out["peak"]))
  out["bandwidth_after"] = measure_bandwidth(bandwidth_bytes)
  out["rows"] = rows
  return out


def table(res: dict) -> str:
  """The markdown table of a `run` result (times beside their bounds)."""
  lines = ["| path (data) | M | add (total) | search b1 p50 / bound | retrieve b1 p50 / p90 | "
           f"retrieve b{res['batch']} per call / bound | feedback p50 (learner step p50) | "
           "save first / after +1,000 (+0) | bytes / memory | recall@K |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    s, rb, fb, step = r["search_b1"], r["retrieve_b1"], r["feedback"], r["feedback_learner_step"]
    save = (f"{r['save_first_s']:.2f} s / {r['save_after_1000_s']:.2f} s (+0: "
            f"{r['save_nothing_added_s']:.2f} s)" if "save_first_s" in r else "-")
    cells = [
        f"{r['path']} ({r['data']})", f"{r['M']:,}", f"{r['add_s']:.2f} s",
        f"{s['p50_ms']:.2f} ms / {r['bound_b1_ms']:.2f} ms "
        f"({s['p50_ms'] / r['bound_b1_ms']:.1f}x)",
        f"{rb['p50_ms']:.2f} / {rb['p90_ms']:.2f} ms",
        f"{r['retrieve_batch']['p50_ms']:.0f} ms / {r['bound_batch_ms']:.0f} ms",
        f"{fb['p50_ms']:.2f} ms ({step['p50_ms']:.1f} ms)" if step else f"{fb['p50_ms']:.2f} ms",
        save, f"{r['bytes_per_memory']:.0f}",
        f"{r['recall_at_k']:.3f}" if "recall_at_k" in r else "exact"]
    lines.append("| " + " | ".join(cells) + " |")
  bw, pk = res["bandwidth"], res["peak"]
  lines.append("")
  lines.append(f"Bounds measured in this run: memory bandwidth {bw['gb_per_s']:.1f} GB/s "
               f"(`jnp.sum` over {bw['bytes'] / 1e9:.2f} GB; "
               f"{res['bandwidth_after']['gb_per_s']:.1f} GB/s at the end), fp32 matmul peak "
               f"{pk['gflops']:.1f} GFLOP/s.")
  return "\n".join(lines)


def plot(res: dict, path: str) -> None:
  """Log-log plot: search / retrieve p50 (with the bound), add, feedback and save against M."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
  by = {}
  for r in res["rows"]:
    by.setdefault(r["path"], []).append(r)
  for name, rows in by.items():
    ms = [r["M"] for r in rows]
    axes[0].plot(ms, [r["search_b1"]["p50_ms"] for r in rows], "o-", label=f"{name} search")
    axes[0].plot(ms, [r["retrieve_b1"]["p50_ms"] for r in rows], "x--",
                 label=f"{name} retrieve")
    axes[1].plot(ms, [r["retrieve_batch"]["p50_ms"] for r in rows], "o-", label=name)
    axes[2].plot(ms, [r["add_s"] * 1e3 for r in rows], "o-", label=f"{name} add (total)")
    axes[2].plot(ms, [r["feedback"]["p50_ms"] for r in rows], "x--", label=f"{name} feedback")
    steps = [r["feedback_learner_step"] for r in rows]
    if all(steps):
      axes[2].plot(ms, [st["p50_ms"] for st in steps], "+:", label=f"{name} learner step")
  for name in ("exact", "bf16"):
    rows = by.get(name)
    if rows:
      axes[0].plot([r["M"] for r in rows], [r["bound_b1_ms"] for r in rows], "k:",
                   label=f"{name} bandwidth bound")
      axes[1].plot([r["M"] for r in rows], [r["bound_batch_ms"] for r in rows], "k:",
                   label=f"{name} bound")
  saved = [r for r in res["rows"] if "save_first_s" in r]
  if saved:
    axes[2].plot([r["M"] for r in saved], [r["save_after_1000_s"] * 1e3 for r in saved], "s-",
                 label="save after +1,000")
  titles = ("batch 1: p50 ms", f"batch {res['batch']}: ms per call",
            "add (total), feedback, learner step, save: ms")
  for ax, title in zip(axes, titles):
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("memories M")
    ax.set_title(title)
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ------------------------------------------------------------------------------------------------
# probes behind the design choices (`--suite=scale_probes`)

# (faiss factory string, proposals re-ranked exactly) on random unit vectors, one query at a time
PQ_PROBES = (("PQ128x4fs", 2000), ("PQ192x4fs", 1000), ("PQ384x4fs", 1000))


def pq_probe(m: int = 1_000_000, dim: int = 384, num_queries: int = 100, k: int = 20,
             probes=PQ_PROBES, shards: int = 2) -> list[dict]:
  """faiss alone on `m` random unit vectors: p50 per query and recall@k against the exact top-k of
  PQ fast-scan + exact re-ranking of the best proposals (numpy), and the middle setting split in
  `shards` threaded `IndexShards`."""
  import faiss  # pylint: disable=g-import-not-at-top
  x = np.concatenate([embeddings("random", s, min(m, s + ADD_BATCH), dim, m)
                      for s in range(0, m, ADD_BATCH)])
  qs = queries("random", num_queries, dim, m)
  exact = np.argsort(-(qs @ x.T), axis=1, kind="stable")[:, :k]
  threads = faiss.omp_get_max_threads()
  out = []
  settings = [(f, r, 1) for f, r in probes] + [(probes[1][0], probes[1][1], shards)]
  for factory, rerank, parts in settings:
    base = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    base.train(x[:ADD_BATCH])
    if parts == 1:
      index = base
      index.add(x)
    else:
      index = faiss.IndexShards(dim, True, True)
      held = []
      for p in range(parts):
        part = faiss.clone_index(base)
        part.add(x[p * m // parts:(p + 1) * m // parts])
        held.append(part)  # keep the Python objects alive
        index.add_shard(part)
    faiss.omp_set_num_threads(1)
    ts, rec = [], []
    try:
      for i in range(num_queries):
        t = time.perf_counter()
        _, ids = index.search(qs[i:i + 1], rerank)
        rows = ids[0][ids[0] >= 0]
        top = rows[np.argsort(-(x[rows] @ qs[i]), kind="stable")[:k]]
        ts.append(time.perf_counter() - t)
        rec.append(len(set(top.tolist()) & set(exact[i].tolist())) / k)
    finally:
      faiss.omp_set_num_threads(threads)
    out.append({"factory": factory, "rerank": rerank, "shards": parts, "M": m,
                "p50_ms": float(np.median(ts) * 1e3), "recall_at_k": float(np.mean(rec))})
    logging.info("pq probe %s", out[-1])
    del index, base
    gc.collect()
  return out


def latency_probe(m: int = 10_000, dim: int = 384, calls: int = 100) -> dict:
  """`Memory.retrieve` p50 at `m` memories back to back, between feedbacks, after a 100 MB cache
  sweep and after 10 ms idle; and a no-op jitted call and the bank's `jnp.sum` warm / after idle."""
  mem = Memory(None, config=EARConfig(dim=dim), initial_capacity=m)
  _fill(mem, "random", m, dim)
  qs = queries("random", calls + 8, dim, m)
  for q in qs[-8:]:  # compile retrieve and the learner step
    r = mem.retrieve(query_embedding=q, k=5)
    mem.feedback(r, [r.ids[0]])
  sweep = np.ones(25_000_000, np.float32)
  between = {"back_to_back": lambda r: mem.discard(r),
             "feedback": lambda r: (mem.feedback(r, [r.ids[0]]), benchmarking.block(
                 mem._driver.state)),  # pylint: disable=protected-access
             "cache_sweep": lambda r: (mem.discard(r), sweep.sum()),
             "idle_10ms": lambda r: (mem.discard(r), time.sleep(0.01))}
  out = {"M": m}
  for name, then in between.items():
    ts = []
    for q in qs[:calls]:
      t = time.perf_counter()
      r = mem.retrieve(query_embedding=q, k=5)
      ts.append(time.perf_counter() - t)
      then(r)
    out[f"retrieve_{name}_p50_ms"] = float(np.median(ts) * 1e3)
  noop, total = jax.jit(lambda a: a + 1), jax.jit(jnp.sum)
  one, emb = jnp.ones(3), mem._bank.emb  # pylint: disable=protected-access
  for name, fn in (("noop", lambda: noop(one)), ("bank_sum", lambda: total(emb))):
    benchmarking.block(fn())
    for idle in (0.0, 0.01):
      ts = []
      for _ in range(calls):
        time.sleep(idle)
        ts.append(_timed(fn)[0])
      out[f"{name}_{'idle_10ms' if idle else 'warm'}_p50_ms"] = float(np.median(ts) * 1e3)
  logging.info("latency probe %s", out)
  return out


def probes_table(pq: list[dict], lat: dict) -> str:
  """Markdown of `pq_probe` and `latency_probe`."""
  size = f"{pq[0]['M']:,}" if pq else "-"
  lines = [f"| faiss index ({size} random unit vectors) | re-ranked | shards | p50 per query | "
           "recall@20 |", "|---|---|---|---|---|"]
  for r in pq:
    lines.append(f"| {r['factory']} | {r['rerank']:,} | {r['shards']} | {r['p50_ms']:.2f} ms | "
                 f"{r['recall_at_k']:.3f} |")
  lines += ["", f"| at {lat['M']:,} memories | p50 |", "|---|---|"]
  lines += [f"| {k[:-7].replace('_', ' ')} | {v:.3f} ms |" for k, v in lat.items()
            if k.endswith("_p50_ms")]
  return "\n".join(lines)
