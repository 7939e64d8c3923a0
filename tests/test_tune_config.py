"""The switches beyond the paper: the paper's `ear` is unchanged; each new switch against an
independent computation (exploit final slate, test-time T)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ear_jax.core import adapter as adapter_lib
from ear_jax.core import explorer
from ear_jax.core import inference
from ear_jax.core import learner
from ear_jax.core.config import (HPARAM_DEFAULTS, METHODS, EARConfig, default_hparams,
                                 hparams_for_method)
from ear_jax.experiment import runner
from ear_jax.experiment.suites import tune
from tests.core_utils import learnable_stream

NEW_FIELDS = ("final_slate", "test_rounds", "side_features", "side_init", "guard_z",
              "guard_min_queries", "guard_holdout", "guard_holdout_capacity")


def test_the_papers_ear_is_unchanged():
  ear = EARConfig.for_method("ear")
  assert (ear.final_slate, ear.test_rounds, ear.guard) == ("round_T", None, False)
  assert ear.eval_rounds == ear.num_rounds == 4
  # Checkpoint / results metadata of the paper's methods names none of the fields beyond it.
  for m in METHODS:
    if m not in ("ear_tuned", "ear_safe"):  # the presets beyond the paper
      assert not set(NEW_FIELDS) & set(EARConfig.for_method(m).to_dict())
  hp = hparams_for_method("ear")
  for k, v in HPARAM_DEFAULTS.items():
    assert float(getattr(hp, k)) == pytest.approx(v)
  # The default optimizer is the bare optax alias (same state tree as before).
  state = learner.make_optimizer(ear).init(adapter_lib.init_adapter(jax.random.PRNGKey(0), ear))
  ref = optax.inject_hyperparams(lambda learning_rate: optax.adam(learning_rate))(
      learning_rate=0.0).init(
      adapter_lib.init_adapter(jax.random.PRNGKey(0), ear))
  assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(ref)


def test_ear_tuned_round_trips_and_differs_from_ear():
  c = EARConfig.for_method("ear_tuned")
  assert EARConfig.from_dict(c.to_dict()) == c
  assert c != EARConfig.for_method("ear")
  assert c.eval_rounds == tune.TEST_ROUNDS  # tested at the paper's budget


@pytest.mark.parametrize("field,value", [("final_slate", "last"), ("test_rounds", 0)])
def test_bad_new_switches_are_clear_errors(field, value):
  with pytest.raises(ValueError, match=field):
    EARConfig(**{field: value})


def test_exploit_slate_orders_by_bandit_mean_then_relevance():
  mean = jnp.array([0.0, 1.0, -1.0, 0.5, 0.0, 1.0, 0.0, 0.0])
  rel = jnp.array([0.9, 0.1, 5.0, 0.2, 0.3, 0.4, 0.8, 2.0])
  where = jnp.array([True, True, True, True, True, True, True, False])
  stats = explorer.BanditStats(mean=mean, counts=jnp.ones(8))
  slate, ok = explorer.exploit_slate(stats, rel, where, 5)
  # confirmed (mean 1: rel 0.4 > 0.1), then 0.5, then never-refuted by relevance; 7 is invalid.
  assert slate.tolist() == [5, 1, 3, 0, 6] and ok.all()
  slate, ok = explorer.exploit_slate(stats, rel, jnp.arange(8) < 3, 5)
  assert slate.tolist() == [1, 0, 2, -1, -1] and ok.tolist() == [True] * 3 + [False] * 2


@pytest.mark.slow
def test_evaluate_final_slate_and_test_rounds_against_the_explorer():
  stream = learnable_stream(1, 12, d=8, k=8)
  base = EARConfig(dim=8, num_candidates=8, num_rounds=6)
  params = adapter_lib.init_adapter(jax.random.PRNGKey(0), base)
  hp = default_hparams()
  key = jax.random.PRNGKey(3)
  cfg = dataclasses.replace(base, final_slate="exploit", test_rounds=2)
  ev = inference.evaluate(key, params, stream, cfg, hp)
  ev_t2 = inference.evaluate(key, params, stream, dataclasses.replace(base, num_rounds=2), hp)
  from ear_jax.core import critic as critic_lib
  critic = critic_lib.or_default(None)

  @jax.jit
  def explore_all(keys, qs, cs, ws, gs):
    def one(k, q, c, w, g):
      out = inference.explorer_slate(k, params, q, c, w, lambda kk, sl, sm: critic(
          kk, critic_lib.slate_view(q, c, g, sl, sm)), cfg, hp)
      return out.slates, out.stats.mean, adapter_lib.adapter_scores(params, q, c)
    return jax.vmap(one)(keys, qs, cs, ws, gs)

  slates, means, zs = explore_all(jax.random.split(key, 12), stream.queries, stream.candidates,
                                  stream.mask, stream.gold)
  assert slates.shape[1] == 2  # test_rounds, not num_rounds
  for i in range(12):
    m, z = np.asarray(means[i]), np.asarray(zs[i])
    order = sorted(range(8), key=lambda j: (-m[j], -z[j]))[:5]
    assert np.asarray(ev.explorer_slates[i]).tolist() == order
  # round_T with T = 2 at test equals a config trained with T = 2 (same keys, same rounds).
  ev_rt = inference.evaluate(key, params, stream, dataclasses.replace(base, test_rounds=2), hp)
  np.testing.assert_array_equal(ev_rt.explorer_slates, ev_t2.explorer_slates)
  assert runner._eval_config(cfg).num_rounds == 2  # pylint: disable=protected-access
  assert runner._eval_config(cfg).final_slate == "exploit"  # pylint: disable=protected-access


def test_preset_check_detects_a_mismatch():
  sw = {k: v for k, v in METHODS["ear_tuned"].items() if k not in ("train_slate", "use_replay")}
  sw.pop("test_rounds", None)
  hp = hparams_for_method("ear_tuned")
  chosen = {"switches": sw, "hparams": {k: float(getattr(hp, k)) for k in HPARAM_DEFAULTS}}
  res = {"chosen": chosen, "final_slate": METHODS["ear_tuned"].get("final_slate", "round_T")}
  assert tune.preset_matches(res)
  res["chosen"]["hparams"]["learning_rate"] *= 3
  assert not tune.preset_matches(res)
