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

from ear_jax.agent.memory import episode
from ear_jax.core import adapter as adapter_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import explorer as explorer_lib



@dataclasses.dataclass(frozen=True)
class Recall:
  """What `Memory.recall` returns.

  Attributes:
    ids, texts, stores: `[k]` the final slate's memory ids, texts and store names.
    scores: `[k]` their adapted relevance `z`.
    rounds: the T `Retrieval`s shown to the critic, in order.
    labels: `[T]` the critic's labels of each round (None for an unusable reply).
    final_slate: the rule that chose the answer ('round_T' or 'exploit').
  """
  ids: tuple[str, ...]
  texts: tuple[str, ...]
  stores: tuple[str, ...]
  scores: tuple[float, ...]
  rounds: tuple
  labels: tuple
  final_slate: str

  def __len__(self):
    return len(self.ids)


@functools.partial(jax.jit, static_argnames=("k",))
def _exploit(params, query, candidates, mask, mean, counts, *, k):
  z, _ = adapter_lib.relevance(params, query, candidates)
  slate, slate_mask = explorer_lib.exploit_slate(
      explorer_lib.BanditStats(mean=mean, counts=counts), z, mask, k)
  return slate, slate_mask, z


def recall(memory: Any, question: str, critic, k: int = 5, *,
           query_embedding=None, learn: bool = True, scope=None) -> Recall:
  """T Explorer rounds of `question` with `critic`, one training query, the final slate.

  With `learn=False` the rounds are explorer-assisted inference with the adapter frozen, as
  `ear_jax.core.inference.evaluate` plays a test query: the same slates, bandit updates and final
  slate, but nothing is queued for the learner (`_frozen_rounds`).

  Args:
    memory: the memory.
    question: the question's text (shown to the critic).
    critic: `critic(key, view) -> labels [k]` or None (e.g. `LLMCritic`, or any function of the
      `SlateView`'s `ids` / `texts`).
    k: memories per slate and in the answer.
    query_embedding: optional `[d]` precomputed embedding of the question.
    learn: False: no training query (a test question; `Recall.rounds` then holds round 1 only).
    scope: the scopes the candidates come from (None: every scope; `Memory.retrieve_batch`).

  Returns:
    A `Recall`.
  """
  if not isinstance(question, str) or not question:
    raise ValueError("recall needs the question's text (a non-empty string): the critic reads it")
  rounds, labels = [], []
  r = memory.retrieve(question, k, explore=True, query_embedding=query_embedding, scope=scope)
  if not learn:
    return _frozen_rounds(memory, r, critic, k)
  for t in range(memory.config.num_rounds):
    if t:
      r = memory.retrieve(k=k, explore=True, continue_from=r)
    rounds.append(r)
    params = memory.params  # the adapter this round's slate used (a copy: feedback may train)
    y = memory.feedback_from_critic(r, critic)
    labels.append(y)
    if y is None:  # an unusable reply: no update, and no more rounds on guesswork
      break
  with memory._lock:  # pylint: disable=protected-access
    s = memory._sessions.by_id.get(r.session_id)  # pylint: disable=protected-access
    if s is not None and not s.closed:  # ended early: the rounds so far are the training query
      memory.close(r)
    last = rounds[-1]
    if memory.config.final_slate == "round_T" or s is None:
      ids, texts, stores, scores = last.ids, last.texts, last.stores, last.scores
    else:
      slate, slate_mask, z = (np.asarray(x) for x in _exploit(
          params, s.query_emb, s.cand_emb, s.cand_mask, s.mean, s.counts, k=k))
      pos = slate[slate_mask]
      ids, texts, stores = memory._bank.describe(s.cand_idx[pos])  # pylint: disable=protected-access
      scores = tuple(float(x) for x in z[pos])
  return Recall(ids=tuple(ids), texts=tuple(texts), stores=tuple(stores), scores=tuple(scores),
                rounds=tuple(rounds), labels=tuple(labels),
                final_slate=memory.config.final_slate)


def _frozen_rounds(memory: Any, first, critic, k: int) -> Recall:
  """`recall(learn=False)`: the T rounds of `first`'s query played off the memory's sessions.

  `first` (round 1, already retrieved) is closed without feedback, so its session queues nothing;
  rounds 2..T are made by the same `episode.round_slates` as `retrieve(continue_from=...)` from
  the bandit statistics updated here (Eq. (9), `episode.update_bandits`), all with the adapter as
  it stood at `first`. The critic's key of round t is `fold_in(fold_in(k_critic, retrieval_id),
  t)`. An unusable reply (None) ends the rounds (the answer is then the last round's slate).
  """
  with memory._lock:  # pylint: disable=protected-access
    sid = memory._sessions.resolve_open(first)  # pylint: disable=protected-access
    s = memory._sessions.by_id[sid]  # pylint: disable=protected-access
    query, query_emb, cand_idx = s.query, s.query_emb, s.cand_idx
    cand_emb, cand_mask = s.cand_emb, s.cand_mask
    slate = np.asarray(s.open_slate, np.int32).copy()
    params = memory.params
    memory.discard(first)
    memory.close(first)  # no feedback: nothing is queued
    critic_key = memory._critic_key  # pylint: disable=protected-access
    base_key = jax.random.fold_in(critic_key, first.retrieval_id)
  config, hparams = memory.config, memory.hparams
  K, d = config.num_candidates, config.dim
  mean, counts = np.zeros((K,), np.float32), np.zeros((K,), np.float32)
  z = np.zeros((K,), np.float32)
  z[slate] = first.scores
  labels = []
  for t in range(config.eval_rounds):  # T at test (Memory refuses test_rounds != num_rounds)
    if t:
      sl, sm, zz = episode.round_slates(params, hparams, query_emb[None], cand_emb[None],
                                        cand_mask[None], mean[None], counts[None], k, True)
      slate, z = sl[0][sm[0]], zz[0]
    with memory._lock:  # pylint: disable=protected-access
      ids, texts, _ = memory._bank.describe(cand_idx[slate])  # pylint: disable=protected-access
    view = critic_lib.SlateView(query=query_emb, slate=slate.copy(),
                                slate_mask=np.ones(len(slate), bool),
                                memories=cand_emb[slate, :d], gold=np.zeros(len(slate), bool),
                                query_text=query, texts=list(texts), ids=list(ids))
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
    ids, texts, stores = memory._bank.describe(cand_idx[slate])  # pylint: disable=protected-access
  memory.stats["frozen_recalls"] += 1
  return Recall(ids=tuple(ids), texts=tuple(texts), stores=tuple(stores),
                scores=tuple(float(x) for x in z[slate]), rounds=(first,), labels=tuple(labels),
                final_slate=config.final_slate)


def search(memory: Any, question: Optional[str] = None, k: int = 5, *,
           query_embedding=None, scope=None):
  """The adapter-only slate of a question: no critic, no learning (its session is closed empty)."""
  r = memory.retrieve(question, k, explore=False, query_embedding=query_embedding, scope=scope)
  memory.close(r)
  return r
