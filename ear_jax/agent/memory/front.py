"""`Memory`: the stateful front of EAR for a live agent (its configuration: `config.MemoryConfig`).

Symbols: `d` dimension, `K` candidates, `k` memories shown (`k <= K`), `T` Explorer rounds.

Three parts behind one re-entrant lock: `rows.Rows` (table, device bank, lexical index, ANN),
`staging.Stage` (encoding, first stage) and `learning.Learning` (sessions, learner). Every public
method validates its input first: a ValueError (`InputTypeError` for a wrong type) naming the
problem, the state unchanged.
"""
from __future__ import annotations

import collections
import pathlib
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory import checks as checks_lib
from ear_jax.agent.memory import config as config_lib
from ear_jax.agent.memory import persistence
from ear_jax.agent.memory import recall as recall_lib
from ear_jax.agent.memory import table as table_lib
from ear_jax.agent.memory.checks import DEFAULT_SCOPE, InputTypeError, check_int, check_k
from ear_jax.agent.memory.config import UNSET, MemoryConfig
from ear_jax.agent.memory.encoder_slot import EncoderSlot
from ear_jax.agent.memory.episode import AnswerFeedback, run_critic_episode
from ear_jax.agent.memory.learning import Learning
from ear_jax.agent.memory.recall import Recall, Session, llm_feedback
from ear_jax.agent.memory.rows import Rows
from ear_jax.agent.memory.sessions import SessionDroppedError, Slate
from ear_jax.agent.memory.staging import Stage
from ear_jax.core import learner as learner_lib
from ear_jax.io import compilation_cache

__all__ = ["DEFAULT_SCOPE", "AnswerFeedback", "Memory", "MemoryConfig", "Recall", "Session",
           "SessionDroppedError", "Slate", "llm_feedback", "run_critic_episode"]


class Memory:
  """An EAR memory for a live agent.

  A query's candidates: its top-K memories by the first stage (Eq. (1), or BM25 / hybrid) in its
  scopes; a slate: the adapter's top-k or an Explorer round (Eq. (5)-(8)). A query's rounds are
  ONE training query (Eq. (10)-(14)); every `b` closed sessions make one learner step.
  `Memory.open(dir)`: every add / update / delete durable on return; `save()`: the learner item.

  Args:
    memory_config: a `MemoryConfig`; or, as a first positional argument that is not one, the
      encoder (an `Encoder`, a spec string, or None): `Memory(None, config=EARConfig(dim=8))`.
    encoder: an `Encoder` object, a spec, or None (no encoder), overriding `MemoryConfig.encoder`.
    **settings: `MemoryConfig` fields.
  """

  def __init__(self, memory_config: Any = UNSET, /, *, encoder: Any = UNSET, **settings):
    cfg, slot = config_lib.new_config(*config_lib.arguments(memory_config, encoder, settings))
    self._setup(cfg, slot, table_lib.Table(None, cfg.ear.dim), None, None, None)
    self._learning.warm()

  def _setup(self, cfg: MemoryConfig, slot: EncoderSlot, table, root, hold, learner) -> None:
    compilation_cache.enable()  # (a second process loads what this one compiles)
    self._cfg, self._encoder, self._root, self._hold = cfg, slot, root, hold
    # (resolved once: `cfg.ear` and `cfg.learner_hparams` would each resolve the method again)
    self._ear, self._hparams = cfg.resolved()
    slot.check_dim(self._ear.dim, root)
    self._lock, self._save_lock = threading.RLock(), threading.Lock()
    self._stats, self._generation = collections.Counter(), 0
    self._rows = Rows(table, cfg, self._ear, root)
    self._stage = Stage(cfg, self._ear, self._hparams, slot, self._rows, self._lock)
    self._learning = Learning(self._ear, self._hparams, cfg.seed, cfg.max_sessions, self._rows,
                              self._lock, self._stats, self._stage.embed_answer, learner,
                              cfg.warm_learner)
    self._stage.learning = self._learning

  # ----------------------------------------------------------------------------------------------
  # opening and saving (`persistence`)

  @classmethod
  def open(cls, path, memory_config: Optional[MemoryConfig] = None, /, *, encoder: Any = UNSET,
           learner: Optional[learner_lib.LearnerState] = None, **settings) -> "Memory":
    """Opens (or creates, with `memory_config` / `settings`) the memory directory `path`, holding
    its owner lock until `close` (`DirectoryInUseError` for anyone else). An existing directory
    keeps its `MemoryConfig` (another one: ValueError); `encoder` replaces the stored spec (same
    model); `learner` seeds a NEW directory. A corrupted file: a `CheckpointError` naming it."""
    if memory_config is not None and not isinstance(memory_config, MemoryConfig):
      raise InputTypeError(f"memory_config must be a MemoryConfig, got "
                           f"{type(memory_config).__name__}")
    cfg, enc, settings = config_lib.arguments(memory_config or UNSET, encoder, settings)
    root = persistence.checkpoint_dir(path)
    persistence.check_directory(root)
    hold, table = persistence.own(root), None
    try:
      persistence.remove_ann(root, only_trash=True)
      meta = persistence.read_meta(root)
      if meta is None:  # a new directory (or a converter's table without its learner item)
        cfg, slot = config_lib.new_config(cfg, enc, settings)
      elif learner is not None:
        raise ValueError(f"learner= starts a new memory directory, but {root} holds one")
      else:
        cfg = config_lib.opened_config(config_lib.stored_config(meta), cfg, settings, root)
        slot = config_lib.encoder_slot(cfg, enc, meta.get("encoder_identity"))
      table = table_lib.Table(root / persistence.TABLE, cfg.ear.dim)
      memory = cls.__new__(cls)
      memory._setup(cfg, slot, table, root, hold, learner)
      if meta is None:
        write = learner is None  # (with a `learner`, the caller adds its rows, then saves)
      else:  # (an item holding the question of a session dropped since: rewritten at once)
        write = memory._restore_learner(root) and hold is not None
      if write:
        memory._write_learner()
      memory._learning.warm()  # (the restored learner's step, with `warm_learner`)
      return memory
    except BaseException:
      if table is not None:
        table.close()
      if hold is not None:
        hold.release()
      raise

  def _restore_learner(self, root: pathlib.Path) -> bool:
    """True when the restored learner item must be written again."""
    arrays, meta, where = persistence.read_learner_of(root, self._rows.table.identity,
                                                      self._rows.next_row)
    self._stats.update(meta["stats"])
    dropped = self._learning.restore(arrays, meta, where)
    self._generation = int(meta.get("generation", 0))
    self._encoder.adopt_identity(meta.get("encoder_identity"), where)
    return dropped

  def save(self, path=None) -> pathlib.Path:
    """Writes the learner item (the rows are durable already) and returns the directory. An
    in-memory memory needs `path` (holding no memory) and becomes an opened memory of it."""
    with self._save_lock:
      if self._root is not None:
        if path is not None and persistence.checkpoint_dir(path) != self._root:
          raise ValueError(f"this memory is the directory {str(self._root)!r}; save() writes "
                           f"there (not to {str(path)!r}); open another memory for another path")
        self._write_learner()
        return self._root
      if path is None:
        raise ValueError("this memory was never saved: pass the directory to save it to")
      root, hold = persistence.claim_new(path)
      try:
        with self._lock:  # (a table without its learner item opens as a new memory of its rows)
          self._rows.move_to(root, root / persistence.TABLE)
          self._root, self._hold = root, hold
          self._write_learner()
      except BaseException:
        if hold is not None and self._root is None:
          hold.release()
        raise
      return root

  def _write_learner(self) -> None:
    with self._lock:
      arrays, learned = self._learning.snapshot()
      self._generation += 1
      meta = {"memory_config": self._cfg.to_dict(), "presets": config_lib.PRESETS_VERSION,
              "rows": self._rows.next_row, "table": self._rows.table.identity,
              "encoder_identity": self._encoder.identity, "stats": dict(self._stats),
              "generation": self._generation, **learned}
      self._rows.save_ann()
    persistence.write_learner(self._root, arrays, meta)

  def close(self) -> None:
    """Releases the owner lock and closes the database (idempotent); later calls: ValueError."""
    with self._lock:
      if self._rows.closed:
        return
      self._rows.close()
      self._learning.registry.closed_memory = True
      if self._hold is not None:
        self._hold.release()
        self._hold = None
    self._learning.driver.join_warm()  # (a process must not exit while a thread compiles)

  def __enter__(self) -> "Memory":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ----------------------------------------------------------------------------------------------
  # properties

  def __len__(self):
    return len(self._rows)

  @property
  def config(self) -> MemoryConfig:
    return self._cfg

  @property
  def learner(self) -> learner_lib.LearnerState:
    """A copy of the learner state (the live one is donated to every learner step)."""
    with self._lock:
      return jax.block_until_ready(jax.tree_util.tree_map(jnp.copy,
                                                          self._learning.driver.state))

  @property
  def stats(self) -> collections.Counter:
    """A `Counter` of events (adds, searches, rounds, learner steps, ...) and gauges: `memories`,
    `capacity`, `ready`, `pending`, `sessions`, `generation`, `serves_adapter`, `guard_evidence`."""
    with self._lock:
      batcher = self._stage.batcher
      batched = {} if batcher is None else batcher.counts()
      serves, evidence = self._learning.serving()
      return collections.Counter(
          {**self._stats, **batched, "memories": len(self._rows),
           "capacity": self._rows.capacity, "ready": len(self._learning.driver.ready),
           "pending": self._learning.pending(), "sessions": self._learning.open_sessions(),
           "generation": self._generation, "serves_adapter": int(serves),
           "guard_evidence": evidence})

  def train(self) -> int:
    """Trains the queued closed sessions now (the last batch masked); returns the steps taken."""
    return self._learning.train()

  # ----------------------------------------------------------------------------------------------
  # rows: add, get, list, delete, update

  def add(self, texts, *, store="dialogue", ids=None, embeddings=None, scope=None,
          dates=None) -> list[str]:
    """Adds memories in ONE table transaction (durable on return for an opened memory).

    Args:
      texts: one string, or a sequence of non-empty strings.
      store: 'dialogue' (episodic, 0) or 'observation' (semantic, 1), or one per text.
      ids: `n` unique new string ids; default `"m<row>"` (or the next free `"m<j>"`).
      embeddings: optional `[n, d]` real embeddings (normalised here).
      scope: their scope (None: `DEFAULT_SCOPE`).
      dates: one per text (free text or ISO 8601); None: now (UTC, ISO 8601).

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
        self._rows.check_new(ids)
    emb = self._stage.embed(texts, embeddings, n, "memory")
    tokens = self._rows.tokenize(texts)
    with self._lock:  # (re-checked: another thread may have added since)
      ids = self._rows.new_ids(n) if ids is None else ids
      self._rows.check_new(ids)
      self._rows.insert(ids, texts, codes, scope, dates, emb, tokens,
                        self._stage.source(embeddings))
      self._stats["memories_added"] += n
      return list(ids)

  def get(self, ids) -> list[dict]:
    """`[{'id', 'text', 'store', 'scope', 'date', 'row'}]` of memory ids, in order."""
    ids = checks_lib.check_ids(ids)
    with self._lock:
      return self._rows.records(self._rows.rows_of(ids, "ids"))

  def list(self, scope=None) -> list[dict]:
    """The memories (`get`'s records) of the scopes `scope` names (None: every scope), in order."""
    names = checks_lib.check_scope_spec(scope)
    with self._lock:
      return self._rows.records(self._rows.table.list_rows(names))

  def delete(self, ids) -> list[str]:
    """Deletes memories everywhere (table bytes overwritten, device / lexical / ANN rows, sessions
    showing one, queued items, replay buffer; a saved item holding a dropped question rewritten)
    and returns their ids. Unknown ids: ValueError, nothing changed."""
    ids = checks_lib.check_ids(ids)
    with self._lock:
      rows = self._rows.rows_of(ids, "ids")
      recs = self._rows.delete(rows)
      questions = self._learning.forget(rows, recs, "deleted")
      self._stats["memories_deleted"] += len(rows)
    if questions:
      self.save()
    return ids

  def update(self, memory_id: str, *, text: Optional[str] = None, embedding=None) -> str:
    """Corrects one memory in ONE table transaction: deleted as `delete`, re-inserted with the same
    id, store, scope, date and place. `text` None keeps the text; `embedding` None encodes it."""
    memory_id, text, emb = checks_lib.check_update(memory_id, text, embedding, self._ear.dim)
    with self._lock:
      self._rows.rows_of([memory_id], "memory_id")  # an unknown id: before encoding
    if emb is None:
      emb = self._stage.embed([text], None, 1, "the updated memory's")
    with self._lock:  # (checked again: another call may have deleted it meanwhile)
      row = int(self._rows.rows_of([memory_id], "memory_id")[0])
      rec, _ = self._rows.replace(row, text, emb, self._stage.source(embedding))
      questions = self._learning.forget(np.asarray([row]), [rec], "updated")
      self._stats["memories_updated"] += 1
    if questions:
      self.save()
    return memory_id

  # ----------------------------------------------------------------------------------------------
  # queries: search, session, recall

  def search(self, question=None, k: int = 5, *, query_embedding=None, scope=None):
    """The served top-k of a question: a pure read, nothing learnt. `k` in `[1, K]` is a maximum;
    an empty scope is a ValueError. A list of questions (or `[n, d]`) gives a list, batched."""
    batch = isinstance(question, (list, tuple)) or (question is None
                                                    and np.ndim(query_embedding) == 2)
    k = check_k(k, self._ear.num_candidates)
    names = checks_lib.check_scope_spec(scope)
    texts, q_emb = self._stage.queries(question, query_embedding, batch)

    def finish(texts, _, found):
      rows, _, _, (slate, slate_mask, z) = found
      out = []
      for i, t in enumerate(texts):
        pos = slate[i][slate_mask[i]]
        out.append(Slate.of(self._rows.records(rows[i][pos]), z[i][pos], 0, False, -1, t))
      self._stats["searches"] += len(texts)
      return out

    out = self._stage.run(texts, q_emb, names, k, k, finish)
    return out if batch else out[0]

  def session(self, question=None, *, query_embedding=None, scope=None, learn: bool = True,
              resume: Optional[int] = None) -> Session:
    """Opens a query session, its candidates found now in `scope` (None: every scope);
    `resume=<id>` re-attaches to an open one (`SessionDroppedError` for a dropped one).
    `learn=False`: a test-time paging session (nothing trains); `close()` it when done."""
    if resume is not None:
      if question is not None or query_embedding is not None or scope is not None or (
          learn is not True):
        raise ValueError("pass either resume= or a question (with its scope and learn), not "
                         "both: a resumed session learns as it was opened")
      sid = check_int(resume, "resume", 0)
      return Session(self._learning, sid, *self._learning.resume(sid))
    if not isinstance(learn, (bool, np.bool_)):
      raise InputTypeError(f"learn must be a bool, got {type(learn).__name__}")
    return self._open(question, query_embedding, scope, not learn, 1, not learn)

  def _open(self, question, query_embedding, scope, frozen: bool, k: int = 1,
            paged: bool = False, asked: Optional[int] = None) -> Session:
    """A new session (frozen: test-time; `paged`: pages of the served ranking)."""
    names = checks_lib.check_scope_spec(scope)
    texts, q_emb = self._stage.queries(question, query_embedding, False)

    def finish(texts, q_emb, found):
      rows, mask, cands, slates = found
      sid, held = self._learning.open(texts[0], q_emb[0], rows[0], cands[0], mask[0], names,
                                      frozen, paged, None if slates is None else slates[2][0])
      return Session(self._learning, sid, texts[0], names or (), not frozen, held)

    return self._stage.run(texts, q_emb, names, k if frozen else None, asked, finish)

  def recall(self, question: str, critic, k: int = 5, *, query_embedding=None,
             learn: bool = True, scope=None, rule: Optional[str] = None) -> Recall:
    """T Explorer rounds of `question` with `critic` as ONE training query, and the final slate
    `config.final_slate` names (`ear_jax.agent.memory.recall`).

    Args:
      question: the question's text (shown to the critic).
      critic: `critic(key, view) -> labels [k]` or None (e.g. `LLMCritic`), or
        `AnswerFeedback(answer_fn)` (this memory's encoder embeds the answers).
      k: memories per slate and in the answer, at most.
      query_embedding: optional `[d]` precomputed embedding of the question.
      learn: False: nothing trains (explorer-assisted inference, `core.inference.evaluate`).
      scope: the scopes the candidates come from (None: every scope).
      rule: 'explorer' (the default to learn) or 'paging' (`learn=False` only, its default: T
        pages of the served ranking, `core.retrieval.paging_slate`).
    """
    if not isinstance(question, str) or not question:
      raise ValueError("recall needs the question's text (a non-empty string): the critic reads it")
    rule = ("explorer" if learn else "paging") if rule is None else rule
    if rule not in recall_lib.RULES:
      raise ValueError(f"unknown rule={rule!r}; expected one of {recall_lib.RULES}")
    if rule == "paging" and learn:
      raise ValueError("rule='paging' is a test-time rule: use it with learn=False (a memory "
                       "learns from the Explorer's rounds)")
    k = check_k(k, self._ear.num_candidates)
    final = "paging" if rule == "paging" else self._ear.final_slate
    session = self._open(question, query_embedding, scope, not learn, k, final == "paging", k)
    return recall_lib.recall(self._learning, session, critic, k, learn=bool(learn),
                             rounds=self._ear.num_rounds, final_slate=final)
