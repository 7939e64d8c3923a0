"""Scopes, dates, `update` and `list` of `Memory` (issue items 3 and 4): a scoped query's candidates
come only from its scopes (exact, ANN, BM25 / hybrid; single store or multistore), one adapter
learns across scopes, and scopes and dates survive a checkpoint (old ones without them load)."""
import hashlib

import jax
import numpy as np
import pytest

from ear_jax import EARConfig
from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import front
from ear_jax.agent.memory import Memory
from ear_jax.data import encoders
from tests.test_forget import _files_holding

D = 8
K = 6
SCOPES = ("a", "b", "c", None)  # None: the default scope


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
  """A memory of 8..28 random memories in batches of random scopes, and the scope of each id."""
  m = Memory(None, config=_config(), multistore=multistore, **kw)
  scope_of = {}
  for _ in range(rng.integers(2, 5)):
    n = int(rng.integers(2, 8))
    scope = SCOPES[rng.integers(len(SCOPES))]
    store = [["dialogue", "observation"][j] for j in rng.integers(0, 2, n)]
    ids = m.add(_texts(rng, n), embeddings=rng.normal(size=(n, D)), store=store, scope=scope)
    scope_of.update({i: scope or front.DEFAULT_SCOPE for i in ids})
  return m, scope_of


def _spec(rng):
  """A random scope spec: None, one name, or a list of names (maybe unknown ones)."""
  kind = rng.integers(3)
  if kind == 0:
    return None
  names = ["a", "b", "c", "default", "unknown"]
  if kind == 1:
    return str(names[rng.integers(len(names))])
  return [str(x) for x in rng.choice(names, int(rng.integers(1, 4)), replace=False)]


def _expected(m, scope_of, spec, q, multistore):
  """The exact candidates (as a set) of query `q` among the memories of `spec`'s scopes."""
  allowed = None if spec is None else ({spec} if isinstance(spec, str) else set(spec))
  recs = [r for r in m.list() if allowed is None or scope_of[r["id"]] in allowed]
  emb = {i: e for i, e in zip(m.ids, m.embeddings())}
  out = set()
  for store, per in ((["dialogue"], K),) if not multistore else (
      (["dialogue"], K // 2), (["observation"], K // 2)):
    rs = [r for r in recs if r["store"] in store]
    scores = [float(emb[r["id"]] @ q) for r in rs]
    out |= {rs[j]["id"] for j in np.argsort(-np.asarray(scores), kind="stable")[:per]}
  return out


def _leak_cases():
  """Every first stage with 30 random cases (slow tier); the fast tier runs 5 cases of dense,
  hybrid (which covers BM25's masking), HNSW and IVF."""
  for stage in FIRST_STAGES:
    name = stage.get("index", stage.get("candidates"))
    yield pytest.param(stage, 30, id=f"{name}-30", marks=pytest.mark.slow)
    if name not in ("bm25", "faiss_pq"):
      yield pytest.param(stage, 5, id=f"{name}-5")


@pytest.mark.parametrize("stage,num_cases", list(_leak_cases()))
def test_scoped_candidates_never_leak_across_scopes(stage, num_cases):
  rng = np.random.default_rng(len(str(stage)))
  k = 2
  for case in range(num_cases):
    multistore = bool(case % 2)
    m, scope_of = _random_memory(rng, multistore, **stage)
    queries = _unit(rng.normal(size=(2, D)))
    texts = _texts(rng, 2)
    for spec in (_spec(rng), _spec(rng), None):
      allowed = None if spec is None else ({spec} if isinstance(spec, str) else set(spec))
      avail = m._bank.available(K, multistore, bank_lib.check_scope_spec(spec))  # pylint: disable=protected-access
      if avail < k:
        with pytest.raises(ValueError, match="larger than the memory bank" + (
            "" if spec is None else " of scope")):
          m.retrieve_batch(texts, k, query_embeddings=queries, scope=spec)
        continue
      rs = m.retrieve_batch(texts, k, explore=bool(case % 3 == 0), query_embeddings=queries,
                            scope=spec)
      for r, q in zip(rs, queries):
        s = m._sessions.by_id[r.session_id]  # pylint: disable=protected-access
        cands = m._bank.describe(s.cand_idx[s.cand_mask])[0]  # pylint: disable=protected-access
        got = {scope_of[i] for i in cands} | {scope_of[i] for i in r.ids}
        assert allowed is None or got <= allowed, (case, stage, spec, got)
        assert int(s.cand_mask.sum()) <= avail
        if not multistore:
          assert set(r.stores) == {"dialogue"}
        assert int(s.cand_mask.sum()) == avail and len(r) == k, (case, stage, spec)
        if "index" not in stage and stage.get("candidates") == "dense":
          assert set(cands) == _expected(m, scope_of, spec, q, multistore)
        m.discard(r)


SMALL_SCOPE_INDEXES = [
    dict(index="faiss_hnsw", index_options={"ef_search": 16, "hnsw_m": 4}),
    dict(index="faiss_ivf", index_options={"nlist": 16, "nprobe": 1, "train_factor": 4}),
]


@pytest.mark.slow
@pytest.mark.parametrize("stage", SMALL_SCOPE_INDEXES, ids=lambda s: s["index"])
def test_a_small_scope_of_a_large_ann_bank_gets_all_its_memories(stage):
  # Scopes of 5 and 60 among 600 memories: the selector-filtered graph / probed lists reach few
  # of their rows, so the query goes to the exact device search (issue 31 item 2).
  rng = np.random.default_rng(11)
  m = Memory(None, config=_config(), **stage)
  m.add(_texts(rng, 600), embeddings=rng.normal(size=(600, D)), scope="big")
  few = m.add(_texts(rng, 5), embeddings=rng.normal(size=(5, D)), scope="small")
  mid = m.add(_texts(rng, 60), embeddings=rng.normal(size=(60, D)), scope="mid")
  for q in _unit(rng.normal(size=(8, D))):
    r = m.retrieve(query_embedding=q, k=3, scope="small")
    s = m._sessions.by_id[r.session_id]  # pylint: disable=protected-access
    assert len(r) == 3 and set(r.ids) <= set(few)
    assert set(m._bank.describe(s.cand_idx[s.cand_mask])[0]) == set(few)  # pylint: disable=protected-access
    m.discard(r)
    assert len(m.search(query_embedding=q, k=5, scope=["small", "nobody"])) == 5
    r = m.retrieve(query_embedding=q, k=K, scope="mid")  # (more than FEW_ROWS * K rows)
    assert len(r) == K and set(r.ids) <= set(mid)
    m.discard(r)


def test_recall_never_shows_the_critic_an_empty_slate(monkeypatch):
  from ear_jax.index import ann  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(13)
  m = Memory(None, config=_config(), index="faiss_ivf", index_options={"nlist": 2})
  m.add(_texts(rng, 8), embeddings=rng.normal(size=(8, D)), scope="s")
  shown = []
  critic = lambda key, view: shown.append(view.ids) or np.ones(len(view.ids), np.float32)
  with pytest.raises(ValueError, match="scope 'empty' holds no memories"):
    m.recall("q", critic, k=2, query_embedding=rng.normal(size=D), scope="empty")
  nothing = lambda self, q, k, multistore, scopes=None: (np.full((len(q), k), -1, np.int32),
                                                          np.zeros((len(q), k), bool))
  monkeypatch.setattr(ann.FaissSearcher, "search", nothing)  # a searcher that finds nothing
  for learn in (True, False):
    with pytest.raises(RuntimeError, match=r"found only 0 of k=2 memories of scope 's'"):
      m.recall("q", critic, k=2, query_embedding=rng.normal(size=D), scope="s", learn=learn)
  assert not shown


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


def test_a_scope_with_fewer_than_k_memories_pads_and_never_borrows():
  m = Memory(None, config=_config(), index="faiss_hnsw")
  rng = np.random.default_rng(0)
  m.add(_texts(rng, 20), embeddings=rng.normal(size=(20, D)), scope="big")
  few = m.add(["tiny one", "tiny two"], embeddings=rng.normal(size=(2, D)), scope="small")
  r = m.retrieve(query_embedding=rng.normal(size=D), k=2, scope="small")
  s = m._sessions.by_id[r.session_id]  # pylint: disable=protected-access
  assert sorted(r.ids) == sorted(few) and int(s.cand_mask.sum()) == 2
  assert (s.cand_idx[~s.cand_mask] == -1).all()
  with pytest.raises(ValueError, match=r"k=3 is larger than the memory bank of scope 'small': "
                                       r"only 2 memories"):
    m.retrieve(query_embedding=rng.normal(size=D), k=3, scope="small")
  with pytest.raises(ValueError, match="scope 'nobody' holds no memories"):
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
  params0 = m.params
  for j in range(4):  # feedback in scope A only
    r = m.retrieve(query_embedding=emb[j], k=3, explore=True, scope="user-a")
    m.feedback(r, r.ids[:1])
    r2 = m.retrieve(continue_from=r, k=3, explore=True)  # (the session keeps its candidates)
    assert {x["scope"] for x in m.get(sorted(set(r.ids + r2.ids)))} == {"user-a"}
    m.feedback(r2, r2.ids[:1])
  m.flush()
  assert m.stats["learner_steps"] > 0 and int(m.state.buffer.valid.sum()) > 0
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree_util.tree_leaves(m.params),
                                                   jax.tree_util.tree_leaves(params0)))
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
       "date": "1:56 pm on 8 May, 2023"},
      {"id": a[1], "text": "second a", "store": "dialogue", "scope": "a", "date": "2023-05-09"}]
  rec = m.get(d)[0]
  assert rec["scope"] == front.DEFAULT_SCOPE == "default" and rec["store"] == "observation"
  assert rec["date"].endswith("+00:00") and rec["date"][:2] == "20"  # ISO 8601, UTC
  assert [r["id"] for r in m.list()] == a + d + b
  assert [r["id"] for r in m.list("a")] == a
  assert [r["id"] for r in m.list(["b", "default"])] == d + b
  assert m.list("nobody") == []
  m.delete(a[0])
  assert [r["id"] for r in m.list("a")] == a[1:]


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
  assert len(m) == 0


def test_bad_scope_specs_of_queries_are_refused():
  m = Memory(None, config=_config())
  m.add(["one", "two", "three"], embeddings=np.eye(3, D) + 0.1, scope="a")
  with pytest.raises(ValueError, match="scope is an empty list"):
    m.search(query_embedding=np.ones(D), k=1, scope=[])
  with pytest.raises(TypeError, match=r"scope\[1\] must be a string"):
    m.search(query_embedding=np.ones(D), k=1, scope=["a", 2])
  with pytest.raises(TypeError, match="scope must be None, a scope name or a list"):
    m.search(query_embedding=np.ones(D), k=1, scope={"a"})
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
  path = tmp_path / "ckpt"
  victim = ids[3]
  old_text = m.get([victim])[0]["text"]
  old_vec = m.embeddings()[3].astype(np.float32).tobytes()
  r = m.retrieve("common words", k=3, explore=True, scope="u")  # learn a little, keep it in buffer
  m.feedback(r, r.ids[:1])
  m.feedback(m.retrieve(continue_from=r, k=3, explore=True), [])
  open_r = m.retrieve("number3", k=6, scope="u")  # an open session holding the victim
  assert victim in open_r.ids
  m.save(path)
  assert _files_holding(path, old_text.encode()) and _files_holding(path, old_vec)
  assert m.update(victim, text="purple elephant memo") == victim
  rec = m.get([victim])[0]
  assert rec == {"id": victim, "text": "purple elephant memo", "store": "dialogue", "scope": "u",
                 "date": "day 3"}
  assert len(m) == 11 and sorted(m.ids) == sorted(ids + ["m10"])
  with pytest.raises(ValueError, match="no longer open: its session was dropped because "
                                       ".*(deleted|updated)"):
    m.feedback(open_r, [])
  hit = m.search("purple elephant memo", 3, scope="u")
  assert victim in hit.ids and "purple elephant memo" in hit.texts
  for q in ("common number3", "number3"):  # (not the old text or vector: queries are saved)
    assert old_text not in m.search(q, 6, scope="u").texts
  assert old_text not in [x["text"] for x in m.list()]
  m.save(path)
  assert _files_holding(path, old_text.encode()) == [] and _files_holding(path, old_vec) == []
  back = Memory.load(path, encoder=_HashEncoder())
  assert back.list() == m.list() and back.get([victim])[0]["text"] == "purple elephant memo"
  # An embedding only: the text is kept.
  new_vec = _unit(rng.normal(size=D))
  m.update(victim, embedding=new_vec)
  assert m.get([victim])[0]["text"] == "purple elephant memo"
  np.testing.assert_allclose(m.embeddings()[-1], new_vec, atol=1e-6)
  assert m.get([victim])[0]["scope"] == "u" and m.stats["memories_updated"] == 2


def test_update_of_an_unknown_id_or_of_nothing_is_refused():
  m = Memory(None, config=_config())
  ids = m.add(["one", "two"], embeddings=np.eye(2, D) + 0.1)
  before = (m.list(), m.embeddings().copy())
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
  m.delete(ids[1])
  with pytest.raises(ValueError, match="unknown memory id"):
    m.update(ids[1], text="x", embedding=np.ones(D))
  assert m.list() == before[0][:1]
  np.testing.assert_array_equal(m.embeddings()[0], before[1][0])


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
# checkpoints


def test_save_load_keeps_scopes_and_dates(tmp_path):
  rng = np.random.default_rng(7)
  m = Memory(None, config=_config(), index="faiss_ivf",
             index_options={"nlist": 2, "nprobe": 2, "train_factor": 4})
  m.add(_texts(rng, 6), embeddings=rng.normal(size=(6, D)), scope="p", dates=list("abcdef"))
  m.save(tmp_path / "c")
  m.add(_texts(rng, 5), embeddings=rng.normal(size=(5, D)), scope="q")
  m.add(_texts(rng, 3), embeddings=rng.normal(size=(3, D)), scope="p")
  m.save(tmp_path / "c")
  back = Memory.load(tmp_path / "c")
  assert back.list() == m.list() and back.list("q") == m.list("q")
  assert back._bank.scope_names == m._bank.scope_names  # pylint: disable=protected-access
  q = _unit(rng.normal(size=D))
  for spec in ("p", "q", ["p", "q"], None):
    assert back.search(query_embedding=q, k=3, scope=spec).ids == m.search(
        query_embedding=q, k=3, scope=spec).ids
  back.add(["late"], embeddings=np.ones((1, D)), scope="r", dates=["tomorrow"])
  back.save(tmp_path / "c")
  again = Memory.load(tmp_path / "c")
  assert again.list("r") == [{"id": "m14", "text": "late", "store": "dialogue", "scope": "r",
                              "date": "tomorrow"}]


def test_the_shard_digest_covers_scopes_and_dates():
  m = Memory(None, config=_config())
  m.add(["x one", "x two"], embeddings=np.eye(2, D) + 0.1, scope="x", dates=["d1", "d2"])
  arrays, meta = m._bank.rows(0, 2)  # pylint: disable=protected-access
  assert meta["scope_names"] == ["x"] and arrays["scopes"].tolist() == [0, 0]
  digest = bank_lib.shard_digest(arrays, meta)
  assert digest == m._bank.digest(0, 2)  # pylint: disable=protected-access
  for changed in ({**meta, "scope_names": ["y"]}, {**meta, "dates": ["d1", "d3"]}):
    assert bank_lib.shard_digest(arrays, changed) != digest
  legacy = bank_lib.rows_digest(meta["ids"], meta["texts"], arrays["stores"],
                                arrays["embeddings"])
  assert legacy != digest


def test_a_trained_pq_index_leaves_scoped_queries_to_the_exact_search():
  rng = np.random.default_rng(9)
  m = Memory(None, config=_config(), index="faiss_pq",
             index_options={"pq_m": 4, "rerank": 2, "train_size": 16})
  m.add(_texts(rng, 20), embeddings=rng.normal(size=(20, D)), scope="a")
  bs = m.add(_texts(rng, 20), embeddings=rng.normal(size=(20, D)), scope="b")
  assert not m._bank.searcher._stores[0].can_filter()  # pylint: disable=protected-access
  exact = Memory(None, config=_config())
  exact.add(_texts(rng, 20), embeddings=m.embeddings()[20:], ids=bs)
  for q in _unit(rng.normal(size=(5, D))):
    assert m.search(query_embedding=q, k=4, scope="b").ids == exact.search(
        query_embedding=q, k=4).ids


def test_a_checkpoint_written_before_scopes_loads_in_the_default_scope(tmp_path, monkeypatch):
  rng = np.random.default_rng(8)
  m = Memory(None, config=_config(), multistore=True)
  m.add(_texts(rng, 9), embeddings=rng.normal(size=(9, D)), store=["dialogue", "observation"] * 4
        + ["dialogue"])

  def old_rows(self, start, stop):  # what `Bank.rows` wrote before scopes and dates
    arrays = {"embeddings": self.embeddings(start, stop),
              "stores": self.store_codes[start:stop].copy()}
    return arrays, {"ids": self.ids[start:stop], "texts": self.texts[start:stop]}

  with monkeypatch.context() as p:
    p.setattr(bank_lib.Bank, "rows", old_rows)
    m.save(tmp_path / "old")
  back = Memory.load(tmp_path / "old")
  assert [r["id"] for r in back.list()] == m.ids
  assert {(r["scope"], r["date"]) for r in back.list()} == {("default", "")}
  assert back.list("default") == back.list()
  q = _unit(rng.normal(size=D))
  assert back.search(query_embedding=q, k=4, scope="default").ids == m.search(
      query_embedding=q, k=4).ids
  back.add(["new scoped"], embeddings=np.ones((1, D)), scope="n")
  back.save(tmp_path / "old")  # the old shard is reused, the new row gets a new-format shard
  again = Memory.load(tmp_path / "old")
  assert again.list() == back.list() and again.list("n")[0]["text"] == "new scoped"


def test_k_errors_name_the_scope_and_its_dialogue_memories():
  m = Memory(None, config=_config())
  m.add(["obs one", "obs two"], embeddings=np.eye(2, D) + 0.1, store="observation", scope="o")
  m.add(["dia one"], embeddings=np.ones((1, D)), scope="d")
  with pytest.raises(ValueError, match=r"k=1 is larger than the memory bank of scope 'o': scope "
                                       r"'o' holds no dialogue memories \(observations"):
    m.search(query_embedding=np.ones(D), k=1, scope="o")
  with pytest.raises(ValueError, match=r"of scopes \['d', 'o'\]: only 1 memories can be retrieved "
                                       r"\(3 in scopes \['d', 'o'\]\)"):
    m.search(query_embedding=np.ones(D), k=2, scope=["d", "o"])
  assert m.search(query_embedding=np.ones(D), k=1, scope=["d", "o"]).ids == ("m2",)


@pytest.mark.slow
def test_searcher_selectors_follow_adds_across_ivf_training(monkeypatch):
  from ear_jax.index import ann  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(10)
  vecs = _unit(rng.normal(size=(40, D)))
  scopes = np.asarray(rng.integers(0, 3, 40), np.int32)  # the bank's host scope codes
  s = ann.faiss_ivf(D, nlist=2, nprobe=2, train_factor=8)  # trained at 16 vectors
  monkeypatch.setattr(ann, "FEW_ROWS", 0)  # (the selectors themselves, not the exact fallback)
  q = _unit(rng.normal(size=(3, D)))
  for stop in (10, 25, 40):  # untrained (flat), then trained: the cached bitmaps are extended
    s.add(vecs[stop - 15 if stop > 10 else 0:stop], np.zeros(15 if stop > 10 else 10, np.int8),
          stop - 15 if stop > 10 else 0)
    for codes in ((1,), (0, 2)):
      rows, mask = s.search(q, 4, False, scopes=(codes, scopes))
      ok = np.flatnonzero(np.isin(scopes[:stop], codes))
      want = ok[np.argsort(-(vecs[ok] @ q.T), axis=0, kind="stable")[:4]].T  # every list probed
      for i in range(len(q)):
        assert sorted(rows[i][mask[i]]) == sorted(want[i]) and mask[i].sum() == min(4, len(ok))
  assert s._stores[0].index is not None  # pylint: disable=protected-access  (trained)
  assert len(s._stores[0]._selectors) == 2  # pylint: disable=protected-access
