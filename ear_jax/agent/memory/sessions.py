"""Query sessions of `Memory`: the `Session` handle, the `Slate` it shows, and the registry behind.

Symbols: `K` candidates per query, `k` memories shown (`k <= K`), `T` Explorer rounds
(`config.num_rounds`), `d` dimension, `F` first-stage side features.

`Memory.session(question)` finds the question's `K` candidates (the first stage, in the scopes
asked for) and opens a *session*; `Session.round(k, explore)` shows a slate made by
`ear_jax.core.retrieval.slate_from_candidates`: with `explore=False` the adapter's top-k
(Section 3.6, ranked by the guard's served parameters), with `explore=True` one Explorer round
(Eq. (5)-(8)) from the session's bandit statistics. `Session.feedback` labels the round it
showed, updating the statistics (Eq. (9)); the round is kept K wide (masked), so `k` may change
from round to round. A new `round()` before feedback discards the open round (no update).

A query's rounds are ONE training query and ONE experience (Eq. (10)-(14), Alg. 1): a session is
*closed* and handed to the learner as one `TrainItem` when it has `T` rounds of feedback, when an
adapter-only round got its feedback, or when it is closed (`Session.close`) or evicted (the least
recently used beyond `max_sessions`) with at least one round of feedback; without feedback it is
dropped. A session that leaves by eviction, or by a delete or an update of one of its candidates
(`ear_jax.agent.memory.forget`), is remembered with the reason (the last `MAX_GONE`), so its
handle's calls raise a `SessionDroppedError` saying why.

*Frozen* sessions play `Memory.recall(learn=False)` and `Memory.session(learn=False)`: nothing for
the learner; a delete masks its memories out of the later rounds instead of dropping the session.
A *paging* one's round t is page t of the served ranking (ranks `t k .. t k + k - 1`, the served
parameters' relevance computed by the open's search), its answer `Session.answer`; an Explorer one
(`recall(rule='explorer')`) plays every round with the served parameters of round 1. They are
never saved (they end with their process) and are evicted like the others (an unclosed
`Memory.session(learn=False)` cannot pile up).

The registry is not thread-safe on its own (`Memory` holds its lock); a handle reaches its memory
only through `Ops`, the memory's locked session operations.
"""
from __future__ import annotations

import collections
import collections.abc
import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory.checks import InputTypeError
from ear_jax.agent.memory.episode import no_feedback, update_bandits
from ear_jax.core.config import EARConfig

MAX_GONE = 4096  # sessions that left remembered with the reason (oldest forgotten first)


class SessionDroppedError(ValueError):
  """A session that is gone: evicted, or dropped because a delete or an update removed one of its
  candidates. Its message says which (a `ValueError`, as every input error)."""


@dataclasses.dataclass(frozen=True)
class Slate:
  """`k` memories shown for a question, best first (adapter-only) or in slate order (Explorer).

  Attributes:
    ids, texts, stores: `[k]` memory ids, texts and store names ('dialogue' | 'observation').
    scores: `[k]` adapted relevance logits `z` (Eq. (4)); the frozen cosine while the adapter is
      the identity.
    round: the 1-based round of its session (0 for `Memory.search`).
    explore: True for an Explorer round (Eq. (8)), False for the adapter's top-k.
    session_id: its session (-1 for `Memory.search`).
    query: the question's text ('' when only an embedding was given).
  """
  ids: tuple[str, ...]
  texts: tuple[str, ...]
  stores: tuple[str, ...]
  scores: tuple[float, ...]
  round: int
  explore: bool
  session_id: int
  query: str

  def __len__(self):
    return len(self.ids)


def citation_labels(shown: list[str], cited_ids, what: str) -> np.ndarray:
  """`[k]` labels of a shown slate: +1 for cited ids, -1 otherwise (Appendix A.2's citations).

  Raises:
    TypeError / ValueError: `cited_ids` is not a collection of ids, or names an id not shown.
  """
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


class TrainItem(NamedTuple):
  """One closed session: one training query of `learner.train_batch_on_feedback` (unbatched)."""
  query: np.ndarray  # [d] float32 pre-adapter query
  candidates: np.ndarray  # [K, d + F] float32 pre-adapter candidates (0 where masked)
  mask: np.ndarray  # [K] bool valid candidates
  slates: np.ndarray  # [T, K] int32 candidate positions of each round (-1 = empty)
  slate_mask: np.ndarray  # [T, K] bool (rows of rounds without feedback are all False)
  labels: np.ndarray  # [T, K] float32 labels in {-1, +1}
  rows: np.ndarray  # [K] int32 bank rows of the candidates (-1 = padding): what the learner
  #   item saves instead of the candidates' embeddings (`driver`)
  held: Any = 0  # [] int8 `Driver.next_held`: 0 trained; 1 held out (`EARConfig.guard_holdout`:
  #   never trained, its feedback to the guard's ring); 2 held out again (not in the ring twice)


@dataclasses.dataclass
class Query:
  """One session's state (host numpy arrays)."""
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
  open_explore: bool = False
  last_used: int = 0
  frozen: bool = False  # a test-time session (`learn=False`): never trained or saved
  params: Any = None  # the adapter parameters of its last round (frozen / 'exploit' answers)
  stale: bool = False  # the feedback of round `rounds` is not in mean / counts yet (`last`)
  adapted: Any = None  # `(z [K], gram [K, K])` device arrays of its last round (`episode.adapted`)
  adapted_by: Any = None  # the parameters they were computed with
  ranking: Optional[np.ndarray] = None  # frozen: [K] float32 the served parameters' relevance z
  #   of its candidates (the open's one search computed it; paging reads it)
  paged: bool = False  # its rounds are pages of `ranking`: no bandit statistics kept
  page_order: Optional[np.ndarray] = None  # held out: [K] float32 the scores its pages follow
  #   when not `ranking` (None: `ranking`)
  held: int = 0  # held out for the guard (`Driver.next_held`'s code; `EARConfig.guard_holdout`):
  #   its rounds page the first stage's ranking (`ranking`, computed at its first round) and it
  #   is never trained on
  records: dict = dataclasses.field(default_factory=dict)  # bank row -> its table record (a
  #   candidate's record never changes while its session lives: a delete or update drops it)

  def last(self):
    """`(slate [K], slate_mask [K], labels [K])` of the feedback not yet in `mean` / `counts`
    (all masked: none): `episode.session_round` applies it in the next round's call."""
    if not self.stale:
      return no_feedback(len(self.mean))
    r = self.rounds - 1
    return self.slates[r], self.slate_mask[r], self.labels[r]

  def settle(self) -> None:
    """Applies the pending feedback to `mean` / `counts` now (Eq. (9))."""
    if self.stale:
      mean, counts = update_bandits(self.mean[None], self.counts[None],
                                    *(x[None] for x in self.last()))
      self.mean, self.counts, self.stale = mean[0], counts[0], False

  def train_item(self) -> TrainItem:
    return TrainItem(self.query_emb.copy(), self.cand_emb.copy(), self.cand_mask.copy(),
                     self.slates.copy(), self.slate_mask.copy(), self.labels.copy(),
                     self.cand_idx.copy(), np.int8(self.held))


_ARRAYS = ("query_emb", "cand_idx", "cand_mask", "mean", "counts", "slates", "slate_mask",
           "labels")
_FIELDS = ("query", "scope", "rounds", "closed", "open_slate", "open_explore", "last_used",
           "held", "paged")
_FIELD_DEFAULTS = {"held": 0, "paged": False}  # (learner items saved before they existed)


class Sessions:
  """The sessions of one memory, least recently used first.

  Args:
    config: static config (`K`, `T`).
    max_sessions: sessions kept; beyond it the least recently used are evicted (closed first).
  """

  def __init__(self, config: EARConfig, max_sessions: int):
    self.config = config
    self.max_sessions = int(max_sessions)
    self.by_id: "collections.OrderedDict[int, Query]" = collections.OrderedDict()
    self.next_session = 0
    self.clock = 0
    self.gone: "collections.OrderedDict[int, str]" = collections.OrderedDict()  # sid -> why
    self.closed_memory = False  # set by `Memory.close`: every session call is refused

  def get(self, sid: int, open_round: Optional[bool] = None) -> Query:
    """The live session `sid`; `open_round` True / False: it must have an open round / may play
    a new one. Raises SessionDroppedError (gone) or ValueError, changing nothing."""
    if self.closed_memory:
      raise ValueError(f"session {sid}: its memory is closed (Memory.close); open the memory "
                       "again and resume the session")
    s = self.by_id.get(sid)
    if s is None:
      if sid in self.gone:
        raise SessionDroppedError(f"session {sid} was dropped because {self.gone[sid]}; open a "
                                  "new session")
      raise ValueError(f"unknown session {sid}: this memory has no such session open (a "
                       "learn=False session ends at close() and is never saved)")
    if open_round is not None and s.closed:
      raise ValueError(f"session {sid} is closed (an adapter-only round, close or its T "
                       f"rounds){'' if s.frozen else ' and went to the learner'}; open a new "
                       "session")
    if open_round and s.open_slate is None:
      raise ValueError(f"session {sid} has no open round to label: call round() first (each "
                       "round takes feedback once)")
    if open_round is False:
      if s.rounds >= self.config.num_rounds:
        raise ValueError(f"session {sid} has played all T={self.config.num_rounds} Explorer "
                         "rounds (Alg. 2); open a new session")
    return s

  def new(self, query: str, query_emb, cand_idx, cand_emb, cand_mask, scope=(),
          frozen: bool = False, held: int = 0, paged: bool = False) -> int:
    """Opens a session with zero statistics (Alg. 2 line 3); returns its id. `held`: held out
    for the guard (`Driver.next_held`'s code; its rounds page the first stage); `paged`
    (frozen): its rounds page the served ranking."""
    T, K = self.config.num_rounds, self.config.num_candidates
    sid = self.next_session
    self.next_session += 1
    self.by_id[sid] = Query(
        query=query, query_emb=np.array(query_emb, np.float32),
        cand_idx=np.array(cand_idx, np.int32), cand_emb=np.array(cand_emb, np.float32),
        cand_mask=np.array(cand_mask, bool), mean=np.zeros((K,), np.float32),
        counts=np.zeros((K,), np.float32), slates=np.full((T, K), -1, np.int32),
        slate_mask=np.zeros((T, K), bool), labels=np.full((T, K), -1.0, np.float32),
        scope=tuple(scope or ()), frozen=frozen, held=int(held), paged=bool(held) or bool(paged))
    self._touch(sid)
    return sid

  def open_round(self, sid: int, positions: np.ndarray, explore: bool) -> None:
    s = self.by_id[sid]
    s.open_slate, s.open_explore = np.asarray(positions, np.int32), bool(explore)
    self._touch(sid)

  def _touch(self, sid: int) -> None:
    self.clock += 1
    self.by_id[sid].last_used = self.clock
    self.by_id.move_to_end(sid)

  def record(self, sid: int, labels: np.ndarray) -> Optional[TrainItem]:
    """Feedback `[k]` on the open round of `sid`; the `TrainItem` if this closes it. Its bandit
    update (Eq. (9)) is pending (`Query.stale`) until the next round's call applies it."""
    s = self.by_id[sid]
    K, k = self.config.num_candidates, len(s.open_slate)
    slate, mask = np.full((K,), -1, np.int32), np.zeros((K,), bool)
    lab = np.full((K,), -1.0, np.float32)
    slate[:k], mask[:k], lab[:k] = s.open_slate, True, labels
    if not s.paged:  # (no-op unless a round's feedback is pending already)
      s.settle()
    s.slates[s.rounds], s.slate_mask[s.rounds], s.labels[s.rounds] = slate, mask, lab
    s.rounds += 1
    s.stale = True
    s.open_slate = None
    self._touch(sid)
    if not s.open_explore or s.rounds >= self.config.num_rounds:
      return self.close(sid)
    return None

  def close(self, sid: int) -> Optional[TrainItem]:
    """Closes session `sid` (an open round is discarded); its item if it has feedback."""
    s = self.by_id[sid]
    if s.closed:
      return None
    s.closed, s.open_slate = True, None
    return s.train_item() if s.rounds and not s.frozen else None

  def evict(self) -> list[TrainItem]:
    """Drops sessions beyond `max_sessions` (least recently used, closed ones first; test-time
    ones too, which have no item); returns the items of those with feedback."""
    live = list(self.by_id)
    excess = len(live) - self.max_sessions
    if excess <= 0:
      return []
    victims = ([sid for sid in live if self.by_id[sid].closed]
               + [sid for sid in live if not self.by_id[sid].closed])[:excess]
    items = [self.close(sid) for sid in victims]
    for sid in victims:
      self.drop(sid, f"it was evicted (the least recently used beyond "
                     f"max_sessions={self.max_sessions})")
    return [it for it in items if it is not None]

  def drop(self, sid: int, reason: str) -> None:
    """Removes session `sid` untrained, remembering `reason` for its handle's errors."""
    self.by_id.pop(sid)
    self.gone[sid] = reason
    while len(self.gone) > MAX_GONE:
      self.gone.popitem(last=False)

  # ----------------------------------------------------------------------------------------------
  # the learner item (`persistence`): rows instead of the candidates' embeddings

  def snapshot(self):
    """`(arrays, meta)`: host copies of the sessions that are not frozen (no arrays when none).
    The candidates are saved as their bank rows (`cand_idx`) and first-stage features only; the
    question's text only while the session is open (a closed one needs it no more)."""
    ss = [(sid, s) for sid, s in self.by_id.items() if not s.frozen]
    for _, s in ss:
      s.settle()
    arrays = {}
    if ss:
      arrays = {f: np.stack([getattr(s, f) for _, s in ss]) for f in _ARRAYS}
      arrays["features"] = np.stack([s.cand_emb[:, self.config.dim:] for _, s in ss])
    meta = {"next_session": self.next_session, "clock": self.clock,
            "sessions": [{"id": sid, **{f: _jsonable(getattr(s, f)) for f in _FIELDS},
                          **({"query": ""} if s.closed else {})} for sid, s in ss]}
    return arrays, meta

  @classmethod
  def restore(cls, config: EARConfig, max_sessions: int, arrays, meta, gather: Callable,
              live: Callable) -> tuple["Sessions", int]:
    """`(sessions, dropped)` of `snapshot`: `gather(rows [n, K], mask [n, K])` gives the
    candidates' `[n, K, d]` embeddings from the bank, `live(rows) -> [..] bool`; a session with
    a candidate deleted since the save is dropped (counted)."""
    out = cls(config, max_sessions)
    out.next_session, out.clock = int(meta["next_session"]), int(meta["clock"])
    saved = meta["sessions"]
    if not saved:
      return out, 0
    cand_idx, cand_mask = np.asarray(arrays["cand_idx"]), np.asarray(arrays["cand_mask"])
    emb = np.concatenate([np.asarray(gather(cand_idx, cand_mask)),
                          np.asarray(arrays["features"], np.float32)], -1)
    keep = (live(np.where(cand_mask, cand_idx, -1)) | ~cand_mask).all(-1)
    for j, sm in enumerate(saved):
      if not keep[j]:
        out.gone[int(sm["id"])] = "a memory among its candidates was deleted or updated"
        continue
      s = Query(cand_emb=emb[j], **{f: np.array(arrays[f][j]) for f in _ARRAYS},
                **{f: sm.get(f, _FIELD_DEFAULTS.get(f)) if f in _FIELD_DEFAULTS else sm[f]
                   for f in _FIELDS})
      s.scope = tuple(s.scope)
      s.open_slate = None if s.open_slate is None else np.asarray(s.open_slate, np.int32)
      out.by_id[int(sm["id"])] = s
    return out, int((~keep).sum())


def _fold_twice(key, sid, t):
  return jax.random.fold_in(jax.random.fold_in(key, sid), t)


_critic_key = jax.jit(_fold_twice)


@functools.partial(jax.jit, static_argnames=("size", "num_rounds"))
def _critic_key_block(key, start, *, size, num_rounds):
  rounds = jnp.arange(num_rounds)
  return jax.vmap(lambda sid: jax.vmap(lambda t: _fold_twice(key, sid, t))(rounds))(
      start + jnp.arange(size))


class CriticKeys:
  """The critic key of round `t` of session `sid`, `fold_in(fold_in(k_critic, sid), t)`, as a host
  `[2]` uint32 array: the keys of `BLOCK` sessions x `T` rounds come from ONE jitted call and are
  kept (the last two blocks), so a round pays no key dispatch.

  Args:
    key: the memory's critic key (`driver.seed_keys`).
    num_rounds: `T`.
  """
  BLOCK = 256

  def __init__(self, key, num_rounds: int):
    self._key, self._rounds = key, int(num_rounds)
    self._blocks: "collections.OrderedDict[int, np.ndarray]" = collections.OrderedDict()

  def __call__(self, sid: int, t: int) -> np.ndarray:
    if not 0 <= t < self._rounds:
      return np.asarray(_critic_key(self._key, sid, t))
    b = sid // self.BLOCK
    if b not in self._blocks:
      self._blocks[b] = np.asarray(_critic_key_block(self._key, b * self.BLOCK, size=self.BLOCK,
                                                     num_rounds=self._rounds))
      while len(self._blocks) > 2:
        self._blocks.popitem(last=False)
    return self._blocks[b][sid % self.BLOCK, t].copy()


def _jsonable(x):
  if isinstance(x, np.ndarray):
    return x.tolist()
  return list(x) if isinstance(x, tuple) else x


class Ops(NamedTuple):
  """A memory's locked session operations, bound methods built by `front.Memory`: what a
  `Session` handle and `recall` call (so neither reads the memory's private parts)."""
  round: Callable  # (sid, k, explore) -> Slate
  feedback: Callable  # (sid, cited_ids, answer) -> bool (a learner step ran)
  close: Callable  # (sid) -> bool
  info: Callable  # (sid) -> (rounds, closed)
  critique: Callable  # (sid, critic, t) -> labels [k] or None: the open round shown to a critic
  final: Callable  # (sid, k) -> (ids, scores): the top-k by bandit mean ('exploit')
  answer: Callable  # (sid, k or None) -> Slate: paging's answer over the pages shown so far
  open: Callable  # (question, query_embedding, scope, frozen, k, paged) -> Session
  abandon: Callable  # (sid) -> None: drops the session untrained (its recall failed)
  records: Callable  # (ids, sid or None) -> {id: record} of those still held
  count: Callable  # (name) -> None: one more in `Memory.stats[name]`


class Session:
  """A handle on one open query session of a `Memory` (`Memory.session`).

  Attributes:
    id: the session id (`Memory.session(resume=id)` re-attaches to it).
    question: the question's text ('' when only an embedding was given).
    scope: the scope names its candidates came from (empty: every scope).
    learn: False for a test-time session (`Memory.session(learn=False)`): its rounds are pages
      of the served ranking and nothing of it trains the learner.
    held_out: True for a training session held out for the guard (`EARConfig.guard_holdout`,
      `Driver.next_held`): its rounds page the first stage's ranking and it is never trained on.
  """

  def __init__(self, ops: Ops, sid: int, question: str, scope: tuple, learn: bool = True,
               held_out: bool = False):
    self._ops, self.id, self.question, self.scope = ops, int(sid), question, tuple(scope)
    self.learn, self.held_out = bool(learn), bool(held_out)

  def __repr__(self):
    return f"Session(id={self.id}, question={self.question!r}, rounds={self.rounds})"

  @property
  def rounds(self) -> int:
    """The rounds with feedback so far."""
    return self._ops.info(self.id)[0]

  @property
  def closed(self) -> bool:
    """True once it went to the learner, was closed, or was dropped."""
    try:
      return self._ops.info(self.id)[1]
    except SessionDroppedError:
      return True

  def round(self, k: int = 5, explore: bool = True) -> Slate:
    """The next round's slate of `k` memories (an open round without feedback is discarded):
    one Explorer round (Eq. (5)-(8)), or with `explore=False` the adapter's top-k ranked by the
    guard's served parameters (its feedback closes the session). At most `T` rounds. A
    test-time session (`learn=False`) shows the next page of the served ranking: its first `k`
    memories still held that no page with feedback showed (page t, ranks `t k .. t k + k - 1`,
    t the rounds with feedback so far, while nothing was deleted; keep `k` the same on every
    page; past its candidates: an empty slate, no round opened).

    Raises:
      SessionDroppedError: a delete / update of one of its candidates or an eviction ended it.
      ValueError: closed, all `T` rounds played, or `k` larger than its candidates.
    """
    return self._ops.round(self.id, k, explore)

  def feedback(self, cited_ids=(), *, answer: Optional[str] = None) -> bool:
    """Labels the open round: +1 for the memories the agent used, -1 for the others shown.

    The used memories are the cited ids and, with `answer` (the agent's answer to the question),
    those the answer draws on by the answer rule (issue 28: `episode.answer_labels`, the memory's
    encoder embedding the answer outside the lock); with both, their union. Updates the bandit
    statistics (Eq. (9)); a session this closes is queued, and every `b` queued sessions make one
    learner step.

    Returns:
      True when this call triggered a learner step.
    """
    return self._ops.feedback(self.id, cited_ids, answer)

  def close(self) -> bool:
    """Ends the session: queued for the learner when it has feedback (its rounds so far are one
    training query). Idempotent. Returns True when this triggered a learner step."""
    return self._ops.close(self.id)

  def answer(self, k: Optional[int] = None) -> Slate:
    """Paging's answer (test-time sessions, `learn=False`): of the pages shown so far (an open
    page counts as uncited), the cited memories first, in ranking order, then the ranking, cut to
    `k` (default: the first page's size) and less what was deleted since; what
    `Memory.recall(learn=False)` answers for the same labels (`recall.paging_answer`). Its
    `round` is the pages with feedback; it still answers once the T-th page's feedback closed
    the session, until `close()` releases it.

    Raises:
      ValueError: a session that plays Explorer rounds (its answer is `Memory.recall`'s).
    """
    return self._ops.answer(self.id, k)
