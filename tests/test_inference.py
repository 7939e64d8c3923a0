"""Section 3.6 inference modes and the Recall@5 / Hitrate@5 metrics."""
import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import inference, learner, metrics
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.core.critic import OracleCritic
from ear_jax.core.stream import make_stream

CFG = EARConfig.for_method("ear", dim=2, num_candidates=4, slate_size=2, num_rounds=2)
M = np.array([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])


def _stream():
  gold = np.array([[False, True, False, False],   # gold in the top 2 by cosine
                   [False, False, True, True],    # two gold, neither in the top 2
                   [True, False, False, False]])  # one gold in the top 2, one outside the top-K
  return make_stream(np.tile([1.0, 0.0], (3, 1)), np.tile(M, (3, 1, 1)), None, gold,
                     num_gold=np.array([1, 2, 2]))


def test_adapter_only_metrics_hand_computed():
  params = learner.init_learner(jax.random.PRNGKey(0), CFG).params
  res = inference.evaluate(jax.random.PRNGKey(0), params, _stream(), CFG, default_hparams(),
                           OracleCritic())
  np.testing.assert_array_equal(res.adapter_slates, [[0, 1]] * 3)
  np.testing.assert_array_equal(res.adapter_all_gold, [True, False, False])
  np.testing.assert_array_equal(res.adapter_any_gold, [True, False, True])
  np.testing.assert_allclose(res.recall_adapter, 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(res.hitrate_adapter, 2 / 3, rtol=1e-6)


def test_explorer_assisted_inference_finds_gold_with_feedback():
  params = learner.init_learner(jax.random.PRNGKey(0), CFG).params
  res = inference.evaluate(jax.random.PRNGKey(0), params, _stream(), CFG, default_hparams(),
                           OracleCritic())
  # Query 2: round 1 shows [0, 1] (both -1); round 2 moves to the unexplored gold m2, then the
  # diversity penalty keeps m3 (0.8 similar to m2) out: [2, 0] (worked out in test_explorer.py).
  np.testing.assert_array_equal(res.explorer_slates[1], [2, 0])
  assert bool(res.explorer_any_gold[1]) and not bool(res.adapter_any_gold[1])
  assert not bool(res.explorer_all_gold[1])
  assert not bool(res.explorer_all_gold[2])  # a gold memory outside the top-K is a miss


def test_metrics_are_safe_on_empty_sets():
  assert float(metrics.masked_mean(jnp.zeros(3), jnp.zeros(3, bool))) == 0.0
  assert not bool(metrics.slate_recall(jnp.int32(0), jnp.int32(0)))
