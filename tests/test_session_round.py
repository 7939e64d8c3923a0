"""A `Memory` session round in one call (`episode.session_round`: the pending bandit update, then
the slate), the cached adapter output of later rounds, the final 'exploit' slate and the critic
keys: each equals the path it replaced."""
import jax
import numpy as np
import pytest

from ear_jax.agent.memory import episode, registry
from ear_jax.core import learner
from ear_jax.core.config import default_hparams
from tests.memory_helpers import config, unit

K, S = 8, 3
pytestmark = pytest.mark.slow  # (each test compiles its own small programs: seconds)


@pytest.fixture(scope="module")
def case():
  cfg = config()
  rng = np.random.default_rng(0)
  state = learner.init_learner(jax.random.PRNGKey(1), cfg)
  params = jax.tree_util.tree_map(lambda w: w + 0.1 * rng.normal(size=w.shape).astype(w.dtype),
                                  state.params)
  query = unit(rng.normal(size=cfg.dim))
  cands = unit(rng.normal(size=(K, cfg.dim)))
  mask = np.arange(K) < K - 1  # (one padded candidate)
  mean = rng.uniform(-1, 1, K).astype(np.float32)
  counts = rng.integers(0, 3, K).astype(np.float32)
  last = (np.asarray([4, 1, 6, -1, -1, -1, -1, -1], np.int32), np.arange(K) < S,
          np.asarray([1, -1, 1, -1, -1, -1, -1, -1], np.float32))
  return params, default_hparams(), query, cands, mask, mean, counts, last


@pytest.mark.parametrize("explore", [True, False])
def test_session_round_equals_the_bandit_update_then_round_slates(case, explore):
  params, hp, query, cands, mask, mean, counts, last = case
  (slate, slate_mask, z, m2, c2), _ = episode.session_round(params, hp, query, cands, mask, mean,
                                                           counts, last, S, explore)
  want_m, want_c = episode.update_bandits(mean[None], counts[None], *(x[None] for x in last))
  want = episode.round_slates(params, hp, query[None], cands[None], mask[None], want_m, want_c,
                              S, explore)
  np.testing.assert_array_equal(m2, want_m[0])
  np.testing.assert_array_equal(c2, want_c[0])
  np.testing.assert_array_equal(slate, want[0][0])
  np.testing.assert_array_equal(slate_mask, want[1][0])
  np.testing.assert_allclose(z, want[2][0], rtol=1e-6, atol=1e-6)
  assert not np.array_equal(m2, mean)  # the pending feedback was applied


def test_a_later_round_with_the_cached_adapter_output_equals_a_fresh_one(case):
  params, hp, query, cands, mask, mean, counts, last = case
  fresh, given = episode.session_round(params, hp, query, cands, mask, mean, counts, last, S, True)
  cached, again = episode.session_round(params, hp, query, cands, mask, mean, counts, last, S,
                                        True, given)
  for a, b in zip(fresh, cached):
    np.testing.assert_array_equal(a, b)
  assert again[0] is not None and again[1].shape == (K, K)


def test_no_feedback_leaves_the_statistics_as_they_are(case):
  params, hp, query, cands, mask, mean, counts, _ = case
  (_, _, _, m2, c2), _ = episode.session_round(params, hp, query, cands, mask, mean, counts,
                                               episode.no_feedback(K), S, True)
  np.testing.assert_array_equal(m2, mean)
  np.testing.assert_array_equal(c2, counts)


def test_exploit_with_the_cached_adapter_output_equals_a_fresh_one(case):
  params, hp, query, cands, mask, mean, counts, last = case
  _, given = episode.session_round(params, hp, query, cands, mask, mean, counts, last, S, True)
  fresh = episode.exploit(params, query, cands, mask, mean, counts, last, S)
  cached = episode.exploit(params, query, cands, mask, mean, counts, last, S, given)
  for a, b in zip(fresh, cached):
    np.testing.assert_array_equal(a, b)
  assert fresh[1].all()


def test_critic_keys_are_the_two_fold_ins_of_the_session_and_round():
  key = jax.random.PRNGKey(7)
  keys = registry.CriticKeys(key, num_rounds=3)
  for sid, t in ((0, 0), (5, 2), (300, 1), (2, 7)):  # (a later block; a round beyond T)
    want = jax.random.fold_in(jax.random.fold_in(key, sid), t)
    np.testing.assert_array_equal(keys(sid, t), np.asarray(want))
  assert not np.array_equal(keys(0, 0), keys(0, 1))
