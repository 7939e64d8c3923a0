"""Paging, explorer-assisted inference's test-time baseline (`retrieval.paging_slate`)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.core import guard, inference, learner, retrieval
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.core.critic import OracleCritic
from ear_jax.core.slates import top_s_slate
from ear_jax.core.stream import make_stream

jit_paging = jax.jit(retrieval.paging_slate, static_argnums=(3, 4, 5))
jit_evaluate = jax.jit(inference.evaluate, static_argnames=("config",))
# Relevance of 6 candidates: ranking 4, 1, 5, 0, 2, 3.
Z = jnp.asarray([0.3, 0.8, 0.2, 0.1, 0.9, 0.5], jnp.float32)
RANKING = [4, 1, 5, 0, 2, 3]


@functools.partial(jax.jit, static_argnums=(3, 4))
def _paging_citing(relevance, where, items, num_pages, slate_size):
  """`paging_slate` with a critic citing exactly the candidates `items` ([2] int32, -1 = none)."""

  def feedback(key, slate, slate_mask):
    del key
    return jnp.where(jnp.isin(slate, items) & slate_mask, 1.0, -1.0)

  return retrieval.paging_slate(jax.random.PRNGKey(0), relevance, where, feedback, num_pages,
                                slate_size)


def _citing(relevance, where, items, num_pages, slate_size):
  items = jnp.asarray(list(items) + [-1] * (2 - len(items)), jnp.int32)
  return _paging_citing(relevance, where, items, num_pages, slate_size)


def test_pages_are_the_ranking_consecutive_blocks_and_cited_items_come_first():
  out = _citing(Z, jnp.ones(6, bool), [5, 0], 2, 2)
  np.testing.assert_array_equal(out.pages, [RANKING[0:2], RANKING[2:4]])
  assert bool(out.page_mask.all())
  np.testing.assert_array_equal(out.labels, [[-1, -1], [1, 1]])
  # Cited 5 (rank 2) and 0 (rank 3) first, in ranking order; nothing else fits in s = 2.
  np.testing.assert_array_equal(out.slate, [5, 0])
  out3 = _citing(Z, jnp.ones(6, bool), [0], 2, 3)
  # T s = 6 ranks shown; cited 0 first, then the ranking's top (4, 1).
  np.testing.assert_array_equal(out3.pages, [RANKING[0:3], RANKING[3:6]])
  np.testing.assert_array_equal(out3.slate, [0, 4, 1])


def test_with_nothing_cited_the_answer_is_the_ranking_top_s():
  where = jnp.asarray([True, True, False, True, True, True])
  out = _citing(Z, where, [], 2, 3)
  want, want_mask = top_s_slate(Z, where, 3)
  np.testing.assert_array_equal(out.slate, want)
  np.testing.assert_array_equal(out.slate_mask, want_mask)


def test_a_cited_item_outside_the_shown_pages_does_not_count():
  # Only the top T s = 2 ranks (4, 1) are shown; candidate 3 (last) is never shown, never cited.
  out = _citing(Z, jnp.ones(6, bool), [3, 1], 1, 2)
  np.testing.assert_array_equal(out.pages, [[4, 1]])
  np.testing.assert_array_equal(out.slate, [1, 4])


def test_masked_and_short_candidate_lists_give_empty_positions():
  where = jnp.asarray([False, True, False, True, False, True])  # valid by rank: 1, 5, 3
  out = _citing(Z, where, [3, 0], 3, 2)
  np.testing.assert_array_equal(out.pages, [[1, 5], [3, -1], [-1, -1]])
  np.testing.assert_array_equal(out.page_mask, [[True, True], [True, False], [False, False]])
  np.testing.assert_array_equal(out.labels, [[-1, -1], [1, -1], [-1, -1]])  # 0 is masked out
  np.testing.assert_array_equal(out.slate, [3, 1])
  # T s > K (8 > 6 ranks): the pages hold every valid candidate once, then empty positions.
  out = _citing(Z, where, [5], 4, 2)
  np.testing.assert_array_equal(out.pages.reshape(-1), [1, 5, 3, -1, -1, -1, -1, -1])
  np.testing.assert_array_equal(out.slate, [5, 1])
  none = _citing(Z, jnp.zeros(6, bool), [1], 2, 2)
  np.testing.assert_array_equal(none.slate, [-1, -1])
  assert not bool(none.slate_mask.any()) and not bool(none.page_mask.any())


def _by_key(key, slate, slate_mask):
  """Critic labels that depend on the key only (which key each page gets)."""
  del slate
  return jnp.where((jax.random.uniform(key, slate_mask.shape) < 0.5) & slate_mask, 1.0, -1.0)


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
def test_page_t_gets_the_key_of_explorer_round_t_and_jit_equals_eager():
  key, where = jax.random.PRNGKey(7), jnp.asarray([True, True, True, False, True, True])
  eager = retrieval.paging_slate(key, Z, where, _by_key, 3, 2)
  jitted = jit_paging(key, Z, where, _by_key, 3, 2)
  for a, b in zip(eager, jitted):
    np.testing.assert_array_equal(a, b)
  want = jax.vmap(_by_key)(jax.random.split(key, 3), eager.pages, eager.page_mask)
  np.testing.assert_array_equal(eager.labels, want)
  assert bool((eager.labels > 0).any())  # the case cites something: the order is exercised
  jit_paging(jax.random.PRNGKey(4), Z + 1.0, where, _by_key, 3, 2)
  assert jit_paging._cache_size() == 1  # pylint: disable=protected-access


CFG = EARConfig.for_method("ear", dim=2, num_candidates=4, slate_size=2, num_rounds=2)
M = np.array([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])


def _stream():
  gold = np.array([[False, True, False, False],   # gold at rank 1: paging answers [1, 0]
                   [False, False, True, True],    # both gold on page 2: [2, 3]
                   [True, False, False, False]])  # one gold in the top-K, one outside it
  return make_stream(np.tile([1.0, 0.0], (3, 1)), np.tile(M, (3, 1, 1)), None, gold,
                     num_gold=np.array([1, 2, 2]))


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
def test_evaluate_pages_the_first_stage_and_the_served_ranking_hand_computed():
  params = learner.init_learner(jax.random.PRNGKey(0), CFG).params
  res = jit_evaluate(jax.random.PRNGKey(0), params, _stream(), CFG, default_hparams(),
                     OracleCritic())
  want = [[1, 0], [2, 3], [0, 1]]
  np.testing.assert_array_equal(res.paging_first_stage_slates, want)
  np.testing.assert_array_equal(res.paging_adapted_slates, want)  # the untrained adapter
  np.testing.assert_array_equal(res.paging_first_stage_all_gold, [True, True, False])
  np.testing.assert_array_equal(res.paging_first_stage_any_gold, [True, True, True])
  np.testing.assert_allclose(res.recall_paging_first_stage, 2 / 3, rtol=1e-6)
  np.testing.assert_allclose(res.hitrate_paging_adapted, 1.0, rtol=1e-6)
  # A served adapter that ranks the candidates backwards (3, 2, 1, 0): paging over the first stage
  # is unchanged, paging over the served ranking shows the pages [3, 2], [1, 0].
  backwards = params.replace(w_m=jnp.asarray([[0.0, 1.0], [1.0, 0.0]]) - jnp.eye(2))  # z = m_2
  rev = jit_evaluate(jax.random.PRNGKey(0), backwards, _stream(), CFG, default_hparams(),
                     OracleCritic())
  np.testing.assert_array_equal(rev.paging_first_stage_slates, want)
  np.testing.assert_array_equal(rev.paging_adapted_slates, [[1, 3], [3, 2], [0, 3]])


def test_evaluate_refuses_side_weights_the_config_does_not_have_naming_them():
  cfg = EARConfig(dim=2, num_candidates=4, slate_size=2, num_rounds=2, side_features=3)
  params = guard.first_stage_params(cfg)
  feats = np.zeros((3, 4, 3), np.float32)
  s = make_stream(np.tile([1.0, 0.0], (3, 1)), np.tile(M, (3, 1, 1)), None,
                  np.zeros((3, 4), bool), features=feats)
  with pytest.raises(ValueError, match="side_features"):
    inference.evaluate(jax.random.PRNGKey(0), params, s, dataclasses.replace(cfg, side_features=0),
                       default_hparams())
