"""The caller's side of a session: the `Session` handle, and `recall`, one call per question.

Symbols: `K` candidates, `k` memories returned, `T` Explorer rounds (`EARConfig.num_rounds`).

`recall` plays T Explorer rounds with a host critic (`critic(key, view) -> labels [k]` or None: no
update, no more rounds) as ONE training query, then the slate `EARConfig.final_slate` names
(`inference.evaluate`'s for the same inputs); a test-time or held-out session pages a ranking
instead. A delete meanwhile never makes it fail: the answer holds the memories still there.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ear_jax.agent.memory.sessions import SessionDroppedError, Slate, paging_answer

RULES = ("explorer", "paging")


@dataclasses.dataclass(frozen=True)
class Recall:
  """What `Memory.recall` returns: the final slate's memories still held when recall returns."""
  ids: tuple[str, ...]  # [k]
  texts: tuple[str, ...]  # [k]
  stores: tuple[str, ...]  # [k]
  scores: tuple[float, ...]  # [k] adapted relevance `z`
  rounds: tuple  # the `Slate`s shown to the critic
  labels: tuple  # the critic's labels of each (None: no usable reply)
  final_slate: str  # the rule that chose the answer: 'round_T', 'exploit' or 'paging'
  dropped: tuple[str, ...] = ()  # the ids shown that were deleted while recall ran

  def __len__(self):
    return len(self.ids)


class Session:
  """A handle on one open query session of a `Memory` (`Memory.session`).

  Attributes:
    id: the session id (`Memory.session(resume=id)` re-attaches to it).
    question: the question's text ('' when only an embedding was given).
    scope: the scope names its candidates came from (empty: every scope).
    learn: False for a test-time session: pages of the served ranking, nothing trains.
    held_out: held out for the guard (`EARConfig.guard_holdout`): pages of the first stage's
      ranking, never trained on.
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
    feedback closes the session); at most `T` rounds. A test-time session shows the next page
    (keep `k` the same; past the candidates: an empty slate).

    Raises:
      SessionDroppedError: a delete / update of one of its candidates or an eviction ended it.
      ValueError: closed, all `T` rounds played, or `k` outside `[1, K]`.
    """
    return self._learning.round(self.id, k, explore)

  def feedback(self, cited_ids=(), *, answer: Optional[str] = None) -> bool:
    """Labels the open round: +1 for the memories used (the cited ids, and with `answer` those it
    draws on, `episode.answer_labels`), -1 for the others shown (Eq. (9)).

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
    """A test-time session's answer: the cited memories, then the ranking, cut to `k` (default:
    the first page's size); `Memory.recall(learn=False)`'s for the same labels. Until `close()`.

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


def _play(session: Session, critic, k: int, rounds: int, shown: list, labels: list) -> None:
  """Rounds (or pages) into `shown` / `labels` until `rounds`, an empty slate or no usable reply."""
  for _ in range(rounds):
    slate = session.round(k, explore=True)
    if not len(slate):  # (past the candidates, or every memory it could show was deleted)
      return
    shown.append(slate)
    labels.append(None)
    labels[-1] = session.critique(critic)
    if labels[-1] is None:  # no more rounds on guesswork
      return


def _recall(answer, held: dict, shown: list, labels: list, final_slate: str, dropped) -> Recall:
  """The `Recall` of `answer` `[(id, score)]`, less the ids not `held`."""
  answer = [(i, sc) for i, sc in answer if i in held]
  return Recall(ids=tuple(i for i, _ in answer), texts=tuple(held[i]["text"] for i, _ in answer),
                stores=tuple(held[i]["store"] for i, _ in answer),
                scores=tuple(float(sc) for _, sc in answer), rounds=tuple(shown),
                labels=tuple(labels), final_slate=final_slate,
                dropped=tuple(dict.fromkeys(i for i in dropped if i not in held)))


def _rounds(learning, session: Session, critic, k: int, learn: bool, rounds: int,
            final_slate: str) -> Recall:
  shown, labels = [], []
  try:
    if learn and session.held_out:  # held out for the guard: pages, and paging's answer
      final_slate = "paging"
    _play(session, critic, k, rounds, shown, labels)
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
  return _recall(zip(ids, scores), held, shown, labels, final_slate,
                 [i for s in shown for i in s.ids])


def _pages(learning, session: Session, critic, k: int, rounds: int) -> Recall:
  """Paging: page t of the served ranking in round t; the answer as `retrieval.paging_slate`."""
  shown, labels = [], []
  _play(session, critic, k, rounds, shown, labels)
  answer, ranked = paging_answer(shown, labels, k)
  held = learning.records([i for i, _, _ in ranked], session.id)
  session.close()
  learning.count("frozen_recalls")
  return _recall(answer, held, shown, labels, "paging", [i for i, _, _ in ranked])


def llm_feedback(memory, critic, query: str, k: int = 5, explore: bool = True, *,
                 query_embedding=None) -> tuple[Slate, object]:
  """One agent step with a host critic: a session of one round, critiqued, then closed (a reply of
  None: no update, counted in `stats['critic_no_update']`).

  Returns:
    `(slate, labels)`: labels `[k]` float32 in {-1, +1}, or None.
  """
  s = memory.session(query, query_embedding=query_embedding)
  slate = s.round(k, explore)
  labels = s.critique(critic)
  if not s.closed:
    s.close()
  return slate, labels
