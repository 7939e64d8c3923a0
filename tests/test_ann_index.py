"""ANN candidate search (faiss) against the exact device search, its saved state, and
`Memory(index=...)`."""
import jax
import numpy as np
import pytest

from ear_jax import EARConfig
from ear_jax.agent.memory import Memory
from ear_jax.agent.memory import bank as bank_lib
from ear_jax.core import retrieval
from ear_jax.index import ann

jit_top_k_search = jax.jit(retrieval.top_k_search, static_argnames=("k", "chunk"))

D = 16


def _clustered(n, seed=0, centers=20):
  """Unit vectors around a few centres (the structure real embeddings have)."""
  rng = np.random.default_rng(seed)
  c = rng.normal(size=(centers, D))
  x = c[rng.integers(0, centers, n)] + 0.35 * rng.normal(size=(n, D))
  return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _exact(q, bank, k):
  idx, _, _ = jit_top_k_search(q, bank, np.ones(len(bank), bool), k=k)
  return np.asarray(idx)


def _recall(a, b):
  return float(np.mean([len(set(x) & set(y)) / len(y) for x, y in zip(a, b)]))


def test_ivf_probing_every_list_is_exact_and_fewer_lists_keep_high_recall():
  bank, q = _clustered(3000), _clustered(50, seed=1)
  exact = _exact(q, bank, 20)
  full = ann.faiss_ivf(D, nlist=16, nprobe=16, train_factor=39)
  full.add(np.arange(3000), bank, np.zeros(3000, np.int8))
  rows, mask = full.search(q, 20, multistore=False)
  assert mask.all()
  assert _recall(rows, exact) == 1.0  # every list probed: the exact candidates (as a set)
  some = ann.faiss_ivf(D, nlist=16, nprobe=8)
  some.add(np.arange(1000), bank[:1000], np.zeros(1000, np.int8))  # trained at 624 held vectors
  some.add(np.arange(1000, 3000), bank[1000:], np.zeros(2000, np.int8))
  assert _recall(some.search(q, 20, False)[0], exact) >= 0.95


def test_hnsw_recall_at_20_against_exact_on_a_small_bank():
  bank, q = _clustered(2000, seed=2), _clustered(50, seed=3)
  hnsw = ann.faiss_hnsw(D, hnsw_m=16, ef_construction=64, ef_search=128)
  hnsw.add(np.arange(2000), bank, np.zeros(2000, np.int8))
  assert _recall(hnsw.search(q, 20, False)[0], _exact(q, bank, 20)) >= 0.98


def test_searchers_keep_the_store_rules_and_row_numbers():
  bank = _clustered(400, seed=4)
  codes = (np.arange(400) % 3 == 0).astype(np.int8)  # every third row an observation
  s = ann.faiss_hnsw(D, ef_search=400)
  s.add(np.arange(150), bank[:150], codes[:150])
  s.add(np.arange(150, 400), bank[150:], codes[150:])
  rows, _ = s.search(bank[:5], 10, multistore=False)
  assert (codes[rows] == 0).all()
  exact = _exact(bank[:5], np.where(codes[:, None] == 0, bank, -bank * 0), 10)
  assert _recall(rows, exact) >= 0.98
  rows, mask = s.search(bank[:5], 10, multistore=True)
  assert mask.all() and all(sorted(codes[r].tolist()) == [0] * 5 + [1] * 5 for r in rows)


def _random(n, seed):
  """Unit vectors without any structure (the worst case for IVF and HNSW)."""
  x = np.random.default_rng(seed).normal(size=(n, 32))
  return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _device_bank(emb, stores, index, options):
  """`(DeviceBank, searcher)` holding rows `0..n` (scope code 0)."""
  n, d = emb.shape
  zeros = np.zeros(n, np.int32)
  searcher = bank_lib.ann_searcher(index, options, d)
  searcher.add(np.arange(n), emb, stores, zeros)
  return bank_lib.write(bank_lib.empty(d, n), np.arange(n), emb, stores, zeros), searcher


def test_pq_with_exact_rerank_keeps_high_recall_on_unstructured_vectors():
  bank, q = _random(4000, 6), _random(40, 7)
  exact = _exact(q, bank, 20)
  recalls = {}
  for rerank in (1, 20):
    b, searcher = _device_bank(bank, np.zeros(4000, np.int8), "faiss_pq",
                               {"pq_m": 16, "rerank": rerank, "train_size": 2000})
    rows, mask, cands, _ = bank_lib.search(b, q, k=20, multistore=False, searcher=searcher)
    assert mask.all() and searcher._stores[0].index is not None  # trained, not the flat stage
    np.testing.assert_array_equal(cands, bank[rows])
    recalls[rerank] = _recall(rows, exact)
  assert recalls[20] >= 0.98 and recalls[20] > recalls[1]
  # Re-ranked rows come out in exact-score order.
  scores = np.einsum("qd,qkd->qk", q, cands)
  assert (np.diff(scores, axis=1) <= 1e-6).all()


def test_rerank_keeps_the_multistore_rule():
  vecs = _random(600, 8)
  codes = (np.arange(600) % 4 == 0).astype(np.int8)
  b, searcher = _device_bank(vecs, codes, "faiss_pq", {"pq_m": 8, "rerank": 5, "train_size": 100})
  rows, mask, _, _ = bank_lib.search(b, vecs[:6], k=8, multistore=True, searcher=searcher)
  assert mask.all() and all(sorted(codes[r].tolist()) == [0] * 4 + [1] * 4 for r in rows)
  with pytest.raises(ValueError, match="pq_m=5 must divide the dimension 32"):
    Memory(None, dim=32, index="faiss_pq", index_options={"pq_m": 5})
  with pytest.raises(ValueError, match="rerank must be >= 1"):
    Memory(None, dim=32, index="faiss_pq", index_options={"rerank": 0})


def test_a_searcher_pads_when_the_store_is_small():
  s = ann.faiss_ivf(D, nlist=4, nprobe=4)
  s.add(np.arange(3), _clustered(3), np.zeros(3, np.int8))
  rows, mask = s.search(_clustered(2, seed=9), 5, False)
  assert mask.sum(1).tolist() == [3, 3] and (rows[:, 3:] == -1).all()


def test_unknown_index_and_bad_options_are_clear_errors():
  with pytest.raises(ValueError, match=r"unknown index 'annoy'.*exact.*faiss_hnsw"):
    Memory(None, dim=D, index="annoy")
  with pytest.raises(ValueError, match=r"bad index_options for index='faiss_ivf'"):
    Memory(None, dim=D, index="faiss_ivf", index_options={"nprobes": 3})
  with pytest.raises(ValueError, match="unknown bank_dtype"):
    Memory(None, dim=D, bank_dtype="float16")


@pytest.mark.slow
@pytest.mark.parametrize("index", ["faiss_hnsw", "faiss_ivf", "faiss_pq"])
def test_memory_with_an_ann_index_retrieves_learns_and_saves(tmp_path, index):
  cfg = EARConfig(dim=D, num_candidates=8, slate_size=3, num_rounds=1, batch_size=1,
                  buffer_capacity=8, replay_size=2)
  bank = _clustered(500, seed=5)
  opts = {"faiss_ivf": {"nlist": 8, "nprobe": 8}, "faiss_hnsw": {"ef_search": 500},
          "faiss_pq": {"pq_m": 8, "train_size": 200}}[index]
  m = Memory(None, config=cfg, index=index, index_options=opts)
  exact = Memory(None, config=cfg)
  for mem in (m, exact):
    mem.add([f"t{i}" for i in range(500)], embeddings=bank)
  found = m.search(query_embedding=bank[7], k=3)
  assert found.ids == exact.search(query_embedding=bank[7], k=3).ids  # the same candidates
  session = m.session(query_embedding=bank[7])
  session.feedback([session.round(3).ids[0]])
  session.close()
  m.save(tmp_path / "m")
  assert (tmp_path / "m" / "ann" / ann.STATE_FILE).exists()
  after = m.search(query_embedding=bank[7], k=3)
  m.close()
  with Memory.open(tmp_path / "m") as back:
    assert back.config == m.config
    assert back.search(query_embedding=bank[7], k=3).ids == after.ids


@pytest.mark.parametrize("index", ["faiss_hnsw", "faiss_ivf"])
def test_a_scoped_search_that_finds_fewer_rows_than_the_scope_holds_answers_none(index):
  # None: the bank searches that batch exactly on the device (masked per scope), so a query
  # always gets min(k, rows of its scopes) candidates.
  rng = np.random.default_rng(12)
  opts = {"faiss_hnsw": {"ef_search": 8, "hnsw_m": 4},
          "faiss_ivf": {"nlist": 16, "nprobe": 1, "train_factor": 4}}[index]
  s = ann.make_searcher(index, D, opts)
  vecs = _clustered(600, seed=6)
  scopes = np.zeros(600, np.int32)
  scopes[rng.choice(600, 150, replace=False)] = 1  # a scope of 150 rows
  scopes[rng.choice(np.flatnonzero(scopes == 0), 5, replace=False)] = 2  # and one of 5
  s.add(np.arange(600), vecs, np.zeros(600, np.int8), scopes)
  q = _clustered(32, seed=7)
  allowed = lambda *codes: np.isin(np.arange(4), codes)
  assert s.search(q, 10, False, allowed(2)) is None  # 5 <= FEW_ROWS * k
  assert ann.FEW_ROWS * 10 < 150
  got = s.search(q, 10, False, allowed(1))
  if index == "faiss_ivf":  # one list of 16 probed: ~9 of the 150 rows, fewer than 10 for some
    assert got is None
  for found in (got, s.search(q, 10, False, allowed(0, 1)), s.search(q, 10, False)):
    if found is not None:  # what it answers has every row it may return
      rows, mask = found
      assert mask.all() and (rows >= 0).all()


def _serialized(searcher):
  # pylint: disable=protected-access
  indexes = [st.index if st.index is not None else st._flat for st in searcher._stores]
  return [bytes(ann._faiss().serialize_index(index)) for index in indexes]


@pytest.mark.parametrize("index,opts", [("faiss_hnsw", {"build_threads": 1}),
                                        ("faiss_ivf", {"nlist": 4, "train_factor": 10})])
def test_a_saved_searcher_loads_as_itself_and_continues_as_if_never_saved(tmp_path, index, opts):
  vecs, stores = _clustered(90, seed=10), (np.arange(90) % 5 == 0).astype(np.int8)
  rows, scopes = np.arange(0, 180, 2), (np.arange(90) % 3).astype(np.int32)  # rows with gaps
  whole = ann.make_searcher(index, D, opts)
  saved = ann.make_searcher(index, D, opts)
  for s in (whole, saved):
    s.add(rows[:30], vecs[:30], stores[:30], scopes[:30])
  saved.save(tmp_path)
  state = (tmp_path / ann.STATE_FILE).read_bytes()
  saved.save(tmp_path)  # unchanged: not rewritten
  assert (tmp_path / ann.STATE_FILE).read_bytes() == state
  back = ann.FaissSearcher.load(tmp_path, index, opts, D, rows[:60], vecs[:60], stores[:60],
                                scopes[:60])
  whole.add(rows[30:60], vecs[30:60], stores[30:60], scopes[30:60])  # what load extended it by
  for s in (whole, back):
    s.add(rows[60:], vecs[60:], stores[60:], scopes[60:])
  assert _serialized(back) == _serialized(whole)  # (IVF trained at 40 vectors, after the load)
  q = _clustered(5, seed=11)
  assert back.search(q, 2, False, np.asarray([False, True])) is not None  # 30 rows > FEW_ROWS * 2
  for allowed, k in ((None, 6), (np.asarray([False, True]), 2)):
    for multistore in (False, True):
      got, want = back.search(q, k, multistore, allowed), whole.search(q, k, multistore, allowed)
      assert (got is None) == (want is None)
      if got is not None:
        np.testing.assert_array_equal(got[0], want[0])


def test_a_stale_state_is_rebuilt_and_an_unreadable_one_is_refused(tmp_path):
  vecs, stores = _clustered(20, seed=12), np.zeros(20, np.int8)
  s = ann.make_searcher("faiss_hnsw", D, {})
  s.add(np.arange(20), vecs, stores)
  s.save(tmp_path)
  live = np.arange(20) != 3  # row 3 deleted since: the state holds a row the table does not
  load = lambda where, name, rows=np.arange(20), live=np.ones(20, bool): ann.FaissSearcher.load(
      where, name, {}, D, rows[live], vecs[live], stores[live], np.zeros(live.sum(), np.int32))
  back = load(tmp_path, "faiss_hnsw", live=live)
  assert sorted(back.rows().tolist()) == np.arange(20)[live].tolist()
  with pytest.raises(ValueError, match=r"index 'faiss_hnsw' with options \{\}, not 'faiss_ivf'"):
    load(tmp_path, "faiss_ivf")
  path = tmp_path / ann.STATE_FILE
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF  # inside store 0's faiss index: refused before faiss reads it
  for tampered in (bytes(data), bytes(data[:200])):
    path.write_bytes(tampered)
    with pytest.raises(ValueError, match=r"index.npz: not a readable index state.*remove it"):
      load(tmp_path, "faiss_hnsw")
  assert len(load(tmp_path / "none", "faiss_hnsw")) == 20  # no state: built from the rows


def test_remove_rebuilds_from_the_live_rows_of_the_device_bank():
  vecs, stores = _clustered(30, seed=13), (np.arange(30) % 2).astype(np.int8)
  b, s = _device_bank(vecs, stores, "faiss_hnsw", {})
  b = bank_lib.tombstone(b, [4, 5])
  s.remove([4, 5], b)
  assert sorted(s.rows().tolist()) == [r for r in range(30) if r not in (4, 5)]
  rows, mask = s.search(vecs[[4, 5]], 10, True)
  assert mask.all() and not np.isin(rows, [4, 5]).any()
