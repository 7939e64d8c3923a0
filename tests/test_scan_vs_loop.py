"""The `scan` path (jitted `run_episode`) and a Python loop over jitted `train_batch` do equal work.

`experiments.bench` compares their speed; this checks that they compute the same thing: the same
slates, labels and buffer, and the same parameters after the same stream.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.core_utils import learnable_stream

import ear_jax as ej
from ear_jax.core import episode
from ear_jax.core import learner
from ear_jax.core import stream as stream_lib

jit_train_batch = jax.jit(learner.train_batch, static_argnames=("config",))
jit_run_episode = jax.jit(episode.run_episode, static_argnames=("config",))


def _loop(key, stream, config, hparams):
  n, b = stream.queries.shape[0], config.batch_size
  k_init, keys = episode.episode_keys(key, n)
  state = learner.init_learner(k_init, config)
  records = []
  for start in range(0, n, b):
    idx = np.minimum(np.arange(start, start + b), n - 1)
    where = jnp.asarray(np.arange(start, start + b) < n)
    batch = jax.tree_util.tree_map(lambda x: x[idx], stream)
    state, rec = jit_train_batch(state, keys[idx], batch, where, config, hparams)
    records.append(jax.tree_util.tree_map(np.asarray, rec))
  records = jax.tree_util.tree_map(lambda *r: np.concatenate(r)[:n], *records)
  return state, records


def _check(config, n=30, seed=0):
  stream = stream_lib.to_device(learnable_stream(seed, n, d=config.dim,
                                                k=config.num_candidates, num_valid=6))
  hparams = ej.default_hparams()
  key = jax.random.PRNGKey(seed)
  scan_state, scan_rec = jit_run_episode(key, stream, config, hparams)
  loop_state, loop_rec = _loop(key, stream, config, hparams)
  np.testing.assert_array_equal(scan_rec.slates, loop_rec.slates)
  np.testing.assert_array_equal(scan_rec.labels, loop_rec.labels)
  np.testing.assert_array_equal(scan_rec.num_replayed, loop_rec.num_replayed)
  np.testing.assert_allclose(scan_rec.loss, loop_rec.loss, atol=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(scan_state.params),
                  jax.tree_util.tree_leaves(loop_state.params)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  for a, b in zip(jax.tree_util.tree_leaves(scan_state.buffer),
                  jax.tree_util.tree_leaves(loop_state.buffer)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  assert int(scan_state.step) == int(loop_state.step) == -(-n // config.batch_size)
  assert float(jnp.max(jnp.abs(scan_state.params.w_m))) > 0  # it did learn something


@pytest.mark.slow
def test_scan_and_loop_give_identical_params_for_ear():
  _check(ej.EARConfig(dim=16, num_candidates=8, slate_size=3, num_rounds=2, replay_size=2,
                      buffer_capacity=64, batch_size=4))


@pytest.mark.slow
def test_scan_and_loop_agree_with_a_padded_last_batch_and_a_full_buffer():
  # 30 queries in batches of 4 (last batch padded); capacity 8 (the ring buffer wraps around).
  _check(ej.EARConfig(dim=16, num_candidates=8, slate_size=3, num_rounds=2, replay_size=2,
                      buffer_capacity=8, batch_size=4), n=30, seed=1)
