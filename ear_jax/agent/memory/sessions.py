"""Query sessions: one question's `K` candidates and its rounds, in four kinds.

Symbols: `K` candidates, `k` memories shown (`k <= K`), `T` Explorer rounds, `d` dimension, `F`
first-stage side features.

`play` opens the next round, `record` takes its feedback (the `TrainItem` when that closes it).
`TrainingSession`: Explorer rounds (Eq. (5)-(8)) or the served top-k, ONE training query
(Eq. (10)-(14)). `HeldOutSession`: pages of the first stage's ranking, for the guard's ring.
`FrozenExplorerSession` / `PagingSession` (`learn=False`): nothing trains, and a delete of a
candidate masks it out (it drops a learning session).
"""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

from ear_jax.agent.memory import episode
from ear_jax.agent.memory.checks import InputTypeError
from ear_jax.core import adapter as adapter_lib
from ear_jax.core import guard as guard_lib


class SessionDroppedError(ValueError):
  """A session gone: evicted, or dropped by a delete / update of a candidate."""


@dataclasses.dataclass(frozen=True)
class Slate:
  """Up to `k` memories shown for a question, best first (adapter-only) or in slate order."""
  ids: tuple[str, ...]  # [k] memory ids
  texts: tuple[str, ...]  # [k]
  stores: tuple[str, ...]  # [k] store names ('dialogue' | 'observation')
  scores: tuple[float, ...]  # [k] adapted relevance logits `z` (Eq. (4))
  round: int  # the 1-based round of its session (0 for `Memory.search`)
  explore: bool  # an Explorer round (Eq. (8)), or the adapter's top-k
  session_id: int  # -1 for `Memory.search`
  query: str  # the question's text ('' when only an embedding was given)

  def __len__(self):
    return len(self.ids)

  @classmethod
  def of(cls, recs, scores, round_: int, explore: bool, sid: int, query: str) -> "Slate":
    """The slate of table records `recs` (`Rows.records`) and their `scores`."""
    return cls(ids=tuple(r["id"] for r in recs), texts=tuple(r["text"] for r in recs),
               stores=tuple(r["store"] for r in recs), scores=tuple(float(x) for x in scores),
               round=round_, explore=explore, session_id=sid, query=query)


def citation_labels(shown: list[str], cited_ids, what: str) -> np.ndarray:
  """`[k]` labels of a shown slate: +1 for cited ids, -1 otherwise (Appendix A.2)."""
  if cited_ids is None:
    cited_ids = []
  elif isinstance(cited_ids, str):
    cited_ids = [cited_ids]
  elif isinstance(cited_ids, (collections.abc.Mapping, bytes)) or not isinstance(
      cited_ids, collections.abc.Iterable):
    raise InputTypeError(f"cited_ids must be a collection of memory ids, got "
                         f"{type(cited_ids).__name__}")
  cited_ids = list(cited_ids)
  unknown = [c for c in cited_ids if not isinstance(c, str) or c not in shown]
  if unknown:
    raise ValueError(f"cited ids {unknown[:5]} were not in the slate of {what} (its ids: "
                     f"{shown})")
  cited = set(cited_ids)
  return np.asarray([1.0 if i in cited else -1.0 for i in shown], np.float32)


def paging_answer(shown, labels, k: int):
  """`(answer [(id, score)] of at most k, ranked [(id, score, cited)])` of pages `shown`: the
  cited memories first, then the ranking (`core.retrieval.paging_slate`); ties in page order."""
  ranked = [(i, sc, lab is not None and len(lab) == len(p.ids) and lab[j] > 0)
            for p, lab in zip(shown, labels) for j, (i, sc) in enumerate(zip(p.ids, p.scores))]
  ranked.sort(key=lambda r: -r[1])  # (stable: pages of a ranking are in its order already)
  answer = ([(i, sc) for i, sc, c in ranked if c] + [(i, sc) for i, sc, c in ranked if not c])[:k]
  return answer, ranked


class TrainItem(NamedTuple):
  """One closed session: one training query of `learner.train_batch_on_feedback` (unbatched)."""
  query: np.ndarray  # [d] float32 pre-adapter query
  candidates: np.ndarray  # [K, d + F] float32 pre-adapter candidates (0 where masked)
  mask: np.ndarray  # [K] bool valid candidates
  slates: np.ndarray  # [T, K] int32 candidate positions of each round (-1 = empty)
  slate_mask: np.ndarray  # [T, K] bool (rows of rounds without feedback are all False)
  labels: np.ndarray  # [T, K] float32 labels in {-1, +1}
  rows: np.ndarray  # [K] int32 bank rows of the candidates (-1 = padding)
  held: Any = 0  # [] int8 `Driver.next_held`'s code: 0 trained, 1 / 2 held out


class View(NamedTuple):
  """What a round reads of the learner (`Learning.view`)."""
  params: Any  # the live adapter parameters (Explorer rounds learn from them)
  served: Any  # the parameters test-time slates rank by (`core.guard.served_params`)
  hparams: Any
  config: Any  # the static `EARConfig`


@functools.partial(jax.jit, static_argnums=4)
def _held_pages(params, q, c, where, config):
  """A held-out session's first-stage relevance `z` and the scores its pages follow."""
  z = adapter_lib.relevance(guard_lib.first_stage_params(config), q, c)[0]
  return z, guard_lib.page_relevance(adapter_lib.relevance(params, q, c)[0], z, where, config)


@dataclasses.dataclass
class QuerySession:
  """One question's candidates and rounds (host numpy arrays); the kinds below own the rounds."""
  trains = True  # its feedback goes to the learner, and it is saved with it
  sid: int
  query: str
  query_emb: np.ndarray  # [d] float32
  cand_idx: np.ndarray  # [K] int32 bank rows, -1 = padding
  cand_emb: np.ndarray  # [K, d + F] float32 (embedding | first-stage features)
  cand_mask: np.ndarray  # [K] bool
  mean: np.ndarray  # [K] float32 bandit mean mu_i, Eq. (9) (less the last round's, when `stale`)
  counts: np.ndarray  # [K] float32 bandit counts N_i (likewise)
  slates: np.ndarray  # [T, K] int32 candidate positions of each round's slate, -1 = empty
  slate_mask: np.ndarray  # [T, K] bool
  labels: np.ndarray  # [T, K] float32
  scope: tuple = ()  # the scope names its candidates came from (empty: every scope)
  rounds: int = 0  # rounds with feedback
  closed: bool = False  # handed to the learner (or dropped): no more rounds
  open_slate: Optional[np.ndarray] = None  # [k] int32 candidate positions of the open round
  open_explore: bool = False  # its feedback leaves the session open (rounds < T)
  shown: int = 0  # rounds opened (the critic key of the open round: `shown - 1`)
  last_used: int = 0
  params: Any = None  # the adapter parameters of its last round (frozen / 'exploit' answers)
  stale: bool = False  # the feedback of round `rounds` is not in mean / counts yet (`last`)
  adapted: Any = None  # `(z [K], gram [K, K])` device arrays of its last round (`episode.adapted`)
  adapted_by: Any = None  # the parameters they were computed with
  ranking: Optional[np.ndarray] = None  # paged: [K] float32 the relevance its pages follow
  page_order: Optional[np.ndarray] = None  # held out: [K] the scores its pages follow
  held: int = 0  # `Driver.next_held`'s code: 0 trained, 1 or 2 held out for the guard
  records: dict = dataclasses.field(default_factory=dict)  # bank row -> its table record

  @property
  def num_held(self) -> int:
    """Candidates still held."""
    return int(self.cand_mask.sum())

  def open(self, positions, explore: bool) -> None:
    self.open_slate, self.open_explore = np.asarray(positions, np.int32), bool(explore)
    self.shown += 1

  def play(self, k: int, explore: bool, view: View):
    """Opens the next round: `(positions [k'], scores [k'], explore)`; None: nothing left."""
    raise NotImplementedError

  def record(self, labels: np.ndarray, num_rounds: int) -> Optional[TrainItem]:
    """Feedback `[k]` on the open round; the `TrainItem` if it closes it (Eq. (9) applied later)."""
    self.settle()  # (no-op unless a round's feedback is pending already)
    return self._store(labels, num_rounds)

  def _store(self, labels: np.ndarray, num_rounds: int) -> Optional[TrainItem]:
    r, k = self.rounds, len(self.open_slate)
    pad = (0, self.slates.shape[1] - k)
    self.slates[r] = np.pad(self.open_slate, pad, constant_values=-1)
    self.slate_mask[r] = np.arange(self.slates.shape[1]) < k
    self.labels[r] = np.pad(labels, pad, constant_values=-1.0)
    self.rounds = r + 1
    self.stale = True
    self.open_slate = None
    return self.close() if not self.open_explore or self.rounds >= num_rounds else None

  def close(self) -> Optional[TrainItem]:
    """Closes it (an open round is discarded); its item if it has feedback to learn from."""
    if self.closed:
      return None
    self.closed, self.open_slate = True, None
    return self.train_item() if self.rounds and self.trains else None

  def forget(self, hit: np.ndarray) -> bool:
    """A delete of the candidates at `hit [K]`: True when the session must be dropped."""
    if self.trains:
      return True
    self.cand_mask = self.cand_mask & ~hit
    return False

  def pages(self):
    """`[(positions, labels or None)]` of the pages shown so far (paging's answer)."""
    raise ValueError(f"session {self.sid} plays Explorer rounds: answer() is paging's (a session "
                     "opened with learn=False)")

  def final(self, k: int, params):
    """`(positions [k'], z [k'])`: the top-k by bandit mean, ties by relevance; None if empty."""
    k = min(k, self.num_held)  # (frozen: deletes may have masked candidates out)
    if not k:
      return None
    params = self.params if self.params is not None else params
    slate, slate_mask, z = episode.exploit(params, self.query_emb, self.cand_emb, self.cand_mask,
                                           self.mean, self.counts, self.last(), k,
                                           self._adapted(params))
    pos = slate[slate_mask]
    return pos, z[pos]

  def last(self):
    """`(slate [K], slate_mask [K], labels [K])` of the feedback not yet in `mean` / `counts`."""
    if not self.stale:
      return episode.no_feedback(len(self.mean))
    r = self.rounds - 1
    return self.slates[r], self.slate_mask[r], self.labels[r]

  def settle(self) -> None:
    """Applies the pending feedback to `mean` / `counts` now (Eq. (9))."""
    if self.stale:
      mean, counts = episode.update_bandits(self.mean[None], self.counts[None],
                                            *(x[None] for x in self.last()))
      self.mean, self.counts, self.stale = mean[0], counts[0], False

  def train_item(self) -> TrainItem:
    return TrainItem(self.query_emb.copy(), self.cand_emb.copy(), self.cand_mask.copy(),
                     self.slates.copy(), self.slate_mask.copy(), self.labels.copy(),
                     self.cand_idx.copy(), np.int8(self.held))

  def _adapted(self, params):
    """Its last round's `episode.adapted` when it ranked by `params`, else None."""
    return self.adapted if self.adapted_by is params else None

  def _explorer_round(self, k: int, explore: bool, params, hparams):
    """One `episode.session_round` by `params`: `(positions [k], z [K])`."""
    (slate, slate_mask, z, self.mean, self.counts), self.adapted = episode.session_round(
        params, hparams, self.query_emb, self.cand_emb, self.cand_mask, self.mean, self.counts,
        self.last(), k, explore, self._adapted(params))
    self.stale, self.adapted_by = False, params
    return slate[slate_mask], z


class TrainingSession(QuerySession):
  """A learning session: Explorer rounds, or the adapter's top-k (whose feedback closes it)."""

  def play(self, k, explore, view):
    k = min(k, self.num_held)  # (k is a maximum)
    params = view.params if explore else view.served
    pos, z = self._explorer_round(k, explore, params, view.hparams)
    self.open(pos, explore)
    if view.config.final_slate != "round_T":
      self.params = params  # (a reference: `Learning` copies it before a learner step donates it)
    return pos, z[pos], explore


class FrozenExplorerSession(QuerySession):
  """A test-time session playing Explorer rounds with the served parameters of its first round."""
  trains = False

  def play(self, k, explore, view):
    k = min(k, self.num_held)
    if not k:
      return None
    pos, z = self._explorer_round(k, True, self.params, view.hparams)
    self.open(pos, True)
    return pos, z[pos], True


class _Paged(QuerySession):
  """Round t shows page t of `ranking`: the first `k` candidates still held that no page with
  feedback showed (ties to the lower candidate). No bandit statistics."""

  def play(self, k, explore, view):
    z = self.ranking
    by = z if self.page_order is None else self.page_order
    order = np.lexsort((np.arange(len(by)), -by))
    fresh = self.cand_mask.copy()
    fresh[self.slates[:self.rounds][self.slate_mask[:self.rounds]]] = False
    pos = order[fresh[order]][:k].astype(np.int32)
    if not len(pos):
      return None
    self.open(pos, explore)
    return pos, z[pos], True

  def record(self, labels, num_rounds):
    return self._store(labels, num_rounds)  # (pages keep no bandit statistics)

  def pages(self):
    out = [(self.slates[t][self.slate_mask[t]], self.labels[t][self.slate_mask[t]])
           for t in range(self.rounds)]
    return out + ([] if self.open_slate is None else [(self.open_slate, None)])


class HeldOutSession(_Paged):
  """A learning session held out for the guard: pages of the first stage's ranking; its item
  goes to the guard's ring, never to training."""

  def play(self, k, explore, view):
    if self.ranking is None:
      z, order = _held_pages(view.params, self.query_emb, self.cand_emb, self.cand_mask,
                             view.config)
      self.ranking, self.page_order = np.asarray(z), np.asarray(order)
    return super().play(k, explore, view)


class PagingSession(_Paged):
  """A test-time session (`learn=False`): pages of the served ranking; nothing trains."""
  trains = False
