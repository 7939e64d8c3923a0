"""Deletes and updates while memories are shown: a critic that deletes or updates a shown memory
inside `recall`, and a thread deleting while another loops `search` / `recall`, never crash; the
answer leaves deleted memories out (`Recall.dropped` names them) and shows updated ones as they are
now; a session a delete dropped says so, and `search` opens no session."""
import threading

import numpy as np
import pytest

from ear_jax import EARConfig
from ear_jax.agent.memory import Memory, SessionDroppedError

D = 8
K = 6


def _memory(n=12, seed=0, **kw):
  cfg = EARConfig(dim=D, num_candidates=K, slate_size=3, num_rounds=2, batch_size=2,
                  buffer_capacity=16, replay_size=2)  # (tests/test_memory_scopes.py's config)
  m = Memory(None, config=cfg, **kw)
  rng = np.random.default_rng(seed)
  m.add([f"text {i}" for i in range(n)], embeddings=rng.normal(size=(n, D)))
  return m, rng


def _editing_critic(m, rng, op, seen):
  """A critic that deletes (or updates) the first memory of every slate it is shown."""

  def critic(key, view):
    del key
    seen.append((list(view.ids), list(view.texts)))
    if op == "delete":
      m.delete(view.ids[0])
    else:
      m.update(view.ids[0], text=f"corrected {view.ids[0]}", embedding=rng.normal(size=D))
    return np.ones(len(view.ids), np.float32)

  return critic


@pytest.mark.parametrize("op", ["delete", "update"])
@pytest.mark.parametrize("learn", [False, True])
def test_a_critic_that_edits_a_shown_memory_inside_recall_gets_an_answer(learn, op):
  m, rng = _memory()
  seen = []
  out = m.recall("q", _editing_critic(m, rng, op, seen), k=3,
                 query_embedding=rng.normal(size=D), learn=learn)
  edited = [ids[0] for ids, _ in seen]
  live = {r["id"]: r["text"] for r in m.list()}
  assert len(out) == len(out.texts) == len(out.scores) and len(out) >= 1
  assert all(i in live for i in out.ids)  # never a deleted memory in the answer
  assert list(out.texts) == [live[i] for i in out.ids]  # updated ones as they are now
  if op == "delete":
    assert set(out.dropped) == set(edited) & set(sum((ids for ids, _ in seen), []))
    assert not set(out.ids) & set(edited)
  else:
    assert out.dropped == ()
  for ids, texts in seen:  # the critic never saw a tombstone
    assert all(i and not i.startswith("\x00") for i in ids) and all(texts)
  if learn:  # the delete dropped the session: the rounds end, nothing is trained
    assert len(seen) == 1 and out.labels == (None,)
    assert m.stats["recall_sessions_dropped"] == 1 and m.stats["pending"] == 0
  else:  # the frozen rounds go on without the deleted memory
    assert len(seen) == m.config.ear.num_rounds and len(set(edited)) == len(edited)


@pytest.mark.parametrize("k, deletes", [(1, 1), (2, 1), (2, 2)])
def test_test_time_paging_goes_on_past_the_memories_the_critic_deletes(k, deletes):
  """A critic deleting what it was shown ended `recall(learn=False)`'s pages (1 critic call of
  T = 4, an empty answer), and a page after a delete skipped the memory that moved up into the
  pages already shown. The pages show the served ranking's next memories, none skipped."""
  cfg = EARConfig(dim=D, num_candidates=12, slate_size=2, num_rounds=4, batch_size=2,
                  buffer_capacity=16, replay_size=2)
  m = Memory(None, config=cfg)
  rng = np.random.default_rng(1)
  m.add([f"text {i}" for i in range(20)], embeddings=rng.normal(size=(20, D)))
  q = rng.normal(size=D)
  untouched = m.recall("q", lambda key, view: -np.ones(len(view.ids)), k=k, query_embedding=q,
                       learn=False)
  ranking = [i for page in untouched.rounds for i in page.ids]
  assert len(ranking) == 4 * k
  seen = []

  def critic(key, view):
    del key
    seen.append(list(view.ids))
    m.delete(list(view.ids[:deletes]))  # then cites the others
    return np.asarray([-1.0] * deletes + [1.0] * (len(view.ids) - deletes), np.float32)

  out = m.recall("q", critic, k=k, query_embedding=q, learn=False)
  assert sum(seen, []) == ranking  # T pages, in ranking order, none skipped
  cited = [p[deletes:] for p in seen]
  assert list(out.ids) == sum(cited, [])[:k]  # the cited survivors first (none: empty)
  assert list(out.dropped) == [i for p in seen for i in p[:deletes]]
  assert m.stats["critic_calls"] == 8


def test_a_session_a_delete_or_update_dropped_says_which_memory_and_why():
  m, rng = _memory()
  q = rng.normal(size=D)
  s = m.session(query_embedding=q)
  r = s.round(3, explore=True)
  m.delete(r.ids[1])
  for call in (lambda: s.feedback([r.ids[0]]), lambda: s.round(3), s.close,
               lambda: m.session(resume=s.id)):
    with pytest.raises(SessionDroppedError, match=rf"session {s.id} was dropped because memory "
                                                  rf"'{r.ids[1]}' among its candidates was "
                                                  r"deleted \(Memory.delete\)"):
      call()
  s2 = m.session(query_embedding=q)
  r2 = s2.round(3, explore=True)
  s2.feedback([])
  m.update(r2.ids[0], text="new text", embedding=rng.normal(size=D))
  with pytest.raises(SessionDroppedError, match=rf"dropped because memory '{r2.ids[0]}' among its "
                                                r"candidates was updated \(Memory.update\)"):
    s2.round(3, explore=True)
  assert m.stats["pending"] == 0  # (dropped untrained)
  assert issubclass(SessionDroppedError, ValueError)


def test_an_evicted_session_says_it_was_evicted():
  m, rng = _memory(max_sessions=1)
  s = m.session(query_embedding=rng.normal(size=D))
  s.round(2)
  m.session(query_embedding=rng.normal(size=D)).round(2)
  for call in (lambda: s.feedback([]), lambda: m.session(resume=s.id)):
    with pytest.raises(SessionDroppedError, match=r"dropped because it was evicted "
                                                  r".*max_sessions=1"):
      call()


def test_search_opens_no_session_and_a_delete_never_fails_it():
  m, rng = _memory(max_sessions=1)
  s = m.session(query_embedding=rng.normal(size=D))
  r = s.round(3, explore=True)
  for q in rng.normal(size=(3, D)):  # a read: no session, so nothing evicted
    m.search(query_embedding=q, k=3)
  s.feedback(r.ids[:1])
  m.delete(m.search(query_embedding=rng.normal(size=D), k=3).ids[0])
  assert len(m.search(query_embedding=rng.normal(size=D), k=3)) == 3


@pytest.mark.slow
def test_search_and_recall_succeed_while_another_thread_deletes():
  m, rng = _memory(n=80, seed=3)
  queries = rng.normal(size=(40, D))
  errors, stop = [], threading.Event()

  def deleter():
    try:
      for j, i in enumerate([r["id"] for r in m.list()][:50]):
        if j % 5 == 4:
          m.update(i, text=f"updated {i}", embedding=rng.normal(size=D))
        else:
          m.delete(i)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(("deleter", repr(e)))
    finally:
      stop.set()

  critic = lambda key, view: np.where(np.arange(len(view.ids)) % 2, 1.0, -1.0).astype(np.float32)
  t = threading.Thread(target=deleter)
  t.start()
  j = 0
  while not stop.is_set() or j < 12:
    q = queries[j % len(queries)]
    try:
      assert len(m.search(query_embedding=q, k=3)) == 3
      out = m.recall("q", critic, k=3, query_embedding=q, learn=bool(j % 2))
      assert all(not i.startswith("\x00") for i in out.ids) and not set(out.ids) & set(
          out.dropped)
    except Exception as e:  # pylint: disable=broad-except
      errors.append((j, repr(e)))
    j += 1
  t.join()
  assert not errors, errors[:3]
  assert len(m) == 80 - 40
