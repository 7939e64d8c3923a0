"""Eq. (5)-(9) and Alg. 2: the Explorer."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from ear_jax.core import critic, explorer
from ear_jax.core.slates import gather_slate, top_s_slate
from ear_jax.core.config import default_hparams

HP = default_hparams()  # lambda = 0.4 / 0.3 / 0.3, alpha = 0.5

# Four unit vectors in 2-D and the query [1, 0] (identity adapter): z = [1, 0.8, 0.6, 0].
M = jnp.array([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])
Z = M @ jnp.array([1.0, 0.0])
GRAM = M @ M.T


def test_ucb_hand_computed():
  stats = explorer.BanditStats(mean=jnp.array([1.0, 0.0, 0.0]), counts=jnp.array([1.0, 0, 0]))
  u = explorer.ucb_scores(stats, jnp.float32(0.5))
  np.testing.assert_allclose(u, [1 + 0.5 * np.sqrt(np.log(2) / 2), 0.5 * np.sqrt(np.log(2)),
                                 0.5 * np.sqrt(np.log(2))], rtol=1e-6)


def test_ucb_is_zero_bonus_before_any_pull():
  np.testing.assert_allclose(explorer.ucb_scores(explorer.init_bandit(3), 0.5), 0.0)


def test_redundancy_hand_computed():
  np.testing.assert_allclose(explorer.redundancy(GRAM, jnp.zeros(4, bool)), 0.0)
  d = explorer.redundancy(GRAM, jnp.array([True, False, True, False]))
  np.testing.assert_allclose(d, [1.0, 0.96, 1.0, 0.8], rtol=1e-6)


def test_bandit_update_hand_computed():
  stats = explorer.BanditStats(mean=jnp.array([0.5, 0.0, 0.2]), counts=jnp.array([1.0, 0, 3]))
  new = explorer.update_bandit(stats, jnp.array([0, 1]), jnp.array([True, True]),
                               jnp.array([-1.0, 1.0]))
  np.testing.assert_allclose(new.counts, [2, 1, 3])
  np.testing.assert_allclose(new.mean, [0.5 + (-1 - 0.5) / 2, 1.0, 0.2])


def test_greedy_slate_hand_computed_first_round():
  # Round 1 (no pulls): A = 0.4 z; pick m0; then A - 0.3 * gram[:, 0]: m1 0.08 > m2 0.06 > m3 0.
  slate, mask = explorer.greedy_slate(Z, jnp.zeros(4), GRAM, jnp.ones(4, bool), HP, 2)
  assert list(np.asarray(slate)) == [0, 1] and bool(mask.all())


def test_four_candidate_explorer_worked_by_hand():
  # Gold = {2}. Round 1 picks [0, 1], both -1. Round 2: U0 = U1 = -1 + 0.5 sqrt(log 3 / 2),
  # U2 = U3 = 0.5 sqrt(log 3): A = [0.2112, 0.1312, 0.3972, 0.1572] -> m2; then minus
  # 0.3 * gram[:, 2] = [0.18, 0.288, -, 0.24]: [0.0312, -0.1568, -, -0.0828] -> m0.
  gold = jnp.array([False, False, True, False])
  fb = lambda k, s, m: critic.oracle_critic(k, gather_slate(gold, s, m, False), m)
  out = explorer.explore(jax.random.PRNGKey(0), Z, GRAM, jnp.ones(4, bool), fb, HP, 2, 2)
  np.testing.assert_array_equal(out.slates, [[0, 1], [2, 0]])
  np.testing.assert_array_equal(out.labels, [[-1, -1], [1, -1]])
  np.testing.assert_allclose(out.stats.counts, [2, 1, 1, 0])
  np.testing.assert_allclose(out.stats.mean, [-1, -1, 1, 0])


def test_ties_go_to_the_lowest_index():
  slate, _ = explorer.greedy_slate(jnp.ones(4), jnp.zeros(4), jnp.zeros((4, 4)),
                                   jnp.ones(4, bool), HP, 3)
  assert list(np.asarray(slate)) == [0, 1, 2]


def test_fewer_valid_candidates_than_s_gives_empty_positions():
  where = jnp.array([False, True, False, True])
  slate, mask = explorer.greedy_slate(Z, jnp.zeros(4), GRAM, where, HP, 3)
  assert list(np.asarray(slate)) == [1, 3, -1]
  assert list(np.asarray(mask)) == [True, True, False]
  top, top_mask = top_s_slate(Z, where, 3)
  assert list(np.asarray(top)) == [1, 3, -1] and list(np.asarray(top_mask)) == [True, True, False]


def test_all_masked_candidates_give_an_empty_slate():
  slate, mask = explorer.greedy_slate(Z, jnp.zeros(4), GRAM, jnp.zeros(4, bool), HP, 2)
  assert list(np.asarray(slate)) == [-1, -1] and not bool(mask.any())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 8), st.integers(1, 8))
def test_slate_never_repeats_or_picks_a_masked_candidate(seed, num_valid, s):
  rng = np.random.default_rng(seed)
  k = 8
  where = np.zeros(k, bool)
  where[rng.choice(k, num_valid, replace=False)] = True
  m = rng.normal(size=(k, 3))
  stats = explorer.BanditStats(mean=jnp.asarray(rng.normal(size=k), jnp.float32),
                               counts=jnp.asarray(rng.integers(0, 3, k), jnp.float32))
  slate, mask = _greedy(jnp.asarray(rng.normal(size=k), jnp.float32),
                        explorer.ucb_scores(stats, 0.5), jnp.asarray(m @ m.T, jnp.float32),
                        jnp.asarray(where), s)
  picked = np.asarray(slate)[np.asarray(mask)]
  assert len(set(picked.tolist())) == len(picked) == min(s, num_valid)
  assert np.all(where[picked])


_greedy = jax.jit(lambda z, u, g, w, s: explorer.greedy_slate(z, u, g, w, HP, s),
                  static_argnums=4)


def test_explore_is_a_scan_over_rounds_that_differs_by_key():
  hp = default_hparams()
  gold = jnp.array([True, False, True, False])
  fb = lambda k, s, m: critic.simulated_critic(k, gather_slate(gold, s, m, False), m, 0.6, 0.6)
  run = jax.jit(lambda key: explorer.explore(key, Z, GRAM, jnp.ones(4, bool), fb, hp, 4, 2))
  outs = [run(jax.random.PRNGKey(i)) for i in range(8)]
  assert outs[0].slates.shape == (4, 2)
  np.testing.assert_array_equal(run(jax.random.PRNGKey(0)).labels, outs[0].labels)
  assert len({np.asarray(o.labels).tobytes() for o in outs}) > 1
