"""Eq. (3)-(4): the residual adapter and the relevance distribution."""
import jax
import pytest
import jax.numpy as jnp
import numpy as np

from ear_jax.core import adapter
from ear_jax.core.config import EARConfig


def test_identity_init_leaves_embeddings_unchanged():
  cfg = EARConfig(dim=3, num_candidates=2, slate_size=1)
  p = adapter.init_adapter(jax.random.PRNGKey(0), cfg)
  q = jnp.array([0.6, 0.8, 0.0])
  np.testing.assert_allclose(adapter.adapt_queries(p, q), q, atol=1e-7)


def test_residual_adapter_hand_computed():
  # W_q = [[0,1],[0,0]]: (I+W) [1, 1] = [2, 1] -> [2, 1] / sqrt(5).
  p = adapter.AdapterParams(w_q=jnp.array([[0.0, 1.0], [0.0, 0.0]]), w_m=jnp.zeros((2, 2)))
  out = adapter.adapt_queries(p, jnp.array([1.0, 1.0]))
  np.testing.assert_allclose(out, np.array([2.0, 1.0]) / np.sqrt(5.0), rtol=1e-6)
  # memories use W_m: identity here.
  m = adapter.adapt_memories(p, jnp.array([[3.0, 4.0]]))
  np.testing.assert_allclose(m, [[0.6, 0.8]], rtol=1e-6)


def test_relevance_probabilities_hand_computed():
  z = adapter.relevance_logits(jnp.array([1.0, 0.0]), jnp.array([[1.0, 0.0], [0.0, 1.0],
                                                                 [0.6, 0.8]]))
  np.testing.assert_allclose(z, [1.0, 0.0, 0.6], atol=1e-7)
  lp = adapter.relevance_log_probs(z, jnp.array([True, True, False]))
  # softmax over the two valid ones: e / (e + 1), 1 / (e + 1).
  np.testing.assert_allclose(jnp.exp(lp[:2]), [np.e / (np.e + 1), 1 / (np.e + 1)], rtol=1e-6)
  assert float(jnp.exp(lp[2])) == 0.0


def test_zero_vector_normalizes_to_zero_with_finite_gradient():
  p = adapter.AdapterParams(w_q=jnp.zeros((3, 3)), w_m=jnp.zeros((3, 3)))
  out = adapter.adapt_queries(p, jnp.zeros(3))
  assert np.all(np.asarray(out) == 0)
  g = jax.grad(lambda pp: jnp.sum(adapter.adapter_scores(pp, jnp.zeros(3), jnp.zeros((2, 3)))))(p)
  assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(g))


def test_all_masked_log_probs_are_finite():
  lp = adapter.relevance_log_probs(jnp.array([0.3, -0.2]), jnp.array([False, False]))
  assert np.all(np.isfinite(np.asarray(lp)))


def test_jit_and_vmap_agree_with_plain_calls():
  rng = np.random.default_rng(1)
  p = adapter.AdapterParams(w_q=rng.normal(size=(4, 4)) * 0.1, w_m=rng.normal(size=(4, 4)) * 0.1)
  qs, ms = rng.normal(size=(3, 4)), rng.normal(size=(3, 5, 4))
  batched = jax.vmap(adapter.adapter_scores, in_axes=(None, 0, 0))(p, qs, ms)
  jitted = jax.jit(adapter.adapter_scores)
  for i in range(3):
    np.testing.assert_allclose(batched[i], adapter.adapter_scores(p, qs[i], ms[i]), rtol=1e-5)
    np.testing.assert_allclose(jitted(p, qs[i], ms[i]), batched[i], rtol=1e-5)
