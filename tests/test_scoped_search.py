"""A scoped search reads only its scopes' rows (`scopes.ScopeRows`, `bank.scope_candidates`) and
answers exactly as the masked scan of the whole bank: same rows, same order, ties to the lower row.
"""
import numpy as np
import pytest

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import scopes as scopes_lib
from ear_jax.agent.memory import checks as checks_lib
from ear_jax.agent.memory import lexical_bank
from ear_jax.data import first_stage

D, K, N, SCOPES = 8, 8, 600, 40


def _unit(x):
  x = np.asarray(x, np.float32)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _random_rows(seed=0):
  """`N` rows in `SCOPES` scopes of uneven sizes (some smaller than K), about 30% observations,
  copies of a row (equal scores) inside one scope; the first `N - 50` rows written at open, 1/5
  of them then tombstoned, the last 50 added after, 7 at a time. Returns `(emb, codes, stores,
  names, scope_rows, steps)`, `steps` the bank's writes and tombstones in order."""
  rng = np.random.default_rng(seed)
  emb = _unit(rng.normal(size=(N, D)))
  codes = np.minimum(rng.geometric(0.08, N) - 1, SCOPES - 1).astype(np.int32)
  same = np.flatnonzero(codes == codes[0])[:4]
  emb[same] = emb[same[0]]
  stores = (rng.random(N) < 0.3).astype(np.int8)
  names = scopes_lib.ScopeNames()
  names.codes([f"s{i}" for i in range(SCOPES)])
  first = N - 50
  steps = [("write", np.arange(first)), ("tombstone", rng.choice(first, first // 5, False))]
  steps += [("write", np.arange(at, min(N, at + 7))) for at in range(first, N, 7)]
  scope_rows = scopes_lib.ScopeRows()
  for op, rows in steps:
    if op == "write":
      scope_rows.add(rows, codes[rows])
    else:
      scope_rows.remove(rows)
  return emb, codes, stores, names, scope_rows, steps


def _random_bank(seed=0):
  """`_random_rows` in a device bank: `(bank, names, scope_rows, codes, stores)`."""
  emb, codes, stores, names, scope_rows, steps = _random_rows(seed)
  bank = bank_lib.empty(D, N)
  for op, rows in steps:
    bank = (bank_lib.write(bank, rows, emb[rows], stores[rows], codes[rows]) if op == "write"
            else bank_lib.tombstone(bank, rows))
  return bank, names, scope_rows, codes, stores


SPECS = [["s6"], ["s20"], ["s1"], ["s5", "s17", "s30"], ["s2", "nope"], ["nope"], ["s39"], ["s0"]]
# (s6 holds equal rows, s20 two rows (< K), s39 none; the first three pad to 32 rows)


@pytest.mark.parametrize("multistore,specs", [
    (False, SPECS[:3]),  # (the fast tier: each padded scope size is a compile)
    pytest.param(False, SPECS, marks=pytest.mark.slow),
    pytest.param(True, SPECS, marks=pytest.mark.slow)])
def test_scoped_search_equals_the_masked_scan_of_the_whole_bank(multistore, specs):
  bank, names, scope_rows, codes, stores = _random_bank()
  rng = np.random.default_rng(1)
  q = np.concatenate([np.asarray(bank.emb[:1]), _unit(rng.normal(size=(3, D)))])
  for spec in specs:
    allowed = names.allowed(spec)
    assert bank_lib.scope_candidates(scope_rows, allowed, bank.emb.shape[0]) is not None
    got = bank_lib.search(bank, q, k=K, multistore=multistore, allowed=allowed,
                          scope_rows=scope_rows)
    want = bank_lib.search(bank, q, k=K, multistore=multistore, allowed=allowed)
    for a, b in zip(got[:3], want[:3]):
      np.testing.assert_array_equal(a, b, err_msg=str(spec))


def _each_alone(search, specs, names, n):
  """The answers of `search(allowed)` (a list of `[q, ...]` arrays) for each spec alone, row i of
  spec i stacked: what one call with the per-query specs must give."""
  alone = [search(None if spec is None else names.allowed(spec)) for spec in specs]
  return [np.stack([alone[i][j][i] for i in range(n)]) for j in range(len(alone[0]))]


@pytest.mark.parametrize("specs", [
    [["s6"], ["s20"], ["s1"], ["s6"], ["nope"]],  # small scopes: each query's rows gathered
    pytest.param([["s6"], None, ["s5", "s17", "s30"], ["s0"], ["s39"]],  # one unscoped: masked
                 marks=pytest.mark.slow)])
def test_per_query_scopes_in_one_call_answer_as_each_spec_alone(specs):
  bank, names, scope_rows, _, _ = _random_bank()
  rng = np.random.default_rng(7)
  q = np.concatenate([np.asarray(bank.emb[:1]), _unit(rng.normal(size=(len(specs) - 1, D)))])
  cand = bank_lib.scope_candidates(scope_rows, [names.allowed(x) if x else None for x in specs],
                                   bank.emb.shape[0], 8)
  assert (cand is None) == any(x is None for x in specs)
  per = [None if x is None else names.allowed(x) for x in specs]
  got = bank_lib.search(bank, q, k=K, multistore=False, allowed=per, scope_rows=scope_rows)
  want = _each_alone(lambda a: bank_lib.search(bank, q, k=K, multistore=False, allowed=a,
                                               scope_rows=scope_rows)[:3], specs, names, len(q))
  for a, b in zip(got[:3], want):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("generator", ["bm25", "hybrid"])
def test_per_query_scopes_of_a_lexical_search_answer_as_each_spec_alone(generator):
  bank, names, scope_rows, lex = _lexical(False, generator)
  q = _unit(np.random.default_rng(8).normal(size=(4, D)))
  texts = ["apple stone music", "cloud river", "green paper", "light apple"]
  for specs in ([["s6"], ["s1"], ["s5", "s17"], ["s1"]], [["s6"], None, ["s0"], ["nope"]]):
    per = [None if x is None else names.allowed(x) for x in specs]
    got = lex.search(bank, q, texts, K, allowed=per, scope_rows=scope_rows)
    want = _each_alone(lambda a: lex.search(bank, q, texts, K, allowed=a,
                                            scope_rows=scope_rows)[:3], specs, names, len(q))
    for a, b in zip(got[:2], want[:2]):
      np.testing.assert_array_equal(a, b, err_msg=str(specs))
    np.testing.assert_allclose(got[2], want[2], rtol=0, atol=1e-6, err_msg=str(specs))


def test_scope_rows_hold_each_scopes_live_rows_ascending():
  _, codes, _, names, scope_rows, steps = _random_rows()
  live = np.zeros(N, bool)
  for op, rows in steps:
    live[rows] = op == "write"
  for spec in SPECS:
    allowed = names.allowed(spec)
    want = np.flatnonzero(live & allowed[codes])
    np.testing.assert_array_equal(scope_rows.of(allowed), want)
    assert scope_rows.size(allowed) == len(want)
  back = scopes_lib.ScopeRows()
  back.add([9, 3], [1, 1])
  back.add([5, 1], [1, 0])  # (below rows held: merged in order)
  back.remove([3, 100])
  np.testing.assert_array_equal(back.of(np.asarray([False, True])), [5, 9])
  np.testing.assert_array_equal(back.of(np.asarray([True, True])), [1, 5, 9])


def test_a_scope_of_many_rows_and_an_unscoped_search_scan_the_whole_bank():
  _, _, _, names, scope_rows, _ = _random_rows()
  cap = bank_lib.capacity_for(N)
  big = scopes_lib.ScopeRows(np.arange(N), np.zeros(N, np.int32))
  assert bank_lib.scope_candidates(big, names.allowed([checks_lib.DEFAULT_SCOPE]), cap) is None
  assert bank_lib.scope_candidates(scope_rows, None, cap) is None
  small = bank_lib.scope_candidates(scope_rows, names.allowed(["s3"]), cap)
  assert len(small) == bank_lib.MIN_CAPACITY and (small[scope_rows.size(names.allowed(["s3"])):]
                                                  == cap).all()


def _lexical(multistore, generator, options=first_stage.FirstStageOptions()):
  bank, names, scope_rows, codes, stores = _random_bank(seed=2)
  words = np.asarray(["apple", "river", "stone", "cloud", "green", "music", "paper", "light"])
  rng = np.random.default_rng(3)
  texts = [" ".join(words[rng.integers(0, len(words), 4)]) for _ in range(N)]
  lex = lexical_bank.LexicalBank(generator, options, multistore)
  live = np.flatnonzero(np.asarray(bank.valid)[:N])
  enc = lex.encode(lexical_bank.tokenize([texts[i] for i in live]), stores[live])
  lex.add(live, enc, codes[live])
  return bank, names, scope_rows, lex


@pytest.mark.slow
@pytest.mark.parametrize("generator,fusion,multistore", [
    ("bm25", "weighted", False), ("hybrid", "weighted", False), ("hybrid", "weighted", True),
    ("hybrid", "rrf", False), ("dense", "weighted", True)])
def test_scoped_lexical_search_equals_the_masked_ranking_of_the_whole_bank(generator, fusion,
                                                                           multistore):
  options = first_stage.FirstStageOptions(fusion=fusion, rrf_k=4.0)
  bank, names, scope_rows, lex = _lexical(multistore, generator, options)
  q = _unit(np.random.default_rng(4).normal(size=(2, D)))
  texts = ["apple stone music", "cloud river"]
  for spec in SPECS:
    allowed = names.allowed(spec)
    got = lex.search(bank, q, texts, K, allowed=allowed, scope_rows=scope_rows)
    want = lex.search(bank, q, texts, K, allowed=allowed)
    for a, b in zip(got[:2], want[:2]):
      np.testing.assert_array_equal(a, b, err_msg=str(spec))
    # (the dense-cosine feature: the same float32 dot product, which XLA may sum in another order
    # for the gathered rows' matrix shape)
    np.testing.assert_allclose(got[2], want[2], rtol=0, atol=1e-6, err_msg=str(spec))


def _memory_answers(mem, queries, texts, specs):
  """`Memory.search` per scope spec with the largest k it allows (up to K: every candidate, in
  the adapter's order)."""
  out = []
  for spec in specs:
    for k in range(K, 0, -1):
      try:
        found = mem.search(texts, k, query_embedding=queries, scope=spec)
        break
      except ValueError:  # (fewer candidates in the scopes)
        continue
    out.append([(s.ids, s.scores) for s in found])
  return out


def _assert_same(got, want, candidates):
  """Dense: the same slates bit for bit. BM25 / hybrid: the same memories with the same scores
  to 1e-6 (the features' dense cosine may differ in its last bit, the matmul's summation order,
  and the slate's order among memories of equal first-stage scores follows that bit)."""
  if candidates == "dense":
    assert got == want
    return
  for g, w in zip(got, want):
    for (ids_a, a), (ids_b, b) in zip(g, w):
      assert sorted(ids_a) == sorted(ids_b)
      np.testing.assert_allclose(sorted(a), sorted(b), rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("candidates,multistore", [("dense", False), ("dense", True),
                                                   ("hybrid", False), ("bm25", True)])
def test_memory_scoped_search_after_adds_deletes_updates_and_a_reopen_equals_the_full_scan(
    tmp_path, monkeypatch, candidates, multistore):
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  from tests import memory_helpers  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(5)
  words = ["apple", "river", "stone", "cloud", "green", "music", "paper", "tiger"]
  mem = Memory(None, config=memory_helpers.config(num_candidates=K), candidates=candidates,
               multistore=multistore)
  dim = memory_helpers.D
  for i in range(30):  # 30 scopes of 4..20 memories, about 360 in all
    n = int(rng.integers(4, 21))
    mem.add([" ".join(rng.choice(words, 3)) for _ in range(n)], scope=f"u{i % 30}",
            embeddings=rng.normal(size=(n, dim)), store=[["dialogue", "observation"][j]
                                                         for j in rng.integers(0, 2, n)])
  held = [r["id"] for r in mem.list()]
  mem.delete(list(rng.choice(held, 60, replace=False)))
  for memory_id in rng.choice([r["id"] for r in mem.list()], 5, replace=False):
    mem.update(str(memory_id), text="apple stone paper", embedding=rng.normal(size=dim))
  specs = ["u0", "u7", ["u3", "u11", "u29"], "u5", ["u2", "nobody"]]
  specs = [s for s in specs if len(mem.list(s)) >= 1]
  queries = memory_helpers.unit(rng.normal(size=(3, dim)))
  texts = ["apple river", "stone music tiger", "paper"]
  used = []  # (whether each scoped search gathered)
  real = bank_lib.scope_candidates
  monkeypatch.setattr(bank_lib, "scope_candidates",
                      lambda *a: used.append(real(*a) is not None) or real(*a))
  for _ in range(2):
    gathered = _memory_answers(mem, queries, texts, specs)
    with monkeypatch.context() as patch:
      patch.setattr(bank_lib, "GATHER_SHARE", 1 << 40)  # (the full masked scan)
      _assert_same(_memory_answers(mem, queries, texts, specs), gathered, candidates)
    mem.save(tmp_path / "m")
    mem.close()
    mem = Memory.open(tmp_path / "m")
    _assert_same(_memory_answers(mem, queries, texts, specs), gathered, candidates)
    n = len(specs)
    assert used == [True] * n + [False] * n + [True] * n  # gathered, scanned, gathered
    used.clear()
    mem.add(["green cloud"] * 3, scope="u0", embeddings=rng.normal(size=(3, dim)))
  mem.close()


@pytest.mark.slow
def test_a_small_scope_skips_the_ann_searcher_and_gets_the_exact_answer():
  bank, names, scope_rows, codes, stores = _random_bank()
  searcher = bank_lib.ann_searcher("faiss_ivf", {"nlist": 4, "nprobe": 1, "train_factor": 4}, D)
  live = np.flatnonzero(np.asarray(bank.valid))
  searcher.add(live, np.asarray(bank.emb)[live], stores[live], codes[live])
  asked = []
  search = searcher.search
  searcher.search = lambda *a: asked.append(a) or search(*a)
  q = _unit(np.random.default_rng(6).normal(size=(4, D)))
  for spec in SPECS[:3]:
    allowed = names.allowed(spec)
    got = bank_lib.search(bank, q, k=K, multistore=False, allowed=allowed, searcher=searcher,
                          scope_rows=scope_rows)
    want = bank_lib.search(bank, q, k=K, multistore=False, allowed=allowed)
    for a, b in zip(got[:3], want[:3]):
      np.testing.assert_array_equal(a, b, err_msg=str(spec))
  assert not asked
  bank_lib.search(bank, q, k=K, multistore=False, searcher=searcher, scope_rows=scope_rows)
  assert len(asked) == 1  # (unscoped: the searcher)


@pytest.mark.slow
def test_per_query_scopes_ask_the_ann_searcher_per_query(monkeypatch):
  monkeypatch.setattr(bank_lib, "GATHER_SHARE", 1 << 30)  # (no gathered path: the searcher)
  bank, names, scope_rows, codes, stores = _random_bank()
  searcher = bank_lib.ann_searcher("faiss_hnsw", {}, D)
  live = np.flatnonzero(np.asarray(bank.valid))
  searcher.add(live, np.asarray(bank.emb)[live], stores[live], codes[live])
  q = _unit(np.random.default_rng(9).normal(size=(3, D)))
  specs = [None, ["s0"], ["s0", "s1"]]
  per = [None if x is None else names.allowed(x) for x in specs]
  got = bank_lib.search(bank, q, k=K, multistore=False, allowed=per, searcher=searcher,
                        scope_rows=scope_rows)
  want = _each_alone(lambda a: bank_lib.search(bank, q, k=K, multistore=False, allowed=a,
                                               searcher=searcher, scope_rows=scope_rows)[:3],
                     specs, names, len(q))
  for a, b in zip(got[:3], want):
    np.testing.assert_array_equal(a, b)
