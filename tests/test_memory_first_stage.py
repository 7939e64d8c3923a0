"""The live memory's first stage (`agent.memory.lexical_bank`) ranks as the benchmark pipeline
(`data.candidates.build_benchmark`) ranks each bank: one BM25, one fusion, one feature function."""
import numpy as np
import pytest

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import lexical_bank
from ear_jax.data import candidates as candidates_lib
from ear_jax.data import corpus as corpus_lib
from ear_jax.data import first_stage

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango").split()
DIM = 16
K = 8


def _texts(n, seed):
  """`n` texts of 2..7 words from a small Zipf-like vocabulary (shared terms, repeated terms)."""
  rng = np.random.default_rng(seed)
  p = 1.0 / np.arange(1, len(WORDS) + 1)
  return [" ".join(rng.choice(WORDS, rng.integers(2, 8), p=p / p.sum())) for _ in range(n)]


def _unit(x):
  return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _bank(n=60, nq=8, seed=0):
  rng = np.random.default_rng(seed)
  return (_texts(n, seed), _unit(rng.standard_normal((n, DIM))), _texts(nq, seed + 100),
          _unit(rng.standard_normal((nq, DIM))))


def _pipeline(banks, k=K, candidates="hybrid", options=first_stage.FirstStageOptions(),
              multistore=False):
  """`build_benchmark` over `banks` (each `(texts, emb, stores, query texts, query emb)`):
  `(candidate ids [N, K], features [N, K, F])`, queries bank after bank (ids `b<g>:<row>`)."""
  cbanks, queries, bank_emb, q_emb = [], [], [], []
  for g, (texts, emb, stores, qtexts, qemb) in enumerate(banks):
    ids = [f"b{g}:{i}" for i in range(len(texts))]
    cbanks.append(corpus_lib.Bank(ids=ids, texts=list(texts), stores=np.asarray(stores, np.int8),
                                  refs=[()] * len(texts)))
    gold = (ids[int(np.flatnonzero(np.asarray(stores) == 0)[0])],)  # (every query is evaluable)
    queries += [corpus_lib.Query(id=f"q{g}:{i}", text=t, gold=gold, category="c", group=g)
                for i, t in enumerate(qtexts)]
    bank_emb.append(emb)
    q_emb.append(qemb)
  ec = corpus_lib.EmbeddedCorpus(corpus_lib.Corpus("t", cbanks, queries, {}), bank_emb,
                                 np.concatenate(q_emb))
  bench = candidates_lib.build_benchmark(ec, k=k, multistore=multistore, candidates=candidates,
                                         side_features=True, first_stage_options=options)
  assert len(bench.query_ids) == len(queries)
  return bench.candidate_ids, np.asarray(bench.stream.candidates)[..., DIM:]


class _Live:
  """A `LexicalBank` and a `bank.DeviceBank` filled as `Memory` fills them (encode, table write,
  add; delete), rows never reused."""

  def __init__(self, candidates="hybrid", options=first_stage.FirstStageOptions(),
               multistore=False, capacity=64, dim=DIM):
    self.lex = lexical_bank.LexicalBank(candidates, options, multistore)
    self.bank = bank_lib.empty(dim, capacity)
    self.ids: list[str] = []

  def add(self, texts, emb, stores, scope, ids):
    rows = np.arange(len(self.ids), len(self.ids) + len(texts))
    enc = self.lex.encode(lexical_bank.tokenize(texts), stores)
    self.bank = bank_lib.write(self.bank, rows, emb, stores, np.full(len(texts), scope))
    self.lex.add(rows, enc, np.full(len(texts), scope, np.int32))
    self.ids += list(ids)
    return enc

  def delete(self, rows):
    dead = self.lex.dead_terms(rows)
    self.bank = bank_lib.tombstone(self.bank, rows)
    assert sorted(self.lex.delete(rows)) == sorted(dead)
    return dead

  def search(self, qtexts, qemb, scope=None, num_scopes=1, k=K):
    allowed = None if scope is None else np.arange(bank_lib.pow2_at_least(num_scopes)) == scope
    rows, mask, cands, _ = self.lex.search(self.bank, qemb, qtexts, k, allowed=allowed)
    ids = np.where(mask, np.asarray(self.ids + [""])[rows], "")
    return ids, cands[..., -len(first_stage.FEATURES):]


def _check(got, want):
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_allclose(got[1], want[1], atol=1e-6)


@pytest.mark.parametrize("multistore", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_candidates_equal_build_benchmark(multistore):
  texts, emb, qtexts, qemb = _bank(n=50, seed=4)
  texts[40:45], emb[40:45] = texts[10:15], emb[10:15]  # duplicates: equal scores, ties by row
  stores = (np.arange(50) % 4 == 3).astype(np.int8)
  live = _Live(multistore=multistore)
  live.add(texts, emb, stores, 0, [f"b0:{i}" for i in range(50)])
  _check(live.search(qtexts, qemb), _pipeline([(texts, emb, stores, qtexts, qemb)],
                                               multistore=multistore))


def test_each_scope_ranks_as_the_pipeline_ranks_its_own_bank():
  """One live bank holding three conversations (one scope each) against the pipeline's three
  banks: BM25 scores a scoped query with its scope's statistics, so a tenant's vocabulary never
  changes another's ranking."""
  banks, live = [], _Live(capacity=256)
  for g, n in enumerate((40, 60, 50)):  # (one padded bank size: one compile)
    texts, emb, qtexts, qemb = _bank(n=n, seed=10 + g)
    if g == 1:  # a conversation full of one word: its df / mean length differ from the others'
      texts = [t + " golf golf" for t in texts]
    stores = np.zeros(n, np.int8)
    banks.append((texts, emb, stores, qtexts, qemb))
    live.add(texts, emb, stores, g, [f"b{g}:{i}" for i in range(n)])
  want_ids, want_f = _pipeline(banks)
  got = [live.search(b[3], b[4], scope=g, num_scopes=3) for g, b in enumerate(banks)]
  _check((np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])),
         (want_ids, want_f))


def test_adds_and_deletes_keep_the_ranking_of_the_live_rows():
  texts, emb, qtexts, qemb = _bank(n=60, seed=1)
  live = _Live()
  for a, b in ((0, 20), (20, 21), (21, 60)):  # no rebuild between: the index is incremental
    live.add(texts[a:b], emb[a:b], np.zeros(b - a, np.int8), 0, [f"r{i}" for i in range(a, b)])
    live.search(qtexts, qemb)
  gone = [3, 17, 20, 41, 59]
  live.delete(gone)
  keep = [i for i in range(60) if i not in gone]
  want_ids, want_f = _pipeline([([texts[i] for i in keep], emb[keep], np.zeros(55, np.int8),
                                 qtexts, qemb)])
  got_ids, got_f = live.search(qtexts, qemb)
  to_row = {f"b0:{j}": f"r{i}" for j, i in enumerate(keep)}
  _check((got_ids, got_f), (np.vectorize(lambda s: to_row.get(s, ""))(want_ids), want_f))


def test_delete_drops_the_terms_no_live_row_holds_and_an_update_keeps_its_own():
  live = _Live()
  live.add(["alpha bravo", "alpha charlie", "delta delta"], _unit(np.ones((3, DIM))),
           np.zeros(3, np.int8), 0, ["a", "b", "c"])
  assert live.delete([0]) == ["bravo"]
  assert "bravo" not in live.lex.vocab and "alpha" in live.lex.vocab
  enc = live.lex.encode(lexical_bank.tokenize(["delta echo"]), [0])  # update of row 2
  assert live.lex.dead_terms([2], keep=enc) == [] and live.lex.dead_terms([2]) == ["delta"]
  assert [t for t, _ in enc.new_vocab] == ["echo"]
  live.lex.add([3], enc, [0])
  assert live.lex.delete([2]) == []
  assert sorted(live.lex.delete([1, 3])) == ["alpha", "charlie", "delta", "echo"]
  assert not live.lex.vocab and len(live.lex) == 0


def test_encode_is_pure_and_a_stale_encoding_is_refused():
  lex = lexical_bank.LexicalBank("bm25", first_stage.FirstStageOptions(), multistore=False)
  a = lex.encode([["alpha", "bravo", "alpha"], ["alpha"]], [0, 1])
  assert a.terms[0].tolist() == [0, 1, 0] and a.terms[1] is None  # an observation: not indexed
  assert not lex.vocab
  b = lex.encode([["bravo"]], [0])
  lex.add([0, 1], a, [0, 0])
  with pytest.raises(ValueError, match="stale"):
    lex.add([2], b, [0])


@pytest.mark.slow
def test_restore_from_table_rows_ranks_as_the_live_index():
  from ear_jax.agent.memory import table as table_lib  # pylint: disable=g-import-not-at-top
  texts, emb, qtexts, qemb = _bank(n=40, seed=2)
  stores = (np.arange(40) % 5 == 4).astype(np.int8)
  live = _Live(multistore=False)
  encs = [live.add(texts[a:b], emb[a:b], stores[a:b], a // 20, [f"r{i}" for i in range(a, b)])
          for a, b in ((0, 20), (20, 40))]
  live.delete([5, 6])
  terms = [t for e in encs for t in e.terms]
  keep = [i for i in range(40) if i not in (5, 6)]
  flat = [terms[i] if terms[i] is not None else np.zeros(0, np.int32) for i in keep]
  rows = table_lib.TableRows(
      rows=np.asarray(keep, np.int64), stores=stores[keep],
      scope_codes=(np.asarray(keep) >= 20).astype(np.int32), scope_names=["default", "s"],
      embeddings=emb[keep], terms=np.concatenate(flat),
      term_offsets=np.concatenate([[0], np.cumsum([len(t) for t in flat])]),
      vocab=sorted(live.lex.vocab.items()), next_row=40)
  back = lexical_bank.LexicalBank("hybrid", first_stage.FirstStageOptions(), multistore=False)
  back.restore(rows)
  assert back.vocab == live.lex.vocab and len(back) == len(live.lex)
  for scope in (None, 0, 1):
    allowed = None if scope is None else np.arange(2) == scope
    got = back.search(live.bank, qemb, qtexts, K, allowed=allowed)
    want = live.lex.search(live.bank, qemb, qtexts, K, allowed=allowed)
    for g, w in zip(got[:3], want[:3]):
      np.testing.assert_array_equal(g, w)


def test_query_without_shared_terms_ranks_by_row_as_the_pipeline():
  texts, emb, _, qemb = _bank(n=30)
  live = _Live(candidates="bm25")
  live.add(texts, emb, np.zeros(30, np.int8), 0, [f"r{i}" for i in range(30)])
  ids, feats = live.search(["zulu yankee"], qemb[:1])
  assert ids[0].tolist() == [f"r{i}" for i in range(K)]  # all score 0: lower row first
  assert not feats[0, :, 0].any() and not feats[0, :, 2].any()


_slow = pytest.mark.slow
CASES = [pytest.param("hybrid", first_stage.FirstStageOptions(fusion="rrf"), True, marks=_slow),
         pytest.param("bm25", first_stage.FirstStageOptions(), False, marks=_slow),
         pytest.param("hybrid", first_stage.FirstStageOptions(fusion="rrf"), False, marks=_slow),
         pytest.param("hybrid", first_stage.FirstStageOptions(fusion="rrf", rrf_k=3.0), False,
                      marks=_slow),
         pytest.param("hybrid", first_stage.FirstStageOptions(fusion="weighted",
                                                              lexical_weight=0.3), True,
                      marks=_slow),
         pytest.param("bm25", first_stage.FirstStageOptions(), True, marks=_slow),
         pytest.param("dense", first_stage.FirstStageOptions(), False, marks=_slow)]


@pytest.mark.parametrize("name,options,multistore", CASES)
def test_every_first_stage_equals_the_pipeline_on_a_larger_bank(name, options, multistore):
  texts, emb, qtexts, qemb = _bank(n=300, nq=12, seed=5)
  texts[200:250], emb[200:250] = texts[10:60], emb[10:60]
  stores = (np.arange(300) % 3 == 2).astype(np.int8)
  live = _Live(name, options, multistore, capacity=512)  # capacity beyond the pipeline's 512
  live.add(texts, emb, stores, 0, [f"b0:{i}" for i in range(300)])
  _check(live.search(qtexts, qemb), _pipeline([(texts, emb, stores, qtexts, qemb)],
                                               candidates=name, options=options,
                                               multistore=multistore))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hybrid", "bm25"])
def test_one_scope_per_locomo_conversation_ranks_as_the_pipeline(locomo_path, minilm, name):
  """Three of LoCoMo's conversations in ONE live index (one scope each) give every question the
  candidates (ids, order, features) the pipeline gives it in its conversation."""
  from ear_jax.data import corpora  # pylint: disable=g-import-not-at-top
  del minilm
  corpus = corpora.load_corpus("locomo", data_dir=str(locomo_path.parent), limit=3)
  ec, _ = candidates_lib.embed_corpus(corpus, "minilm", progress=False)
  bench = candidates_lib.build_benchmark(ec, candidates=name, side_features=True)
  live = _Live(name, capacity=sum(len(b) for b in corpus.banks), dim=ec.query_embeddings.shape[1])
  for g, b in enumerate(corpus.banks):
    live.add(b.texts, ec.bank_embeddings[g], b.stores, g, b.ids)
  qidx = {q.id: n for n, q in enumerate(corpus.queries)}
  k = bench.candidate_ids.shape[1]
  got_ids = np.full(bench.candidate_ids.shape, "", object)
  got_f = np.zeros((len(got_ids), k, 3), np.float32)
  for g in range(len(corpus.banks)):
    sel = np.flatnonzero(bench.group == g)
    qs = [qidx[bench.query_ids[i]] for i in sel]
    got_ids[sel], got_f[sel] = live.search([corpus.queries[n].text for n in qs],
                                           ec.query_embeddings[qs], scope=g,
                                           num_scopes=len(corpus.banks), k=k)
  np.testing.assert_array_equal(got_ids.astype(str), bench.candidate_ids)
  np.testing.assert_allclose(got_f, np.asarray(bench.stream.candidates)[..., -3:], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hybrid", "bm25"])
def test_a_live_memory_with_one_scope_per_conversation_slates_the_pipeline_candidates(
    locomo_path, minilm, name):
  """Through `Memory`'s public API: a memory holding three of LoCoMo's conversations (one scope
  each) answers each question, before any feedback, with a slate of k = K memories that is
  exactly the pipeline's K candidates of its conversation, in the first stage's order
  (z = side_init f_0 + (q.m - f_1): the order of f_0, up to float rounding between equal
  first-stage scores)."""
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  from ear_jax.core.config import EARConfig  # pylint: disable=g-import-not-at-top
  from ear_jax.data import corpora  # pylint: disable=g-import-not-at-top
  del minilm
  corpus = corpora.load_corpus("locomo", data_dir=str(locomo_path.parent), limit=3)
  ec, _ = candidates_lib.embed_corpus(corpus, "minilm", progress=False)
  bench = candidates_lib.build_benchmark(ec, candidates=name, side_features=True)
  k = bench.candidate_ids.shape[1]
  mem = Memory(None, config=EARConfig(dim=ec.query_embeddings.shape[1], num_candidates=k),
               candidates=name)
  for g, b in enumerate(corpus.banks):
    dia = np.flatnonzero(b.stores == 0)
    mem.add([b.texts[i] for i in dia], ids=[f"{g}/{b.ids[i]}" for i in dia],
            embeddings=ec.bank_embeddings[g][dia], scope=f"conversation {g}")
  qidx = {q.id: n for n, q in enumerate(corpus.queries)}
  first = np.asarray(bench.stream.candidates)[..., -3]  # f_0 of each pipeline candidate
  for g in range(len(corpus.banks)):
    sel = np.flatnonzero(bench.group == g)
    qs = [qidx[bench.query_ids[i]] for i in sel]
    slates = mem.search([corpus.queries[n].text for n in qs], k=k,
                        query_embedding=ec.query_embeddings[qs], scope=f"conversation {g}")
    for i, slate in zip(sel, slates):
      want = [f"{g}/{c}" for c in bench.candidate_ids[i]]
      assert sorted(slate.ids) == sorted(want)
      f0 = first[i][[want.index(m) for m in slate.ids]]
      assert (np.diff(f0) <= 1e-5).all(), (bench.query_ids[i], slate.ids, want)
