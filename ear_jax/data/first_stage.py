"""The first stage (Eq. (1) for any first stage): dense, BM25 and hybrid candidates, features.

Symbols: `q` queries, `C` bank rows, `K` candidates, `d` dimension, `F` side features, `B` BM25
pairs per query, `t` the RRF depth. ONE implementation, `rank_bank` (pure, jittable): the
benchmark pipeline (`bank_first_stage`) and `Memory` give the same texts the same candidates.

Generators (`GENERATORS`): `dense` (the paper's cosine), `bm25`, `hybrid`: 'weighted' (min-max
normalised `lexical_weight * bm25 + (1 - lexical_weight) * cos`) or 'rrf' (only rows in the top
`t = ceil(rrf_k + 2 K) + 1` of either ranking can reach the fused top-K). Best first, ties to the
lower row. The side features (Appendix B.6, `FEATURES`) start with the first stage's normalised
score. Only store 0 is a candidate unless `multistore`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import retrieval
from ear_jax.core.types import CandidateGenerator

QUERY_BATCH = 64  # queries per jitted search call (the last batch is padded)
FEATURES = ("first_stage", "dense_cosine", "bm25")  # the side features of every candidate
FUSIONS = ("rrf", "weighted")
MIN_BUCKET = 16  # smallest bucket of BM25 pairs per query
_top_k_search = jax.jit(retrieval.top_k_search, static_argnames=("k", "chunk"))


@dataclasses.dataclass(frozen=True)
class FirstStageOptions:
  """Settings of the hybrid fusion (ignored by `dense` and `bm25`).

  Defaults chosen by `python -m experiments.run --benchmark=locomo --suite=first_stage_tune`.
  """
  fusion: str = "weighted"
  rrf_k: float = 60.0
  lexical_weight: float = 0.6

  def __post_init__(self):
    if self.fusion not in FUSIONS:
      raise ValueError(f"unknown fusion={self.fusion!r}; expected one of {FUSIONS}")
    if not 0.0 <= self.lexical_weight <= 1.0:
      raise ValueError(f"lexical_weight must lie in [0, 1], got {self.lexical_weight}")
    if not self.rrf_k > 0:
      raise ValueError(f"rrf_k must be > 0, got {self.rrf_k}")

  @classmethod
  def with_defaults(cls, fusion=None, lexical_weight=None) -> "FirstStageOptions":
    """The options with `fusion` / `lexical_weight` where given (None: default)."""
    given = dict(fusion=fusion, lexical_weight=lexical_weight)
    return cls(**{k: v for k, v in given.items() if v is not None})


def top_k_candidates(queries: np.ndarray, bank: np.ndarray, k: int, valid: np.ndarray | None = None,
                     batch_size: int = QUERY_BATCH) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Top-`k` memories of one bank by cosine for each query (ties: lower index first).

  `queries [Nq, d]`, `bank [M, d]` unit rows; `valid [M]` optional; `batch_size` queries per call.

  Returns:
    (`index [Nq, K]` int32, -1 on padding; `scores [Nq, K]` float32, -inf on padding;
    `mask [Nq, K]` bool), in decreasing score order.
  """
  queries = np.asarray(queries, np.float32)
  nq, m = queries.shape[0], np.shape(bank)[0]
  cap = max(k, pow2_at_least(m))
  bank_p = _padded(bank, cap, np.float32)
  valid_p = _padded(np.ones(m, bool) if valid is None else valid, cap, bool)
  idx = np.full((nq, k), -1, np.int32)
  sc = np.full((nq, k), -np.inf, np.float32)
  for s in range(0, nq, batch_size):
    n = min(batch_size, nq - s)
    qb = _padded(queries[s:s + n], batch_size, np.float32)
    i, v, _ = _top_k_search(jnp.asarray(qb), jnp.asarray(bank_p), jnp.asarray(valid_p), k=k)
    sc[s:s + n] = np.asarray(v)[:n]
    idx[s:s + n] = np.asarray(i)[:n]
  mask = np.isfinite(sc)
  return np.where(mask, idx, -1), sc, mask


def pow2_at_least(n: int, minimum: int = 1) -> int:
  """The smallest power of two `>= max(n, minimum, 1)`."""
  n = max(n, minimum, 1)
  return 1 << (n - 1).bit_length()


def _padded(x, rows: int, dtype, fill=0) -> np.ndarray:
  """`x` as `dtype`, extended along axis 0 to `rows` rows of `fill`."""
  x = np.asarray(x)
  out = np.full((rows,) + x.shape[1:], fill, dtype)
  out[:len(x)] = x
  return out


class BankScores(NamedTuple):
  """What a generator ranks: one bank's scores for a block of queries."""
  cos: jax.Array  # [q, C] float32 frozen cosine
  lex: jax.Array  # [q, C] float32 BM25 (0 for no shared term)
  where: jax.Array  # [C] bool rows that may be candidates


def _masked_top(x, where, k):
  """`(rows [q, k], values [q, k])` of `x [q, C]` over `where [C]` (lower row first on ties)."""
  v, r = jax.lax.top_k(jnp.where(where[None], x, -jnp.inf), k)
  return r.astype(jnp.int32), v


def _minmax(x, where):
  """Min-max normalisation of `x [q, C]` over `where` (`[C]` or `[q, C]`; 0 where constant)."""
  where = jnp.broadcast_to(where, x.shape)
  lo = jnp.min(jnp.where(where, x, jnp.inf), axis=1, keepdims=True)
  hi = jnp.max(jnp.where(where, x, -jnp.inf), axis=1, keepdims=True)
  span = hi - lo
  return jnp.where(span > 0, (x - lo) / jnp.where(span > 0, span, 1.0), 0.0)


def rrf_depth(rrf_k: float, k: int, capacity: int) -> int:
  """`t`: the rows of each ranking that can reach the RRF top-`k` (module docstring)."""
  return min(capacity, int(math.ceil(rrf_k + 2 * k)) + 1)


def _ranks_one(x, where, rows, vals):
  """`[t]` 1-based ranks of bank rows `rows [t]` in the ranking of `x [C]` over `where [C]`.

  Higher first, lower row first on ties, without sorting the bank: a binary search over the sorted
  `t` rows, then an accumulated histogram; `O(C log t)`.
  """
  t, c = rows.shape[0], x.shape[0]
  neg, s_rows, perm = jax.lax.sort((-vals, rows, jnp.arange(t, dtype=jnp.int32)), num_keys=2)
  s_vals = -neg
  col = jnp.arange(c, dtype=jnp.int32)

  def step(_, bounds):  # invariant: the first `lo` of the t precede row j, those from `hi` do not
    lo, hi = bounds
    mid = (lo + hi) // 2
    at = jnp.minimum(mid, t - 1)
    v, r = s_vals[at], s_rows[at]
    before = ((v > x) | ((v == x) & (r < col))) & (mid < hi)
    return jnp.where(before, mid + 1, lo), jnp.where(before, hi, mid)

  pos, _ = jax.lax.fori_loop(0, max(1, t.bit_length()), step,
                             (jnp.zeros((c,), jnp.int32), jnp.full((c,), t, jnp.int32)))
  pos = jnp.where(where, pos, t + 1)  # invalid rows precede nothing
  # cum[i] = bank rows with at most i of the t before them = rows before the i-th, plus itself
  cum = jnp.cumsum(jnp.zeros((t + 2,), jnp.int32).at[pos].add(1))
  return jnp.zeros((t,), jnp.int32).at[perm].set(cum[:t])


def _ranks_of(x, where, rows, vals):
  """`_ranks_one` for each query, one after the other (`lax.map`)."""
  return jax.lax.map(lambda a: _ranks_one(a[0], where, a[1], a[2]), (x, rows, vals))


def _rrf(s: BankScores, k: int, rrf_k: float):
  """The RRF top-`k` (module docstring): `(rows [q, k], scores [q, k])`."""
  t = rrf_depth(rrf_k, k, s.cos.shape[1])
  r_d, v_d = _masked_top(s.cos, s.where, t)
  r_l, v_l = _masked_top(s.lex, s.where, t)
  pos = jnp.arange(1, t + 1, dtype=jnp.int32)[None]
  ok_d, ok_l = v_d > -jnp.inf, v_l > -jnp.inf
  # Each list's rows in the other ranking (exact counts; the lists' own ranks are their positions).
  rank_ld = _ranks_of(s.lex, s.where, r_d, jnp.take_along_axis(s.lex, r_d, 1))
  rank_dl = _ranks_of(s.cos, s.where, r_l, jnp.take_along_axis(s.cos, r_l, 1))
  in_d = jnp.any((r_l[:, :, None] == r_d[:, None, :]) & ok_d[:, None, :], axis=-1)
  fuse = lambda a, b: 1.0 / (rrf_k + a.astype(jnp.float32)) + 1.0 / (rrf_k + b.astype(jnp.float32))
  rows = jnp.concatenate([r_d, r_l], 1)
  fused = jnp.concatenate([fuse(pos, rank_ld), fuse(rank_dl, pos)], 1)
  ok = jnp.concatenate([ok_d, ok_l & ~in_d], 1)
  key = jnp.where(ok, -fused, jnp.inf)
  _, rows, fused, ok = jax.lax.sort((key, rows, fused, ok), dimension=1, num_keys=2)
  return rows[:, :k], jnp.where(ok[:, :k], fused[:, :k], -jnp.inf)


def dense_generator(s: BankScores, k: int, options: FirstStageOptions):
  """The frozen encoder's top-K by cosine (the paper's Eq. (1))."""
  del options
  return _masked_top(s.cos, s.where, k)


def bm25_generator(s: BankScores, k: int, options: FirstStageOptions):
  """The top-K by BM25 (rows sharing no term score 0 and follow in row order)."""
  del options
  return _masked_top(s.lex, s.where, k)


def hybrid_generator(s: BankScores, k: int, options: FirstStageOptions):
  """The top-K of a fusion of the BM25 and the dense ranking over the whole bank."""
  if options.fusion == "rrf":
    return _rrf(s, k, float(options.rrf_k))
  w = float(options.lexical_weight)
  return _masked_top(w * _minmax(s.lex, s.where) + (1.0 - w) * _minmax(s.cos, s.where), s.where,
                     k)


# Candidate generator name -> `fn(BankScores, k, FirstStageOptions) -> (rows, scores)`
# (`ear_jax.core.types.CandidateGenerator`; jittable, `k` and the options static).
GENERATORS: dict[str, CandidateGenerator] = {
    "dense": dense_generator,
    "bm25": bm25_generator,
    "hybrid": hybrid_generator,
}


def check_generator(name: str) -> Callable:
  """The registered generator `name` (ValueError naming the choices otherwise)."""
  if name not in GENERATORS:
    raise ValueError(f"unknown candidates={name!r}; expected one of {tuple(GENERATORS)}")
  return GENERATORS[name]


def features(s: BankScores, rows, scores, mask):
  """`[q, K, F]` float32 `FEATURES` of ranked candidates `rows [q, K]` (0 on padding)."""
  first = jnp.where(mask, _minmax(jnp.where(mask, scores, 0.0), mask), 0.0)
  safe = jnp.maximum(rows, 0)
  cos = jnp.take_along_axis(s.cos, safe, 1)
  lex = jnp.take_along_axis(s.lex, safe, 1)
  best = jnp.max(jnp.where(mask, lex, 0.0), axis=1, keepdims=True)
  lex = jnp.where(best > 0, lex / jnp.where(best > 0, best, 1.0), 0.0)
  return jnp.where(mask[..., None], jnp.stack([first, cos, lex], -1), 0.0)


def _block(queries, emb, where, stores, lex_rows, lex_scores, k, generator, options, multistore):
  """`rank_bank` for one block of queries."""
  cap, b = emb.shape[0], queries.shape[0]
  cos = retrieval._chunk_scores(queries, emb)  # [b, C] float32  pylint: disable=protected-access
  lex = jnp.zeros((b, cap), jnp.float32).at[jnp.arange(b)[:, None], lex_rows].set(
      lex_scores, mode="drop")
  gen = GENERATORS[generator]
  s = BankScores(cos, lex, where)
  if multistore:
    parts = [gen(s._replace(where=where & (stores == st)), k // 2, options) for st in (0, 1)]
    rows = jnp.concatenate([p[0] for p in parts], 1)
    sc = jnp.concatenate([p[1] for p in parts], 1)
    pos = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[None], sc.shape)
    _, _, sc, rows = jax.lax.sort((-sc, pos, sc, rows), dimension=1, num_keys=2)
  else:
    rows, sc = gen(s._replace(where=where & (stores == 0)), k, options)
  mask = sc > -jnp.inf
  rows = jnp.where(mask, rows, -1).astype(jnp.int32)
  return rows, mask, sc, features(s, rows, sc, mask)


def rank_bank(queries, emb, where, stores, lex_rows, lex_scores, *, k: int, generator: str,
              options: FirstStageOptions, multistore: bool):
  """The first stage of `q` queries over one bank (pure; jit with the keywords static).

  Queries go in blocks (`lax.map`) so at most about `retrieval.SCORE_BUDGET` scores exist at once.

  Args:
    queries: `[q, d]` unit queries (`q` a power of two).
    emb: `[C, d]` the bank's unit rows (float32 or bfloat16); where: `[C]` bool candidates.
    stores: `[C]` int store codes (single store: only store 0 is a candidate).
    lex_rows, lex_scores: `[q, B]` each query's nonzero BM25 `(row, score)` pairs (row `C` =
      padding).
    k, generator, options, multistore: `K`, a name in `GENERATORS`, the fusion's settings, and
      each store's top-K/2 merged.

  Returns:
    `(rows [q, K] int32 (-1 = padding), mask [q, K] bool, scores [q, K] float32 (-inf =
    padding), features [q, K, F] float32)`, best first.
  """
  cap, q = emb.shape[0], queries.shape[0]
  per_block = min(q, pow2_at_least(max(1, retrieval.SCORE_BUDGET // cap) + 1) // 2)

  def fn(x):
    return _block(x[0], emb, where, stores, x[1], x[2], k, generator, options, multistore)

  xs = (queries, lex_rows, lex_scores)
  if per_block == q:
    return fn(xs)
  blocks = tuple(a.reshape((q // per_block, per_block) + a.shape[1:]) for a in xs)
  return tuple(a.reshape((q,) + a.shape[2:]) for a in jax.lax.map(fn, blocks))


def pairs(found: Sequence[tuple[np.ndarray, np.ndarray]], capacity: int, num_padded: int,
          offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """`(rows [num_padded, B] int32, scores [num_padded, B] float32)`: each query's BM25 pairs.

  Rows are shifted by `-offset`, those outside the bank dropped, padded with `capacity` to a
  power-of-two bucket `B` in `[MIN_BUCKET, capacity]`.
  """
  found = [(r - offset, s) for r, s in found]
  found = [(r[(r >= 0) & (r < capacity)], s[(r >= 0) & (r < capacity)]) for r, s in found]
  most = max([len(r) for r, _ in found] + [1])
  bucket = min(pow2_at_least(most, MIN_BUCKET), max(capacity, 1))
  rows = np.full((num_padded, bucket), capacity, np.int32)
  scores = np.zeros((num_padded, bucket), np.float32)
  for i, (r, s) in enumerate(found):
    rows[i, :len(r)], scores[i, :len(s)] = r, s
  return rows, scores


_rank_bank = jax.jit(rank_bank, static_argnames=("k", "generator", "options", "multistore"))


def bank_first_stage(queries: np.ndarray, emb: np.ndarray, stores: np.ndarray, valid: np.ndarray,
                     found: Sequence[tuple[np.ndarray, np.ndarray]], k: int, generator: str,
                     options: FirstStageOptions, multistore: bool, offset: int = 0):
  """`rank_bank` of one benchmark bank on host arrays, padded so a benchmark compiles once per size.

  Args:
    queries: `[n, d]` unit queries; emb: `[M, d]` the bank's rows; stores, valid: `[M]`.
    found: per query, its BM25 `(rows, scores)`; rows minus `offset` are bank rows.
    k, generator, options, multistore: as `rank_bank`.

  Returns:
    `(index [n, K] int32, scores [n, K] float32, features [n, K, F] float32)`.
  """
  n, m = queries.shape[0], emb.shape[0]
  cap, q = max(k, pow2_at_least(m)), min(QUERY_BATCH, pow2_at_least(n))
  emb_p, where = _padded(emb, cap, np.float32), _padded(valid, cap, bool)
  stores_p = _padded(stores, cap, np.int32, fill=-1)
  out = []
  for s in range(0, n, q):  # blocks of `q` queries (one compiled shape per bank size)
    q_p = _padded(queries[s:s + q], q, np.float32)
    lex_rows, lex_scores = pairs(found[s:s + q], cap, q, offset)
    rows, _, sc, feats = _rank_bank(q_p, emb_p, where, stores_p, lex_rows, lex_scores, k=k,
                                    generator=generator, options=options, multistore=multistore)
    out.append([np.asarray(a)[:min(q, n - s)] for a in (rows, sc, feats)])
  return tuple(np.concatenate([o[i] for o in out]) for i in range(3))
