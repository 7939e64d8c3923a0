"""Appendix A.2: the simulated critic."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.core import critic


def test_false_positive_rate_hand_computed():
  # n = 2 gold, u = 3 others, r = 0.86, p = 0.88: p_fp = 2*0.86*0.12 / (3*0.88).
  np.testing.assert_allclose(critic.false_positive_rate(2, 3, 0.88, 0.86),
                             2 * 0.86 * 0.12 / (3 * 0.88), rtol=1e-6)
  assert float(critic.false_positive_rate(0, 5, 0.88, 0.86)) == 0.0
  assert float(critic.false_positive_rate(5, 0, 0.88, 0.86)) == 0.0
  assert float(critic.false_positive_rate(4, 1, 0.1, 1.0)) == 1.0  # clipped


@pytest.mark.parametrize("precision,recall", [(0.88, 0.86), (0.7, 0.7), (1.0, 1.0)])
def test_empirical_precision_and_recall_match_targets(precision, recall):
  n_slates, s = 20_000, 5
  rng = np.random.default_rng(0)
  # n >= 1 gold in every slate. A slate made only of gold (u = 0) cannot hold a false positive,
  # so its precision is 1 whatever p is (Appendix A.2 sets p_fp = 0 there), and for n = 4 of 5 at
  # p = 0.7 the formula asks for p_fp > 1 (clipped). Real slates hold 1-3 gold items (LoCoMo queries
  # have 1-4 gold memories): 1 <= n <= 3, where p_fp is never clipped for these targets.
  num_gold = rng.integers(1, 4, size=n_slates)
  gold = np.arange(s)[None, :] < num_gold[:, None]
  hp = (precision, recall)
  keys = jax.random.split(jax.random.PRNGKey(0), n_slates)
  labels = jax.jit(jax.vmap(critic.simulated_critic, in_axes=(0, 0, None, None, None)))(
      keys, jnp.asarray(gold), jnp.ones((s,), bool), *hp)
  cited = np.asarray(labels) > 0
  tp = np.sum(cited & gold)
  emp_recall = tp / gold.sum()
  emp_precision = tp / cited.sum()
  assert abs(emp_recall - recall) <= 0.01, emp_recall
  assert abs(emp_precision - precision) <= 0.01, emp_precision


def test_masked_positions_are_never_cited():
  hp = (0.5, 1.0)
  labels = critic.simulated_critic(jax.random.PRNGKey(0), jnp.array([True, False, True]),
                                   jnp.array([True, True, False]), *hp)
  assert float(labels[2]) == -1.0 and float(labels[0]) == 1.0


def test_different_keys_give_different_labels():
  hp = (0.6, 0.6)
  gold = jnp.array([True, True, False, False, False])
  draws = {tuple(np.asarray(critic.simulated_critic(jax.random.PRNGKey(i), gold,
                                                    jnp.ones(5, bool), *hp))) for i in range(20)}
  assert len(draws) > 1


def test_all_gold_slate_is_cited_at_the_target_recall():
  hp = (0.7, 0.7)
  keys = jax.random.split(jax.random.PRNGKey(1), 2000)
  labels = jax.vmap(critic.simulated_critic, in_axes=(0, None, None, None, None))(
      keys, jnp.ones(5, bool), jnp.ones(5, bool), *hp)
  assert abs(float(jnp.mean(labels > 0)) - 0.7) < 0.02  # recall holds; nothing else to cite


def test_critic_pytree_sees_the_slate_through_a_view_and_vmaps_over_its_parameters():
  query, cands = jnp.ones(3), jnp.arange(12.0).reshape(4, 3)
  gold = jnp.array([False, True, False, True])
  view = critic.slate_view(query, cands, gold, jnp.array([1, 0, -1]), jnp.array([True, True, False]))
  np.testing.assert_array_equal(view.gold, [True, False, False])
  np.testing.assert_array_equal(view.memories, [cands[1], cands[0], jnp.zeros(3)])
  np.testing.assert_array_equal(critic.OracleCritic()(jax.random.PRNGKey(0), view), [1, -1, -1])
  sweep = critic.stack_critics([critic.make_simulated_critic(p, p) for p in (0.7, 1.0)])
  labels = jax.jit(jax.vmap(lambda c: c(jax.random.PRNGKey(3), view)))(sweep)
  assert labels.shape == (2, 3)
  np.testing.assert_array_equal(labels[1], [1, -1, -1])  # p = r = 1 cites exactly the gold
  with pytest.raises(ValueError, match="critic precision must be in"):
    critic.make_simulated_critic(precision=1.5)
