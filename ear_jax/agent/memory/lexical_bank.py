"""The lexical first stage of `Memory`: its vocabulary, its `lexical.BM25Index`, and the search.

Symbols: `C` bank capacity, `d` dimension, `K` candidates, `q` queries of one call (padded to a
power of two), `F = len(first_stage.FEATURES)` side features.

It ranks exactly as the benchmark pipeline ranks one bank: the same tokens, the same incremental
BM25 (a scoped query scores with its scopes' statistics) and the same kernel
(`first_stage.rank_bank`, ties by lower row), in one jitted call with `bank.finish`. A write is
`encode` (pure) -> the table's transaction -> `add`; a delete is `dead_terms` -> transaction ->
`delete`. The vocabulary never keeps a term no live row holds (a forgotten memory's words leave
with it). ANN searchers are refused here: the fusion needs every row's cosine.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import jax
import numpy as np

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import scopes as scopes_lib
from ear_jax.data import first_stage
from ear_jax.data import lexical

tokenize = lexical.tokenize


def needs_lexical(candidates: str, side_features: int) -> bool:
  """Whether a memory with this first stage keeps a `LexicalBank` (bm25, hybrid, or features)."""
  return candidates != "dense" or side_features > 0


class Encoded(NamedTuple):
  """New rows' terms as ids (`LexicalBank.encode`)."""
  terms: list  # [n] int32 term ids per row (repeats kept), None for a row not indexed
  new_vocab: tuple  # (term, id) pairs the vocabulary does not hold yet, ids ascending


class LexicalBank:
  """The vocabulary, BM25 index and first-stage search of a memory (`candidates`,
  `options`: the first stage; `multistore`: index every memory, else dialogue only)."""

  def __init__(self, candidates: str, options: first_stage.FirstStageOptions, multistore: bool):
    first_stage.check_generator(candidates)
    self.candidates, self.options, self.multistore = candidates, options, bool(multistore)
    self.vocab: dict[str, int] = {}  # term -> id
    self._term_of: dict[int, str] = {}  # id -> term
    self._next_id = 0  # ids are never reused within a run (a dead id may still have postings)
    self.index = lexical.BM25Index()

  def __len__(self):
    """Indexed (live) memories."""
    return len(self.index)

  def _indexed(self, stores) -> np.ndarray:
    stores = np.asarray(stores)
    return (stores == 0) | ((stores == 1) & self.multistore)

  def encode(self, tokens: Sequence[Sequence[str]], stores) -> Encoded:
    """The term ids of new rows' `tokens` (new terms get the next ids). Pure until `add`."""
    new: dict[str, int] = {}  # term -> id, from `_next_id` on in order of first use
    term_id = lambda w: self.vocab[w] if w in self.vocab else new.setdefault(
        w, self._next_id + len(new))
    terms = [np.asarray([term_id(w) for w in toks], np.int32) if indexed else None
             for toks, indexed in zip(tokens, self._indexed(stores))]
    return Encoded(terms, tuple(new.items()))

  def add(self, rows, encoded: Encoded, scope_codes) -> None:
    """Indexes new rows (`encoded` by `encode` under the same lock) and commits its vocabulary."""
    for term, i in encoded.new_vocab:
      if term in self.vocab or i < self._next_id:
        raise ValueError(f"LexicalBank.add: the encoding of term {term!r} is stale (encode and add "
                         "must run under the same lock, with no other add between)")
      self.vocab[term], self._term_of[i] = i, term
    if encoded.new_vocab:
      self._next_id = encoded.new_vocab[-1][1] + 1
    keep = [j for j, t in enumerate(encoded.terms) if t is not None]
    if keep:
      rows, codes = np.asarray(rows, np.int64), np.asarray(scope_codes, np.int32)
      self.index.add(rows[keep], codes[keep], *lexical.pack([encoded.terms[j] for j in keep]))

  def dead_terms(self, rows, keep: Optional[Encoded] = None) -> list[str]:
    """The terms that no live row but `rows` holds (pure), less those `keep` uses."""
    held = self.index.terms_of(np.unique(np.asarray(rows, np.int64)))
    ids, count = np.unique(held, return_counts=True)
    dead = ids[self.index.df[ids] == count]
    if keep is not None:
      used = [t for t in keep.terms if t is not None]
      if used:
        dead = dead[~np.isin(dead, np.concatenate(used))]
    return [self._term_of[int(i)] for i in dead]

  def delete(self, rows) -> list[str]:
    """Unindexes `rows` (O(their tokens)); drops and returns the terms no live row holds now."""
    dead = [self._term_of.pop(int(i)) for i in self.index.delete(rows)]
    for term in dead:
      del self.vocab[term]
    return dead

  def restore(self, table_rows, scope_codes=None) -> None:
    """Rebuilds the vocabulary and the index from `table.Table.read_all()` without tokenising."""
    self.vocab = {term: int(i) for term, i in table_rows.vocab}
    self._term_of = {i: term for term, i in self.vocab.items()}
    self._next_id = max(self._term_of, default=-1) + 1
    self.index = lexical.BM25Index()
    codes = np.asarray(table_rows.scope_codes if scope_codes is None else scope_codes, np.int32)
    keep = np.flatnonzero(self._indexed(table_rows.stores))
    offsets = np.asarray(table_rows.term_offsets, np.int64)
    lens = (offsets[1:] - offsets[:-1])[keep]
    new_offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    at = np.repeat(offsets[keep] - new_offsets[:-1], lens) + np.arange(new_offsets[-1])
    self.index.add(np.asarray(table_rows.rows, np.int64)[keep], codes[keep],
                   np.asarray(table_rows.terms, np.int32)[at], new_offsets)

  def query_ids(self, tokens: Sequence[str]) -> np.ndarray:
    """`[t]` int32 ids of a query's tokens (`tokenize`), unknown terms left out."""
    return lexical.term_ids(self.vocab, tokens)

  def search(self, bank: bank_lib.DeviceBank, queries: np.ndarray, query_texts: Sequence[str],
             k: int, *, allowed: Optional[np.ndarray] = None, slate=None,
             scope_rows: Optional[scopes_lib.ScopeRows] = None):
    """`bank.search` with this first stage: `(rows [q, K], mask [q, K], cands [q, K, d + F],
    slates or None)`, numpy. `query_texts [q]` are BM25's input; `allowed` scopes both the rows
    and the BM25 statistics; the other arguments are `bank.search`'s."""
    q, padded = len(queries), bank_lib.pad_queries(queries)
    ids = [self.query_ids(t) for t in tokenize(query_texts)]
    found = self._scores(ids, allowed)
    cand = bank_lib.scope_candidates(scope_rows, allowed, bank.emb.shape[0], len(padded))
    if cand is None:
      lex_rows, lex_scores = first_stage.pairs(found, bank.emb.shape[0], len(padded))
    else:  # the pairs' rows as positions in `cand` (a scoped query's BM25 rows are of its scopes)
      at = (lambda i: cand) if cand.ndim == 1 else (lambda i: cand[i])
      lex_rows, lex_scores = first_stage.pairs(
          [_positions(at(i), r, s) for i, (r, s) in enumerate(found)], cand.shape[-1],
          len(padded))
    params, hparams, size, explore = slate if slate is not None else (None, None, None, False)
    out = _search(padded, bank, bank_lib.query_allowed(allowed, len(padded)), cand, lex_rows,
                  lex_scores, params, hparams if explore else None, k=k,
                  multistore=self.multistore, generator=self.candidates, options=self.options,
                  slate_size=None if size is None else int(size), explore=bool(explore))
    return bank_lib.unpack(out, q, k, bank.emb.shape[1] + len(first_stage.FEATURES), size)

  def _scores(self, ids: list, allowed) -> list:
    """BM25 pairs of each query with its scopes' statistics (one call per distinct spec)."""
    if not isinstance(allowed, list):
      return self.index.scores(ids, allowed)
    groups: dict = {}
    for i, a in enumerate(allowed):
      groups.setdefault(None if a is None else a.tobytes(), []).append(i)
    found = [None] * len(ids)
    for at in groups.values():
      for i, f in zip(at, self.index.scores([ids[i] for i in at], allowed[at[0]])):
        found[i] = f
    return found


def _positions(cand: np.ndarray, rows: np.ndarray, scores: np.ndarray):
  """`(positions, scores)` of the BM25 pairs whose rows are in `cand` (ascending, padded)."""
  pos = np.minimum(np.searchsorted(cand, rows), len(cand) - 1)
  ok = cand[pos] == rows
  return pos[ok], scores[ok]


@functools.partial(jax.jit, static_argnames=("k", "multistore", "generator", "options",
                                             "slate_size", "explore"))
def _search(queries, bank, allowed, cand, lex_rows, lex_scores, params, hparams, *, k,
            multistore, generator, options, slate_size, explore):
  """`first_stage.rank_bank` over the allowed live rows, then `bank.finish`, in one call."""
  def ranked(queries, allowed, cand, lex_rows, lex_scores):
    emb, where, stores = bank_lib.gathered(bank, allowed, cand)
    rows, mask, _, feats = first_stage.rank_bank(queries, emb, where, stores, lex_rows,
                                                 lex_scores, k=k, generator=generator,
                                                 options=options, multistore=multistore)
    if cand is not None:
      rows = bank_lib.rows_at(cand, rows, mask)
    return rows, mask, feats

  rows, mask, feats = bank_lib.per_query(ranked, queries, allowed, cand, lex_rows, lex_scores)
  slate = None if slate_size is None else (params, hparams, slate_size, explore)
  return bank_lib.finish(queries, bank.emb, rows, mask, features=feats, slate=slate)
