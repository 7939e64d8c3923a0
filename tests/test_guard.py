"""The guard (`EARConfig.guard_holdout`, `ear_jax.core.guard`) serving: the decision on its held-out
ring, the served parameters, the state it adds, `ear_safe`, and the runner."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.core import episode, guard, inference, learner, retrieval
from ear_jax.core.config import EARConfig, Method, default_hparams
from ear_jax.core.slates import top_s_slate
from ear_jax.core.stream import make_stream, to_device
from tests.core_utils import learnable_stream

jit_push = jax.jit(guard.push_holdout, static_argnums=(9,))
jit_served = jax.jit(inference.served_params, static_argnames=("config",))
jit_slates = jax.jit(jax.vmap(retrieval.slate_from_candidates, in_axes=(None, 0, 0, 0, None)),
                     static_argnums=(4,))

D, K, S = 4, 6, 2
CFG = EARConfig(dim=D, num_candidates=K, slate_size=S, num_rounds=3, replay_size=2,
                buffer_capacity=16, batch_size=4, guard_holdout=2, guard_min_queries=4,
                guard_holdout_capacity=16, side_features=3, side_init=0.5)


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _side_stream(n, seed=0):
  """Candidates whose first-stage score (feature 0) ranks the two gold ones first; their dense
  cosine feature is the true cosine (the initial z is `side_init * f_0`)."""
  rng = np.random.default_rng(seed)
  q = _unit(rng.normal(size=(n, D)))
  c = _unit(rng.normal(size=(n, K, D)))
  gold = np.zeros((n, K), bool)
  f0 = rng.uniform(0.0, 0.5, size=(n, K))
  for i in range(n):
    g = rng.choice(K, 2, replace=False)
    gold[i, g] = True
    f0[i, g] = rng.uniform(0.8, 1.0, size=2)
  cos = np.einsum("nkd,nd->nk", c, q)
  features = np.stack([f0, cos, np.zeros_like(f0)], -1)
  return make_stream(q, c, gold=gold, features=features)


def _ring(stream):
  """The ring of every query of `stream` held out, paged in full (K / s pages), gold cited."""
  n = stream.queries.shape[0]
  slates = np.tile(np.arange(K, dtype=np.int32).reshape(K // S, S), (n, 1, 1))
  labels = np.where(np.take_along_axis(np.asarray(stream.gold), slates.reshape(n, -1), 1),
                    1.0, -1.0).reshape(slates.shape).astype(np.float32)
  return jit_push(guard.init_guard(CFG), guard.first_stage_params(CFG), stream.queries,
                  stream.candidates, stream.mask, slates, np.ones(slates.shape, bool), labels,
                  np.ones((n,), bool), S)


def _bad_params():
  """The first stage's ranking turned upside down (w_side = -[side_init, ...])."""
  p = guard.first_stage_params(CFG)
  return p.replace(w_side=jnp.asarray([-1.0, -1.0, 0.0], jnp.float32))


def _good_stream_and_params():
  """A stream where the first stage is wrong (feature 0 ranks two non-gold candidates first) and
  feature 2 marks the gold, and an adapter that weighs feature 2."""
  stream = _side_stream(16)
  gold = np.asarray(stream.gold)
  cands = np.asarray(stream.candidates).copy()
  cands[..., D] = np.where(gold, 0.1, cands[..., D])
  cands[..., D + 2] = np.where(gold, 1.0, 0.0)
  good = guard.first_stage_params(CFG).replace(w_side=jnp.asarray([0.5, -1.0, 2.0], jnp.float32))
  return stream.replace(candidates=cands), good


def test_guarded_slate_is_the_first_stage_top_s_when_the_adapter_is_worse():
  stream = _side_stream(16)
  bad = _bad_params()
  state = learner.init_learner(jax.random.PRNGKey(0), CFG).replace(params=bad,
                                                                   guard=_ring(stream))
  serve, lcb, n = guard.holdout_decision(bad, state.guard, CFG)
  assert not bool(serve) and float(lcb) < 0 and float(n) == 16
  slate, _, _ = jit_slates(jit_served(state, CFG), stream.queries, stream.candidates, stream.mask,
                           S)
  want, _ = jax.vmap(top_s_slate, in_axes=(0, 0, None))(stream.candidates[..., D], stream.mask, S)
  np.testing.assert_array_equal(slate, want)  # the first stage's own top-s (feature 0)
  unguarded, _, _ = jit_slates(bad, stream.queries, stream.candidates, stream.mask, S)
  assert not np.array_equal(unguarded, want)


def test_adapted_slate_is_served_when_it_is_clearly_better():
  stream, good = _good_stream_and_params()
  state = learner.init_learner(jax.random.PRNGKey(0), CFG).replace(params=good,
                                                                   guard=_ring(stream))
  assert bool(guard.serve_adapted(good, state.guard, CFG))
  served = jit_served(state, CFG)
  for a, b in zip(jax.tree_util.tree_leaves(served), jax.tree_util.tree_leaves(good)):
    np.testing.assert_array_equal(a, b)
  slate, _, _ = jit_slates(served, stream.queries, stream.candidates, stream.mask, S)
  assert np.all(np.take_along_axis(np.asarray(stream.gold), slate, 1))
  # Too few held-out questions with a citation: the first stage, whatever the bound says.
  assert not bool(guard.serve_adapted(good, state.guard,
                                      dataclasses.replace(CFG, guard_min_queries=17)))
  assert not bool(guard.serve_adapted(good, guard.init_guard(CFG), CFG, 0.0))  # an empty ring


@pytest.mark.slow
def test_guard_kernels_jit_equals_eager_and_do_not_retrace():
  stream, good = _good_stream_and_params()
  ring = _ring(stream)
  traces = []

  def f(params, g, z):
    traces.append(1)
    return guard.holdout_decision(params, g, CFG, z)

  jitted = jax.jit(f)
  a = jitted(good, ring, jnp.float32(0.5))
  with jax.disable_jit():
    b = f(good, ring, jnp.float32(0.5))
  for x, y in zip(a, b):
    np.testing.assert_allclose(x, y, rtol=1e-6)
  assert bool(a[0])
  jitted(_bad_params(), ring, jnp.float32(1.0))
  assert len(traces) == 2  # one trace for jit, one eager call; the second jitted call reuses it


def test_served_params_vmapped_over_seeds_equals_a_loop():
  stream, good = _good_stream_and_params()
  states = [learner.init_learner(jax.random.PRNGKey(0), CFG).replace(params=p, guard=_ring(stream))
            for p in (_bad_params(), good)]
  stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *states)
  got = jax.jit(jax.vmap(lambda s: inference.served_params(s, CFG)))(stacked)
  for i, st in enumerate(states):
    want = inference.served_params(st, CFG)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(a[i], b)


def test_guard_off_adds_no_state_and_serves_the_adapter():
  off = dataclasses.replace(CFG, guard_holdout=0)
  assert not off.guard and CFG.guard
  state = learner.init_learner(jax.random.PRNGKey(0), off)
  assert state.guard is None
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  assert not [n for n in names if "guard" in n]
  assert inference.served_params(state, off) is state.params
  assert not {"guard_holdout", "guard_z", "guard_min_queries", "guard_holdout_capacity"} & set(
      EARConfig.for_method("ear_tuned").to_dict())
  on = learner.init_learner(jax.random.PRNGKey(0), CFG)
  assert len(jax.tree_util.tree_leaves(on)) == len(jax.tree_util.tree_leaves(state)) + 6


def test_ear_safe_is_ear_tuned_with_the_held_out_guard():
  safe, tuned = Method.named("ear_safe"), Method.named("ear_tuned")
  assert safe.config == dataclasses.replace(tuned.config, guard_holdout=5, guard_z=0.25)
  for a, b in zip(jax.tree_util.tree_leaves(safe.hparams), jax.tree_util.tree_leaves(tuned.hparams)):
    np.testing.assert_array_equal(a, b)
  assert EARConfig.from_dict(safe.config.to_dict()) == safe.config
  assert not [k for k in tuned.config.to_dict() if k.startswith("guard")]


@pytest.mark.parametrize("field,value", [("guard_z", -1.0), ("guard_min_queries", 0),
                                         ("guard_holdout", 1), ("guard_holdout", True),
                                         ("guard_holdout_capacity", 0)])
def test_bad_guard_settings_are_refused_naming_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    EARConfig(**{field: value})


# -- episodes (slow: each compiles a whole learner step) ------------------------------------------

EP_CFG = EARConfig.for_method("ear", dim=16, num_candidates=8, slate_size=2, num_rounds=4,
                              replay_size=2, buffer_capacity=64, batch_size=4, guard_holdout=3,
                              guard_min_queries=2, guard_holdout_capacity=16)
HP = default_hparams(learning_rate=3e-3)
jit_run_episode = jax.jit(episode.run_episode, static_argnames=("config",))


@pytest.mark.slow
def test_guarded_episode_vmapped_over_seeds_equals_a_loop():
  stream = to_device(learnable_stream(1, 24))
  keys = jnp.stack([jax.random.PRNGKey(s) for s in (0, 1)])
  both = jax.jit(jax.vmap(lambda k: episode.run_episode(k, stream, EP_CFG, HP)))(keys)
  for i in range(2):
    one = jit_run_episode(keys[i], stream, EP_CFG, HP)
    for a, b in zip(jax.tree_util.tree_leaves(both[0].guard),
                    jax.tree_util.tree_leaves(one[0].guard)):
      np.testing.assert_allclose(a[i], b, rtol=1e-6)
  assert int(both[0].guard.count[0]) == 24 // 3


@pytest.mark.slow
def test_runner_serves_the_first_stage_when_the_adapter_is_worse_and_checkpoints_the_guard(
    tmp_path):
  from ear_jax.experiment import runner  # pylint: disable=import-outside-toplevel
  from ear_jax.io import run_checkpoints  # pylint: disable=import-outside-toplevel
  # The first stage (feature 0) is right; the run resumes from a position-0 checkpoint holding
  # the first stage's ranking upside down, and a learning rate of 0 keeps it there.
  stream = _side_stream(48, seed=2)
  cfg = EARConfig.for_method("ear_safe", dim=D, num_candidates=K, slate_size=S, num_rounds=3,
                             replay_size=2, buffer_capacity=64, batch_size=4, side_features=3,
                             guard_holdout=2, guard_min_queries=4)
  hp = default_hparams(learning_rate=0.0)
  seeds = [0, 1]
  train, test = runner.seed_splits(48, seeds)
  init_keys, _ = runner._episode_keys(runner._split_seed_keys(runner.per_seed_keys(seeds))[0],
                                      train.shape[1])
  states = runner._init_states(init_keys, cfg)
  states = states.replace(params=jax.tree_util.tree_map(
      lambda x: jnp.broadcast_to(x, (2,) + x.shape), _bad_params()))
  ck = run_checkpoints.RunCheckpointer(tmp_path / "run")
  ck.bind(config=cfg, hparams=hp, seeds=seeds, num_train=train.shape[1], segment=8, target=states)
  ck.save(0, states, {"curve": [], "train_log": {}})
  res = runner.train_and_evaluate("ear_safe", stream, train, test, cfg, hp, seeds,
                                  checkpoint_every=8, resume=True,
                                  checkpointer=run_checkpoints.RunCheckpointer(tmp_path / "run"))
  assert not np.any(run_checkpoints.guard_decisions(res.final_state, cfg))
  first = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (2,) + x.shape),
                                 guard.first_stage_params(cfg))
  ev_first = runner.evaluate_params(first, stream, test, cfg, hp, seeds)
  ev_bad = runner.evaluate_params(res.final_state.params, stream, test, cfg, hp, seeds)
  np.testing.assert_array_equal(res.eval["adapter_slates"], ev_first["adapter_slates"])
  assert ev_bad["recall_adapter"].mean() < res.eval["recall_adapter"].mean()
  # The learner state with its guard round-trips through the run's checkpoint, by leaf name.
  ck = run_checkpoints.RunCheckpointer(tmp_path / "run")
  ck.bind(config=cfg, hparams=hp, seeds=seeds, num_train=train.shape[1], segment=8,
          target=res.final_state)
  restored, position, _ = ck.restore()
  assert position == train.shape[1]
  for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(res.final_state)):
    np.testing.assert_array_equal(a, b)
  assert int(restored.guard.count[0]) == int(res.final_state.guard.count[0]) > 0
