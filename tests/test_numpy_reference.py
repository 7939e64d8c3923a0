"""The JAX training step equals an independent NumPy implementation on identical random draws."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.core import learner
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.core.stream import make_stream
from tests import numpy_reference as ref

D, K = 8, 6


def _stream(seed, n):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(n, D))
  c = rng.normal(size=(n, K, D))
  mask = np.ones((n, K), bool)
  mask[1, 4:] = False  # a bank smaller than K
  gold = (rng.random((n, K)) < 0.35) & mask
  gold[:, 0] |= True
  return make_stream(q / np.linalg.norm(q, axis=-1, keepdims=True),
                     c / np.linalg.norm(c, axis=-1, keepdims=True), mask, gold)


def _run_both(config, hparams, num_batches=4, seed=0):
  b = config.batch_size
  stream = _stream(seed, b * num_batches)
  keys = jax.random.split(jax.random.PRNGKey(seed), b * num_batches)
  state = learner.init_learner(jax.random.PRNGKey(99), config)
  np_state = ref.init_numpy_state(config)
  hp = ref.hp_dict(hparams)
  step = jax.jit(learner.train_batch, static_argnames=("config",))
  for i in range(num_batches):
    sl = slice(i * b, (i + 1) * b)
    batch = stream.take(sl)
    state, rec = step(state, keys[sl], batch, jnp.ones((b,), bool), config, hparams)
    rnds = [ref.draw_randoms(k, config) for k in keys[sl]]
    np_state, outs = ref.numpy_train_batch(
        np_state, {f: np.asarray(getattr(batch, f), np.float64 if f in ("queries", "candidates")
                                 else None) for f in ("queries", "candidates", "mask", "gold")},
        rnds, config, hp)
    for j, o in enumerate(outs):
      jax_slates = np.asarray(rec.slates[j])
      jax_mask = np.asarray(rec.slate_mask[j])
      for r, slate in enumerate(o["slates"]):
        assert list(jax_slates[r][jax_mask[r]]) == list(slate), (i, j, r)
        np.testing.assert_array_equal(np.asarray(rec.labels[j, r])[jax_mask[r]], o["labels"][r])
      np.testing.assert_allclose(float(rec.loss_cur[j]), o["loss_cur"], atol=1e-5)
      np.testing.assert_allclose(float(rec.loss_rep[j]), o["loss_rep"], atol=1e-5)
    np.testing.assert_allclose(np.asarray(state.params.w_q), np_state["wq"], atol=1e-5)
    np.testing.assert_allclose(np.asarray(state.params.w_m), np_state["wm"], atol=1e-5)
  assert int(state.buffer.num_pushed) == b * num_batches
  return state, np_state


BASE = dict(dim=D, num_candidates=K, slate_size=3, num_rounds=3, replay_size=2,
            buffer_capacity=5, batch_size=2)


@pytest.mark.parametrize("overrides", [
    {},
    pytest.param({"loss_form": "sequential"}, marks=pytest.mark.slow),
    pytest.param({"replay_unobserved": "ignore"}, marks=pytest.mark.slow),
    pytest.param({"replay_strategy": "reward"}, marks=pytest.mark.slow),
    pytest.param({"replay_strategy": "random"}, marks=pytest.mark.slow),
    pytest.param({"optimizer": "sgd"}, marks=pytest.mark.slow),
], ids=["ear", "sequential", "ignore", "reward", "random", "sgd"])
def test_ear_step_matches_numpy(overrides):
  config = EARConfig.for_method("ear", **{**BASE, **overrides})
  # A large learning rate so that parameter differences would show.
  _run_both(config, default_hparams(learning_rate=0.05))


@pytest.mark.parametrize("loss_support", ["window", "labelled", "auto"])
def test_loss_support_beyond_the_rounds_window_matches_numpy(loss_support):
  # K = 6 > T s = 2 x 2 = 4: the window leaves the never-shown tail out of the softmax.
  config = EARConfig.for_method("ear", **{**BASE, "slate_size": 2, "num_rounds": 2,
                                          "loss_support": loss_support})
  _run_both(config, default_hparams(learning_rate=0.05))


@pytest.mark.parametrize("method", ["rl_update",
                                    pytest.param("ear_no_explorer", marks=pytest.mark.slow),
                                    pytest.param("ear_no_replay", marks=pytest.mark.slow)])
def test_baseline_steps_match_numpy(method):
  config = EARConfig.for_method(method, **BASE)
  _run_both(config, default_hparams(learning_rate=0.05))


def test_numpy_reference_sees_a_nonzero_update():
  config = EARConfig.for_method("ear", **BASE)
  state, np_state = _run_both(config, default_hparams(learning_rate=0.05), num_batches=2)
  assert np.abs(np_state["wq"]).max() > 1e-3 and np.abs(np_state["wm"]).max() > 1e-3
