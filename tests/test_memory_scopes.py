"""Scopes, dates, `update` and `list` of `Memory`: a scoped query's candidates come only from its
scopes (exact, ANN, BM25 / hybrid; single store or multistore), one adapter learns across scopes,
and scopes and dates survive a reopen (a tampered one is refused)."""
import hashlib
import sqlite3

import jax
import numpy as np
import pytest

from ear_jax import EARConfig
from ear_jax.agent.memory import Memory, MemoryConfig, SessionDroppedError
from ear_jax.data import encoders
from ear_jax.io.checkpoints import CheckpointError
from tests.test_forget import _files_holding, stored_embeddings

D = 8
K = 6
SCOPES = ("a", "b", "c", None)  # None: the default scope
DEFAULT_SCOPE = "default"


def _config(**kw):
  base = dict(dim=D, num_candidates=K, slate_size=3, num_rounds=2, batch_size=2,
              buffer_capacity=16, replay_size=2)
  return EARConfig(**{**base, **kw})


class _HashEncoder(encoders.Encoder):
  """Bag of hashed words (texts sharing words are close): a deterministic stand-in encoder."""
  name, dim = "hash8", D

  @property
  def identity(self):
    return {"hash": D}

  def encode_new(self, texts, progress=True, bar=None):
    out = np.full((len(texts), D), 1e-3, np.float32)
    for i, t in enumerate(texts):
      for w in t.lower().split():
        out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % D] += 1.0
    return out / np.linalg.norm(out, axis=1, keepdims=True), 0


def _unit(x):
  x = np.asarray(x, np.float32)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _texts(rng, n):
  words = ["apple", "river", "stone", "cloud", "green", "music", "paper", "tiger"]
  return [" ".join(rng.choice(words, 3)) + f" note{rng.integers(1000)}" for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# the property: scopes never leak


FIRST_STAGES = [
    dict(candidates="dense"),
    dict(candidates="bm25"),
    dict(candidates="hybrid"),
    dict(index="faiss_hnsw", index_options={"ef_search": 64}),
    dict(index="faiss_ivf", index_options={"nlist": 2, "nprobe": 2, "train_factor": 4}),
    dict(index="faiss_pq", index_options={"pq_m": 4, "rerank": 2, "train_size": 16}),
]


def _random_memory(rng, multistore, **kw):
  """A memory of 8..28 random memories in batches of random scopes; the scope, store and unit
  embedding of each id."""
  m = Memory(None, config=_config(), multistore=multistore, **kw)
  about = {}
  for _ in range(rng.integers(2, 5)):
    n = int(rng.integers(2, 8))
    scope = SCOPES[rng.integers(len(SCOPES))]
    store = [["dialogue", "observation"][j] for j in rng.integers(0, 2, n)]
    emb = rng.normal(size=(n, D))
    ids = m.add(_texts(rng, n), embeddings=emb, store=store, scope=scope)
    about.update({i: (scope or DEFAULT_SCOPE, st, e) for i, st, e in zip(ids, store, _unit(emb))})
  return m, about


def _spec(rng):
  """A random scope spec: None, one name, or a list of names (maybe unknown ones)."""
  kind = rng.integers(3)
  if kind == 0:
    return None
  names = ["a", "b", "c", "default", "unknown"]
  if kind == 1:
    return str(names[rng.integers(len(names))])
  return [str(x) for x in rng.choice(names, int(rng.integers(1, 4)), replace=False)]


def _allowed(spec):
  return None if spec is None else ({spec} if isinstance(spec, str) else set(spec))


def _per_store(about, spec, multistore):
  """The ids a query of `spec` may get candidates from, per store searched, and how many."""
  allowed = _allowed(spec)
  stores = ["dialogue", "observation"] if multistore else ["dialogue"]
  per = K // 2 if multistore else K
  ids = [[i for i, (sc, st, _) in about.items() if st == store and (allowed is None or
                                                                     sc in allowed)]
         for store in stores]
  return ids, sum(min(len(x), per) for x in ids), per


def _expected(about, spec, q, multistore):
  """The exact candidates (as a set) of query `q` among the memories of `spec`'s scopes."""
  ids, _, per = _per_store(about, spec, multistore)
  out = set()
  for group in ids:
    scores = np.asarray([float(about[i][2] @ q) for i in group])
    out |= {group[j] for j in np.argsort(-scores, kind="stable")[:per]}
  return out


def _leak_cases():
  """Every first stage with 12 random cases (slow tier); the fast tier runs 2 cases of dense,
  HNSW and IVF (each case compiles its own search)."""
  for stage in FIRST_STAGES:
    name = stage.get("index", stage.get("candidates"))
    yield pytest.param(stage, 12, id=f"{name}-12", marks=pytest.mark.slow)
    if name not in ("bm25", "hybrid", "faiss_pq"):  # (test_memory_first_stage: BM25's scopes)
      yield pytest.param(stage, 2, id=f"{name}-2")


@pytest.mark.parametrize("stage,num_cases", list(_leak_cases()))
def test_scoped_candidates_never_leak_across_scopes(stage, num_cases):
  rng = np.random.default_rng(len(str(stage)))
  k = 2
  for case in range(num_cases):
    multistore = bool(case % 2)
    m, about = _random_memory(rng, multistore, **stage)
    queries = _unit(rng.normal(size=(2, D)))
    texts = _texts(rng, 2)
    for spec in (_spec(rng), _spec(rng), None):
      allowed = _allowed(spec)
      _, avail, _ = _per_store(about, spec, multistore)
      if not avail:
        with pytest.raises(ValueError, match="no memory to retrieve" + (
            "" if spec is None else r" \(k=2\): scope")):
          m.search(texts, k, query_embedding=queries, scope=spec)
        continue
      assert [len(x) for x in m.search(texts, k, query_embedding=queries, scope=spec)] == [
          min(k, avail)] * 2  # (k is a maximum)
      if avail < k:
        continue
      # k = every candidate: a search's slates show the whole candidate set (one batched call)
      hits = m.search(texts, avail, query_embedding=queries, scope=spec)
      s = m.session(texts[0], query_embedding=queries[0], scope=spec)
      shown = s.round(k, explore=bool(case % 3 == 0))
      s.close()
      assert len(shown) == k and set(shown.ids) <= set(hits[0].ids), (case, stage, spec)
      for hit, q in zip(hits, queries):
        cands = set(hit.ids)
        assert len(cands) == avail, (case, stage, spec)
        got = {about[i][0] for i in cands}
        assert allowed is None or got <= allowed, (case, stage, spec, got)
        if not multistore:
          assert set(hit.stores) == {"dialogue"}
        if "index" not in stage and stage.get("candidates") == "dense":
          assert cands == _expected(about, spec, q, multistore)
      if avail < K:  # (k is a maximum)
        more = m.search(texts, avail + 1, query_embedding=queries, scope=spec)
        assert [x.ids for x in more] == [x.ids for x in hits], (case, stage, spec)


SMALL_SCOPE_INDEXES = [
    dict(index="faiss_hnsw", index_options={"ef_search": 16, "hnsw_m": 4}),
    dict(index="faiss_ivf", index_options={"nlist": 16, "nprobe": 1, "train_factor": 4}),
]


@pytest.mark.slow
@pytest.mark.parametrize("stage", SMALL_SCOPE_INDEXES, ids=lambda s: s["index"])
def test_a_small_scope_of_a_large_ann_bank_gets_all_its_memories(stage):
  # Scopes of 5 and 60 among 600 memories: the selector-filtered graph / probed lists reach few
  # of their rows, so the query goes to the exact device search.
  rng = np.random.default_rng(11)
  m = Memory(None, config=_config(), **stage)
  m.add(_texts(rng, 600), embeddings=rng.normal(size=(600, D)), scope="big")
  few = m.add(_texts(rng, 5), embeddings=rng.normal(size=(5, D)), scope="small")
  mid = m.add(_texts(rng, 60), embeddings=rng.normal(size=(60, D)), scope="mid")
  for q in _unit(rng.normal(size=(8, D))):
    s = m.session(query_embedding=q, scope="small")
    r = s.round(3)
    assert len(r) == 3 and set(r.ids) <= set(few)
    assert set(s.round(5, explore=False).ids) == set(few)  # every candidate: the whole scope
    s.close()
    assert set(m.search(query_embedding=q, k=5, scope=["small", "nobody"]).ids) == set(few)
    s = m.session(query_embedding=q, scope="mid")  # (more than FEW_ROWS * K rows)
    r = s.round(K, explore=False)
    assert len(r) == K and set(r.ids) <= set(mid)
    s.close()


def test_recall_never_shows_the_critic_an_empty_slate(monkeypatch):
  from ear_jax.index import ann  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(13)
  m = Memory(None, config=_config(), index="faiss_ivf", index_options={"nlist": 2})
  ss = m.add(_texts(rng, 8), embeddings=rng.normal(size=(8, D)), scope="s")
  shown = []
  critic = lambda key, view: shown.append(view.ids) or np.ones(len(view.ids), np.float32)
  with pytest.raises(ValueError, match="scope 'empty' holds no memories"):
    m.recall("q", critic, k=2, query_embedding=rng.normal(size=D), scope="empty")
  assert not shown
  # A filtered faiss search that finds fewer rows than it may is answered by the exact search.
  monkeypatch.setattr(ann, "FEW_ROWS", 0)
  fewer = lambda self, queries, k, scopes=None: None
  monkeypatch.setattr(ann._StoreIndex, "search", fewer)  # pylint: disable=protected-access
  for learn in (True, False):
    out = m.recall("q", critic, k=2, query_embedding=rng.normal(size=D), scope="s", learn=learn)
    assert len(out) == 2 and set(out.ids) <= set(ss)
  assert shown and all(len(ids) == 2 and set(ids) <= set(ss) for ids in shown)


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
def test_scope_none_gives_the_candidates_of_a_memory_without_scopes():
  rng = np.random.default_rng(3)
  emb = rng.normal(size=(20, D))
  texts = _texts(rng, 20)
  for stage in FIRST_STAGES[:4]:
    plain = Memory(None, config=_config(), **stage)
    plain.add(texts, embeddings=emb)
    scoped = Memory(None, config=_config(), **stage)
    for j, scope in enumerate(("a", "b", None, "c")):
      scoped.add(texts[5 * j:5 * j + 5], embeddings=emb[5 * j:5 * j + 5], scope=scope)
    for q, t in zip(_unit(rng.normal(size=(4, D))), _texts(rng, 4)):
      a = plain.search(t, 4, query_embedding=q)
      b = scoped.search(t, 4, query_embedding=q)
      assert a.ids == b.ids and np.allclose(a.scores, b.scores), stage


def test_a_scope_with_fewer_than_k_memories_gets_them_all_and_never_borrows():
  m = Memory(None, config=_config(), index="faiss_hnsw")
  rng = np.random.default_rng(0)
  m.add(_texts(rng, 20), embeddings=rng.normal(size=(20, D)), scope="big")
  few = m.add(["tiny one", "tiny two"], embeddings=rng.normal(size=(2, D)), scope="small")
  s = m.session(query_embedding=rng.normal(size=D), scope="small")
  assert sorted(s.round(2).ids) == sorted(few) and s.scope == ("small",)
  assert sorted(s.round(3).ids) == sorted(few)  # (k is a maximum)
  assert sorted(m.search(query_embedding=rng.normal(size=D), k=3, scope="small").ids) == sorted(
      few)
  with pytest.raises(ValueError, match=r"\(k=1\): scope 'nobody' holds no memories"):
    m.search(query_embedding=rng.normal(size=D), k=1, scope="nobody")
  # Rows added after a scoped search are found by the next one (the selectors are extended).
  new = m.add(["tiny three"], embeddings=np.ones((1, D)), scope="small")
  assert new[0] in m.search(query_embedding=np.ones(D), k=3, scope=["small"]).ids
  assert new[0] not in m.search(query_embedding=np.ones(D), k=3, scope="big").ids


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
def test_one_adapter_and_one_buffer_learn_across_scopes():
  rng = np.random.default_rng(1)
  m = Memory(None, config=_config(batch_size=1))
  emb = rng.normal(size=(24, D))
  m.add(_texts(rng, 12), embeddings=emb[:12], scope="user-a")
  m.add(_texts(rng, 12), embeddings=emb[12:], scope="user-b")
  q = _unit(emb[14] + 0.3 * rng.normal(size=D))
  before = m.search(query_embedding=q, k=3, scope="user-b")
  params0 = [np.asarray(x) for x in jax.tree_util.tree_leaves(m.learner.params)]
  for j in range(4):  # feedback in scope A only
    s = m.session(query_embedding=emb[j], scope="user-a")
    r = s.round(3, explore=True)
    s.feedback(r.ids[:1])
    r2 = s.round(3, explore=True)  # (the session keeps its candidates)
    assert {x["scope"] for x in m.get(sorted(set(r.ids + r2.ids)))} == {"user-a"}
    s.feedback(r2.ids[:1])
    assert s.closed  # T rounds: queued, and trained (batch size 1)
  learner = m.learner
  assert m.stats["learner_steps"] == 4 and int(learner.buffer.valid.sum()) > 0
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree_util.tree_leaves(learner.params),
                                                   params0))
  after = m.search(query_embedding=q, k=3, scope="user-b")  # scope B uses the trained adapter
  assert not np.allclose(before.scores, after.scores)
  assert {m.get([i])[0]["scope"] for i in after.ids} == {"user-b"}


def test_recall_with_a_scope():
  rng = np.random.default_rng(2)
  m = Memory(None, config=_config(batch_size=1))
  m.add(_texts(rng, 10), embeddings=rng.normal(size=(10, D)), scope="x")
  ys = m.add(_texts(rng, 10), embeddings=rng.normal(size=(10, D)), scope="y")
  out = m.recall("what?", lambda key, view: np.ones(len(view.ids), np.float32), k=2,
                 query_embedding=rng.normal(size=D), scope="y")
  assert set(out.ids) <= set(ys) and all(set(r.ids) <= set(ys) for r in out.rounds)


# ------------------------------------------------------------------------------------------------
# add, get, list: scopes and dates


def test_add_records_scope_and_date_and_list_filters():
  m = Memory(None, config=_config())
  rng = np.random.default_rng(4)
  a = m.add(["first a", "second a"], embeddings=rng.normal(size=(2, D)), scope="a",
            dates=["1:56 pm on 8 May, 2023", "2023-05-09"])
  d = m.add(["a default one"], embeddings=rng.normal(size=(1, D)), store="observation")
  b = m.add(["b one"], embeddings=rng.normal(size=(1, D)), scope="b")
  assert m.get(a) == [
      {"id": a[0], "text": "first a", "store": "dialogue", "scope": "a",
       "date": "1:56 pm on 8 May, 2023", "row": 0},
      {"id": a[1], "text": "second a", "store": "dialogue", "scope": "a", "date": "2023-05-09",
       "row": 1}]
  rec = m.get(d)[0]
  assert rec["scope"] == DEFAULT_SCOPE and rec["store"] == "observation" and rec["row"] == 2
  assert rec["date"].endswith("+00:00") and rec["date"][:2] == "20"  # ISO 8601, UTC
  assert [r["id"] for r in m.list()] == a + d + b
  assert [r["id"] for r in m.list("a")] == a
  assert [r["id"] for r in m.list(["b", "default"])] == d + b
  assert m.list("nobody") == []
  m.delete(a[0])
  assert [r["id"] for r in m.list("a")] == a[1:]
  assert m.get(b)[0]["row"] == 3  # (row numbers are never reused)


@pytest.mark.parametrize("kw,err,match", [
    (dict(scope=""), ValueError, "scope is an empty string"),
    (dict(scope=3), TypeError, "scope must be a string"),
    (dict(scope=["a"]), TypeError, "scope must be a string"),
    (dict(dates=["x"]), ValueError, "dates has 1 entries for 2 texts"),
    (dict(dates="2023"), TypeError, "dates must be a sequence"),
    (dict(dates=["x", 5]), TypeError, r"dates\[1\] must be a string"),
])
def test_bad_scopes_and_dates_are_refused_and_nothing_is_added(kw, err, match):
  m = Memory(None, config=_config())
  with pytest.raises(err, match=match):
    m.add(["one", "two"], embeddings=np.ones((2, D)), **kw)
  assert len(m) == 0 and m.list() == []


@pytest.mark.parametrize("bad", ["a\x00b", "a\nb", "a\x7f", "\x85"])
def test_a_scope_name_with_a_control_character_is_refused_everywhere_and_never_leaks(bad):
  """SQLite's `json_each` cuts a string at U+0000: 'a\\x00b' would list scope 'a'."""
  m = Memory(None, config=_config())
  m.add(["one", "two", "three"], embeddings=np.eye(3, D) + 0.1, scope="a")
  char = next(c for c in bad if c not in "ab")
  problem = f"U\\+{ord(char):04X}.*scope names may not contain control characters"
  calls = [lambda: m.list(scope=bad), lambda: m.list(scope=["a", bad]),
           lambda: m.add(["four"], embeddings=np.ones((1, D)), scope=bad),
           lambda: m.search(query_embedding=np.ones(D), k=1, scope=bad),
           lambda: m.session(query_embedding=np.ones(D), scope=[bad])]
  for call in calls:
    with pytest.raises(ValueError, match=problem):
      call()
  assert len(m) == 3 and m.stats["sessions_opened"] == 0


def test_bad_scope_specs_of_queries_are_refused():
  m = Memory(None, config=_config())
  m.add(["one", "two", "three"], embeddings=np.eye(3, D) + 0.1, scope="a")
  for query in (lambda scope: m.search(query_embedding=np.ones(D), k=1, scope=scope),
                lambda scope: m.session(query_embedding=np.ones(D), scope=scope)):
    with pytest.raises(ValueError, match="scope is an empty list"):
      query([])
    with pytest.raises(TypeError, match=r"scope\[1\] must be a string"):
      query(["a", 2])
    with pytest.raises(TypeError, match="scope must be None, a scope name or a list"):
      query({"a"})
  with pytest.raises(TypeError, match="scope must be None"):
    m.list(scope=7)


# ------------------------------------------------------------------------------------------------
# update


@pytest.mark.slow
def test_update_replaces_text_and_vector_everywhere(tmp_path):
  rng = np.random.default_rng(5)
  m = Memory(_HashEncoder(), config=_config(batch_size=1), candidates="hybrid")
  ids = m.add([f"common words number{i}" for i in range(10)], scope="u",
              dates=[f"day {i}" for i in range(10)], embeddings=rng.normal(size=(10, D)))
  m.add(["zebra crossing elsewhere"], scope="v")  # (encoded)
  path = tmp_path / "mem"
  victim = ids[3]
  old_text = m.get([victim])[0]["text"]
  s = m.session("common words", scope="u")  # learn a little: the buffer holds the victim
  s.feedback(s.round(3, explore=True).ids[:1])
  s.feedback([victim] if victim in s.round(6, explore=True).ids else [])
  open_s = m.session("number3", scope="u")  # an open session holding the victim
  assert victim in open_s.round(6).ids
  m.save(path)
  old_vec = stored_embeddings(path, [victim])[0].tobytes()
  assert _files_holding(path, old_text.encode()) and _files_holding(path, old_vec)
  assert m.update(victim, text="purple elephant memo") == victim
  rec = m.get([victim])[0]
  assert {k: v for k, v in rec.items() if k != "row"} == {
      "id": victim, "text": "purple elephant memo", "store": "dialogue", "scope": "u",
      "date": "day 3"}
  assert rec["row"] == 11  # (a new row: the old one is never reused)
  assert len(m) == 11 and sorted(r["id"] for r in m.list()) == sorted(ids + ["m10"])
  with pytest.raises(SessionDroppedError, match=rf"memory '{victim}' .*updated"):
    open_s.feedback([])
  hit = m.search("purple elephant memo", 3, scope="u")
  assert victim in hit.ids and "purple elephant memo" in hit.texts
  for q in ("common number3", "number3"):
    assert old_text not in m.search(q, 6, scope="u").texts
  assert old_text not in [x["text"] for x in m.list()]
  # durable and scrubbed when it returns: no file holds the old text or vector
  assert _files_holding(path, old_text.encode()) == [] and _files_holding(path, old_vec) == []
  m.save()
  assert _files_holding(path, old_text.encode()) == [] and _files_holding(path, old_vec) == []
  records = m.list()
  # An embedding only: the text is kept.
  new_vec = _unit(rng.normal(size=D))
  m.update(victim, embedding=new_vec)
  assert m.get([victim])[0]["text"] == "purple elephant memo"
  np.testing.assert_allclose(stored_embeddings(path, [victim])[0], new_vec, atol=1e-6)
  assert m.get([victim])[0]["scope"] == "u" and m.stats["memories_updated"] == 2
  assert m.search("purple elephant memo", 1, query_embedding=new_vec, scope="u").ids == (victim,)
  m.close()
  with Memory.open(path, encoder=_HashEncoder()) as back:
    assert [{k: v for k, v in r.items() if k != "row"} for r in back.list()] == [
        {k: v for k, v in r.items() if k != "row"} for r in records]
    assert back.get([victim])[0]["text"] == "purple elephant memo"


def test_update_of_an_unknown_id_or_of_nothing_is_refused():
  m = Memory(None, config=_config())
  ids = m.add(["one", "two", "three"], embeddings=np.eye(3, D) + 0.1)

  def seen():
    r = m.search(query_embedding=np.ones(D), k=len(m))
    return m.list(), r.ids, r.scores

  before = seen()
  with pytest.raises(ValueError, match=r"unknown memory id\(s\) 'nope'"):
    m.update("nope", text="x", embedding=np.ones(D))
  with pytest.raises(ValueError, match=f"update of memory '{ids[0]}' changes nothing"):
    m.update(ids[0])
  with pytest.raises(ValueError, match="no encoder"):
    m.update(ids[0], text="new text")  # no encoder: the embedding must be given
  with pytest.raises(ValueError, match="wrong dimension"):
    m.update(ids[0], embedding=np.ones(D + 1))
  with pytest.raises(ValueError, match="empty text"):
    m.update(ids[0], text="  ", embedding=np.ones(D))
  with pytest.raises(TypeError, match="memory_id must be a string"):
    m.update([ids[0]], text="x", embedding=np.ones(D))
  assert seen() == before
  m.delete(ids[1])
  with pytest.raises(ValueError, match="unknown memory id"):
    m.update(ids[1], text="x", embedding=np.ones(D))
  assert m.list() == [before[0][0], before[0][2]]


def test_update_keeps_store_scope_and_date_with_ann():
  rng = np.random.default_rng(6)
  m = Memory(None, config=_config(), index="faiss_hnsw", multistore=True)
  ids = m.add(_texts(rng, 8), embeddings=rng.normal(size=(8, D)), scope="s",
              store="observation", dates=["d"] * 8)
  m.add(_texts(rng, 8), embeddings=rng.normal(size=(8, D)), scope="t")
  v = _unit(rng.normal(size=D))
  m.update(ids[2], embedding=v)
  assert m.get([ids[2]])[0] == {**m.get([ids[2]])[0], "store": "observation", "scope": "s",
                                "date": "d"}
  r = m.search(query_embedding=v, k=2, scope="s")
  assert r.ids[0] == ids[2] and set(r.ids) <= set(ids)


# ------------------------------------------------------------------------------------------------
# memory directories


def test_open_keeps_scopes_and_dates(tmp_path):
  rng = np.random.default_rng(7)
  m = Memory(None, config=_config(), index="faiss_ivf",
             index_options={"nlist": 2, "nprobe": 2, "train_factor": 4})
  m.add(_texts(rng, 6), embeddings=rng.normal(size=(6, D)), scope="p", dates=list("abcdef"))
  m.save(tmp_path / "c")
  m.add(_texts(rng, 5), embeddings=rng.normal(size=(5, D)), scope="q")
  m.add(_texts(rng, 3), embeddings=rng.normal(size=(3, D)), scope="p")  # (after the save)
  q = _unit(rng.normal(size=D))
  specs = ("p", "q", ["p", "q"], None)
  want = [m.search(query_embedding=q, k=3, scope=spec).ids for spec in specs]
  records, by_scope = m.list(), m.list("q")
  m.close()
  with Memory.open(tmp_path / "c") as back:
    assert back.list() == records and back.list("q") == by_scope
    assert [back.search(query_embedding=q, k=3, scope=spec).ids for spec in specs] == want
    back.add(["late"], embeddings=np.ones((1, D)), scope="r", dates=["tomorrow"])
  with Memory.open(tmp_path / "c") as again:
    assert again.list("r") == [{"id": "m14", "text": "late", "store": "dialogue", "scope": "r",
                                "date": "tomorrow", "row": 14}]


@pytest.mark.parametrize("column, value", [("scope", "y"), ("date", "d3")])
def test_a_row_whose_scope_or_date_was_changed_on_disk_is_refused(tmp_path, column, value):
  m = Memory.open(tmp_path / "c", MemoryConfig(encoder=None, config=_config()))
  m.add(["x one", "x two"], embeddings=np.eye(2, D) + 0.1, scope="x", dates=["d1", "d2"])
  m.close()
  with sqlite3.connect(tmp_path / "c" / "rows.sqlite") as db:  # (an edit outside ear_jax)
    db.execute(f"UPDATE memories SET {column} = ? WHERE id = 'm1'", (value,))
  with pytest.raises(CheckpointError, match=r"rows\.sqlite.*'m1'"):
    Memory.open(tmp_path / "c")


def test_a_trained_pq_index_leaves_scoped_queries_to_the_exact_search():
  rng = np.random.default_rng(9)
  m = Memory(None, config=_config(), index="faiss_pq",
             index_options={"pq_m": 4, "rerank": 2, "train_size": 16})
  m.add(_texts(rng, 20), embeddings=rng.normal(size=(20, D)), scope="a")
  emb_b = rng.normal(size=(20, D))
  bs = m.add(_texts(rng, 20), embeddings=emb_b, scope="b")  # (trained at 16 vectors)
  exact = Memory(None, config=_config())
  exact.add(_texts(rng, 20), embeddings=emb_b, ids=bs)
  for q in _unit(rng.normal(size=(5, D))):
    assert m.search(query_embedding=q, k=4, scope="b").ids == exact.search(
        query_embedding=q, k=4).ids


def test_k_errors_name_the_scope_and_its_dialogue_memories():
  m = Memory(None, config=_config())
  m.add(["obs one", "obs two"], embeddings=np.eye(2, D) + 0.1, store="observation", scope="o")
  m.add(["dia one"], embeddings=np.ones((1, D)), scope="d")
  with pytest.raises(ValueError, match=r"^no memory to retrieve \(k=4\): scope 'o' holds no "
                                       r"dialogue memories \(observations"):
    m.search(query_embedding=np.ones(D), k=4, scope="o")
  # (k is a maximum: the one dialogue memory of the two scopes)
  assert m.search(query_embedding=np.ones(D), k=2, scope=["d", "o"]).ids == ("m2",)
  assert m.search(query_embedding=np.ones(D), k=1, scope=["d", "o"]).ids == ("m2",)
