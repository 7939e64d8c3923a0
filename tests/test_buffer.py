"""Eq. (13)-(15), Table 7: the Experience Buffer."""
import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import buffer
from ear_jax.core.config import EARConfig

CFG = EARConfig(dim=2, num_candidates=2, slate_size=1, buffer_capacity=3, replay_size=2,
                batch_size=2)


def _push(buf, ids, where=None):
  ids = np.asarray(ids, np.float32)
  n = len(ids)
  q = np.stack([ids, np.ones(n)], -1).astype(np.float32)
  return buffer.push_experiences(
      buf, jnp.asarray(q), jnp.zeros((n, 2, 2)), jnp.ones((n, 2), bool), jnp.ones((n, 2), bool),
      jnp.asarray(np.stack([ids, ids], -1)), jnp.ones(n, bool) if where is None else where)


def test_wrap_around_keeps_exactly_the_newest_capacity_experiences():
  buf = buffer.init_buffer(CFG)
  for i in range(5):
    buf = _push(buf, [i])
  assert int(buf.num_pushed) == 5 and int(buf.insert_index) == 2
  assert sorted(np.asarray(buf.queries[:, 0]).tolist()) == [2.0, 3.0, 4.0]
  assert bool(buf.valid.all())


def test_batch_push_skips_padding_rows_and_keeps_order():
  buf = buffer.init_buffer(CFG)
  buf = _push(buf, [7, 8], where=jnp.array([True, False]))
  assert int(buf.num_pushed) == 1 and list(np.asarray(buf.valid)) == [True, False, False]
  buf = _push(buf, [9, 10])
  buf = _push(buf, [11, 12])  # slots: 7 -> 0, 9 -> 1, 10 -> 2, 11 -> 0, 12 -> 1
  np.testing.assert_array_equal(np.asarray(buf.queries[:, 0]), [11, 12, 10])
  assert int(buf.insert_index) == 2 and int(buf.num_pushed) == 5


def test_similarity_replay_picks_the_most_similar_and_fewer_when_fewer():
  buf = buffer.init_buffer(CFG)
  buf = _push(buf, [1])
  idx, mask = buffer.select_replay(jax.random.PRNGKey(0), buf, jnp.array([1.0, 0.0]), 2,
                                   buffer.similarity_replay)
  assert list(np.asarray(mask)) == [True, False] and int(idx[0]) == 0
  buf = _push(buf, [5, -3])
  idx, mask = buffer.select_replay(jax.random.PRNGKey(0), buf, jnp.array([1.0, 0.0]), 2,
                                   buffer.similarity_replay)
  assert bool(mask.all()) and list(np.asarray(buf.queries[idx, 0])) == [5.0, 1.0]


def test_reward_replay_picks_the_lowest_mean_reward():
  buf = _push(buffer.init_buffer(CFG), [0.5, -1.0, 0.25])
  idx, mask = buffer.select_replay(jax.random.PRNGKey(0), buf, jnp.zeros(2), 2, buffer.reward_replay)
  assert list(np.asarray(buf.ybar[idx, 0])) == [-1.0, 0.25]


def test_random_replay_draws_valid_experiences_by_key():
  cfg = EARConfig(dim=2, num_candidates=2, slate_size=1, buffer_capacity=8, replay_size=2)
  buf = _push(buffer.init_buffer(cfg), [1, 2, 3, 4, 5])
  picks = set()
  for i in range(20):
    idx, mask = buffer.select_replay(jax.random.PRNGKey(i), buf, jnp.zeros(2), 2, buffer.random_replay)
    assert bool(mask.all()) and bool(buf.valid[idx].all())
    picks.add(tuple(np.asarray(idx)))
  assert len(picks) > 1


def test_empty_buffer_replays_nothing():
  idx, mask = buffer.select_replay(jax.random.PRNGKey(0), buffer.init_buffer(CFG),
                                   jnp.ones(2), 2, buffer.similarity_replay)
  assert not bool(mask.any())


def _newest_replay(key, buf, query):
  """A user-defined strategy: replay the most recently pushed experiences."""
  del key, query
  capacity = buf.valid.shape[0]
  age = (buf.insert_index - 1 - jnp.arange(capacity)) % capacity
  return -age.astype(jnp.float32)


def test_a_new_replay_strategy_is_one_function_and_one_registry_line(monkeypatch):
  from ear_jax.core import config as config_lib
  monkeypatch.setitem(buffer.REPLAY_STRATEGIES, "newest", _newest_replay)
  cfg = config_lib.EARConfig.for_method("ear", dim=2, num_candidates=3, replay_size=2,
                                        buffer_capacity=4, slate_size=2)
  assert cfg.to_dict()["replay_strategy"] == "similarity"  # the paper's Eq. (15) by default
  cfg = config_lib.EARConfig.for_method("ear", dim=2, num_candidates=3, replay_size=2,
                                        buffer_capacity=4, slate_size=2, replay_strategy="newest")
  assert buffer.replay_strategy(cfg.replay_strategy) is _newest_replay
  assert cfg.to_dict()["replay_strategy"] == "newest"
  buf = buffer.init_buffer(cfg)
  for i in range(3):
    q = jnp.eye(2)[i % 2][None]
    buf = buffer.push_experiences(buf, q, jnp.zeros((1, 3, 2)), jnp.ones((1, 3), bool),
                                  jnp.zeros((1, 3), bool), jnp.zeros((1, 3)), jnp.ones(1, bool))
  idx, mask = buffer.select_replay(jax.random.PRNGKey(0), buf, jnp.ones(2), 2, cfg.replay_strategy)
  assert mask.tolist() == [True, True]
  assert idx.tolist() == [2, 1]  # the newest two slots, newest first
