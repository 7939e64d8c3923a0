"""The cross-process merge of the sharded candidate search, timed.

Symbols: `M` memories, `P` processes, `d` dimension, `K` candidates, `n` queries per call.

Every process calls `run` (SPMD) and holds only its `M / P` rows. Timed for `n` = 1 and 256:
`sharded` (`sharding.sharded_top_k_search` of the whole bank), `local` (this process's rows
alone), `merge` = sharded - local (what the split adds), `tiny` (8 rows per process: the merge
alone) and `single` (process 0 searching the whole bank alone). On one machine this measures the
split's overhead, not a speed-up.
"""
from __future__ import annotations

import jax
import numpy as np

from ear_jax.core import retrieval
from ear_jax.experiment import benchmarking
from ear_jax.experiment import scale_bench
from ear_jax.experiment import sharding

_top_k_search = jax.jit(retrieval.top_k_search, static_argnames=("k", "chunk"))


def _rows(m: int, dim: int, p: int, num: int) -> np.ndarray:
  per = -(-m // num)
  return scale_bench.embeddings("random", p * per, min((p + 1) * per, m), dim, m)


def run(m: int = 1_000_000, dim: int = 384, k: int = 20, batches=(1, 256), reps: int = 5,
        single: bool = True) -> dict:
  """Times the search of `m` rows split over every process (a collective: every process calls it
  with the same arguments); `single` is filled in process 0 only."""
  num, me = jax.process_count(), jax.process_index()
  local = _rows(m, dim, me, num)
  local_dev, local_valid = jax.device_put(local), jax.device_put(np.ones(len(local), bool))
  mesh = sharding.bank_mesh()
  bank, valid, ids = sharding.shard_bank_local(local, np.ones(len(local), bool), mesh)
  tiny = sharding.shard_bank_local(local[:8], np.ones(8, bool), mesh)
  out = {"rows": m, "dim": dim, "k": k, "processes": num, "devices": jax.device_count(),
         "local_rows": len(local), "backend": jax.default_backend(), "rows_per_call": {}}
  for n in batches:
    q = scale_bench.queries("random", n, dim, m)
    timings = {}
    for name, fn in (
        ("sharded", lambda: sharding.sharded_top_k_search(q, bank, valid, k, mesh=mesh,
                                                          row_ids=ids)),
        ("local", lambda: _top_k_search(q, local_dev, local_valid, k=k)),
        ("tiny", lambda: sharding.sharded_top_k_search(q, *tiny[:2], k, mesh=mesh,
                                                       row_ids=tiny[2]))):
      benchmarking.block(fn())  # compile
      _barrier(f"{name}{n}")
      timings[name] = benchmarking.min_time(fn, reps if n == 1 else max(2, reps // 2))
    timings["merge"] = timings["sharded"] - timings["local"]
    out["rows_per_call"][n] = {name: {"ms_per_call": 1e3 * t, "ms_per_query": 1e3 * t / n}
                               for name, t in timings.items()}
  del bank, valid, ids, local_dev
  if single:
    _barrier("single")
    if me == 0:
      whole = jax.device_put(np.concatenate([_rows(m, dim, p, num) for p in range(num)]))
      whole_valid = jax.device_put(np.ones(m, bool))
      for n in batches:
        q = scale_bench.queries("random", n, dim, m)
        fn = lambda: _top_k_search(q, whole, whole_valid, k=k)  # noqa: E731
        benchmarking.block(fn())
        t = benchmarking.min_time(fn, reps if n == 1 else max(2, reps // 2))
        out["rows_per_call"][n]["single"] = {"ms_per_call": 1e3 * t, "ms_per_query": 1e3 * t / n}
      del whole
    _barrier("single_done")
  return out


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(f"ear_jax_bench_{name}")


def table(res: dict) -> str:
  """The markdown table of `run`'s result (process 0's)."""
  head = ("| queries per call | 1 process, whole bank | P processes (sharded) | local search of M/P "
          "rows | merge = sharded - local | merge only (8-row bank) |\n|---|---|---|---|---|---|")
  lines = [f"{res['rows']:,} rows x d = {res['dim']}, K = {res['k']}, {res['processes']} "
           f"processes x {res['devices'] // res['processes']} {res['backend']} device(s) each; "
           "ms per query (ms per call)", "", head]
  for n, row in res["rows_per_call"].items():
    def cell(name):
      if name not in row:
        return "—"
      return f"{row[name]['ms_per_query']:.3g} ({row[name]['ms_per_call']:.3g})"
    lines.append(f"| {n} | {cell('single')} | {cell('sharded')} | {cell('local')} | "
                 f"{cell('merge')} | {cell('tiny')} |")
  return "\n".join(lines)
