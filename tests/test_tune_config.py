"""Issue 12's switches: the paper's `ear` is unchanged; each new switch against an independent
computation (class-balanced Eq. (10), exploit final slate, test-time T, weight decay, schedules)."""
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
from ear_jax.core import losses
from ear_jax.core.config import (HPARAM_DEFAULTS, METHODS, EARConfig, default_hparams,
                                 hparams_for_method)
from ear_jax.experiment import runner
from ear_jax.experiment.suites import tune
from tests.core_utils import learnable_stream

NEW_FIELDS = ("label_weights", "final_slate", "test_rounds", "lr_schedule", "lr_schedule_steps",
              "weight_decay")


def test_the_papers_ear_is_unchanged():
  ear = EARConfig.for_method("ear")
  assert (ear.label_weights, ear.final_slate, ear.test_rounds, ear.lr_schedule,
          ear.weight_decay) == ("none", "round_T", None, "constant", 0.0)
  assert ear.eval_rounds == ear.num_rounds == 4
  # Checkpoint / results metadata of the paper's methods is exactly what it was before issue 12.
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


@pytest.mark.parametrize("field,value", [("label_weights", "x"), ("final_slate", "last"),
                                         ("test_rounds", 0), ("lr_schedule", "step"),
                                         ("lr_schedule_steps", 0), ("weight_decay", -1.0)])
def test_bad_new_switches_are_clear_errors(field, value):
  with pytest.raises(ValueError, match=field):
    EARConfig(**{field: value})


def _np_balanced_loss(logits, slates, mask, rewards, b):
  lp = logits - np.log(np.sum(np.exp(logits)))
  pos = mask & (rewards > 0)
  neg = mask & (rewards <= 0)
  n, npos, nneg = mask.sum(), pos.sum(), neg.sum()
  w = np.where(pos, n / (2 * max(npos, 1)), n / (2 * max(nneg, 1))) if npos and nneg else np.ones(
      rewards.shape)
  return -np.sum(np.where(mask, w * (rewards - b) * lp[np.maximum(slates, 0)], 0)) / n


@pytest.mark.parametrize("seed", range(4))
def test_class_balanced_ranking_loss_against_numpy(seed):
  rng = np.random.default_rng(seed)
  k, r, s = 10, 3, 4
  logits = rng.normal(size=k).astype(np.float32)
  slates = np.stack([rng.permutation(k)[:s] for _ in range(r)]).astype(np.int32)
  mask = rng.random((r, s)) < 0.85
  rewards = np.where(rng.random((r, s)) < 0.3, 1.0, -1.0).astype(np.float32)
  if seed == 3:
    rewards[:] = -1.0  # one class only: weights are all 1 (the paper's loss)
  got = losses.ranking_loss(jnp.asarray(logits), jnp.ones(k, bool), slates, mask, rewards,
                            jnp.float32(0.25), "flat", weighting="balanced")
  np.testing.assert_allclose(got, _np_balanced_loss(logits, slates, mask, rewards, 0.25),
                             rtol=1e-5)
  w = losses.label_weights(jnp.asarray(rewards), jnp.asarray(mask), "balanced")
  np.testing.assert_allclose(np.sum(np.where(mask, w, 0)), mask.sum(), rtol=1e-6)
  if seed == 3:
    np.testing.assert_allclose(
        got, losses.ranking_loss(jnp.asarray(logits), jnp.ones(k, bool), slates, mask, rewards,
                                 jnp.float32(0.25), "flat"), rtol=1e-6)


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


def test_weight_decay_and_lr_schedule_through_optax():
  cfg = EARConfig(dim=4, num_candidates=4, slate_size=2, weight_decay=2.0)
  state = learner.init_learner(jax.random.PRNGKey(0), cfg)
  state = state.replace(params=jax.tree_util.tree_map(jnp.ones_like, state.params))
  zero = jax.tree_util.tree_map(jnp.zeros_like, state.params)
  hp = default_hparams(learning_rate=0.1)
  new = learner.apply_gradients(state, zero, cfg, hp)  # Adam on 0 grads moves nothing
  np.testing.assert_allclose(new.params.w_q, 1.0 - 0.1 * 2.0, rtol=1e-6)
  # rsqrt schedule with SGD: step c moves by lr / sqrt(1 + c / steps).
  cfg = EARConfig(dim=4, num_candidates=4, slate_size=2, optimizer="sgd", lr_schedule="rsqrt",
                  lr_schedule_steps=2)
  state = learner.init_learner(jax.random.PRNGKey(0), cfg)
  ones = jax.tree_util.tree_map(jnp.ones_like, state.params)
  w0 = np.asarray(state.params.w_q)
  for c in range(3):
    state = learner.apply_gradients(state, ones, cfg, hp)
  want = w0 - 0.1 * sum(1 / np.sqrt(1 + c / 2) for c in range(3))
  np.testing.assert_allclose(state.params.w_q, want, rtol=1e-5)


@pytest.mark.parametrize("target", ["zero", "first_stage"])
def test_weight_decay_pulls_w_side_toward_its_target(target):
  cfg = EARConfig(dim=4, num_candidates=4, slate_size=2, side_features=3, side_init=0.5,
                  weight_decay=2.0, weight_decay_target=target)
  state = learner.init_learner(jax.random.PRNGKey(0), cfg)
  init_side = np.asarray(state.params.w_side)  # [0.5, -1, 0]
  state = state.replace(params=jax.tree_util.tree_map(jnp.ones_like, state.params))
  zero = jax.tree_util.tree_map(jnp.zeros_like, state.params)
  new = learner.apply_gradients(state, zero, cfg, default_hparams(learning_rate=0.1))
  anchor = 0.0 if target == "zero" else init_side  # (W decays toward 0 either way)
  np.testing.assert_allclose(new.params.w_side, 1.0 - 0.1 * 2.0 * (1.0 - anchor), rtol=1e-6)
  np.testing.assert_allclose(new.params.w_q, 1.0 - 0.1 * 2.0, rtol=1e-6)
  with pytest.raises(ValueError, match="weight_decay_target"):
    EARConfig(weight_decay_target="init")


def test_preset_check_detects_a_mismatch():
  sw = {k: v for k, v in METHODS["ear_tuned"].items() if k not in ("train_slate", "use_replay")}
  sw.pop("test_rounds", None)
  hp = hparams_for_method("ear_tuned")
  chosen = {"switches": sw, "hparams": {k: float(getattr(hp, k)) for k in HPARAM_DEFAULTS}}
  res = {"chosen": chosen, "final_slate": METHODS["ear_tuned"].get("final_slate", "round_T")}
  assert tune.preset_matches(res)
  res["chosen"]["hparams"]["learning_rate"] *= 3
  assert not tune.preset_matches(res)
