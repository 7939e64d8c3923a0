"""Scoped search at scale: a scoped `Memory.search` among `M` memories in `S` scopes
against a `Memory` holding only that scope's memories, in the same run.

Symbols: `M` memories, `S` scopes (`M / S` memories each), `d` dimension.

For each first stage (`STAGES`) one `Memory` gets `M` random unit embeddings with short texts, its
scopes spread over the bank in `ROUNDS` rounds. Timed in turn (p50 / p99): the scoped search (the
gathered path of `bank.scope_candidates`), the same as a masked scan (`GATHER_SHARE` huge), the
unscoped search, and the query on a `Memory` holding only that scope. Bounds: scope and bank bytes
over the bandwidth measured in this run. Target: scoped / own-memory <= 2.
"""
from __future__ import annotations

import gc
import time
from typing import Sequence

import numpy as np
from absl import logging

from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.agent.memory import bank as bank_lib
from ear_jax.core.config import EARConfig
from ear_jax.experiment import benchmarking as bm
from ear_jax.experiment import scale_bench

STAGES = ("exact", "bm25", "hybrid")
ROUNDS = 4  # each scope's memories arrive in this many adds, spread over the build
VOCAB = 5000
TARGET = 2.0


def _texts(start: int, stop: int, seed: int = 0) -> list[str]:
  """Texts of memories `start:stop`: 6 words `w<j>`, `j` Zipf-like over `VOCAB` (reproducible)."""
  rng = np.random.default_rng([seed, start])
  words = np.minimum(rng.zipf(1.3, (stop - start, 6)), VOCAB) - 1
  return [" ".join(f"w{j}" for j in row) for row in words]


def _question(i: int) -> str:
  return " ".join(f"w{j}" for j in np.random.default_rng([3, i]).integers(0, 200, 3))


def _memory(stage: str, dim: int, capacity: int) -> Memory:
  return Memory(MemoryConfig(encoder=None, config=EARConfig(dim=dim), initial_capacity=capacity,
                             candidates="dense" if stage == "exact" else stage))


def _build(stage: str, emb: np.ndarray, texts: list[str], num_scopes: int
           ) -> tuple[Memory, float]:
  """`M` memories, memory `i` in scope `u<i % S>`, added in `ROUNDS` rounds: (memory, seconds)."""
  m, dim = emb.shape
  mem = _memory(stage, dim, m)
  per = m // num_scopes
  t = time.perf_counter()
  for r in range(ROUNDS):
    lo, hi = r * per // ROUNDS, (r + 1) * per // ROUNDS
    for s in range(num_scopes):
      idx = s + num_scopes * np.arange(lo, hi)  # memory i = s + S j, j its rank in the scope
      mem.add([texts[i] for i in idx], ids=[f"m{i}" for i in idx], embeddings=emb[idx],
              scope=f"u{s}")
  return mem, time.perf_counter() - t


def _own(stage: str, scope: int, emb: np.ndarray, texts: list[str], num_scopes: int) -> Memory:
  """A memory holding only scope `u<scope>`'s memories (same ids, texts, embeddings, order)."""
  idx = scope + num_scopes * np.arange(len(emb) // num_scopes)
  mem = _memory(stage, emb.shape[1], len(idx))
  mem.add([texts[i] for i in idx], ids=[f"m{i}" for i in idx], embeddings=emb[idx],
          scope=f"u{scope}")
  return mem


def _times(fns: dict, calls: int) -> dict:
  """`percentiles` of each of `fns` (name -> `fn(i)`), called in turn, after a compiling pass."""
  for i in range(calls):
    for fn in fns.values():
      fn(i)
  ts = {name: [] for name in fns}
  for i in range(calls):
    for name, fn in fns.items():
      ts[name].append(bm.timed(lambda: fn(i)))
  return {name: bm.percentiles(t) for name, t in ts.items()}


def _masked_scan(fn):
  """`fn` with the gathered path switched off (the masked scan of every row)."""

  def call(i):
    share = bank_lib.GATHER_SHARE
    bank_lib.GATHER_SHARE = 1 << 40
    try:
      return fn(i)
    finally:
      bank_lib.GATHER_SHARE = share

  return call


def bench_stage(stage: str, m: int, num_scopes: int, dim: int, calls: int, sample: int,
                bandwidth: dict) -> dict:
  """One first stage's row (module docstring)."""
  emb, texts = scale_bench.embeddings("random", 0, m, dim, m), _texts(0, m)
  mem, build_s = _build(stage, emb, texts, num_scopes)
  qs = scale_bench.queries("random", calls + 1, dim, m)
  scopes = np.random.default_rng(11).choice(num_scopes, sample, replace=False)
  own = {int(s): _own(stage, int(s), emb, texts, num_scopes) for s in scopes}
  del emb, texts
  search = lambda mm, i, scope: mm.search(_question(i), 5, query_embedding=qs[i], scope=scope)
  pick = lambda i: int(scopes[i % sample])
  # (every answer checked: the scoped search of the big memory finds the own memory's ids)
  for i in range(sample):
    s = pick(i)
    assert search(mem, i, f"u{s}").ids == search(own[s], i, f"u{s}").ids, (stage, s)
  row = {"stage": stage, "M": m, "S": num_scopes, "per_scope": m // num_scopes,
         "build_s": build_s, "capacity": mem.stats["capacity"]}
  scoped = lambda i: search(mem, i, f"u{pick(i)}")
  row.update(_times({"scoped": scoped, "own_memory": lambda i: search(own[pick(i)], i,
                                                                       f"u{pick(i)}")}, calls))
  row.update(_times({"unscoped": lambda i: search(mem, i, None),
                     "scoped_masked_scan": _masked_scan(scoped)}, max(2, calls // 4)))
  row["ratio_p50"] = row["scoped"]["p50_ms"] / row["own_memory"]["p50_ms"]
  row["ratio_p99"] = row["scoped"]["p99_ms"] / row["own_memory"]["p99_ms"]
  gbs = bandwidth["gb_per_s"] * 1e9
  row["bound_scope_ms"] = (m // num_scopes) * dim * 4 / gbs * 1e3
  row["bound_bank_ms"] = m * dim * 4 / gbs * 1e3
  logging.info("scopes %s: %s", stage, row)
  for x in [mem, *own.values()]:
    x.close()
  return row


def run(m: int, num_scopes: int, stages: Sequence[str] = STAGES, dim: int = 384,
        calls: int = 200, sample: int = 20) -> dict:
  """Every stage's row and the bandwidth of this run."""
  unknown = set(stages) - set(STAGES)
  if unknown:
    raise ValueError(f"unknown scope stages {sorted(unknown)}; expected some of {list(STAGES)}")
  sample = min(sample, num_scopes)  # (a sample of distinct scopes)
  out = {"M": m, "S": num_scopes, "dim": dim, "calls": calls, "sample": sample,
         "gather_share": bank_lib.GATHER_SHARE,
         "bandwidth": scale_bench.measure_bandwidth(min(1.5e9, m * dim * 4.0))}
  out["rows"] = []
  for stage in stages:
    out["rows"].append(bench_stage(stage, m, num_scopes, dim, calls, sample, out["bandwidth"]))
    gc.collect()
  return out


def table(res: dict) -> str:
  """A markdown table of `run`'s result."""
  lines = [f"M = {res['M']:,} memories in S = {res['S']:,} scopes (d = {res['dim']}), "
           f"bandwidth {res['bandwidth']['gb_per_s']:.1f} GB/s; p50 / p99 ms of "
           f"{res['calls']} single-query `Memory.search` calls",
           "",
           "| stage | scoped | own memory | ratio p50 (p99) | target | masked scan (before) | "
           "unscoped | bound: scope / bank |",
           "|---|---|---|---|---|---|---|---|"]
  f = lambda t: f"{t['p50_ms']:.2f} / {t['p99_ms']:.2f}"
  for r in res["rows"]:
    ok = "met" if r["ratio_p50"] <= TARGET else "missed"
    lines.append(f"| {r['stage']} | {f(r['scoped'])} | {f(r['own_memory'])} | "
                 f"{r['ratio_p50']:.2f} ({r['ratio_p99']:.2f}) | <= {TARGET:g}: {ok} | "
                 f"{f(r['scoped_masked_scan'])} | {f(r['unscoped'])} | "
                 f"{r['bound_scope_ms'] * 1e3:.1f} us / {r['bound_bank_ms']:.2f} ms |")
  return "\n".join(lines)
