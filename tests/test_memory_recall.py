"""`Memory.recall` / `Memory.search` (one call per question) and `Memory(method=...)`."""
import jax
import numpy as np
import pytest

from ear_jax.agent.memory import Memory, SessionDroppedError
from ear_jax.core import critic as critic_lib
from ear_jax.core import inference
from ear_jax.core import retrieval
from ear_jax.core import stream as stream_lib
from ear_jax.core.config import EARConfig, Method, default_hparams

D, M = 16, 48
GOLD = {"m1", "m3", "m7"}


def _memory(**kw):
  rng = np.random.default_rng(0)
  emb = rng.normal(size=(M, D)).astype(np.float32)
  mem = Memory(None, **kw) if kw else Memory(None, dim=D)
  mem.add([f"memory {i}" for i in range(M)], embeddings=emb)
  return mem, emb


def _gold_critic(key, view):
  del key
  return np.where([i in GOLD for i in view.ids], 1.0, -1.0).astype(np.float32)


def _unit(x):
  x = np.asarray(x, np.float32)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _evaluate(mem, emb, query):
  """`(candidate ids [K], EvalResult)`: `evaluate` on the first stage's top-K by cosine (Eq. (1))
  with the memory's learner, the perfect simulated critic (it cites exactly the gold: the labels
  `_gold_critic` gives)."""
  cfg = mem.config.ear
  rows, _, mask = retrieval.top_k_search(_unit(query)[None], _unit(emb), np.ones(M, bool),
                                         cfg.num_candidates)
  rows, mask = np.asarray(rows)[0], np.asarray(mask)[0]
  ids = [f"m{r}" for r in rows]
  gold = np.asarray([i in GOLD for i in ids]) & mask
  stream = stream_lib.make_stream(_unit(query)[None], _unit(emb)[rows][None], mask[None],
                                  gold[None])
  perfect = critic_lib.make_simulated_critic(precision=1.0, recall=1.0)
  return ids, inference.evaluate(jax.random.PRNGKey(0), mem.learner.params,
                                 stream_lib.to_device(stream), cfg, mem.config.learner_hparams,
                                 perfect)


@pytest.mark.parametrize("method", [pytest.param("ear", marks=pytest.mark.slow),  # (fast tier's
                                    "ear_tuned"])  # budget; CI's full suite runs it)
def test_recall_equals_evaluates_explorer_assisted_slate(method):
  mem, emb = _memory(method=method, dim=D)
  cfg = mem.config.ear
  query = emb[1] + emb[3] + 0.3 * emb[20]
  out = mem.recall("which memories?", _gold_critic, k=5, query_embedding=query)
  assert out.final_slate == cfg.final_slate and len(out.rounds) == cfg.num_rounds
  ids, res = _evaluate(mem, emb, query)
  slate = np.asarray(res.explorer_slates[0])
  expected = [ids[j] for j in slate if j >= 0]
  assert list(out.ids) == expected
  for t, r in enumerate(out.rounds):  # every round's slate too
    assert r.round == t + 1 and r.explore and set(r.ids) <= set(ids)


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
def test_recall_is_one_training_query_and_search_learns_nothing():
  mem, emb = _memory(method="ear", dim=D)
  before = dict(mem.stats)
  mem.search("anything", k=5, query_embedding=emb[2])
  assert mem.stats["feedback"] == before.get("feedback", 0)
  assert mem.stats["queries_queued"] == before.get("queries_queued", 0)
  for i in range(4):  # 4 questions = one batch = one learner step
    mem.recall(f"question {i}", _gold_critic, k=5, query_embedding=emb[i] + emb[7])
  assert mem.stats["queries_queued"] == 4 and mem.stats["critic_calls"] == 16
  assert mem.stats["learner_steps"] == 1


def test_an_unusable_critic_reply_ends_the_rounds_without_an_update():
  mem, emb = _memory(method="ear", dim=D)
  out = mem.recall("q", lambda key, view: None, k=5, query_embedding=emb[0])
  assert out.labels == (None,) and len(out.rounds) == 1 and len(out.ids) == 5
  assert mem.stats["critic_no_update"] == 1 and mem.stats["queries_queued"] == 0


def test_recall_needs_the_question_text():
  mem, emb = _memory(method="ear", dim=D)
  with pytest.raises(ValueError, match="question's text"):
    mem.recall("", _gold_critic, query_embedding=emb[0])


def test_a_method_brings_its_own_hyperparameters():
  mem = Memory(None, method="ear_tuned", dim=D)
  tuned = Method.named("ear_tuned", dim=D)
  assert mem.config.ear == tuned.config and mem.config.method == "ear_tuned"
  hp = mem.config.learner_hparams
  assert float(hp.learning_rate) == pytest.approx(float(tuned.hparams.learning_rate))
  assert float(hp.learning_rate) != pytest.approx(
      float(default_hparams().learning_rate))


def test_method_and_config_together_are_refused():
  with pytest.raises(ValueError, match="not both"):
    Memory(None, method="ear", config=EARConfig(dim=D))


@pytest.mark.parametrize("kwargs, field", [
    (dict(method="rl_update", dim=D), "train_slate"),
    (dict(method="ear_no_explorer", dim=D), "train_slate"),
    (dict(config=EARConfig(dim=D, test_rounds=2)), "test_rounds"),
])
def test_config_fields_memory_cannot_honour_are_refused_naming_them(kwargs, field):
  with pytest.raises(ValueError, match=f"config.{field}="):
    Memory(None, **kwargs)


def test_recall_without_learning_pages_by_default_and_equals_evaluates_paging_slate():
  mem, emb = _memory(method="ear_tuned", dim=D)
  cfg = mem.config.ear
  query = emb[1] + emb[3] + 0.3 * emb[20]
  out = mem.recall("which memories?", _gold_critic, k=5, query_embedding=query, learn=False)
  assert out.final_slate == "paging" and len(out.rounds) == cfg.num_rounds
  ids, res = _evaluate(mem, emb, query)
  # Page t = ranks 5t .. 5t + 4 of the untrained adapter (the first stage's order).
  assert [list(r.ids) for r in out.rounds] == [ids[5 * t:5 * t + 5] for t in range(4)]
  expected = [ids[j] for j in np.asarray(res.paging_adapted_slates[0]) if j >= 0]
  assert list(out.ids) == expected and set(out.ids[:len(GOLD & set(ids))]) <= GOLD
  assert mem.stats["queries_queued"] == 0


def test_recall_refuses_paging_while_learning_and_an_unknown_rule():
  mem, emb = _memory(method="ear", dim=D)
  with pytest.raises(ValueError, match="test-time rule"):
    mem.recall("q", _gold_critic, k=5, query_embedding=emb[0], rule="paging")
  with pytest.raises(ValueError, match="unknown rule"):
    mem.recall("q", _gold_critic, k=5, query_embedding=emb[0], learn=False, rule="pages")


def _learner_leaves(mem):
  return [np.asarray(x) for x in jax.tree.leaves(mem.learner)]


def _trained_memory():
  """An `ear_tuned` memory after one learner step (4 training recalls): its served ranking is the
  adapter's, no longer the first stage's."""
  mem, emb = _memory(method="ear_tuned", dim=D)
  for i in range(4):
    mem.recall(f"question {i}", _gold_critic, k=5, query_embedding=emb[i] + emb[7])
  assert mem.stats["learner_steps"] == 1
  return mem, emb


def test_a_test_time_session_pages_as_recall_does_and_trains_nothing():
  """`Memory.session(learn=False)`: round t + 1 is page t of the served ranking (what
  `recall(learn=False)` shows its critic), its feedback trains nothing, `answer()` is recall's
  paging answer for the same citations; after T pages it is closed, and `close()` releases it."""
  mem, emb = _trained_memory()
  T = mem.config.ear.num_rounds
  query = emb[1] + emb[3] + 0.3 * emb[20]
  out = mem.recall("which memories?", _gold_critic, k=5, query_embedding=query, learn=False)
  before, stats = _learner_leaves(mem), dict(mem.stats)
  s = mem.session("which memories?", query_embedding=query, learn=False)
  assert not s.learn and mem.session(resume=s.id).learn is False
  pages = []
  for t in range(T):
    page = s.round(5)
    assert page.round == t + 1 and len(page) == 5
    if t == 0:
      assert s.answer().ids == page.ids  # (an open page counts as uncited: the ranking)
    pages.append(page)
    assert s.feedback([i for i in page.ids if i in GOLD]) is False
  assert [p.ids for p in pages] == [r.ids for r in out.rounds]
  assert [p.scores for p in pages] == [r.scores for r in out.rounds]
  answer = s.answer()
  assert answer.ids == out.ids and answer.scores == out.scores and answer.round == T
  assert answer.texts == out.texts and s.answer(2).ids == out.ids[:2]
  assert s.closed and s.rounds == T
  with pytest.raises(ValueError, match="closed"):
    s.round(5)
  for a, b in zip(before, _learner_leaves(mem)):  # params, optimiser, buffer, guard, counters
    np.testing.assert_array_equal(a, b)
  for name in ("learner_steps", "queries_queued", "ready", "pending", "sessions"):
    assert mem.stats[name] == stats.get(name, 0), name
  assert mem.stats["feedback"] == stats["feedback"] + T
  assert mem.search(query_embedding=query, k=5).ids == out.rounds[0].ids  # the ranking unmoved
  s.close()
  with pytest.raises(ValueError, match="unknown session"):
    mem.session(resume=s.id)


def test_a_test_time_session_refuses_bad_input_and_leaves_out_deleted_memories():
  mem, emb = _memory(method="ear_tuned", dim=D)
  with pytest.raises(TypeError, match="learn must be a bool"):
    mem.session("q", query_embedding=emb[0], learn="no")
  train = mem.session("q", query_embedding=emb[0])
  assert train.learn
  train.round(5)
  with pytest.raises(ValueError, match="Explorer rounds"):
    train.answer()
  with pytest.raises(ValueError, match="not both"):
    mem.session(resume=train.id, learn=False)
  s = mem.session("q", query_embedding=emb[0], learn=False)
  assert s.answer().ids == ()  # nothing shown yet
  first = s.round(5)
  with pytest.raises(ValueError, match="not in the slate"):
    s.feedback(["m999"])
  s.feedback([first.ids[1]])
  mem.delete([first.ids[1]])  # a frozen session goes on without it
  second = s.round(5)
  assert second.round == 2 and first.ids[1] not in second.ids
  assert s.answer().ids == first.ids[:1] + first.ids[2:] + second.ids[:1]
  s.close()


def test_a_test_time_session_is_never_saved(tmp_path):
  """A frozen session lives in its process only: after a save and a reopen its id is unknown,
  saying so; the training session beside it survives."""
  rng = np.random.default_rng(0)
  mem = Memory.open(tmp_path / "mem", dim=D, encoder=None)
  mem.add([f"memory {i}" for i in range(M)], embeddings=rng.normal(size=(M, D)))
  q = rng.normal(size=D)
  test, train = mem.session("q", query_embedding=q, learn=False), mem.session("q", query_embedding=q)
  test.round(5)
  train.round(5)
  mem.save()
  test.feedback([])  # (the save leaves it open here)
  mem.close()
  with Memory.open(tmp_path / "mem") as back:
    assert back.session(resume=train.id).rounds == 0
    with pytest.raises(ValueError, match="never saved"):
      back.session(resume=test.id)


def test_unclosed_test_time_sessions_are_evicted_like_training_ones():
  """A `session(learn=False)` an agent never closes cannot pile up: beyond `max_sessions` the
  least recently used session goes, test-time or training, with the eviction named."""
  mem, emb = _memory(method="ear_tuned", dim=D, max_sessions=2)
  first = mem.session("a", query_embedding=emb[0], learn=False)
  first.round(5)
  others = [mem.session(q, query_embedding=emb[i], learn=False) for i, q in ((1, "b"), (2, "c"))]
  with pytest.raises(SessionDroppedError, match="evicted"):
    first.round(5)
  assert all(len(s.round(5).ids) == 5 for s in others)
  assert int(mem.learner.queries_seen) == 0  # (test-time sessions leave nothing to learn)
