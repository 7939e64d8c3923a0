"""The guard's held-out evidence (`EARConfig.guard_holdout`, issue 27): which training queries are
held out, the ring, its evidence by hand, that held-out queries are never trained on, and the
decision on the current parameters."""
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
from tests.core_utils import learnable_stream

jit_push = jax.jit(guard.push_holdout, static_argnums=(9,))
jit_evidence = jax.jit(guard.holdout_evidence, static_argnums=(2, 3))
jit_episode = jax.jit(episode.run_episode, static_argnames=("config",))
jit_served = jax.jit(inference.served_params, static_argnames=("config",))
jit_step = jax.jit(learner.train_batch_on_feedback, static_argnames=("config",))


def test_every_nth_training_query_is_held_out():
  cfg = EARConfig(guard=True, guard_holdout=3)
  np.testing.assert_array_equal(guard.held_out(0, 8, cfg),
                                [0, 0, 1, 0, 0, 1, 0, 0])
  np.testing.assert_array_equal(guard.held_out(4, 4, cfg), [0, 1, 0, 0])  # positions 4..7
  np.testing.assert_array_equal(guard.held_out(0, 4, EARConfig(guard=True)), [0, 0, 0, 0])


def test_config_refuses_bad_holdout_settings():
  with pytest.raises(ValueError, match="guard_holdout must be 0"):
    EARConfig(guard=True, guard_holdout=1)
  with pytest.raises(ValueError, match="needs guard=True"):
    EARConfig(guard_holdout=5)
  with pytest.raises(ValueError, match="choose one"):
    EARConfig(guard=True, guard_holdout=5, guard_probe=True)
  with pytest.raises(ValueError, match="guard_holdout_capacity"):
    EARConfig(guard=True, guard_holdout=5, guard_holdout_capacity=0)
  assert EARConfig(guard=True, guard_holdout=5).to_dict()["guard_holdout"] == 5
  assert "guard_holdout" not in EARConfig(guard=True).to_dict()  # the default is left out


MEM_CFG = EARConfig(dim=8, num_candidates=6, slate_size=2, num_rounds=3, replay_size=2,
                    buffer_capacity=16, batch_size=2, guard=True, guard_holdout=2,
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
  ring = state.guard.holdout
  assert int(ring.count) == 4 and int(ring.cited.any(-1).sum()) == 4
  serve, _, n = guard.holdout_decision(state.params, ring, MEM_CFG, MEM_CFG.guard_z)
  st = m.stats  # what `search` serves now, and the evidence it rests on
  assert st["guard_evidence"] == int(n) == 4 and st["serves_adapter"] == int(serve)
  before = (np.asarray(ring.candidates), np.asarray(ring.mask))
  m.save()
  m.close()
  loaded = Memory.open(tmp_path / "m")
  ring2 = loaded.learner.guard.holdout
  np.testing.assert_array_equal(np.asarray(ring2.candidates), before[0])  # gathered back
  np.testing.assert_array_equal(np.asarray(ring2.mask), before[1])
  assert int(ring2.count) == 4
  # A delete clears that memory from the ring (mask, citation, embedding).
  victim = outs[1].rounds[0].ids[0]
  loaded.delete(victim)
  ring3 = loaded.learner.guard.holdout
  gone = before[1] & ~np.asarray(ring3.mask)
  assert gone.sum() >= 1 and np.all(np.asarray(ring3.candidates)[gone] == 0.0)
  assert int(np.asarray(ring3.cited).sum()) == int(np.asarray(ring2.cited).sum()) - 1
  assert not (np.asarray(ring3.cited) & gone).any()
  loaded.close()


def _two_rankings():
  """dim 2, K 4, s 2: the first stage (frozen cosine) ranks {0, 1} first, the adapted
  (w_q = -2 I, so q~ = -q) {3, 2}."""
  cfg = EARConfig(dim=2, num_candidates=4, slate_size=2, num_rounds=2, guard=True,
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
  ring = guard.init_guard(cfg).holdout
  ring = jit_push(ring, first, q, c, mask, slates, np.ones((4, 2, 2), bool), labels, held, 2)
  assert int(ring.count) == 2
  np.testing.assert_array_equal(ring.cited[:2], [[1, 0, 0, 1], [0, 0, 1, 0]])
  np.testing.assert_array_equal(ring.in_first[:2], [[1, 1, 0, 0]] * 2)
  assert not ring.mask[2].any()  # the third slot is still empty
  d, counts = jit_evidence(adapted, ring, 2, False)
  # query 1: cited 3 in the adapted top-2, 0 in the first's: 1 - 1; query 3: 2 only in adapted
  np.testing.assert_array_equal(d, [0.0, 1.0, 0.0])
  np.testing.assert_array_equal(counts, [True, True, False])
  d, _ = jit_evidence(adapted, ring, 2, True)  # whole questions: {0, 3} is in neither top-2
  np.testing.assert_array_equal(d, [0.0, 1.0, 0.0])
  d, _ = jit_evidence(first, ring, 2, False)
  np.testing.assert_array_equal(d, [0.0, 0.0, 0.0])
  # 'dcg': sum 1 / log2(2 + rank) of the cited over the whole ranking, adapted minus first stage's:
  # query 1 (0 and 3 swap ranks 0 and 3): 0; query 3 (candidate 2: rank 2 -> rank 1).
  d, counts = guard.holdout_evidence(adapted, ring, 2, first=first)
  np.testing.assert_allclose(d, [0.0, 1 / np.log2(3) - 1 / np.log2(4), 0.0], atol=1e-6)
  np.testing.assert_array_equal(counts, [True, True, False])
  with pytest.raises(ValueError, match="needs guard_holdout"):
    EARConfig(guard=True, guard_evidence="dcg")
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
                  buffer_capacity=16, batch_size=4, guard=True, guard_holdout=4)
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
    np.testing.assert_array_equal(x, y)
  assert int(a.queries_seen) == 4 and int(b.queries_seen) == 3
  assert int(a.guard.holdout.count) == 1 and int(b.guard.holdout.count) == 0
  np.testing.assert_array_equal(a.guard.holdout.queries[0], batch.queries[3])


def test_episode_holds_out_pages_of_the_first_stage_and_serves_by_the_ring():
  n, every = 120, 4
  cfg = EARConfig(dim=16, num_candidates=8, slate_size=2, num_rounds=4, replay_size=2,
                  buffer_capacity=64, batch_size=4, guard=True, guard_min_queries=10,
                  guard_holdout=every, guard_holdout_capacity=64)
  stream = to_device(learnable_stream(0, n))
  state, records = jit_episode(jax.random.PRNGKey(0), stream, cfg,
                               default_hparams(learning_rate=3e-2))
  ring = state.guard.holdout
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
  assert bool(guard.serve_adapted(state.guard, cfg, params=state.params))
  served = jit_served(state, cfg)
  np.testing.assert_array_equal(served.w_q, state.params.w_q)
  # The untrained adapter ties the first stage (d = 0 everywhere): not served, the same ranking.
  untrained = state.replace(params=guard.first_stage_params(cfg))
  assert not bool(guard.serve_adapted(untrained.guard, cfg, params=untrained.params))
  with pytest.raises(ValueError, match="pass params"):
    guard.serve_adapted(state.guard, cfg)
  # Without the ring the training is the same stream's (the held-out queries train again).
  off, _ = jit_episode(jax.random.PRNGKey(0), stream, dataclasses.replace(cfg, guard_holdout=0),
                       default_hparams(learning_rate=3e-2))
  assert off.guard.holdout is None and int(off.buffer.num_pushed) == n
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
                  buffer_capacity=16, batch_size=4, guard=True, guard_min_queries=10,
                  guard_holdout=2, side_features=3, side_init=0.5)
  stream = to_device(_side_stream(80))
  state, _ = jit_episode(jax.random.PRNGKey(0), stream, cfg, default_hparams(learning_rate=1e-3))
  assert int(state.guard.holdout.count) == 40
  # The first stage's ranking upside down (w_side = -[1, 1, 0]) loses the gold the ring cited.
  bad = state.replace(params=guard.first_stage_params(cfg).replace(
      w_side=jnp.asarray([-1.0, -1.0, 0.0], jnp.float32)))
  lcb, n = guard.holdout_lower_bound(bad.params, bad.guard.holdout, cfg, 0.5)
  assert float(n) >= 30 and float(lcb) < 0
  assert not bool(guard.serve_adapted(bad.guard, cfg, params=bad.params))
  np.testing.assert_array_equal(jit_served(bad, cfg).w_side,
                                guard.first_stage_params(cfg).w_side)


def test_a_directory_of_the_earlier_ear_safe_opens_as_it_was_created(tmp_path, monkeypatch):
  # Written before session 11 (meta `presets` 1): `ear_safe` was the prequential guard. Opened now,
  # the directory keeps those settings (pinned as a config), its learner loads, and a new memory
  # of the same name gets today's preset.
  from ear_jax.agent.memory import config as mconfig  # pylint: disable=g-import-not-at-top
  from ear_jax.core import config as core_config  # pylint: disable=g-import-not-at-top
  old = dict(core_config.METHODS["ear_safe"], **mconfig.PRESET_CHANGES[2]["ear_safe"])
  with monkeypatch.context() as mp:
    mp.setitem(core_config.METHODS, "ear_safe", old)
    mp.setattr(mconfig, "PRESETS_VERSION", 1)
    m = Memory.open(tmp_path / "old", MemoryConfig(encoder=None, method="ear_safe", dim=8))
    m.add(["a", "b", "c"], embeddings=np.eye(3, 8))
    assert m.learner.guard.holdout is None
    m.close()
  with Memory.open(tmp_path / "old") as back:
    assert back.config.ear.guard and back.config.ear.guard_holdout == 0
    assert back.config.ear.guard_z == 0.5 and back.learner.guard.holdout is None
    assert len(back.list()) == 3
  with pytest.raises(ValueError, match="guard_holdout"):  # today's ear_safe differs: named
    Memory.open(tmp_path / "old", MemoryConfig(encoder=None, method="ear_safe", dim=8))
  with Memory(MemoryConfig(encoder=None, method="ear_safe", dim=8)) as new:
    assert new.config.ear.guard_holdout == 5 and new.learner.guard.holdout is not None


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
                  buffer_capacity=64, batch_size=4, guard=True, guard_min_queries=4,
                  guard_holdout=4, guard_holdout_capacity=16)
  stream = learnable_stream(0, 80)
  hp = default_hparams(learning_rate=3e-2)
  seeds = [0, 1]
  train, test = runner.seed_splits(80, seeds)
  plain = runner.train_and_evaluate("ring", stream, train, test, cfg, hp, seeds)
  from ear_jax.experiment import checkpointing  # pylint: disable=g-import-not-at-top
  with pytest.raises(runner.Interrupted):  # stopped after its first chunk: a partial ring saved
    runner.train_and_evaluate(
        "ring", stream, train, test, cfg, hp, seeds, checkpoint_every=8, stop_after_chunks=1,
        checkpointer=checkpointing.RunCheckpointer(tmp_path / "ck"))
  resumed = runner.train_and_evaluate(
      "ring", stream, train, test, cfg, hp, seeds, checkpoint_every=8, resume=True,
      checkpointer=checkpointing.RunCheckpointer(tmp_path / "ck"))
  for a, b in zip(jax.tree_util.tree_leaves(plain.final_state.guard),
                  jax.tree_util.tree_leaves(resumed.final_state.guard)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(np.asarray(plain.final_state.guard.holdout.count)[0]) == train.shape[1] // 4
  np.testing.assert_array_equal(plain.eval["adapter_slates"], resumed.eval["adapter_slates"])


def test_a_held_out_question_asked_again_is_in_the_ring_once():
  m, rng, _, _ = _held_memory()
  qs = [rng.normal(size=8) for _ in range(8)]
  for _ in range(3):  # three epochs of the same 8 questions: 4 held out, each in the ring once
    for j, q in enumerate(qs):
      m.recall(f"question {j}", _cite_first, k=2, query_embedding=q)
  state = m.learner
  assert int(state.guard.holdout.count) == 4
  assert int(state.buffer.num_pushed) == 12  # the 4 trained questions, every epoch
  m.close()


def test_config_checks_guard_pages():
  with pytest.raises(ValueError, match="guard_pages"):
    EARConfig(guard=True, guard_holdout=5, guard_pages="random")
  with pytest.raises(ValueError, match="needs guard_holdout"):
    EARConfig(guard=True, guard_pages="shuffled")
  cfg = EARConfig(guard=True, guard_holdout=5, guard_pages="shuffled")
  assert EARConfig.from_dict(cfg.to_dict()) == cfg
  assert "guard_pages" not in EARConfig(guard=True, guard_holdout=5).to_dict()  # the default


def test_page_order_is_the_first_stage_or_a_random_order_per_key():
  z = jnp.asarray([0.9, 0.1, 0.5, 0.3, 0.7, 0.2])
  key = jax.random.PRNGKey(3)
  first = EARConfig(guard=True, guard_holdout=2)
  np.testing.assert_array_equal(guard.page_order(key, z, first), z)
  shuffled = dataclasses.replace(first, guard_pages="shuffled")
  a = np.asarray(guard.page_order(key, z, shuffled))
  assert a.shape == (6,) and len(set(a.tolist())) == 6  # distinct scores: an order
  np.testing.assert_array_equal(a, guard.page_order(key, z + 5.0, shuffled))  # not by z
  orders = {tuple(np.argsort(-np.asarray(guard.page_order(jax.random.PRNGKey(i), z, shuffled))))
            for i in range(20)}
  assert len(orders) > 10  # another key, another order


def test_episode_pages_held_out_queries_in_a_random_order_with_guard_pages_shuffled():
  n, every = 40, 4
  cfg = EARConfig(dim=16, num_candidates=8, slate_size=2, num_rounds=4, replay_size=2,
                  buffer_capacity=64, batch_size=4, guard=True, guard_min_queries=10,
                  guard_holdout=every, guard_holdout_capacity=64, guard_pages="shuffled")
  stream = to_device(learnable_stream(0, n))
  hp = default_hparams(learning_rate=3e-2)
  state, records = jit_episode(jax.random.PRNGKey(0), stream, cfg, hp)
  first, first_records = jit_episode(jax.random.PRNGKey(0), stream,
                                     dataclasses.replace(cfg, guard_pages="first_stage"), hp)
  held = np.flatnonzero(np.arange(n) % every == every - 1)
  in_order = 0
  for i in held:  # every candidate once, in an order that is not the first stage's
    pages = np.asarray(records.slates[i]).reshape(-1)
    assert sorted(pages.tolist()) == list(range(8))
    z0 = np.einsum("kd,d->k", np.asarray(stream.candidates[i]), np.asarray(stream.queries[i]))
    in_order += np.array_equal(pages, np.argsort(-z0, kind="stable"))
  assert in_order == 0
  # Only the held-out queries' pages differ: the trained queries' slates and the adapter are
  # the same (held-out queries are never trained on).
  trained = np.setdiff1d(np.arange(n), held)
  np.testing.assert_array_equal(np.asarray(records.slates)[trained],
                                np.asarray(first_records.slates)[trained])
  np.testing.assert_array_equal(np.asarray(state.params.w_q), np.asarray(first.params.w_q))
  np.testing.assert_array_equal(np.asarray(state.guard.holdout.in_first),
                                np.asarray(first.guard.holdout.in_first))


def test_memory_pages_a_held_out_question_shuffled_and_answers_by_the_first_stage():
  cfg = dataclasses.replace(MEM_CFG, guard_pages="shuffled")
  m = Memory(MemoryConfig(encoder=None, config=cfg))
  rng = np.random.default_rng(0)
  emb = rng.normal(size=(30, 8))
  ids = m.add([f"memory {i}" for i in range(30)], embeddings=emb)
  emb = emb / np.linalg.norm(emb, axis=-1, keepdims=True)
  unit = lambda x: x / np.linalg.norm(x)
  shuffled = 0
  for j in range(8):
    q = rng.normal(size=8)
    out = m.recall(f"question {j}", _cite_first, k=2, query_embedding=q)
    if j % 2 == 0:
      continue
    ranking = [ids[f] for f in np.argsort(-(emb @ unit(q)), kind="stable")[:6]]
    shown = [i for r in out.rounds for i in r.ids]
    assert sorted(shown) == sorted(ranking)  # every candidate once
    shuffled += shown != ranking
    cited = [r.ids[0] for r in out.rounds]  # (the critic cites each page's first)
    expect = [i for i in ranking if i in cited] + [i for i in ranking if i not in cited]
    assert list(out.ids) == expect[:2]  # cited first, in the first stage's order
  assert shuffled >= 3
  assert int(m.learner.guard.holdout.count) == 4
  m.close()


def test_a_held_out_sessions_shuffled_pages_continue_after_a_reopen(tmp_path):
  cfg = dataclasses.replace(MEM_CFG, guard_pages="shuffled")
  m = Memory.open(tmp_path / "m", MemoryConfig(encoder=None, config=cfg))
  rng = np.random.default_rng(1)
  m.add([f"memory {i}" for i in range(30)], embeddings=rng.normal(size=(30, 8)))
  m.recall("question 0", _cite_first, k=2, query_embedding=rng.normal(size=8))  # trained
  q = rng.normal(size=8)
  s = m.session("question 1", query_embedding=q)
  assert s.held_out
  first = s.round(2)
  s.feedback([first.ids[0]])
  m.save()
  m.close()
  m = Memory.open(tmp_path / "m")
  s = m.session(resume=s.id)
  pages = [first, s.round(2)]
  s.feedback([])
  pages.append(s.round(2))
  shown = [i for p in pages for i in p.ids]
  assert len(set(shown)) == 6  # the same order as before the reopen: no candidate twice
  # ... and it is the order a memory that never closed shows (the same seed and session id)
  again = Memory(MemoryConfig(encoder=None, config=cfg))
  rng = np.random.default_rng(1)
  again.add([f"memory {i}" for i in range(30)], embeddings=rng.normal(size=(30, 8)))
  again.recall("question 0", _cite_first, k=2, query_embedding=rng.normal(size=8))
  t = again.session("question 1", query_embedding=rng.normal(size=8))
  assert [i for _ in range(3) for i in (t.round(2).ids, t.feedback([]))[0]] == shown
  m.close()
  again.close()
