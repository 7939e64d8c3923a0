"""The first stage at scale: the incremental BM25 index and the bm25 / hybrid candidate search
against bank size, alone and through `Memory`.

Symbols: `M` memories, `d` dimension, `K` candidates.

For each bank size, synthetic Zipf texts (`texts`) and random unit embeddings are timed one query
at a time (p50 after an untimed pass that compiles each BM25 bucket): the index alone
(`LexicalBank`: tokenise, build, host BM25, dense / bm25 / hybrid searches, and add-search-delete
cycles), then through `Memory` (add, search, and add-search-delete cycles: the first search after
adding one memory within `AFTER_ADD_TARGET` x of one without changes; the index is incremental).
Each search stands beside its bound, the bank's bytes over the bandwidth measured in this run.
"""
from __future__ import annotations

import gc
import os
import time
from typing import Sequence

import numpy as np
from absl import logging

from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import lexical_bank
from ear_jax.core.config import EARConfig
from ear_jax.data import first_stage
from ear_jax.experiment import benchmarking as bm
from ear_jax.experiment import scale_bench

VOCAB = 50_000
ZIPF_S = 1.1
AFTER_ADD_TARGET = 2.0  # the search after adding one memory / a search without changes
STAGES = {"bm25": ("bm25", first_stage.FirstStageOptions()),
          "hybrid_rrf": ("hybrid", first_stage.FirstStageOptions(fusion="rrf")),
          "hybrid_weighted": ("hybrid", first_stage.FirstStageOptions(fusion="weighted"))}


def _words(rng: np.random.Generator, n: int) -> np.ndarray:
  """`n` word ids drawn from the Zipf distribution over `VOCAB` words."""
  p = 1.0 / np.arange(1, VOCAB + 1) ** ZIPF_S
  return rng.choice(VOCAB, n, p=p / p.sum())


def texts(start: int, stop: int, seed: int = 0) -> list[str]:
  """Synthetic memory texts `start:stop` (reproducible by block): 8-20 Zipf-drawn words."""
  rng = np.random.default_rng([seed, start, 11])
  lens = rng.integers(8, 21, stop - start)
  words = _words(rng, int(lens.sum()))
  off = np.concatenate([[0], np.cumsum(lens)])
  return [" ".join(f"w{w}" for w in words[off[i]:off[i + 1]]) for i in range(stop - start)]


def query_texts(n: int, seed: int = 1) -> list[str]:
  """`n` queries of 3-6 words from the same distribution."""
  rng = np.random.default_rng([seed, 12])
  return [" ".join(f"w{w}" for w in _words(rng, int(rng.integers(3, 7)))) for _ in range(n)]


def _index_rows(m: int, dim: int, calls: int, qs, qt, bandwidth: dict) -> dict:
  """The index alone (module docstring)."""
  k = EARConfig(dim=dim).num_candidates
  row = {"tokenize_s": 0.0, "index_build_s": 0.0}
  device = bank_lib.empty(dim, m + 1024)
  lexes = {name: lexical_bank.LexicalBank(c, o, False) for name, (c, o) in STAGES.items()}
  lex = lexes["bm25"]
  for a, b in scale_bench.blocks(m):
    batch = texts(a, b)
    device = bank_lib.write(device, np.arange(a, b), scale_bench.embeddings("random", a, b, dim, m),
                            np.zeros(b - a, np.int8), np.zeros(b - a, np.int32))
    t = time.perf_counter()
    tokens = lexical_bank.tokenize(batch)
    row["tokenize_s"] += time.perf_counter() - t
    t = time.perf_counter()
    lex.add(np.arange(a, b), lex.encode(tokens, np.zeros(b - a, np.int8)), np.zeros(b - a))
    row["index_build_s"] += time.perf_counter() - t
  for other in lexes.values():  # (one index and vocabulary, three first stages over them)
    other.vocab, other.index = lex.vocab, lex.index
  bm.block(device.emb)
  ids = [lex.query_ids(t) for t in lexical_bank.tokenize(qt)]
  row["matching_mean"] = float(np.mean([len(lex.index.scores([i])[0][0]) for i in ids]))
  row["bm25_host"] = bm.percentiles([bm.timed(lambda i=i: lex.index.scores([i])) for i in ids])
  row["dense"] = bm.timed_calls(
      lambda i: bank_lib.search(device, qs[i:i + 1], k=k, multistore=False), calls, warmup=1)
  for name, searcher in lexes.items():  # (the warm-up compiles each BM25 bucket of pairs)
    row[name] = bm.timed_calls(lambda i, s=searcher: s.search(device, qs[i:i + 1], qt[i:i + 1], k),
                               calls, warmup=calls)
  weighted = lexes["hybrid_weighted"]
  cycle = {"index_add_one": [], "hybrid_weighted_after_add": [], "index_delete_one": []}
  for j in range(calls + 1):  # add one, search, delete it; the first cycle compiles (untimed)
    r = m + j
    new = texts(r, r + 1, seed=3)
    t_add = bm.timed(lambda: lex.add([r], lex.encode(lexical_bank.tokenize(new), [0]), [0]))
    device = bank_lib.write(device, [r], scale_bench.embeddings("random", r, r + 1, dim, m), [0],
                            [0])
    t_search = bm.timed(lambda j=j: weighted.search(device, qs[j % calls:j % calls + 1],
                                                    qt[j % calls:j % calls + 1], k))
    t = time.perf_counter()
    lex.dead_terms([r])  # (for the table's transaction, as `Memory.delete`)
    lex.delete([r])
    device = bank_lib.tombstone(device, [r])
    if j:
      for key, v in zip(cycle, (t_add, t_search, time.perf_counter() - t)):
        cycle[key].append(v)
  row.update({key: bm.percentiles(v) for key, v in cycle.items()})
  row["bound_ms"] = m * dim * 4 / (bandwidth["gb_per_s"] * 1e9) * 1e3
  return row


def _memory_rows(m: int, dim: int, calls: int, qs, qt, candidates: str) -> dict:
  """`Memory(candidates=...)`, filled, searched, one add / search / delete (module docstring)."""
  mem = Memory(MemoryConfig(encoder=None, config=EARConfig(dim=dim), candidates=candidates,
                            initial_capacity=m + 1024))  # (no growth at the +1: not the index's)
  t_add = 0.0
  for a, b in scale_bench.blocks(m):
    emb, batch = scale_bench.embeddings("random", a, b, dim, m), texts(a, b)
    t = time.perf_counter()
    mem.add(batch, embeddings=emb)
    t_add += time.perf_counter() - t
  row = {"add_s": t_add}
  search = lambda i: mem.search(qt[i], k=5, query_embedding=qs[i])
  row["search"] = bm.timed_calls(search, calls, warmup=calls)
  cycle = {"add_one": [], "search_after_add": [], "delete_one": [], "search_after_delete": []}
  for j in range(calls + 1):  # add one, search, delete it, search; the first cycle compiles
    r = m + j
    t = time.perf_counter()
    (new_id,) = mem.add(texts(r, r + 1, seed=3),
                        embeddings=scale_bench.embeddings("random", r, r + 1, dim, m))
    t_add = time.perf_counter() - t
    t_after_add = bm.timed(lambda j=j: search(j % calls))
    t_delete = bm.timed(lambda: mem.delete([new_id]))
    t_after_delete = bm.timed(lambda j=j: search((j + 1) % calls))
    if j:
      for key, v in zip(cycle, (t_add, t_after_add, t_delete, t_after_delete)):
        cycle[key].append(v)
  row.update({key: bm.percentiles(v) for key, v in cycle.items()})
  mem.close()
  return row


def bench_size(m: int, dim: int, calls: int, bandwidth: dict) -> dict:
  """One bank size: the rows of the module docstring."""
  qs = scale_bench.queries("random", calls + 1, dim, m)
  qt = query_texts(calls + 1)
  row = {"M": m, **_index_rows(m, dim, calls, qs, qt, bandwidth)}
  gc.collect()
  for cand in ("bm25", "hybrid"):
    row[f"memory_{cand}"] = _memory_rows(m, dim, calls, qs, qt, cand)
    gc.collect()
  logging.info("first stage M=%d: %s", m, row)
  return row


def run(sizes: Sequence[int], dim: int = 384, calls: int = 20, bandwidth_bytes: float = 1.5e9
        ) -> dict:
  """Every size's row, the bandwidth measured before and after, and the machine's load."""
  out = {"dim": dim, "calls": calls, "sizes": list(sizes), "vocab": VOCAB, "zipf_s": ZIPF_S,
         "options": first_stage.FirstStageOptions().__dict__, "loadavg_before": os.getloadavg()}
  out["bandwidth"] = scale_bench.measure_bandwidth(bandwidth_bytes)
  out["rows"] = [bench_size(m, dim, calls, out["bandwidth"]) for m in sizes]
  out["bandwidth_after"] = scale_bench.measure_bandwidth(bandwidth_bytes)
  out["loadavg_after"] = os.getloadavg()
  return out


def table(res: dict) -> str:
  """Markdown of a `run` result: the index alone, then through `Memory`."""
  p = lambda r, key: f"{r[key]['p50_ms']:.2f}"
  lines = ["| M | matching / query | tokenise + index build | bm25 host p50 | dense p50 / bound | "
           "bm25 p50 | hybrid rrf p50 | hybrid weighted p50 | weighted after +1 p50 | add +1 p50 | "
           "delete 1 p50 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    lines.append(
        f"| {r['M']:,} | {r['matching_mean']:,.0f} | {r['tokenize_s']:.2f} + "
        f"{r['index_build_s']:.2f} s | {p(r, 'bm25_host')} ms | {p(r, 'dense')} / "
        f"{r['bound_ms']:.2f} ms | {p(r, 'bm25')} ms | {p(r, 'hybrid_rrf')} ms | "
        f"{p(r, 'hybrid_weighted')} ms | {p(r, 'hybrid_weighted_after_add')} ms | "
        f"{p(r, 'index_add_one')} ms | {p(r, 'index_delete_one')} ms |")
  lines += ["", "| M | Memory | add all | search p50 / p90 | add +1 p50 | first search after +1 "
            f"p50 / p90 (target <= {AFTER_ADD_TARGET:g}x) | delete 1 p50 | search after delete "
            "p50 | bound |", "|---|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    for cand in ("bm25", "hybrid"):
      x = r[f"memory_{cand}"]
      ratio = x["search_after_add"]["p50_ms"] / x["search"]["p50_ms"]
      lines.append(
          f"| {r['M']:,} | {cand} | {x['add_s']:.1f} s | {p(x, 'search')} / "
          f"{x['search']['p90_ms']:.2f} ms | {p(x, 'add_one')} ms | {p(x, 'search_after_add')} / "
          f"{x['search_after_add']['p90_ms']:.2f} ms ({ratio:.2f}x, "
          f"{'met' if ratio <= AFTER_ADD_TARGET else 'NOT met'}) | {p(x, 'delete_one')} ms | "
          f"{p(x, 'search_after_delete')} ms | {r['bound_ms']:.2f} ms |")
  bw, o = res["bandwidth"], res["options"]
  lines += ["", f"d = {res['dim']}, K = 20, one query per call, p50 of {res['calls']}; `Memory` "
            f"hybrid uses the default options (fusion {o['fusion']}, lexical_weight "
            f"{o['lexical_weight']}, rrf_k {o['rrf_k']:g}); synthetic texts (Zipf s = "
            f"{res['zipf_s']} over {res['vocab']:,} words). Bound: the bank's float32 bytes / "
            f"memory bandwidth {bw['gb_per_s']:.1f} GB/s measured in this run "
            f"({res['bandwidth_after']['gb_per_s']:.1f} GB/s at the end). Load average "
            f"{res['loadavg_before'][0]:.1f} before, {res['loadavg_after'][0]:.1f} after."]
  return "\n".join(lines)
