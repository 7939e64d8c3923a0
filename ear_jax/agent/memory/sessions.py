"""Query sessions of `Memory`: one query's candidates, bandit statistics, rounds, slates and labels.

Symbols: `K` candidates per query, `k` memories shown (`k <= K`), `T` Explorer rounds
(`config.num_rounds`), `d` dimension, `n` queries of one call.

A retrieval opens a *session* (or plays the next round of one, `continue_from`). Each round shows a
slate made by `ear_jax.core.retrieval.slate_from_candidates`: without bandit statistics the
adapter's top-k (Section 3.6, `explore=False`), with the session's statistics one Explorer round
(Eq. (5)-(8), `explore=True`). The feedback on a round updates the statistics (Eq. (9)) and is kept
K wide (masked), so `k` may differ from round to round.

A query's rounds are ONE training query and ONE experience (Eq. (10)-(14), Alg. 1): a session is
*closed* and handed to the learner as one `TrainItem` when

* it has `T` rounds of feedback, or
* a round played with `explore=False` got its feedback (adapter-only retrieval: one round), or
* it is closed (`Memory.close`), flushed (`Memory.flush`, sessions without an open retrieval) or
  evicted (least recently used beyond `max_sessions`) with at least one round of feedback.

A session without feedback is dropped when closed or evicted. No session is trained one round at a
time, and a closed session cannot be continued. A session that leaves (`evict`, or `drop`: a delete
or update of one of its candidates, `ear_jax.agent.memory.forget`) is remembered with the reason
(the last `MAX_GONE`), so feedback, `continue_from` or `close` with one of its retrievals raises a
`SessionDroppedError` saying why ("retrieval 7 is no longer open: its session was dropped because
memory 'm3' was deleted"). Not thread-safe on its own: `Memory` holds its lock.
"""
from __future__ import annotations

import collections
import collections.abc
import dataclasses
import secrets
from typing import NamedTuple, Optional

import numpy as np

from ear_jax.agent.memory.bank import InputTypeError
from ear_jax.agent.memory.episode import update_bandits
from ear_jax.core.config import EARConfig

MAX_GONE = 4096  # sessions that left remembered with the reason (oldest forgotten first)
DELETED_REASON = "a memory among its candidates was deleted or updated (Memory.delete / update)"


class SessionDroppedError(ValueError):
  """A retrieval whose session is gone: evicted, or dropped because a delete or an update removed
  one of its candidates. Its message says which (a `ValueError`, as every input error)."""


_ARRAY_FIELDS = ("query_emb", "cand_idx", "cand_emb", "cand_mask", "mean", "counts", "slates",
                 "slate_mask", "labels")


@dataclasses.dataclass(frozen=True)
class Retrieval:
  """What `Memory.retrieve` returns: `k` memories, best first (adapter-only) or in slate order.

  Attributes:
    retrieval_id: id of this retrieval within its memory (`feedback` also takes the bare int).
    session_id: the query session (all rounds of one query share it).
    round: 1-based Explorer round of the session this slate belongs to.
    query: the query text ('' when only an embedding was given).
    ids, texts, stores: `[k]` memory ids, texts and store names ('dialogue' | 'observation').
    scores: `[k]` adapted relevance logits `z` (Eq. (4)); the frozen cosine while the adapter is
      the identity.
    explore: True for an Explorer round (Eq. (8)), False for adapter-only top-k.
    memory_token: the identity of the `Memory` that returned it (random per instance).
    generation: that memory's generation when it returned it (`Memory.restore` bumps it).
  """
  retrieval_id: int
  session_id: int
  round: int
  query: str
  ids: tuple[str, ...]
  texts: tuple[str, ...]
  stores: tuple[str, ...]
  scores: tuple[float, ...]
  explore: bool
  memory_token: str = ""
  generation: int = 0

  def __len__(self):
    return len(self.ids)


def citation_labels(shown: list[str], cited_ids, rid: int) -> np.ndarray:
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
    raise ValueError(f"cited ids {unknown[:5]} were not in the slate of retrieval {rid} (its ids: "
                     f"{shown})")
  cited = set(cited_ids)
  return np.asarray([1.0 if i in cited else -1.0 for i in shown], np.float32)


class TrainItem(NamedTuple):
  """One closed session: one training query of `learner.train_batch_on_feedback` (unbatched)."""
  query: np.ndarray  # [d] float32 pre-adapter query
  candidates: np.ndarray  # [K, d] float32 pre-adapter candidates (0 where masked)
  mask: np.ndarray  # [K] bool valid candidates
  slates: np.ndarray  # [T, K] int32 candidate positions of each round (-1 = empty)
  slate_mask: np.ndarray  # [T, K] bool (rows of rounds without feedback are all False)
  labels: np.ndarray  # [T, K] float32 labels in {-1, +1}
  rows: np.ndarray  # [K] int32 bank rows of the candidates (-1 = padding): checkpoints save these
  #   instead of the candidates' embeddings, which the bank already holds


@dataclasses.dataclass
class Session:
  """One query's state (host numpy arrays)."""
  query: str
  query_emb: np.ndarray  # [d] float32
  cand_idx: np.ndarray  # [K] int32 bank rows, -1 = padding
  cand_emb: np.ndarray  # [K, d + F] float32 (embedding | first-stage features, F = 0 without)
  cand_mask: np.ndarray  # [K] bool
  mean: np.ndarray  # [K] float32 bandit mean mu_i, Eq. (9)
  counts: np.ndarray  # [K] float32 bandit counts N_i
  slates: np.ndarray  # [T, K] int32 candidate positions of each round's slate, -1 = empty
  slate_mask: np.ndarray  # [T, K] bool
  labels: np.ndarray  # [T, K] float32
  rounds: int = 0  # rounds with feedback
  closed: bool = False  # handed to the learner (or dropped): no more rounds
  open_id: int = -1  # retrieval awaiting feedback, -1 = none
  open_slate: Optional[np.ndarray] = None  # [k] int32 candidate positions of the open retrieval
  open_explore: bool = False
  consumed: list = dataclasses.field(default_factory=list)  # retrieval ids answered or discarded
  last_used: int = 0
  scope: tuple = ()  # the scope names its candidates came from (empty: every scope)

  def train_item(self) -> TrainItem:
    return TrainItem(self.query_emb.copy(), self.cand_emb.copy(), self.cand_mask.copy(),
                     self.slates.copy(), self.slate_mask.copy(), self.labels.copy(),
                     self.cand_idx.copy())


class Sessions:
  """The query sessions of one memory, least recently used first, and the open retrievals.

  Every `Retrieval` carries the memory's identity (`token`, random per `Memory` instance) and
  `generation` (bumped by `Memory.restore`); `resolve_open` / `continuable_session` refuse another
  memory's or a stale retrieval with ValueError, changing nothing.

  Args:
    config: static config (`K`, `T`).
    max_sessions: sessions kept; beyond it the least recently used are evicted (closed ones first).
    token: the memory's identity (default: a fresh random token).
    generation: the memory's generation.
  """

  def __init__(self, config: EARConfig, max_sessions: int, token: Optional[str] = None,
               generation: int = 0):
    self.config = config
    self.max_sessions = int(max_sessions)
    self.token = token or secrets.token_hex(8)
    self.generation = int(generation)
    self.by_id: "collections.OrderedDict[int, Session]" = collections.OrderedDict()
    self.open: dict[int, int] = {}  # open retrieval id -> session id
    self.next_retrieval = 0
    self.next_session = 0
    self.clock = 0
    # session id -> (why it left, its open retrieval id or -1), the last MAX_GONE
    self.gone: "collections.OrderedDict[int, tuple[str, int]]" = collections.OrderedDict()
    self.gone_floor = -1  # sessions up to this id that left may have been forgotten from `gone`

  # ----------------------------------------------------------------------------------------------
  # lookups (raise ValueError, change nothing)

  def check_identity(self, r: Retrieval) -> None:
    """ValueError for another memory's retrieval or one from an earlier generation."""
    if r.memory_token != self.token:
      raise ValueError(f"retrieval {r.retrieval_id} belongs to another Memory (token "
                       f"{r.memory_token[:8] or 'none'}, this memory is {self.token[:8]})")
    if r.generation != self.generation:
      raise ValueError(f"retrieval {r.retrieval_id} is stale: it was returned at generation "
                       f"{r.generation}, and this memory was restored since (generation "
                       f"{self.generation})")

  def resolve_open(self, retrieval) -> int:
    """The session of an open retrieval (a `Retrieval` of this memory, or a bare retrieval id)."""
    if isinstance(retrieval, Retrieval):
      self.check_identity(retrieval)
      sid = self.open_session(retrieval.retrieval_id, retrieval.session_id)
      if sid != retrieval.session_id:
        raise ValueError(f"retrieval {retrieval.retrieval_id} does not match its session")
      return sid
    if isinstance(retrieval, (int, np.integer)) and not isinstance(retrieval, bool):
      return self.open_session(int(retrieval))
    raise InputTypeError(f"expected a Retrieval (or its retrieval_id), got "
                         f"{type(retrieval).__name__}")

  def gone_reason(self, sid: int) -> Optional[str]:
    """Why session `sid` left (None: it is here, or it is unknown): recorded by `evict` / `drop`;
    one that left unrecorded was dropped by `forget.forget_rows` (a delete or an update)."""
    if sid in self.gone:
      return self.gone[sid][0]
    if self.gone_floor < sid < self.next_session and sid not in self.by_id:
      return DELETED_REASON
    return None

  def dropped_error(self, rid: int, sid: int, what: str = "") -> SessionDroppedError:
    """The `SessionDroppedError` of retrieval `rid` of session `sid`, which left (`gone_reason`)."""
    why = self.gone_reason(sid) or "it was evicted or dropped by a delete"
    return SessionDroppedError(f"{what}retrieval {rid} is no longer open: its session was "
                               f"dropped because {why}; retrieve again")

  def open_session(self, rid: int, session_hint: Optional[int] = None) -> int:
    """The session of open retrieval `rid`."""
    sid = self.open.get(rid)
    if sid is not None:
      return sid
    s = self.by_id.get(session_hint) if session_hint is not None else None
    if s is not None and rid in s.consumed:
      raise ValueError(f"retrieval {rid} was already consumed: its feedback was given or it was "
                       "discarded (each retrieval takes feedback once; retrieve again to continue)")
    if session_hint is not None and s is None and self.gone_reason(session_hint) is not None:
      raise self.dropped_error(rid, session_hint)
    if session_hint is None:  # a bare retrieval id: the session it was open in, if one left
      for gone_sid, (_, open_rid) in self.gone.items():
        if open_rid == rid:
          raise self.dropped_error(rid, gone_sid)
    if 0 <= rid < self.next_retrieval:
      raise ValueError(f"retrieval {rid} is no longer open: it was consumed, or its session was "
                       f"closed, flushed or evicted (max_sessions={self.max_sessions})")
    raise ValueError(f"unknown retrieval {rid}: this memory never returned it")

  def continuable_session(self, r: Retrieval, k: int) -> int:
    """The session of finished retrieval `r` if it may play another round of `k` memories."""
    if not isinstance(r, Retrieval):
        raise InputTypeError(f"continue_from takes Retrieval objects, got {type(r).__name__}")
    self.check_identity(r)
    rid, sid = r.retrieval_id, r.session_id
    if rid in self.open:
      raise ValueError(f"retrieval {rid} has no feedback yet: give its feedback (or discard it) "
                       "before continuing its session")
    s = self.by_id.get(sid)
    if s is None and self.gone_reason(sid) is not None:
      raise self.dropped_error(rid, sid, "cannot continue: ")
    if s is None or rid not in s.consumed:
      raise ValueError(f"cannot continue retrieval {rid}: unknown or evicted session")
    if s.rounds >= self.config.num_rounds:
      raise ValueError(f"the session of retrieval {rid} has played all T={self.config.num_rounds} "
                       "Explorer rounds (Alg. 2); start a new retrieval")
    if s.closed:
      raise ValueError(f"the session of retrieval {rid} is closed (an adapter-only round, close, "
                       "flush or eviction) and went to the learner; start a new retrieval")
    if s.open_id >= 0:
      raise ValueError(f"the session of retrieval {rid} already has an open retrieval {s.open_id}")
    if k > int(s.cand_mask.sum()):
      raise ValueError(f"k={k} is larger than the {int(s.cand_mask.sum())} candidates of the "
                       "session being continued")
    return sid

  # ----------------------------------------------------------------------------------------------
  # state changes

  def new(self, query: str, query_emb, cand_idx, cand_emb, cand_mask, scope=()) -> int:
    """Opens a session with zero statistics (Alg. 2 line 3); returns its id. `scope`: the scope
    names its candidates came from (empty: every scope), kept for callers that key questions by
    scope (`ear_jax.agent.mcp_server`)."""
    T, K = self.config.num_rounds, self.config.num_candidates
    sid = self.next_session
    self.next_session += 1
    self.by_id[sid] = Session(
        query=query, query_emb=np.array(query_emb, np.float32),
        cand_idx=np.array(cand_idx, np.int32), cand_emb=np.array(cand_emb, np.float32),
        cand_mask=np.array(cand_mask, bool), mean=np.zeros((K,), np.float32),
        counts=np.zeros((K,), np.float32), slates=np.full((T, K), -1, np.int32),
        slate_mask=np.zeros((T, K), bool), labels=np.full((T, K), -1.0, np.float32),
        scope=tuple(scope or ()))
    return sid

  def open_round(self, sid: int, positions: np.ndarray, explore: bool) -> int:
    """Records the slate shown by a new retrieval of session `sid`; returns the retrieval id."""
    s = self.by_id[sid]
    rid = self.next_retrieval
    self.next_retrieval += 1
    s.open_id, s.open_slate, s.open_explore = rid, np.asarray(positions, np.int32), bool(explore)
    self.open[rid] = sid
    self._touch(sid)
    return rid

  def retrieval(self, sid: int, rid: int, z: np.ndarray, describe) -> Retrieval:
    """The `Retrieval` of the open round `rid` of `sid` (`describe(rows) -> (ids, texts, stores)`,
    `z`: `[K]` the round's adapted logits)."""
    s = self.by_id[sid]
    ids, texts, stores = describe(s.cand_idx[s.open_slate])
    return Retrieval(retrieval_id=rid, session_id=sid, round=s.rounds + 1, query=s.query, ids=ids,
                     texts=texts, stores=stores,
                     scores=tuple(float(x) for x in z[s.open_slate]), explore=s.open_explore,
                     memory_token=self.token, generation=self.generation)

  def _touch(self, sid: int) -> None:
    self.clock += 1
    self.by_id[sid].last_used = self.clock
    self.by_id.move_to_end(sid)

  def _finish_open(self, s: Session) -> None:
    self.open.pop(s.open_id, None)
    s.consumed.append(s.open_id)
    s.open_id, s.open_slate = -1, None

  def record(self, sid: int, labels: np.ndarray) -> Optional[TrainItem]:
    """Feedback `[k]` on the open round of `sid` (Eq. (9)); the `TrainItem` if this closes it."""
    s = self.by_id[sid]
    K = self.config.num_candidates
    k = len(s.open_slate)
    slate = np.full((K,), -1, np.int32)
    mask = np.zeros((K,), bool)
    lab = np.full((K,), -1.0, np.float32)
    slate[:k], mask[:k], lab[:k] = s.open_slate, True, labels
    mean, counts = update_bandits(s.mean[None], s.counts[None], slate[None], mask[None], lab[None])
    s.mean, s.counts = mean[0], counts[0]
    s.slates[s.rounds], s.slate_mask[s.rounds], s.labels[s.rounds] = slate, mask, lab
    s.rounds += 1
    explore = s.open_explore
    self._finish_open(s)
    self._touch(sid)
    if not explore or s.rounds >= self.config.num_rounds:
      return self._close(s)
    return None

  def discard(self, sid: int) -> None:
    """Closes the open retrieval of `sid` without feedback; the session may be continued."""
    self._finish_open(self.by_id[sid])
    self._touch(sid)

  def _close(self, s: Session) -> Optional[TrainItem]:
    if s.open_id >= 0:
      self._finish_open(s)
    s.closed = True
    return s.train_item() if s.rounds else None

  def close(self, sid: int) -> Optional[TrainItem]:
    """Closes session `sid` (an open retrieval is discarded); its item if it has feedback."""
    s = self.by_id[sid]
    return None if s.closed else self._close(s)

  def flush(self) -> list[TrainItem]:
    """Closes every session with feedback and no open retrieval; their items, oldest first."""
    return [self._close(s) for s in self.by_id.values()
            if not s.closed and s.rounds and s.open_id < 0]

  def evict(self) -> list[TrainItem]:
    """Drops sessions beyond `max_sessions` (least recently used, closed ones first)."""
    items = []
    excess = len(self.by_id) - self.max_sessions
    if excess <= 0:
      return items
    victims = []  # closed ones first, then open ones, each least recently used first; the scan
    for want_closed in (True, False):  # stops at the first `excess` (O(1) when the LRU is closed)
      for sid, s in self.by_id.items():
        if len(victims) == excess:
          break
        if s.closed == want_closed:
          victims.append(sid)
    for sid in victims:
      s = self.by_id.pop(sid)
      self._remember(sid, s, f"it was evicted (the least recently used beyond "
                             f"max_sessions={self.max_sessions})")
      if not s.closed:
        item = self._close(s)
        if item is not None:
          items.append(item)
      self.open.pop(s.open_id, None)
    return items

  def drop(self, sid: int, reason: str) -> None:
    """Removes session `sid` untrained (and its open retrieval), remembering `reason` (e.g.
    "memory 'm3' was deleted") for the errors of its retrievals."""
    s = self.by_id.pop(sid)
    self._remember(sid, s, reason)
    self.open.pop(s.open_id, None)

  def _remember(self, sid: int, s: Session, reason: str) -> None:
    self.gone[sid] = (reason, s.open_id)
    while len(self.gone) > MAX_GONE:
      self.gone_floor = max(self.gone_floor, self.gone.popitem(last=False)[0])

  # ----------------------------------------------------------------------------------------------
  # snapshot / restore

  def snapshot(self):
    """`(arrays, meta)`: host copies of every session (arrays omitted when there is none)."""
    ss = list(self.by_id.items())
    arrays = {}
    if ss:  # not the candidates' embeddings: `restore` gathers them from the bank by `cand_idx`
      arrays = {f: np.stack([getattr(s, f) for _, s in ss]) for f in _ARRAY_FIELDS
                if f != "cand_emb"}
      if self.config.side_features:  # but their first-stage features (per query, [n, K, F])
        arrays["cand_features"] = np.stack([s.cand_emb[:, self.config.dim:] for _, s in ss])
    meta = {
        "counters": {"next_retrieval": self.next_retrieval, "next_session": self.next_session,
                     "clock": self.clock},
        "sessions": [{"id": sid, "query": s.query, "rounds": s.rounds, "closed": s.closed,
                      "open_id": s.open_id,
                      "open_slate": None if s.open_slate is None else s.open_slate.tolist(),
                      "open_explore": s.open_explore, "consumed": list(s.consumed),
                      "last_used": s.last_used, "scope": list(s.scope)} for sid, s in ss],
    }
    return arrays, meta

  @classmethod
  def restore(cls, config: EARConfig, max_sessions: int, arrays, meta, where: str, token: str,
              generation: int, gather) -> "Sessions":
    """The sessions of `snapshot` under a memory's identity; ValueError naming `where` on a shape
    mismatch. `gather(rows [n, K], mask [n, K], where)` gives the candidates' embeddings from the
    restored bank (checkpoints written before this hold them inline)."""
    out = cls(config, max_sessions, token, generation)
    arrays = dict(arrays)
    if meta["sessions"] and "cand_emb" not in arrays:
      for f in ("cand_idx", "cand_mask"):
        if f not in arrays:
          raise ValueError(f"{where}: the session array {f!r} is missing")
      arrays["cand_emb"] = np.asarray(gather(arrays["cand_idx"], arrays["cand_mask"],
                                             f"the sessions of {where}"))
      if config.side_features:
        feats = np.asarray(arrays.get("cand_features", np.zeros((0,))), np.float32)
        want = arrays["cand_emb"].shape[:2] + (config.side_features,)
        if feats.shape != want:
          raise ValueError(f"{where}: the session array 'cand_features' has shape {feats.shape}, "
                           f"expected {want}")
        arrays["cand_emb"] = np.concatenate([arrays["cand_emb"], feats], -1)
    arrays.pop("cand_features", None)
    T, K, d = config.num_rounds, config.num_candidates, config.dim
    shapes = {"query_emb": (d,), "cand_idx": (K,), "cand_emb": (K, d + config.side_features),
              "cand_mask": (K,),
              "mean": (K,), "counts": (K,), "slates": (T, K), "slate_mask": (T, K),
              "labels": (T, K)}
    sessions = meta["sessions"]
    for f in (_ARRAY_FIELDS if sessions else ()):
      got = tuple(np.shape(arrays[f]))
      if got != (len(sessions),) + shapes[f]:
        raise ValueError(f"{where}: session array {f!r} has shape {got}, expected "
                         f"{(len(sessions),) + shapes[f]}")
    dtypes = {"cand_idx": np.int32, "cand_mask": bool, "slates": np.int32, "slate_mask": bool}
    for j, sm in enumerate(sessions):
      s = Session(query=sm["query"],
                  **{f: np.array(arrays[f][j], dtypes.get(f, np.float32)) for f in _ARRAY_FIELDS},
                  rounds=int(sm["rounds"]), closed=bool(sm["closed"]), open_id=int(sm["open_id"]),
                  open_slate=None if sm["open_slate"] is None
                  else np.asarray(sm["open_slate"], np.int32),
                  open_explore=bool(sm["open_explore"]), consumed=list(sm["consumed"]),
                  last_used=int(sm["last_used"]),
                  scope=tuple(str(x) for x in sm.get("scope", ())))  # (older: every scope)
      out.by_id[int(sm["id"])] = s
      if s.open_id >= 0:
        out.open[s.open_id] = int(sm["id"])
    c = meta["counters"]
    out.next_retrieval, out.next_session, out.clock = (int(c["next_retrieval"]),
                                                       int(c["next_session"]), int(c["clock"]))
    return out
