"""The live API: feedback from the agent's answer (`Session.feedback(answer=...)`, `AnswerFeedback`
as `recall`'s critic, the MCP server's `cite(answer=...)`), labelled by the same answer rule as the
benchmarks (`ear_jax.core.critic.answer_critic`, `ANSWER_DEFAULTS`)."""
import jax
import numpy as np
import pytest

from ear_jax import EARConfig
from ear_jax.agent.memory import AnswerFeedback, Memory
from ear_jax.core import critic as critic_lib
from ear_jax.data import answer_support
from tests.test_mcp_server import D, FACTS, HashEncoder, _run, _service

pytest.importorskip("mcp")

from experiments import mcp_agent  # pylint: disable=wrong-import-position

QUESTION = "where does the red cat live"
ANSWER = "the red cat lives in room 0"  # new content words: room, 0 (only FACTS[0] holds both)


def _memory(encoder=None, batch_size=None, **kw):
  cfg = EARConfig.for_method("ear_tuned", dim=D, num_candidates=8, buffer_capacity=64,
                             **({} if batch_size is None else {"batch_size": batch_size}))
  return Memory(HashEncoder() if encoder is None else encoder, config=cfg, **kw)


def _rule(question, answer, texts, memories):
  """The labels the answer rule gives a slate, computed here from the data layer's features."""
  enc = HashEncoder()
  a, qa = enc._encode([answer, f"{question} {answer}"])[0]  # pylint: disable=protected-access
  mask = np.ones((1, len(texts)), bool)
  support = np.concatenate([
      answer_support.lexical_support([question], [answer], np.asarray([list(texts)], object),
                                     mask),
      answer_support.embedding_support(a[None], qa[None], np.asarray(memories)[None], mask)], -1)
  view = critic_lib.SlateView(query=np.zeros(D), slate=np.arange(len(texts)),
                              slate_mask=mask[0], memories=np.asarray(memories),
                              gold=np.zeros(len(texts), bool), answer_support=support[0])
  return np.asarray(_critic(critic_lib.make_answer_critic(), view))


_critic = jax.jit(lambda c, view: c(None, view))


def _shown(texts):
  """The embeddings of shown memories (the stand-in encoder's unit vectors), in slate order."""
  return HashEncoder()._encode(list(texts))[0]  # pylint: disable=protected-access


def _twins():
  """Two equal memories of FACTS that take a learner step per closed session."""
  twins = _memory(batch_size=1), _memory(batch_size=1)
  for m in twins:
    m.add(FACTS)
  return twins


def _same_learner(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a.learner), jax.tree_util.tree_leaves(b.learner)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_feedback_with_an_answer_labels_the_slate_by_the_answer_rule():
  a, b = _twins()
  sa, sb = a.session(QUESTION), b.session(QUESTION)
  r = sa.round(6, explore=True)
  assert sb.round(6, explore=True) == r and FACTS[0] in r.texts
  want = _rule(QUESTION, ANSWER, r.texts, _shown(r.texts))
  assert want[r.texts.index(FACTS[0])] == 1.0  # the memory holding the answer's new words
  assert (want < 0).any()  # and not every shown memory
  sa.feedback(answer=ANSWER)  # labels as citing exactly the rule's memories would
  sb.feedback([i for i, y in zip(r.ids, want) if y > 0])
  assert a.stats["cited"] == b.stats["cited"] == int((want > 0).sum())
  assert a.stats["answer_feedback"] == 1
  assert sa.close() and sb.close()  # (one learner step each, on the same labels)
  _same_learner(a, b)


def test_feedback_with_cited_ids_and_an_answer_cites_their_union():
  a, b = _twins()
  sa, sb = a.session(QUESTION), b.session(QUESTION)
  r = sa.round(6, explore=True)
  sb.round(6, explore=True)
  want = _rule(QUESTION, ANSWER, r.texts, _shown(r.texts))
  extra = next(i for i, y in zip(r.ids, want) if y < 0)
  sa.feedback([extra], answer=ANSWER)
  sb.feedback([i for i, y in zip(r.ids, want) if y > 0 or i == extra])
  assert a.stats["cited"] == b.stats["cited"] == int((want > 0).sum()) + 1
  sa.close()
  sb.close()
  _same_learner(a, b)


def test_feedback_with_an_answer_without_an_encoder_is_a_value_error_and_changes_nothing():
  m = Memory(None, config=_memory().config.ear)
  m.add(FACTS, embeddings=_shown(FACTS))
  s = m.session(QUESTION, query_embedding=_shown([QUESTION])[0])
  r = s.round(4, explore=True)
  with pytest.raises(ValueError, match="no encoder"):
    s.feedback(answer=ANSWER)
  assert m.stats["feedback"] == 0 and s.rounds == 0
  s.feedback([r.ids[0]])  # the round is still open


@pytest.mark.parametrize("answer,error,message", [
    (3, TypeError, "answer must be a string"),
    ("   ", ValueError, "answer is empty"),
])
def test_feedback_refuses_a_bad_answer_naming_it(answer, error, message):
  m = _memory()
  m.add(FACTS)
  s = m.session(QUESTION)
  s.round(4, explore=True)
  with pytest.raises(error, match=message):
    s.feedback(answer=answer)
  s.feedback([])  # still open: nothing changed


def test_feedback_with_an_answer_needs_the_question_text():
  m = _memory()
  m.add(FACTS)
  s = m.session(query_embedding=_shown([QUESTION])[0])
  s.round(4, explore=True)
  with pytest.raises(ValueError, match="no question text"):
    s.feedback(answer=ANSWER)


def test_recall_with_answer_feedback_labels_every_round_by_the_answer_rule():
  m = _memory()
  m.add(FACTS)
  seen = []

  def answer_fn(question, texts):
    seen.append((question, tuple(texts)))
    return ANSWER
  rec = m.recall(QUESTION, AnswerFeedback(answer_fn), k=4)
  assert len(rec.rounds) == m.config.ear.num_rounds == len(seen)
  for r, y, (q, texts) in zip(rec.rounds, rec.labels, seen):
    assert q == QUESTION and texts == r.texts
    np.testing.assert_array_equal(y, _rule(QUESTION, ANSWER, r.texts, _shown(r.texts)))
  assert m.stats["queries_queued"] == 1  # the rounds are one training query


def test_recall_with_answer_feedback_that_gives_no_answer_ends_the_rounds_untrained():
  m = _memory()
  m.add(FACTS)
  rec = m.recall(QUESTION, AnswerFeedback(lambda question, texts: None), k=4)
  assert rec.labels == (None,) and m.stats["critic_no_update"] == 1
  assert m.stats["feedback"] == 0


def test_recall_with_answer_feedback_and_learn_false_uses_the_rule_too():
  m = _memory()
  m.add(FACTS)
  rec = m.recall(QUESTION, AnswerFeedback(lambda question, texts: ANSWER), k=4, learn=False)
  r = rec.rounds[0]
  np.testing.assert_array_equal(rec.labels[0], _rule(QUESTION, ANSWER, r.texts, _shown(r.texts)))
  assert m.stats["queries_queued"] == 0


def test_answer_feedback_refuses_an_answer_fn_that_is_not_callable():
  with pytest.raises(TypeError, match="answer_fn"):
    AnswerFeedback("not a function")


# --------------------------------------------------------------------------------------------------
# MCP: cite(retrieval_id, answer=...)


def test_mcp_cite_with_an_answer_trains_like_memory_feedback():
  svc = _service()

  async def script(s):
    await mcp_agent.must(s, "remember", {"texts": FACTS})
    r = await mcp_agent.must(s, "recall", {"question": QUESTION, "k": 6})
    out = await mcp_agent.must(s, "cite", {"retrieval_id": r["retrieval_id"], "answer": ANSWER})
    tools = {t.name: t for t in (await s.list_tools()).tools}
    return r, out, tools
  r, out, tools = _run(svc, script)
  assert out["recorded"] and out["round"] == 1
  texts = [x["text"] for x in r["memories"]]
  want = _rule(QUESTION, ANSWER, texts, _shown(texts))
  m = svc.memory
  assert m.stats["feedback"] == 1 and m.stats["answer_feedback"] == 1
  assert m.stats["cited"] == int((want > 0).sum()) >= 1
  assert "answer" in tools["cite"].inputSchema["properties"]
  assert "used_ids" not in tools["cite"].inputSchema.get("required", [])
  assert "answer=" in tools["recall"].description and "answer" in tools["cite"].description
  assert "answer" in r["next"]


@pytest.mark.parametrize("args,message", [
    ({}, "used_ids or answer"),
    ({"answer": 5}, "answer\n  input should be a valid string"),
    ({"answer": ""}, "answer is empty"),
    ({"answer": "x" * 20_001}, "answer\n  string should have at most 20000 characters"),
    ({"used_ids": [], "answer": ["a"]}, "answer\n  input should be a valid string"),
])
def test_mcp_cite_with_a_bad_answer_is_a_tool_error_naming_it(args, message):
  async def script(s):
    await mcp_agent.must(s, "remember", {"texts": FACTS})
    r = await mcp_agent.must(s, "recall", {"question": QUESTION, "k": 3})
    bad = await mcp_agent.call(s, "cite", {"retrieval_id": r["retrieval_id"], **args})
    good = await mcp_agent.call(s, "cite", {"retrieval_id": r["retrieval_id"], "used_ids": []})
    return bad, good
  (ok, err), good = _run(_service(), script)
  assert not ok and message.lower() in err.lower() and "Traceback" not in err, err
  assert good[0]  # the retrieval was still open: the bad call changed nothing
