"""Memory at scale: add / search / session / feedback / save / open costs against bank size.

Symbols: `M` memories, `d` dimension, `K` candidates, `n` queries per call.

For each bank size and path (`PATHS`: exact fp32 / bf16, faiss IVF, PQ with exact re-ranking,
HNSW) a `Memory` is filled with unit embeddings and timed as an agent uses it (p50 / p90):
`search` (k = 5), a session's first round, `feedback` + `close`, and a 256-query `search`. The
exact path also times persistence: save, `Memory.open`, and `add` of one memory on the opened
memory. Bounds are measured in the same run: memory bandwidth (an exact search reads the bank
once: bank bytes / bandwidth) and the fp32 matmul peak. Data: `random` or `clustered` unit
vectors; the ANN paths' recall@K is against the exact top-K.
"""
from __future__ import annotations

import gc
import pathlib
import shutil
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.core.config import EARConfig
from ear_jax.experiment import benchmarking as bm

# IVF: 512 lists, 8 probed (a query scans ~1/64 of the bank); one build thread.
IVF = {"nlist": 512, "nprobe": 8, "build_threads": 1}
# name -> (Memory keyword options, data)
PATHS = {
    "exact": ({}, "random"),
    "bf16": ({"bank_dtype": "bfloat16"}, "random"),
    "ivf": ({"index": "faiss_ivf", "index_options": IVF}, "random"),
    "ivf_clustered": ({"index": "faiss_ivf", "index_options": IVF}, "clustered"),
    # PQ fast-scan (d / 2 x 4 bits) proposing 50 K rows that the bank re-scores exactly.
    "pq": ({"index": "faiss_pq", "index_options": {"rerank": 50}}, "random"),
    "hnsw": ({"index": "faiss_hnsw", "index_options": {
        "hnsw_m": 32, "ef_construction": 80, "ef_search": 256, "build_threads": 1}}, "random"),
}
ADD_BATCH = 1 << 16
# `Memory.load` of the exact 1M memory in the earlier Orbax-shard layout (BENCHMARKS.md); target:
# `Memory.open` within 2x of it.
OLD_LOAD_1M_S = 17.5
ADD_ONE_TARGET_MS = 50.0  # the target: `add` of one memory at 1M, durable when it returns


def embeddings(kind: str, start: int, stop: int, dim: int, total: int, seed: int = 0):
  """Rows `start:stop` of a reproducible `[total, d]` unit bank (generated block by block)."""
  rng = np.random.default_rng([seed, start, dim])
  x = rng.standard_normal((stop - start, dim), np.float32)
  if kind == "clustered":
    num = max(1, total // 1000)
    centres = np.random.default_rng([seed, dim, 7]).standard_normal((num, dim), np.float32)
    x = centres[rng.integers(0, num, stop - start)] + 0.5 * x
  return bm.unit(x)


def queries(kind: str, n: int, dim: int, total: int, seed: int = 1) -> np.ndarray:
  """`[n, d]` unit queries: random directions, or new points of the bank's clusters."""
  if kind == "clustered":
    return embeddings(kind, 10 * total + 1000 * seed, 10 * total + 1000 * seed + n, dim, total)
  return bm.unit(np.random.default_rng([seed, 9]).standard_normal((n, dim), np.float32))


def measure_bandwidth(nbytes: float = 1.5e9, reps: int = 5) -> dict:
  """Memory bandwidth (GB/s) of a jitted `jnp.sum` over a resident float32 array."""
  x = jnp.ones((int(nbytes) // 4 // 384, 384), jnp.float32)
  f = jax.jit(jnp.sum)
  bm.block(f(x))
  secs = bm.min_time(lambda: f(x), reps)
  return {"gb_per_s": x.size * 4 / secs / 1e9, "bytes": x.size * 4, "seconds": secs}


def blocks(m: int) -> list[tuple[int, int]]:
  """`(start, stop)` of `m` rows in blocks of `ADD_BATCH`."""
  return [(a, min(m, a + ADD_BATCH)) for a in range(0, m, ADD_BATCH)]


def _fill(mem: Memory, kind: str, m: int, dim: int) -> float:
  """Adds `m` memories in batches of `ADD_BATCH`: seconds of the adds and of one search after."""
  total = 0.0
  for start, stop in blocks(m):
    emb = embeddings(kind, start, stop, dim, m)
    ids = [f"m{i}" for i in range(start, stop)]
    t = time.perf_counter()
    mem.add(ids, ids=ids, embeddings=emb)
    total += time.perf_counter() - t
  q = queries(kind, 1, dim, m)[0]
  return total + bm.timed(lambda: mem.search(query_embedding=q, k=1))  # (the last async write)


def _exact_top_k(kind: str, qs: np.ndarray, m: int, dim: int, k: int) -> np.ndarray:
  """`[n, k]` rows of each query's exact top-k among the `m` generated rows (ties: lower row)."""
  best_s = np.full((len(qs), 0), -np.inf, np.float32)
  best_r = np.zeros((len(qs), 0), np.int64)
  for start, stop in blocks(m):
    sc = qs @ embeddings(kind, start, stop, dim, m).T
    all_s = np.concatenate([best_s, sc], axis=1)
    all_r = np.concatenate([best_r, np.broadcast_to(np.arange(start, stop), sc.shape)], axis=1)
    top = np.lexsort((all_r, -all_s), axis=1)[:, :k]
    best_s, best_r = np.take_along_axis(all_s, top, 1), np.take_along_axis(all_r, top, 1)
  return best_r


def _recall(mem: Memory, kind: str, qs: np.ndarray, m: int, dim: int, k: int) -> float:
  """Recall@K of the memory's K candidates against the exact top-K of the same rows."""
  found = [[int(i[1:]) for i in s.ids] for s in mem.search(query_embedding=qs, k=k)]
  exact = _exact_top_k(kind, qs, m, dim, k)
  return float(np.mean([len(set(a) & set(b.tolist())) / k for a, b in zip(found, exact)]))


def _size(path: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else (
      path.stat().st_size)


def _bench_persistence(mem: Memory, kind: str, m: int, dim: int, path: pathlib.Path,
                       reps: int = 3, adds: int = 20) -> dict:
  """Times the first save, saves after adding 1,000 and after nothing, opens (median), and on the
  opened memory `adds` x (add one memory, search)."""
  shutil.rmtree(path, ignore_errors=True)
  out = {"save_first_s": bm.timed(lambda: mem.save(path))}
  added, empty = [], []
  for i in range(reps):
    extra = embeddings(kind, m + 1000 * i, m + 1000 * (i + 1), dim, m)
    mem.add([f"x{i}_{j}" for j in range(1000)], embeddings=extra)
    added.append(bm.timed(mem.save))
    empty.append(bm.timed(mem.save))
  out.update(save_after_1000_s=float(np.median(added)), save_after_1000_all_s=added,
             save_nothing_added_s=float(np.median(empty)), table_bytes=_size(path / "rows.sqlite"),
             learner_bytes=_size(path / "learner"))
  mem.close()
  loads = []
  for i in range(reps):
    t = time.perf_counter()
    back = Memory.open(path)
    loads.append(time.perf_counter() - t)
    if i < reps - 1:
      back.close()
  out.update(load_s=float(np.median(loads)), load_all_s=loads, memories=len(back))
  q = queries(kind, 1, dim, m)[0]
  out["first_search_after_open_s"] = bm.timed(lambda: back.search(query_embedding=q, k=5))
  t_add, t_search = [], []
  for i in range(adds):
    one = embeddings(kind, m + 10 * reps * 1000 + i, m + 10 * reps * 1000 + i + 1, dim, m)
    t_add.append(bm.timed(lambda e=one, i=i: back.add([f"one{i}"], embeddings=e)))
    t_search.append(bm.timed(lambda: back.search(query_embedding=q, k=5)))
  out["add_one"], out["search_after_add_one"] = bm.percentiles(t_add), bm.percentiles(t_search)
  back.close()
  shutil.rmtree(path, ignore_errors=True)
  return out


def bench_path(name: str, m: int, dim: int, calls: int, batch: int, save_dir: Optional[str],
               bandwidth: dict, peak: dict) -> dict:
  """One (path, bank size) row: add, search (1 and `batch`), round, feedback, save, open, bytes."""
  options, kind = PATHS[name]
  config = EARConfig(dim=dim)
  mem = Memory(MemoryConfig(encoder=None, config=config, initial_capacity=m, **options))
  row = {"path": name, "data": kind, "M": m, "options": options}
  row["add_s"] = _fill(mem, kind, m, dim)
  itemsize = 2 if options.get("bank_dtype") == "bfloat16" else 4
  # the device bank's arrays: [C, d] embeddings, [C] valid, stores (int8) and scope codes (int32)
  row["device_bytes_per_memory"] = mem.stats["capacity"] * (dim * itemsize + 1 + 1 + 4) / m
  k = config.num_candidates
  qs = queries(kind, max(calls, batch) + 1, dim, m)
  row["search_b1"] = bm.timed_calls(lambda i: mem.search(query_embedding=qs[i], k=5), calls,
                                    warmup=1)
  steps = lambda: mem.stats["learner_steps"]
  wait_for_step = lambda: bm.block(mem.learner.params)  # (a copy of the learner state)
  for q in qs[-config.batch_size:]:  # compile a round and the learner step (b sessions)
    s = mem.session(query_embedding=q)
    s.feedback([s.round(5).ids[0]])
    s.close()
  wait_for_step()
  t_round, t_fb, t_step = [], [], []
  for q in qs[:calls]:
    t = time.perf_counter()
    s = mem.session(query_embedding=q)
    r = s.round(5)
    t_round.append(time.perf_counter() - t)
    before, t = steps(), time.perf_counter()
    s.feedback([r.ids[0]])
    s.close()
    if steps() > before:
      wait_for_step()
      t_step.append(time.perf_counter() - t)
    else:
      t_fb.append(time.perf_counter() - t)
  row["round_b1"], row["feedback"] = bm.percentiles(t_round), bm.percentiles(t_fb)
  row["feedback_learner_step"] = bm.percentiles(t_step) if t_step else None
  row["learner_copy"] = bm.percentiles([bm.timed(lambda: mem.learner.params) for _ in range(3)])
  qb = qs[:batch]
  mem.search(query_embedding=qb, k=5)  # compile
  tb = [bm.timed(lambda: mem.search(query_embedding=qb, k=5)) for _ in range(2)]
  row["search_batch"] = {"queries": batch, **bm.percentiles(tb),
                         "queries_per_s": batch / float(np.median(tb))}
  row["bound_b1_ms"] = m * dim * itemsize / (bandwidth["gb_per_s"] * 1e9) * 1e3
  row["bound_batch_ms"] = max(row["bound_b1_ms"],
                              2 * batch * m * dim / (peak["gflops"] * 1e9) * 1e3)
  if "index" in options:
    row["recall_at_k"] = _recall(mem, kind, qs[:100], m, dim, k)
    row["k"] = k
  if save_dir is not None and name == "exact":
    row.update(_bench_persistence(mem, kind, m, dim, pathlib.Path(save_dir) / f"mem_{m}"))
  logging.info("scale %s M=%d: %s", name, m, {k2: v for k2, v in row.items() if k2 != "options"})
  mem.close()
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
  out["peak"] = bm.measure_peak(peak_sizes)
  logging.info("bandwidth %.1f GB/s, matmul peak %.1f GFLOP/s", out["bandwidth"]["gb_per_s"],
               out["peak"]["gflops"])
  out["rows"] = []
  for m in sizes:
    for name in paths:
      out["rows"].append(bench_path(name, m, dim, calls, batch, save_dir, out["bandwidth"],
                                    out["peak"]))
      gc.collect()
  out["bandwidth_after"] = measure_bandwidth(bandwidth_bytes)
  return out


def table(res: dict) -> str:
  """The markdown table of a `run` result, times beside their bounds and targets."""
  lines = ["| path (data) | M | add (total) | search b1 p50 / bound | round b1 p50 / p90 | "
           f"search b{res['batch']} per call / bound | feedback p50 (learner step p50) | "
           "save first / after +1,000 (+0) | device bytes / memory | recall@K |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    s, rb, fb, step = r["search_b1"], r["round_b1"], r["feedback"], r["feedback_learner_step"]
    save = (f"{r['save_first_s']:.2f} s / {r['save_after_1000_s']:.2f} s (+0: "
            f"{r['save_nothing_added_s']:.2f} s)" if "save_first_s" in r else "-")
    cells = [
        f"{r['path']} ({r['data']})", f"{r['M']:,}", f"{r['add_s']:.2f} s",
        f"{s['p50_ms']:.2f} ms / {r['bound_b1_ms']:.2f} ms "
        f"({s['p50_ms'] / r['bound_b1_ms']:.1f}x)",
        f"{rb['p50_ms']:.2f} / {rb['p90_ms']:.2f} ms",
        f"{r['search_batch']['p50_ms']:.0f} ms / {r['bound_batch_ms']:.0f} ms",
        (f"{fb['p50_ms']:.2f} ms ({step['p50_ms']:.1f} ms; copy {r['learner_copy']['p50_ms']:.1f} "
         "ms)") if step else f"{fb['p50_ms']:.2f} ms",
        save, f"{r['device_bytes_per_memory']:.0f}",
        f"{r['recall_at_k']:.3f}" if "recall_at_k" in r else "exact"]
    lines.append("| " + " | ".join(cells) + " |")
  bw, pk = res["bandwidth"], res["peak"]
  lines += ["", f"Bounds measured in this run: memory bandwidth {bw['gb_per_s']:.1f} GB/s "
            f"(`jnp.sum` over {bw['bytes'] / 1e9:.2f} GB; "
            f"{res['bandwidth_after']['gb_per_s']:.1f} GB/s at the end), fp32 matmul peak "
            f"{pk['gflops']:.1f} GFLOP/s. The learner step p50 includes a copy of the learner "
            "state (`Memory.learner`, to wait for the step; the copy alone beside it)."]
  persisted = [r for r in res["rows"] if "load_s" in r]
  if persisted:
    lines += ["", "| exact, M | `Memory.open` (median of 3) | vs the Orbax-shards layout (target "
              "<= 2x) | first search after open | `add` of one memory p50 / p90 (target < "
              f"{ADD_ONE_TARGET_MS:.0f} ms) | search after that add p50 / search p50 | table / "
              "learner item bytes |", "|---|---|---|---|---|---|---|"]
    for r in persisted:
      old = OLD_LOAD_1M_S if r["M"] == 1_000_000 and res["dim"] == 384 else None
      met = old is not None and r["load_s"] <= 2 * old
      vs = (f"{old:.1f} s: {r['load_s'] / old:.2f}x ({'met' if met else 'NOT met'})" if old
            else "- (measured at 1M, d = 384)")
      a, after = r["add_one"], r["search_after_add_one"]
      lines.append(
          f"| {r['M']:,} | {r['load_s']:.2f} s | {vs} | {r['first_search_after_open_s']:.2f} s | "
          f"{a['p50_ms']:.2f} / {a['p90_ms']:.2f} ms "
          f"({'met' if a['p50_ms'] < ADD_ONE_TARGET_MS else 'NOT met'}) | "
          f"{after['p50_ms']:.2f} / {r['search_b1']['p50_ms']:.2f} ms "
          f"({after['p50_ms'] / r['search_b1']['p50_ms']:.2f}x) | "
          f"{r['table_bytes'] / 1e6:.1f} MB / {r['learner_bytes'] / 1e6:.1f} MB |")
  return "\n".join(lines)


def plot(res: dict, path: str) -> None:
  """Log-log plot: search / round p50 (with the bound), add, feedback and save against M."""
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
    axes[0].plot(ms, [r["round_b1"]["p50_ms"] for r in rows], "x--", label=f"{name} round")
    axes[1].plot(ms, [r["search_batch"]["p50_ms"] for r in rows], "o-", label=name)
    axes[2].plot(ms, [r["add_s"] * 1e3 for r in rows], "o-", label=f"{name} add (total)")
    axes[2].plot(ms, [r["feedback"]["p50_ms"] for r in rows], "x--", label=f"{name} feedback")
    steps = [r["feedback_learner_step"] for r in rows]
    if all(steps):
      axes[2].plot(ms, [st["p50_ms"] for st in steps], "+:", label=f"{name} learner step")
    if name in ("exact", "bf16"):
      axes[0].plot(ms, [r["bound_b1_ms"] for r in rows], "k:", label=f"{name} bandwidth bound")
      axes[1].plot(ms, [r["bound_batch_ms"] for r in rows], "k:", label=f"{name} bound")
  saved = [r for r in res["rows"] if "save_first_s" in r]
  if saved:
    axes[2].plot([r["M"] for r in saved], [r["save_after_1000_s"] * 1e3 for r in saved], "s-",
                 label="save after +1,000")
    axes[2].plot([r["M"] for r in saved], [r["add_one"]["p50_ms"] for r in saved], "d-",
                 label="add one (durable)")
  titles = ("batch 1: p50 ms", f"batch {res['batch']}: ms per call",
            "add (total), feedback, learner step, save, add one: ms")
  for ax, title in zip(axes, titles):
    ax.set(xscale="log", yscale="log", xlabel="memories M", title=title)
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
