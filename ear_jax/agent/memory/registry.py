"""The open sessions of one `Memory` by id, and the critic's keys.

Symbols: `K` candidates, `T` Explorer rounds, `d` dimension.

`Registry` keeps at most `max_sessions` sessions (the least recently used evicted, closed first);
a session gone is remembered with the reason its handle's `SessionDroppedError` gives. `snapshot`
saves learning sessions only, candidates as bank rows. Not thread-safe: `Learning` holds the lock.
"""
from __future__ import annotations

import collections
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory import sessions as sessions_lib
from ear_jax.agent.memory.sessions import QuerySession, SessionDroppedError, TrainItem
from ear_jax.core.config import EARConfig

MAX_GONE = 4096  # sessions that left remembered with the reason (oldest forgotten first)

_ARRAYS = ("query_emb", "cand_idx", "cand_mask", "mean", "counts", "slates", "slate_mask",
           "labels")
_FIELDS = ("query", "scope", "rounds", "closed", "open_slate", "open_explore", "last_used",
           "held")
_FIELD_DEFAULTS = {"held": 0}  # (learner items saved before it existed)


class Registry:
  """The sessions of one memory, least recently used first (at most `max_sessions`)."""

  def __init__(self, config: EARConfig, max_sessions: int):
    self.config, self.max_sessions = config, int(max_sessions)
    self.by_id: "collections.OrderedDict[int, QuerySession]" = collections.OrderedDict()
    self.next_session, self.clock = 0, 0
    self.gone: "collections.OrderedDict[int, str]" = collections.OrderedDict()  # sid -> why
    self.closed_memory = False  # set by `Memory.close`: every session call is refused

  def get(self, sid: int, open_round: Optional[bool] = None) -> QuerySession:
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
                       f"rounds){' and went to the learner' if s.trains else ''}; open a new "
                       "session")
    if open_round and s.open_slate is None:
      raise ValueError(f"session {sid} has no open round to label: call round() first (each "
                       "round takes feedback once)")
    if open_round is False and s.rounds >= self.config.num_rounds:
      raise ValueError(f"session {sid} has played all T={self.config.num_rounds} Explorer "
                       "rounds (Alg. 2); open a new session")
    return s

  def new(self, kind: type, query: str, query_emb, cand_idx, cand_emb, cand_mask, scope=(),
          **fields) -> QuerySession:
    """Opens a session of `kind` with zero statistics (Alg. 2 line 3)."""
    T, K = self.config.num_rounds, self.config.num_candidates
    sid = self.next_session
    self.next_session += 1
    s = self.by_id[sid] = kind(
        sid=sid, query=query, query_emb=np.array(query_emb, np.float32),
        cand_idx=np.array(cand_idx, np.int32), cand_emb=np.array(cand_emb, np.float32),
        cand_mask=np.array(cand_mask, bool), mean=np.zeros((K,), np.float32),
        counts=np.zeros((K,), np.float32), slates=np.full((T, K), -1, np.int32),
        slate_mask=np.zeros((T, K), bool), labels=np.full((T, K), -1.0, np.float32),
        scope=tuple(scope or ()), **fields)
    self.touch(sid)
    return s

  def touch(self, sid: int) -> None:
    self.clock += 1
    self.by_id[sid].last_used = self.clock
    self.by_id.move_to_end(sid)

  def evict(self) -> list[TrainItem]:
    """Drops sessions beyond `max_sessions`; returns the items of those with feedback."""
    live = list(self.by_id)
    excess = len(live) - self.max_sessions
    if excess <= 0:
      return []
    victims = sorted(live, key=lambda sid: not self.by_id[sid].closed)[:excess]  # closed first
    items = [self.by_id[sid].close() for sid in victims]
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

  def snapshot(self):
    """`(arrays, meta)`: host copies of the learning sessions (no arrays when none)."""
    ss = [(sid, s) for sid, s in self.by_id.items() if s.trains]
    for _, s in ss:
      s.settle()
    arrays = {}
    if ss:
      arrays = {f: np.stack([getattr(s, f) for _, s in ss]) for f in _ARRAYS}
      arrays["features"] = np.stack([s.cand_emb[:, self.config.dim:] for _, s in ss])
    meta = {"next_session": self.next_session, "clock": self.clock,
            "sessions": [{"id": sid, **{f: _jsonable(getattr(s, f)) for f in _FIELDS},
                          "paged": bool(s.held), **({"query": ""} if s.closed else {})}
                         for sid, s in ss]}
    return arrays, meta

  @classmethod
  def restore(cls, config: EARConfig, max_sessions: int, arrays, meta, gather: Callable,
              live: Callable) -> tuple["Registry", int]:
    """`(registry, dropped)` of `snapshot`; a session with a deleted candidate is dropped."""
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
      fields = {f: sm.get(f, _FIELD_DEFAULTS.get(f)) if f in _FIELD_DEFAULTS else sm[f]
                for f in _FIELDS}
      kind = sessions_lib.HeldOutSession if fields["held"] else sessions_lib.TrainingSession
      s = kind(sid=int(sm["id"]), cand_emb=emb[j], **{f: np.array(arrays[f][j]) for f in _ARRAYS},
               **fields)
      s.scope = tuple(s.scope)
      s.open_slate = None if s.open_slate is None else np.asarray(s.open_slate, np.int32)
      s.shown = s.rounds + (s.open_slate is not None)
      out.by_id[int(sm["id"])] = s
    return out, int((~keep).sum())


def _jsonable(x):
  if isinstance(x, np.ndarray):
    return x.tolist()
  return list(x) if isinstance(x, tuple) else x


def _fold_twice(key, sid, t):
  return jax.random.fold_in(jax.random.fold_in(key, sid), t)


_critic_key = jax.jit(_fold_twice)


@functools.partial(jax.jit, static_argnames=("size", "num_rounds"))
def _critic_key_block(key, start, *, size, num_rounds):
  rounds = jnp.arange(num_rounds)
  return jax.vmap(lambda sid: jax.vmap(lambda t: _fold_twice(key, sid, t))(rounds))(
      start + jnp.arange(size))


class CriticKeys:
  """The critic key `fold_in(fold_in(key, sid), t)` of round `t` of session `sid`, as a host
  `[2]` uint32 array, computed `BLOCK` sessions x `num_rounds` at a time."""
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
