"""Whole episodes (Alg. 1 / Alg. 3): jit, scan, vmap over seeds and hyperparameters, learning."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.core import episode, inference, learner
from ear_jax.core.config import EARConfig, default_hparams, stack_hparams
from ear_jax.core.stream import make_stream
from tests.core_utils import close_or_equal, learnable_stream

jit_run_episode = jax.jit(episode.run_episode, static_argnames=("config",))
jit_train_stream = jax.jit(episode.train_stream, static_argnames=("config",))
jit_evaluate = jax.jit(inference.evaluate, static_argnames=("config",))
jit_train_batch = jax.jit(learner.train_batch, static_argnames=("config",))
jit_train_batch_on_feedback = jax.jit(learner.train_batch_on_feedback,
                                      static_argnames=("config",))

CFG = EARConfig.for_method("ear", dim=16, num_candidates=8, slate_size=2, num_rounds=3,
                           replay_size=2, buffer_capacity=64, batch_size=4)
HP = default_hparams(learning_rate=3e-3)
TRAIN = learnable_stream(0, 42)  # not a multiple of the batch size: the last batch is padded


@pytest.mark.slow
def test_jit_does_not_retrace_on_a_second_call():
  traces = []

  def ep(key, stream):
    traces.append(1)
    return episode.run_episode(key, stream, CFG, HP)

  f = jax.jit(ep)
  jax.block_until_ready(f(jax.random.PRNGKey(0), TRAIN))
  jax.block_until_ready(f(jax.random.PRNGKey(1), TRAIN))
  assert len(traces) == 1


@pytest.mark.slow
def test_same_key_identical_different_keys_differ():
  a = jit_run_episode(jax.random.PRNGKey(0), TRAIN, CFG, HP)
  b = jit_run_episode(jax.random.PRNGKey(0), TRAIN, CFG, HP)
  c = jit_run_episode(jax.random.PRNGKey(1), TRAIN, CFG, HP)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(a[1].labels, c[1].labels)
  assert not np.array_equal(a[0].params.w_q, c[0].params.w_q)


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
def test_records_and_counters():
  state, rec = jit_run_episode(jax.random.PRNGKey(0), TRAIN, CFG, HP)
  assert rec.slates.shape == (42, 3, 2) and rec.loss.shape == (42,)
  assert int(state.queries_seen) == 42 and int(state.critic_calls) == 42 * 3
  assert int(state.step) == 11 and int(state.buffer.num_pushed) == 42
  assert np.all(np.isfinite(rec.loss))
  assert int(rec.num_replayed[0]) == 0 and int(rec.num_replayed[-1]) == 2  # empty buffer first


@pytest.mark.slow
def test_vmap_over_three_seeds_equals_a_loop():
  keys = jax.random.split(jax.random.PRNGKey(7), 3)
  f = jax.jit(jax.vmap(episode.run_episode, in_axes=(0, None, None, None)),
              static_argnums=(2,))
  vs, vr = f(keys, TRAIN, CFG, HP)
  for i in range(3):
    s, r = jit_run_episode(keys[i], TRAIN, CFG, HP)
    np.testing.assert_array_equal(vr.slates[i], r.slates)
    np.testing.assert_array_equal(vr.labels[i], r.labels)
    np.testing.assert_allclose(vs.params.w_q[i], s.params.w_q, atol=1e-5)
    np.testing.assert_allclose(vs.params.w_m[i], s.params.w_m, atol=1e-5)


@pytest.mark.slow
def test_vmap_over_hyperparameters_equals_a_loop():
  hps = [default_hparams(learning_rate=lr, alpha=a) for lr, a in ((1e-3, 0.5), (1e-2, 1.0))]
  f = jax.jit(jax.vmap(episode.run_episode, in_axes=(None, None, None, 0)), static_argnums=(2,))
  vs, vr = f(jax.random.PRNGKey(3), TRAIN, CFG, stack_hparams(hps))
  for i, hp in enumerate(hps):
    s, r = jit_run_episode(jax.random.PRNGKey(3), TRAIN, CFG, hp)
    np.testing.assert_array_equal(vr.slates[i], r.slates)
    np.testing.assert_allclose(vs.params.w_q[i], s.params.w_q, atol=1e-5)


@pytest.mark.slow
def test_chunked_training_equals_one_scan():
  k_init, keys = episode.episode_keys(jax.random.PRNGKey(5), 42)
  full, _ = jit_train_stream(learner.init_learner(k_init, CFG), keys, TRAIN, CFG, HP)
  state = learner.init_learner(k_init, CFG)
  for start, stop in ((0, 16), (16, 32), (32, 42)):
    state, _ = jit_train_stream(state, keys[start:stop], TRAIN.take(slice(start, stop)),
                                CFG, HP)
  for x, y in zip(jax.tree_util.tree_leaves(full), jax.tree_util.tree_leaves(state)):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("method", ["ear"] + [pytest.param(m, marks=pytest.mark.slow) for m in
                                             ("rl_update", "ear_no_replay", "ear_no_explorer")])
def test_zero_vectors_and_masked_candidates_give_finite_losses_and_params(method):
  cfg = EARConfig.for_method(method, dim=4, num_candidates=4, slate_size=2, num_rounds=2,
                             replay_size=2, buffer_capacity=8, batch_size=2)
  mask = np.array([[True] * 4, [False] * 4, [True, False, False, False], [True] * 4])
  stream = make_stream(np.zeros((4, 4)), np.zeros((4, 4, 4)), mask, np.zeros((4, 4), bool))
  state, rec = jit_run_episode(jax.random.PRNGKey(0), stream, cfg, HP)
  assert np.all(np.isfinite(rec.loss))
  assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(state.params))
  assert not bool(rec.slate_mask[1].any())  # the all-masked query gets an empty slate


def test_untrained_method_leaves_the_state_unchanged():
  cfg = EARConfig.for_method("retriever", dim=16, num_candidates=8, slate_size=2)
  state, rec = jit_run_episode(jax.random.PRNGKey(0), TRAIN, cfg, HP)
  assert rec is None and float(jnp.abs(state.params.w_q).sum()) == 0.0


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
def test_ear_learns_a_learnable_stream():
  train, test = learnable_stream(1, 400), learnable_stream(2, 200)
  cfg = dataclasses.replace(CFG, buffer_capacity=512)
  hp = default_hparams(learning_rate=1e-2)
  untrained = learner.init_learner(jax.random.PRNGKey(0), cfg)
  state, _ = jit_run_episode(jax.random.PRNGKey(0), train, cfg, hp)
  before = jit_evaluate(jax.random.PRNGKey(9), untrained.params, test, cfg, hp)
  after = jit_evaluate(jax.random.PRNGKey(9), state.params, test, cfg, hp)
  assert float(before.recall_adapter) < 0.1  # frozen cosine prefers the distractors
  assert float(after.recall_adapter) > float(before.recall_adapter) + 0.3
  assert float(after.hitrate_adapter) > float(before.hitrate_adapter) + 0.3


def test_train_batch_on_feedback_equals_train_batch_with_the_same_labels():
  state = learner.init_learner(jax.random.PRNGKey(0), CFG)
  keys = jax.random.split(jax.random.PRNGKey(1), 4)
  batch, where = TRAIN.take(slice(0, 4)), jnp.ones(4, bool)
  s1, r1 = jit_train_batch(state, keys, batch, where, CFG, HP)
  # Same replay keys: train_batch splits each query key into (train, replay).
  replay_keys = jax.vmap(lambda k: jax.random.split(k)[1])(keys)
  s2, r2 = jit_train_batch_on_feedback(state, replay_keys, batch, r1.slates,
                                       r1.slate_mask, r1.labels, where, CFG, HP)
  np.testing.assert_allclose(s1.params.w_q, s2.params.w_q, atol=1e-6)
  np.testing.assert_allclose(r1.loss, r2.loss, atol=1e-6)


@pytest.mark.slow
def test_masked_queries_are_padding_and_an_all_padding_batch_is_a_no_op():
  k_init, keys = episode.episode_keys(jax.random.PRNGKey(5), 16)
  stream = TRAIN.take(slice(0, 16))
  where = jnp.arange(16) < 8  # batches 3 and 4 hold no real query
  init = learner.init_learner(k_init, CFG)
  masked, rec = jit_train_stream(init, keys, stream, CFG, HP, where=where)
  # What the padding holds changes nothing, bit for bit (the same program).
  other = TRAIN.take(slice(16, 32))
  mixed = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a[:8], b[8:]]), stream, other)
  again, _ = jit_train_stream(init, keys, mixed, CFG, HP, where=where)
  for x, y in zip(jax.tree_util.tree_leaves(masked), jax.tree_util.tree_leaves(again)):
    np.testing.assert_array_equal(x, y)
  # And it equals training on the 8 real queries alone (another program: up to float rounding).
  head, _ = jit_train_stream(init, keys[:8], stream.take(slice(0, 8)), CFG, HP)
  for x, y in zip(jax.tree_util.tree_leaves(masked), jax.tree_util.tree_leaves(head)):
    close_or_equal(x, y, rtol=1e-5, atol=1e-8)
  assert int(masked.step) == 2 and int(masked.buffer.num_pushed) == 8
  assert not np.asarray(rec.slate_mask[8:]).any() and np.all(np.asarray(rec.loss[8:]) == 0)
