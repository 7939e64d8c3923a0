"""`Memory`: the stateful front of EAR for a live agent (add, retrieve, learn from feedback, save).

Symbols: `n` memories, `d` dimension, `K` candidates, `k` memories shown (`k <= K`), `T` Explorer
rounds, `b` batch size. `Memory` serialises three parts over the pure core with one lock:
`bank.Bank` (ids, texts, device-resident `[C, d]` embeddings; `retrieval.top_k_search`),
`sessions.Sessions` (one session per query; `retrieval.slate_from_candidates`) and `driver.Driver`
(the learner state; `learner.train_batch_on_feedback`). Checkpoints: `persistence`; critic
loops: `llm_feedback` (here), `episode.run_critic_episode` (re-exported here).
"""
from __future__ import annotations

import collections
import dataclasses
import pathlib
import threading
from typing import Any, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import forget
from ear_jax.agent.memory import lexical_bank
from ear_jax.agent.memory import persistence
from ear_jax.agent.memory import recall as recall_lib
from ear_jax.agent.memory.bank import DEFAULT_SCOPE, InputTypeError
from ear_jax.agent.memory.encoder_slot import EncoderSlot
from ear_jax.agent.memory.driver import Driver, seed_keys
from ear_jax.agent.memory import episode
from ear_jax.agent.memory.episode import AnswerFeedback, round_slates, run_critic_episode
from ear_jax.agent.memory.sessions import Retrieval, Sessions, citation_labels
from ear_jax.core import adapter as adapter_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import guard as guard_lib
from ear_jax.core import learner as learner_lib
from ear_jax.core import policies
from ear_jax.core.config import EARConfig, HParams, Method, default_hparams
from ear_jax.data import first_stage

__all__ = ["DEFAULT_SCOPE", "AnswerFeedback", "Memory", "Retrieval", "llm_feedback",
           "run_critic_episode"]


def _check_int(value, name: str, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise InputTypeError(f"{name} must be an int, got {type(value).__name__}")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {name}={value}")
  return int(value)


def _check_honoured(config: Optional[EARConfig]) -> None:
  """Refuses config fields a live `Memory` cannot honour, naming the field."""
  if config is None or not isinstance(config, EARConfig):
    return
  policy = policies.train_slate_policy(config.train_slate)
  if policy is not None and policy is not policies.TRAIN_SLATES["explorer"]:
    raise ValueError(
        f"config.train_slate={config.train_slate!r} is not honoured by Memory: its training "
        "slates are the Explorer rounds the agent plays (recall / retrieve(explore=True)); "
        "use train_slate='explorer'")
  if config.test_rounds is not None and config.test_rounds != config.num_rounds:
    raise ValueError(
        f"config.test_rounds={config.test_rounds} is not honoured by Memory: recall plays "
        f"num_rounds={config.num_rounds} rounds, which train as one query; set test_rounds=None "
        "or equal to num_rounds")


def _first_stage(config: EARConfig, candidates, options, multistore: bool, index: str):
  """`(config, LexicalBank or None)` of a memory's first stage (see `Memory`'s `candidates`)."""
  if not isinstance(candidates, str):
    raise InputTypeError(f"candidates must be a string, got {type(candidates).__name__}")
  first_stage.check_generator(candidates)
  if options is None:
    options = first_stage.FirstStageOptions()
  elif not isinstance(options, first_stage.FirstStageOptions):
    raise InputTypeError("first_stage_options must be a first_stage.FirstStageOptions, got "
                         f"{type(options).__name__}")
  f = lexical_bank.NUM_FEATURES
  if candidates != "dense" and not config.side_features:
    config = dataclasses.replace(config, side_features=f)
  if config.side_features not in (0, f):
    raise ValueError(f"config.side_features={config.side_features}, but a memory's first stage "
                     f"gives {f} features {first_stage.FEATURES} (or 0 with candidates='dense')")
  if not lexical_bank.needs_lexical(candidates, config.side_features):
    return config, None
  if index != "exact":
    raise ValueError(f"index={index!r} cannot serve candidates={candidates!r} (or side features): "
                     "the lexical first stage fuses every memory's cosine with its BM25 score; "
                     "use index='exact' (BENCHMARKS.md 'First stage at scale')")
  return config, lexical_bank.LexicalBank(candidates, options, multistore)

# The served parameters of a guarded memory in one compiled call (`core.guard.served_params`:
# the decision and a leafwise select), not a dozen eager dispatches on every retrieve.
_served = jax.jit(guard_lib.served_params, static_argnums=2)


class Memory:
  """An EAR memory for a live agent.

  Retrieval rule: the candidates of a query are its top-K memories by frozen cosine (Eq. (1)) among
  the DIALOGUE memories only (store 0), exactly as the benchmark pipeline and
  `docs/jsonl_format.md`; observations are never candidates unless `multistore=True`, which takes
  the top-K/2 of each store (Section 5). Then either the adapter's top-k (Section 3.6) or one
  Explorer round (Eq. (5)-(8)) with the session's bandit statistics.

  Scopes: every memory has a scope (`add(..., scope='user-42')`; `DEFAULT_SCOPE` when none is
  given) and a date. A query with `scope=` (a name, or a list of names; `retrieve`,
  `retrieve_batch`, `search`, `recall`) gets candidates of those scopes only, by the same rule
  within them; `scope=None` (the default) searches every scope. The filter runs inside the device
  search (and the faiss searchers' ID selectors, and the lexical first stage), so a memory of
  another scope is never a candidate, even when the scope holds fewer than K memories. One adapter
  and one replay buffer learn from every scope's feedback. `list(scope)` / `get(ids)` give the
  memories' records; `update(id, text=..., embedding=...)` corrects one memory (see
  `ear_jax.agent.memory.forget`).

  Training: a query's rounds are ONE training query and ONE experience (Eq. (10)-(14)). A session
  is closed and queued for the learner when it has `T` rounds of feedback, after the feedback of an
  adapter-only round (`explore=False`), or when it is closed (`close`), flushed (`flush`) or evicted
  (least recently used beyond `max_sessions`) with at least one round of feedback. Every `b` queued
  sessions -> one learner step (keys: see `ear_jax.agent.memory.driver`).

  Threads: one re-entrant lock guards every state change and read-modify-write (add, retrieve,
  feedback, discard, close, flush, the learner step, the save snapshot, restore); encoding and
  critic calls run outside it. `save` copies a consistent snapshot (arrays and metadata of one
  moment) under the lock and writes it outside, so agents are not blocked by disk I/O (saves of one
  memory are serialised by a second lock; the store's file lock serialises processes). A
  `Retrieval` carries its memory's random token and generation: feedback with another memory's
  retrieval, or with one from before `restore`, raises ValueError and changes nothing.

  Every public method validates its input first and raises ValueError (TypeError for wrong types;
  `InputTypeError` is both) naming the problem, with the state unchanged.

  Args:
    encoder: 'minilm' (default), a local Hugging Face checkpoint directory, a `.npy`/`.npz` of
      precomputed embeddings, an `ear_jax.data.encoders.Encoder`, or None (then every `add` /
      `retrieve` passes embeddings). A spec is checked now (the data layer names a missing path) and
      loaded at the first text that needs encoding.
    config: `EARConfig`; default `EARConfig(dim=encoder dim)` (or `dim=`). Its `dim` must match.
    hparams: `HParams`; default `default_hparams()`.
    seed: seed of the learner (adapter init for the low-rank option, replay randomness).
    dim: the embedding dimension when neither `config` nor the encoder gives it.
    multistore: candidates = top-K/2 dialogue memories + top-K/2 observations (Section 5).
    cache_dir: embedding cache root for `encoders.encode` (None: no disk cache).
    max_sessions: query sessions kept (>= 1); beyond it the least recently used is evicted.
    initial_capacity: initial bank capacity (rounded up by `bank.capacity_for`).
    bank_dtype: 'float32' or 'bfloat16', the dtype of the device-resident bank.
    index: how the K candidates are found: 'exact' (the streamed device search,
      `retrieval.top_k_search`) or an approximate faiss searcher, 'faiss_hnsw' / 'faiss_ivf' /
      'faiss_pq' (`ear_jax.index.ann.SEARCHERS`; measured recall in BENCHMARKS.md "Scale"). EAR
      works on the candidates the same way whichever produced them.
    index_options: keyword options of that searcher (e.g. `{'nlist': 1024, 'nprobe': 64}`).
    candidates: the first stage (`ear_jax.data.first_stage.GENERATORS`): 'dense' (the frozen
      cosine, above; the default), 'bm25' or 'hybrid' (BM25 over the memories' texts, alone or
      fused with the cosine; `ear_jax.agent.memory.lexical_bank`): the same candidates, in the same order,
      as the benchmark pipeline's generator over the same bank. With 'bm25' / 'hybrid' each
      candidate carries the first stage's scores as side features (`first_stage.FEATURES`), so
      `config.side_features` is set to 3 (a config with another nonzero value is refused), and
      queries need their texts. 'dense' with `config.side_features=3` keeps the dense candidates
      and adds the features. Not with an ANN `index`.
    first_stage_options: the hybrid fusion (`first_stage.FirstStageOptions`; default its defaults).
  """

  def __init__(self, encoder: Any = "minilm", *, method: Any = None,
               config: Optional[EARConfig] = None,
               hparams: Optional[HParams] = None, seed: int = 0, dim: Optional[int] = None,
               multistore: bool = False, cache_dir=None, max_sessions: int = 4096,
               initial_capacity: int = bank_lib.MIN_CAPACITY, bank_dtype: str = "float32",
               index: str = "exact", index_options: Optional[dict] = None,
               candidates: str = "dense",
               first_stage_options: Optional[first_stage.FirstStageOptions] = None):
    self.seed = _check_int(seed, "seed", 0)
    self.max_sessions = _check_int(max_sessions, "max_sessions", 1)
    _check_int(initial_capacity, "initial_capacity", 1)
    self._encoder = encoder if isinstance(encoder, EncoderSlot) else EncoderSlot(encoder)
    enc_dim = self._encoder.dim
    if method is not None:
      if config is not None or hparams is not None:
        raise ValueError("pass method= (a preset with its own config and hyperparameters) or "
                         "config= / hparams=, not both")
      d = dim if dim is not None else enc_dim
      if isinstance(method, str):
        if d is None:
          raise ValueError("the embedding dimension is unknown: pass dim= with method=")
        method = Method.named(method, dim=_check_int(d, "dim", 1))
      if not isinstance(method, Method):
        raise InputTypeError(f"method must be a method name or a Method, got "
                             f"{type(method).__name__}")
      config, hparams = method.config, method.hparams
    _check_honoured(config)
    if config is None:
      d = dim if dim is not None else enc_dim
      if d is None:
        raise ValueError("the embedding dimension is unknown: pass config=EARConfig(dim=...) or "
                         "dim=")
      config = EARConfig(dim=_check_int(d, "dim", 1))
    if not isinstance(config, EARConfig):
      raise InputTypeError(f"config must be an EARConfig, got {type(config).__name__}")
    if dim is not None and dim != config.dim:
      raise ValueError(f"dim={dim} does not match config.dim={config.dim}")
    if enc_dim is not None and enc_dim != config.dim:
      raise ValueError(f"config.dim={config.dim} does not match the encoder's dimension {enc_dim}")
    if multistore and config.num_candidates % 2:
      raise ValueError(f"multistore needs an even num_candidates K, got {config.num_candidates}")
    if not config.trains:
      raise ValueError("config.train_slate='none' never learns; use train_slate='explorer'")
    if hparams is not None and not isinstance(hparams, HParams):
      raise InputTypeError(f"hparams must be an HParams, got {type(hparams).__name__}")
    config, self._lexical = _first_stage(config, candidates, first_stage_options, multistore,
                                         index)
    self.config = config
    self.multistore = bool(multistore)
    self.cache_dir = None if cache_dir is None else str(cache_dir)
    self._lock = threading.RLock()
    self._save_lock = threading.Lock()
    self._critic_key = seed_keys(self.seed)[2]
    if index_options is not None and not isinstance(index_options, dict):
      raise InputTypeError(f"index_options must be a dict, got {type(index_options).__name__}")
    self._bank = bank_lib.Bank(config.dim, max(initial_capacity, config.num_candidates),
                               bank_dtype, index, index_options)
    self._sessions = Sessions(config, self.max_sessions)
    self._driver = Driver(config, default_hparams() if hparams is None else hparams, self.seed)
    self.stats = collections.Counter()
    self._holds = {}  # memory directory -> this memory's share of the process's owner lock

  # ----------------------------------------------------------------------------------------------
  # properties

  def __len__(self):
    return len(self._bank) - forget.num_deleted(self._bank)

  @property
  def capacity(self) -> int:
    """`C`, the current bank capacity (`bank.capacity_for` of the rows held)."""
    return self._bank.capacity

  @property
  def state(self) -> learner_lib.LearnerState:
    """A copy of the learner state (the live one is updated in place by every learner step: its
    arrays are donated to the step, so a reference to them would not survive it)."""
    with self._lock:
      return jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, self._driver.state))

  @property
  def params(self) -> adapter_lib.AdapterParams:
    """A copy of the adapter parameters (see `state`)."""
    with self._lock:
      return jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, self._driver.state.params))

  @property
  def hparams(self) -> HParams:
    return self._driver.hparams

  def _served_params(self) -> adapter_lib.AdapterParams:
    """The parameters test-time slates rank by (`core.guard.served_params`): the adapter's,
    or the first stage's when the guard (`EARConfig.guard`, e.g. `method="ear_safe"`) does not
    trust it yet. Exploring rounds, whose feedback trains, always use the adapter's. Call under
    the lock."""
    state = self._driver.state
    if state.guard is None:  # the guard off: the adapter's own parameters, no dispatch
      return state.params
    return _served(state.params, state.guard, self.config)  # one jitted call per retrieve

  @property
  def candidates(self) -> str:
    """The first stage: 'dense', 'bm25' or 'hybrid'."""
    return "dense" if self._lexical is None else self._lexical.candidates

  @property
  def first_stage_options(self) -> first_stage.FirstStageOptions:
    """The hybrid fusion's settings."""
    return first_stage.FirstStageOptions() if self._lexical is None else self._lexical.options

  @property
  def generation(self) -> int:
    """Bumped by `restore`: retrievals from an earlier generation are stale."""
    return self._sessions.generation

  @property
  def num_ready(self) -> int:
    """Closed sessions queued for the next learner step (fewer than `b`)."""
    return len(self._driver.ready)

  @property
  def num_pending(self) -> int:
    """Sessions with feedback not yet trained: queued ones plus open ones with >= 1 round."""
    with self._lock:
      return self.num_ready + sum(1 for s in self._sessions.by_id.values()
                                  if not s.closed and s.rounds)

  @property
  def ids(self) -> list[str]:
    with self._lock:
      return forget.live_ids(self._bank)

  @property
  def encoder(self):
    """The encoder (loaded now if it was given as a spec)."""
    return self._encoder.get(self.config.dim)

  def embeddings(self) -> np.ndarray:
    """`[n, d]` the bank's frozen (pre-adapter) unit embeddings."""
    with self._lock:
      return self._bank.embeddings()

  def _embed(self, texts: Optional[list[str]], embeddings, n: Optional[int], what: str):
    """Checked `[n, d]` embeddings, given or encoded (outside the state lock)."""
    if embeddings is not None:
      return bank_lib.check_embeddings(embeddings, n, self.config.dim, f"{what} embeddings")
    return self._encoder.embed(texts, self.config.dim, self.cache_dir, what)

  # ----------------------------------------------------------------------------------------------
  # add and retrieve

  def add(self, texts, *, store="dialogue", ids=None, embeddings=None, scope=None,
          dates=None) -> list[str]:
    """Appends memories to the bank (batched encoding; capacity grows when full).

    Args:
      texts: one string, or a sequence (list, tuple) of non-empty strings (a dict, a set or bytes
        is a TypeError).
      store: 'dialogue' (episodic, 0) or 'observation' (semantic, 1), or one per text.
      ids: `n` unique string ids not yet in the bank; default `"m<row>"`, or the next free
        `"m<j>"` (j > row) where an explicit id already took it.
      embeddings: optional `[n, d]` precomputed real embeddings, one row per text (finite,
        non-zero, any magnitude; normalised here without overflow; complex, boolean, string or
        object arrays are refused).
      scope: the scope of these memories: a non-empty string (e.g. 'user-42'), or None for
        `DEFAULT_SCOPE`.
      dates: one date per text (free text, e.g. "1:56 pm on 8 May, 2023", or ISO 8601); None: the
        UTC time of this call, ISO 8601.

    Returns:
      The ids of the added memories.
    """
    texts = bank_lib.check_text_list(texts, "texts")
    n = len(texts)
    codes = bank_lib.store_codes(store, n)
    scope = bank_lib.check_scope(scope)
    dates = bank_lib.check_dates(dates, n)
    if ids is not None:
      ids = bank_lib.check_id_list(ids, n)
      with self._lock:
        self._bank.check_new_ids(ids)
    emb = self._embed(texts, embeddings, n, "memory")
    tokens = None if self._lexical is None else lexical_bank.tokenize(texts)
    with self._lock:  # re-checked: another thread may have added since
      if ids is None:
        ids = self._bank.default_ids(n)
      self._bank.check_new_ids(ids)
      start = len(self._bank)
      if self._lexical is not None:
        self._lexical.sync(self._bank)  # (a no-op unless a restore left it behind)
      self._bank.append(ids, texts, codes, emb, [scope] * n, dates)
      if self._lexical is not None:
        self._lexical.append(tokens, codes, start)
      self.stats["memories_added"] += n
      return list(ids)

  def _check_k(self, k) -> int:
    k = _check_int(k, "k", 1)
    if k > self.config.num_candidates:
      raise ValueError(f"k={k} is larger than num_candidates K={self.config.num_candidates}")
    return k

  def retrieve(self, query: Optional[str] = None, k: int = 5, explore: bool = False, *,
               continue_from: Optional[Retrieval] = None, query_embedding=None,
               scope=None) -> Retrieval:
    """Retrieves `k` memories for one query (see `retrieve_batch`)."""
    queries, emb = self._one_query(query, query_embedding)
    if continue_from is not None:
      if query is not None or emb is not None:
        raise ValueError("pass either a query / query_embedding or continue_from, not both")
      return self.retrieve_batch(None, k, explore, continue_from=[continue_from])[0]
    return self.retrieve_batch(queries, k, explore, query_embeddings=emb, scope=scope)[0]

  def _one_query(self, query, query_embedding):
    """`(queries [1] or None, query_embeddings [1, d] or None)` of `retrieve`'s one query."""
    if query is not None and not isinstance(query, str):
      raise InputTypeError(f"query must be a string, got {type(query).__name__}")
    emb = None
    if query_embedding is not None:
      emb = bank_lib.real_query_vector(query_embedding, self.config.dim)[None]
    return (None if query is None else [query]), emb

  def retrieve_batch(self, queries: Optional[Sequence[str]] = None, k: int = 5,
                     explore: bool = False, *, continue_from: Optional[Sequence[Retrieval]] = None,
                     query_embeddings=None, scope=None) -> list[Retrieval]:
    """Retrieves `k` memories for each of `n` queries in one batched call.

    Each query gets its candidates (see the class docstring), then the adapter-only top-k of `z`
    (`explore=False`) or one Explorer round (`explore=True`). Each retrieval opens a session (or
    plays the next round of one) and takes one `feedback`.

    Args:
      queries: `n` non-empty query texts (encoded in one batch); may be None when
        `query_embeddings` or `continue_from` is given.
      k: memories per query, `1 <= k <= K` and at most the candidates available.
      explore: one Explorer round instead of adapter-only top-k.
      continue_from: `n` earlier retrievals of open sessions whose feedback was given (or that
        were discarded): play their next round (same query and candidates, bandit statistics kept;
        at most T rounds).
      query_embeddings: optional `[n, d]` precomputed query embeddings.
      scope: the scopes every query's candidates come from: None (every scope), a scope name, or
        a list / tuple of names (an unknown name holds no memories). Ignored with
        `continue_from` (a session keeps its candidates).

    Returns:
      `n` `Retrieval`s.
    """
    k = self._check_k(k)
    explore = bool(explore)
    scope = bank_lib.check_scope_spec(scope)
    if continue_from is not None:
      if queries is not None or query_embeddings is not None:
        raise ValueError("pass either queries / query_embeddings or continue_from, not both")
      prev = list(continue_from)
      if not prev:
        raise ValueError("continue_from is empty")
      with self._lock:
        sids = [self._sessions.continuable_session(r, k) for r in prev]
        if len(set(sids)) != len(sids):
          raise ValueError("a session appears twice in continue_from")
        ss = [self._sessions.by_id[sid] for sid in sids]
        stack = lambda f: np.stack([getattr(s, f) for s in ss])
        params = self._driver.state.params if explore else self._served_params()
        slates = round_slates(params, self.hparams, stack("query_emb"),
                              stack("cand_emb"), stack("cand_mask"), stack("mean"),
                              stack("counts"), k, explore)
        return self._open_rounds(sids, slates, explore)
    texts, q_emb = self._queries(queries, query_embeddings)
    return self._retrieve(texts, q_emb, k, explore, scope)

  def _queries(self, queries, query_embeddings) -> tuple[list[str], np.ndarray]:
    """`(texts [n] ('' where none), [n, d] unit embeddings)` of `retrieve_batch`'s queries,
    checked and encoded (outside the lock)."""
    if queries is None and query_embeddings is None:
      raise ValueError("pass queries (texts) or query_embeddings")
    texts = None if queries is None else bank_lib.check_text_list(queries, "queries")
    q_emb = self._embed(texts, query_embeddings, None if texts is None else len(texts), "query")
    texts = texts if texts is not None else [""] * q_emb.shape[0]
    if not texts:
      raise ValueError("query_embeddings is empty: pass at least one query")
    if len(texts) > self.max_sessions:
      raise ValueError(f"{len(texts)} queries in one call exceed max_sessions={self.max_sessions}")
    if self._lexical is not None and not any(texts):
      raise ValueError(f"candidates={self.candidates!r} ranks by the query's text (BM25): pass "
                       "queries (texts), with query_embeddings or without")
    return texts, q_emb

  def _retrieve(self, texts: list[str], q_emb: np.ndarray, k: int, explore: bool,
                scope, test_time: bool = False) -> list[Retrieval]:
    """The retrievals of `_queries` (checked `k` and scope spec), opened in one hold of the lock
    (re-entrant: `recall.search` holds it around this and the close that follows, so a delete in
    another thread cannot drop the session in between). Adapter-only slates, and exploring ones
    at `test_time` (`recall(learn=False)`), rank by `_served_params`; training rounds by the
    adapter's."""
    with self._lock:
      self._bank.check_k(k, self.config.num_candidates, self.multistore, scope)
      train = explore and not test_time
      params = self._driver.state.params if train else self._served_params()
      slate = (params, self.hparams, k, explore)
      if self._lexical is None:
        rows, mask, cands, slates = self._bank.search(q_emb, self.config.num_candidates,
                                                      self.multistore, slate=slate, scope=scope)
      else:
        rows, mask, cands, slates = self._lexical.search(self._bank, q_emb, texts,
                                                         self.config.num_candidates, slate, scope)
      short = np.flatnonzero(slates[1].sum(1) < k)
      if len(short):  # (check_k passed: every first stage finds min(K, rows of the scopes))
        where = "the bank" if scope is None else bank_lib.scope_label(scope)
        raise RuntimeError(
            f"the {self._bank.index_name} / {self.candidates} search found only "
            f"{int(slates[1][short[0]].sum())} of k={k} memories of {where} for query "
            f"{int(short[0])}, which holds enough: a bug, please report it")
      sids = [self._sessions.new(t, q, r, c, m, scope or ())
              for t, q, r, c, m in zip(texts, q_emb, rows, cands, mask)]
      return self._open_rounds(sids, slates, explore)

  def _open_rounds(self, sids: list[int], slates, explore: bool) -> list[Retrieval]:
    """Opens the retrievals of computed slates `(slate [n, k], mask [n, k], z [n, K])`, then evicts
    beyond `max_sessions` (which may train)."""
    slate, slate_mask, z = slates
    out = []
    for i, sid in enumerate(sids):
      rid = self._sessions.open_round(sid, slate[i][slate_mask[i]], explore)
      out.append(self._sessions.retrieval(sid, rid, z[i], self._bank.describe))
    self.stats["retrievals"] += len(sids)
    self._learn(self._sessions.evict())
    return out

  # ----------------------------------------------------------------------------------------------
  # feedback

  def _labels_for(self, retrieval, cited_ids) -> tuple[int, np.ndarray]:
    sid = self._sessions.resolve_open(retrieval)
    s = self._sessions.by_id[sid]
    shown = list(self._bank.describe(s.cand_idx[s.open_slate])[0])
    return sid, citation_labels(shown, cited_ids, s.open_id)

  def _learn(self, items) -> int:
    steps = self._driver.push(items)
    self.stats["learner_steps"] += steps
    self.stats["queries_queued"] += len(items)
    return steps

  def _apply(self, sid: int, labels: np.ndarray) -> int:
    item = self._sessions.record(sid, labels)
    self.stats["feedback"] += 1
    self.stats["cited"] += int((labels > 0).sum())
    return self._learn([] if item is None else [item])

  def feedback(self, retrieval, cited_ids: Iterable[str] = (), *,
               answer: Optional[str] = None) -> bool:
    """Applies an agent's feedback to a retrieval's slate: labels +1 for the memories it used,
    -1 for the others shown.

    The used memories are the cited ids, and, with `answer` (the agent's answer to the
    retrieval's question), those the answer draws on by the answer rule (issue 28; the rule and
    thresholds of `ear_jax.core.critic.AnswerCritic`, `ANSWER_DEFAULTS`, chosen on LoCoMo
    validation: `episode.answer_labels`); with both, their union. The answer and "question
    answer" are embedded by this memory's encoder outside the lock (a memory without an encoder
    cannot: ValueError, nothing changed), so the retrieval needs its question's text. Updates
    the session's bandit statistics (Eq. (9)); a session that this closes (see the class
    docstring) is queued, and every `b` queued sessions make one learner step.

    Args:
      retrieval: an open `Retrieval` of this memory (or its `retrieval_id`).
      cited_ids: ids of the memories of that slate the agent cited (possibly none).
      answer: optional non-empty string, the agent's answer.

    Returns:
      True when this call triggered a learner step.
    """
    if answer is None:
      with self._lock:
        sid, labels = self._labels_for(retrieval, cited_ids)
        return self._apply(sid, labels) > 0
    answer = episode.check_answer(answer)
    with self._lock:  # checked (ids, open retrieval, question) before encoding
      sid, _ = self._labels_for(retrieval, cited_ids)
      s = self._sessions.by_id[sid]
      if not s.query:
        raise ValueError(f"retrieval {s.open_id} has no question text: feedback from an answer "
                         "compares it with the question (retrieve with the question's text)")
      question, texts = s.query, list(self._bank.describe(s.cand_idx[s.open_slate])[1])
      memories = s.cand_emb[s.open_slate, :self.config.dim].copy()
    used = episode.answer_labels(question, answer, texts, memories, self._embed_answer)
    with self._lock:  # (still open: another call may have consumed it, a delete dropped it)
      sid, cited = self._labels_for(retrieval, cited_ids)
      self.stats["answer_feedback"] += 1
      return self._apply(sid, np.maximum(cited, used)) > 0

  def _embed_answer(self, texts: list[str]) -> np.ndarray:
    """`[n, d]` embeddings of an answer's texts by this memory's encoder (outside the lock)."""
    if self._encoder.get(self.config.dim) is None:
      raise ValueError("this memory has no encoder, so it cannot embed an answer: feedback from "
                       "an answer needs the memories' encoder (build the Memory with one); give "
                       "cited ids instead")
    return self._embed(texts, None, len(texts), "the answer's")

  def feedback_batch(self, retrievals: Sequence[Any], cited_ids: Sequence[Iterable[str]]) -> int:
    """`feedback` for many retrievals; all are validated before any is applied.

    Returns:
      The number of learner steps taken.
    """
    retrievals, cited_ids = list(retrievals), list(cited_ids)
    if len(retrievals) != len(cited_ids):
      raise ValueError(f"{len(retrievals)} retrievals but {len(cited_ids)} citation lists")
    with self._lock:
      checked = []
      for i, (r, c) in enumerate(zip(retrievals, cited_ids)):
        try:
          checked.append(self._labels_for(r, c))
        except ValueError as e:
          raise type(e)(f"feedback_batch item {i}: {e}") from None
      sids = [sid for sid, _ in checked]
      if len(set(sids)) != len(sids):
        raise ValueError("a retrieval appears twice in feedback_batch")
      return sum(self._apply(sid, labels) for sid, labels in checked)

  def discard(self, retrieval) -> None:
    """Closes a retrieval without feedback (no update); its session can still be continued."""
    with self._lock:
      self._sessions.discard(self._sessions.resolve_open(retrieval))
      self.stats["discarded"] += 1

  def close(self, retrieval) -> bool:
    """Ends a retrieval's session: an open retrieval is discarded, and a session with feedback is
    queued for the learner (its rounds so far are one training query).

    Returns:
      True when this triggered a learner step.
    """
    with self._lock:
      if isinstance(retrieval, Retrieval):
        self._sessions.check_identity(retrieval)
        sid = retrieval.session_id
        if sid not in self._sessions.by_id:  # (evicted, or dropped by a delete: it says which)
          raise self._sessions.dropped_error(retrieval.retrieval_id, sid)
      else:
        sid = self._sessions.resolve_open(retrieval)
      item = self._sessions.close(sid)
      return self._learn([] if item is None else [item]) > 0

  def flush(self) -> bool:
    """Closes every session with feedback and no open retrieval, then trains everything queued
    (the last batch padded and masked).

    Returns:
      True when a learner step was taken.
    """
    with self._lock:
      steps = self._learn(self._sessions.flush())
      padded = self._driver.flush()
      self.stats["learner_steps"] += padded
      return steps + padded > 0

  def recall(self, question: str, critic, k: int = 5, *,
             query_embedding=None, learn: bool = True, scope=None) -> recall_lib.Recall:
    """One call per question: T Explorer rounds with `critic`, recorded as ONE training query
    (Eq. (11)-(14)), and the final slate `config.final_slate` names (round T's, or the top-k by
    bandit mean for `ear_tuned`). See `ear_jax.agent.memory.recall.recall`.

    Args:
      question: the question's text.
      critic: `critic(key, view) -> labels [k]` or None (e.g. `LLMCritic`), or
        `AnswerFeedback(answer_fn)`: the agent answers each round's slate and its answer labels
        it by the answer rule (this memory's encoder embeds the answer).
      k: memories per slate and in the answer.
      query_embedding: optional `[d]` precomputed embedding of the question.
      learn: False: the same rounds with the adapter frozen and no training query (explorer-
        assisted inference on a test question, as `ear_jax.core.inference.evaluate`).
      scope: the scopes the candidates come from (None: every scope; see `retrieve_batch`).
    """
    return recall_lib.recall(self, question, critic, k, query_embedding=query_embedding,
                             learn=learn, scope=scope)

  def search(self, question: Optional[str] = None, k: int = 5, *, query_embedding=None,
             scope=None) -> Retrieval:
    """The adapter-only slate of a question: no critic, no learning (`scope`: see
    `retrieve_batch`)."""
    return recall_lib.search(self, question, k, query_embedding=query_embedding, scope=scope)

  def feedback_from_critic(self, retrieval, critic) -> Optional[np.ndarray]:
    """Shows a retrieval's slate to a host critic and applies its labels.

    The critic follows the library's protocol `critic(key, view) -> labels [k]` or None (e.g.
    `LLMCritic`, or `AnswerFeedback`, the agent's answers, whose answer this memory's encoder
    embeds); the view carries `query_text`, `texts` and `ids`. It is called outside the lock
    with the key `jax.random.fold_in(k_critic, retrieval_id)` (see `ear_jax.agent.memory.driver`).
    None (an unusable reply) discards the retrieval with NO update, counted in
    `stats['critic_no_update']`.

    Returns:
      The labels, or None.
    """
    with self._lock:
      sid = self._sessions.resolve_open(retrieval)
      s = self._sessions.by_id[sid]
      if not s.query:
        raise ValueError(f"retrieval {s.open_id} has no query text to show the critic")
      k = len(s.open_slate)
      ids, texts, _ = self._bank.describe(s.cand_idx[s.open_slate])
      view = critic_lib.SlateView(
          query=s.query_emb, slate=s.open_slate.copy(), slate_mask=np.ones(k, bool),
          memories=s.cand_emb[s.open_slate, :self.config.dim], gold=np.zeros(k, bool),
          query_text=s.query, texts=list(texts), ids=list(ids))
      key = jax.random.fold_in(self._critic_key, s.open_id)
    labels = self._bound(critic)(key, view)
    if labels is not None:
      labels = episode.check_labels(labels, k, "the critic")  # ValueError: the retrieval stays open
    with self._lock:
      if labels is None:
        self.discard(retrieval)
        self.stats["critic_no_update"] += 1
      else:
        self.feedback(retrieval, [i for i, y in zip(ids, labels) if y > 0])
      self.stats["critic_calls"] += 1
    return labels

  def _bound(self, critic):
    """`critic`, or an `AnswerFeedback` without an encoder bound to this memory's."""
    return critic.bound(self._embed_answer) if isinstance(critic, AnswerFeedback) else critic

  # ----------------------------------------------------------------------------------------------
  # forgetting (`ear_jax.agent.memory.forget`)

  def delete(self, ids) -> list[str]:
    """Deletes memories everywhere: never a candidate again (exact, ANN and lexical search), open
    sessions that had one as a candidate are dropped untrained, queued items and the replay buffer
    mask it out, and the next `save` leaves no file holding its text or embedding (see
    `ear_jax.agent.memory.forget`). All ids are checked first (an unknown one: ValueError, nothing
    changed), then all are deleted under the lock.

    Args:
      ids: one memory id or a list of distinct ids.

    Returns:
      The deleted ids.
    """
    ids = forget.check_ids(ids)
    with self._lock:
      self._forget(forget.rows_of(self._bank, ids))
    return ids

  def _forget(self, rows: np.ndarray) -> None:
    """`forget.forget_rows` of this memory's parts (call under the lock)."""
    forget.forget_rows(self._bank, self._sessions, self._driver, rows, self.stats)
    if self._lexical is not None:  # rebuilt from the bank's texts at the next search
      self._lexical = self._lexical.fresh()

  def get(self, ids) -> list[dict]:
    """`[{'id', 'text', 'store', 'scope', 'date'}]` of memory ids, in order (ValueError for an
    unknown id)."""
    ids = forget.check_ids(ids)
    with self._lock:
      return forget.records(self._bank, ids)

  def update(self, memory_id: str, *, text: Optional[str] = None, embedding=None) -> str:
    """Corrects one memory: the old row is deleted everywhere (as `delete`) and a new one with the
    same id, store, scope and date appended, atomically under the lock. `text` None keeps the
    text; `embedding` None encodes the new text (outside the lock); both None is a ValueError, as
    is an unknown id (naming it).

    Returns:
      The id.
    """
    memory_id, text, emb = forget.check_update(memory_id, text, embedding, self.config.dim)
    with self._lock:
      forget.rows_of(self._bank, [memory_id], "memory_id")  # an unknown id: before encoding
    if emb is None:
      emb = self._embed([text], None, 1, "the updated memory's")
    with self._lock:  # (the id is checked again: another call may have deleted it meanwhile)
      forget.replace_row(self._bank, self._sessions, self._driver, memory_id, text, emb,
                         self.stats)
      if self._lexical is not None:  # rebuilt from the bank's texts at the next search
        self._lexical = self._lexical.fresh()
    return memory_id

  def list(self, scope=None) -> list[dict]:
    """The live memories (`get`'s records) of the scopes `scope` names (None: every scope; a
    name; a list of names), in bank order (an updated memory where its update put it)."""
    names = bank_lib.check_scope_spec(scope)
    with self._lock:
      return forget.list_records(self._bank, names)

  # ----------------------------------------------------------------------------------------------
  # persistence (`ear_jax.agent.memory.persistence`)

  def save(self, path) -> pathlib.Path:
    """Writes a consistent snapshot of this moment as the next checkpoint step at `path` (the
    snapshot is copied under the lock, written outside it, so agents are not blocked by disk
    I/O; saves of one memory are serialised, and processes by the store's writer lock); returns
    the step's directory. Holds the directory from then on (`claim`).

    Raises:
      DirectoryInUseError: another process holds `path` (naming it and that process's pid).
    """
    with self._save_lock:
      self._hold(path, create=True)
      with persistence.Writer(path) as writer:
        with self._lock:
          snap = writer.snapshot(self._parts())
        return writer.write(snap)

  def claim(self, path) -> pathlib.Path:
    """Takes the memory directory `path` (creating it) for this process now, as `load`,
    `restore` and the first `save` to it do: until `release` (or this memory is garbage-collected,
    or the process ends, even by SIGKILL) another process that loads, restores or saves it is
    refused with a `checkpoints.DirectoryInUseError` naming the directory and this process's pid,
    so two processes (two MCP servers on one `--memory_dir`) never hand out one id for two
    memories nor overwrite each other's checkpoints. Within one process the lock is shared: other
    `Memory` instances of this process may load and save the directory (their saves are
    serialised by the store's writer lock; which of them a later load sees is the caller's
    business), and a directory released by all of them is claimed again by the next call.

    Returns:
      The directory.
    """
    self._hold(path, create=True)
    return persistence.checkpoint_dir(path)

  def release(self) -> None:
    """Gives back this memory's hold on every directory it loaded, restored, saved or claimed
    (another process can open them once no other `Memory` of this process holds them); a later
    `save` takes its directory again. Idempotent."""
    with self._lock:
      holds, self._holds = list(self._holds.values()), {}
    for h in holds:
      h.release()

  def _hold(self, path, *, create: bool):
    """This memory's hold on the directory `path` (`persistence.own`), taken when it has none;
    returns the hold it took (None when it already held it, or there is nothing to hold)."""
    root = persistence.checkpoint_dir(path)
    with self._lock:
      if str(root) in self._holds:
        return None
      hold = persistence.own(root, create=create)
      if hold is not None:
        self._holds[str(root)] = hold
      return hold

  @classmethod
  def load(cls, path, *, encoder: Any = "saved", config: Optional[EARConfig] = None) -> "Memory":
    """A new memory (a new identity) from the latest checkpoint at `path`.

    Args:
      path: the checkpoint directory given to `save`.
      encoder: 'saved' (the saved spec, loaded lazily and checked against the saved model
        identity), an `Encoder` / spec to use instead (dimension and identity must match), or None.
      config: optional expected `EARConfig`; a different one is an error listing the fields.

    Raises:
      ValueError: no checkpoint at `path`, another format, config, encoder dimension or model.
      CheckpointError: a truncated or corrupted checkpoint (naming its path); a
        `CheckpointFormatError` for an unknown format, layout, dtype or index (naming the file and
        the field); a `DirectoryInUseError` (also a ValueError) when another process holds `path`
        (naming it and that process's pid). The loaded memory holds `path` (`claim`).
    """
    hold = persistence.own(path, create=False)  # (DirectoryInUseError: another process has it)
    try:
      ckpt = persistence.read(path)
      memory = cls(**persistence.memory_args(ckpt, encoder=encoder, config=config))
      memory._install(persistence.restore_parts(ckpt, memory._bank.settings(), memory.config,
                                                memory._sessions.token, generation=0))
    except BaseException:
      if hold is not None:
        hold.release()
      raise
    if hold is not None:
      memory._holds[str(ckpt.root)] = hold
    persistence.tidy(ckpt.root)  # what a killed save left (after the checkpoint was verified)
    return memory

  def restore(self, path) -> None:
    """Replaces this memory's state by the latest checkpoint at `path`, in place (its config and
    first stage must equal this memory's, its encoder identity too when both are known), and
    bumps the generation: retrievals returned before are stale. Holds the directory from then
    on (`claim`; `DirectoryInUseError` when another process holds it)."""
    taken = self._hold(path, create=False)
    try:
      ckpt = persistence.read(path)
      persistence.check_restorable(ckpt, self.config, self.candidates, self.first_stage_options,
                                   self._encoder.identity)
      with self._lock:
        self._install(persistence.restore_parts(ckpt, self._bank.settings(), self.config,
                                                self._sessions.token, self.generation + 1))
    except BaseException:
      if taken is not None:
        with self._lock:
          self._holds.pop(str(persistence.checkpoint_dir(path)), None)
        taken.release()
      raise
    persistence.tidy(ckpt.root)  # what a killed save left (after the checkpoint was verified)

  def _parts(self) -> persistence.Parts:
    """This memory's parts and settings, what a checkpoint holds (call under the lock)."""
    settings = dict(config=self.config.to_dict(), seed=self.seed, multistore=self.multistore,
                    max_sessions=self.max_sessions, cache_dir=self.cache_dir,
                    stats=dict(self.stats), encoder=self._encoder.meta(self.config.dim),
                    # its lexical index is rebuilt from the bank's verified texts on load
                    first_stage=lexical_bank.options_meta(self.candidates,
                                                          self.first_stage_options))
    return persistence.Parts(bank=self._bank, sessions=self._sessions, driver=self._driver,
                             settings=settings)

  def _install(self, parts: persistence.Parts) -> None:
    """Replaces this memory's parts, settings and stats by a checkpoint's (call under the lock)."""
    self._bank, self._sessions, self._driver = parts.bank, parts.sessions, parts.driver
    if self._lexical is not None:  # rebuilt from the restored bank's texts at the next search
      self._lexical = self._lexical.fresh()
    settings = parts.settings
    self.seed, self.multistore = int(settings["seed"]), bool(settings["multistore"])
    self.max_sessions, self.cache_dir = int(settings["max_sessions"]), settings["cache_dir"]
    self._critic_key = seed_keys(self.seed)[2]
    self.stats = collections.Counter(settings["stats"])


def llm_feedback(memory: Memory, critic, query: str, k: int = 5, explore: bool = True, *,
                 query_embedding=None) -> tuple[Retrieval, Any]:
  """One agent step with a host critic: `retrieve` -> `critic(key, view)` -> `feedback`.

  An unusable reply (labels None) closes the retrieval with no update (counted in
  `memory.stats['critic_no_update']` and in the critic's own `stats`); the loop never crashes on it.

  Returns:
    `(retrieval, labels)`: labels `[k]` float32 in {-1, +1}, or None.
  """
  r = memory.retrieve(query, k=k, explore=explore, query_embedding=query_embedding)
  return r, memory.feedback_from_critic(r, critic)
