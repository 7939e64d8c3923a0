"""The device bank's pure functions (`ear_jax.agent.memory.bank`) against a NumPy brute force."""
import jax
import numpy as np
import pytest

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import scopes as scopes_lib
from ear_jax.agent.memory import checks as checks_lib
from ear_jax.core import adapter as adapter_lib
from ear_jax.core import explorer as explorer_lib
from ear_jax.core import retrieval as retrieval_lib
from ear_jax.core.config import EARConfig, default_hparams

D, K = 8, 8


def _unit(x):
  x = np.asarray(x, np.float32)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _filled(n=40, seed=0, dtype="float32", ties=True):
  """A bank of `n` rows: every third an observation, scopes 'a' (rows < n/2) and 'b'; rows 4 and
  7 are copies of row 1 (equal scores)."""
  rng = np.random.default_rng(seed)
  emb = _unit(rng.normal(size=(n, D)))
  if ties:
    emb[[4, 7]] = emb[1]
  stores = (np.arange(n) % 3 == 2).astype(np.int8)
  names = scopes_lib.ScopeNames()
  scopes = names.codes(["a"] * (n // 2) + ["b"] * (n - n // 2))
  names.count(scopes, stores)
  bank = bank_lib.write(bank_lib.empty(D, 4, dtype), np.arange(n), emb, stores, scopes)
  return bank, emb, stores, scopes, names


def _brute(q, emb, where, k):
  """`[q, k]` rows by score, ties to the lower row, -1 padding (NumPy)."""
  out = np.full((len(q), k), -1)
  for i, s in enumerate(np.asarray(q, np.float32) @ emb.T):
    rows = np.flatnonzero(where)
    best = rows[np.lexsort((rows, -s[rows]))][:k]
    out[i, :len(best)] = best
  return out


def _brute_multistore(q, emb, where, stores, k):
  parts = [_brute(q, emb, where & (stores == s), k // 2) for s in (0, 1)]
  out = np.full((len(q), k), -1)
  for i in range(len(q)):
    rows = [r for p in parts for r in p[i] if r >= 0]
    score = {r: float(np.float32(q[i]) @ emb[r]) for r in rows}
    rows.sort(key=lambda r: (-score[r], stores[r]))  # equal scores: store 0 first
    out[i, :len(rows)] = rows
  return out


def test_search_equals_a_numpy_brute_force_over_dialogue_memories_with_ties_to_the_lower_row():
  bank, emb, stores, _, _ = _filled()
  q = np.concatenate([emb[[1]], _unit(np.random.default_rng(1).normal(size=(4, D)))])
  rows, mask, cands, slates = bank_lib.search(bank, q, k=K, multistore=False)
  np.testing.assert_array_equal(rows, _brute(q, emb, stores == 0, K))
  assert slates is None and mask.all() and (stores[rows] == 0).all()
  assert rows[0, :3].tolist() == [1, 4, 7]  # equal scores: lower row first
  np.testing.assert_array_equal(cands, emb[rows])


def test_multistore_takes_the_top_half_of_each_store_merged_by_score():
  bank, emb, stores, _, _ = _filled()
  q = _unit(np.random.default_rng(2).normal(size=(3, D)))
  rows, mask, _, _ = bank_lib.search(bank, q, k=K, multistore=True)
  np.testing.assert_array_equal(rows, _brute_multistore(q, emb, np.ones(40, bool), stores, K))
  assert mask.all() and ((stores[rows] == 1).sum(1) == K // 2).all()


def test_a_scoped_search_never_returns_rows_of_another_scope_however_few_it_holds():
  bank, emb, stores, scopes, names = _filled()
  names.count(names.codes(["tiny"]), [0])
  bank = bank_lib.write(bank, [40], emb[[3]], [0], names.codes(["tiny"]))
  emb, stores, scopes = np.concatenate([emb, emb[[3]]]), np.append(stores, 0), \
      np.append(scopes, names.codes(["tiny"]))
  q = emb[[3, 30]]
  for spec in (["a"], ["b"], ["tiny"], ["a", "tiny"], ["unknown"]):
    allowed = names.allowed(spec)
    rows, mask, _, _ = bank_lib.search(bank, q, k=K, multistore=False, allowed=allowed)
    where = np.isin(scopes, np.flatnonzero(allowed)) & (stores == 0)
    np.testing.assert_array_equal(rows, _brute(q, emb, where, K))
    assert set(scopes[rows[mask]]) <= set(np.flatnonzero(allowed)), spec
  rows, mask, _, _ = bank_lib.search(bank, q, k=K, multistore=False,
                                     allowed=names.allowed(["tiny"]))
  assert rows[:, 0].tolist() == [40, 40] and not mask[:, 1:].any() and (rows[:, 1:] == -1).all()


def test_tombstoned_rows_are_zeroed_and_never_candidates():
  bank, emb, stores, _, _ = _filled()
  bank = bank_lib.tombstone(bank, [1, 4, 30])
  assert not np.asarray(bank.valid)[[1, 4, 30]].any() and not np.asarray(bank.emb)[[1, 4, 30]].any()
  live = np.ones(40, bool)
  live[[1, 4, 30]] = False
  q = emb[[1, 30]]
  rows, _, _, _ = bank_lib.search(bank, q, k=K, multistore=False)
  np.testing.assert_array_equal(rows, _brute(q, emb, live & (stores == 0), K))
  assert rows[0, 0] == 7  # the copy of row 1 that is still live


def test_write_grows_the_bank_and_keeps_rows_gaps_and_masks():
  bank, emb, stores, scopes, _ = _filled()
  assert bank.emb.shape == (64, D) and int(np.asarray(bank.valid).sum()) == 40
  grown = bank_lib.write(bank, [70], emb[[2]], [1], [1])  # beyond the capacity: one copy
  assert grown.emb.shape == (128, D) and grown.stores.dtype == np.int8
  valid = np.asarray(grown.valid)
  assert valid[:40].all() and not valid[40:70].any() and valid[70] and not valid[71:].any()
  np.testing.assert_array_equal(np.asarray(grown.emb)[:40], emb)
  np.testing.assert_array_equal(np.asarray(grown.scopes)[:40], scopes)
  assert bank_lib.grow(grown, 100) is grown


def test_write_and_tombstone_donate_the_bank_and_compile_once_per_batch_size():
  bank, emb, _, _, _ = _filled()
  old = bank.emb
  bank = bank_lib.write(bank, [41, 42, 43], emb[:3], [0, 0, 0], [0, 0, 0])
  assert old.is_deleted()  # donated: an add writes its rows, not a copy of the bank
  before = bank_lib._write._cache_size()  # pylint: disable=protected-access
  bank = bank_lib.write(bank, [44, 45, 46, 47], emb[:4], [0] * 4, [0] * 4)  # padded: 4 again
  bank = bank_lib.tombstone(bank, [41])
  old = bank.emb
  bank = bank_lib.tombstone(bank, [42])
  assert old.is_deleted()
  assert bank_lib._write._cache_size() == before  # pylint: disable=protected-access


def test_search_compiles_once_per_capacity_and_query_count():
  bank, emb, _, _, names = _filled()
  before = bank_lib._search._cache_size()  # pylint: disable=protected-access
  for q in (emb[:3], emb[3:6], emb[:4]):  # 3 and 4 queries both pad to 4
    bank_lib.search(bank, q, k=K, multistore=False, allowed=names.allowed(["a"]))
  assert bank_lib._search._cache_size() - before == 1  # pylint: disable=protected-access


@pytest.mark.slow  # (~1.3 s: the slate's compile)
@pytest.mark.parametrize("explore", [False, True])
def test_first_round_slate_is_the_adapter_or_explorer_slate_of_the_candidates(explore):
  bank, _, _, _, _ = _filled()
  cfg = EARConfig(dim=D, num_candidates=K, slate_size=3)
  params = adapter_lib.init_adapter(jax.random.PRNGKey(0), cfg)
  hp = default_hparams()
  q = _unit(np.random.default_rng(4).normal(size=(3, D)))
  rows, mask, cands, (slate, slate_mask, z) = bank_lib.search(
      bank, q, k=K, multistore=False, slate=(params, hp, 3, explore))
  plain = bank_lib.search(bank, q, k=K, multistore=False)
  np.testing.assert_array_equal(rows, plain[0])
  fresh = np.zeros((3, K), np.float32)
  stats = explorer_lib.BanditStats(mean=fresh, counts=fresh) if explore else None
  ref = retrieval_lib.batch_slates(params, q, cands, mask, 3, hp if explore else None, stats)
  np.testing.assert_array_equal(slate, np.asarray(ref[0]))
  np.testing.assert_array_equal(slate_mask, np.asarray(ref[1]))
  np.testing.assert_allclose(z, np.asarray(ref[2]), rtol=1e-5, atol=1e-6)


def test_gather_returns_the_candidates_search_gave():
  bank, _, _, _, _ = _filled(dtype="bfloat16")
  q = np.asarray(bank.emb[:2], np.float32)
  rows, mask, cands, _ = bank_lib.search(bank, q, k=K, multistore=False)
  np.testing.assert_array_equal(np.asarray(bank_lib.gather(bank, rows, mask)), cands)
  np.testing.assert_array_equal(cands, np.asarray(bank.emb, np.float32)[rows])


def test_scope_names_codes_masks_and_counts():
  names, codes = scopes_lib.ScopeNames.from_rows(["x", "y", "x"], [0, 1, 0])
  assert codes.tolist() == [1, 2, 1] and names.names == ["default", "x", "y"]
  assert names.allowed(None) is None
  assert names.allowed(["y", "nope"]).tolist() == [False, False, True, False]  # padded to 4
  assert names.available(K, False, ["x"]) == 2 and names.available(K, True, ["x", "y"]) == 3
  names.check_any(K, False, ["x"], k=3)  # (k is a maximum: 2 memories are enough)
  with pytest.raises(ValueError, match=r"^no memory to retrieve \(k=3\): scope 'y' holds no "
                                       "dialogue memories"):
    names.check_any(K, False, ["y"], k=3)
  with pytest.raises(ValueError, match=r"^no memory to retrieve: scopes \['nope', 'z'\] holds "
                                       "no memories"):
    names.check_any(K, True, ["nope", "z"])
  names.count(codes, [0, 1, 0], -1)
  with pytest.raises(ValueError, match=r"^no memory to retrieve \(k=5\): the memory holds no "
                                       r"memories \(all were deleted\)$"):
    names.check_any(K, False, k=5)
  with pytest.raises(ValueError, match="the bank is empty$"):
    scopes_lib.ScopeNames().check_any(K, True)


def test_an_ann_searcher_gives_the_exact_candidates_on_a_small_bank_and_after_a_remove():
  bank, emb, stores, scopes, names = _filled(ties=False)  # (faiss orders equal scores freely)
  searcher = bank_lib.ann_searcher("faiss_hnsw", {"ef_search": 64}, D)
  searcher.add(np.arange(40), emb, stores, scopes)
  q = _unit(np.random.default_rng(5).normal(size=(3, D)))
  exact = bank_lib.search(bank, q, k=K, multistore=True)
  got = bank_lib.search(bank, q, k=K, multistore=True, searcher=searcher)
  np.testing.assert_array_equal(got[0], exact[0])
  bank = bank_lib.tombstone(bank, exact[0][:, 0])
  searcher.remove(exact[0][:, 0], bank)
  assert len(searcher) == 40 - len(set(exact[0][:, 0]))
  for allowed in (None, names.allowed(["b"])):  # 'b' holds few rows: the exact fallback
    exact = bank_lib.search(bank, q, k=K, multistore=False, allowed=allowed)
    got = bank_lib.search(bank, q, k=K, multistore=False, allowed=allowed, searcher=searcher)
    np.testing.assert_array_equal(got[0], exact[0])
  with pytest.raises(checks_lib.InputTypeError, match="index must be a string"):
    bank_lib.ann_searcher(3, {}, D)
  assert bank_lib.ann_searcher("exact", {}, D) is None
