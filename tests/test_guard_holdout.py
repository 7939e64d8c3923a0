"""The guard's held-out evidence (`EARConfig.guard_holdout`): which training queries are held out,
the ring, its evidence by hand, that held-out queries are never trained on, and the decision on
the current parameters."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.core import episode, guard, inference, learner
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.core.slates import top_s_slate
from ear_jax.core.stream import Stream, make_stream, to_device
from tests.core_utils import close_or_equal, learnable_stream

jit_push = jax.jit(guard.push_holdout, static_argnums=(9,))
jit_evidence = jax.jit(guard.holdout_evidence, static_argnums=(2,))
jit_episode = jax.jit(episode.run_episode, static_argnames=("config",))
jit_served = jax.jit(inference.served_params, static_argnames=("config",))
jit_step = jax.jit(learner.train_batch_on_feedback, static_argnames=("config",))


def test_every_nth_training_query_is_held_out():
  cfg = EARConfig(guard_holdout=3)
  np.testing.assert_array_equal(guard.held_out(0, 8, cfg),
                                [0, 0, 1, 0, 0, 1, 0, 0])
  np.testing.assert_array_equal(guard.held_out(4, 4, cfg), [0, 1, 0, 0])  # positions 4..7
  np.testing.assert_array_equal(guard.held_out(0, 4, EARConfig()), [0, 0, 0, 0])


def test_config_refuses_bad_holdout_settings():
  with pytest.raises(ValueError, match="guard_holdout must be 0"):
    EARConfig(guard_holdout=1)
  with pytest.raises(ValueError, match="guard_holdout_capacity"):
    EARConfig(guard_holdout=5, guard_holdout_capacity=0)
  assert EARConfig(guard_holdout=5).to_dict()["guard_holdout"] == 5
  assert "guard_holdout" not in EARConfig().to_dict()  # the default (off) is left out


MEM_CFG = EARConfig(dim=8, num_candidates=6, slate_size=2, num_rounds=3, replay_size=2,
                    buffer_capacity=16, batch_size=2, guard_holdout=2,
                    guard_min_queries=2, guard_holdout_capacity=8)


def _held_memory(path=None):
  config = MemoryConfig(encoder=None, config=MEM_CFG)
  m = Memory(config) if path is None else Memory.open(path, config)
  rng = np.random.default_rng(0)
  emb = rng.normal(size=(30, 8))
  ids = m.add([f"memory {i}" for i in range(30)], embeddings=emb)
  return m, rng, ids, emb / np.linalg.norm(emb, axis=-1, keepdims=True)


def _cite_first(key, view):
  del key
  return np.where(np.arange(len(view.ids)) == 0, 1.0, -1.0).astype(np.float32)


def test_memory_holds_out_every_nth_session_pages_the_first_stage_and_never_trains_on_it(
    tmp_path):
  m, rng, ids, emb = _held_memory(tmp_path / "m")
  unit = lambda x: x / np.linalg.norm(x)
  outs = []
  for j in range(8):
    q = rng.normal(size=8)
    out = m.recall(f"question {j}", _cite_first, k=2, query_embedding=q)
    outs.append(out)
    if j % 2 == 1:  # held out: T pages of the first stage's (frozen cosine) ranking, in order
      assert out.final_slate == "paging"
      shown = [i for r in out.rounds for i in r.ids]
      assert shown == [ids[f] for f in np.argsort(-(emb @ unit(q)), kind="stable")[:6]]
      assert out.ids[0] == out.rounds[0].ids[0]  # the cited (each page's first) come first
      assert list(out.ids) == [out.rounds[0].ids[0], out.rounds[1].ids[0]]
    else:
      assert out.final_slate == MEM_CFG.final_slate
  state = m.learner
  assert int(state.buffer.num_pushed) == 4  # the 4 trained sessions, not the 4 held out
  ring = state.guard
  assert int(ring.count) == 4 and int(ring.cited.any(-1).sum()) == 4
  serve, _, n = guard.holdout_decision(state.params, ring, MEM_CFG, MEM_CFG.guard_z)
  st = m.stats  # what `search` serves now, and the evidence it rests on
  assert st["guard_evidence"] == int(n) == 4 and st["serves_adapter"] == int(serve)
  before = (np.asarray(ring.candidates), np.asarray(ring.mask))
  m.save()
  m.close()
  loaded = Memory.open(tmp_path / "m")
  ring2 = loaded.learner.guard
  np.testing.assert_array_equal(np.asarray(ring2.candidates), before[0])  # gathered back
  np.testing.assert_array_equal(np.asarray(ring2.mask), before[1])
  assert int(ring2.count) == 4
  # A delete clears that memory from the ring (mask, citation, embedding).
  victim = outs[1].rounds[0].ids[0]
  loaded.delete(victim)
  ring3 = loaded.learner.guard
  gone = before[1] & ~np.asarray(ring3.mask)
  assert gone.sum() >= 1 and np.all(np.asarray(ring3.candidates)[gone] == 0.0)
  assert int(np.asarray(ring3.cited).sum()) == int(np.asarray(ring2.cited).sum()) - 1
  assert not (np.asarray(ring3.cited) & gone).any()
  loaded.close()


def _two_rankings():
  """dim 2, K 4, s 2: the first stage (frozen cosine) ranks {0, 1} first, the adapted
  (w_q = -2 I, so q~ = -q) {3, 2}."""
  cfg = EARConfig(dim=2, num_candidates=4, slate_size=2, num_rounds=2,
                  guard_holdout=2, guard_holdout_capacity=3, guard_min_queries=2)
  first = guard.first_stage_params(cfg)
  adapted = first.replace(w_q=-2.0 * jnp.eye(2))
  q = np.tile(np.asarray([[1.0, 0.0]], np.float32), (4, 1))
  c = np.tile(np.asarray([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.0]], np.float32),
              (4, 1, 1))
  return cfg, first, adapted, q, c


def test_ring_and_its_evidence_by_hand():
  cfg, first, adapted, q, c = _two_rankings()
  mask = np.ones((4, 4), bool)
  slates = np.tile(np.asarray([[0, 1], [2, 3]], np.int32), (4, 1, 1))  # every candidate shown
  labels = -np.ones((4, 2, 2), np.float32)
  labels[1, 0, 0] = labels[1, 1, 1] = 1.0  # query 1 cites 0 and 3
  labels[3, 1, 0] = 1.0  # query 3 cites 2
  labels[0, 0, 0] = 1.0  # query 0 (trained, not held out) cites 0: not in the ring
  held = np.asarray([False, True, False, True])
  ring = guard.init_guard(cfg)
  ring = jit_push(ring, first, q, c, mask, slates, np.ones((4, 2, 2), bool), labels, held, 2)
  assert int(ring.count) == 2
  np.testing.assert_array_equal(ring.cited[:2], [[1, 0, 0, 1], [0, 0, 1, 0]])
  np.testing.assert_array_equal(ring.in_first[:2], [[1, 1, 0, 0]] * 2)
  assert not ring.mask[2].any()  # the third slot is still empty
  # Whole questions: query 1's cited {0, 3} is in neither top-2 (0 - 0); query 3's {2} is in the
  # adapted top-2 only (1 - 0).
  d, counts = jit_evidence(adapted, ring, 2)
  np.testing.assert_array_equal(d, [0.0, 1.0, 0.0])
  np.testing.assert_array_equal(counts, [True, True, False])
  d, _ = jit_evidence(first, ring, 2)
  np.testing.assert_array_equal(d, [0.0, 0.0, 0.0])
  lcb, n = guard.holdout_lower_bound(adapted, ring, cfg, 0.0)
  assert float(n) == 2 and float(lcb) == pytest.approx(0.5)
  # The ring keeps the newest H = 3: two more held-out queries go to slots 2 and 0.
  ring2 = jit_push(ring, first, q, c, mask, slates, np.ones((4, 2, 2), bool), labels,
                   np.asarray([True, False, False, True]), 2)
  assert int(ring2.count) == 4
  np.testing.assert_array_equal(ring2.cited[2], [1, 0, 0, 0])  # query 0 of the second batch
  np.testing.assert_array_equal(ring2.cited[0], [0, 0, 1, 0])  # query 3 overwrote the oldest
  np.testing.assert_array_equal(ring2.cited[1], ring.cited[1])


def _batch(n=4, seed=0):
  s = learnable_stream(seed, n)
  return Stream(queries=s.queries, candidates=s.candidates, mask=s.mask, gold=s.gold,
                num_gold=s.num_gold)


def test_held_out_queries_are_not_trained_on():
  cfg = EARConfig(dim=16, num_candidates=8, slate_size=2, num_rounds=2, replay_size=2,
                  buffer_capacity=16, batch_size=4, guard_holdout=4)
  hp = default_hparams(learning_rate=1e-2)
  state = learner.init_learner(jax.random.PRNGKey(0), cfg)
  batch = _batch()
  slates = np.tile(np.asarray([[0, 1], [2, 3]], np.int32), (4, 1, 1))
  labels = np.where(np.arange(4)[:, None, None] % 2 == 0, 1.0, -1.0) * np.ones((4, 2, 2))
  labels = labels.astype(np.float32)
  keys = jax.random.split(jax.random.PRNGKey(1), 4)
  smask = np.ones((4, 2, 2), bool)
  held = np.asarray([False, False, False, True])
  a, _ = jit_step(state, keys, batch, slates, smask, labels, np.ones(4, bool), cfg, hp, held)
  b, _ = jit_step(state, keys, batch, slates, smask, labels, ~held, cfg, hp)
  for x, y in zip(jax.tree_util.tree_leaves((a.params, a.buffer)),
                  jax.tree_util.tree_leaves((b.params, b.buffer))):
    # (two programs: equal up to the compiler's float rounding; a trained query moves w by 1e-2)
    close_or_equal(x, y, rtol=1e-6, atol=1e-8)
  assert int(a.queries_seen) == 4 and int(b.queries_seen) == 3
  assert int(a.guard.count) == 1 and int(b.guard.count) == 0
  np.testing.assert_array_equal(a.guard.queries[0], batch.queries[3])


def test_episode_holds_out_pages_of_the_first_stage_and_serves_by_the_ring():
  n, every = 120, 4
  cfg = EARConfig(dim=16, num_candidates=8, slate_size=2, num_rounds=4, replay_size=2,
                  buffer_capacity=64, batch_size=4, guard_min_queries=10,
                  guard_holdout=every, guard_holdout_capacity=64)
  stream = to_device(learnable_stream(0, n))
  state, records = jit_episode(jax.random.PRNGKey(0), stream, cfg,
                               default_hparams(learning_rate=3e-2))
  ring = state.guard
  assert int(ring.count) == n // every
  held = np.arange(n) % every == every - 1
  np.testing.assert_array_equal(np.asarray(ring.queries[:n // every]),
                                np.asarray(stream.queries)[held])
  # A held-out query's T pages are the frozen cosine ranking, 2 candidates a page, in order.
  z0 = np.einsum("kd,d->k", np.asarray(stream.candidates[3]), np.asarray(stream.queries[3]))
  np.testing.assert_array_equal(np.asarray(records.slates[3]).reshape(-1),
                                np.argsort(-z0, kind="stable"))
  assert not np.array_equal(np.asarray(records.slates[2]).reshape(-1),
                            np.argsort(-np.einsum("kd,d->k", np.asarray(stream.candidates[2]),
                                                  np.asarray(stream.queries[2])), kind="stable"))
  # The trained adapter finds the hidden rotation: the ring says so and it is served.
  assert bool(guard.serve_adapted(state.params, state.guard, cfg))
  served = jit_served(state, cfg)
  np.testing.assert_array_equal(served.w_q, state.params.w_q)
  # The untrained adapter ties the first stage (d = 0 everywhere): not served, the same ranking.
  untrained = state.replace(params=guard.first_stage_params(cfg))
  assert not bool(guard.serve_adapted(untrained.params, untrained.guard, cfg))
  # Without the ring the training is the same stream's (the held-out queries train again).
  off, _ = jit_episode(jax.random.PRNGKey(0), stream, dataclasses.replace(cfg, guard_holdout=0),
                       default_hparams(learning_rate=3e-2))
  assert off.guard is None and int(off.buffer.num_pushed) == n
  assert int(state.buffer.num_pushed) == n - n // every


def test_top_mask_matches_top_s_slate():
  # (the ring's first-stage top-s is `top_s_slate`'s: ties to the lower index)
  z = jnp.asarray([0.5, 0.5, 0.2, 0.5])
  slate, m = top_s_slate(z, jnp.ones(4, bool), 2)
  top = guard._top_mask(z, jnp.ones(4, bool), 2)  # pylint: disable=protected-access
  np.testing.assert_array_equal(top, np.isin(np.arange(4), np.asarray(slate)[np.asarray(m)]))


def _side_stream(n, seed=0, d=4, k=6):
  """Candidates whose first-stage score (feature 0) ranks the two gold ones first."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, c = unit(rng.normal(size=(n, d))), unit(rng.normal(size=(n, k, d)))
  gold = np.zeros((n, k), bool)
  f0 = rng.uniform(0.0, 0.5, size=(n, k))
  for i in range(n):
    g = rng.choice(k, 2, replace=False)
    gold[i, g], f0[i, g] = True, rng.uniform(0.8, 1.0, size=2)
  feats = np.stack([f0, np.einsum("nkd,nd->nk", c, q), np.zeros_like(f0)], -1)
  return make_stream(q, c, gold=gold, features=feats)


def test_the_ring_refuses_an_adapter_worse_than_the_first_stage():
  cfg = EARConfig(dim=4, num_candidates=6, slate_size=2, num_rounds=3, replay_size=2,
                  buffer_capacity=16, batch_size=4, guard_min_queries=10,
                  guard_holdout=2, side_features=3, side_init=0.5)
  stream = to_device(_side_stream(80))
  state, _ = jit_episode(jax.random.PRNGKey(0), stream, cfg, default_hparams(learning_rate=1e-3))
  assert int(state.guard.count) == 40
  # The first stage's ranking upside down (w_side = -[1, 1, 0]) loses the gold the ring cited.
  bad = state.replace(params=guard.first_stage_params(cfg).replace(
      w_side=jnp.asarray([-1.0, -1.0, 0.0], jnp.float32)))
  lcb, n = guard.holdout_lower_bound(bad.params, bad.guard, cfg, 0.5)
  assert float(n) >= 30 and float(lcb) < 0
  assert not bool(guard.serve_adapted(bad.params, bad.guard, cfg))
  np.testing.assert_array_equal(jit_served(bad, cfg).w_side,
                                guard.first_stage_params(cfg).w_side)


def test_a_directory_of_ear_safe_before_the_held_out_ring_is_refused_naming_its_preset(
    tmp_path, monkeypatch):
  # Written with presets 1, `ear_safe` was guarded by evidence sums this version no longer has:
  # the directory is refused with a clear error; a new memory of the same name is today's.
  from ear_jax.agent.memory import config as mconfig  # pylint: disable=g-import-not-at-top
  with monkeypatch.context() as mp:
    mp.setattr(mconfig, "PRESETS_VERSION", 1)
    m = Memory.open(tmp_path / "old", MemoryConfig(encoder=None, method="ear_safe", dim=8))
    m.add(["a", "b", "c"], embeddings=np.eye(3, 8))
    m.close()
  with pytest.raises(ValueError, match="'ear_safe' of presets version 1"):
    Memory.open(tmp_path / "old")
  with Memory(MemoryConfig(encoder=None, method="ear_safe", dim=8)) as new:
    assert new.config.ear.guard_holdout == 5 and new.learner.guard is not None


def test_a_question_asked_again_keeps_its_part_across_a_save(tmp_path):
  # Held out stays held out (never trained on), trained stays trained (never scores the guard).
  m, rng, _, _ = _held_memory(tmp_path / "m")
  qs = {j: rng.normal(size=8) for j in range(5)}
  ask = lambda mem, j: mem.recall(f"question {j}", _cite_first, k=2, query_embedding=qs[j])
  assert [ask(m, j).final_slate for j in range(4)] == ["round_T", "paging"] * 2
  assert ask(m, 1).final_slate == "paging" and ask(m, 0).final_slate == "round_T"
  assert ask(m, 4).final_slate == "round_T"  # (a new question: the 5th new one, position 4)
  m.save()
  m.close()
  with Memory.open(tmp_path / "m") as back:
    assert ask(back, 3).final_slate == "paging" and ask(back, 2).final_slate == "round_T"
    qs[9] = rng.normal(size=8)
    assert ask(back, 9).final_slate == "paging"  # the 6th new question


@pytest.mark.slow
def test_the_runner_checkpoints_and_resumes_the_ring(tmp_path):
  from ear_jax.experiment import runner  # pylint: disable=g-import-not-at-top
  cfg = EARConfig(dim=16, num_candidates=8, slate_size=2, num_rounds=4, replay_size=2,
                  buffer_capacity=64, batch_size=4, guard_min_queries=4,
                  guard_holdout=4, guard_holdout_capacity=16)
  stream = learnable_stream(0, 80)
  hp = default_hparams(learning_rate=3e-2)
  seeds = [0, 1]
  train, test = runner.seed_splits(80, seeds)
  plain = runner.train_and_evaluate("ring", stream, train, test, cfg, hp, seeds)
  from ear_jax.io import run_checkpoints  # pylint: disable=g-import-not-at-top
  with pytest.raises(runner.Interrupted):  # stopped after its first chunk: a partial ring saved
    runner.train_and_evaluate(
        "ring", stream, train, test, cfg, hp, seeds, checkpoint_every=8, stop_after_chunks=1,
        checkpointer=run_checkpoints.RunCheckpointer(tmp_path / "ck"))
  resumed = runner.train_and_evaluate(
      "ring", stream, train, test, cfg, hp, seeds, checkpoint_every=8, resume=True,
      checkpointer=run_checkpoints.RunCheckpointer(tmp_path / "ck"))
  for a, b in zip(jax.tree_util.tree_leaves(plain.final_state.guard),
                  jax.tree_util.tree_leaves(resumed.final_state.guard)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(np.asarray(plain.final_state.guard.count)[0]) == train.shape[1] // 4
  np.testing.assert_array_equal(plain.eval["adapter_slates"], resumed.eval["adapter_slates"])


def test_a_held_out_question_asked_again_is_in_the_ring_once():
  m, rng, _, _ = _held_memory()
  qs = [rng.normal(size=8) for _ in range(8)]
  for _ in range(3):  # three epochs of the same 8 questions: 4 held out, each in the ring once
    for j, q in enumerate(qs):
      m.recall(f"question {j}", _cite_first, k=2, query_embedding=q)
  state = m.learner
  assert int(state.guard.count) == 4
  assert int(state.buffer.num_pushed) == 12  # the 4 trained questions, every epoch
  m.close()


def test_held_out_pages_interleave_both_rankings_when_the_rounds_cannot_show_every_candidate():
  cfg = EARConfig(dim=4, num_candidates=6, slate_size=1, num_rounds=4, guard_holdout=5)
  z_first = jnp.asarray([6.0, 5.0, 4.0, 3.0, 2.0, 1.0])  # ranks 0..5
  z_adapted = jnp.asarray([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # the reverse
  where = jnp.asarray([True, True, True, True, True, False])
  scores = guard.page_relevance(z_adapted, z_first, where, cfg)
  # adapted #1 (4; 5 is not a candidate), first #1 (0), adapted #2 (3), first #2 (1), ...
  np.testing.assert_array_equal(np.argsort(-np.asarray(scores), kind="stable")[:4], [4, 0, 3, 1])
  # T s >= K: the first stage's relevance itself, bit for bit (ear_safe at K = T s unchanged)
  covering = dataclasses.replace(cfg, num_rounds=6)
  assert guard.page_relevance(z_adapted, z_first, where, covering) is z_first


def test_episode_pages_held_out_queries_over_both_rankings_beyond_t_s():
  n, every = 64, 4
  cfg = EARConfig(dim=16, num_candidates=8, slate_size=1, num_rounds=4, replay_size=2,
                  buffer_capacity=64, batch_size=4, guard_min_queries=10,
                  guard_holdout=every, guard_holdout_capacity=64)
  stream = to_device(learnable_stream(0, n))
  hp = default_hparams(learning_rate=3e-2)
  _, records = jit_episode(jax.random.PRNGKey(0), stream, cfg, hp)
  # The first held-out query (position 3, its batch starts from the untrained adapter): both
  # rankings are the frozen cosine, so its 4 pages are that ranking's top 4, once each.
  z0 = np.einsum("kd,d->k", np.asarray(stream.candidates[3]), np.asarray(stream.queries[3]))
  np.testing.assert_array_equal(np.asarray(records.slates[3]).reshape(-1),
                                np.argsort(-z0, kind="stable")[:4])
  # Later ones show the first stage's top two and the adapted ranking's, each candidate once;
  # as the adapter learns, the pages are no longer the first stage's top 4 alone.
  differs = []
  for i in range(every - 1, n, every):
    shown = np.asarray(records.slates[i]).reshape(-1)
    z0 = np.einsum("kd,d->k", np.asarray(stream.candidates[i]), np.asarray(stream.queries[i]))
    first = np.argsort(-z0, kind="stable")
    assert len(set(shown.tolist())) == 4 and set(first[:2]) <= set(shown.tolist())
    differs.append(set(shown.tolist()) != set(first[:4].tolist()))
  assert any(differs)
