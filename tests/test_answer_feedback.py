"""Issue 28, the live API: feedback from the agent's answer (`Memory.feedback(answer=...)`,
`AnswerFeedback` as `recall`'s critic, the MCP server's `cite(answer=...)`), labelled by the same
answer rule as the benchmarks (`ear_jax.core.critic.answer_critic`, `ANSWER_DEFAULTS`)."""
import asyncio

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


def _memory(encoder=None, **kw):
  cfg = EARConfig.for_method("ear_tuned", dim=D, num_candidates=8, buffer_capacity=64)
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


def _shown(memory, r):
  """The frozen embeddings of a retrieval's memories, in slate order."""
  emb = memory.embeddings()
  return emb[[memory.ids.index(i) for i in r.ids]]


def _recorded(memory, r):
  """The labels the memory recorded for round `r` (its session's row of that round)."""
  s = memory._sessions.by_id[r.session_id]  # pylint: disable=protected-access
  return s.labels[r.round - 1, :len(r.ids)]


def test_feedback_with_an_answer_labels_the_slate_by_the_answer_rule():
  m = _memory()
  m.add(FACTS)
  r = m.retrieve(QUESTION, k=6, explore=True)
  assert FACTS[0] in r.texts
  m.feedback(r, answer=ANSWER)
  want = _rule(QUESTION, ANSWER, r.texts, _shown(m, r))
  got = _recorded(m, r)
  np.testing.assert_array_equal(got, want)
  assert got[r.texts.index(FACTS[0])] == 1.0  # the memory holding the answer's new words
  assert (got < 0).any()  # and not every shown memory
  assert m.stats["cited"] == int((want > 0).sum())


def test_feedback_with_cited_ids_and_an_answer_cites_their_union():
  m = _memory()
  m.add(FACTS)
  r = m.retrieve(QUESTION, k=6, explore=True)
  want = _rule(QUESTION, ANSWER, r.texts, _shown(m, r))
  extra = next(i for i, y in zip(r.ids, want) if y < 0)
  m.feedback(r, [extra], answer=ANSWER)
  np.testing.assert_array_equal(
      _recorded(m, r), np.where(np.asarray(r.ids) == extra, 1.0, want))


def test_feedback_with_an_answer_without_an_encoder_is_a_value_error_and_changes_nothing():
  enc = HashEncoder()
  m = Memory(None, config=_memory().config)
  m.add(FACTS, embeddings=enc._encode(FACTS)[0])  # pylint: disable=protected-access
  r = m.retrieve(QUESTION, k=4, explore=True,
                 query_embedding=enc._encode([QUESTION])[0][0])  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="no encoder"):
    m.feedback(r, answer=ANSWER)
  assert m.stats["feedback"] == 0
  m.feedback(r, [r.ids[0]])  # the retrieval is still open


@pytest.mark.parametrize("answer,error,message", [
    (3, TypeError, "answer must be a string"),
    ("   ", ValueError, "answer is empty"),
])
def test_feedback_refuses_a_bad_answer_naming_it(answer, error, message):
  m = _memory()
  m.add(FACTS)
  r = m.retrieve(QUESTION, k=4, explore=True)
  with pytest.raises(error, match=message):
    m.feedback(r, answer=answer)
  m.feedback(r, [])  # still open: nothing changed


def test_feedback_with_an_answer_needs_the_question_text():
  m = _memory()
  m.add(FACTS)
  q = HashEncoder()._encode([QUESTION])[0][0]  # pylint: disable=protected-access
  r = m.retrieve(k=4, explore=True, query_embedding=q)
  with pytest.raises(ValueError, match="no question text"):
    m.feedback(r, answer=ANSWER)


def test_recall_with_answer_feedback_labels_every_round_by_the_answer_rule():
  m = _memory()
  m.add(FACTS)
  seen = []

  def answer_fn(question, texts):
    seen.append((question, tuple(texts)))
    return ANSWER
  rec = m.recall(QUESTION, AnswerFeedback(answer_fn), k=4)
  assert len(rec.rounds) == m.config.num_rounds == len(seen)
  emb = m.embeddings()
  for r, y, (q, texts) in zip(rec.rounds, rec.labels, seen):
    assert q == QUESTION and texts == r.texts
    np.testing.assert_array_equal(
        y, _rule(QUESTION, ANSWER, r.texts, emb[[m.ids.index(i) for i in r.ids]]))
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
  np.testing.assert_array_equal(rec.labels[0], _rule(QUESTION, ANSWER, r.texts, _shown(m, r)))
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
  m = svc.memory
  rid = svc._retrievals[r["retrieval_id"]]  # pylint: disable=protected-access
  np.testing.assert_array_equal(_recorded(m, rid),
                                _rule(QUESTION, ANSWER, rid.texts, _shown(m, rid)))
  assert m.stats["feedback"] == 1 and m.stats["cited"] >= 1
  assert "answer" in tools["cite"].inputSchema["properties"]
  assert "used_ids" not in tools["cite"].inputSchema.get("required", [])
  assert "answer=" in tools["recall"].description and "answer" in tools["cite"].description
  assert "answer" in r["next"]


@pytest.mark.parametrize("args,message", [
    ({}, "used_ids or answer"),
    ({"answer": 5}, "answer\n  input should be a valid string"),
    ({"answer": ""}, "answer is empty"),
    ({"answer": "x" * 20_001}, "limit"),
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
