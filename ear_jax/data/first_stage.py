"""Candidate generators (Eq. (1) for any first stage): dense, BM25 and hybrid, and their features.

Symbols: `n` queries of one bank, `M` memories in the bank, `K` candidates, `d` dimension,
`F = len(FEATURES)` first-stage features.

A generator ranks one bank for its queries: `fn(inputs, k, options) -> (index [n, K] int32,
scores [n, K] float32)`, candidates in decreasing score order (ties: lower bank row first; -1 /
-inf on padding when fewer than K rows are valid). `GENERATORS` names them for the command line;
adding one is one function and one registry line.

- `dense`: the frozen encoder's cosine (`candidates.top_k_candidates`, the paper's Eq. (1)).
- `bm25`: BM25 over the bank's texts (`ear_jax.data.lexical`).
- `hybrid`: a fusion of the two rankings over the whole bank, `FirstStageOptions.fusion`:
  'rrf' (reciprocal-rank fusion, `1 / (rrf_k + rank)` summed over the two rankings) or 'weighted'
  (`lexical_weight * bm25~ + (1 - lexical_weight) * cos~`, each min-max normalised over the
  query's bank). The weight is chosen on validation data only (BUILD_NOTES "First stage").

Side information (`features`, Appendix B.6): each candidate carries `FEATURES`: its first stage's
own score min-max normalised over the K candidates (1 = the first stage's best, 0 = its K-th),
the frozen dense cosine, and its BM25 score divided by the query's best candidate BM25 score.
`ear_jax.core.adapter.relevance` adds `w . f` to the adapted cosine; `w` starts at
`[side_init, -1, 0]`, so before any feedback the adapter-only slate is the first stage's top-s.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import retrieval
from ear_jax.core.types import CandidateGenerator
from ear_jax.data import lexical

QUERY_BATCH = 64  # queries per jitted dense search call (the last batch is padded)
FEATURES = ("first_stage", "dense_cosine", "bm25")
FUSIONS = ("rrf", "weighted")
_top_k_search = jax.jit(retrieval.top_k_search, static_argnames=("k", "chunk"))


@dataclasses.dataclass(frozen=True)
class FirstStageOptions:
  """Settings of the hybrid fusion (ignored by `dense` and `bm25`).

  The defaults are the choice of `python -m experiments.run --benchmark=locomo
  --suite=first_stage_tune --seeds=5` on LoCoMo validation data (BUILD_NOTES "First stage"):
  the weighted sum with a BM25 share of 0.6 (validation Recall@5 48.4; RRF 40.7).
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
    """The options with `fusion` / `lexical_weight` where given (None: the default)."""
    over = {k: v for k, v in (("fusion", fusion), ("lexical_weight", lexical_weight))
            if v is not None}
    return cls(**over)


class BankInputs(NamedTuple):
  """One bank and the queries that search it."""
  queries: np.ndarray  # [n, d] float32 unit query embeddings
  bank: np.ndarray  # [M, d] float32 unit memory embeddings
  query_texts: Sequence[str]  # [n]
  bank_texts: Sequence[str]  # [M] ('' when unknown)
  valid: np.ndarray  # [M] bool, rows that may be chosen (e.g. one store)
  lexical: Callable[[], np.ndarray]  # () -> [n, M] BM25 scores (computed once, on first use)


def _top(scores: np.ndarray, valid: np.ndarray, k: int):
  """`(index [n, K], scores [n, K])` of the top-k valid rows per query, ties by lower row."""
  n, m = scores.shape
  masked = np.where(valid[None], scores, -np.inf).astype(np.float32)
  order = np.argsort(-masked, axis=1, kind="stable")[:, :k]
  top = np.take_along_axis(masked, order, 1)
  pad = k - order.shape[1]
  if pad > 0:
    order = np.concatenate([order, np.full((n, pad), -1, order.dtype)], 1)
    top = np.concatenate([top, np.full((n, pad), -np.inf, np.float32)], 1)
  order = np.where(np.isfinite(top), order, -1)
  return order.astype(np.int32), top.astype(np.float32)


def top_k_candidates(queries: np.ndarray, bank: np.ndarray, k: int, valid: np.ndarray | None = None,
                     batch_size: int = QUERY_BATCH) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Top-`k` memories of one bank by cosine for each query (ties: lower index first).

  Args:
    queries: `[Nq, d]` unit query embeddings.
    bank: `[M, d]` unit memory embeddings.
    k: K, the number of candidates.
    valid: optional `[M]` bool, memories that may be chosen (e.g. one store).
    batch_size: queries per jitted call (the last batch is padded).

  Returns:
    (`index` `[Nq, K]` int32 memory indices, -1 on padding; `scores` `[Nq, K]` float32, -inf on
    padding; `mask` `[Nq, K]` bool, True on real candidates), in decreasing score order.
  """
  queries = np.asarray(queries, np.float32)
  bank = np.asarray(bank, np.float32)
  nq, m = queries.shape[0], bank.shape[0]
  valid = np.ones(m, bool) if valid is None else np.asarray(valid, bool)
  mp = max(k, 1 << max(0, int(np.ceil(np.log2(max(m, 1))))))
  bank_p = np.zeros((mp, bank.shape[1]), np.float32)
  bank_p[:m] = bank
  valid_p = np.zeros(mp, bool)
  valid_p[:m] = valid
  idx = np.full((nq, k), -1, np.int32)
  sc = np.full((nq, k), -np.inf, np.float32)
  for s in range(0, nq, batch_size):
    qb = np.zeros((batch_size, queries.shape[1]), np.float32)
    n = min(batch_size, nq - s)
    qb[:n] = queries[s:s + n]
    i, v, _ = _top_k_search(jnp.asarray(qb), jnp.asarray(bank_p), jnp.asarray(valid_p), k=k)
    sc[s:s + n] = np.asarray(v)[:n]
    idx[s:s + n] = np.asarray(i)[:n]
  mask = np.isfinite(sc)
  idx = np.where(mask, idx, -1)
  return idx, sc, mask



def dense_generator(inputs: BankInputs, k: int, options: FirstStageOptions):
  """The frozen encoder's top-K by cosine (the paper's Eq. (1), `top_k_candidates`)."""
  del options
  idx, sc, _ = top_k_candidates(inputs.queries, inputs.bank, k, valid=inputs.valid)
  return idx, sc


def bm25_generator(inputs: BankInputs, k: int, options: FirstStageOptions):
  """The top-K by BM25 (`ear_jax.data.lexical`)."""
  del options
  return _top(inputs.lexical(), inputs.valid, k)


def _minmax(x: np.ndarray, valid: np.ndarray) -> np.ndarray:
  """Min-max normalisation of `x [n, M]` over the valid rows of each query (0 where constant);
  `valid` is `[M]` (one mask for every query) or `[n, M]`."""
  valid = np.broadcast_to(valid, x.shape)
  if not x.shape[1]:
    return np.zeros(x.shape, np.float32)
  lo = np.where(valid, x, np.inf).min(1, keepdims=True)
  hi = np.where(valid, x, -np.inf).max(1, keepdims=True)
  span = hi - lo
  return np.where(span > 0, (x - lo) / np.where(span > 0, span, 1.0), 0.0)


def _ranks(scores: np.ndarray, valid: np.ndarray) -> np.ndarray:
  """`[n, M]` 1-based rank of every row per query (ties by lower row; invalid rows last)."""
  masked = np.where(valid[None], scores, -np.inf)
  order = np.argsort(-masked, axis=1, kind="stable")
  ranks = np.empty_like(order)
  np.put_along_axis(ranks, order, np.arange(1, scores.shape[1] + 1)[None], 1)
  return ranks


def hybrid_generator(inputs: BankInputs, k: int, options: FirstStageOptions):
  """The top-K of a fusion of the BM25 and the dense ranking over the whole bank."""
  cos = inputs.queries @ inputs.bank.T
  lex = inputs.lexical()
  if options.fusion == "rrf":
    fused = (1.0 / (options.rrf_k + _ranks(lex, inputs.valid))
             + 1.0 / (options.rrf_k + _ranks(cos, inputs.valid)))
  else:
    w = options.lexical_weight
    fused = w * _minmax(lex, inputs.valid) + (1.0 - w) * _minmax(cos, inputs.valid)
  return _top(fused.astype(np.float32), inputs.valid, k)


# Candidate generator name -> `fn(BankInputs, k, FirstStageOptions) -> (index, scores)`
# (`ear_jax.core.types.CandidateGenerator`).
GENERATORS: dict[str, CandidateGenerator] = {
    "dense": dense_generator,
    "bm25": bm25_generator,
    "hybrid": hybrid_generator,
}


def features(inputs: BankInputs, index: np.ndarray, scores: np.ndarray) -> np.ndarray:
  """`[n, K, F]` float32 side features of ranked candidates (`FEATURES`; 0 on padding)."""
  mask = index >= 0
  safe = np.maximum(index, 0)
  # The first stage's score of each candidate, 1 for the best and 0 for the K-th.
  first = np.where(mask, _minmax(np.where(mask, scores, 0.0), mask), 0.0)
  cos = np.einsum("nkd,nd->nk", inputs.bank[safe], inputs.queries)
  lex = np.take_along_axis(inputs.lexical(), safe, 1) if inputs.bank.shape[0] else np.zeros(
      index.shape)
  best = np.where(mask, lex, 0.0).max(1, keepdims=True) if index.size else np.ones((0, 1))
  lex = np.where(best > 0, lex / np.where(best > 0, best, 1.0), 0.0)
  f = np.stack([first, cos, lex], -1)
  return np.where(mask[..., None], f, 0.0).astype(np.float32)


def bank_inputs(queries, bank, query_texts, bank_texts, valid, lexical_rows=None) -> BankInputs:
  """`BankInputs` whose BM25 scores are computed once, on first use.

  Args:
    queries: `[n, d]` query embeddings.
    bank: `[M, d]` memory embeddings.
    query_texts: `[n]` query texts.
    bank_texts: `[M]` memory texts.
    valid: `[M]` bool, rows the generator may choose.
    lexical_rows: optional `[M]` bool, the rows BM25 indexes (its document frequencies and length
      statistics come from them; the other rows score 0). Default: every row.
  """
  cache = {}
  rows = np.ones(len(bank_texts), bool) if lexical_rows is None else np.asarray(lexical_rows, bool)

  def lex():
    if "scores" not in cache:
      if len(bank_texts) and not any(bank_texts):
        raise ValueError("the lexical first stage (bm25 / hybrid / side features) needs the "
                         "memories' texts; this bank has none (e.g. the synthetic benchmark)")
      out = np.zeros((len(query_texts), len(bank_texts)), np.float32)
      out[:, rows] = lexical.bm25_scores([t for t, r in zip(bank_texts, rows) if r], query_texts)
      cache["scores"] = out
    return cache["scores"]

  return BankInputs(np.asarray(queries, np.float32), np.asarray(bank, np.float32),
                    list(query_texts), list(bank_texts), np.asarray(valid, bool), lex)


def check_generator(name: str) -> Callable:
  """The registered generator `name` (ValueError naming the choices otherwise)."""
  if name not in GENERATORS:
    raise ValueError(f"unknown candidates={name!r}; expected one of {tuple(GENERATORS)}")
  return GENERATORS[name]
