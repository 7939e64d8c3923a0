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
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Optional

import jax
import numpy as np

from ear_jax.agent.memory import episode
from ear_jax.core import adapter as adapter_lib
from ear_jax.core import explorer as explorer_lib

if TYPE_CHECKING:
  from ear_jax.agent.memory import Memory, Retrieval


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


def recall(memory: "Memory", question: str, critic, k: int = 5, *,
           query_embedding=None) -> Recall:
  """T Explorer rounds of `question` with `critic`, one training query, the final slate.

  Args:
    memory: the memory.
    question: the question's text (shown to the critic).
    critic: `critic(key, view) -> labels [k]` or None (e.g. `LLMCritic`, or any function of the
      `SlateView`'s `ids` / `texts`).
    k: memories per slate and in the answer.
    query_embedding: optional `[d]` precomputed embedding of the question.

  Returns:
    A `Recall`.
  """
  if not isinstance(question, str) or not question:
    raise ValueError("recall needs the question's text (a non-empty string): the critic reads it")
  rounds, labels = [], []
  r = memory.retrieve(question, k, explore=True, query_embedding=query_embedding)
  for t in range(memory.config.num_rounds):
    if t:
      r = memory.retrieve(k=k, explore=True, continue_from=r)
    rounds.append(r)
    params = memory.params  # the adapter this round's slate used (a copy: feedback may train)
    y = episode.feedback_from_critic(memory, r, critic)
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


def search(memory: "Memory", question: Optional[str] = None, k: int = 5, *,
           query_embedding=None) -> "Retrieval":
  """The adapter-only slate of a question: no critic, no learning (its session is closed empty)."""
  r = memory.retrieve(question, k, explore=False, query_embedding=query_embedding)
  memory.close(r)
  return r
