"""The lexical first stage: the tokeniser and an incremental, scoped BM25 index (`BM25Index`).

Symbols: `N` documents (rows) of the allowed scopes, `V` term ids, `P` postings (one per
(document, distinct term)), `S` scope codes, `n` queries.

One tokenisation and one scoring for every caller: bm25s's lower-cased `\\w+` runs without its
`en_plus` stop words, no stemming; Lucene's BM25 (`K1 = 1.2`, `B = 0.75`) with the statistics of
the ALLOWED SCOPES only, so a scoped query equals bm25s's `get_scores` over that bank alone, bit
for bit (`tests/test_bm25_index.py`). Raw term frequencies are stored (unlike bm25s), so documents
can be added and deleted; scores use bm25s's float operations and order.

Layout: postings `(key = term << 31 | scope, row, tf)` in a sorted base, a sorted delta and an
append-only tail, merged when they outgrow their shares (an add is `O(its tokens)` amortised).
`delete` is `O(its tokens)`: statistics decremented, postings masked until the next base merge.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import numpy as np

TOKEN_PATTERN = r"(?u)\b\w+\b"
STOPWORDS = "en_plus"
K1 = 1.2
B = 0.75
MIN_DELTA = 1 << 16  # delta postings always allowed before a merge into the base
DELTA_SHARE = 16  # ... or this fraction of the base
MAX_TAIL = 1 << 12  # tail postings (scanned by every query) before a merge into the delta
DENSE_SHARE = 8  # a query matching more than 1 / this of the rows sums into a [rows] array
_SCOPE_BITS = 31


@functools.cache
def _bm25s():
  """The `bm25s` module, imported on first use (importing it starts JAX)."""
  import bm25s  # pylint: disable=g-import-not-at-top
  return bm25s


def tokenize(texts: Sequence[str]) -> list[list[str]]:
  """The token lists of `texts` (see the module docstring); an empty text gives `[]`."""
  return _bm25s().tokenize(list(texts), lower=True, token_pattern=TOKEN_PATTERN,
                           stopwords=STOPWORDS, stemmer=None, return_ids=False,
                           show_progress=False)


def pack(token_ids: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  """`(tokens [T] int32, offsets [n + 1] int64)` of `n` token id arrays, concatenated."""
  lens = np.fromiter((len(t) for t in token_ids), np.int64, len(token_ids))
  offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
  flat = np.concatenate([np.zeros(0, np.int32)] + [np.asarray(t, np.int32) for t in token_ids])
  return flat, offsets


def term_ids(vocab: dict, tokens: Sequence[str], grow: bool = False) -> np.ndarray:
  """`[t]` int32 ids of `tokens` in `vocab`; `grow`: new terms get new ids, else are left out."""
  if grow:
    return np.fromiter((vocab.setdefault(w, len(vocab)) for w in tokens), np.int32)
  return np.fromiter((vocab[w] for w in tokens if w in vocab), np.int32)


def _grown(a: np.ndarray, n: int) -> np.ndarray:
  """`a` (1-D) with room for at least `n` entries (doubling; new entries 0)."""
  if n <= len(a):
    return a
  out = np.zeros(max(n, 2 * len(a), 16), a.dtype)
  out[:len(a)] = a
  return out


def _merged(sorted_seg: tuple, new: tuple) -> tuple:
  """`(key, row, tf)` of a sorted segment and postings `new`, merged by key (segment first)."""
  order = np.argsort(new[0], kind="stable")
  cat = [np.concatenate([a, b[order]]) for a, b in zip(sorted_seg, new)]
  order = np.argsort(cat[0], kind="stable")
  return tuple(a[order] for a in cat)


class BM25Index:
  """An incremental, scoped BM25 index over integer term ids (module docstring).

  Rows are the caller's document numbers (any non-negative int, each added at most once while live).
  """

  def __init__(self):
    self._length = np.zeros(0, np.int64)  # [rows] tokens per document
    self._scope = np.zeros(0, np.int32)  # [rows] scope code
    self._live = np.zeros(0, bool)  # [rows] indexed and not deleted
    self._used = np.zeros(0, bool)  # [rows] ever indexed (a row is never indexed twice)
    self._docs = np.zeros(0, np.int64)  # [S] live documents per scope
    self._tokens = np.zeros(0, np.int64)  # [S] their tokens
    self._df = np.zeros(0, np.int64)  # [V] live documents per term (every scope)
    self._row_terms = np.zeros(0, np.int32)  # every added row's distinct terms, in add order
    self._row_start = np.zeros(0, np.int64)  # [rows] where a row's terms start there
    self._row_count = np.zeros(0, np.int32)  # [rows] and how many
    self._num_row_terms = 0
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32))
    self._base = empty  # (key [P] int64 sorted, row [P] int64, tf [P] int32)
    self._delta = empty  # the same, sorted (the postings since the base's last merge)
    self._tail = tuple(a.copy() for a in empty)  # the same, unsorted, with room to append
    self._num_tail = 0
    self._dead_postings = 0  # postings of deleted rows still in the segments

  def __len__(self) -> int:
    """Live documents."""
    return int(self._docs.sum())

  @property
  def df(self) -> np.ndarray:
    """`[V]` int64 live documents per term id, every scope (a view: do not modify)."""
    return self._df

  def add(self, rows, scopes, tokens: np.ndarray, offsets: np.ndarray) -> None:
    """Indexes documents `rows [n]` with `scopes [n]` and packed term ids (`pack`; repeats count).

    Raises:
      ValueError: for a row indexed before.
    """
    rows = np.asarray(rows, np.int64)
    scopes = np.asarray(scopes, np.int32)
    tokens = np.asarray(tokens, np.int64)
    offsets = np.asarray(offsets, np.int64)
    n = len(rows)
    if not n:
      return
    if rows.min() < 0 or scopes.min() < 0 or (len(tokens) and tokens.min() < 0):
      raise ValueError("BM25Index.add: rows, scopes and term ids must be non-negative")
    top = int(rows.max()) + 1
    for name in ("_length", "_scope", "_live", "_used", "_row_start", "_row_count"):
      setattr(self, name, _grown(getattr(self, name), top))
    if self._used[rows].any() or len(np.unique(rows)) != n:
      raise ValueError(f"BM25Index.add: rows {rows[self._used[rows]][:5].tolist()} (or repeated "
                       "rows) were indexed before (a row number is never reused)")
    lengths = np.diff(offsets)
    doc = np.repeat(np.arange(n, dtype=np.int64), lengths)
    vmax = int(tokens.max()) + 1 if len(tokens) else 1
    pairs, tf = np.unique(doc * vmax + tokens, return_counts=True)  # by (document, term)
    d, term = pairs // vmax, pairs % vmax
    self._length[rows], self._scope[rows] = lengths, scopes
    self._live[rows] = self._used[rows] = True
    self._docs = _grown(self._docs, int(scopes.max()) + 1)
    self._tokens = _grown(self._tokens, len(self._docs))
    np.add.at(self._docs, scopes, 1)
    np.add.at(self._tokens, scopes, lengths)
    self._df = _grown(self._df, vmax)
    np.add.at(self._df, term, 1)
    self._row_terms = _grown(self._row_terms, self._num_row_terms + len(term))
    self._row_terms[self._num_row_terms:self._num_row_terms + len(term)] = term
    per_doc = np.bincount(d, minlength=n)
    self._row_start[rows] = self._num_row_terms + np.concatenate([[0], np.cumsum(per_doc)[:-1]])
    self._row_count[rows] = per_doc
    self._num_row_terms += len(term)
    self._append((term << _SCOPE_BITS) | scopes[d], rows[d], tf.astype(np.int32))

  def delete(self, rows) -> np.ndarray:
    """Removes live documents `rows`; returns the term ids no live document holds now."""
    rows = self._live_rows(np.unique(np.asarray(rows, np.int64)))
    if not len(rows):
      return np.zeros(0, np.int64)
    terms = self.terms_of(rows)
    self._live[rows] = False
    self._dead_postings += len(terms)
    np.subtract.at(self._docs, self._scope[rows], 1)
    np.subtract.at(self._tokens, self._scope[rows], self._length[rows])
    np.subtract.at(self._df, terms, 1)
    terms = np.unique(terms)
    return terms[self._df[terms] == 0]

  def terms_of(self, rows) -> np.ndarray:
    """The distinct term ids of live documents `rows`, concatenated (with repeats across rows)."""
    rows = self._live_rows(np.asarray(rows, np.int64))
    parts = [self._row_terms[s:s + c] for s, c in zip(self._row_start[rows], self._row_count[rows])]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

  def _live_rows(self, rows: np.ndarray) -> np.ndarray:
    rows = rows[rows < len(self._live)]
    return rows[self._live[rows]]

  def _append(self, key, row, tf) -> None:
    """Appends postings to the tail, merging segments that outgrew their shares."""
    m = self._num_tail + len(key)
    self._tail = tuple(_grown(a, m) for a in self._tail)
    for a, v in zip(self._tail, (key, row, tf)):
      a[self._num_tail:m] = v
    self._num_tail = m
    if m > MAX_TAIL:
      self._delta = _merged(self._delta, tuple(a[:m] for a in self._tail))
      self._tail = tuple(np.zeros(0, a.dtype) for a in self._tail)
      self._num_tail = 0
      if len(self._delta[0]) > max(MIN_DELTA, len(self._base[0]) // DELTA_SHARE):
        self._merge()

  def _merge(self) -> None:
    """Base + delta + tail -> a new base of the live postings, sorted by key (ties: add order)."""
    tail = tuple(a[:self._num_tail] for a in self._tail)
    key, row, tf = _merged(_merged(self._base, self._delta), tail)
    keep = self._live[row]
    self._base = (key[keep], row[keep], tf[keep])
    empty = tuple(np.zeros(0, a.dtype) for a in self._tail)
    self._delta, self._tail, self._num_tail = empty, tuple(a.copy() for a in empty), 0
    self._dead_postings = 0

  def _postings(self, terms: np.ndarray, scopes: Optional[np.ndarray]):
    """Per term of `terms [u]`, its live `(rows [m] int64, tf [m] int32)` in `scopes`."""
    if scopes is None:
      lo_key, hi_key = (terms << _SCOPE_BITS)[:, None], ((terms + 1) << _SCOPE_BITS)[:, None]
    else:
      lo_key = (terms[:, None] << _SCOPE_BITS) | scopes[None]
      hi_key = lo_key + 1
    ranges = [(seg, np.searchsorted(seg[0], lo_key).tolist(), np.searchsorted(seg[0], hi_key)
               .tolist()) for seg in (self._base, self._delta) if len(seg[0])]
    tail = None
    if self._num_tail:
      dk, dr, dt = (a[:self._num_tail] for a in self._tail)
      sel = np.isin(dk >> _SCOPE_BITS, terms)
      if scopes is not None:
        sel &= np.isin(dk & ((1 << _SCOPE_BITS) - 1), scopes)
      sel = np.flatnonzero(sel)
      tail = (dk[sel] >> _SCOPE_BITS, dr[sel], dt[sel])
    out = []
    empty = (self._base[1][:0], self._base[2][:0])
    for j, term in enumerate(terms.tolist()):
      parts = [(seg[1][a:b], seg[2][a:b]) for seg, lo, hi in ranges
               for a, b in zip(lo[j], hi[j]) if b > a]
      if tail is not None:
        mine = tail[0] == term
        parts.append((tail[1][mine], tail[2][mine]))
      rows, tfs = parts[0] if len(parts) == 1 else (
          tuple(np.concatenate([p[i] for p in parts]) for i in (0, 1)) if parts else empty)
      if self._dead_postings:  # (deleted rows' postings stay until the next merge)
        live = self._live[rows]
        rows, tfs = rows[live], tfs[live]
      out.append((rows, tfs))
    return out

  def scores(self, queries: Sequence[np.ndarray], allowed: Optional[np.ndarray] = None
             ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per query (term ids in order), `(rows [m] int64 ascending, scores [m] float32 > 0)`.

    Statistics are those of the scopes `allowed` (`[S']` bool over scope codes; None: every
    document): equal to bm25s `get_scores` over those documents alone.
    """
    if allowed is None:
      scopes, num_docs, num_tokens = None, self._docs.sum(), self._tokens.sum()
    else:
      scopes = np.flatnonzero(np.asarray(allowed, bool)[:len(self._docs)]).astype(np.int64)
      num_docs, num_tokens = self._docs[scopes].sum(), self._tokens[scopes].sum()
    out = []
    for q in queries:
      q = np.asarray(q, np.int64)
      q = q[(q >= 0) & (q < len(self._df))]
      if not len(q) or not num_docs:
        out.append((np.zeros(0, np.int64), np.zeros(0, np.float32)))
        continue
      out.append(self._score(q, scopes, int(num_docs), np.float64(int(num_tokens)) / num_docs))
    return out

  def _score(self, q, scopes, num_docs: int, l_avg):
    """One query's `(rows, scores)` (`scores`): bm25s's float operations, in its order."""
    terms, inverse = np.unique(q, return_inverse=True)
    postings = self._postings(terms, scopes)
    total = sum(len(r) for r, _ in postings)
    if not total:
      return np.zeros(0, np.int64), np.zeros(0, np.float32)
    contrib = []
    for rows, tf in postings:
      df = len(rows)  # idf: Python floats, rounded to float32 (bm25s `_build_idf_array`)
      idf = np.float32(math.log(1 + (num_docs - df + 0.5) / (df + 0.5)))
      tf = tf.astype(np.float32)
      tfc = tf / (K1 * ((1 - B) + B * self._length[rows] / l_avg) + tf)  # float64 (bm25s)
      contrib.append((idf * tfc).astype(np.float32))  # > 0
    dense = total * DENSE_SHARE > len(self._live)  # many matches: a row-indexed accumulator
    if dense:
      slots = [rows for rows, _ in postings]
      acc = np.zeros(len(self._live), np.float32)
    else:
      docs = np.unique(np.concatenate([rows for rows, _ in postings]))
      slots = [np.searchsorted(docs, rows) for rows, _ in postings]
      acc = np.zeros(len(docs), np.float32)
    for t in inverse:  # float32 sums in the query's token order (repeats count), as bm25s
      acc[slots[t]] += contrib[t]
    if dense:
      docs = np.flatnonzero(acc)
      return docs, acc[docs]
    return docs, acc
