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
  those `2 t` rows exactly: a row's rank in the other ranking is `1 +` the valid rows before it,
  counted by a binary search among the `t` (`_ranks_one`, `O(C log t)` per query), never by a sort
  of the bank. The fused score is rounded as the pipeline's float64 sum rounded to float32
  (`_rrf_score`), so equal sums tie there and here (lower row first).

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

Scopes: a scoped query (`bank.ScopeFilter`) ANDs `allowed[scopes]` into the valid rows inside the
jitted call, before any ranking, so rows of other scopes are never candidates and count in no
normalisation over rows or candidates (the min-max of 'weighted', the RRF ranks, the features).
The BM25 statistics themselves (document frequencies, mean length) are those of the whole index,
every scope together: one index, as for the stores.

ANN searchers (`index='faiss_*'`) are refused with bm25 / hybrid / side features: the fusion needs
every valid row's cosine (the min-max normalisation, the RRF ranks).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory import bank as bank_lib
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
  """The first stage as checkpoints store it (`Memory._parts`, `persistence.main_step`)."""
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
    self.vocab: dict[str, int] = {}  # token -> id, in order of first appearance
    self._tokens: list[np.ndarray] = []  # per `append`: the token ids of its indexed memories
    self._lengths: list[np.ndarray] = []  # per `append`: their token counts (int64)
    self._rows: list[np.ndarray] = []  # per `append`: their bank rows (int32)
    self.num_docs = 0  # indexed memories
    self.synced = 0  # bank rows seen (indexed or skipped)
    self._engine = None
    self._engine_docs = -1  # indexed memories when the engine was built
    self._rows_of = np.zeros((0,), np.int32)  # [L] bank row of each indexed memory

  def fresh(self) -> "LexicalBank":
    """An empty index with the same settings (it catches up with a bank at its first search)."""
    return LexicalBank(self.candidates, self.options, self.multistore)

  def sharing(self, candidates: str, options: first_stage.FirstStageOptions) -> "LexicalBank":
    """Another first stage over this index (its state shared as of now, not copied: for
    benchmarks that compare generators on one index)."""
    other = LexicalBank(candidates, options, self.multistore)
    other.__dict__.update({k: v for k, v in self.__dict__.items()
                           if k not in ("candidates", "options")})
    return other

  def __len__(self):
    return self.num_docs

  def append(self, tokens: Sequence[Sequence[str]], codes: np.ndarray, start: int) -> None:
    """Indexes new bank rows `start, start + 1, ...` (their `tokenize`d texts and store codes)."""
    if start != self.synced:
      raise ValueError(f"lexical index out of step with the bank: rows from {start}, expected "
                       f"{self.synced}")
    keep = [j for j, code in enumerate(codes)  # (store 2: a deleted memory, `agent.forget`)
            if int(code) == 0 or (self.multistore and int(code) == 1)]
    ids = self.vocab.setdefault
    self._tokens.append(np.fromiter((ids(w, len(self.vocab)) for j in keep for w in tokens[j]),
                                    np.int32))
    self._lengths.append(np.asarray([len(tokens[j]) for j in keep], np.int64))
    self._rows.append(start + np.asarray(keep, np.int32))
    self.num_docs += len(keep)
    self.synced = start + len(codes)

  def sync(self, bank: bank_lib.Bank) -> None:
    """Tokenises and indexes the bank rows not indexed yet (after `load` / `restore`)."""
    if self.synced < len(bank):
      self.append(tokenize(bank.texts[self.synced:]), bank.store_codes[self.synced:],
                  self.synced)

  def _scores_engine(self):
    """The bm25s engine over the indexed memories, rebuilt when memories were added since."""
    if self._engine_docs != self.num_docs:
      self._engine = None
      if self.num_docs:
        flat = np.concatenate(self._tokens)
        lengths = np.concatenate(self._lengths)
        self._tokens, self._lengths = [flat], [lengths]
        self._rows = [np.concatenate(self._rows)]
        self._engine = build_engine(flat, lengths, self.vocab)
      self._rows_of = self._rows[0] if self._rows else np.zeros((0,), np.int32)
      self._engine_docs = self.num_docs
    return self._engine

  def pairs(self, query_texts: Sequence[str], capacity: int, num_padded: int):
    """Each query's nonzero BM25 scores as `(rows [q, B] int32, scores [q, B] float32)`; padding
    rows are `capacity` (dropped by the device scatter)."""
    engine = self._scores_engine()
    rows_of = self._rows_of
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
             num_candidates: int, slate, scope=None):
    """`bank.Bank.search` with this first stage: `(rows [q, K], mask [q, K], candidates
    [q, K, d + F] (embedding | features), (slate [q, s], slate_mask [q, s], z [q, K]))`.

    Args:
      bank: the memory's dense bank (its rows `0..n` are indexed here, `sync`).
      queries: `[q, d]` unit queries.
      query_texts: `[q]` their texts (BM25's input).
      num_candidates: `K`.
      slate: `(params, hparams, slate_size, explore)` of the first round (see `bank.Bank.search`).
      scope: the scope names the candidates come from (`bank.check_scope_spec`; None: every
        scope).
    """
    self.sync(bank)
    q = queries.shape[0]
    q_pad = bank_lib.pow2_at_least(q)
    padded = np.zeros((q_pad, bank.dim), np.float32)
    padded[:q] = queries
    lex_rows, lex_scores = self.pairs(query_texts, bank.capacity, q_pad)
    params, hparams, size, explore = slate
    o = self.options
    filt = bank.scope_filter(scope)
    out = _search_slates(padded, bank.emb, bank.valid, bank.stores, bank.scopes,
                         None if filt is None else filt.allowed, lex_rows, lex_scores, params,
                         hparams if explore else None, k=num_candidates,
                         multistore=self.multistore, generator=self.candidates, fusion=o.fusion,
                         rrf_k=float(o.rrf_k), lexical_weight=float(o.lexical_weight),
                         slate_size=int(size), explore=bool(explore))
    ints, floats = (np.asarray(a) for a in out)
    return bank_lib._unpack(ints, floats, q, num_candidates, bank.dim + NUM_FEATURES, size)  # pylint: disable=protected-access


def build_engine(token_ids: np.ndarray, lengths: np.ndarray, vocab: dict):
  """A `lexical.new_engine()` indexing `L` documents given as token ids, built with bm25s's own
  scoring functions applied to all (document, term) pairs at once.

  bm25s's `index` computes the same numbers one document at a time in Python (about 19 s for a
  million memories here, against about 2 s this way); each (document, term) score is the same
  elementwise arithmetic in the same dtypes (bm25s's `_select_tfc_scorer` / `_build_idf_array`),
  the sparse matrix is bm25s's own `_np_csc`, so the scores equal `lexical.LexicalIndex` of the
  same texts bit for bit (`tests/test_memory_first_stage.py` checks it).

  Args:
    token_ids: `[T]` int32 the documents' token ids, concatenated.
    lengths: `[L]` int64 tokens per document.
    vocab: token -> id (ids `0..V-1`).
  """
  scoring = lexical._bm25s().scoring  # pylint: disable=protected-access
  engine = lexical.new_engine()
  n, v = len(lengths), len(vocab)
  doc = np.repeat(np.arange(n, dtype=np.int64), lengths)
  pairs, tf = np.unique(doc * v + token_ids, return_counts=True)
  d, tok = pairs // v, pairs % v
  df = np.bincount(tok, minlength=v)
  idf = scoring._build_idf_array(dict(enumerate(df.tolist())), n_docs=n,  # pylint: disable=protected-access
                                 compute_idf_fn=scoring._select_idf_scorer(engine.idf_method),  # pylint: disable=protected-access
                                 dtype=engine.dtype)
  tfc = scoring._select_tfc_scorer(engine.method)(  # pylint: disable=protected-access
      tf_array=tf.astype(engine.dtype), l_d=lengths[d], l_avg=lengths.mean(), k1=engine.k1,
      b=engine.b, delta=engine.delta)
  scores = (idf[tok] * tfc).astype(engine.dtype)
  data, indices, indptr = engine._np_csc(data=scores, rows=d.astype(engine.int_dtype),  # pylint: disable=protected-access
                                         cols=tok.astype(engine.int_dtype), shape=(n, v))
  engine.scores = {"data": data.astype(engine.dtype), "indices": indices, "indptr": indptr,
                   "num_docs": n}
  engine.vocab_dict = dict(vocab)
  engine.unique_token_ids_set = set(engine.vocab_dict.values())
  engine.nonoccurrence_array = None
  return engine


# ------------------------------------------------------------------------------------------------
# jitted kernels


def rrf_depth(rrf_k: float, k: int, capacity: int) -> int:
  """`t`: the rows of each ranking that can reach the RRF top-`k` (module docstring)."""
  return min(capacity, int(math.ceil(rrf_k + 2 * k)) + 1)


def _masked_top(x, where, k):
  """`(values [q, k], rows [q, k])` of `x [q, C]` over `where [C]` (-inf beyond, lower row first
  on ties, as the pipeline's stable sort)."""
  return jax.lax.top_k(jnp.where(where[None], x, -jnp.inf), k)


def _ranks_one(x, where, rows, vals):
  """`[t]` 1-based ranks of bank rows `rows [t]` (values `vals [t]`) in the ranking of `x [C]`
  over `where [C]` (higher first, lower row first on ties), without sorting the bank.

  The `t` rows are sorted by (value desc, row asc); a binary search in that order gives each bank
  row the number of the `t` that precede it (`ceil(log2(t + 1))` steps over the bank, ties by row
  included), and a histogram of those numbers, accumulated, counts the bank rows that precede each
  of the `t`. `O(C log t)` instead of the `O(t C)` of a comparison count (BM25 has many equal
  scores: every row sharing no term scores 0).
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
  """`_ranks_one` for each query of `x [q, C]`, `rows` and `vals` `[q, t]` -> `[q, t]` (one
  query after the other: batched binary searches are several times slower on CPU)."""
  return jax.lax.map(lambda a: _ranks_one(a[0], where, a[1], a[2]), (x, rows, vals))


def _minmax(x, where):
  """`first_stage._minmax` over `where [C]` for `x [q, C]` (0 where the valid values are equal)."""
  lo = jnp.min(jnp.where(where[None], x, jnp.inf), axis=1, keepdims=True)
  hi = jnp.max(jnp.where(where[None], x, -jnp.inf), axis=1, keepdims=True)
  span = hi - lo
  return jnp.where(span > 0, (x - lo) / jnp.where(span > 0, span, 1.0), 0.0)


def _split(a):
  """Veltkamp's split of float32 `a` into two 12-bit halves (`hi + lo == a` exactly)."""
  c = 4097.0 * a
  hi = c - (c - a)
  return hi, a - hi


def _two_sum(a, b):
  """`(s, e)` with `s = fl(a + b)` and `s + e == a + b` exactly (Knuth)."""
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


def _recip(x):
  """`1 / x` as a float32 pair `hi + lo` (about 48 bits; Dekker's exact product for the residual)."""
  hi = 1.0 / x
  p = hi * x
  (ah, al), (bh, bl) = _split(hi), _split(x)
  e = ((ah * bh - p) + ah * bl + al * bh) + al * bl  # hi * x == p + e exactly
  return hi, ((1.0 - p) - e) / x


def _rrf_score(a, b):
  """`1 / a + 1 / b` rounded once to float32 from about 48 bits, as the pipeline's float64 sum
  rounded to float32: rank pairs with equal sums (1/10 + 1/8 = 1/40 + 1/5) get equal scores, so
  their order is the lower row first there and here (plain float32 arithmetic differs by an ulp)."""
  (ah, al), (bh, bl) = _recip(a), _recip(b)
  s, e = _two_sum(ah, bh)
  return s + (e + (al + bl))


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
  fuse = lambda a, b: _rrf_score(rrf_k + a.astype(jnp.float32), rrf_k + b.astype(jnp.float32))
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
def _search_slates(queries, emb, valid, stores, scopes, allowed, lex_rows, lex_scores, params,
                   hparams, *, k, multistore, generator, fusion, rrf_k, lexical_weight, slate_size,
                   explore):
  """The first stage of `[q, d]` queries, their candidates' rows `[embedding | features]` and
  each query's first-round slate, in one call (packed as `bank._pack`); with `allowed [S']`
  only rows whose scope code `scopes [C]` is allowed (None: every scope)."""
  if allowed is not None:
    valid = valid & allowed[scopes]
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
