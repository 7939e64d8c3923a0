"""`Memory`: the stateful front of EAR for a live agent (its configuration: `config.MemoryConfig`).

Symbols: `n` memories, `d` dimension, `K` candidates, `k` memories shown (`k <= K`), `T` Explorer
rounds, `b` batch size.

Where a row lives: in the table (`table.Table`, SQLite: `<dir>/rows.sqlite`, or `:memory:` for a
memory that was never saved), and, derived from it at open, on the device (`bank.DeviceBank`:
`[C, d]` embeddings, masks, store and scope codes, and with features='context' each row's
session, speaker and turn), in the lexical index (`lexical_bank`) and an
optional ANN searcher (`bank.Searcher`, `<dir>/ann`). Where the learner lives: the `driver.Driver`
(adapter, optimiser, replay buffer, guard, queued items) and the `sessions.Sessions` registry,
saved together as ONE Orbax item (`persistence`, `<dir>/learner`) by `save()`.

One write's path (`add`): validate -> encode and tokenise (outside the lock) -> under the lock
ONE table transaction (durable on return for an opened memory) -> the device bank, the lexical
index and the searcher. One query's path (`session()`, `search`): validate -> encode -> under
the lock the first stage (one jitted device call: `bank.search` or `LexicalBank.search`, with
`search`'s slate) -> ids and texts from the table; each `Session.round()` is one jitted call
(`episode.session_round`: the last round's bandit update, then the slate; the adapter's output
for the candidates kept for the session's later rounds) and reads no table row its session has
read already.

One re-entrant lock guards every state change and read of the parts; encoding and critic calls run
outside it. With `MemoryConfig.batch_window_ms > 0` concurrent calls are micro-batched
(`ear_jax.agent.memory.batcher`): the encodings (of queries, added memories, answers) and first
stages (`search`, `session()`, `recall()`'s) arriving within one window share ONE encoder call and
ONE search (per slate size, each query in its own scopes); each still takes effect at one instant
between its call and its return (a search sees every add that returned before it was called).
Every public method validates its input
first and raises ValueError (TypeError for wrong types; `InputTypeError` is both) naming the
problem, with the state unchanged.
"""
from __future__ import annotations

import collections
import dataclasses
import pathlib
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import batcher as batcher_lib
from ear_jax.agent.memory import checks as checks_lib
from ear_jax.agent.memory import episode
from ear_jax.agent.memory import forget
from ear_jax.agent.memory import lexical_bank
from ear_jax.agent.memory import persistence
from ear_jax.agent.memory import recall as recall_lib
from ear_jax.agent.memory import scopes as scopes_lib
from ear_jax.agent.memory import table as table_lib
from ear_jax.agent.memory.checks import DEFAULT_SCOPE, InputTypeError
from ear_jax.agent.memory import config as config_lib
from ear_jax.agent.memory.config import MemoryConfig, check_int
from ear_jax.agent.memory.driver import Driver, seed_keys
from ear_jax.agent.memory.encoder_slot import EncoderSlot
from ear_jax.agent.memory.episode import AnswerFeedback, run_critic_episode
from ear_jax.agent.memory.recall import Recall
from ear_jax.agent.memory.sessions import (CriticKeys, Ops, Session, SessionDroppedError,
                                           Sessions, Slate,
                                           citation_labels)
from ear_jax.core import adapter as adapter_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import guard as guard_lib
from ear_jax.core import learner as learner_lib
from ear_jax.data import first_stage
from ear_jax.io import checkpoints

__all__ = ["DEFAULT_SCOPE", "AnswerFeedback", "Memory", "MemoryConfig", "Recall", "Session",
           "SessionDroppedError", "Slate", "llm_feedback", "run_critic_episode"]

_UNSET = object()


def _settings(first, encoder, settings: dict) -> tuple[Optional[MemoryConfig], Any, dict]:
  """`(MemoryConfig or None, encoder object or spec or _UNSET, settings)` of the arguments of
  `Memory(...)` / `Memory.open(...)`: a first argument that is not a MemoryConfig is the
  encoder."""
  fields = {f.name for f in dataclasses.fields(MemoryConfig)}
  unknown = sorted(set(settings) - fields)
  if unknown:
    raise InputTypeError(f"unknown Memory setting(s) {unknown}; the settings are MemoryConfig's "
                         f"fields {sorted(fields)}")
  if "encoder" in settings:
    raise InputTypeError("pass the encoder as Memory(encoder=...) (or MemoryConfig.encoder)")
  if isinstance(first, MemoryConfig) or first is _UNSET:
    return (None if first is _UNSET else first), encoder, settings
  if encoder is not _UNSET:
    raise ValueError("pass the encoder once: as the first argument or as encoder=")
  return None, first, settings


def _new_config(cfg: Optional[MemoryConfig], enc, settings: dict):
  """`(MemoryConfig, EncoderSlot)` of a new memory (`_settings`' output): the encoder's spec and,
  for an `Encoder` object, its dimension filled in."""
  cfg = cfg or MemoryConfig()
  slot = EncoderSlot(cfg.encoder if enc is _UNSET else enc)
  if slot.encoder is not None and cfg.dim is None and cfg.config is None and not (
      {"dim", "config"} & set(settings)):
    settings = {**settings, "dim": slot.encoder.dim}
  return dataclasses.replace(cfg, encoder=slot.spec, **settings), slot


class _Closed:
  """The table of a closed memory: every use is a ValueError saying so."""

  def __init__(self, root):
    self._where = "this memory" if root is None else f"memory {str(root)!r}"

  def __getattr__(self, name):
    raise ValueError(f"{self._where} is closed (Memory.close): open it again")

  def __len__(self):
    return self.__getattr__("__len__")


# The served parameters of a guarded memory in one compiled call (`core.guard.served_params`).
_served = jax.jit(guard_lib.served_params, static_argnums=2)
# A held-out session's (`guard_holdout`) first-stage relevance `z` of its candidates: its pages
# follow it.
_held_pages = jax.jit(
    lambda q, c, config: adapter_lib.relevance(guard_lib.first_stage_params(config), q, c)[0],
    static_argnums=2)
_copy = jax.jit(lambda tree: jax.tree_util.tree_map(jnp.copy, tree))  # (one call, own buffers)


class Memory:
  """An EAR memory for a live agent.

  Retrieval rule: the candidates of a query are its top-K memories by frozen cosine (Eq. (1))
  among the DIALOGUE memories (store 0), exactly as the benchmark pipeline; observations are
  candidates only with `multistore=True` (the top-K/2 of each store, Section 5). Then the
  adapter's top-k (Section 3.6) or one Explorer round (Eq. (5)-(8)) from the session's bandit
  statistics. With `candidates='bm25' | 'hybrid'` the first stage is the benchmark's lexical one.

  Scopes: every memory has a scope (`add(..., scope='user-42')`; `DEFAULT_SCOPE` when none is
  given) and a date. A query with `scope=` (a name, or a list of names) gets candidates of those
  scopes only (filtered inside the device search, the faiss selectors and the lexical first
  stage, whose BM25 statistics are those of the allowed scopes); `scope=None` searches every
  scope. One adapter and one replay buffer learn from every scope's feedback.

  Training: a query's rounds are ONE training query and ONE experience (Eq. (10)-(14); see
  `ear_jax.agent.memory.sessions`). Every `b` closed sessions -> one learner step
  (`ear_jax.agent.memory.driver`). `search` is a pure read: no session, nothing learnt. The
  learner is `MemoryConfig.method` (default `config.DEFAULT_METHOD`, `ear_safe`: the tuned
  preset with the held-out guard; `method='ear'` is the paper's).

  `Memory(...)` is an in-memory memory (its table in SQLite's ':memory:'); `Memory.open(dir)`
  opens (or creates) a memory directory, where every add / update / delete is durable when it
  returns; `save()` writes the learner item.

  Args:
    memory_config: a `MemoryConfig`; or, as a first positional argument that is not one, the
      encoder (an `Encoder`, a spec string, or None): `Memory(None, config=EARConfig(dim=8))`.
    encoder: an `Encoder` object, a spec, or None (no encoder), overriding `MemoryConfig.encoder`.
    **settings: `MemoryConfig` fields.
  """

  def __init__(self, memory_config: Any = _UNSET, /, *, encoder: Any = _UNSET, **settings):
    cfg, slot = _new_config(*_settings(memory_config, encoder, settings))
    self._setup(cfg, slot, table_lib.Table(None, cfg.ear.dim), None, None, None)

  def _setup(self, cfg: MemoryConfig, slot: EncoderSlot, table, root, hold, learner) -> None:
    """Builds every part from `table` (and the learner item of `root`, or a `learner` state)."""
    self._cfg, self._encoder, self._table, self._root, self._hold = cfg, slot, table, root, hold
    self._ear, self._hparams = cfg._resolved()  # pylint: disable=protected-access
    config = self._ear
    if slot.dim is not None and slot.dim != config.dim:
      if root is None:
        raise ValueError(f"config.dim={config.dim} does not match the encoder's dimension "
                         f"{slot.dim}")
      raise ValueError(f"{root} was written with encoder dimension d={config.dim}, but encoder "
                       f"{(slot.encoder.name if slot.encoder else slot.spec)!r} has dimension "
                       f"{slot.dim}")
    self._lock = threading.RLock()
    self._save_lock = threading.Lock()
    k_critic = seed_keys(cfg.seed)[2]
    self._critic_keys = CriticKeys(k_critic, config.num_rounds)
    context = cfg.first_stage.uses_context
    rows = table.read_all(texts=context)
    self._next_row = int(rows.next_row)
    row_scopes = [rows.scope_names[c] for c in rows.scope_codes]
    self._scopes, codes = scopes_lib.ScopeNames.from_rows(
        row_scopes, rows.stores, held_before=rows.next_row > len(rows.rows))
    self._scope_rows = scopes_lib.ScopeRows(rows.rows, codes)
    self._lexical = None
    if lexical_bank.needs_lexical(cfg.first_stage_name, config.side_features):
      self._lexical = lexical_bank.LexicalBank(cfg.first_stage_name, cfg.first_stage,
                                               cfg.multistore)
      self._lexical.restore(rows, codes)
    # features='context': (scope, date) -> session code; each session's live rows by place
    self._date_codes, self._turns = {}, scopes_lib.SessionTurns()
    self._bank = bank_lib.write(
        bank_lib.empty(config.dim, max(cfg.initial_capacity, config.num_candidates,
                                       rows.next_row), cfg.bank_dtype),
        rows.rows, rows.embeddings, rows.stores, codes,
        *(self._context(rows.rows, rows.texts, rows.dates, row_scopes, rows.stores, (),
                        rows.places)[0] if context else ()))
    self._searcher = None
    if cfg.index != "exact" and root is not None:
      self._searcher = bank_lib.Searcher.load(root / persistence.ANN, cfg.index,
                                              dict(cfg.index_options), config.dim, rows.rows,
                                              rows.embeddings, rows.stores, codes)
      if self._searcher.stale_file is not None:  # (a kill between a delete's commit and its
        persistence.remove_ann(root)  # `remove_ann`: it may hold the deleted rows' vectors)
    elif cfg.index != "exact":
      self._searcher = bank_lib.ann_searcher(cfg.index, dict(cfg.index_options), config.dim)
      self._searcher.add(rows.rows, rows.embeddings, rows.stores, codes)
    self._ann_rows = self._next_row if root is not None and (root / persistence.ANN).exists() else 0
    self._sessions = Sessions(config, cfg.max_sessions)
    self._saved_questions = set()  # the sessions whose question the learner item on disk holds
    self._driver = Driver(config, self._hparams, cfg.seed, learner)
    self._served_cache = (None, None)  # (the guard state, its served parameters)
    self._stats = collections.Counter()
    self._generation = 0
    self._batcher = None
    if cfg.batch_window_ms > 0:
      self._batcher = batcher_lib.Batcher(
          cfg.batch_window_ms / 1e3, cfg.batch_max_queries,
          lambda texts, what: self._encoder.embed(texts, config.dim, cfg.cache_dir, what),
          lambda key, texts, q_emb, scopes: self._first_stage(texts, q_emb, scopes, *key),
          self._lock)
    self._ops = Ops(round=self._round, feedback=self._feedback, close=self._close,
                    answer=self._answer, info=self._info, critique=self._critique, final=self._final,
                    open=self._open, abandon=self._abandon, records=self._live_records,
                    count=self._count)

  def _restore_learner(self, root: pathlib.Path) -> bool:
    """The learner, sessions and counters of the learner item of `root` (rows deleted since its
    save masked out, sessions showing one dropped); True when the item holds the question of a
    session dropped so (a process killed before its delete rewrote the item)."""
    arrays, meta, where = persistence.read_learner(root)
    table = meta.get("table")  # (None: an item saved before tables had an identity)
    if table is not None and table != self._table.identity:
      raise checkpoints.CheckpointError(
          f"{where} belongs to the table with identity {table}, not to "
          f"{root / persistence.TABLE} (identity {self._table.identity}): a learner item of "
          "another memory directory (copied here?) is never used")
    if int(meta["rows"]) > self._next_row:
      raise checkpoints.CheckpointError(
          f"{where} was saved when the table held rows up to {meta['rows']}, but the table "
          f"{root / persistence.TABLE} ends at row {self._next_row}: they are not one memory's "
          "(a table replaced by an older copy?)")
    driver, sessions = arrays.get("driver", {}), arrays.get("sessions", {})
    for name, rows in (("driver/buffer_rows", driver.get("buffer_rows")),
                       ("driver/holdout_rows", driver.get("holdout_rows")),
                       ("driver/ready/rows", driver.get("ready", {}).get("rows")),
                       ("sessions/cand_idx", sessions.get("cand_idx"))):
      rows = np.asarray([] if rows is None else rows)
      bad = rows[(rows < -1) | (rows >= int(meta["rows"]))]
      if bad.size:
        raise checkpoints.CheckpointError(
            f"{where}: {name} names row {int(bad[0])}, outside the {meta['rows']} rows it was "
            "saved with (corrupted, or another memory's)")
    live = self._live_rows
    gather = lambda r, m: bank_lib.gather(self._bank, np.where(live(r) & m, r, 0), live(r) & m)
    self._driver = Driver.restore(self._ear, self._cfg.seed, driver, meta["driver"], where,
                                  gather, live)
    self._sessions, dropped = Sessions.restore(self._ear, self._cfg.max_sessions, sessions,
                                               meta["sessions"], gather, live)
    self._saved_questions = {int(x["id"]) for x in meta["sessions"]["sessions"] if x.get("query")}
    self._stats = collections.Counter(meta["stats"])
    if dropped:
      self._stats["sessions_dropped_by_delete"] += dropped
    self._generation = int(meta.get("generation", 0))
    saved = meta.get("encoder_identity")
    if saved and self._encoder.identity and saved != self._encoder.identity:
      raise ValueError(f"{where} was written with another encoder model (identity "
                       f"{saved[:16]}), not this one (identity {self._encoder.identity[:16]})")
    self._encoder.identity = self._encoder.identity or saved
    return bool(self._saved_questions - set(self._sessions.by_id))

  def _live_rows(self, rows) -> np.ndarray:
    """`[..]` bool: which device rows hold a memory now."""
    rows = np.asarray(rows)
    ok = (rows >= 0) & (rows < self._bank.valid.shape[0])
    valid = np.asarray(self._bank.valid)
    return ok & valid[np.where(ok, rows, 0)]

  # ----------------------------------------------------------------------------------------------
  # opening and saving (`ear_jax.agent.memory.persistence`)

  @classmethod
  def open(cls, path, memory_config: Optional[MemoryConfig] = None, /, *, encoder: Any = _UNSET,
           learner: Optional[learner_lib.LearnerState] = None, **settings) -> "Memory":
    """Opens the memory directory `path`, creating it with `memory_config` / `settings` when it
    holds no memory; an existing one keeps its stored `MemoryConfig` (passing a different one
    is a ValueError naming the differing fields). Holds the owner lock until `close`: no other
    process, and no other `Memory` of this one, opens the directory meanwhile.

    Args:
      path: the memory directory.
      memory_config: the `MemoryConfig` (of a new directory, or the one expected).
      encoder: an `Encoder` object (or spec) instead of the stored spec (dimension and model
        identity must match).
      learner: a `LearnerState` to start a NEW directory from.
      **settings: `MemoryConfig` fields.

    Raises:
      DirectoryInUseError: another process holds `path` (naming it and that process's pid), or
        another `Memory` of this process (naming it and where that one was opened).
      CheckpointError: a corrupted table or learner item (naming the file);
        `CheckpointFormatError` for an old layout.
    """
    if memory_config is not None and not isinstance(memory_config, MemoryConfig):
      raise InputTypeError(f"memory_config must be a MemoryConfig, got "
                           f"{type(memory_config).__name__}")
    cfg, enc, settings = _settings(memory_config or _UNSET, encoder, settings)
    root = persistence.checkpoint_dir(path)
    persistence.check_directory(root)
    hold, table = persistence.own(root), None
    try:
      persistence.remove_ann(root, only_trash=True)
      meta = persistence.read_meta(root)
      if meta is None:  # a new directory (or a converter's table without its learner item)
        cfg, slot = _new_config(cfg, enc, settings)
        table = table_lib.Table(root / persistence.TABLE, cfg.ear.dim)
        memory = cls.__new__(cls)
        memory._setup(cfg, slot, table, root, hold, learner)
        if learner is None:  # (with one, the caller adds its rows, then saves)
          memory._write_learner()
        return memory
      if learner is not None:
        raise ValueError(f"learner= starts a new memory directory, but {root} holds one")
      stored = config_lib.stored_config(meta)
      if cfg is not None or settings:
        wanted = dataclasses.replace(cfg or stored, **settings)
        if wanted.candidates is None:  # (not given: the directory's first stage)
          wanted = dataclasses.replace(wanted, candidates=stored.candidates)
        checkpoints.check_compatible(stored._comparable(),  # pylint: disable=protected-access
                                     wanted._comparable(),  # pylint: disable=protected-access
                                     f"the MemoryConfig of {root}")
        stored = dataclasses.replace(  # (where and when, not what)
            stored, **{name: getattr(wanted, name) for name in config_lib.SERVING})
      slot = EncoderSlot(stored.encoder if enc is _UNSET else enc, meta.get("encoder_identity"))
      table = table_lib.Table(root / persistence.TABLE, stored.ear.dim)
      memory = cls.__new__(cls)
      memory._setup(stored, slot, table, root, hold, None)
      if memory._restore_learner(root) and hold is not None:
        memory._write_learner()  # (before anything is served: no question of a dropped session)
      return memory
    except BaseException:
      if table is not None:
        table.close()
      if hold is not None:
        hold.release()
      raise

  def _bind(self, root: pathlib.Path, hold) -> None:
    """Writes this in-memory memory's table and learner item into the new directory `root` and
    makes it an opened memory of `root`."""
    self._table.backup_to(root / persistence.TABLE)  # (a table without its learner item opens
    self._table.close()  # as a new memory of those rows)
    self._table = table_lib.Table(root / persistence.TABLE, self._ear.dim)
    self._root, self._hold = root, hold
    self._write_learner()

  def save(self, path=None) -> pathlib.Path:
    """Writes the learner item (adapter, optimiser, buffer, guard, queued items, open sessions);
    the rows are durable already. An in-memory memory needs `path`, a directory that holds no
    memory: it writes the table there too and is then an opened memory of it (holding its owner
    lock). Returns the directory."""
    with self._save_lock:
      if self._root is not None:
        if path is not None and persistence.checkpoint_dir(path) != self._root:
          raise ValueError(f"this memory is the directory {str(self._root)!r}; save() writes "
                           f"there (not to {str(path)!r}); open another memory for another path")
        self._write_learner()
        return self._root
      if path is None:
        raise ValueError("this memory was never saved: pass the directory to save it to")
      root = persistence.checkpoint_dir(path)
      persistence.check_directory(root)
      hold = persistence.own(root, "Memory.save")
      try:
        if persistence.read_meta(root) is not None or (root / persistence.TABLE).exists():
          raise ValueError(f"{str(root)!r} holds a memory already: Memory.open it, or save to "
                           "another directory")
        with self._lock:
          self._bind(root, hold)
      except BaseException:
        if hold is not None and self._root is None:
          hold.release()
        raise
      return root

  def _write_learner(self) -> None:
    with self._lock:
      self._driver.resolve_rows(self._rows_of_embeddings)
      sessions = self._sessions.snapshot()
      self._saved_questions = {s["id"] for s in sessions[1]["sessions"] if s["query"]}
      driver = self._driver.snapshot()
      self._generation += 1
      meta = {"memory_config": self._cfg.to_dict(), "presets": config_lib.PRESETS_VERSION,
              "rows": self._next_row, "table": self._table.identity,
              "encoder_identity": self._encoder.identity, "stats": dict(self._stats),
              "generation": self._generation, "sessions": sessions[1], "driver": driver[1]}
      if self._searcher is not None:
        self._searcher.save(self._root / persistence.ANN)
        self._ann_rows = self._next_row
    arrays = {"driver": driver[0], **({"sessions": sessions[0]} if sessions[0] else {})}
    persistence.write_learner(self._root, arrays, meta)

  def _rows_of_embeddings(self, emb: np.ndarray) -> np.ndarray:
    """`[n]` the rows holding exactly the embeddings `emb [n, d]`, as given or as `add` stores
    them (normalised again); -1: none."""
    rows = self._table.read_all()
    index = {e.tobytes(): int(r) for r, e in zip(rows.rows, rows.embeddings)}
    emb = np.asarray(emb, np.float32)
    again = checks_lib.check_embeddings(emb, len(emb), self._ear.dim, "the learner's candidates")
    return np.asarray([index.get(e.tobytes(), index.get(a.tobytes(), -1))
                       for e, a in zip(emb, again)], np.int64)

  def close(self) -> None:
    """Releases the owner lock and closes the database (idempotent); every later call but
    `close` is a ValueError."""
    with self._lock:
      if isinstance(self._table, _Closed):
        return
      self._table.close()
      self._table = _Closed(self._root)
      self._sessions.closed_memory = True
      if self._hold is not None:
        self._hold.release()
        self._hold = None

  def __enter__(self) -> "Memory":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ----------------------------------------------------------------------------------------------
  # properties

  def __len__(self):
    return len(self._table)

  @property
  def config(self) -> MemoryConfig:
    return self._cfg

  @property
  def learner(self) -> learner_lib.LearnerState:
    """A copy of the learner state (the live one is donated to every learner step)."""
    with self._lock:
      return jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, self._driver.state))

  @property
  def stats(self) -> collections.Counter:
    """A `Counter` (0 for what was never counted) of the counters (memories added / deleted /
    updated, searches, sessions opened, rounds, feedback, learner steps, critic calls, ...) and
    `memories`, `capacity` (device rows), `ready` (closed sessions queued for the next learner
    step), `pending` (those plus open sessions with feedback), `sessions` (open ones),
    `generation` (learner items saved)."""
    with self._lock:
      open_ = [s for s in self._sessions.by_id.values() if not s.closed and not s.frozen]
      ready = len(self._driver.ready)
      batched = {} if self._batcher is None else self._batcher.counts()
      return collections.Counter(
          {**self._stats, **batched, "memories": len(self._table),
           "capacity": self._bank.emb.shape[0],
           "ready": ready, "pending": ready + sum(1 for s in open_ if s.rounds),
           "sessions": len(open_), "generation": self._generation})

  def _count(self, name: str) -> None:
    with self._lock:
      self._stats[name] += 1

  def _served_params(self):
    """The parameters test-time slates rank by (`core.guard.served_params`): the adapter's, or
    the first stage's while the guard does not trust it. Call under the lock."""
    state = self._driver.state
    if state.guard is None:
      return state.params
    if self._served_cache[0] is not state.guard:  # (new after every learner step and delete)
      self._served_cache = (state.guard, _served(state.params, state.guard, self._ear))
    return self._served_cache[1]

  # ----------------------------------------------------------------------------------------------
  # rows: add, get, list, delete, update

  def _embed(self, texts, embeddings, n, what: str):
    """Checked `[n, d]` embeddings, given or encoded (outside the lock; in the window's one
    encoder call when batching)."""
    if embeddings is not None:
      return checks_lib.check_embeddings(embeddings, n, self._ear.dim, f"{what} embeddings")
    if self._batcher is not None:
      return self._batcher.submit(batcher_lib.Request(texts, None, None, what=what))
    return self._encoder.embed(texts, self._ear.dim, self._cfg.cache_dir, what)

  def _check_new(self, ids: list[str]) -> None:
    taken = [i for i, r in zip(ids, self._table.rows_of(ids)) if r >= 0]
    if taken:
      raise ValueError(f"memory ids {taken[:5]} are already in the bank")

  def _default_ids(self, n: int) -> list[str]:
    """`n` free ids `"m<j>"`, `j` counting up from the next row, skipping taken ones."""
    ids, j = [], self._next_row
    while len(ids) < n:
      want = [f"m{i}" for i in range(j, j + n - len(ids))]
      ids += [i for i, r in zip(want, self._table.rows_of(want)) if r < 0]
      j += len(want)
    return ids

  def add(self, texts, *, store="dialogue", ids=None, embeddings=None, scope=None,
          dates=None) -> list[str]:
    """Adds memories: ONE table transaction (durable on return for an opened memory), then the
    device bank, the lexical index and the searcher.

    Args:
      texts: one string, or a sequence of non-empty strings.
      store: 'dialogue' (episodic, 0) or 'observation' (semantic, 1), or one per text.
      ids: `n` unique string ids not yet held; default `"m<row>"`, or the next free `"m<j>"`.
      embeddings: optional `[n, d]` real embeddings (any magnitude; normalised here).
      scope: the scope of these memories (None: `DEFAULT_SCOPE`).
      dates: one date per text (free text or ISO 8601); None: now (UTC, ISO 8601).

    Returns:
      The ids of the added memories.
    """
    texts = checks_lib.check_text_list(texts, "texts")
    n = len(texts)
    codes = checks_lib.store_codes(store, n)
    scope = checks_lib.check_scope(scope)
    dates = checks_lib.check_dates(dates, n)
    if ids is not None:
      ids = checks_lib.check_id_list(ids, n)
      with self._lock:
        self._check_new(ids)
    emb = self._embed(texts, embeddings, n, "memory")
    tokens = None if self._lexical is None else lexical_bank.tokenize(texts)
    with self._lock:  # (re-checked: another thread may have added since)
      if ids is None:
        ids = self._default_ids(n)
      self._check_new(ids)
      enc = None if tokens is None else self._lexical.encode(tokens, codes)
      terms = None if enc is None else [np.zeros(0, np.int32) if t is None else t
                                        for t in enc.terms]  # (not indexed: no terms)
      rows = self._table.insert(ids, texts, codes, [scope] * n, dates, emb, terms,
                                () if enc is None else enc.new_vocab)
      self._put(rows, emb, codes, scope, enc, texts, dates)
      self._stats["memories_added"] += n
      return list(ids)

  def _context(self, rows, texts, dates, scopes, stores, new_vocab=(), places=None):
    """For features='context', new rows' `((sessions, speakers, turns) [n] int32, moved)`: a
    session per (scope, date) (rows added with one date in one scope are one session; `add`'s
    default date is the call's time), the speaker's term id (`lexical_bank.LexicalBank.speakers`)
    and the row's turn, its index among its session's live rows by place (`scopes.SessionTurns`;
    `places` None: the rows' own numbers), with `{row: turn}` of the rows it moved."""
    sessions = first_stage.session_codes([(s, d) if d else None for s, d in zip(scopes, dates)],
                                         self._date_codes)
    turns, moved = self._turns.add(rows, sessions, places)
    return (sessions, self._lexical.speakers(texts, stores, new_vocab), turns), moved

  def _put(self, rows, emb, codes, scope: str, enc, texts, dates, places=None) -> None:
    """Rows the table just took into the device bank, the counts, the searcher, the lexicon."""
    scodes = self._scopes.codes([scope] * len(rows))
    self._scopes.count(scodes, codes)
    self._scope_rows.add(rows, scodes)
    context, moved = (self._context(rows, texts, dates, [scope] * len(rows), codes,
                                    enc.new_vocab, places)
                      if self._cfg.first_stage.uses_context else ((), {}))
    self._bank = bank_lib.write(self._bank, rows, emb, codes, scodes, *context)
    self._bank = bank_lib.set_turns(self._bank, list(moved), list(moved.values()))
    if self._searcher is not None:
      self._searcher.add(rows, emb, codes, scodes)
    if self._lexical is not None:
      self._lexical.add(rows, enc, scodes)
    self._next_row = int(rows[-1]) + 1

  def _records(self, rows) -> list[dict]:
    """`{id, text, store (name), scope, date, row}` of held rows, in order."""
    recs = self._table.records(rows)
    for r in recs:
      r["store"] = checks_lib.STORE_NAMES[int(r["store"])]
    return recs

  def _rows(self, ids: list[str], what: str) -> np.ndarray:
    rows = self._table.rows_of(ids)
    if (rows < 0).any():
      raise forget.unknown_ids(ids, rows, what)
    return rows

  def get(self, ids) -> list[dict]:
    """`[{'id', 'text', 'store', 'scope', 'date', 'row'}]` of memory ids, in order (ValueError
    for an unknown id)."""
    ids = forget.check_ids(ids)
    with self._lock:
      return self._records(self._rows(ids, "ids"))

  def list(self, scope=None) -> list[dict]:
    """The memories (`get`'s records) of the scopes `scope` names (None: every scope), in row
    order (an updated memory where its update put it)."""
    names = checks_lib.check_scope_spec(scope)
    with self._lock:
      return self._records(self._table.list_rows(names))

  def _live_records(self, ids, sid: Optional[int] = None) -> dict:
    """`{id: record}` of those of `ids` still held (`Ops.records`): the records session `sid`
    read of its live candidates (a delete drops a learning session and masks a frozen one's
    candidate), the others' from the table."""
    ids = list(dict.fromkeys(ids))
    with self._lock:
      s = None if sid is None else self._sessions.by_id.get(sid)
      got = {}
      if s is not None:
        got = {rec["id"]: rec for row, ok in zip(s.cand_idx.tolist(), s.cand_mask.tolist())
               if ok and (rec := s.records.get(row)) is not None}
      rest = [i for i in ids if i not in got]
      if rest:
        rows = self._table.rows_of(rest)
        got.update({r["id"]: r for r in self._records(rows[rows >= 0])})
      return {i: got[i] for i in ids if i in got}

  def delete(self, ids) -> list[str]:
    """Deletes memories everywhere (see `ear_jax.agent.memory.forget`): the table row (one
    transaction, its bytes overwritten), the device, lexical and ANN rows (`<dir>/ann` removed
    when it covers one), the open sessions that had one as a candidate (dropped untrained; when
    the learner item holds the question of one, it is saved again before this returns), queued
    items and the replay buffer (masked). Unknown ids: ValueError, nothing changed.

    Returns:
      The deleted ids.
    """
    ids = forget.check_ids(ids)
    with self._lock:
      rows = self._rows(ids, "ids")
      recs = self._records(rows)
      self._table.delete(rows, () if self._lexical is None else self._lexical.dead_terms(rows))
      if self._lexical is not None:
        self._lexical.delete(rows)
      questions = self._unput(rows, recs, "deleted")
      self._stats["memories_deleted"] += len(rows)
    if questions:
      self.save()
    return ids

  def _unput(self, rows: np.ndarray, recs: list[dict], verb: str) -> bool:
    """Rows the table just dropped out of the device bank, the counts, the searcher, the ANN
    file, the sessions, the queue and the buffer (call under the lock). True when the learner
    item holds the question of a session this dropped: the caller saves it again, after the
    lock (so no file keeps it once the call returns)."""
    self._scopes.count(self._scopes.codes([r["scope"] for r in recs]),
                       checks_lib.store_codes([r["store"] for r in recs], len(recs)), -1)
    self._bank = bank_lib.tombstone(self._bank, rows)
    if self._cfg.first_stage.uses_context:  # (the session's later rows move up one)
      moved = self._turns.remove(rows)
      self._bank = bank_lib.set_turns(self._bank, list(moved), list(moved.values()))
    self._scope_rows.remove(rows)
    if self._searcher is not None:
      self._searcher.remove(rows, self._bank)
      if self._root is not None and int(rows.min()) < self._ann_rows:
        persistence.remove_ann(self._root)
        self._ann_rows = 0
    held = set(self._sessions.by_id)
    forget.forget_rows(self._sessions, self._driver, rows,
                       {int(r["row"]): r["id"] for r in recs}, self._stats, verb)
    return self._root is not None and bool(
        (held - set(self._sessions.by_id)) & self._saved_questions)

  def update(self, memory_id: str, *, text: Optional[str] = None, embedding=None) -> str:
    """Corrects one memory: its row is deleted everywhere (as `delete`) and a new one with the
    same id, store, scope and date inserted, in ONE table transaction; it keeps the memory's place
    in their order (`Table.places`: with features='context', its turn in its session). `text`
    None keeps the text; `embedding` None encodes the new text (outside the lock).

    Returns:
      The id.
    """
    memory_id, text, emb = forget.check_update(memory_id, text, embedding, self._ear.dim)
    with self._lock:
      self._rows([memory_id], "memory_id")  # an unknown id: before encoding
    if emb is None:
      emb = self._embed([text], None, 1, "the updated memory's")
    with self._lock:  # (checked again: another call may have deleted it meanwhile)
      rows = self._rows([memory_id], "memory_id")
      rec = self._records(rows)[0]
      new_text = rec["text"] if text is None else text
      code = np.asarray([checks_lib.STORES[rec["store"]]], np.int8)
      enc, lex = None, (None, (), ())
      if self._lexical is not None:
        enc = self._lexical.encode(lexical_bank.tokenize([new_text]), code)
        lex = (enc.terms[0], enc.new_vocab, self._lexical.dead_terms(rows, keep=enc))
      new = self._table.replace(int(rows[0]), memory_id, new_text, int(code[0]), rec["scope"],
                                rec["date"], emb[0], *lex)
      questions = self._unput(rows, [rec], "updated")
      self._put(np.asarray([new]), emb, code, rec["scope"], enc, [new_text], [rec["date"]],
                self._table.places([new]))  # (the memory keeps its place: its turn)
      if self._lexical is not None:
        self._lexical.delete(rows)
      self._stats["memories_updated"] += 1
    if questions:
      self.save()
    return memory_id

  # ----------------------------------------------------------------------------------------------
  # queries: search, session, recall

  def _check_k(self, k) -> int:
    k = check_int(k, "k", 1)
    if k > self._ear.num_candidates:
      raise ValueError(f"k={k} is larger than num_candidates K={self._ear.num_candidates}")
    return k

  def _queries(self, question, query_embedding, batch: bool):
    """`(texts [n] or None, [n, d] given unit embeddings or None)`, checked (the texts are
    encoded when no embeddings are given)."""
    if question is None and query_embedding is None:
      raise ValueError("pass a question (text) or query_embedding")
    if question is not None and not batch and not isinstance(question, str):
      raise InputTypeError(f"question must be a string, got {type(question).__name__}")
    texts = None if question is None else checks_lib.check_text_list(question, "question")
    if query_embedding is None:
      return texts, None
    emb = query_embedding
    if not batch:
      emb = checks_lib.real_query_vector(query_embedding, self._ear.dim)[None]
    emb = self._embed(texts, emb, None if texts is None else len(texts), "query")
    if not len(emb):
      raise ValueError("no question: pass at least one")
    if self._lexical is not None and texts is None:
      raise ValueError(f"candidates={self._cfg.first_stage_name!r} ranks by the question's text "
                       "(BM25): pass the question, with query_embedding or without")
    return texts, emb

  def _staged(self, texts, emb, names, size, k: int, finish):
    """`finish(texts, q_emb, first stage)` under the lock after the first stage of the checked
    query (`_queries`) in the scopes `names` (with `size`, the slate of that size): in the
    window's one encoder call and one search per slate size when batching (each query in its own
    scopes), else now."""
    search_texts = texts if texts is not None else [""] * len(emb)
    prepare = lambda: self._scopes.check_k(k, self._ear.num_candidates, self._cfg.multistore,
                                           names)
    if self._batcher is not None:
      return self._batcher.submit(batcher_lib.Request(
          texts if emb is None else None, emb, (size,), search_texts, prepare, finish,
          scope=names, what="query"))
    if emb is None:
      emb = self._embed(texts, None, len(texts), "query")
    with self._lock:
      prepare()
      return finish(search_texts, emb, self._first_stage(search_texts, emb, [names] * len(emb),
                                                         size))

  def _first_stage(self, texts, q_emb, scopes, size):
    """`bank.search` / `LexicalBank.search` of `[q, d]` queries, query i in the scopes
    `scopes[i]` (one spec for all when they are equal, else per query), with the adapter's slate
    of `size` by the served parameters (None: none) (call under the lock)."""
    if all(x == scopes[0] for x in scopes):
      allowed = self._scopes.allowed(scopes[0])
    else:
      allowed = [self._scopes.allowed(x) for x in scopes]
    K = self._ear.num_candidates
    slate = None if size is None else (self._served_params(), self._hparams, size, False)
    if self._lexical is None:
      return bank_lib.search(self._bank, q_emb, k=K, multistore=self._cfg.multistore,
                             allowed=allowed, slate=slate, searcher=self._searcher,
                             scope_rows=self._scope_rows)
    return self._lexical.search(self._bank, q_emb, texts, K, allowed=allowed, slate=slate,
                                scope_rows=self._scope_rows)

  def _slate(self, rows, scores, round_: int, explore: bool, sid: int, query: str,
             recs=None) -> Slate:
    recs = self._records(rows) if recs is None else recs
    return Slate(ids=tuple(r["id"] for r in recs), texts=tuple(r["text"] for r in recs),
                 stores=tuple(r["store"] for r in recs),
                 scores=tuple(float(x) for x in scores), round=round_, explore=explore,
                 session_id=sid, query=query)

  def search(self, question=None, k: int = 5, *, query_embedding=None, scope=None):
    """The adapter's top-k of a question (ranked by the guard's served parameters): a pure read,
    no session, nothing learnt. A list of questions (or `[n, d]` embeddings) -> a list of
    slates, in one batched device call.

    Returns:
      A `Slate` (round 0, session_id -1), or a list of them.
    """
    batch = isinstance(question, (list, tuple)) or (question is None
                                                    and np.ndim(query_embedding) == 2)
    k = self._check_k(k)
    names = checks_lib.check_scope_spec(scope)
    texts, q_emb = self._queries(question, query_embedding, batch)

    def finish(texts, q_emb, found):
      del q_emb
      rows, _, _, (slate, slate_mask, z) = found
      out = []
      for i, t in enumerate(texts):
        pos = slate[i][slate_mask[i]]
        out.append(self._slate(rows[i][pos], z[i][pos], 0, False, -1, t))
      self._stats["searches"] += len(texts)
      return out

    out = self._staged(texts, q_emb, names, k, k, finish)
    return out if batch else out[0]

  def session(self, question=None, *, query_embedding=None, scope=None, learn: bool = True,
              resume: Optional[int] = None) -> Session:
    """Opens a query session: its candidates are found now, by the first stage, in the scopes
    `scope` names (None: every scope); `resume=<id>` re-attaches to an open session instead.

    With `learn=False` a test-time (frozen) session, `recall(learn=False)`'s paging driven by the
    caller: round t + 1 shows page t of the served ranking, `feedback` records the citations
    (nothing trains the learner: no learner step, replay push or guard ring), `Session.answer`
    is paging's answer. It is never saved (after a reopen its id is unknown to `resume`) and is
    evicted like any session beyond `max_sessions`: `close()` it when done.

    Raises:
      ValueError: no memory in the scopes, a bad question; for `resume`, an unknown or closed
        session (`SessionDroppedError` for one a delete or an eviction dropped).
    """
    if resume is not None:
      if question is not None or query_embedding is not None or scope is not None or (
          learn is not True):
        raise ValueError("pass either resume= or a question (with its scope and learn), not "
                         "both: a resumed session learns as it was opened")
      sid = check_int(resume, "resume", 0)
      with self._lock:
        s = self._sessions.get(sid)
        if s.closed:
          raise ValueError(f"session {sid} is closed: open a new session")
        return Session(self._ops, sid, s.query, s.scope, not s.frozen, bool(s.held))
    if not isinstance(learn, (bool, np.bool_)):
      raise InputTypeError(f"learn must be a bool, got {type(learn).__name__}")
    return self._open(question, query_embedding, scope, not learn, 1, not learn)

  def _open(self, question, query_embedding, scope, frozen: bool, k: int = 1,
            paged: bool = False) -> Session:
    """`Ops.open`: a new session (frozen: a test-time one; `paged`: its rounds are pages of the
    served ranking) whose rounds can show `k`."""
    names = checks_lib.check_scope_spec(scope)
    texts, q_emb = self._queries(question, query_embedding, False)

    def finish(texts, q_emb, found):
      rows, mask, cands, slates = found
      held = not frozen and self._driver.next_held(texts[0], names)  # (`guard_holdout`)
      sid = self._sessions.new(texts[0], q_emb[0], rows[0], cands[0], mask[0], names or (),
                               frozen, held, frozen and paged)
      if frozen:  # (params, an Explorer one's: `_learn` copies them before a step donates them)
        s = self._sessions.by_id[sid]
        s.params, s.ranking = None if paged else self._served_params(), slates[2][0]
      self._stats["sessions_opened"] += 1
      self._learn(self._sessions.evict())
      return Session(self._ops, sid, texts[0], names or (), not frozen, bool(held))

    # (frozen: the search's slate by the served parameters gives their ranking `z`, what paging
    # reads, in the same call)
    return self._staged(texts, q_emb, names, k if frozen else None, k, finish)

  def recall(self, question: str, critic, k: int = 5, *, query_embedding=None,
             learn: bool = True, scope=None, rule: Optional[str] = None) -> Recall:
    """T Explorer rounds of `question` with `critic`, recorded as ONE training query, and the
    final slate `config.final_slate` names (see `ear_jax.agent.memory.recall`).

    Args:
      question: the question's text (shown to the critic).
      critic: `critic(key, view) -> labels [k]` or None (e.g. `LLMCritic`), or
        `AnswerFeedback(answer_fn)` (this memory's encoder embeds the answers).
      k: memories per slate and in the answer.
      query_embedding: optional `[d]` precomputed embedding of the question.
      learn: False: the same rounds with the adapter frozen and nothing to train (explorer-
        assisted inference, as `ear_jax.core.inference.evaluate`).
      scope: the scopes the candidates come from (None: every scope).
      rule: the rounds: 'explorer' (T Explorer rounds) or 'paging' (`learn=False` only: the
        critic reads the served ranking's top T k in T pages of k, and the answer is the cited
        memories first, in ranking order, then the ranking: `core.retrieval.paging_slate`).
        Default: 'explorer' to learn, 'paging' with `learn=False` (RESULTS.md "Safety and
        paging": at test time the Explorer's rounds do not beat paging with the same calls).
    """
    if not isinstance(question, str) or not question:
      raise ValueError("recall needs the question's text (a non-empty string): the critic reads it")
    rule = ("explorer" if learn else "paging") if rule is None else rule
    if rule not in recall_lib.RULES:
      raise ValueError(f"unknown rule={rule!r}; expected one of {recall_lib.RULES}")
    if rule == "paging" and learn:
      raise ValueError("rule='paging' is a test-time rule: use it with learn=False (a memory "
                       "learns from the Explorer's rounds)")
    k = self._check_k(k)
    critic = critic.bound(self._embed_answer) if isinstance(critic, AnswerFeedback) else critic
    return recall_lib.recall(self._ops, question, critic, k, query_embedding=query_embedding,
                             learn=bool(learn), scope=scope, rounds=self._ear.num_rounds,
                             final_slate="paging" if rule == "paging" else self._ear.final_slate)

  # ----------------------------------------------------------------------------------------------
  # the session operations (`sessions.Ops`)

  def _shown(self, s) -> list[str]:
    return [r["id"] for r in self._candidate_records(s, s.open_slate)]

  def _candidate_records(self, s, positions) -> list[dict]:
    """The records of session `s`'s candidates at `positions` (all its candidates' read at the
    first call, in one query)."""
    rows = [int(r) for r in s.cand_idx[positions]]
    if any(r not in s.records for r in rows):
      held = s.cand_idx[s.cand_mask & self._live_rows(s.cand_idx)]
      missing = list(dict.fromkeys([int(r) for r in held if int(r) not in s.records] + rows))
      s.records.update(zip(missing, self._records(missing)))
    return [s.records[r] for r in rows]

  def _round(self, sid: int, k, explore: bool) -> Slate:
    k = self._check_k(k)
    explore = bool(explore)
    with self._lock:
      s = self._sessions.get(sid, open_round=False)
      if s.held:  # held out for the guard: its pages are of the first stage's ranking
        if k > int(s.cand_mask.sum()):
          raise ValueError(f"k={k} is larger than the {int(s.cand_mask.sum())} candidates of "
                           f"session {sid}")
        if s.ranking is None:
          s.ranking = np.asarray(_held_pages(s.query_emb, s.cand_emb, self._ear))
      if s.paged:  # the next page of `ranking` (a held-out session is paged too)
        return self._open_page(s, sid, k, explore)
      held = int(s.cand_mask.sum())
      if s.frozen:
        k = min(k, held)
        if not k:
          return Slate((), (), (), (), s.rounds + 1, True, sid, s.query)
      elif k > held:
        raise ValueError(f"k={k} is larger than the {held} candidates of session {sid}")
      params = s.params if s.frozen else (
          self._driver.state.params if explore else self._served_params())
      (slate, slate_mask, z, s.mean, s.counts), s.adapted = episode.session_round(
          params, self._hparams, s.query_emb, s.cand_emb, s.cand_mask, s.mean, s.counts,
          s.last(), k, explore or s.frozen, self._adapted(s, params))
      s.stale, s.adapted_by = False, params
      pos = slate[slate_mask]
      self._sessions.open_round(sid, pos, explore or s.frozen)
      if not s.frozen and self._ear.final_slate != "round_T":
        s.params = params  # (a reference: `_learn` copies it before a learner step donates it)
      self._stats["rounds"] += 1
      return self._slate(s.cand_idx[pos], z[pos], s.rounds + 1, explore or s.frozen, sid,
                         s.query, self._candidate_records(s, pos))

  def _open_page(self, s, sid: int, k: int, explore: bool) -> Slate:
    """The next page of session `s`'s `ranking` (a held-out session's: of its `page_order`, when
    one was saved; ties to the lower candidate): its first `k` candidates still held that no page
    with feedback showed (after t pages of k and no delete: ranks `t k .. t k + k - 1`), opened as
    its next round (`explore`: the session goes on after its feedback)."""
    z = s.ranking
    by = z if s.page_order is None else s.page_order
    order = np.lexsort((np.arange(len(by)), -by))
    fresh = s.cand_mask.copy()
    fresh[s.slates[:s.rounds][s.slate_mask[:s.rounds]]] = False
    pos = order[fresh[order]][:k].astype(np.int32)
    if not len(pos):
      return Slate((), (), (), (), s.rounds + 1, True, sid, s.query)
    self._sessions.open_round(sid, pos, explore)
    self._stats["rounds"] += 1
    return self._slate(s.cand_idx[pos], z[pos], s.rounds + 1, True, sid, s.query,
                       self._candidate_records(s, pos))

  def _answer(self, sid: int, k) -> Slate:
    """`Ops.answer`: `recall.paging_answer` of the pages session `sid` showed (its rounds with
    feedback, then the open one uncited), less the memories deleted since; `k` None: the first
    page's size."""
    k = None if k is None else self._check_k(k)
    with self._lock:
      s = self._sessions.get(sid)
      if not s.paged:  # (held-out sessions are paged too)
        raise ValueError(f"session {sid} plays Explorer rounds: answer() is paging's (a session "
                         "opened with learn=False)")
      pages = [(s.slates[t][s.slate_mask[t]], s.labels[t][s.slate_mask[t]])
               for t in range(s.rounds)]
      pages += [] if s.open_slate is None else [(s.open_slate, None)]
      shown, labels = [], []
      for pos, lab in pages:
        keep = s.cand_mask[pos]  # (a delete masked its memory out)
        shown.append(self._slate(s.cand_idx[pos[keep]], s.ranking[pos[keep]], s.rounds, False,
                                 sid, s.query, self._candidate_records(s, pos[keep])))
        labels.append(None if lab is None else lab[keep])
      if k is None:
        k = len(pages[0][0]) if pages else 0
      answer, _ = recall_lib.paging_answer(shown, labels, k)
      recs = {i: (text, store) for p in shown for i, text, store in zip(p.ids, p.texts, p.stores)}
      return Slate(ids=tuple(i for i, _ in answer), texts=tuple(recs[i][0] for i, _ in answer),
                   stores=tuple(recs[i][1] for i, _ in answer),
                   scores=tuple(float(sc) for _, sc in answer), round=s.rounds, explore=False,
                   session_id=sid, query=s.query)

  def _learn(self, items) -> int:
    if len(self._driver.ready) + len(items) >= self._ear.batch_size:
      self._detach_params()
    steps = self._driver.push(items)
    self._stats["learner_steps"] += steps
    self._stats["queries_queued"] += len(items)
    return steps

  @staticmethod
  def _adapted(s, params):
    """The session's `episode.adapted` of its last round when it ranked by `params` (the
    adapter's output for its candidates: later rounds skip the adapter), else None."""
    return s.adapted if s.adapted_by is params else None

  def _detach_params(self) -> None:
    """Sessions that hold the live adapter parameters (their last round's, for 'exploit' and
    frozen answers) get one copy of them: the learner step donates the live ones."""
    live, copy = self._driver.state.params, None
    for s in self._sessions.by_id.values():
      if s.params is live:
        copy = _copy(live) if copy is None else copy
        s.params = copy

  def _apply(self, sid: int, labels: np.ndarray) -> int:
    item = self._sessions.record(sid, labels)
    self._stats["feedback"] += 1
    self._stats["cited"] += int((labels > 0).sum())
    return self._learn([] if item is None else [item])

  def _feedback(self, sid: int, cited_ids, answer) -> bool:
    what = lambda s: f"session {sid} round {s.rounds + 1}"
    with self._lock:
      s = self._sessions.get(sid, open_round=True)
      labels = citation_labels(self._shown(s), cited_ids, what(s))
      if answer is None:
        return self._apply(sid, labels) > 0
      answer = episode.check_answer(answer)
      if not s.query:
        raise ValueError(f"session {sid} has no question text: feedback from an answer compares "
                         "it with the question (open the session with the question's text)")
      slate = s.open_slate.copy()
      texts = [r["text"] for r in self._candidate_records(s, slate)]
      question, memories = s.query, s.cand_emb[slate, :self._ear.dim].copy()
    used = episode.answer_labels(question, answer, texts, memories, self._embed_answer)
    with self._lock:  # (still open: another call may have labelled it, a delete dropped it)
      s = self._sessions.get(sid, open_round=True)
      if not np.array_equal(s.open_slate, slate):
        raise ValueError(f"session {sid} showed another round meanwhile; nothing was changed")
      cited = citation_labels(self._shown(s), cited_ids, what(s))
      self._stats["answer_feedback"] += 1
      return self._apply(sid, np.maximum(cited, used)) > 0

  def _embed_answer(self, texts: list[str]) -> np.ndarray:
    """`[n, d]` embeddings of an answer's texts by this memory's encoder (outside the lock)."""
    if self._encoder.get(self._ear.dim) is None:
      raise ValueError("this memory has no encoder, so it cannot embed an answer: feedback from "
                       "an answer needs the memories' encoder (build the Memory with one); give "
                       "cited ids instead")
    return self._embed(texts, None, len(texts), "the answer's")

  def _close(self, sid: int) -> bool:
    with self._lock:
      s = self._sessions.get(sid)
      item = self._sessions.close(sid)
      if s.frozen:
        self._sessions.by_id.pop(sid)
      return self._learn([] if item is None else [item]) > 0

  def _abandon(self, sid: int) -> None:
    with self._lock:
      self._sessions.by_id.pop(sid, None)

  def _info(self, sid: int) -> tuple[int, bool]:
    with self._lock:
      s = self._sessions.get(sid)
      return s.rounds, s.closed

  def _critique(self, sid: int, critic, t: int) -> Optional[np.ndarray]:
    """`Ops.critique`: the open round of `sid` shown to a host critic (outside the lock, key
    `fold_in(fold_in(k_critic, sid), t)` as a host `[2]` uint32 array, `sessions.CriticKeys`);
    its labels applied, or (None, an unusable reply) the round discarded with no update
    (`stats['critic_no_update']`). Returns the critic's labels of the memories it was shown (a
    frozen session applies those of the memories still held: none left, no update)."""
    with self._lock:
      s = self._sessions.get(sid, open_round=True)
      slate = s.open_slate[s.cand_mask[s.open_slate]]  # (frozen: less what was deleted since)
      if not len(slate):
        s.open_slate = None
        return None
      recs = self._candidate_records(s, slate)
      view = critic_lib.SlateView(
          query=s.query_emb, slate=slate, slate_mask=np.ones(len(slate), bool),
          memories=s.cand_emb[slate, :self._ear.dim], gold=np.zeros(len(slate), bool),
          query_text=s.query, texts=[r["text"] for r in recs], ids=[r["id"] for r in recs])
      key = self._critic_keys(sid, t)
    labels = critic(key, view)
    if labels is not None:
      labels = episode.check_labels(labels, len(slate), "the critic")  # the round stays open
    with self._lock:
      self._stats["critic_calls"] += 1
      s = self._sessions.get(sid, open_round=True)
      kept = labels
      if s.frozen:  # (a delete meanwhile masked some of its memories out: label the others)
        keep = s.cand_mask[slate]
        s.open_slate, kept = slate[keep], None if labels is None else labels[keep]
      elif not np.array_equal(s.open_slate, slate):
        raise ValueError(f"session {sid} showed another round while the critic ran")
      if labels is None:
        s.open_slate = None
        self._stats["critic_no_update"] += 1
      elif not len(kept):  # (every memory it showed was deleted: no update, the rounds go on)
        s.open_slate = None
      else:
        self._apply(sid, kept)
    return labels

  def _final(self, sid: int, k: int) -> tuple[tuple, tuple]:
    """`Ops.final`: the top-k by bandit mean, ties by adapted relevance ('exploit')."""
    with self._lock:
      s = self._sessions.get(sid)
      k = min(k, int(s.cand_mask.sum()))  # (frozen: deletes may have masked candidates out)
      if not k:
        return (), ()
      params = s.params if s.params is not None else self._driver.state.params
      slate, slate_mask, z = recall_lib.exploit(params, s.query_emb, s.cand_emb, s.cand_mask,
                                                s.mean, s.counts, s.last(), k,
                                                self._adapted(s, params))
      pos = slate[slate_mask]
      return (tuple(r["id"] for r in self._candidate_records(s, pos)), tuple(z[pos].tolist()))


def llm_feedback(memory: Memory, critic, query: str, k: int = 5, explore: bool = True, *,
                 query_embedding=None) -> tuple[Slate, Any]:
  """One agent step with a host critic: a session of one round, `critic(key, view)`, its labels
  as the round's feedback, and the session closed (queued when labelled).

  An unusable reply (labels None) gives no update (counted in `memory.stats['critic_no_update']`
  and in the critic's own `stats`); the loop never crashes on it.

  Returns:
    `(slate, labels)`: labels `[k]` float32 in {-1, +1}, or None.
  """
  s = memory.session(query, query_embedding=query_embedding)
  slate = s.round(k, explore)
  if isinstance(critic, AnswerFeedback):
    critic = critic.bound(memory._embed_answer)  # pylint: disable=protected-access
  labels = memory._ops.critique(s.id, critic, 0)  # pylint: disable=protected-access
  if not s.closed:
    s.close()
  return slate, labels
