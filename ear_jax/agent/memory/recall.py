"""One call per question for a live agent: `recall` (T Explorer rounds with a critic, one training
query, the final slate) and `search` (the adapter-only slate: no critic, no learning).

Symbols: `K` candidates, `k` memories returned, `T` Explorer rounds (`EARConfig.num_rounds`).

`recall` plays what `ear_jax.core.inference.evaluate` calls explorer-assisted inference, on a live
`Memory`: round t shows the Explorer's slate (Eq. (5)-(8)) to the critic, whose labels update the
query's bandit statistics (Eq. (9)); after T rounds the session closes and is queued as ONE training
query (Eq. (11)-(14)); the answer is the slate `EARConfig.final_slate` names: round T's ('round_T',
the paper) or the top-k by bandit mean, ties by adapted relevance ('exploit', `ear_tuned`). For the
same embeddings, learner state and critic labels it equals `evaluate`'s explorer-assisted slate
(`tests/test_memory_recall.py`). A critic follows the library's protocol, `critic(key, view) ->
labels [k]` or None (an unusable reply: that round gets no update and the rounds end there).

The functions take the `Memory` itself (a friend module of `front`, which imports this one, never
the reverse: the agent layer has no import circle, `tests/test_layers.py`) and hold its lock while
they read a session's arrays.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import numpy as np

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import episode
from ear_jax.agent.memory import forget
from ear_jax.agent.memory import sessions as sessions_lib
from ear_jax.core import adapter as adapter_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import explorer as explorer_lib



@dataclasses.dataclass(frozen=True)
class Recall:
  """What `Memory.recall` returns.

  Attributes:
    ids, texts, stores: `[k]` the final slate's memory ids, texts and store names, as they are
      when recall returns: a memory deleted meanwhile is left out (fewer than k), an updated one
      has its new text.
    scores: `[k]` their adapted relevance `z`.
    rounds: the T `Retrieval`s shown to the critic, in order.
    labels: `[T]` the critic's labels of each round (None for an unusable reply, or for the
      round whose session a delete dropped).
    final_slate: the rule that chose the answer ('round_T' or 'exploit').
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


@functools.partial(jax.jit, static_argnames=("k",))
def _exploit(params, query, candidates, mask, mean, counts, *, k):
  z, _ = adapter_lib.relevance(params, query, candidates)
  slate, slate_mask = explorer_lib.exploit_slate(
      explorer_lib.BanditStats(mean=mean, counts=counts), z, mask, k)
  return slate, slate_mask, z


def _live(bank, memory_id: str) -> bool:
  return memory_id in bank.row_of and not forget.is_tombstone(memory_id)


def _answer(memory: Any, ids, scores, shown, final_slate: str, rounds, labels) -> Recall:
  """The `Recall` of slate `ids` / `scores` with the memories as they are now (call under the
  lock): deleted ones left out, updated ones with their new text; `dropped`: the `shown` ids
  deleted meanwhile."""
  bank = memory._bank  # pylint: disable=protected-access
  keep = [j for j, i in enumerate(ids) if _live(bank, i)]
  recs = bank.records([bank.row_of[ids[j]] for j in keep])
  dropped = tuple(dict.fromkeys(i for i in shown if not _live(bank, i)))
  return Recall(ids=tuple(ids[j] for j in keep), texts=tuple(r["text"] for r in recs),
                stores=tuple(r["store"] for r in recs),
                scores=tuple(float(scores[j]) for j in keep), rounds=tuple(rounds),
                labels=tuple(labels), final_slate=final_slate, dropped=dropped)


def _retrieve_now(memory: Any, question, k, explore: bool, query_embedding, scope,
                  test_time: bool = False):
  """One query checked and encoded now (outside the lock); returns `retrieve()`, which opens its
  retrieval (`Memory._retrieve`) when called, under the lock, with what must follow it."""
  k = memory._check_k(k)  # pylint: disable=protected-access
  scope = bank_lib.check_scope_spec(scope)
  texts, q_emb = memory._queries(*memory._one_query(question, query_embedding))  # pylint: disable=protected-access
  return lambda: memory._retrieve(texts, q_emb, k, explore, scope, test_time)[0]  # pylint: disable=protected-access


def recall(memory: Any, question: str, critic, k: int = 5, *,
           query_embedding=None, learn: bool = True, scope=None) -> Recall:
  """T Explorer rounds of `question` with `critic`, one training query, the final slate.

  With `learn=False` the rounds are explorer-assisted inference with the adapter frozen, as
  `ear_jax.core.inference.evaluate` plays a test query: the same slates, bandit updates and final
  slate, but nothing is queued for the learner (`_frozen_rounds`).

  Deletes and updates meanwhile (by the critic itself, or another thread) never make it fail:
  with `learn=True` a delete or update of one of the session's candidates drops the session
  (`ear_jax.agent.memory.forget`), so the rounds end there untrained
  (`stats['recall_sessions_dropped']`; eviction beyond `max_sessions` ends them the same way,
  trained); with `learn=False` the deleted or updated candidates leave the later rounds. Either
  way the answer holds the memories as they are when recall returns (`Recall`).

  Args:
    memory: the memory.
    question: the question's text (shown to the critic).
    critic: `critic(key, view) -> labels [k]` or None (e.g. `LLMCritic`, or any function of the
      `SlateView`'s `ids` / `texts`), or `episode.AnswerFeedback(answer_fn)`: the agent's answer
      to each round labels it by the answer rule, the memory's encoder embedding the answer.
    k: memories per slate and in the answer.
    query_embedding: optional `[d]` precomputed embedding of the question.
    learn: False: no training query (a test question; `Recall.rounds` then holds round 1 only).
    scope: the scopes the candidates come from (None: every scope; `Memory.retrieve_batch`).

  Returns:
    A `Recall`.
  """
  if not isinstance(question, str) or not question:
    raise ValueError("recall needs the question's text (a non-empty string): the critic reads it")
  critic = memory._bound(critic)  # pylint: disable=protected-access  (AnswerFeedback: its encoder)
  if not learn:
    return _frozen_rounds(memory, _retrieve_now(memory, question, k, True, query_embedding, scope,
                                                test_time=True), critic, k)
  rounds, labels, lost = [], [], False
  r = memory.retrieve(question, k, explore=True, query_embedding=query_embedding, scope=scope)
  for t in range(memory.config.num_rounds):
    if t:
      try:
        r = memory.retrieve(k=k, explore=True, continue_from=r)
      except sessions_lib.SessionDroppedError:  # a delete (or eviction) ended the session
        lost = True
        break
    rounds.append(r)
    params = memory.params  # the adapter this round's slate used (a copy: feedback may train)
    try:
      y = memory.feedback_from_critic(r, critic)
    except sessions_lib.SessionDroppedError:
      lost = True
      labels.append(None)
      break
    labels.append(y)
    if y is None:  # an unusable reply: no update, and no more rounds on guesswork
      break
  with memory._lock:  # pylint: disable=protected-access
    s = memory._sessions.by_id.get(r.session_id)  # pylint: disable=protected-access
    if s is not None and not s.closed:  # ended early: the rounds so far are the training query
      memory.close(r)
    if lost:
      memory.stats["recall_sessions_dropped"] += 1
    last = rounds[-1]
    if memory.config.final_slate == "round_T" or s is None:
      ids, scores = last.ids, last.scores
    else:  # (a live session: none of its candidates was deleted)
      slate, slate_mask, z = (np.asarray(x) for x in _exploit(
          params, s.query_emb, s.cand_emb, s.cand_mask, s.mean, s.counts, k=k))
      pos = slate[slate_mask]
      ids = memory._bank.describe(s.cand_idx[pos])[0]  # pylint: disable=protected-access
      scores = z[pos]
    return _answer(memory, ids, scores, [i for x in rounds for i in x.ids],
                   memory.config.final_slate, rounds, labels)


def _frozen_rounds(memory: Any, retrieve_first, critic, k: int) -> Recall:
  """`recall(learn=False)`: the T rounds of one query played off the memory's sessions.

  `retrieve_first()` opens round 1 and its session is read and closed without feedback in the
  same hold of the lock (so it queues nothing, and no delete can drop it in between); rounds 2..T
  are made by the same `episode.round_slates` as `retrieve(continue_from=...)` from the bandit
  statistics updated here (Eq. (9), `episode.update_bandits`), all with the adapter as it stood
  at round 1. The critic's key of round t is `fold_in(fold_in(k_critic, retrieval_id), t)`. An
  unusable reply (None) ends the rounds (the answer is then the last round's slate). Before each
  round the candidates deleted or updated since (their id no longer at their row) are masked out;
  a round left with no memory to show ends the rounds.
  """
  with memory._lock:  # pylint: disable=protected-access
    first = retrieve_first()
    sid = memory._sessions.resolve_open(first)  # pylint: disable=protected-access
    s = memory._sessions.by_id[sid]  # pylint: disable=protected-access
    query, query_emb, cand_idx = s.query, s.query_emb, s.cand_idx
    cand_emb, cand_mask = s.cand_emb, s.cand_mask.copy()
    cand_ids, cand_texts, _ = memory._bank.describe(cand_idx[cand_mask])  # pylint: disable=protected-access
    slate = np.asarray(s.open_slate, np.int32).copy()
    params = memory._served_params()  # pylint: disable=protected-access  (test time: guarded)
    memory.discard(first)
    memory.close(first)  # no feedback: nothing is queued
    critic_key = memory._critic_key  # pylint: disable=protected-access
    base_key = jax.random.fold_in(critic_key, first.retrieval_id)
  pos_of = np.flatnonzero(cand_mask)  # the masked candidates lead (best first), padding after
  cand_ids = dict(zip(pos_of.tolist(), cand_ids))
  cand_texts = dict(zip(pos_of.tolist(), cand_texts))
  config, hparams = memory.config, memory.hparams
  K, d = config.num_candidates, config.dim
  mean, counts = np.zeros((K,), np.float32), np.zeros((K,), np.float32)
  z = np.zeros((K,), np.float32)
  z[slate] = first.scores
  labels, shown = [], []
  for t in range(config.eval_rounds):  # T at test (Memory refuses test_rounds != num_rounds)
    with memory._lock:  # pylint: disable=protected-access
      bank = memory._bank  # pylint: disable=protected-access
      for p in np.flatnonzero(cand_mask).tolist():
        if bank.row_of.get(cand_ids[p]) != int(cand_idx[p]):  # deleted or updated since
          cand_mask[p] = False
    if t:
      sl, sm, zz = episode.round_slates(params, hparams, query_emb[None], cand_emb[None],
                                        cand_mask[None], mean[None], counts[None], k, True)
      slate, z = sl[0][sm[0]], zz[0]
    else:
      slate = slate[cand_mask[slate]]
    if not len(slate):  # every memory it could show was deleted: nothing to ask the critic
      break
    ids = [cand_ids[p] for p in slate.tolist()]
    shown += ids
    view = critic_lib.SlateView(query=query_emb, slate=slate.copy(),
                                slate_mask=np.ones(len(slate), bool),
                                memories=cand_emb[slate, :d], gold=np.zeros(len(slate), bool),
                                query_text=query, texts=[cand_texts[p] for p in slate.tolist()],
                                ids=ids)
    y = critic(jax.random.fold_in(base_key, t), view)
    memory.stats["critic_calls"] += 1
    if y is None:
      memory.stats["critic_no_update"] += 1
      labels.append(None)
      break
    y = episode.check_labels(y, len(slate), "the critic")
    labels.append(y)
    full = np.full((1, K), -1, np.int32)
    mask = np.zeros((1, K), bool)
    lab = np.full((1, K), -1.0, np.float32)
    full[0, :len(slate)], mask[0, :len(slate)], lab[0, :len(slate)] = slate, True, y
    m, c = episode.update_bandits(mean[None], counts[None], full, mask, lab)
    mean, counts = m[0], c[0]
  if config.final_slate != "round_T":
    out, out_mask, z = (np.asarray(x) for x in _exploit(params, query_emb, cand_emb, cand_mask,
                                                        mean, counts, k=k))
    slate = out[out_mask]
  with memory._lock:  # pylint: disable=protected-access
    memory.stats["frozen_recalls"] += 1
    return _answer(memory, [cand_ids[p] for p in slate.tolist()], z[slate], shown,
                   config.final_slate, (first,), labels)


def search(memory: Any, question: Optional[str] = None, k: int = 5, *,
           query_embedding=None, scope=None):
  """The adapter-only slate of a question: no critic, no learning. A read: its session is opened
  and closed empty in one hold of the lock (the question encoded before), so a delete in another
  thread never makes it fail."""
  retrieve = _retrieve_now(memory, question, k, False, query_embedding, scope)
  with memory._lock:  # pylint: disable=protected-access
    r = retrieve()
    memory.close(r)
  return r
