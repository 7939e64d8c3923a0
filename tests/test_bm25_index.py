"""`lexical.BM25Index` (incremental, scoped BM25) against bm25s `get_scores`, the oracle."""
import numpy as np
import pytest

from ear_jax.data import lexical

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango").split()


def _texts(n, seed):
  """`n` texts of 0..9 words from a Zipf-like vocabulary (shared, repeated and absent terms)."""
  rng = np.random.default_rng(seed)
  p = 1.0 / np.arange(1, len(WORDS) + 1)
  return [" ".join(rng.choice(WORDS, rng.integers(0, 10), p=p / p.sum())) for _ in range(n)]


class _Vocab(dict):
  def ids(self, tokens, grow=True):
    if grow:
      return np.asarray([self.setdefault(t, len(self)) for t in tokens], np.int32)
    return np.asarray([self[t] for t in tokens if t in self], np.int32)


def _oracle(texts, queries):
  """`[n, M]` bm25s scores of `queries` over `texts` alone (a fresh bm25s index)."""
  import bm25s  # pylint: disable=g-import-not-at-top
  out = np.zeros((len(queries), len(texts)), np.float32)
  if not texts:
    return out
  engine = bm25s.BM25(k1=lexical.K1, b=lexical.B, method="lucene")
  engine.index(lexical.tokenize(texts), show_progress=False)
  for i, toks in enumerate(lexical.tokenize(queries)):
    if toks:
      out[i] = engine.get_scores(toks)
  return out


def _index(texts, scopes, vocab, rows=None):
  index = lexical.BM25Index()
  rows = np.arange(len(texts)) if rows is None else rows
  index.add(rows, scopes, *lexical.pack([vocab.ids(t) for t in lexical.tokenize(texts)]))
  return index


def _scores(index, vocab, queries, rows, allowed=None):
  """`[n, len(rows)]` the index's scores of `queries` at `rows` (0 where it returns none)."""
  q = [vocab.ids(t, grow=False) for t in lexical.tokenize(queries)]
  dense = np.zeros((len(q), int(max(rows, default=-1)) + 1), np.float32)
  for i, (found, s) in enumerate(index.scores(q, allowed)):
    keep = found < dense.shape[1]
    dense[i, found[keep]] = s[keep]
  return dense[:, rows]


QUERIES = ["alpha golf golf", "tango and the zulu", "what is it", "bravo charlie delta echo",
           "alpha bravo"]


@pytest.mark.parametrize("dense_share", [0, 10**9])  # sums per matching row / per row
def test_scores_equal_bm25s_bit_for_bit_on_one_bank(monkeypatch, dense_share):
  monkeypatch.setattr(lexical, "DENSE_SHARE", dense_share)
  texts = _texts(80, 0) + ["golf golf golf golf hotel", "What is the"]  # repeats, stop words only
  vocab = _Vocab()
  index = _index(texts, np.zeros(len(texts), np.int32), vocab)
  got = _scores(index, vocab, QUERIES, np.arange(len(texts)))
  want = _oracle(texts, QUERIES)
  np.testing.assert_array_equal(got, want)
  assert (got[0] > 0).sum() > 10 and not got[2].any()  # shared terms found; stop words score 0


def test_each_scope_scores_with_its_own_statistics():
  texts = _texts(150, 1)
  scopes = np.random.default_rng(1).integers(0, 4, len(texts)).astype(np.int32)
  vocab = _Vocab()
  index = _index(texts, scopes, vocab)
  for s in range(4):
    rows = np.flatnonzero(scopes == s)
    allowed = np.arange(4) == s
    got = _scores(index, vocab, QUERIES, rows, allowed)
    np.testing.assert_array_equal(got, _oracle([texts[r] for r in rows], QUERIES))
    other = _scores(index, vocab, QUERIES, np.flatnonzero(scopes != s), allowed)
    assert not other.any()  # rows of other scopes never score
  pair = np.isin(scopes, [1, 3])  # two scopes: their pooled statistics
  got = _scores(index, vocab, QUERIES, np.flatnonzero(pair), np.isin(np.arange(4), [1, 3]))
  np.testing.assert_array_equal(got, _oracle([t for t, p in zip(texts, pair) if p], QUERIES))
  np.testing.assert_array_equal(_scores(index, vocab, QUERIES, np.arange(len(texts))),
                                _oracle(texts, QUERIES))  # None: every scope


@pytest.mark.parametrize("max_tail,min_delta", [
    (16, 8),  # the tail merged into the delta and the delta into the base, often
    pytest.param(16, 1 << 16, marks=pytest.mark.slow),  # the tail into the delta only
    (1 << 12, 1 << 16)])  # no merge
def test_interleaved_adds_and_deletes_equal_a_fresh_index_of_the_live_rows(monkeypatch, max_tail,
                                                                           min_delta):
  monkeypatch.setattr(lexical, "MAX_TAIL", max_tail)
  monkeypatch.setattr(lexical, "MIN_DELTA", min_delta)
  merged = []
  merge = lexical.BM25Index._merge
  monkeypatch.setattr(lexical.BM25Index, "_merge", lambda self: merged.append(1) or merge(self))
  texts = _texts(300, 2)
  scopes = (np.arange(300) % 3).astype(np.int32)
  rng = np.random.default_rng(2)
  vocab = _Vocab()
  index = lexical.BM25Index()
  live = np.zeros(300, bool)
  start = 0
  for step in range(12):
    stop = min(300, start + int(rng.integers(1, 40)))
    ids = [vocab.ids(t) for t in lexical.tokenize(texts[start:stop])]
    index.add(np.arange(start, stop), scopes[start:stop], *lexical.pack(ids))
    live[start:stop] = True
    start = stop
    gone = rng.choice(np.flatnonzero(live), int(rng.integers(0, 8)), replace=False)
    index.delete(gone)
    live[gone] = False
    s = step % 3
    rows = np.flatnonzero(live & (scopes == s))
    got = _scores(index, vocab, QUERIES, rows, np.arange(3) == s)
    np.testing.assert_array_equal(got, _oracle([texts[r] for r in rows], QUERIES))
    assert len(index) == live.sum()
  assert bool(merged) == (min_delta == 8)  # (the tail and the delta reached their merges)
  dead = index.delete(np.flatnonzero(live))
  assert len(index) == 0 and not index.df.any()
  assert set(dead.tolist()) <= set(vocab.values())


def test_delete_reports_the_terms_no_live_document_holds():
  vocab = _Vocab()
  index = _index(["alpha bravo", "alpha charlie", "delta"], np.zeros(3, np.int32), vocab)
  assert index.delete([0]).tolist() == [vocab["bravo"]]
  assert sorted(index.delete([1, 2, 2]).tolist()) == sorted([vocab["alpha"], vocab["charlie"],
                                                             vocab["delta"]])
  assert index.delete([1]).tolist() == []  # already gone: ignored


def test_a_row_is_never_indexed_twice():
  vocab = _Vocab()
  index = _index(["alpha"], np.zeros(1, np.int32), vocab)
  index.delete([0])
  with pytest.raises(ValueError, match="never reused"):
    index.add([0], [0], *lexical.pack([vocab.ids(["alpha"])]))


def test_empty_index_scope_and_query_score_nothing():
  index = lexical.BM25Index()
  assert index.scores([np.int32([0, 1])])[0][0].shape == (0,)
  vocab = _Vocab()
  index = _index(["alpha"], np.int32([2]), vocab)
  rows, scores = index.scores([vocab.ids(["alpha"])], np.bool_([True, False]))[0]
  assert rows.shape == scores.shape == (0,)  # scope 0 holds no document
  assert index.scores([np.zeros(0, np.int32)])[0][0].shape == (0,)
