"""The caller's side of a session: the `Session` handle, and `recall`, one call per question.

Symbols: `K` candidates, `k` memories returned, `T` Explorer rounds (`EARConfig.num_rounds`).

A `Session` (`Memory.session`) is a handle on one session of a memory's `learning.Learning`:
`round`, `feedback`, `critique`, `close`, `answer`, each one locked step there. `recall` loops
over one session with a host critic, `critic(key, view) -> labels [k]` or None (an unusable
reply: that round gets no update and the rounds end there): T Explorer rounds recorded as ONE
training query, then the slate `EARConfig.final_slate` names (round T's, or 'exploit': the top-k
by bandit mean, ties by adapted relevance), `inference.evaluate`'s explorer-assisted slate for the
same inputs (`tests/test_memory_recall.py`). With `learn=False` its default rule is paging: round
t shows page t of the served ranking, and the answer is the cited memories first, in ranking
order, then the ranking (`core.retrieval.paging_slate`). A session held out for the guard pages
the first stage and answers as paging does.

Deletes meanwhile (by the critic itself, or another thread) never make it fail: with `learn=True`
a delete or update of a candidate drops the session, so the rounds end there untrained
(`stats['recall_sessions_dropped']`); with `learn=False` the deleted candidates leave the later
rounds. Either way the answer holds the memories as they are when recall returns.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ear_jax.agent.memory.sessions import SessionDroppedError, Slate, paging_answer

RULES = ("explorer", "paging")


@dataclasses.dataclass(frozen=True)
class Recall:
  """What `Memory.recall` returns.

  Attributes:
    ids, texts, stores: `[k]` the final slate's memory ids, texts and store names, as they are
      when recall returns: a memory deleted meanwhile is left out (fewer than k), an updated one
      has its new text.
    scores: `[k]` their adapted relevance `z`.
    rounds: the `Slate`s shown to the critic, in order.
    labels: the critic's labels of each round (None for an unusable reply, or for the round
      whose session a delete dropped).
    final_slate: the rule that chose the answer ('round_T' or 'exploit' after Explorer rounds,
      'paging' after pages of the served ranking).
    dropped: the ids of memories shown to the critic that were deleted while recall ran (none of
      them is in the answer).
  """
  ids: tuple[str, ...]
  texts: tuple[str, ...]
  stores: tuple[str, ...]
  scores: tuple[float, ...]
  rounds: tuple
  labels: tuple
  final_slate: str
  dropped: tuple[str, ...] = ()

  def __len__(self):
    return len(self.ids)


class Session:
  """A handle on one open query session of a `Memory` (`Memory.session`).

  Attributes:
    id: the session id (`Memory.session(resume=id)` re-attaches to it).
    question: the question's text ('' when only an embedding was given).
    scope: the scope names its candidates came from (empty: every scope).
    learn: False for a test-time session (`Memory.session(learn=False)`): its rounds are pages
      of the served ranking and nothing of it trains the learner.
    held_out: True for a training session held out for the guard (`EARConfig.guard_holdout`):
      its rounds page the first stage's ranking and it is never trained on.
  """

  def __init__(self, learning, sid: int, question: str, scope: tuple, learn: bool = True,
               held_out: bool = False):
    self._learning, self.id, self.question, self.scope = learning, int(sid), question, tuple(scope)
    self.learn, self.held_out = bool(learn), bool(held_out)

  def __repr__(self):
    return f"Session(id={self.id}, question={self.question!r}, rounds={self.rounds})"

  @property
  def rounds(self) -> int:
    """The rounds with feedback so far."""
    return self._learning.info(self.id)[0]

  @property
  def closed(self) -> bool:
    """True once it went to the learner, was closed, or was dropped."""
    try:
      return self._learning.info(self.id)[1]
    except SessionDroppedError:
      return True

  def round(self, k: int = 5, explore: bool = True) -> Slate:
    """The next round's slate of at most `k` memories (fewer when the session's candidates are
    fewer; an open round without feedback is discarded):
    one Explorer round (Eq. (5)-(8)), or with `explore=False` the adapter's top-k ranked by the
    guard's served parameters (its feedback closes the session). At most `T` rounds. A
    test-time session (`learn=False`) shows the next page of the served ranking: its first `k`
    memories still held that no page with feedback showed (page t, ranks `t k .. t k + k - 1`,
    t the rounds with feedback so far, while nothing was deleted; keep `k` the same on every
    page; past its candidates: an empty slate, no round opened).

    Raises:
      SessionDroppedError: a delete / update of one of its candidates or an eviction ended it.
      ValueError: closed, all `T` rounds played, or `k` outside `[1, K]`.
    """
    return self._learning.round(self.id, k, explore)

  def feedback(self, cited_ids=(), *, answer: Optional[str] = None) -> bool:
    """Labels the open round: +1 for the memories the agent used, -1 for the others shown.

    The used memories are the cited ids and, with `answer` (the agent's answer to the question),
    those the answer draws on by the answer rule (`episode.answer_labels`, the memory's encoder
    embedding the answer outside the lock); with both, their union. Updates the bandit
    statistics (Eq. (9)); a session this closes is queued, and every `b` queued sessions make one
    learner step.

    Returns:
      True when this call triggered a learner step.
    """
    return self._learning.feedback(self.id, cited_ids, answer)

  def critique(self, critic):
    """Shows the open round to a host critic (`critic(key, view) -> labels [k]` or None, e.g.
    `LLMCritic` or `AnswerFeedback`) and applies its labels as the round's feedback; None (an
    unusable reply) discards the round with no update. Returns the critic's labels."""
    return self._learning.critique(self.id, critic)

  def close(self) -> bool:
    """Ends the session: queued for the learner when it has feedback (its rounds so far are one
    training query). Idempotent. Returns True when this triggered a learner step."""
    return self._learning.close(self.id)

  def answer(self, k: Optional[int] = None) -> Slate:
    """Paging's answer (test-time sessions, `learn=False`): of the pages shown so far (an open
    page counts as uncited), the cited memories first, in ranking order, then the ranking, cut to
    `k` (default: the first page's size) and less what was deleted since; what
    `Memory.recall(learn=False)` answers for the same labels (`sessions.paging_answer`). Its
    `round` is the pages with feedback; it still answers once the T-th page's feedback closed
    the session, until `close()` releases it.

    Raises:
      ValueError: a session that plays Explorer rounds (its answer is `Memory.recall`'s).
    """
    return self._learning.answer(self.id, k)


def recall(learning, session: Session, critic, k: int, *, learn: bool, rounds: int,
           final_slate: str) -> Recall:
  """`rounds` Explorer rounds (or, `final_slate='paging'`, pages) of an opened `session` with
  `critic` (see the module docstring), then the final slate, as a `Recall`."""
  try:
    if final_slate == "paging":
      return _pages(learning, session, critic, k, rounds)
    return _rounds(learning, session, critic, k, learn, rounds, final_slate)
  except BaseException:
    learning.abandon(session.id)  # (a bad critic: nothing of its rounds is kept)
    raise


def _rounds(learning, session: Session, critic, k: int, learn: bool, rounds: int,
            final_slate: str) -> Recall:
  shown, labels = [], []
  try:
    if learn and session.held_out:  # held out for the guard: pages, and paging's answer
      final_slate = "paging"
    for _ in range(rounds):
      slate = session.round(k, explore=True)
      if not len(slate):  # (frozen: every memory it could show was deleted)
        break
      shown.append(slate)
      labels.append(None)
      labels[-1] = session.critique(critic)
      if labels[-1] is None:  # an unusable reply: no update, and no more rounds on guesswork
        break
    ids, scores = (shown[-1].ids, shown[-1].scores) if shown else ((), ())
    if final_slate == "paging":  # (a held-out session's pages: paging's answer)
      answer, _ = paging_answer(shown, labels, k)
      ids, scores = tuple(i for i, _ in answer), tuple(sc for _, sc in answer)
    elif final_slate != "round_T":
      ids, scores = learning.final(session.id, k)
    held = learning.records(list(ids) + [i for s in shown for i in s.ids], session.id)
    session.close()  # ended early: the rounds so far are the training query
  except SessionDroppedError:  # a delete (or an eviction) ended the session
    ids, scores = (shown[-1].ids, shown[-1].scores) if shown else ((), ())
    learning.count("recall_sessions_dropped")
    held = learning.records(list(ids) + [i for s in shown for i in s.ids], None)
  if not learn:
    learning.count("frozen_recalls")
  keep = [j for j, i in enumerate(ids) if i in held]
  return Recall(ids=tuple(ids[j] for j in keep), texts=tuple(held[ids[j]]["text"] for j in keep),
                stores=tuple(held[ids[j]]["store"] for j in keep),
                scores=tuple(float(scores[j]) for j in keep), rounds=tuple(shown),
                labels=tuple(labels), final_slate=final_slate,
                dropped=tuple(dict.fromkeys(i for s in shown for i in s.ids if i not in held)))


def _pages(learning, session: Session, critic, k: int, rounds: int) -> Recall:
  """Paging (`learn=False`): page t of the served ranking to the critic in round t; the answer is
  the cited memories first (ranking order), then the ranking, cut to k (`retrieval.paging_slate`
  on the same labels; nothing cited: the adapter-only top-k)."""
  shown, labels = [], []
  for _ in range(rounds):
    page = session.round(k)  # (a paging session's round t + 1 is page t)
    if not len(page):  # past the candidates (or every one was deleted)
      break
    shown.append(page)
    labels.append(session.critique(critic))
    if labels[-1] is None:
      break
  answer, ranked = paging_answer(shown, labels, k)
  held = learning.records([i for i, _, _ in ranked], session.id)
  session.close()
  learning.count("frozen_recalls")
  answer = [(i, sc) for i, sc in answer if i in held]
  return Recall(ids=tuple(i for i, _ in answer), texts=tuple(held[i]["text"] for i, _ in answer),
                stores=tuple(held[i]["store"] for i, _ in answer),
                scores=tuple(float(sc) for _, sc in answer), rounds=tuple(shown),
                labels=tuple(labels), final_slate="paging",
                dropped=tuple(dict.fromkeys(i for i, _, _ in ranked if i not in held)))


def llm_feedback(memory, critic, query: str, k: int = 5, explore: bool = True, *,
                 query_embedding=None) -> tuple[Slate, object]:
  """One agent step with a host critic: a session of one round, `critic(key, view)`, its labels
  as the round's feedback, and the session closed (queued when labelled).

  An unusable reply (labels None) gives no update (counted in `memory.stats['critic_no_update']`
  and in the critic's own `stats`); the loop never crashes on it.

  Returns:
    `(slate, labels)`: labels `[k]` float32 in {-1, +1}, or None.
  """
  s = memory.session(query, query_embedding=query_embedding)
  slate = s.round(k, explore)
  labels = s.critique(critic)
  if not s.closed:
    s.close()
  return slate, labels
