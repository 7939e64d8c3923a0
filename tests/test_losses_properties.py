"""Property tests of `ranking_loss` (Eq. (10)): its gradient w.r.t. the logits under random masks.

In float64 (enabled inside each test only), the autodiff gradient of both loss forms ('flat',
'sequential') matches central finite differences for random valid-candidate masks, slates of
distinct valid candidates with random empty positions, random labels, baselines and count masks.
Masked candidates get exactly zero gradient; shifting every valid logit by a constant changes
nothing (so the gradient sums to zero over them); an all-masked input gives a finite loss (0) and
a finite (zero) gradient. Shapes are fixed (K = 6, R = 3, s = 3), so each loss form compiles once.
"""
import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.core import losses

K, R, S = 6, 3, 3
EPS = 1e-6
SETTINGS = hypothesis.settings(max_examples=25, deadline=None, database=None,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])


@functools.lru_cache(maxsize=None)
def _evaluate(loss_form, with_count_mask):
  """One jitted function (call it under x64): loss, its gradient w.r.t. the logits, the central
  differences `(L(z + EPS e_i) - L(z - EPS e_i)) / 2 EPS` and the loss at `z + 0.75`."""
  def loss(z, where, slates, slate_mask, rewards, baseline, count_mask):
    return losses.ranking_loss(z, where, slates, slate_mask, rewards, baseline, loss_form,
                               count_mask if with_count_mask else None)

  def evaluate(z, *rest):
    value, grad = jax.value_and_grad(loss)(z, *rest)
    steps = EPS * jnp.concatenate([jnp.eye(K, dtype=z.dtype), -jnp.eye(K, dtype=z.dtype)])
    vals = jax.vmap(lambda dz: loss(z + dz, *rest))(steps)  # [2K]
    return value, grad, (vals[:K] - vals[K:]) / (2 * EPS), loss(z + 0.75, *rest)

  return jax.jit(evaluate)


def _run(loss_form, with_count_mask, *args):
  with jax.enable_x64(True):
    args = [jnp.asarray(a, jnp.float64) if np.asarray(a).dtype.kind == "f" else jnp.asarray(a)
            for a in args]
    out = _evaluate(loss_form, with_count_mask)(*args)
    return [np.asarray(x) for x in out]


@st.composite
def _cases(draw):
  """Valid candidates, R slates of distinct valid candidates (empty positions anywhere), labels."""
  where = np.array(draw(st.lists(st.booleans(), min_size=K, max_size=K)))
  valid = np.flatnonzero(where)
  slates = np.full((R, S), -1, np.int32)
  slate_mask = np.zeros((R, S), bool)
  for r in range(R):
    perm = draw(st.permutations(valid.tolist())) if valid.size else []
    keep = draw(st.lists(st.booleans(), min_size=S, max_size=S))
    for j, item in enumerate(perm[:S]):
      if keep[j]:
        slates[r, j], slate_mask[r, j] = item, True
  rewards = np.array(draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=R * S,
                                   max_size=R * S))).reshape(R, S)
  count_mask = np.array(draw(st.lists(st.booleans(), min_size=R * S,
                                      max_size=R * S))).reshape(R, S)
  baseline = draw(st.floats(-1.0, 1.0))
  logits = np.array(draw(st.lists(st.floats(-4.0, 4.0), min_size=K, max_size=K)))
  return logits, where, slates, slate_mask, rewards, baseline, count_mask


def _check_gradient(loss_form, with_count_mask, case):
  logits, where, slates, slate_mask, rewards, baseline, count_mask = case
  value, grad, fd, shifted = _run(loss_form, with_count_mask, logits, where, slates, slate_mask,
                                  rewards, np.float64(baseline), count_mask)
  assert grad.dtype == np.float64
  assert np.isfinite(value) and np.all(np.isfinite(grad))
  np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-7)
  assert np.all(grad[~where] == 0.0)  # masked candidates take no part in the softmax
  np.testing.assert_allclose(grad[where].sum(), 0.0, atol=1e-9)
  np.testing.assert_allclose(shifted, value, rtol=1e-9, atol=1e-12)
  counted = slate_mask & count_mask if with_count_mask else slate_mask
  if not counted.any():
    assert value == 0.0 and np.all(grad == 0.0)


@pytest.mark.parametrize("loss_form", ["flat", "sequential"])
@pytest.mark.parametrize("with_count_mask", [False, True], ids=["no_count_mask", "count_mask"])
@SETTINGS
@hypothesis.given(case=_cases())
def test_ranking_loss_gradient_matches_central_differences(loss_form, with_count_mask, case):
  _check_gradient(loss_form, with_count_mask, case)


@pytest.mark.parametrize("loss_form", ["flat", "sequential"])
def test_everything_masked_gives_zero_loss_and_zero_gradient(loss_form):
  logits = np.linspace(-3.0, 3.0, K)
  empty = (np.full((R, S), -1, np.int32), np.zeros((R, S), bool))
  full = (np.arange(R * S, dtype=np.int32).reshape(R, S) % K, np.ones((R, S), bool))
  cases = [(np.zeros(K, bool), empty, np.ones((R, S), bool)),  # no candidate, no slate item
           (np.ones(K, bool), empty, np.ones((R, S), bool)),  # candidates, empty slates
           (np.ones(K, bool), full, np.zeros((R, S), bool))]  # full slates, nothing counts
  for where, (slates, slate_mask), count_mask in cases:
    value, grad, fd, _ = _run(loss_form, True, logits, where, slates, slate_mask,
                              np.ones((R, S)), np.float64(0.3), count_mask)
    assert value == 0.0
    assert np.all(np.isfinite(grad)) and np.all(grad == 0.0) and np.all(fd == 0.0)
