"""The first stage of `Memory` beyond dense search: BM25 and hybrid candidates with side features.

Symbols: `n` memories in the bank, `C` bank capacity, `L` memories in the lexical index, `d`
dimension, `K` candidates, `q` queries of one call (padded to a power of two), `B` BM25 pairs per
query (a power-of-two bucket, at most `C`), `F = len(first_stage.FEATURES)` side features, `t` the
RRF depth.

`Memory(candidates='bm25' | 'hybrid')` (and 'dense' with `config.side_features > 0`) keeps a
`LexicalBank` beside its dense `bank.Bank`. It ranks exactly as the benchmark pipeline
(`ear_jax.data.first_stage`, `candidates.build_benchmark`) ranks one bank: the same generators, the
same BM25 (`ear_jax.data.lexical`: the same tokens, the same bm25s engine and parameters, so the
same scores for the same texts), the same features, the same ties (lower bank row first):

* single store: only dialogue memories (store 0) are indexed and are candidates (the pipeline's
  `lexical_rows = valid = dialogue`); with `multistore` every memory is indexed and the candidates
  are each store's top-K/2, merged by the first stage's score (store 0 first on equal scores).
* `bm25`: the top-K by BM25 (rows that share no term score 0 and follow in row order);
* `hybrid`, 'weighted': `w bm25~ + (1 - w) cos~`, each min-max normalised over the valid rows;
* `hybrid`, 'rrf': `1 / (rrf_k + rank_bm25) + 1 / (rrf_k + rank_cos)` with ranks over the valid
  rows. Only rows in the top-`t` of either ranking, `t = ceil(rrf_k + 2 K) + 1` (capped at `C`),
  can be in the fused top-K (a row ranked below `t` in both has a fused score below
  `2 / (rrf_k + t) < 1 / (rrf_k + K)`, which each of the cosine top-K beats), so the kernel ranks
  those `2 t` rows exactly: a row's rank in the other ranking is `1 +` the valid rows before it
  (a comparison count over the bank, `O(t C)` per query), never a sort of the bank.

Host / device split (the device-side discipline of `bank.Bank`): BM25 runs on the host (bm25s) and
only each query's nonzero `(row, score)` pairs go to the device, padded to a power-of-two bucket;
the fusion, the top-K, the gather, the features and the first-round slate are ONE jitted call
(`_search_slates`), whose outputs come back in two host copies (`bank._pack`). Queries are scanned
in blocks of `retrieval.SCORE_BUDGET // C` (`lax.map`), so at most about that many cosine and BM25
scores exist at once.

The index: bm25s has no incremental add (its index stores each (term, memory) BM25 score, which
depends on every memory through the document frequencies and the mean length). `add` tokenises the
new texts (outside the memory's lock) into an incremental vocabulary; the bm25s engine is rebuilt
from those token ids on the first search after a change (under the lock; bm25s's scores do not
depend on the token ids, so they equal `lexical.LexicalIndex` of the same texts). A checkpoint holds
nothing of the index: it is a deterministic function of the bank's texts (verified by the shards'
digests) and of the first stage's settings (in the verified meta), rebuilt on the first search
after `load` / `restore`. Measured costs: BENCHMARKS.md "First stage at scale".

ANN searchers (`index='faiss_*'`) are refused with bm25 / hybrid / side features: the fusion needs
every valid row's cosine (the min-max normalisation, the RRF ranks).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent import bank as bank_lib
from ear_jax.core import explorer as explorer_lib
from ear_jax.core import retrieval as retrieval_lib
from ear_jax.data import first_stage
from ear_jax.data import lexical

NUM_FEATURES = len(first_stage.FEATURES)
MIN_BUCKET = 16  # smallest bucket of BM25 pairs per query


def needs_lexical(candidates: str, side_features: int) -> bool:
  """Whether a memory with this first stage keeps a `LexicalBank` (bm25, hybrid, or features)."""
  return candidates != "dense" or side_features > 0


def options_meta(candidates: str, options: first_stage.FirstStageOptions) -> dict:
  """The first stage as checkpoints store it (`persistence.snapshot`)."""
  return {"candidates": candidates, "options": dataclasses.asdict(options)}


def options_from_meta(meta, where: str) -> tuple[str, first_stage.FirstStageOptions]:
  """`(candidates, options)` of a checkpoint's `first_stage` meta (None: an older checkpoint,
  dense). ValueError naming `where` and the field for a value this version does not know."""
  if meta is None:
    return "dense", first_stage.FirstStageOptions()
  try:
    name = meta["candidates"]
    first_stage.check_generator(name)
    opts = first_stage.FirstStageOptions(**meta["options"])
  except (TypeError, KeyError, ValueError) as e:
    raise ValueError(f"{where}: field 'first_stage' ({meta!r}) is not a first stage this version "
                     f"of ear_jax knows: {e}") from None
  return name, opts


def tokenize(texts: Sequence[str]) -> list[list[str]]:
  """The BM25 tokens of `texts` (`lexical.tokenize`); called by `Memory.add` outside its lock."""
  return lexical.tokenize(texts)


class LexicalBank:
  """BM25 over a memory's texts, kept in step with its `bank.Bank`, and the candidate search.

  Args:
    candidates: 'dense', 'bm25' or 'hybrid' (`first_stage.GENERATORS`).
    options: the hybrid fusion's settings.
    multistore: index every memory (True) or the dialogue memories only (False).
  """

  def __init__(self, candidates: str, options: first_stage.FirstStageOptions, multistore: bool):
    first_stage.check_generator(candidates)
    self.candidates, self.options, self.multistore = candidates, options, bool(multistore)
    self.vocab: dict[str, int] = {}
    self._docs: list[np.ndarray] = []  # per indexed memory: its token ids (int32)
    self._rows: list[int] = []  # per indexed memory: its bank row
    self.synced = 0  # bank rows seen (indexed or skipped)
    self._engine = None
    self._engine_docs = -1  # indexed memories when the engine was built

  def fresh(self) -> "LexicalBank":
    """An empty index with the same settings (it catches up with a bank at its first search)."""
    return LexicalBank(self.candidates, self.options, self.multistore)

  def __len__(self):
    return len(self._docs)

  def append(self, tokens: Sequence[Sequence[str]], codes: np.ndarray, start: int) -> None:
    """Indexes new bank rows `start, start + 1, ...` (their `tokenize`d texts and store codes)."""
    if start != self.synced:
      raise ValueError(f"lexical index out of step with the bank: rows from {start}, expected "
                       f"{self.synced}")
    for j, (toks, code) in enumerate(zip(tokens, codes)):
      if self.multistore or int(code) == 0:
        self._docs.append(np.fromiter((self.vocab.setdefault(w, len(self.vocab)) for w in toks),
                                      np.int32))
        self._rows.append(start + j)
    self.synced = start + len(codes)

  def sync(self, bank: bank_lib.Bank) -> None:
    """Tokenises and indexes the bank rows not indexed yet (after `load` / `restore`)."""
    if self.synced < len(bank):
      self.append(tokenize(bank.texts[self.synced:]), bank.store_codes[self.synced:],
                  self.synced)

  def _scores_engine(self):
    """The bm25s engine over the indexed memories, rebuilt when memories were added since."""
    if self._engine_docs != len(self._docs):
      self._engine = None
      if self._docs:
        engine = lexical.new_engine()
        engine.index(([d.tolist() for d in self._docs], self.vocab), create_empty_token=False,
                     show_progress=False)
        self._engine = engine
      self._engine_docs = len(self._docs)
    return self._engine

  def pairs(self, query_texts: Sequence[str], capacity: int, num_padded: int):
    """Each query's nonzero BM25 scores as `(rows [q, B] int32, scores [q, B] float32)`; padding
    rows are `capacity` (dropped by the device scatter)."""
    engine = self._scores_engine()
    rows_of = np.asarray(self._rows, np.int32)
    found = []
    for toks in tokenize(query_texts):
      if engine is None or not toks:
        found.append((np.zeros(0, np.int32), np.zeros(0, np.float32)))
        continue
      s = engine.get_scores(list(toks))
      nz = np.flatnonzero(s)
      found.append((rows_of[nz], s[nz].astype(np.float32)))
    most = max([len(r) for r, _ in found] + [1])
    bucket = min(bank_lib.pow2_at_least(most, MIN_BUCKET), capacity)
    rows = np.full((num_padded, bucket), capacity, np.int32)
    scores = np.zeros((num_padded, bucket), np.float32)
    for i, (r, s) in enumerate(found):
      rows[i, :len(r)], scores[i, :len(s)] = r, s
    return rows, scores

  def search(self, bank: bank_lib.Bank, queries: np.ndarray, query_texts: Sequence[str],
             num_candidates: int, slate):
    """`bank.Bank.search` with this first stage: `(rows [q, K], mask [q, K], candidates
    [q, K, d + F] (embedding | features), (slate [q, s], slate_mask [q, s], z [q, K]))`.

    Args:
      bank: the memory's dense bank (its rows `0..n` are indexed here, `sync`).
      queries: `[q, d]` unit queries.
      query_texts: `[q]` their texts (BM25's input).
      num_candidates: `K`.
      slate: `(params, hparams, slate_size, explore)` of the first round (see `bank.Bank.search`).
    """
    self.sync(bank)
    q = queries.shape[0]
    q_pad = bank_lib.pow2_at_least(q)
    padded = np.zeros((q_pad, bank.dim), np.float32)
    padded[:q] = queries
    lex_rows, lex_scores = self.pairs(query_texts, bank.capacity, q_pad)
    params, hparams, size, explore = slate
    o = self.options
    out = _search_slates(padded, bank.emb, bank.valid, bank.stores, lex_rows, lex_scores, params,
                         hparams if explore else None, k=num_candidates,
                         multistore=self.multistore, generator=self.candidates, fusion=o.fusion,
                         rrf_k=float(o.rrf_k), lexical_weight=float(o.lexical_weight),
                         slate_size=int(size), explore=bool(explore))
    ints, floats = (np.asarray(a) for a in out)
    return bank_lib._unpack(ints, floats, q, num_candidates, bank.dim + NUM_FEATURES, size)  # pylint: disable=protected-access


# ------------------------------------------------------------------------------------------------
# jitted kernels


def rrf_depth(rrf_k: float, k: int, capacity: int) -> int:
  """`t`: the rows of each ranking that can reach the RRF top-`k` (module docstring)."""
  return min(capacity, int(math.ceil(rrf_k + 2 * k)) + 1)


def _masked_top(x, where, k):
  """`(values [q, k], rows [q, k])` of `x [q, C]` over `where [C]` (-inf beyond, lower row first
  on ties, as the pipeline's stable sort)."""
  return jax.lax.top_k(jnp.where(where[None], x, -jnp.inf), k)


def _ranks_of(x, where, rows, vals):
  """`[q, R]` 1-based rank of bank rows `rows [q, R]` (values `vals`) in the ranking of `x [q, C]`
  over `where` (higher first, lower row first on ties)."""
  col = jnp.arange(x.shape[1], dtype=jnp.int32)
  before = (x[:, None, :] > vals[..., None]) | ((x[:, None, :] == vals[..., None])
                                                & (col[None, None, :] < rows[..., None]))
  return 1 + jnp.sum(before & where[None, None, :], axis=-1, dtype=jnp.int32)


def _minmax(x, where):
  """`first_stage._minmax` over `where [C]` for `x [q, C]` (0 where the valid values are equal)."""
  lo = jnp.min(jnp.where(where[None], x, jnp.inf), axis=1, keepdims=True)
  hi = jnp.max(jnp.where(where[None], x, -jnp.inf), axis=1, keepdims=True)
  span = hi - lo
  return jnp.where(span > 0, (x - lo) / jnp.where(span > 0, span, 1.0), 0.0)


def _rrf(cos, lex, where, k, rrf_k):
  """The RRF top-`k` of one store (module docstring): `(scores [q, k], rows [q, k])`."""
  t = rrf_depth(rrf_k, k, cos.shape[1])
  v_d, r_d = _masked_top(cos, where, t)
  v_l, r_l = _masked_top(lex, where, t)
  pos = jnp.arange(1, t + 1, dtype=jnp.int32)[None]
  ok_d, ok_l = v_d > -jnp.inf, v_l > -jnp.inf
  # Each list's rows in the other ranking (exact counts; the lists' own ranks are their positions).
  lex_at_d = jnp.take_along_axis(lex, r_d, 1)
  cos_at_l = jnp.take_along_axis(cos, r_l, 1)
  rank_ld = _ranks_of(lex, where, r_d, lex_at_d)
  rank_dl = _ranks_of(cos, where, r_l, cos_at_l)
  in_d = jnp.any((r_l[:, :, None] == r_d[:, None, :]) & ok_d[:, None, :], axis=-1)
  fuse = lambda a, b: 1.0 / (rrf_k + a.astype(jnp.float32)) + 1.0 / (rrf_k + b.astype(jnp.float32))
  rows = jnp.concatenate([r_d, r_l], 1)
  fused = jnp.concatenate([fuse(pos, rank_ld), fuse(rank_dl, pos)], 1)
  ok = jnp.concatenate([ok_d, ok_l & ~in_d], 1)
  key = jnp.where(ok, -fused, jnp.inf)
  key, rows, fused, ok = jax.lax.sort((key, rows, fused, ok), dimension=1, num_keys=2)
  return jnp.where(ok[:, :k], fused[:, :k], -jnp.inf), rows[:, :k]


def _generate(cos, lex, where, k, generator, fusion, rrf_k, lexical_weight):
  """`(scores [q, k], rows [q, k])` of one first stage over `where [C]`, best first (-inf past the
  valid rows)."""
  if generator == "dense":
    return _masked_top(cos, where, k)
  if generator == "bm25":
    return _masked_top(lex, where, k)
  if fusion == "rrf":
    return _rrf(cos, lex, where, k, rrf_k)
  w = lexical_weight
  return _masked_top(w * _minmax(lex, where) + (1.0 - w) * _minmax(cos, where), where, k)


def _features(cos, lex, rows, scores, mask):
  """`first_stage.features` on the device: `[q, K, F]` (0 on padding)."""
  first = jnp.where(mask, _minmax_rows(jnp.where(mask, scores, 0.0), mask), 0.0)
  safe = jnp.maximum(rows, 0)
  c = jnp.take_along_axis(cos, safe, 1)
  lx = jnp.take_along_axis(lex, safe, 1)
  best = jnp.max(jnp.where(mask, lx, 0.0), axis=1, keepdims=True)
  lx = jnp.where(best > 0, lx / jnp.where(best > 0, best, 1.0), 0.0)
  return jnp.where(mask[..., None], jnp.stack([first, c, lx], -1), 0.0)


def _minmax_rows(x, where):
  """`_minmax` with a per-query mask `where [q, K]`."""
  lo = jnp.min(jnp.where(where, x, jnp.inf), axis=1, keepdims=True)
  hi = jnp.max(jnp.where(where, x, -jnp.inf), axis=1, keepdims=True)
  span = hi - lo
  return jnp.where(span > 0, (x - lo) / jnp.where(span > 0, span, 1.0), 0.0)


def _block(queries, emb, valid, stores, lex_rows, lex_scores, k, multistore, generator, fusion,
           rrf_k, lexical_weight):
  """Candidates of a block of queries: `(rows [b, K], mask [b, K], scores [b, K], features
  [b, K, F])`."""
  cap = emb.shape[0]
  cos = retrieval_lib._chunk_scores(queries, emb)  # [b, C] float32  pylint: disable=protected-access
  b = queries.shape[0]
  lex = jnp.zeros((b, cap), jnp.float32).at[jnp.arange(b)[:, None], lex_rows].set(
      lex_scores, mode="drop")
  gen = functools.partial(_generate, generator=generator, fusion=fusion, rrf_k=rrf_k,
                          lexical_weight=lexical_weight)
  if multistore:
    parts = [gen(cos, lex, valid & (stores == s), k // 2) for s in (0, 1)]
    sc = jnp.concatenate([p[0] for p in parts], 1)
    rows = jnp.concatenate([p[1] for p in parts], 1)
    pos = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[None], sc.shape)
    _, _, sc, rows = jax.lax.sort((-sc, pos, sc, rows), dimension=1, num_keys=2)
  else:
    sc, rows = gen(cos, lex, valid & (stores == 0), k)
  mask = sc > -jnp.inf
  rows = jnp.where(mask, rows, -1).astype(jnp.int32)
  return rows, mask, _features(cos, lex, rows, sc, mask)


@functools.partial(jax.jit, static_argnames=("k", "multistore", "generator", "fusion", "rrf_k",
                                             "lexical_weight", "slate_size", "explore"))
def _search_slates(queries, emb, valid, stores, lex_rows, lex_scores, params, hparams, *, k,
                   multistore, generator, fusion, rrf_k, lexical_weight, slate_size, explore):
  """The first stage of `[q, d]` queries, their candidates' rows `[embedding | features]` and
  each query's first-round slate, in one call (packed as `bank._pack`)."""
  cap = emb.shape[0]
  q = queries.shape[0]
  per_block = min(q, bank_lib.pow2_at_least(max(1, retrieval_lib.SCORE_BUDGET // cap) + 1) // 2)
  fn = lambda x: _block(*x[:1], emb, valid, stores, *x[1:], k, multistore, generator, fusion,
                        rrf_k, lexical_weight)
  xs = (queries, lex_rows, lex_scores)
  if per_block == q:
    rows, mask, feats = fn(xs)
  else:  # blocks of `per_block` queries (both powers of two), one after the other
    blocks = tuple(a.reshape((q // per_block, per_block) + a.shape[1:]) for a in xs)
    rows, mask, feats = (a.reshape((q,) + a.shape[2:]) for a in jax.lax.map(fn, blocks))
  emb_rows = bank_lib._rows_of(jax.lax.optimization_barrier(emb), rows, mask)  # pylint: disable=protected-access
  cands = jnp.concatenate([emb_rows, feats.astype(jnp.float32)], -1)  # [q, K, d + F]
  fresh = jnp.zeros(mask.shape, jnp.float32)
  stats = explorer_lib.BanditStats(mean=fresh, counts=fresh) if explore else None
  return bank_lib._pack(rows, mask, cands, retrieval_lib.batch_slates(  # pylint: disable=protected-access
      params, queries, cands, mask, slate_size, hparams, stats))
