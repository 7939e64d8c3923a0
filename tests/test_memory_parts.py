"""The parts of a query's life in `Memory`, through the public API: a `Session`'s rounds and when it
goes to the learner, eviction, the learner queue across a save, the bank's capacity and the faiss
searcher's scope selectors; and that `Memory`'s training is the core's (one query and one experience
per question, as `run_episode`). The device bank's pure functions are tested in
tests/test_device_bank.py, the table in tests/test_table.py."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import Memory, MemoryConfig, SessionDroppedError
from ear_jax.core import episode as episode_lib
from ear_jax.core import retrieval as retrieval_lib
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.core.critic import OracleCritic
from ear_jax.core.stream import make_stream
from tests.test_forget import stored_embeddings
from tests.memory_helpers import config as _config, unit as _unit

_D = 16


def _memory(n=24, path=None, **settings):
  config = MemoryConfig(encoder=None, config=settings.pop("config", _config()), **settings)
  m = Memory(config) if path is None else Memory.open(path, config)
  m.add([f"t{i}" for i in range(n)], embeddings=np.random.default_rng(0).normal(size=(n, _D)))
  return m


def _queries(n, seed=7):
  return _unit(np.random.default_rng(seed).normal(size=(n, _D)))


# ------------------------------------------------------------------------------------------------
# the bank's capacity


def test_capacity_is_a_power_of_two_then_grows_in_quarter_steps():
  assert [bank_lib.capacity_for(n) for n in (1, 33, 4096, 4097, 5121, 8192, 10_000, 1_000_000)] == [
      32, 64, 4096, 5120, 6144, 8192, 10240, 1_048_576]
  for n in range(1, 200_000, 997):  # always holds n, wastes at most a quarter beyond 4,096
    c = bank_lib.capacity_for(n)
    assert n <= c and (c <= 4096 or c <= 1.25 * n)


@pytest.mark.slow  # (compiles the search for two capacities)
def test_the_capacity_grows_with_the_memories_and_search_keeps_working():
  m = _memory(n=20, initial_capacity=32)
  assert m.stats["capacity"] == 32 and m.stats["memories"] == 20
  m.add([f"u{i}" for i in range(20)], embeddings=_queries(20, 3))
  assert m.stats["capacity"] == 64 and len(m) == 40
  assert m.search(query_embedding=_queries(1, 3)[0], k=1).ids == ("m20",)


# ------------------------------------------------------------------------------------------------
# sessions


def test_a_session_closes_after_t_explorer_rounds_or_one_adapter_only_round():
  m = _memory(config=_config(num_rounds=3, batch_size=4))
  s = m.session("q", query_embedding=_queries(1)[0])
  assert (s.rounds, s.closed, s.question) == (0, False, "q")
  for t in range(3):
    r = s.round(2, explore=True)
    assert (r.round, r.explore, r.session_id, len(r)) == (t + 1, True, s.id, 2)
    s.feedback([r.ids[0]])
    assert s.rounds == t + 1 and s.closed == (t == 2)
  assert m.stats["ready"] == 1 and m.stats["pending"] == 1  # queued: one training query
  with pytest.raises(ValueError, match="closed"):
    s.round(2)
  s2 = m.session(query_embedding=_queries(1, 8)[0])
  r = s2.round(1, explore=False)
  assert (r.round, r.explore) == (1, False)
  s2.feedback([])
  assert s2.closed and m.stats["ready"] == 2
  s3 = m.session(query_embedding=_queries(1, 9)[0])
  s3.round(2)
  s3.round(2)  # a new round before feedback discards the open one
  assert s3.rounds == 0 and not s3.close() and s3.closed
  assert m.stats["ready"] == 2  # (no feedback: nothing to train)
  with pytest.raises(ValueError, match="no open round"):
    m.session(query_embedding=_queries(1, 10)[0]).feedback([])


def test_eviction_queues_least_recently_used_sessions_with_feedback_and_drops_the_others():
  m = _memory(max_sessions=2)
  a = m.session(query_embedding=_queries(1, 1)[0])
  a.feedback(a.round(1, explore=True).ids)  # a: one round of feedback, still open
  b = m.session(query_embedding=_queries(1, 2)[0])
  b.round(1, explore=True)  # b: open, no feedback
  c = m.session(query_embedding=_queries(1, 3)[0])  # a is the least recently used: queued
  assert m.stats["ready"] == 1
  with pytest.raises(SessionDroppedError, match="evicted"):
    a.round(1)
  c.round(1)
  m.session(query_embedding=_queries(1, 4)[0])  # b had no feedback: dropped
  assert m.stats["ready"] == 1
  with pytest.raises(SessionDroppedError, match="evicted"):
    b.feedback([])
  c.round(1)  # c is kept


def test_eviction_drops_closed_sessions_before_open_ones_each_least_recently_used_first():
  m = _memory(max_sessions=5, config=_config(batch_size=8))
  ss = [m.session(query_embedding=q) for q in _queries(5, 1)]
  for s in (ss[2], ss[4]):  # closed: 2 and 4; open: 0, 1, 3 (0 least recently used)
    s.feedback(s.round(1, explore=False).ids)
    assert s.closed
  for q in _queries(3, 2):  # 3 over the limit
    m.session(query_embedding=q)
  for j in (0, 2, 4):
    with pytest.raises(SessionDroppedError, match="evicted"):
      m.session(resume=ss[j].id)
  for j in (1, 3):
    assert m.session(resume=ss[j].id).round(1)
  assert m.stats["ready"] == 2  # (evicting a closed session loses nothing: it was queued)


# ------------------------------------------------------------------------------------------------
# the learner queue


def test_one_learner_step_per_batch_size_closed_sessions():
  m = _memory()
  trained = []
  for q in _queries(5):
    s = m.session(query_embedding=q)
    s.round(3, explore=False)
    trained.append(s.feedback([]))  # (an adapter-only round's feedback closes the session)
  assert trained == [False, True, False, True, False]
  st = m.learner
  assert int(st.step) == 2 == m.stats["learner_steps"] and int(st.queries_seen) == 4
  assert m.stats["ready"] == 1 and int(st.buffer.num_pushed) == 4


@pytest.mark.slow  # (a save and an open)
def test_the_learner_queue_survives_a_save_and_a_reopen(tmp_path):
  m = _memory(path=tmp_path / "mem")
  for q in _queries(3):
    s = m.session(query_embedding=q)
    s.feedback(s.round(3, explore=False).ids[:1])
  assert int(m.learner.step) == 1 and m.stats["ready"] == 1
  m.save()  # (queues nothing: the waiting session is saved with the learner)
  assert int(m.learner.step) == 1 and m.stats["ready"] == 1
  m.close()
  with Memory.open(tmp_path / "mem") as back:
    assert back.stats["ready"] == 1 and int(back.learner.step) == 1
    s = back.session(query_embedding=_queries(1, 3)[0])
    s.round(3, explore=False)
    assert s.feedback([])  # the saved item and this one: a batch
    assert int(back.learner.step) == 2 and int(back.learner.queries_seen) == 4


@pytest.mark.slow
def test_searcher_selectors_follow_adds_across_ivf_training(monkeypatch):
  from ear_jax.index import ann  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(10)
  vecs = _unit(rng.normal(size=(40, _D)))
  scopes = np.asarray(rng.integers(0, 3, 40), np.int32)  # the bank's scope codes
  s = ann.faiss_ivf(_D, nlist=2, nprobe=2, train_factor=8)  # trained at 16 vectors
  monkeypatch.setattr(ann, "FEW_ROWS", 0)  # (the selectors themselves, not the exact fallback)
  q = _unit(rng.normal(size=(3, _D)))
  for start, stop in ((0, 10), (10, 25), (25, 40)):  # untrained (flat), then trained
    s.add(np.arange(start, stop), vecs[start:stop], np.zeros(stop - start, np.int8),
          scopes[start:stop])
    for codes in ((1,), (0, 2)):
      allowed = np.isin(np.arange(3), codes)
      rows, mask = s.search(q, 4, False, allowed)
      ok = np.flatnonzero(np.isin(scopes[:stop], codes))
      want = ok[np.argsort(-(vecs[ok] @ q.T), axis=0, kind="stable")[:4]].T  # every list probed
      for i in range(len(q)):
        assert sorted(rows[i][mask[i]]) == sorted(want[i]) and mask[i].sum() == min(4, len(ok))


# ------------------------------------------------------------------------------------------------
# Memory trains what the core trains


@pytest.mark.slow
def test_memory_trains_one_query_per_question_and_pushes_the_experience_run_episode_pushes(
    tmp_path):
  """Two questions, T=2 Explorer rounds each through sessions, citing exactly the gold: ONE
  learner step on TWO training queries (not 2 T), and the buffer rows (query, candidates, mask,
  observed, ybar), the slates and the parameters equal `run_episode`'s with the oracle critic on
  the same candidates."""
  cfg = _config()
  hp = default_hparams()
  rng = np.random.default_rng(6)
  q = _unit(rng.normal(size=(2, _D)))
  m = Memory.open(tmp_path / "mem", MemoryConfig(encoder=None, config=cfg, seed=0))
  ids = m.add([f"t{i}" for i in range(24)], embeddings=_unit(rng.normal(size=(24, _D))))
  emb = stored_embeddings(tmp_path / "mem", ids)
  idx, _, mask = retrieval_lib.top_k_search(q, emb, np.ones(24, bool), 8)
  idx = np.asarray(idx)
  gold = np.zeros((2, 8), bool)
  gold[:, [2, 5]] = True  # two gold memories per question, below the frozen top-s
  gold_ids = [{ids[r] for r in idx[j][gold[j]]} for j in range(2)]
  sessions = [m.session(t, query_embedding=q[j]) for j, t in enumerate("ab")]
  slates = [[], []]
  for _ in range(cfg.num_rounds):
    rs = [s.round(3, explore=True) for s in sessions]
    assert int(m.learner.step) == 0  # no round is trained on its own
    for j, (s, r) in enumerate(zip(sessions, rs)):
      slates[j].append([[ids[x] for x in idx[j]].index(i) for i in r.ids])
      s.feedback([i for i in r.ids if i in gold_ids[j]])
  st = m.learner
  assert int(st.step) == 1 and int(st.queries_seen) == 2 and int(st.buffer.num_pushed) == 2

  stream = make_stream(q, emb[idx], np.asarray(mask), gold)
  ref, records = episode_lib.run_episode(jax.random.PRNGKey(0), stream, cfg, hp, OracleCritic())
  for f in ("queries", "candidates", "mask", "observed", "ybar"):
    np.testing.assert_allclose(np.asarray(getattr(st.buffer, f))[:2],
                               np.asarray(getattr(ref.buffer, f))[:2], rtol=1e-6, err_msg=f)
  assert np.asarray(st.buffer.observed)[:2].sum() > 3  # the rounds explored
  np.testing.assert_array_equal(np.asarray(slates), np.asarray(records.slates))
  for x, y in zip(jax.tree_util.tree_leaves(st.params), jax.tree_util.tree_leaves(ref.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
  assert not np.allclose(np.asarray(st.params.w_q), 0.0)
