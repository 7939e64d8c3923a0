"""Eq. (10)-(12), (16), (17), (19), (20)."""
import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import losses

LOG123 = jnp.log(jnp.array([1.0, 2.0, 3.0]))


def test_plackett_luce_three_items_hand_computed():
  # p ∝ [1, 2, 3]; slate [2, 0, 1]: P = 3/6 * 1/3 * 2/2 = 1/6.
  lp = losses.slate_log_probs(LOG123, jnp.ones(3, bool), jnp.array([2, 0, 1]),
                              jnp.ones(3, bool), "sequential")
  np.testing.assert_allclose(lp, np.log([3 / 6, 1 / 3, 1.0]), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(jnp.sum(lp), np.log(1 / 6), rtol=1e-6)


def test_flat_log_probs_use_the_full_softmax():
  lp = losses.slate_log_probs(LOG123, jnp.ones(3, bool), jnp.array([2, 0, 1]),
                              jnp.ones(3, bool), "flat")
  np.testing.assert_allclose(lp, np.log([3 / 6, 1 / 6, 2 / 6]), rtol=1e-6)


def test_current_query_loss_hand_computed():
  # slate [2, 0], rewards [+1, -1], b = 0.5: -1/2 [0.5 log(1/2) - 1.5 log(1/6)].
  loss = losses.ranking_loss(LOG123, jnp.ones(3, bool), jnp.array([[2, 0]]),
                             jnp.ones((1, 2), bool), jnp.array([[1.0, -1.0]]), 0.5, "flat")
  np.testing.assert_allclose(loss, -0.5 * (0.5 * np.log(0.5) - 1.5 * np.log(1 / 6)), rtol=1e-6)


def test_loss_averages_over_rounds_and_positions():
  slates = jnp.array([[2, 0], [1, 2]])
  rewards = jnp.array([[1.0, -1.0], [1.0, 1.0]])
  loss = losses.ranking_loss(LOG123, jnp.ones(3, bool), slates, jnp.ones((2, 2), bool), rewards,
                             0.5, "flat")
  lp = np.log([3 / 6, 1 / 6, 2 / 6, 3 / 6])
  np.testing.assert_allclose(loss, -np.mean(np.array([0.5, -1.5, 0.5, 0.5]) * lp), rtol=1e-6)


def test_loss_is_finite_with_all_masked_inputs_and_zero_vectors():
  def f(z):
    return losses.ranking_loss(z, jnp.zeros(3, bool), jnp.array([[-1, -1]]),
                               jnp.zeros((1, 2), bool), jnp.array([[-1.0, -1.0]]), 0.5,
                               "sequential")
  assert float(f(jnp.zeros(3))) == 0.0
  assert np.all(np.isfinite(np.asarray(jax.grad(f)(jnp.zeros(3)))))


def test_feedback_aggregation_hand_computed():
  observed, ybar = losses.aggregate_feedback(jnp.array([[0, 1], [2, 0]]), jnp.ones((2, 2), bool),
                                             jnp.array([[1.0, -1.0], [1.0, -1.0]]), 4)
  np.testing.assert_array_equal(observed, [True, True, True, False])
  np.testing.assert_allclose(ybar, [0.0, -1.0, 1.0, 0.0])


def test_replay_rewards_both_readings():
  ybar = jnp.array([0.5, 0.0, -0.5, 0.0])
  observed = jnp.array([True, True, True, False])
  r, c = losses.replay_rewards(ybar, observed, "negative")
  np.testing.assert_array_equal(r, [1, -1, -1, -1])  # ties (ybar = 0) -> -1
  assert bool(c.all())
  r, c = losses.replay_rewards(ybar, observed, "ignore")
  np.testing.assert_array_equal(c, [True, True, True, False])


def test_gumbel_top_s_is_the_top_s_slate_of_tempered_logits_plus_the_keys_gumbel_noise():
  key, z, tau = jax.random.PRNGKey(3), jnp.array([1.0, 0.0, 0.5, -2.0]), jnp.float32(0.5)
  where = jnp.array([True, True, True, False])
  slate, mask = losses.gumbel_top_s(key, z, where, tau, 3)
  g = jax.random.gumbel(key, (4,), jnp.float32)  # the noise the key draws, Eq. (19)
  want = np.argsort(-np.where(np.asarray(where), np.asarray(z / tau + g), -np.inf))[:3]
  np.testing.assert_array_equal(slate, want)
  assert bool(mask.all())
  slate, mask = losses.gumbel_top_s(key, z, where, tau, 4)  # 3 valid: the 4th position is empty
  assert int(slate[3]) == -1 and mask.tolist() == [True, True, True, False]


def test_gumbel_top_s_samples_without_replacement_and_respects_masks():
  where = jnp.array([True, False, True, True, False])
  for i in range(20):
    slate, mask = losses.gumbel_top_s(jax.random.PRNGKey(i), jnp.zeros(5), where, 0.5, 3)
    assert sorted(np.asarray(slate).tolist()) == [0, 2, 3] and bool(mask.all())
  slates = {tuple(np.asarray(losses.gumbel_top_s(jax.random.PRNGKey(i), jnp.zeros(5), where,
                                                 0.5, 2)[0])) for i in range(20)}
  assert len(slates) > 1  # the key matters


def test_replay_loss_is_a_masked_mean_and_zero_when_empty():
  np.testing.assert_allclose(losses.replay_loss(jnp.array([1.0, 3.0, 100.0]),
                                                jnp.array([True, True, False])), 2.0)
  assert float(losses.replay_loss(jnp.array([5.0]), jnp.array([False]))) == 0.0
  np.testing.assert_allclose(losses.combined_loss(1.0, 2.0, 0.5), 2.0)


def test_loss_support_all_and_a_covering_window_are_the_valid_candidates_themselves():
  where = jnp.array([True, True, False, True])
  observed = jnp.array([True, False, False, False])
  assert losses.loss_support(where, observed, "all", 2) is where
  assert losses.loss_support(where, observed, "window", 4) is where  # K <= T s: the paper's set
  assert losses.loss_support(where, observed, "auto", 4) is where
  np.testing.assert_array_equal(losses.loss_support(where, observed, "auto", 3),
                                [True, False, False, False])  # K > T s: the labelled ones


def test_loss_support_window_is_the_first_stages_top_ts_and_the_labelled_tail():
  where = jnp.array([True, True, True, True, True, False])
  observed = jnp.array([False, True, False, False, True, True])
  np.testing.assert_array_equal(losses.loss_support(where, observed, "window", 2),
                                [True, True, False, False, True, False])
  np.testing.assert_array_equal(losses.loss_support(where, observed, "labelled", 2),
                                [False, True, False, False, True, False])


def test_unshown_tail_gets_no_gradient_outside_the_window():
  # Two shown, uncited memories (ranks 0 and 1, label -1): with the full softmax the loss pushes
  # every other candidate up, the never-shown tail (ranks 2-5) included; with the window of
  # T s = 3 the tail beyond it is untouched and only rank 2 (in the window) moves up.
  z = jnp.zeros(6)
  where = jnp.ones(6, bool)
  slates, mask, labels = jnp.array([[0, 1]]), jnp.ones((1, 2), bool), jnp.array([[-1.0, -1.0]])
  observed, _ = losses.aggregate_feedback(slates, mask, labels, 6)

  def grad(mode):
    support = losses.loss_support(where, observed, mode, 3)
    return jax.grad(lambda x: losses.ranking_loss(x, support, slates, mask, labels, 0.0,
                                                  "flat"))(z)

  g_all, g_window = grad("all"), grad("window")
  assert np.all(np.asarray(g_all[2:]) < 0)  # gradient descent raises the whole unshown tail
  assert g_window[2] < 0 and np.all(np.asarray(g_window[3:]) == 0.0)
  assert np.all(np.isfinite(np.asarray(g_window)))
