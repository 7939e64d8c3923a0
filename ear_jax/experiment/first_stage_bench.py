"""The first stage at scale: BM25 and hybrid candidates of `Memory` against bank size.

Symbols: `M` memories, `d` dimension, `K` candidates.

For each bank size a `Memory(None, config=EARConfig(dim=d), candidates='hybrid')` is filled with
synthetic texts (`texts`: words drawn from a fixed vocabulary of `VOCAB` words with Zipf
frequencies, 8-20 words a memory, a fixed seed) and random unit embeddings
(`scale_bench.embeddings`), then timed one query at a time (p50 of `calls`):

* `index build`: tokenising every text and building the bm25s index (what the first search after
  `load` pays, and what the first search after an `add` pays for the build part);
* `bm25 host`: the host's BM25 of one query (`LexicalBank.pairs`: bm25s scores, nonzero pairs);
* `dense`: the dense candidate search (`Bank.search`, today's path) beside its bound, the bank's
  bytes over the memory bandwidth measured in the same run (`scale_bench.measure_bandwidth`);
* `bm25`, `hybrid rrf`, `hybrid weighted`: the whole candidate call of that first stage
  (`LexicalBank.search`: host BM25, then one jitted call: cosines, fusion, top-K, gather, features,
  first slate), beside the same bandwidth bound (it must read the bank once too); timed after one
  untimed pass over the same queries (a call compiles once per power-of-two bucket of BM25 pairs);
* `retrieve`: `Memory.retrieve(text, query_embedding=..., k=5)` with the default first stage
  options (`first_stage.FirstStageOptions()`), and the first retrieve after adding one memory
  (the index rebuild).
The mean number of memories sharing a term with a query (`matching`) says how sparse BM25 was.
"""
from __future__ import annotations

import gc
import os
import time
from typing import Sequence

import numpy as np
from absl import logging

from ear_jax.agent.memory import Memory
from ear_jax.core.config import EARConfig
from ear_jax.data import first_stage
from ear_jax.experiment import benchmarking
from ear_jax.experiment import scale_bench

VOCAB = 50_000
ZIPF_S = 1.1
ADD_BATCH = 1 << 16


def texts(start: int, stop: int, seed: int = 0) -> list[str]:
  """Synthetic memory texts `start:stop` (reproducible block by block): 8-20 words `w<rank>` with
  Zipf(`ZIPF_S`) frequencies over `VOCAB` ranks."""
  rng = np.random.default_rng([seed, start, 11])
  p = 1.0 / np.arange(1, VOCAB + 1) ** ZIPF_S
  lens = rng.integers(8, 21, stop - start)
  words = rng.choice(VOCAB, int(lens.sum()), p=p / p.sum())
  off = np.concatenate([[0], np.cumsum(lens)])
  return [" ".join(f"w{w}" for w in words[off[i]:off[i + 1]]) for i in range(stop - start)]


def query_texts(n: int, seed: int = 1) -> list[str]:
  """`n` queries of 3-6 words from the same distribution."""
  rng = np.random.default_rng([seed, 12])
  p = 1.0 / np.arange(1, VOCAB + 1) ** ZIPF_S
  return [" ".join(f"w{w}" for w in rng.choice(VOCAB, int(rng.integers(3, 7)), p=p / p.sum()))
          for _ in range(n)]


def _pct(ts) -> dict:
  return scale_bench._pct(ts)  # pylint: disable=protected-access


def bench_size(m: int, dim: int, calls: int, bandwidth: dict) -> dict:
  """One bank size: the rows of the module docstring."""
  config = EARConfig(dim=dim)
  k = config.num_candidates
  mem = Memory(None, config=config, candidates="hybrid", initial_capacity=m)
  t_add = 0.0
  for start in range(0, m, ADD_BATCH):
    stop = min(m, start + ADD_BATCH)
    emb = scale_bench.embeddings("random", start, stop, dim, m)
    batch = texts(start, stop)
    t = time.perf_counter()
    mem.add(batch, embeddings=emb)
    t_add += time.perf_counter() - t
  bank, lex = mem._bank, mem._lexical  # pylint: disable=protected-access
  benchmarking.block(bank.emb)
  row = {"M": m, "add_s": t_add}
  qs = scale_bench.queries("random", calls + 1, dim, m)
  qt = query_texts(calls + 1)
  fresh = lex.fresh()
  t = time.perf_counter()
  fresh.sync(bank)
  row["tokenize_s"] = time.perf_counter() - t
  t = time.perf_counter()
  fresh._scores_engine()  # pylint: disable=protected-access
  row["index_build_s"] = time.perf_counter() - t
  del fresh
  gc.collect()
  lex._scores_engine()  # pylint: disable=protected-access
  nnz = []
  ts = []
  for text in qt[:calls]:
    t = time.perf_counter()
    rows, _ = lex.pairs([text], bank.capacity, 1)
    ts.append(time.perf_counter() - t)
    nnz.append(int((rows < bank.capacity).sum()))
  row["bm25_host"], row["matching_mean"] = _pct(ts), float(np.mean(nnz))
  slate = (mem._driver.state.params, mem.hparams, 5, False)  # pylint: disable=protected-access
  bank.search(qs[:1], k, False)  # compile
  row["dense"] = _pct([scale_bench._timed(lambda q=q: bank.search(q[None], k, False))[0]  # pylint: disable=protected-access
                       for q in qs[:calls]])
  stages = {"bm25": ("bm25", first_stage.FirstStageOptions()),
            "hybrid_rrf": ("hybrid", first_stage.FirstStageOptions(fusion="rrf")),
            "hybrid_weighted": ("hybrid", first_stage.FirstStageOptions(fusion="weighted"))}
  for name, (cand, opts) in stages.items():
    searcher = lex.sharing(cand, opts)
    call = lambda i, s=searcher: s.search(bank, qs[i:i + 1], qt[i:i + 1], k, slate)
    for i in range(calls):  # compile (once per power-of-two bucket of BM25 pairs)
      call(i)
    row[name] = _pct([scale_bench._timed(lambda i=i: call(i))[0] for i in range(calls)])  # pylint: disable=protected-access
  for i in range(calls):  # compile
    mem.discard(mem.retrieve(qt[i], k=5, query_embedding=qs[i]))
  ts = []
  for i in range(calls):
    t = time.perf_counter()
    r = mem.retrieve(qt[i], k=5, query_embedding=qs[i])
    ts.append(time.perf_counter() - t)
    mem.discard(r)
  row["retrieve"] = _pct(ts)
  mem.add(["w1 w2 w3 a new memory"], embeddings=scale_bench.embeddings("random", m, m + 1, dim,
                                                                       m))
  t = time.perf_counter()
  mem.retrieve(qt[0], k=5, query_embedding=qs[0])
  row["retrieve_after_add_s"] = time.perf_counter() - t
  row["bound_ms"] = m * dim * 4 / (bandwidth["gb_per_s"] * 1e9) * 1e3
  logging.info("first stage M=%d: %s", m, row)
  del mem, bank, lex
  gc.collect()
  return row


def run(sizes: Sequence[int], dim: int = 384, calls: int = 20,
        bandwidth_bytes: float = 1.5e9) -> dict:
  """Every size's row, the bandwidth measured before and after, and the machine's load."""
  out = {"dim": dim, "calls": calls, "sizes": list(sizes), "vocab": VOCAB, "zipf_s": ZIPF_S,
         "options": first_stage.FirstStageOptions().__dict__, "loadavg_before": os.getloadavg()}
  out["bandwidth"] = scale_bench.measure_bandwidth(bandwidth_bytes)
  out["rows"] = [bench_size(m, dim, calls, out["bandwidth"]) for m in sizes]
  out["bandwidth_after"] = scale_bench.measure_bandwidth(bandwidth_bytes)
  out["loadavg_after"] = os.getloadavg()
  return out


def table(res: dict) -> str:
  """Markdown of a `run` result."""
  lines = ["| M | matching / query | index build (tokenise + bm25s) | bm25 host p50 | dense p50 / "
           "bound | bm25 p50 | hybrid rrf p50 | hybrid weighted p50 | retrieve hybrid p50 / p90 | "
           "first retrieve after +1 |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    p = lambda key, r=r: f"{r[key]['p50_ms']:.2f} ms"
    lines.append(
        f"| {r['M']:,} | {r['matching_mean']:,.0f} | {r['tokenize_s']:.2f} + "
        f"{r['index_build_s']:.2f} s | {p('bm25_host')} | {p('dense')} / {r['bound_ms']:.2f} ms | "
        f"{p('bm25')} | {p('hybrid_rrf')} | {p('hybrid_weighted')} | "
        f"{r['retrieve']['p50_ms']:.2f} / {r['retrieve']['p90_ms']:.2f} ms | "
        f"{r['retrieve_after_add_s']:.2f} s |")
  bw, o = res["bandwidth"], res["options"]
  lines += ["", f"d = {res['dim']}, K = 20, one query per call, p50 of {res['calls']}; `retrieve` "
            f"uses the default first stage options (fusion {o['fusion']}, lexical_weight "
            f"{o['lexical_weight']}, rrf_k {o['rrf_k']:g}), each hybrid column its fusion with "
            "those defaults; synthetic "
            f"texts (Zipf s = {res['zipf_s']} over {res['vocab']:,} words). Bound: the bank's "
            f"float32 bytes / memory bandwidth {bw['gb_per_s']:.1f} GB/s measured in this run "
            f"({res['bandwidth_after']['gb_per_s']:.1f} GB/s at the end). Load average "
            f"{res['loadavg_before'][0]:.1f} before, {res['loadavg_after'][0]:.1f} after."]
  return "\n".join(lines)
