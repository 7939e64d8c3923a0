"""The caller's side of a session: the `Session` handle, and `recall`, one call per question.

Symbols: `K` candidates, `k` memories returned, `T` Explorer rounds (`EARConfig.num_rounds`).

`recall` plays T Explorer rounds with a host critic (`critic(key, view) -> labels [k]` or None: an
unusable reply ends the rounds with no update) as ONE training query, then the slate
`EARConfig.final_slate` names: `inference.evaluate`'s explorer-assisted slate for the same inputs.
With `learn=False` it pages the served ranking instead (a guard's held-out session: the first
stage's). A delete meanwhile never makes it fail: it drops a learning session untrained, and the
answer holds the memories as they are when recall returns.
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
      when recall returns (a memory deleted meanwhile is left out).
    scores: `[k]` their adapted relevance `z`.
    rounds: the `Slate`s shown to the critic, in order.
    labels: the critic's labels of each round (None: an unusable reply or a dropped session).
    final_slate: the rule that chose the answer: 'round_T', 'exploit' or 'paging'.
    dropped: the ids shown to the critic that were deleted while recall ran.
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
    learn: False for a test-time session: pages of the served ranking, nothing trains.
    held_out: True for a session held out for the guard (`EARConfig.guard_holdout`): it pages
      the first stage's ranking and is never trained on.
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
    """The next round's slate of at most `k` memories (an open round without feedback is
    discarded): an Explorer round (Eq. (5)-(8)), or with `explore=False` the served top-k (its
    feedback closes the session). At most `T` rounds. A test-time session shows the next page of
    the served ranking (keep `k` the same on every page; past the candidates: an empty slate).

    Raises:
      SessionDroppedError: a delete / update of one of its candidates or an eviction ended it.
      ValueError: closed, all `T` rounds played, or `k` outside `[1, K]`.
    """
    return self._learning.round(self.id, k, explore)

  def feedback(self, cited_ids=(), *, answer: Optional[str] = None) -> bool:
    """Labels the open round: +1 for the memories the agent used, -1 for the others shown.

    The used memories are the cited ids, plus with `answer` those the answer draws on by the
    answer rule (`episode.answer_labels`). Updates the bandit statistics (Eq. (9)); every `b`
    closed sessions make one learner step.

    Returns:
      True when this call triggered a learner step.
    """
    return self._learning.feedback(self.id, cited_ids, answer)

  def critique(self, critic):
    """Applies a host critic's labels as the open round's feedback and returns them."""
    return self._learning.critique(self.id, critic)

  def close(self) -> bool:
    """Ends the session (queued for the learner with feedback); True when a learner step ran."""
    return self._learning.close(self.id)

  def answer(self, k: Optional[int] = None) -> Slate:
    """Paging's answer of a test-time session: the cited memories first, in ranking order, then
    the ranking, cut to `k` (default: the first page's size); equal to `Memory.recall(learn=False)`
    for the same labels. It still answers after the T-th page, until `close()`.

    Raises:
      ValueError: a session that plays Explorer rounds (its answer is `Memory.recall`'s).
    """
    return self._learning.answer(self.id, k)


def recall(learning, session: Session, critic, k: int, *, learn: bool, rounds: int,
           final_slate: str) -> Recall:
  """`rounds` Explorer rounds (or pages) of an opened `session` with `critic`, as a `Recall`."""
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
  """Paging: page t of the served ranking in round t; the answer as `retrieval.paging_slate`."""
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
  """One agent step with a host critic: a session of one round, critiqued, then closed. An
  unusable reply (None) gives no update and is counted (`stats['critic_no_update']`).

  Returns:
    `(slate, labels)`: labels `[k]` float32 in {-1, +1}, or None.
  """
  s = memory.session(query, query_embedding=query_embedding)
  slate = s.round(k, explore)
  labels = s.critique(critic)
  if not s.closed:
    s.close()
  return slate, labels
