"""`experiment.supervised`: the adapter fitted on gold labels, and `--suite=headroom`."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.core import adapter as adapter_lib
from ear_jax.core import config as config_lib
from ear_jax.core.stream import make_stream
from ear_jax.experiment import supervised


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _stream(n=64, k=6, d=8, seed=0, features=False):
  """Queries whose gold candidate is the one closest to `M q` (M a fixed rotation): the identity
  adapter ranks by `q . m`, which a learned W_q can fix; gold is candidate 0 of every query."""
  m = _unit(np.random.default_rng(100).normal(size=(d, d)))  # the same map for every stream
  rng = np.random.default_rng(seed)
  q = _unit(rng.normal(size=(n, d)))
  c = _unit(rng.normal(size=(n, k, d)))
  c[:, 0] = _unit(q @ m.T + 0.05 * rng.normal(size=(n, d)))
  gold = np.zeros((n, k), bool)
  gold[:, 0] = True
  mask = np.ones((n, k), bool)
  mask[: n // 4, -1] = False
  f = rng.normal(size=(n, k, 3)).astype(np.float32) if features else None
  return make_stream(q, c, mask=mask, gold=gold, features=f)


def _config(d=8, k=6, side=0):
  return config_lib.EARConfig(dim=d, num_candidates=k, slate_size=1,
                              side_features=side)


def test_recall_at_counts_queries_with_all_their_gold_in_the_top_s():
  s = make_stream(np.eye(2, 3, dtype=np.float32),
                  np.asarray([[[1, 0, 0], [0, 1, 0], [0, 0, 1]],
                              [[1, 0, 0], [0, 1, 0], [0, 0, 1]]], np.float32),
                  gold=np.asarray([[True, False, False], [True, True, False]]))
  p = adapter_lib.init_adapter(jax.random.PRNGKey(0), config_lib.EARConfig(dim=3, num_candidates=3, slate_size=1))
  # Query 0's gold (candidate 0) is its best; query 1 has two gold, only one fits a slate of 1.
  assert float(supervised.recall_at(p, s, 1)) == pytest.approx(0.5)
  assert float(supervised.recall_at(p, s, 2)) == pytest.approx(1.0)
  # A gold memory outside the candidates (num_gold) is a miss.
  s2 = s.replace(num_gold=np.asarray([2, 2], np.int32))
  assert float(supervised.recall_at(p, s2, 3)) == pytest.approx(0.5)


def test_listwise_loss_is_the_mean_gold_log_softmax_over_valid_candidates():
  q = np.asarray([[1.0, 0.0]], np.float32)
  c = np.asarray([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]], np.float32)
  where = np.asarray([[True, True, False]])
  gold = np.asarray([[False, True, True]])  # the masked gold is left out
  p = adapter_lib.init_adapter(jax.random.PRNGKey(0), config_lib.EARConfig(dim=2, num_candidates=3, slate_size=1))
  beta = 2.0
  z = np.asarray([1.0, 0.0]) * beta
  want = -(z[1] - np.log(np.exp(z).sum()))
  got = supervised.listwise_loss(p, q, c, where, gold, jnp.float32(beta))
  assert float(got) == pytest.approx(want, rel=1e-5)
  # A batch with no gold gives 0 (a safe mean), with finite gradients.
  none = np.zeros_like(gold)
  assert float(supervised.listwise_loss(p, q, c, where, none, jnp.float32(beta))) == 0.0
  g = jax.grad(supervised.listwise_loss)(p, q, c, where, none, jnp.float32(beta))
  assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(g))


def test_fit_learns_a_rotation_the_first_stage_cannot_see_and_generalises():
  train, test = _stream(seed=0), _stream(n=32, seed=1)
  p0 = adapter_lib.init_adapter(jax.random.PRNGKey(0), _config())
  c = jax.jit(lambda k: supervised.fit(k, p0, train, test, learning_rate=3e-2, beta=8.0,
                                       steps=200, batch_size=16, eval_every=50,
                                       slate_size=1))(jax.random.PRNGKey(1))
  assert c.fitted.shape == c.held_out.shape == (5,)
  np.testing.assert_allclose(c.held_out[0], supervised.recall_at(p0, test, 1))
  assert c.fitted[-1] > c.fitted[0] + 0.3
  assert c.held_out[-1] > c.held_out[0] + 0.3


def test_fit_keeps_frozen_fields_at_their_start_and_moves_the_rest():
  train = _stream(features=True)
  p0 = adapter_lib.init_adapter(jax.random.PRNGKey(0), _config(side=3))
  # The curve shows the gradient mask: with every field frozen nothing moves.
  fit = lambda frozen: supervised.fit(jax.random.PRNGKey(1), p0, train, train,
                                      learning_rate=1e-1, beta=8.0, steps=20, batch_size=16,
                                      eval_every=10, slate_size=1, frozen=frozen)
  everything = fit(("w_q", "w_m", "w_side"))
  np.testing.assert_allclose(everything.fitted, everything.fitted[0])  # nothing moves
  assert not np.allclose(fit(("w_q", "w_m")).fitted, everything.fitted[0])  # the side weights do


def test_fit_refuses_steps_that_are_not_a_multiple_of_eval_every():
  s = _stream()
  p0 = adapter_lib.init_adapter(jax.random.PRNGKey(0), _config())
  with pytest.raises(ValueError, match="multiple of eval_every"):
    supervised.fit(jax.random.PRNGKey(1), p0, s, s, learning_rate=1e-2, beta=1.0, steps=30,
                   batch_size=4, eval_every=20, slate_size=1)


def test_fit_vmaps_over_seeds_and_seeds_differ():
  s = _stream()
  parts = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), s)
  p0 = adapter_lib.init_adapter(jax.random.PRNGKey(0), _config())
  f = jax.jit(jax.vmap(lambda k, a: supervised.fit(k, p0, a, a, learning_rate=3e-2, beta=8.0,
                                                   steps=20, batch_size=4, eval_every=10,
                                                   slate_size=1)))
  c = f(jax.random.split(jax.random.PRNGKey(3), 2), parts)
  one = supervised.fit(jax.random.split(jax.random.PRNGKey(3), 2)[1], p0, s, s,
                       learning_rate=3e-2, beta=8.0, steps=20, batch_size=4, eval_every=10,
                       slate_size=1)
  np.testing.assert_allclose(c.fitted[1], one.fitted, atol=1e-6)
  assert not np.array_equal(c.fitted[0], c.fitted[1])


def test_headroom_suite_is_registered_by_name_only():
  from ear_jax.experiment import suites  # pylint: disable=import-outside-toplevel
  from ear_jax.experiment.suites import headroom  # pylint: disable=import-outside-toplevel
  from experiments import run  # pylint: disable=import-outside-toplevel
  assert suites.SUITES["headroom"] is headroom.suite_headroom
  assert "headroom" in run.SUITES and "headroom" not in suites.ALL_ORDER


@pytest.mark.slow
def test_headroom_suite_pairs_every_row_with_the_frozen_first_stage(locomo_path, tmp_path,
                                                                    monkeypatch):
  from ear_jax.experiment import suites  # pylint: disable=import-outside-toplevel
  from ear_jax.experiment.suites import first_stage  # pylint: disable=import-outside-toplevel
  from ear_jax.experiment.suites import headroom  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(headroom, "STEPS", 20)
  monkeypatch.setattr(headroom, "EVAL_EVERY", 10)
  monkeypatch.setattr(headroom, "VARIANTS", {
      k: (f, lrs[:1], betas[:1]) for k, (f, lrs, betas) in headroom.VARIANTS.items()})
  opts = suites.Options(benchmark="locomo", data_dir=str(locomo_path.parent.resolve()), limit=1,
                        seeds=2, workdir=str(tmp_path / "w"), suite="headroom",
                        checkpoint_every=None, progress=False)
  res = suites.run(opts)
  md = res["tables"]["headroom"]
  import json  # pylint: disable=import-outside-toplevel
  saved = json.loads((tmp_path / "w" / "headroom.json").read_text())
  assert [s["candidates"] for s in saved] == list(first_stage.GENERATORS_SHOWN)
  for s in saved:
    assert len(s["frozen"]) == len(s["online"]) == 2
    for v in s["variants"].values():
      # The grid includes step 0 (the untrained adapter): the held-out bound is never below
      # the frozen first stage's validation mean.
      assert np.mean(v["held_out"]) >= np.mean(s["frozen"]) - 1e-9
      assert np.mean(v["in_sample"]) >= np.mean(s["frozen"]) - 1e-9
    assert np.all(np.asarray(s["ceiling"]) >= np.asarray(s["frozen"]) - 1e-9)
    assert f"| {s['candidates']} | frozen first stage | {np.mean(s['frozen']):.2f} |" in md
  assert (tmp_path / "w" / "plots" / "locomo_headroom.png").is_file()
