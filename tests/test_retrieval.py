"""The one retrieval path: top-K search (Eq. (1)) and adapt -> slate (Section 3.6)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.core import adapter, critic, retrieval
from ear_jax.core.config import EARConfig, default_hparams

jit_top_k_search = jax.jit(retrieval.top_k_search, static_argnames=("k", "chunk"))
jit_retrieve = jax.jit(retrieval.retrieve, static_argnames=("k", "slate_size"))
jit_explorer_retrieve = jax.jit(retrieval.explorer_retrieve,
                                static_argnames=("k", "num_rounds", "slate_size"))


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _params(d, seed=0):
  rng = np.random.default_rng(seed)
  return adapter.AdapterParams(w_q=jnp.asarray(0.3 * rng.normal(size=(d, d)), jnp.float32),
                               w_m=jnp.asarray(0.3 * rng.normal(size=(d, d)), jnp.float32))


def test_top_k_search_equals_a_numpy_sort_and_masks_invalid_rows():
  rng = np.random.default_rng(0)
  q, bank = _unit(rng.normal(size=(5, 8))), _unit(rng.normal(size=(30, 8)))
  valid = rng.random(30) < 0.7
  idx, scores, mask = jit_top_k_search(jnp.asarray(q), jnp.asarray(bank),
                                       jnp.asarray(valid), k=6)
  s = np.where(valid[None], q @ bank.T, -np.inf)
  np.testing.assert_array_equal(idx, np.argsort(-s, axis=1, kind="stable")[:, :6])
  np.testing.assert_allclose(scores, np.take_along_axis(s, np.asarray(idx), 1), rtol=1e-6)
  assert bool(mask.all())


def test_top_k_search_pads_a_bank_smaller_than_k():
  idx, scores, mask = jit_top_k_search(jnp.ones((1, 2)), jnp.eye(2), jnp.array([1, 0], bool),
                                       k=4)
  assert idx.tolist() == [[0, -1, -1, -1]] and mask.tolist() == [[True, False, False, False]]
  assert np.isneginf(np.asarray(scores)[0, 1:]).all()


def test_multistore_search_takes_half_from_each_store():
  rng = np.random.default_rng(1)
  bank = _unit(rng.normal(size=(20, 4)))
  stores = jnp.asarray(np.arange(20) % 2, jnp.int32)
  idx, _, mask = retrieval.top_k_search(jnp.asarray(bank[:1]), jnp.asarray(bank),
                                        jnp.ones(20, bool), 6, stores=stores)
  assert int(mask.sum()) == 6
  assert sorted((np.asarray(idx[0]) % 2).tolist()) == [0, 0, 0, 1, 1, 1]


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
def test_retrieve_gives_the_same_slates_whether_it_adapts_the_bank_or_the_candidates():
  rng = np.random.default_rng(2)
  d, k, s = 8, 5, 3
  params = _params(d)
  bank = jnp.asarray(_unit(rng.normal(size=(12, d))), jnp.float32)
  valid = jnp.ones(12, bool)
  q = jnp.asarray(_unit(rng.normal(size=(4, d))), jnp.float32)  # 4 * 5 > 12: adapts the bank
  rows_bank, idx, z_bank = jit_retrieve(params, q, bank, valid, k=k, slate_size=s)
  for i in range(4):  # one query at a time: 5 <= 12 adapts the candidates
    rows_one, idx_one, z_one = jit_retrieve(params, q[i:i + 1], bank, valid, k=k,
                                            slate_size=s)
    np.testing.assert_array_equal(rows_one[0], rows_bank[i])
    np.testing.assert_allclose(z_one[0], z_bank[i], atol=1e-5)
  # Against the adapter's own scores over the whole bank, restricted to the top-K candidates.
  z_all = adapter.adapter_scores(params, q[0], bank[idx[0]])
  assert rows_bank[0].tolist() == np.asarray(idx[0])[np.argsort(-np.asarray(z_all))[:s]].tolist()


def test_explorer_retrieve_with_an_oracle_critic_finds_gold_inside_the_candidates():
  rng = np.random.default_rng(3)
  d = 8
  bank = jnp.asarray(_unit(rng.normal(size=(40, d))), jnp.float32)
  q = jnp.asarray(_unit(rng.normal(size=(3, d))), jnp.float32)
  idx, _, _ = retrieval.top_k_search(q, bank, jnp.ones(40, bool), 10)
  gold = np.zeros((3, 40), bool)
  gold[np.arange(3), np.asarray(idx)[:, 9]] = True  # the 10th candidate: outside the adapter top-3
  hp = default_hparams()
  cfg = EARConfig(dim=d, num_candidates=10, slate_size=3, num_rounds=4)
  rows = jit_explorer_retrieve(jax.random.PRNGKey(0), adapter.AdapterParams(
      w_q=jnp.zeros((d, d)), w_m=jnp.zeros((d, d))), q, bank, jnp.ones(40, bool),
      jnp.asarray(gold), k=cfg.num_candidates, num_rounds=cfg.num_rounds,
      slate_size=cfg.slate_size, hparams=hp, critic=critic.OracleCritic())
  assert rows.shape == (3, 3)
  found = [bool(gold[i, np.asarray(rows[i])].any()) for i in range(3)]
  assert sum(found) >= 2, found  # UCB exploration reaches candidates the adapter ranks last
