"""One call per question for a live agent: `recall`, a loop over one query session.

Symbols: `K` candidates, `k` memories returned, `T` Explorer rounds (`EARConfig.num_rounds`).

`recall` plays what `ear_jax.core.inference.evaluate` calls explorer-assisted inference, on a live
`Memory`: round t shows the Explorer's slate (Eq. (5)-(8)) to the critic, whose labels update the
query's bandit statistics (Eq. (9)); after T rounds the session closes and is queued as ONE
training query (Eq. (11)-(14)); the answer is the slate `EARConfig.final_slate` names: round T's
('round_T', the paper) or the top-k by bandit mean, ties by adapted relevance ('exploit',
`ear_tuned`). For the same embeddings, learner state and critic labels it equals `evaluate`'s
explorer-assisted slate (`tests/test_memory_recall.py`). A critic follows the library's protocol,
`critic(key, view) -> labels [k]` or None (an unusable reply: that round gets no update and the
rounds end there). With `learn=False` the session is *frozen* (`sessions`): the rounds rank by
the guard's served parameters of round 1 and nothing is queued; its default rule is *paging*
(`rule='paging'`, issue 27): round t shows page t (ranks `t k .. t k + k - 1`) of the served
ranking, and the answer is the cited memories first, in ranking order, then the ranking, as
`core.retrieval.paging_slate` (`inference.evaluate`'s `paging_adapted` slate for the same labels:
`tests/test_memory_recall.py`); `rule='explorer'` plays the Explorer's rounds instead. A training
session held out for the guard (`EARConfig.guard_holdout`: every n-th) shows pages of the first
stage's ranking instead of Explorer rounds, answers as paging does, and is never trained on.

Deletes and updates meanwhile (by the critic itself, or another thread) never make it fail: with
`learn=True` a delete or update of one of the session's candidates drops the session, so the
rounds end there untrained (`stats['recall_sessions_dropped']`; an eviction beyond
`max_sessions` ends them the same way, trained); with `learn=False` the deleted candidates leave
the later rounds. Either way the answer holds the memories as they are when recall returns.

The loop reaches its memory only through `sessions.Ops` (the memory's locked session
operations), never through the memory's private parts.
"""
from __future__ import annotations

import dataclasses
import functools

import jax

from ear_jax.agent.memory import episode
from ear_jax.agent.memory.sessions import Ops, SessionDroppedError
from ear_jax.core import explorer as explorer_lib


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


RULES = ("explorer", "paging")


@functools.partial(jax.jit, static_argnames=("k",))
def _exploit(params, query, candidates, given, mask, mean, counts, last, *, k):
  z, _ = episode.adapted(params, query, candidates, given)
  stats = explorer_lib.update_bandit(explorer_lib.BanditStats(mean=mean, counts=counts), *last)
  slate, slate_mask = explorer_lib.exploit_slate(stats, z, mask, k)
  return slate, slate_mask, z


def exploit(params, query, candidates, mask, mean, counts, last, k: int, given=None):
  """The top-k by bandit mean, ties by adapted relevance: `(slate [k], slate_mask [k], z [K])`
  numpy, after the pending feedback `last = (slate [K], slate_mask [K], labels [K])` (Eq. (9);
  all masked: none); `given`: the rounds' `episode.adapted` by the same `params` (see
  `episode.session_round`)."""
  if given is not None:
    params = query = candidates = None
  return jax.device_get(_exploit(params, query, candidates, given, mask, mean, counts,
                                 tuple(last), k=k))


def recall(ops: Ops, question: str, critic, k: int, *, query_embedding, learn: bool, scope,
           rounds: int, final_slate: str) -> Recall:
  """`rounds` Explorer rounds (or, `final_slate='paging'`, pages) of `question` with `critic` (a
  checked question and `k`; see the module docstring), then the final slate, as a `Recall`."""
  session = ops.open(question, query_embedding, scope, not learn, k, final_slate == "paging")
  try:
    if final_slate == "paging":
      return _pages(ops, session, critic, k, rounds)
    return _rounds(ops, session, critic, k, learn, rounds, final_slate)
  except BaseException:
    ops.abandon(session.id)  # (a bad critic: nothing of its rounds is kept)
    raise


def _rounds(ops: Ops, session, critic, k: int, learn: bool, rounds: int,
            final_slate: str) -> Recall:
  shown, labels = [], []
  try:
    if learn and session.held_out:  # held out for the guard: pages, and paging's answer
      final_slate = "paging"
    for t in range(rounds):
      slate = session.round(k, explore=True)
      if not len(slate):  # (frozen: every memory it could show was deleted)
        break
      shown.append(slate)
      labels.append(None)
      labels[-1] = ops.critique(session.id, critic, t)
      if labels[-1] is None:  # an unusable reply: no update, and no more rounds on guesswork
        break
    ids, scores = (shown[-1].ids, shown[-1].scores) if shown else ((), ())
    if final_slate == "paging":  # (a held-out session's pages: paging's answer)
      answer, _ = paging_answer(shown, labels, k)
      ids, scores = tuple(i for i, _ in answer), tuple(sc for _, sc in answer)
    elif final_slate != "round_T":
      ids, scores = ops.final(session.id, k)
    held = ops.records(list(ids) + [i for s in shown for i in s.ids], session.id)
    session.close()  # ended early: the rounds so far are the training query
  except SessionDroppedError:  # a delete (or an eviction) ended the session
    ids, scores = (shown[-1].ids, shown[-1].scores) if shown else ((), ())
    ops.count("recall_sessions_dropped")
    held = ops.records(list(ids) + [i for s in shown for i in s.ids], None)
  if not learn:
    ops.count("frozen_recalls")
  keep = [j for j, i in enumerate(ids) if i in held]
  return Recall(ids=tuple(ids[j] for j in keep), texts=tuple(held[ids[j]]["text"] for j in keep),
                stores=tuple(held[ids[j]]["store"] for j in keep),
                scores=tuple(float(scores[j]) for j in keep), rounds=tuple(shown),
                labels=tuple(labels), final_slate=final_slate,
                dropped=tuple(dict.fromkeys(i for s in shown for i in s.ids if i not in held)))


def _pages(ops: Ops, session, critic, k: int, rounds: int) -> Recall:
  """Paging (`learn=False`): page t of the served ranking to the critic in round t; the answer is
  the cited memories first (ranking order), then the ranking, cut to k (`retrieval.paging_slate`
  on the same labels; nothing cited: the adapter-only top-k)."""
  shown, labels = [], []
  for t in range(rounds):
    page = session.round(k)  # (a paging session's round t + 1 is page t)
    if not len(page):  # past the candidates (or every one was deleted)
      break
    shown.append(page)
    labels.append(ops.critique(session.id, critic, t))
    if labels[-1] is None:
      break
  answer, ranked = paging_answer(shown, labels, k)
  held = ops.records([i for i, _, _ in ranked], session.id)
  session.close()
  ops.count("frozen_recalls")
  answer = [(i, sc) for i, sc in answer if i in held]
  return Recall(ids=tuple(i for i, _ in answer), texts=tuple(held[i]["text"] for i, _ in answer),
                stores=tuple(held[i]["store"] for i, _ in answer),
                scores=tuple(float(sc) for _, sc in answer), rounds=tuple(shown),
                labels=tuple(labels), final_slate="paging",
                dropped=tuple(dict.fromkeys(i for i, _, _ in ranked if i not in held)))


def paging_answer(shown, labels, k: int):
  """`(answer [(id, score)] of at most k, ranked [(id, score, cited)])` of pages `shown` and
  their `labels` (None: unusable): the cited memories first, in ranking order, then the ranking
  (`core.retrieval.paging_slate`; `Session.answer` too). The ranking is by score, the order
  shown among equal scores: the pages' own order."""
  ranked = [(i, sc, lab is not None and len(lab) == len(p.ids) and lab[j] > 0)
            for p, lab in zip(shown, labels) for j, (i, sc) in enumerate(zip(p.ids, p.scores))]
  ranked.sort(key=lambda r: -r[1])  # (stable: pages of a ranking are in its order already)
  answer = ([(i, sc) for i, sc, c in ranked if c] + [(i, sc) for i, sc, c in ranked if not c])[:k]
  return answer, ranked
