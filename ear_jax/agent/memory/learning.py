"""`Learning`: a `Memory`'s sessions (`registry.Registry`) and the learner they feed
(`driver.Driver`), behind the memory's lock.

Symbols: `K` candidates, `k` memories shown, `T` Explorer rounds, `b` batch size.

`recall.Session` calls its methods, each one locked step (encoding an answer and a host critic run
outside the lock); every `b` closed sessions make ONE learner step. `forget` is a delete's side.
"""
from __future__ import annotations

import collections
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory import episode
from ear_jax.agent.memory import sessions as sessions_lib
from ear_jax.agent.memory.checks import check_k
from ear_jax.agent.memory.driver import Driver, seed_keys
from ear_jax.agent.memory.registry import CriticKeys, Registry
from ear_jax.agent.memory.sessions import Slate, citation_labels
from ear_jax.core import critic as critic_lib
from ear_jax.core import guard as guard_lib

_served = jax.jit(guard_lib.served_params, static_argnums=2)


@functools.partial(jax.jit, static_argnums=2)
def _serving(params, guard, config):
  """`(serves the adapter [] bool, evidence [] int32)`: the guard's decision and its evidence."""
  serve, _, n = guard_lib.holdout_decision(params, guard, config)
  return serve, n.astype(jnp.int32)
_copy = jax.jit(lambda tree: jax.tree_util.tree_map(jnp.copy, tree))  # (one call, own buffers)


class Learning:
  """The sessions and the learner of one memory: its settings, `rows.Rows`, lock and counters,
  `embed_answer(texts) -> [n, d]`, a learner state (None: fresh from the seed), `warm_learner`."""

  def __init__(self, config, hparams, seed: int, max_sessions: int, rows, lock,
               stats: collections.Counter, embed_answer: Callable, learner=None,
               warm: bool = False):
    self.config, self.hparams, self.seed, self.max_sessions = config, hparams, seed, max_sessions
    self.rows, self._lock, self.stats, self._embed_answer = rows, lock, stats, embed_answer
    self._critic_keys = CriticKeys(seed_keys(seed)[2], config.num_rounds)
    self.registry = Registry(config, max_sessions)
    self.driver = Driver(config, hparams, seed, learner)
    self.saved_questions = set()  # the sessions whose question the learner item on disk holds
    self._served_cache = (None, None)  # (the guard state, its served parameters)
    self._warm = warm

  def warm(self) -> None:
    """With `warm`: the learner step compiled in a background thread (`Driver.warm`)."""
    if not self._warm:
      return
    K, params = self.config.num_candidates, self.driver.state.params
    zeros = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)

    def also():
      jax.block_until_ready(_copy(jax.tree_util.tree_map(
          lambda s: jnp.zeros(s.shape, s.dtype), zeros)))
      episode.update_bandits(np.zeros((1, K), np.float32), np.zeros((1, K), np.float32),
                             *(x[None] for x in episode.no_feedback(K)))

    self.driver.warm(also)

  # ----------------------------------------------------------------------------------------------
  # what the learner serves

  def served_params(self):
    """The parameters test-time slates rank by (`core.guard.served_params`). Call under the lock."""
    state = self.driver.state
    if state.guard is None:
      return state.params
    if self._served_cache[0] is not state.guard:  # (new after every learner step and delete)
      self._served_cache = (state.guard, _served(state.params, state.guard, self.config))
    return self._served_cache[1]

  def serving(self) -> tuple[bool, int]:
    """`(serves the adapter, guard evidence)` (0 evidence without a guard). Call under the lock."""
    state = self.driver.state
    if state.guard is None:
      return True, 0
    serve, n = _serving(state.params, state.guard, self.config)
    return bool(serve), int(n)

  def train(self) -> int:
    """`Driver.flush` under the lock; returns the learner steps taken."""
    with self._lock:
      if not self.driver.ready:
        return 0
      self._detach_params()
      steps = self.driver.flush()
      self.stats["learner_steps"] += steps
      return steps

  def view(self) -> sessions_lib.View:
    state = self.driver.state
    return sessions_lib.View(state.params, self.served_params(), self.hparams, self.config)

  # ----------------------------------------------------------------------------------------------
  # sessions

  def open(self, text: str, q_emb, rows, cands, mask, names, frozen: bool, paged: bool,
           ranking) -> tuple[int, bool]:
    """Registers a session of the first stage's candidates: `(id, held out)`. Under the lock."""
    held = not frozen and self.driver.next_held(text, names)  # (`guard_holdout`)
    if frozen:
      kind = sessions_lib.PagingSession if paged else sessions_lib.FrozenExplorerSession
      s = self.registry.new(kind, text, q_emb, rows, cands, mask, names,
                            params=None if paged else self.served_params(), ranking=ranking)
    else:
      kind = sessions_lib.HeldOutSession if held else sessions_lib.TrainingSession
      s = self.registry.new(kind, text, q_emb, rows, cands, mask, names, held=int(held))
    self.stats["sessions_opened"] += 1
    self._learn(self.registry.evict())
    return s.sid, bool(held)

  def round(self, sid: int, k, explore: bool) -> Slate:
    k = check_k(k, self.config.num_candidates)
    explore = bool(explore)
    with self._lock:
      s = self.registry.get(sid, open_round=False)
      shown = s.play(k, explore, self.view())
      if shown is None:  # (nothing left to show: no round opened)
        return Slate((), (), (), (), s.rounds + 1, True, sid, s.query)
      pos, scores, explore = shown
      self.registry.touch(sid)
      self.stats["rounds"] += 1
      return Slate.of(self._records(s, pos), scores, s.rounds + 1, explore, sid, s.query)

  def feedback(self, sid: int, cited_ids, answer) -> bool:
    what = lambda s: f"session {sid} round {s.rounds + 1}"
    with self._lock:
      s = self.registry.get(sid, open_round=True)
      labels = citation_labels(self._shown(s), cited_ids, what(s))
      if answer is None:
        return self._apply(s, labels) > 0
      answer = episode.check_answer(answer)
      if not s.query:
        raise ValueError(f"session {sid} has no question text: feedback from an answer compares "
                         "it with the question (open the session with the question's text)")
      slate = s.open_slate.copy()
      texts = [r["text"] for r in self._records(s, slate)]
      question, memories = s.query, s.cand_emb[slate, :self.config.dim].copy()
    used = episode.answer_labels(question, answer, texts, memories, self._embed_answer)
    with self._lock:  # (still open: another call may have labelled it, a delete dropped it)
      s = self.registry.get(sid, open_round=True)
      if not np.array_equal(s.open_slate, slate):
        raise ValueError(f"session {sid} showed another round meanwhile; nothing was changed")
      cited = citation_labels(self._shown(s), cited_ids, what(s))
      self.stats["answer_feedback"] += 1
      return self._apply(s, np.maximum(cited, used)) > 0

  def critique(self, sid: int, critic) -> Optional[np.ndarray]:
    """The open round of `sid` shown to a host critic outside the lock (key: `registry.CriticKeys`);
    returns its labels, applied (None: the round discarded)."""
    if isinstance(critic, episode.AnswerFeedback):
      critic = critic.bound(self._embed_answer)
    with self._lock:
      s = self.registry.get(sid, open_round=True)
      slate = s.open_slate[s.cand_mask[s.open_slate]]  # (frozen: less what was deleted since)
      if not len(slate):
        s.open_slate = None
        return None
      recs = self._records(s, slate)
      view = critic_lib.SlateView(
          query=s.query_emb, slate=slate, slate_mask=np.ones(len(slate), bool),
          memories=s.cand_emb[slate, :self.config.dim], gold=np.zeros(len(slate), bool),
          query_text=s.query, texts=[r["text"] for r in recs], ids=[r["id"] for r in recs])
      key = self._critic_keys(sid, s.shown - 1)
    labels = critic(key, view)
    if labels is not None:
      labels = episode.check_labels(labels, len(slate), "the critic")  # the round stays open
    with self._lock:
      self.stats["critic_calls"] += 1
      s = self.registry.get(sid, open_round=True)
      kept = labels
      if not s.trains:  # (a delete meanwhile masked some of its memories out: label the others)
        keep = s.cand_mask[slate]
        s.open_slate, kept = slate[keep], None if labels is None else labels[keep]
      elif not np.array_equal(s.open_slate, slate):
        raise ValueError(f"session {sid} showed another round while the critic ran")
      if labels is None:
        s.open_slate = None
        self.stats["critic_no_update"] += 1
      elif not len(kept):  # (every memory it showed was deleted: no update, the rounds go on)
        s.open_slate = None
      else:
        self._apply(s, kept)
    return labels

  def close(self, sid: int) -> bool:
    """Closes session `sid` (queued with feedback; a test-time one released)."""
    with self._lock:
      s = self.registry.get(sid)
      item = s.close()
      if not s.trains:
        self.registry.by_id.pop(sid)
      return self._learn([] if item is None else [item]) > 0

  def abandon(self, sid: int) -> None:
    """Drops session `sid` untrained (its recall failed)."""
    with self._lock:
      self.registry.by_id.pop(sid, None)

  def resume(self, sid: int) -> tuple[str, tuple, bool, bool]:
    """`(question, scope, learns, held out)` of the open session `sid` (ValueError: closed)."""
    with self._lock:
      s = self.registry.get(sid)
      if s.closed:
        raise ValueError(f"session {sid} is closed: open a new session")
      return s.query, s.scope, s.trains, bool(s.held)

  def info(self, sid: int) -> tuple[int, bool]:
    with self._lock:
      s = self.registry.get(sid)
      return s.rounds, s.closed

  def answer(self, sid: int, k) -> Slate:
    """`sessions.paging_answer` of session `sid`'s pages, less what was deleted since."""
    k = None if k is None else check_k(k, self.config.num_candidates)
    with self._lock:
      s = self.registry.get(sid)
      pages = s.pages()
      shown, labels = [], []
      for pos, lab in pages:
        keep = s.cand_mask[pos]  # (a delete masked its memory out)
        shown.append(Slate.of(self._records(s, pos[keep]), s.ranking[pos[keep]], s.rounds,
                              False, sid, s.query))
        labels.append(None if lab is None else lab[keep])
      if k is None:
        k = len(pages[0][0]) if pages else 0
      answer, _ = sessions_lib.paging_answer(shown, labels, k)
      recs = {i: dict(id=i, text=text, store=store)
              for p in shown for i, text, store in zip(p.ids, p.texts, p.stores)}
      return Slate.of([recs[i] for i, _ in answer], [sc for _, sc in answer], s.rounds, False,
                      sid, s.query)

  def final(self, sid: int, k: int) -> tuple[tuple, tuple]:
    """`(ids, scores)` of 'exploit': the top-k by bandit mean, ties by adapted relevance."""
    with self._lock:
      s = self.registry.get(sid)
      got = s.final(k, self.driver.state.params)
      if got is None:
        return (), ()
      pos, z = got
      return tuple(r["id"] for r in self._records(s, pos)), tuple(z.tolist())

  def records(self, ids, sid: Optional[int] = None) -> dict:
    """`{id: record}` of those of `ids` still held."""
    ids = list(dict.fromkeys(ids))
    with self._lock:
      s = None if sid is None else self.registry.by_id.get(sid)
      got = {}
      if s is not None:
        got = {rec["id"]: rec for row, ok in zip(s.cand_idx.tolist(), s.cand_mask.tolist())
               if ok and (rec := s.records.get(row)) is not None}
      rest = [i for i in ids if i not in got]
      if rest:
        got.update(self.rows.held_records(rest))
      return {i: got[i] for i in ids if i in got}

  def count(self, name: str) -> None:
    with self._lock:
      self.stats[name] += 1

  def open_sessions(self) -> int:
    """Learning sessions still open."""
    return sum(1 for s in self.registry.by_id.values() if not s.closed and s.trains)

  def pending(self) -> int:
    """Queued items plus open learning sessions with feedback."""
    return len(self.driver.ready) + sum(1 for s in self.registry.by_id.values()
                                        if not s.closed and s.trains and s.rounds)

  # ----------------------------------------------------------------------------------------------
  # forgetting (a delete's or an update's learning side; call under the lock)

  def forget(self, rows: np.ndarray, recs: list[dict], verb: str) -> bool:
    """Forgets bank `rows` in the sessions (`QuerySession.forget`) and the learner. True when the
    saved learner item holds the question of a dropped session: the caller must save again."""
    names = {int(r["row"]): r["id"] for r in recs}
    held = set(self.registry.by_id)
    for sid, s in list(self.registry.by_id.items()):
      hit = np.isin(s.cand_idx, rows) & s.cand_mask
      if hit.any() and s.forget(hit):
        memory_id = names[int(s.cand_idx[np.flatnonzero(hit)[0]])]
        self.registry.drop(sid, f"memory {memory_id!r} among its candidates was {verb} "
                                f"(Memory.{'update' if verb == 'updated' else 'delete'})")
        self.stats["sessions_dropped_by_delete"] += 1
    self.driver.forget(rows)
    return self.rows.root is not None and bool(
        (held - set(self.registry.by_id)) & self.saved_questions)

  # ----------------------------------------------------------------------------------------------
  # the learner item (`persistence`)

  def snapshot(self) -> tuple[dict, dict]:
    """`(arrays, meta)` of the driver and the learning sessions (call under the lock)."""
    self.driver.resolve_rows(self.rows.rows_of_embeddings)
    sessions = self.registry.snapshot()
    self.saved_questions = {s["id"] for s in sessions[1]["sessions"] if s["query"]}
    driver = self.driver.snapshot()
    arrays = {"driver": driver[0], **({"sessions": sessions[0]} if sessions[0] else {})}
    return arrays, {"sessions": sessions[1], "driver": driver[1]}

  def restore(self, arrays: dict, meta: dict, where: str) -> bool:
    """The driver and sessions of a learner item; True when the item must be rewritten."""
    driver, sessions = arrays.get("driver", {}), arrays.get("sessions", {})
    self.driver = Driver.restore(self.config, self.seed, driver, meta["driver"], where,
                                 self.rows.gather, self.rows.live)
    self.registry, dropped = Registry.restore(self.config, self.max_sessions, sessions,
                                              meta["sessions"], self.rows.gather, self.rows.live)
    self.saved_questions = {int(x["id"]) for x in meta["sessions"]["sessions"] if x.get("query")}
    if dropped:
      self.stats["sessions_dropped_by_delete"] += dropped
    return bool(self.saved_questions - set(self.registry.by_id))

  def _apply(self, s, labels: np.ndarray) -> int:
    item = s.record(labels, self.config.num_rounds)
    self.registry.touch(s.sid)
    self.stats["feedback"] += 1
    self.stats["cited"] += int((labels > 0).sum())
    return self._learn([] if item is None else [item])

  def _learn(self, items) -> int:
    if len(self.driver.ready) + len(items) >= self.config.batch_size:
      self._detach_params()
    steps = self.driver.push(items)
    self.stats["learner_steps"] += steps
    self.stats["queries_queued"] += len(items)
    return steps

  def _detach_params(self) -> None:
    """Sessions holding the live adapter parameters get a copy: the learner step donates them."""
    live, copy = self.driver.state.params, None
    for s in self.registry.by_id.values():
      if s.params is live:
        copy = _copy(live) if copy is None else copy
        s.params = copy

  def _shown(self, s) -> list[str]:
    return [r["id"] for r in self._records(s, s.open_slate)]

  def _records(self, s, positions) -> list[dict]:
    """The records of session `s`'s candidates at `positions` (all read at the first call)."""
    rows = [int(r) for r in s.cand_idx[positions]]
    if any(r not in s.records for r in rows):
      held = s.cand_idx[s.cand_mask & self.rows.live(s.cand_idx)]
      missing = list(dict.fromkeys([int(r) for r in held if int(r) not in s.records] + rows))
      s.records.update(zip(missing, self.rows.records(missing)))
    return [s.records[r] for r in rows]

