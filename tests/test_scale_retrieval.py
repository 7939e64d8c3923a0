"""The streamed exact search (`retrieval.top_k_search` in blocks) against an independent sort."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.core import retrieval

jit_top_k_search = jax.jit(retrieval.top_k_search, static_argnames=("k", "chunk"))


def _bank(m, d, seed=0, dup=True):
  rng = np.random.default_rng(seed)
  bank = rng.normal(size=(m, d)).astype(np.float32)
  bank /= np.linalg.norm(bank, axis=1, keepdims=True)
  if dup:  # exact ties spread over several blocks: equal scores must go to the lower row
    for r in (m // 3, m // 2, m - 1):
      bank[r] = bank[5]
  return bank


def _numpy_top(q, bank, where, k):
  s = np.where(where[None], q.astype(np.float64) @ bank.T.astype(np.float64), -np.inf)
  idx = np.argsort(-s, axis=1, kind="stable")[:, :k]
  vals = np.take_along_axis(s, idx, 1)
  return np.where(np.isfinite(vals), idx, -1)


@pytest.mark.parametrize("m,chunk", [(1000, 64), (1024, 128), (1000, 4096)])
def test_streamed_search_equals_a_stable_numpy_sort_with_ties_and_invalid_rows(m, chunk):
  bank = _bank(m, 12)
  rng = np.random.default_rng(1)
  valid = rng.random(m) < 0.8
  valid[[5, m // 3, m // 2, m - 1]] = True
  q = np.concatenate([bank[5:6], rng.normal(size=(3, 12)).astype(np.float32)])
  idx, scores, mask = jit_top_k_search(jnp.asarray(q), jnp.asarray(bank),
                                       jnp.asarray(valid), k=20, chunk=chunk)
  np.testing.assert_array_equal(idx, _numpy_top(q, bank, valid, 20))
  assert np.asarray(idx)[0, :4].tolist() == [5, m // 3, m // 2, m - 1]
  np.testing.assert_allclose(scores, np.sort(np.where(valid[None], q @ bank.T, -np.inf),
                                             axis=1)[:, ::-1][:, :20], atol=1e-5)
  assert bool(mask.all())


def test_streamed_search_pads_when_fewer_than_k_rows_are_valid():
  bank = _bank(300, 8, dup=False)
  valid = np.zeros(300, bool)
  valid[[7, 250, 299]] = True
  q = bank[250:251]
  idx, scores, mask = jit_top_k_search(q, bank, valid, k=6, chunk=32)
  assert idx[0, 0] == 250 and sorted(np.asarray(idx)[0, :3].tolist()) == [7, 250, 299]
  assert np.asarray(idx)[0, 3:].tolist() == [-1, -1, -1]
  assert np.asarray(mask)[0].tolist() == [True] * 3 + [False] * 3
  assert np.isneginf(np.asarray(scores)[0, 3:]).all()


def test_streamed_multistore_search_equals_the_one_block_search():
  bank = _bank(700, 10)
  stores = jnp.asarray(np.random.default_rng(2).integers(0, 2, 700), jnp.int32)
  valid = jnp.ones(700, bool)
  q = jnp.asarray(bank[:4])
  one = retrieval.top_k_search(q, bank, valid, 10, stores, chunk=4096)
  streamed = retrieval.top_k_search(q, bank, valid, 10, stores, chunk=64)
  for a, b in zip(one, streamed):
    np.testing.assert_array_equal(a, b)
  idx = np.asarray(streamed[0])
  assert all(sorted(np.asarray(stores)[row].tolist()) == [0] * 5 + [1] * 5 for row in idx)


@pytest.mark.slow
def test_a_bfloat16_bank_gives_float32_scores_close_to_the_float32_bank():
  bank = _bank(2000, 32, dup=False)
  q = jnp.asarray(np.random.default_rng(3).normal(size=(2, 32)), jnp.float32)
  valid = jnp.ones(2000, bool)
  for n in (1, 8):  # the multiply-reduce (few queries) and the widened product
    qq = jnp.tile(q, (n // 2 + 1, 1))[:n]
    i32, s32, _ = jit_top_k_search(qq, bank, valid, k=20, chunk=256)
    i16, s16, _ = jit_top_k_search(qq, jnp.asarray(bank, jnp.bfloat16), valid, k=20,
                                   chunk=256)
    assert s16.dtype == jnp.float32
    exact16 = np.asarray(jnp.asarray(bank, jnp.bfloat16), np.float32) @ np.asarray(qq).T
    np.testing.assert_allclose(np.asarray(s16), np.take_along_axis(exact16.T, np.asarray(i16), 1),
                               atol=1e-4)
    overlap = np.mean([len(set(a) & set(b)) / 20 for a, b in zip(np.asarray(i32),
                                                                np.asarray(i16))])
    assert overlap >= 0.9


def test_block_rows_keeps_the_score_buffer_bounded():
  assert retrieval.block_rows(1) == retrieval.SCORE_BUDGET
  assert retrieval.block_rows(256) == retrieval.SCORE_BUDGET // 256
  assert retrieval.block_rows(10**6) == retrieval.MIN_CHUNK
  assert retrieval.block_rows(3) & (retrieval.block_rows(3) - 1) == 0  # a power of two
