"""The lexical first stage: BM25 over a bank's texts, on the `bm25s` engine.

Symbols: `M` memories in a bank, `n` queries.

One tokenisation and one scoring for every caller (the benchmark pipeline, `ear_jax.agent.Memory`),
so identical texts get identical scores everywhere:
- tokens: lower-cased runs of word characters (`TOKEN_PATTERN`, `\\w+`: letters, digits, `_`),
  with bm25s's English stop-word list `en_plus` (179 words: function words, pronouns and question
  words such as 'what' / 'did') removed; no stemming (on LoCoMo, bm25s's 33-word list 'en' gives
  40.0 Recall@5, 'en_plus' 45.9: question words match half of every conversation);
- scoring: BM25 (Lucene's variant, `k1 = 1.2`, `b = 0.75`) with the bank's own document
  frequencies and length statistics (a bank is one conversation / one question's haystack / one
  `Memory`).

Why bm25s (BUILD_NOTES "First stage"): it keeps the index as sparse matrices that score a query in
one sparse product, builds a bank of 600 turns in about a millisecond, and returns the whole score
vector (`get_scores`), which the hybrid fusion needs. It has no incremental add; a `Memory` rebuilds
its index lazily on the first search after a change (`LexicalIndex`).
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

TOKEN_PATTERN = r"(?u)\b\w+\b"
STOPWORDS = "en_plus"
K1 = 1.2
B = 0.75


@functools.cache
def _bm25s():
  """The `bm25s` module, imported on first use: importing it runs a JAX op, which would start JAX
  before a multi-process run's `jax.distributed.initialize()` (`experiments.dist_flags`)."""
  import bm25s  # pylint: disable=g-import-not-at-top
  return bm25s


def tokenize(texts: Sequence[str]) -> list[list[str]]:
  """The token lists of `texts` (see the module docstring); an empty text gives `[]`."""
  return _bm25s().tokenize(list(texts), lower=True, token_pattern=TOKEN_PATTERN,
                        stopwords=STOPWORDS, stemmer=None, return_ids=False, show_progress=False)


def new_engine():
  """An empty `bm25s.BM25` with this module's scoring (`K1`, `B`, Lucene's variant): index it with
  `engine.index(token lists)` or `engine.index((token id lists, vocab))` (the same scores)."""
  return _bm25s().BM25(k1=K1, b=B, method="lucene")


class LexicalIndex:
  """BM25 over one bank of texts.

  Args:
    texts: `[M]` memory texts (row order = the bank's order).
  """

  def __init__(self, texts: Sequence[str]):
    self.num_rows = len(texts)
    self._engine = None
    if self.num_rows:
      self._engine = new_engine()
      self._engine.index(tokenize(texts), show_progress=False)

  def scores(self, query_texts: Sequence[str]) -> np.ndarray:
    """`[n, M]` float32 BM25 scores of each query against every row (0 for no shared term)."""
    out = np.zeros((len(query_texts), self.num_rows), np.float32)
    if self._engine is None:
      return out
    for i, tokens in enumerate(tokenize(query_texts)):
      if tokens:
        out[i] = self._engine.get_scores(tokens)
    return out


def bm25_scores(bank_texts: Sequence[str], query_texts: Sequence[str]) -> np.ndarray:
  """`[n, M]` BM25 scores of `query_texts` against one bank (`LexicalIndex(bank).scores`)."""
  return LexicalIndex(bank_texts).scores(query_texts)
