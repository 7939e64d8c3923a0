"""The guard (`EARConfig.guard`, `ear_jax.core.guard`): evidence, state, decision, serving."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.core import adapter as adapter_lib
from ear_jax.core import episode, guard, inference, learner
from ear_jax.core.config import EARConfig, Method, default_hparams
from ear_jax.core.slates import top_s_slate
from ear_jax.core.stream import make_stream, to_device
from tests.core_utils import learnable_stream

jit_evidence = jax.jit(jax.vmap(guard.query_evidence, in_axes=(None, None, 0, 0, 0, 0, 0, 0, None)),
                       static_argnums=(8,))
jit_update = jax.jit(guard.update_guard, static_argnames=("config",))
jit_served = jax.jit(inference.served_params, static_argnames=("config",))
jit_slates = jax.jit(jax.vmap(inference.adapter_only_slate, in_axes=(None, 0, 0, 0, None)),
                     static_argnums=(4,))

D, K, S = 4, 6, 2
CFG = EARConfig(dim=D, num_candidates=K, slate_size=S, num_rounds=3, replay_size=2,
                buffer_capacity=16, batch_size=4, guard=True, guard_min_queries=4,
                guard_half_life=0.0, side_features=3, side_init=0.5)


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


def _all_shown_feedback(stream):
  """Slates showing every candidate once (K / s rounds), the gold ones labelled +1."""
  n = stream.queries.shape[0]
  slates = np.tile(np.arange(K, dtype=np.int32).reshape(K // S, S), (n, 1, 1))
  labels = np.where(np.take_along_axis(np.asarray(stream.gold), slates.reshape(n, -1), 1),
                    1.0, -1.0).reshape(slates.shape).astype(np.float32)
  return slates, np.ones(slates.shape, bool), labels


def _bad_params():
  """The first stage's ranking turned upside down (w_side = -[side_init, ...])."""
  p = guard.first_stage_params(CFG)
  return p.replace(w_side=jnp.asarray([-1.0, -1.0, 0.0], jnp.float32))


def _evidence_guard(params, stream):
  slates, mask, labels = _all_shown_feedback(stream)
  d, counts = jit_evidence(params, guard.first_stage_params(CFG), stream.queries,
                           stream.candidates, stream.mask, slates, mask, labels, S)
  return jit_update(guard.init_guard(), d, counts, CFG)


def test_evidence_counts_cited_items_in_each_top_s_by_hand():
  cfg = EARConfig(dim=2, num_candidates=4, slate_size=2, guard=True)
  q = np.asarray([[1.0, 0.0]] * 3, np.float32)
  c = np.tile(np.asarray([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.0]], np.float32), (3, 1, 1))
  where = np.ones((3, 4), bool)
  first = guard.first_stage_params(cfg)  # frozen cosine: top-2 = {0, 1}
  adapted = first.replace(w_q=-2.0 * jnp.eye(2))  # q~ = -q: top-2 = {3, 2}
  slates = np.asarray([[[0, 2], [3, 1]],  # every candidate shown; 0, 3, 1 cited
                       [[0, 2], [3, 1]],  # nothing cited
                       [[3, 2], [1, -1]]], np.int32)  # 0 (in the first stage's top-2) not shown
  mask = slates >= 0
  labels = np.asarray([[[1, -1], [1, 1]], [[-1, -1], [-1, -1]], [[1, -1], [1, -1]]], np.float32)
  d, counts = jit_evidence(adapted, first, q, c, where, slates, mask, labels, 2)
  # query 0: adapted top-2 {3, 2} holds 1 cited, the first stage's {0, 1} holds 2: d = -1.
  np.testing.assert_array_equal(d, [-1.0, 0.0, 1.0 - 1.0])
  np.testing.assert_array_equal(counts, [True, False, False])
  # Only the candidates in one top-s but not the other must be shown: equal rankings always count.
  d, counts = jit_evidence(first, first, q, c, where, slates, mask, labels, 2)
  np.testing.assert_array_equal(d, [0.0, 0.0, 0.0])
  np.testing.assert_array_equal(counts, [True, False, True])


def test_question_evidence_counts_whole_questions_by_hand():
  q = np.asarray([[1.0, 0.0]] * 3, np.float32)
  c = np.tile(np.asarray([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.0]], np.float32), (3, 1, 1))
  where = np.ones((3, 4), bool)
  first = guard.first_stage_params(EARConfig(dim=2, num_candidates=4, slate_size=2, guard=True))
  adapted = first.replace(w_q=-2.0 * jnp.eye(2))  # top-2 {3, 2}; the first stage's {0, 1}
  slates = np.tile(np.asarray([[0, 2], [3, 1]], np.int32), (3, 1, 1))  # every candidate shown
  labels = np.asarray([[[1, -1], [-1, 1]],  # 0, 1 cited: all in the first stage's top-2
                       [[-1, 1], [1, -1]],  # 2, 3 cited: all in the adapted top-2
                       [[1, 1], [-1, -1]]], np.float32)  # 0, 2 cited: all in neither
  questions = jax.jit(jax.vmap(functools.partial(guard.query_evidence, questions=True),
                               in_axes=(None, None, 0, 0, 0, 0, 0, 0, None)), static_argnums=(8,))
  d, counts = questions(adapted, first, q, c, where, slates, slates >= 0, labels, 2)
  np.testing.assert_array_equal(d, [-1.0, 1.0, 0.0])
  np.testing.assert_array_equal(counts, [True, True, True])
  d_items, _ = jit_evidence(adapted, first, q, c, where, slates, slates >= 0, labels, 2)
  np.testing.assert_array_equal(d_items, [-2.0, 2.0, 0.0])  # (the items' count of the same)


def test_question_evidence_is_refused_with_the_probe():
  with pytest.raises(ValueError, match="guard_evidence='questions'"):
    EARConfig(guard=True, guard_probe=True, guard_evidence="questions")
  with pytest.raises(ValueError, match="guard_evidence"):
    EARConfig(guard=True, guard_evidence="rows")


def test_update_guard_matches_hand_computed_sums_with_a_half_life():
  cfg = dataclasses.replace(CFG, guard_half_life=2.0)
  g = guard.GuardState(count=jnp.int32(3), weight=jnp.float32(2.0), weight_sq=jnp.float32(2.0),
                       total=jnp.float32(1.0), total_sq=jnp.float32(3.0))
  out = jit_update(g, jnp.asarray([-1.0, 5.0, 2.0, 7.0]), jnp.asarray([True, False, True, False]),
                   cfg)
  decay = 0.5  # two counted queries, half-life 2
  np.testing.assert_allclose(
      [out.count, out.weight, out.weight_sq, out.total, out.total_sq],
      [5, 2 * decay + 2, 2 * decay ** 2 + 2, decay * 1.0 - 1.0 + 2.0, decay * 3.0 + 1.0 + 4.0],
      rtol=1e-6)
  plain = jit_update(g, jnp.asarray([-1.0, 5.0]), jnp.asarray([True, False]), CFG)  # no decay
  np.testing.assert_allclose([plain.weight, plain.total, plain.total_sq], [3.0, 0.0, 4.0])


def test_lower_bound_and_decision_match_hand_computed_values():
  g = jit_update(guard.init_guard(), jnp.asarray([1.0, 1.0, 2.0, 0.0]), jnp.ones(4, bool), CFG)
  se = np.sqrt((2.0 / 3.0) / 4.0)  # mean 1, sample variance 2/3, n = 4
  np.testing.assert_allclose(guard.lower_bound(g, 1.0), 1.0 - se, rtol=1e-6)
  assert bool(guard.serve_adapted(g, CFG, 1.0))
  assert not bool(guard.serve_adapted(g, CFG, 2.5))  # 1 - 2.5 se < 0
  assert not bool(guard.serve_adapted(g, dataclasses.replace(CFG, guard_min_queries=5), 1.0))
  assert not bool(guard.serve_adapted(guard.init_guard(), CFG, 0.0))  # no evidence: first stage


def test_guarded_slate_is_the_first_stage_top_s_when_the_adapter_is_worse():
  stream = _side_stream(16)
  bad = _bad_params()
  state = learner.init_learner(jax.random.PRNGKey(0), CFG).replace(
      params=bad, guard=_evidence_guard(bad, stream))
  assert float(state.guard.total) < 0 and not bool(guard.serve_adapted(state.guard, CFG))
  slate, _, _ = jit_slates(jit_served(state, CFG), stream.queries, stream.candidates, stream.mask,
                           S)
  want, _ = jax.vmap(top_s_slate, in_axes=(0, 0, None))(stream.candidates[..., D], stream.mask, S)
  np.testing.assert_array_equal(slate, want)  # the first stage's own top-s (feature 0)
  unguarded, _, _ = jit_slates(bad, stream.queries, stream.candidates, stream.mask, S)
  assert not np.array_equal(unguarded, want)


def test_adapted_slate_is_served_when_it_is_clearly_better():
  stream = _side_stream(16)
  gold = np.asarray(stream.gold)
  # A stream where the first stage is wrong: feature 0 now ranks two non-gold candidates first.
  cands = np.asarray(stream.candidates).copy()
  cands[..., D] = np.where(gold, 0.1, cands[..., D])
  good_feature = np.where(gold, 1.0, 0.0)
  cands[..., D + 2] = good_feature  # feature 2 marks the gold: an adapter that weighs it is right
  stream = stream.replace(candidates=cands)
  good = guard.first_stage_params(CFG).replace(w_side=jnp.asarray([0.5, -1.0, 2.0], jnp.float32))
  state = learner.init_learner(jax.random.PRNGKey(0), CFG).replace(
      params=good, guard=_evidence_guard(good, stream))
  assert bool(guard.serve_adapted(state.guard, CFG))
  served = jit_served(state, CFG)
  for a, b in zip(jax.tree_util.tree_leaves(served), jax.tree_util.tree_leaves(good)):
    np.testing.assert_array_equal(a, b)
  slate, _, _ = jit_slates(served, stream.queries, stream.candidates, stream.mask, S)
  assert np.all(np.take_along_axis(gold, slate, 1))


@pytest.mark.slow
def test_guard_kernels_jit_equals_eager_and_do_not_retrace():
  stream = _side_stream(16)
  slates, mask, labels = _all_shown_feedback(stream)
  args = (_bad_params(), guard.first_stage_params(CFG), stream.queries[0], stream.candidates[0],
          stream.mask[0], slates[0], mask[0], labels[0])
  traces = []

  def f(*a):
    traces.append(1)
    d, c = guard.query_evidence(*a, S)
    return guard.update_guard(guard.init_guard(), d[None], c[None], CFG)

  jitted = jax.jit(f)
  a = jitted(*args)
  with jax.disable_jit():
    b = f(*args)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-6)
  assert float(a.total) != 0.0
  jitted(*args[:2], *(jnp.asarray(x) for x in (stream.queries[1], stream.candidates[1],
                                               stream.mask[1], slates[1], mask[1], labels[1])))
  assert len(traces) == 2  # one trace for jit, one eager call; the second jitted call reuses it


def test_served_params_vmapped_over_seeds_equals_a_loop():
  stream = _side_stream(16)
  states = [learner.init_learner(jax.random.PRNGKey(0), CFG).replace(
      params=p, guard=_evidence_guard(p, stream))
            for p in (_bad_params(), guard.first_stage_params(CFG).replace(
                w_side=jnp.asarray([2.0, -1.0, 0.0], jnp.float32)))]
  stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *states)
  got = jax.jit(jax.vmap(lambda s: inference.served_params(s, CFG)))(stacked)
  for i, st in enumerate(states):
    want = inference.served_params(st, CFG)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(a[i], b)


def test_guard_off_adds_no_state_and_serves_the_adapter():
  off = dataclasses.replace(CFG, guard=False)
  state = learner.init_learner(jax.random.PRNGKey(0), off)
  assert state.guard is None
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  assert not [n for n in names if "guard" in n]
  assert inference.served_params(state, off) is state.params
  assert not {"guard", "guard_z", "guard_min_queries", "guard_half_life"} & set(
      EARConfig.for_method("ear_tuned").to_dict())
  on = learner.init_learner(jax.random.PRNGKey(0), CFG)
  assert len(jax.tree_util.tree_leaves(on)) == len(jax.tree_util.tree_leaves(state)) + 5


def test_ear_safe_is_ear_tuned_with_the_held_out_guard():
  safe, tuned = Method.named("ear_safe"), Method.named("ear_tuned")
  assert safe.config == dataclasses.replace(tuned.config, guard=True, guard_holdout=5,
                                            guard_evidence="questions", guard_z=0.25)
  for a, b in zip(jax.tree_util.tree_leaves(safe.hparams), jax.tree_util.tree_leaves(tuned.hparams)):
    np.testing.assert_array_equal(a, b)
  assert EARConfig.from_dict(safe.config.to_dict()) == safe.config
  assert "guard" not in tuned.config.to_dict() and "guard" not in EARConfig().to_dict()


@pytest.mark.parametrize("field,value", [("guard_z", -1.0), ("guard_min_queries", 0),
                                         ("guard_half_life", -2.0), ("guard", 1)])
def test_bad_guard_settings_are_refused_naming_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    EARConfig(**{field: value})


# -- episodes (slow: each compiles a whole learner step) ------------------------------------------

EP_CFG = EARConfig.for_method("ear", dim=16, num_candidates=8, slate_size=2, num_rounds=4,
                              replay_size=2, buffer_capacity=64, batch_size=4, guard=True,
                              guard_min_queries=8, guard_half_life=8.0)
HP = default_hparams(learning_rate=3e-3)
jit_run_episode = jax.jit(episode.run_episode, static_argnames=("config",))


@pytest.mark.slow
def test_guard_changes_nothing_in_training_and_its_state_folds_from_its_records():
  stream = learnable_stream(0, 42)
  on = jit_run_episode(jax.random.PRNGKey(3), stream, EP_CFG, HP)
  off = jit_run_episode(jax.random.PRNGKey(3), stream, dataclasses.replace(EP_CFG, guard=False),
                        HP)
  assert off[0].guard is None and off[1].guard_d is None
  for a, b in zip(jax.tree_util.tree_leaves(off[0]),
                  jax.tree_util.tree_leaves(on[0].replace(guard=None))):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree_util.tree_leaves(off[1]),
                  jax.tree_util.tree_leaves(on[1]._replace(guard_d=None, guard_counts=None))):
    np.testing.assert_array_equal(a, b)
  assert int(on[0].guard.count) == int(np.sum(on[1].guard_counts)) > 0
  folded = guard.guard_from_evidence(on[1].guard_d, on[1].guard_counts, EP_CFG)
  for a, b in zip(jax.tree_util.tree_leaves(folded), jax.tree_util.tree_leaves(on[0].guard)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.slow
def test_guarded_episode_vmapped_over_seeds_equals_a_loop():
  stream = to_device(learnable_stream(1, 24))
  cfg = dataclasses.replace(EP_CFG, guard_half_life=16.0)
  keys = jnp.stack([jax.random.PRNGKey(s) for s in (0, 1)])
  both = jax.jit(jax.vmap(lambda k: episode.run_episode(k, stream, cfg, HP)))(keys)
  for i in range(2):
    one = jit_run_episode(keys[i], stream, cfg, HP)
    for a, b in zip(jax.tree_util.tree_leaves(both[0].guard), jax.tree_util.tree_leaves(one[0].guard)):
      np.testing.assert_allclose(a[i], b, rtol=1e-6)


@pytest.mark.slow
def test_runner_serves_the_first_stage_when_the_adapter_is_worse_and_checkpoints_the_guard(
    tmp_path):
  from ear_jax.experiment import checkpointing  # pylint: disable=import-outside-toplevel
  from ear_jax.experiment import runner  # pylint: disable=import-outside-toplevel
  # The first stage (feature 0) is right; the run resumes from a position-0 checkpoint holding
  # the first stage's ranking upside down, and a learning rate of 0 keeps it there.
  stream = _side_stream(48, seed=2)
  cfg = EARConfig.for_method("ear_safe", dim=D, num_candidates=K, slate_size=S, num_rounds=3,
                             replay_size=2, buffer_capacity=64, batch_size=4, side_features=3,
                             guard_min_queries=4, guard_holdout=0, guard_z=0.5,
                             guard_evidence="items")  # (prequential)
  hp = default_hparams(learning_rate=0.0)
  seeds = [0, 1]
  train, test = runner.seed_splits(48, seeds)
  init_keys, _ = runner._episode_keys(runner._split_seed_keys(runner.per_seed_keys(seeds))[0],
                                      train.shape[1])
  states = runner._init_states(init_keys, cfg)
  states = states.replace(params=jax.tree_util.tree_map(
      lambda x: jnp.broadcast_to(x, (2,) + x.shape), _bad_params()))
  ck = checkpointing.RunCheckpointer(tmp_path / "run")
  ck.bind(config=cfg, hparams=hp, seeds=seeds, num_train=train.shape[1], segment=8, target=states)
  ck.save(0, states, {"curve": [], "train_log": {}})
  res = runner.train_and_evaluate("ear_safe", stream, train, test, cfg, hp, seeds,
                                  checkpoint_every=8, resume=True,
                                  checkpointer=checkpointing.RunCheckpointer(tmp_path / "run"))
  assert np.all(np.asarray(res.final_state.guard.total) < 0)
  assert not np.any(jax.vmap(lambda g: guard.serve_adapted(g, cfg))(res.final_state.guard))
  first = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (2,) + x.shape),
                                 guard.first_stage_params(cfg))
  ev_first = runner.evaluate_params(first, stream, test, cfg, hp, seeds)
  ev_bad = runner.evaluate_params(res.final_state.params, stream, test, cfg, hp, seeds)
  np.testing.assert_array_equal(res.eval["adapter_slates"], ev_first["adapter_slates"])
  assert ev_bad["recall_adapter"].mean() < res.eval["recall_adapter"].mean()
  # The learner state with its guard round-trips through the run's checkpoint, by leaf name.
  ck = checkpointing.RunCheckpointer(tmp_path / "run")
  ck.bind(config=cfg, hparams=hp, seeds=seeds, num_train=train.shape[1], segment=8,
          target=res.final_state)
  restored, position, _ = ck.restore()
  assert position == train.shape[1]
  for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(res.final_state)):
    np.testing.assert_array_equal(a, b)
  assert int(restored.guard.count[0]) == int(res.final_state.guard.count[0]) > 0


# -- the probe (`guard_probe`) --------------------------------------------------------------------
jit_probe = jax.jit(guard.probe_slate, static_argnums=(4,))


def test_probe_interleaves_both_rankings_differences_and_fills_with_the_common_items():
  k, s = 8, 5
  z = jnp.arange(k, 0, -1, dtype=jnp.float32)  # adapted top-5: 0 1 2 3 4
  z0 = jnp.asarray([9, 8, 7, 0, 0, 6, 5, 4], jnp.float32)  # first stage's top-5: 0 1 2 5 6
  for seed in range(5):
    slate, mask = (np.asarray(x) for x in jit_probe(jax.random.PRNGKey(seed), z, z0,
                                                     jnp.ones(k, bool), s))
    assert mask.all() and len(set(slate)) == s
    assert set(slate[[0, 2]]) == {3, 4} and set(slate[[1, 3]]) == {5, 6}  # A, F alternating
    assert slate[4] == 0  # then the common items by adapted relevance
  same, _ = jit_probe(jax.random.PRNGKey(0), z, z, jnp.ones(k, bool), s)
  np.testing.assert_array_equal(same, [0, 1, 2, 3, 4])  # the two top-s agree: the top-s itself


def test_probe_evidence_is_the_scaled_difference_of_the_probes_citations():
  # One query, K = 6, s = 2: adapted top-2 {0, 1}, first stage's {2, 3}: m = 2, j = 1 each side.
  q = jnp.zeros((D,), jnp.float32).at[0].set(1.0)
  c = jnp.zeros((K, D + 3), jnp.float32)
  first = jnp.asarray([0.0, 0.0, 1.0, 0.9, 0.1, 0.1])  # feature 0: ranks 2, 3 first
  c = c.at[:, D].set(first)
  params = guard.first_stage_params(CFG)
  adapted = params.replace(w_side=jnp.asarray([-0.5, -1.0, 0.0]))  # reverses the order: 0, 1
  slates = jnp.asarray([[4, 5], [5, 4], [0, 2]], jnp.int32)  # the last slate is the probe
  mask = jnp.ones((3, 2), bool)
  for labels, want in (([[-1, -1], [-1, -1], [1, -1]], 2.0), ([[-1, -1], [-1, -1], [-1, 1]], -2.0),
                       ([[1, -1], [-1, -1], [-1, -1]], 0.0)):
    d, counts = guard.probe_evidence(adapted, params, q, c, jnp.ones(K, bool), slates, mask,
                                     jnp.asarray(labels, jnp.float32), 2)
    assert float(d) == want and bool(counts)
  d, counts = guard.probe_evidence(adapted, params, q, c, jnp.ones(K, bool), slates, mask,
                                   -jnp.ones((3, 2), jnp.float32), 2)
  assert float(d) == 0.0 and not bool(counts)  # nothing cited: no evidence


def test_guard_probe_needs_the_guard():
  with pytest.raises(ValueError, match="guard_probe=True needs guard=True"):
    EARConfig(guard_probe=True)


def test_the_probe_is_one_more_slate_and_leaves_the_policys_slates_and_training_unchanged():
  stream = to_device(_side_stream(1, seed=3))
  cfg = dataclasses.replace(CFG, guard_probe=True)
  hp = default_hparams()
  key = jax.random.PRNGKey(7)
  params = guard.first_stage_params(cfg)
  args = (params, stream.queries[0], stream.candidates[0], stream.mask[0], stream.gold[0])
  from ear_jax.core import critic as critic_lib  # pylint: disable=g-import-not-at-top
  perfect = critic_lib.make_simulated_critic(precision=1.0, recall=1.0)
  fb = learner.collect_feedback(key, *args, cfg, hp, perfect)
  plain = learner.collect_feedback(key, *args, CFG, hp, perfect)
  assert fb.slates.shape[0] == plain.slates.shape[0] + 1
  np.testing.assert_array_equal(fb.slates[:-1], plain.slates)
  np.testing.assert_array_equal(fb.labels[:-1], plain.labels)
  loss = lambda f, c: learner.query_loss(params, args[1], args[2], args[3], f, None,
                                         dataclasses.replace(c, use_replay=False), hp)[0]
  assert float(loss(fb, cfg)) == float(loss(plain, CFG))  # the probe does not train
  # The untrained adapter = the first stage: the probe is their common top-s.
  top, _ = top_s_slate(adapter_lib.adapter_scores(params, stream.queries[0],
                                                  stream.candidates[0]), stream.mask[0], S)
  np.testing.assert_array_equal(np.sort(fb.slates[-1]), np.sort(top))


def test_paging_training_slates_show_every_candidate_once():
  from ear_jax.core import policies  # pylint: disable=g-import-not-at-top
  z = jnp.asarray([0.1, 0.9, 0.5, 0.7, 0.3, 0.2])
  fb = lambda k, slate, mask: jnp.where(slate == 1, 1.0, -1.0)
  cfg = dataclasses.replace(CFG, guard=False, train_slate="paging")
  slates, mask, labels = policies.TRAIN_SLATES["paging"](jax.random.PRNGKey(0), z, None,
                                                         jnp.ones(K, bool), fb, cfg, None)
  np.testing.assert_array_equal(slates, [[1, 3], [2, 4], [5, 0]])
  assert mask.all() and float(labels[0, 0]) == 1.0 and float(labels.sum()) == -4.0
