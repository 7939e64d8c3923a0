"""`Memory`: the stateful front of EAR for a live agent (add, retrieve, learn from citations, persist).

Symbols: `n` memories in the bank, `C` bank capacity (a power of two >= n), `d` dimension, `K`
candidates per query (`config.num_candidates`), `k` memories shown to the LLM (`k <= K`), `T`
Explorer rounds per query (`config.num_rounds`), `b` batch size (`config.batch_size`).

The functional core (adapter, Explorer, learner) stays pure; `Memory` only holds its state on the
host and calls the jitted functions:

* `add(texts, store=..., ids=...)` encodes the texts with the frozen encoder (batched, optionally with
  the on-disk embedding cache) or takes precomputed `embeddings=`, and appends them to a growable bank.
  The bank is a `[C, d]` array plus a `[C]` validity mask; `C` doubles when full, so the jitted
  candidate search compiles once per capacity, i.e. O(log n) times.
* `retrieve(query, k=5, explore=False)`: the top-K memories of the bank by frozen cosine (Eq. (1);
  with `multistore=True` the top-K/2 of each store, Section 5), then either the adapter-only top-k of
  the adapted logits `z` (Section 3.6) or ONE Explorer round (Eq. (5)-(8)) with the query's bandit
  statistics. A retrieval opens a *query session* that holds the candidates, the bandit statistics and
  the rounds played so far; `retrieve(continue_from=r)` plays the next round of the same session (at
  most T rounds, Alg. 2), so repeated feedback on one query keeps exploring.
* `feedback(retrieval, cited_ids)`: cited memories get label +1, the other shown memories -1
  (Appendix A.2's citation critic, for real); the bandit statistics are updated (Eq. (9)) and the
  session becomes *pending*. When `b` sessions are pending, ONE learner step runs on them
  (`learner.train_batch_on_feedback_jit`: current loss Eq. (10) over the session's rounds, replay loss
  Eq. (16), one optax step, then the experiences Eq. (13)-(14) are pushed). A session that receives
  more rounds while still pending is merged (its rounds form one query of the batch, exactly as the
  T rounds of Alg. 1); rounds played after it was trained form a new pending query.
* `save(path)` / `Memory.load(path)`: bank, embeddings, learner state, hyperparameters, open and
  pending sessions, counters and config, with Orbax. Atomic: a new checkpoint is written into a
  temporary directory, renamed to `ckpt-<N>`, and only then is the `LATEST` pointer file replaced
  (`os.replace`); a save killed at any moment leaves the previous checkpoint loadable.
* Every public method validates its input first and raises `ValueError` naming the problem with the
  state unchanged (the checks run before any mutation).

Determinism: the learner's keys are `fold_in(PRNGKey(seed), batch_number)`; the same calls with the
same seed give the same retrievals and parameters.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import adapter as adapter_lib
from ear_jax.core import explorer as explorer_lib
from ear_jax.core import learner as learner_lib
from ear_jax.core.config import EARConfig, HParams, default_hparams
from ear_jax.core.stream import Stream

STORES = {"dialogue": 0, "episodic": 0, "observation": 1, "semantic": 1}
STORE_NAMES = ("dialogue", "observation")
CHECKPOINT_FORMAT = "ear_jax.agent.memory/1"
_LATEST = "LATEST"
_META = "meta.json"
_ARRAYS = "arrays"
_MIN_CAPACITY = 32


@dataclasses.dataclass(frozen=True)
class Retrieval:
  """What `Memory.retrieve` returns: `k` memories, best first (adapter-only) or in slate order.

  Attributes:
    retrieval_id: unique id of this retrieval within its `Memory` (pass it, or this object, to
      `feedback`).
    session_id: the query session (all rounds of one query share it).
    round: 1-based Explorer round of the session this slate belongs to.
    query: the query text ('' when only an embedding was given).
    ids: `[k]` memory ids.
    texts: `[k]` memory texts.
    stores: `[k]` store names ('dialogue' | 'observation').
    scores: `[k]` adapted relevance logits `z` (Eq. (4)); the frozen cosine while the adapter is
      the identity.
    explore: True for an Explorer round (Eq. (8)), False for adapter-only top-k.
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

  def __len__(self):
    return len(self.ids)


@dataclasses.dataclass
class _Session:
  """One query's candidates, bandit statistics and rounds (host numpy arrays)."""
  query: str
  query_emb: np.ndarray  # [d] float32
  cand_idx: np.ndarray  # [K] int32 bank rows, -1 = padding
  cand_emb: np.ndarray  # [K, d] float32
  cand_mask: np.ndarray  # [K] bool
  mean: np.ndarray  # [K] float32 bandit mean, Eq. (9)
  counts: np.ndarray  # [K] float32 bandit counts
  slates: np.ndarray  # [T, K] int32 candidate positions of each round's slate, -1 = empty
  slate_mask: np.ndarray  # [T, K] bool
  labels: np.ndarray  # [T, K] float32
  rounds: int = 0  # rounds with feedback
  trained: int = 0  # rounds already used by a learner step
  open_id: int = -1  # retrieval awaiting feedback, -1 = none
  open_slate: Optional[np.ndarray] = None  # [k] int32 candidate positions of the open retrieval
  open_explore: bool = False
  consumed: list = dataclasses.field(default_factory=list)  # retrieval ids with feedback given
  last_used: int = 0


# ------------------------------------------------------------------------------------------------
# jitted kernels


@functools.partial(jax.jit, static_argnames=("num_candidates", "multistore"))
def _bank_candidates(queries, bank, valid, stores, *, num_candidates, multistore):
  """Top-K bank rows by cosine for `[n, d]` queries against a `[C, d]` bank (Eq. (1)).

  Returns `(index [n, K] int32 (-1 = padding), mask [n, K] bool)` in decreasing score order; with
  `multistore` the top-K/2 of each store, merged by score.
  """
  scores = queries @ bank.T  # [n, C]
  if not multistore:
    vals, idx = jax.lax.top_k(jnp.where(valid[None, :], scores, -jnp.inf), num_candidates)
  else:
    half = num_candidates // 2
    parts = [jax.lax.top_k(jnp.where((valid & (stores == s))[None, :], scores, -jnp.inf), half)
             for s in (0, 1)]
    vals = jnp.concatenate([p[0] for p in parts], 1)
    idx = jnp.concatenate([p[1] for p in parts], 1)
    vals, order = jax.lax.top_k(vals, num_candidates)
    idx = jnp.take_along_axis(idx, order, 1)
  mask = vals > -jnp.inf
  return jnp.where(mask, idx, -1).astype(jnp.int32), mask


@functools.partial(jax.jit, static_argnames=("k", "explore"))
def _slates(params, queries, candidates, mask, mean, counts, hparams, *, k, explore):
  """Adapter-only top-k (Section 3.6) or one Explorer round (Eq. (5)-(8)) for `n` queries.

  Returns `(slate [n, k] int32, slate_mask [n, k] bool, z [n, K])`.
  """
  def one(q, c, where, mu, cnt):
    q_t = adapter_lib.adapt_queries(params, q)
    m_t = adapter_lib.adapt_memories(params, c)
    z = adapter_lib.relevance_logits(q_t, m_t)
    if explore:
      ucb = explorer_lib.ucb_scores(explorer_lib.BanditStats(mean=mu, counts=cnt), hparams.alpha)
      slate, slate_mask = explorer_lib.greedy_slate(z, ucb, m_t @ m_t.T, where, hparams, k)
    else:
      slate, slate_mask = explorer_lib.top_s_slate(z, where, k)
    return slate, slate_mask, z

  return jax.vmap(one)(queries, candidates, mask, mean, counts)


_update_bandit = jax.jit(explorer_lib.update_bandit)


def _pow2_at_least(n: int, minimum: int = 1) -> int:
  n = max(n, minimum, 1)
  return 1 << (n - 1).bit_length()


# ------------------------------------------------------------------------------------------------
# validation helpers


def _as_text_list(texts, what: str) -> list[str]:
  if isinstance(texts, str):
    texts = [texts]
  try:
    texts = list(texts)
  except TypeError:
    raise ValueError(f"{what} must be a string or a sequence of strings, got "
                     f"{type(texts).__name__}") from None
  if not texts:
    raise ValueError(f"{what} is empty: pass at least one text")
  for i, t in enumerate(texts):
    if not isinstance(t, str):
      raise ValueError(f"{what}[{i}] must be a string, got {type(t).__name__}")
    if not t.strip():
      raise ValueError(f"{what}[{i}] is an empty text")
  return texts


def _check_embeddings(emb, n: Optional[int], dim: int, what: str) -> np.ndarray:
  try:
    arr = np.asarray(emb, np.float32)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{what} must be a float array: {e}") from None
  if arr.ndim != 2 or arr.shape[1] != dim or (n is not None and arr.shape[0] != n):
    want = f"[{n if n is not None else 'n'}, {dim}]"
    raise ValueError(f"{what} has shape {arr.shape}, expected {want} (wrong dimension: this "
                     f"memory's encoder dimension is d={dim})")
  bad = ~np.all(np.isfinite(arr), axis=1)
  if bad.any():
    raise ValueError(f"{what} contains non-finite values (NaN or Inf) in row(s) "
                     f"{np.nonzero(bad)[0][:10].tolist()}")
  norm = np.linalg.norm(arr, axis=1, keepdims=True)
  if (norm[:, 0] <= 1e-12).any():
    raise ValueError(f"{what} contains all-zero row(s) {np.nonzero(norm[:, 0] <= 1e-12)[0][:10].tolist()}"
                     ": an embedding must have a direction")
  return (arr / norm).astype(np.float32)


def _store_codes(store, n: int) -> np.ndarray:
  def code(s):
    if isinstance(s, (int, np.integer)) and not isinstance(s, bool) and int(s) in (0, 1):
      return int(s)
    if isinstance(s, str) and s in STORES:
      return STORES[s]
    raise ValueError(f"unknown store {s!r}; expected one of {sorted(STORES)} or 0/1")

  if isinstance(store, (str, int, np.integer)):
    return np.full(n, code(store), np.int8)
  store = list(store)
  if len(store) != n:
    raise ValueError(f"store has {len(store)} entries for {n} texts")
  return np.asarray([code(s) for s in store], np.int8)


class Memory:
  """An EAR memory for a live agent: see the module docstring.

  Args:
    encoder: 'minilm' (default), a local Hugging Face checkpoint directory, a `.npy`/`.npz` of
      precomputed embeddings, an `ear_jax.data.encoders.Encoder`, or None (then every `add`/`retrieve`
      must pass embeddings). A spec string is loaded lazily, at the first text that needs encoding.
    config: `EARConfig`; default `EARConfig(dim=encoder dim)` (or `dim=` when there is no encoder).
      Its `dim` must match the encoder's.
    hparams: `HParams`; default `default_hparams()`.
    seed: seed of the learner (adapter init for the low-rank option, replay randomness).
    dim: the embedding dimension when neither `config` nor a loaded encoder gives it.
    multistore: candidates = top-K/2 dialogue memories + top-K/2 observations (Section 5).
    cache_dir: embedding cache root for `encoders.encode` (None: no disk cache).
    max_sessions: query sessions kept for feedback / continued exploration; the least recently used
      one that is not pending is dropped beyond this (its retrievals then expire).
    initial_capacity: initial bank capacity (rounded up to a power of two).

  Raises:
    ValueError: for a config whose `dim` does not match the encoder.
  """

  def __init__(self, encoder: Any = "minilm", *, config: Optional[EARConfig] = None,
               hparams: Optional[HParams] = None, seed: int = 0, dim: Optional[int] = None,
               multistore: bool = False, cache_dir=None, max_sessions: int = 4096,
               initial_capacity: int = _MIN_CAPACITY):
    from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
    self._encoder_spec = None
    self._encoder = None
    if encoder is not None:
      if isinstance(encoder, encoders.Encoder):
        self._encoder = encoder
        src = getattr(encoder, "model_dir", None) or getattr(encoder, "path", None)
        self._encoder_spec = "minilm" if encoder.name == "minilm" else (
            str(src) if src is not None else None)
      elif isinstance(encoder, (str, os.PathLike)):
        self._encoder_spec = str(encoder)
      else:
        raise ValueError(f"encoder must be a spec string, an Encoder or None, got "
                         f"{type(encoder).__name__}")
    self._encoder_identity = self._encoder.identity_hash if self._encoder is not None else None
    enc_dim = self._encoder.dim if self._encoder is not None else (
        384 if self._encoder_spec == "minilm" else None)
    if config is None:
      d = dim if dim is not None else enc_dim
      if d is None:
        raise ValueError("the embedding dimension is unknown: pass config=EARConfig(dim=...) or dim=")
      config = EARConfig(dim=int(d))
    if not isinstance(config, EARConfig):
      raise ValueError(f"config must be an EARConfig, got {type(config).__name__}")
    if dim is not None and dim != config.dim:
      raise ValueError(f"dim={dim} does not match config.dim={config.dim}")
    if enc_dim is not None and enc_dim != config.dim:
      raise ValueError(f"config.dim={config.dim} does not match the encoder's dimension {enc_dim}")
    if multistore and config.num_candidates % 2:
      raise ValueError(f"multistore needs an even num_candidates K, got {config.num_candidates}")
    if not config.trains:
      raise ValueError("config.train_slate='none' never learns; use train_slate='explorer'")
    self.config = config
    self.hparams = default_hparams() if hparams is None else hparams
    self.seed = int(seed)
    self.multistore = bool(multistore)
    self.cache_dir = None if cache_dir is None else str(cache_dir)
    self.max_sessions = int(max_sessions)
    root = jax.random.PRNGKey(self.seed)
    k_init, self._train_key = jax.random.split(root)
    self.state: learner_lib.LearnerState = learner_lib.init_learner(k_init, config)
    cap = _pow2_at_least(max(initial_capacity, config.num_candidates), _MIN_CAPACITY)
    self._emb = np.zeros((cap, config.dim), np.float32)
    self._valid = np.zeros((cap,), bool)
    self._stores = np.zeros((cap,), np.int8)
    self._ids: list[str] = []
    self._texts: list[str] = []
    self._row_of: dict[str, int] = {}
    self._sessions: "collections.OrderedDict[int, _Session]" = collections.OrderedDict()
    self._pending: list[int] = []  # session ids, in arrival order
    self._open: dict[int, int] = {}  # retrieval id -> session id
    self._next_retrieval = 0
    self._next_session = 0
    self._num_batches = 0
    self._clock = 0
    self.stats = collections.Counter()

  # ----------------------------------------------------------------------------------------------
  # properties

  def __len__(self):
    return len(self._ids)

  @property
  def capacity(self) -> int:
    """`C`, the current bank capacity (a power of two)."""
    return int(self._emb.shape[0])

  @property
  def params(self) -> adapter_lib.AdapterParams:
    return self.state.params

  @property
  def num_pending(self) -> int:
    """Query sessions with feedback waiting for the next learner step."""
    return len(self._pending)

  @property
  def ids(self) -> list[str]:
    return list(self._ids)

  @property
  def encoder(self):
    """The encoder (loaded now if it was given as a spec)."""
    return self._get_encoder()

  def embeddings(self) -> np.ndarray:
    """`[n, d]` the bank's frozen (pre-adapter) unit embeddings."""
    return self._emb[:len(self._ids)].copy()

  # ----------------------------------------------------------------------------------------------
  # encoding

  def _get_encoder(self):
    if self._encoder is None and self._encoder_spec is not None:
      from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
      enc = encoders.load_encoder(self._encoder_spec)
      if enc.dim != self.config.dim:
        raise ValueError(f"encoder {self._encoder_spec!r} has dimension {enc.dim}, but this memory "
                         f"uses d={self.config.dim}")
      if self._encoder_identity is not None and enc.identity_hash != self._encoder_identity:
        raise ValueError(
            f"encoder {self._encoder_spec!r} is not the model this memory was built with (identity "
            f"{enc.identity_hash[:16]} != {self._encoder_identity[:16]}): its embeddings would not "
            "match the bank")
      self._encoder = enc
      self._encoder_identity = enc.identity_hash
    return self._encoder

  def _encode(self, texts: list[str], what: str) -> np.ndarray:
    enc = self._get_encoder()
    if enc is None:
      raise ValueError(f"this memory has no encoder: pass {what} embeddings explicitly")
    from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
    emb = encoders.encode(enc, texts, cache_dir=self.cache_dir, use_cache=self.cache_dir is not None,
                          progress=False)
    return _check_embeddings(emb, len(texts), self.config.dim, f"encoder output for {what}")

  # ----------------------------------------------------------------------------------------------
  # add

  def add(self, texts, *, store="dialogue", ids=None, embeddings=None) -> list[str]:
    """Appends memories to the bank (batched encoding; capacity doubles when full).

    Args:
      texts: `n` non-empty strings (one string is one memory).
      store: 'dialogue' (episodic, 0) or 'observation' (semantic, 1), or one per text.
      ids: `n` unique string ids not yet in the bank; default `"m<row>"`.
      embeddings: optional `[n, d]` precomputed embeddings (finite, non-zero; normalised here);
        without it the texts are encoded with the memory's encoder.

    Returns:
      The ids of the added memories.

    Raises:
      ValueError: for empty texts, bad stores or ids, or wrong-dimension / non-finite embeddings;
        the bank is unchanged.
    """
    texts = _as_text_list(texts, "texts")
    n = len(texts)
    codes = _store_codes(store, n)
    if ids is None:
      base = len(self._ids)
      ids = [f"m{base + i}" for i in range(n)]
      clash = [i for i in ids if i in self._row_of]
      if clash:
        raise ValueError(f"default ids {clash[:5]} are already taken; pass ids= explicitly")
    else:
      ids = [ids] if isinstance(ids, str) else list(ids)
      if len(ids) != n:
        raise ValueError(f"ids has {len(ids)} entries for {n} texts")
      for i in ids:
        if not isinstance(i, str) or not i:
          raise ValueError(f"memory ids must be non-empty strings, got {i!r}")
      dup = sorted({i for i in ids if ids.count(i) > 1})
      if dup:
        raise ValueError(f"duplicate memory ids {dup[:5]} in this call")
      taken = [i for i in ids if i in self._row_of]
      if taken:
        raise ValueError(f"memory ids {taken[:5]} are already in the bank")
    if embeddings is not None:
      emb = _check_embeddings(embeddings, n, self.config.dim, "embeddings")
    else:
      emb = self._encode(texts, "memory")
    # --- all checks passed: mutate
    start = len(self._ids)
    need = start + n
    if need > self.capacity:
      cap = _pow2_at_least(need, self.capacity)
      grow = lambda a: np.concatenate([a, np.zeros((cap - a.shape[0],) + a.shape[1:], a.dtype)])
      self._emb, self._valid, self._stores = grow(self._emb), grow(self._valid), grow(self._stores)
    self._emb[start:need] = emb
    self._valid[start:need] = True
    self._stores[start:need] = codes
    for j, (i, t) in enumerate(zip(ids, texts)):
      self._row_of[i] = start + j
    self._ids.extend(ids)
    self._texts.extend(texts)
    self.stats["memories_added"] += n
    return list(ids)

  # ----------------------------------------------------------------------------------------------
  # retrieve

  def _available(self) -> int:
    n = len(self._ids)
    k_cap = self.config.num_candidates
    if not self.multistore:
      return min(n, k_cap)
    stores = self._stores[:n]
    return sum(min(int((stores == s).sum()), k_cap // 2) for s in (0, 1))

  def _check_k(self, k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
      raise ValueError(f"k must be a positive int, got {k!r}")
    k = int(k)
    if k > self.config.num_candidates:
      raise ValueError(f"k={k} is larger than num_candidates K={self.config.num_candidates}")
    avail = self._available()
    if k > avail:
      if len(self._ids) == 0:
        raise ValueError(f"k={k} is larger than the memory bank: the bank is empty")
      raise ValueError(f"k={k} is larger than the memory bank: only {avail} memories can be "
                       f"retrieved ({len(self._ids)} in the bank)")
    return k

  def retrieve(self, query: Optional[str] = None, k: int = 5, explore: bool = False, *,
               continue_from: Optional[Retrieval] = None,
               query_embedding=None) -> Retrieval:
    """Retrieves `k` memories for one query (see `retrieve_batch`)."""
    if continue_from is not None:
      return self.retrieve_batch(None, k, explore, continue_from=[continue_from],
                                 query_embeddings=None if query_embedding is None
                                 else np.asarray(query_embedding, np.float32)[None])[0]
    if query is not None and not isinstance(query, str):
      raise ValueError(f"query must be a string, got {type(query).__name__}")
    return self.retrieve_batch(None if query is None else [query], k, explore,
                               query_embeddings=None if query_embedding is None
                               else np.asarray(query_embedding, np.float32)[None])[0]

  def retrieve_batch(self, queries: Optional[Sequence[str]] = None, k: int = 5,
                     explore: bool = False, *, continue_from: Optional[Sequence[Retrieval]] = None,
                     query_embeddings=None) -> list[Retrieval]:
    """Retrieves `k` memories for each of `n` queries in one batched call.

    Each query gets its top-K candidates from the bank by frozen cosine (Eq. (1)), then either the
    adapter-only top-k of `z` (Section 3.6; `explore=False`) or one Explorer round (Eq. (5)-(8);
    `explore=True`) with its session's bandit statistics. Every retrieval opens a session that
    takes one `feedback`.

    Args:
      queries: `n` non-empty query texts (encoded in one batch); may be None when
        `query_embeddings` or `continue_from` is given.
      k: memories to return per query, `1 <= k <= K` and at most the memories in the bank.
      explore: one Explorer round instead of adapter-only top-k.
      continue_from: `n` earlier retrievals whose feedback was given: play the next round of their
        sessions (same query and candidates, bandit statistics kept; at most T rounds per session).
      query_embeddings: optional `[n, d]` precomputed query embeddings.

    Returns:
      `n` `Retrieval`s.

    Raises:
      ValueError: for empty queries, bad embeddings, k larger than the bank or K, or an invalid
        `continue_from`; the memory is unchanged.
    """
    k = self._check_k(k)
    d, K, T = self.config.dim, self.config.num_candidates, self.config.num_rounds
    if continue_from is not None:
      if queries is not None or query_embeddings is not None:
        raise ValueError("pass either queries / query_embeddings or continue_from, not both")
      prev = list(continue_from)
      if not prev:
        raise ValueError("continue_from is empty")
      sessions = []
      for r in prev:
        sid = self._session_of_finished(r)
        if sid in sessions:
          raise ValueError(f"session {sid} appears twice in continue_from")
        s = self._sessions[sid]
        if s.rounds >= T:
          raise ValueError(f"the session of retrieval {r.retrieval_id} has played all T={T} "
                           "Explorer rounds (Alg. 2); start a new retrieval")
        sessions.append(sid)
      objs = [self._sessions[sid] for sid in sessions]
      q_emb = np.stack([s.query_emb for s in objs])
      cand_idx = np.stack([s.cand_idx for s in objs])
      cand_mask = np.stack([s.cand_mask for s in objs])
      mean = np.stack([s.mean for s in objs])
      counts = np.stack([s.counts for s in objs])
      texts = [s.query for s in objs]
      for s in objs:  # the bank cannot shrink, but k must fit this session's candidates
        if k > int(s.cand_mask.sum()):
          raise ValueError(f"k={k} is larger than the {int(s.cand_mask.sum())} candidates of "
                           "the session being continued")
    else:
      if queries is None and query_embeddings is None:
        raise ValueError("pass queries (texts) or query_embeddings")
      texts = None
      if queries is not None:
        texts = _as_text_list(queries, "queries")
      if query_embeddings is not None:
        q_emb = _check_embeddings(query_embeddings, None if texts is None else len(texts), d,
                                  "query_embeddings")
        if texts is None:
          texts = [""] * q_emb.shape[0]
      else:
        q_emb = self._encode(texts, "query")
      n = len(texts)
      cand_idx, cand_mask = self._candidates(q_emb)
      mean = np.zeros((n, K), np.float32)
      counts = np.zeros((n, K), np.float32)
      sessions = None
    n = len(texts)
    cand_emb = np.where(cand_mask[..., None], self._emb[np.maximum(cand_idx, 0)], 0.0
                        ).astype(np.float32)
    n_pad = _pow2_at_least(n)
    pad = lambda a: np.concatenate([a, np.zeros((n_pad - n,) + a.shape[1:], a.dtype)])
    slate, slate_mask, z = _slates(self.state.params, pad(q_emb), pad(cand_emb), pad(cand_mask),
                                   pad(mean), pad(counts), self.hparams, k=k, explore=bool(explore))
    slate, slate_mask, z = (np.asarray(x)[:n] for x in (slate, slate_mask, z))
    # --- mutate
    out = []
    for i in range(n):
      if sessions is None:
        sid = self._next_session
        self._next_session += 1
        s = _Session(query=texts[i], query_emb=q_emb[i].copy(), cand_idx=cand_idx[i].copy(),
                     cand_emb=cand_emb[i].copy(), cand_mask=cand_mask[i].copy(),
                     mean=mean[i].copy(), counts=counts[i].copy(),
                     slates=np.full((T, K), -1, np.int32), slate_mask=np.zeros((T, K), bool),
                     labels=np.full((T, K), -1.0, np.float32))
        self._sessions[sid] = s
      else:
        sid = sessions[i]
        s = self._sessions[sid]
      rid = self._next_retrieval
      self._next_retrieval += 1
      pos = slate[i][slate_mask[i]].astype(np.int32)
      s.open_id, s.open_slate, s.open_explore = rid, pos, bool(explore)
      self._clock += 1
      s.last_used = self._clock
      self._sessions.move_to_end(sid)
      self._open[rid] = sid
      out.append(self._make_retrieval(rid, sid, s, z[i][pos]))
    self.stats["retrievals"] += n
    self._evict()
    return out

  def _candidates(self, q_emb: np.ndarray):
    n = q_emb.shape[0]
    n_pad = _pow2_at_least(n)
    q = np.zeros((n_pad, self.config.dim), np.float32)
    q[:n] = q_emb
    idx, mask = _bank_candidates(q, self._emb, self._valid, self._stores,
                                 num_candidates=self.config.num_candidates,
                                 multistore=self.multistore)
    return np.asarray(idx)[:n], np.asarray(mask)[:n]

  def _make_retrieval(self, rid: int, sid: int, s: _Session, z: np.ndarray) -> Retrieval:
    rows = s.cand_idx[s.open_slate]
    return Retrieval(
        retrieval_id=rid, session_id=sid, round=s.rounds + 1, query=s.query,
        ids=tuple(self._ids[r] for r in rows), texts=tuple(self._texts[r] for r in rows),
        stores=tuple(STORE_NAMES[int(self._stores[r])] for r in rows),
        scores=tuple(float(x) for x in np.asarray(z)), explore=s.open_explore)

  def _evict(self):
    if len(self._sessions) <= self.max_sessions:
      return
    pending = set(self._pending)
    for sid in list(self._sessions):
      if len(self._sessions) <= self.max_sessions:
        break
      if sid in pending:
        continue
      s = self._sessions.pop(sid)
      if s.open_id >= 0:
        self._open.pop(s.open_id, None)
      self.stats["sessions_evicted"] += 1

  # ----------------------------------------------------------------------------------------------
  # feedback

  def _rid(self, retrieval) -> int:
    if isinstance(retrieval, Retrieval):
      return retrieval.retrieval_id
    if isinstance(retrieval, (int, np.integer)) and not isinstance(retrieval, bool):
      return int(retrieval)
    raise ValueError(f"expected a Retrieval (or its retrieval_id), got {type(retrieval).__name__}")

  def _session_of_open(self, retrieval) -> int:
    rid = self._rid(retrieval)
    sid = self._open.get(rid)
    if sid is None:
      for s in self._sessions.values():
        if rid in s.consumed:
          raise ValueError(f"retrieval {rid} was already consumed: its feedback was given "
                           "(each retrieval takes feedback once; retrieve again to continue)")
      if 0 <= rid < self._next_retrieval:
        raise ValueError(f"retrieval {rid} has expired (its session was dropped after "
                         f"max_sessions={self.max_sessions}) or was consumed")
      raise ValueError(f"unknown retrieval {rid}: this memory never returned it")
    if isinstance(retrieval, Retrieval) and retrieval.session_id != sid:
      raise ValueError(f"retrieval {rid} does not belong to this memory")
    return sid

  def _session_of_finished(self, retrieval) -> int:
    rid = self._rid(retrieval)
    if rid in self._open:
      raise ValueError(f"retrieval {rid} has no feedback yet: give its feedback before "
                       "continuing its session")
    if isinstance(retrieval, Retrieval):
      sid = retrieval.session_id
      s = self._sessions.get(sid)
      if s is not None and rid in s.consumed:
        if s.open_id >= 0:
          raise ValueError(f"the session of retrieval {rid} already has an open retrieval "
                           f"{s.open_id}")
        return sid
    raise ValueError(f"cannot continue retrieval {rid}: unknown or expired session")

  def _labels_for(self, retrieval, cited_ids) -> tuple[int, np.ndarray]:
    sid = self._session_of_open(retrieval)
    s = self._sessions[sid]
    if cited_ids is None:
      cited_ids = []
    elif isinstance(cited_ids, str):
      cited_ids = [cited_ids]
    else:
      try:
        cited_ids = list(cited_ids)
      except TypeError:
        raise ValueError(f"cited_ids must be a collection of memory ids, got "
                         f"{type(cited_ids).__name__}") from None
    shown = [self._ids[r] for r in s.cand_idx[s.open_slate]]
    unknown = [c for c in cited_ids if c not in shown]
    if unknown:
      raise ValueError(f"cited ids {unknown[:5]} were not in the slate of retrieval {s.open_id} "
                       f"(its ids: {shown})")
    cited = set(cited_ids)
    return sid, np.asarray([1.0 if i in cited else -1.0 for i in shown], np.float32)

  def feedback(self, retrieval, cited_ids: Iterable[str] = ()) -> bool:
    """Applies an LLM's citations to a retrieval's slate (labels +1 cited, -1 otherwise).

    Updates the session's bandit statistics (Eq. (9)) and marks the session pending; once
    `config.batch_size` sessions are pending, one EAR learner step (current + replay loss,
    Eq. (17)-(18)) runs on them.

    Args:
      retrieval: a `Retrieval` of this memory (or its `retrieval_id`) without feedback yet.
      cited_ids: ids of the memories of that slate the LLM cited (possibly none).

    Returns:
      True when this call triggered a learner step.

    Raises:
      ValueError: for an unknown or already-consumed retrieval, or cited ids outside the slate; the
        memory is unchanged.
    """
    sid, labels = self._labels_for(retrieval, cited_ids)
    self._apply_feedback(sid, labels)
    return self._maybe_train()

  def feedback_batch(self, retrievals: Sequence[Any], cited_ids: Sequence[Iterable[str]]
                     ) -> int:
    """`feedback` for many retrievals; all are validated before any is applied.

    Args:
      retrievals: `n` retrievals (distinct).
      cited_ids: `n` collections of cited ids.

    Returns:
      The number of learner steps taken.

    Raises:
      ValueError: as `feedback` (naming the offending index), or for mismatched lengths / repeated
        retrievals; the memory is unchanged.
    """
    retrievals, cited_ids = list(retrievals), list(cited_ids)
    if len(retrievals) != len(cited_ids):
      raise ValueError(f"{len(retrievals)} retrievals but {len(cited_ids)} citation lists")
    checked, seen = [], set()
    for i, (r, c) in enumerate(zip(retrievals, cited_ids)):
      rid = self._rid(r)
      if rid in seen:
        raise ValueError(f"retrieval {rid} appears twice in feedback_batch")
      seen.add(rid)
      try:
        checked.append(self._labels_for(r, c))
      except ValueError as e:
        raise ValueError(f"feedback_batch item {i}: {e}") from None
    steps = 0
    for sid, labels in checked:
      self._apply_feedback(sid, labels)
      steps += int(self._maybe_train())
    return steps

  def discard(self, retrieval) -> None:
    """Closes a retrieval without feedback (no update); its session can still be continued."""
    sid = self._session_of_open(retrieval)
    s = self._sessions[sid]
    self._open.pop(s.open_id)
    s.consumed.append(s.open_id)
    s.open_id, s.open_slate = -1, None
    self.stats["discarded"] += 1

  def _apply_feedback(self, sid: int, labels: np.ndarray) -> None:
    s = self._sessions[sid]
    K = self.config.num_candidates
    slate = np.full((K,), -1, np.int32)
    mask = np.zeros((K,), bool)
    lab = np.full((K,), -1.0, np.float32)
    k = len(s.open_slate)
    slate[:k], mask[:k], lab[:k] = s.open_slate, True, labels
    stats = _update_bandit(explorer_lib.BanditStats(mean=jnp.asarray(s.mean),
                                                    counts=jnp.asarray(s.counts)),
                           jnp.asarray(slate), jnp.asarray(mask), jnp.asarray(lab))
    s.mean, s.counts = np.asarray(stats.mean), np.asarray(stats.counts)
    t = s.rounds
    s.slates[t], s.slate_mask[t], s.labels[t] = slate, mask, lab
    s.rounds += 1
    self._open.pop(s.open_id)
    s.consumed.append(s.open_id)
    s.open_id, s.open_slate = -1, None
    if sid not in self._pending:
      self._pending.append(sid)
    self.stats["feedback"] += 1
    self.stats["cited"] += int((labels > 0).sum())

  def _maybe_train(self) -> bool:
    if len(self._pending) < self.config.batch_size:
      return False
    self._train(self._pending[:self.config.batch_size])
    return True

  def flush(self) -> bool:
    """Runs a learner step now on the pending sessions (fewer than a batch; padded and masked).

    Returns:
      True when a step was taken (there was pending feedback).
    """
    if not self._pending:
      return False
    self._train(list(self._pending))
    return True

  def _train(self, sids: list[int]) -> None:
    b = self.config.batch_size
    d, K, T = self.config.dim, self.config.num_candidates, self.config.num_rounds
    q = np.zeros((b, d), np.float32)
    c = np.zeros((b, K, d), np.float32)
    m = np.zeros((b, K), bool)
    sl = np.full((b, T, K), -1, np.int32)
    sm = np.zeros((b, T, K), bool)
    lab = np.full((b, T, K), -1.0, np.float32)
    where = np.zeros((b,), bool)
    for i, sid in enumerate(sids):
      s = self._sessions[sid]
      r = s.rounds - s.trained
      q[i], c[i], m[i], where[i] = s.query_emb, s.cand_emb, s.cand_mask, True
      sl[i, :r], sm[i, :r], lab[i, :r] = (s.slates[s.trained:s.rounds], s.slate_mask[s.trained:s.rounds],
                                          s.labels[s.trained:s.rounds])
    keys = jax.random.split(jax.random.fold_in(self._train_key, self._num_batches), b)
    batch = Stream(queries=q, candidates=c, mask=m, gold=np.zeros((b, K), bool),
                   num_gold=np.zeros((b,), np.int32))
    self.state, _ = learner_lib.train_batch_on_feedback_jit(
        self.state, keys, batch, sl, sm, lab, where, self.config, self.hparams)
    self._num_batches += 1
    for sid in sids:
      s = self._sessions[sid]
      s.trained = s.rounds
    self._pending = [p for p in self._pending if p not in set(sids)]
    self.stats["learner_steps"] += 1
    self._evict()

  # ----------------------------------------------------------------------------------------------
  # LLM critic

  def feedback_from_critic(self, retrieval: Retrieval, critic) -> Any:
    """Asks a critic (e.g. `LLMCritic`) about a retrieval's slate and applies its citations.

    The critic's `critique(question, memory_texts)` must return an object with `labels` (None when
    it produced no usable citations) and `cited` (slate positions). Without usable citations the
    retrieval is closed with NO update (`discard`) and counted in `stats['critic_no_update']`.

    Returns:
      The critic's result.

    Raises:
      ValueError: for an unknown / consumed retrieval or a retrieval without query text.
    """
    sid = self._session_of_open(retrieval)
    if not retrieval.query:
      raise ValueError(f"retrieval {retrieval.retrieval_id} has no query text to show the critic")
    if self._sessions[sid].open_id != retrieval.retrieval_id:
      raise ValueError(f"retrieval {retrieval.retrieval_id} is not open")
    result = critic.critique(retrieval.query, list(retrieval.texts))
    self.stats["critic_calls"] += 1
    if getattr(result, "labels", None) is None or getattr(result, "cited", None) is None:
      self.discard(retrieval)
      self.stats["critic_no_update"] += 1
      return result
    self.feedback(retrieval, [retrieval.ids[i] for i in result.cited])
    return result

  # ----------------------------------------------------------------------------------------------
  # persistence

  def save(self, path) -> pathlib.Path:
    """Writes a checkpoint atomically (see the module docstring).

    Args:
      path: checkpoint directory (created if missing); earlier checkpoints in it are replaced.

    Returns:
      The directory of the new checkpoint (`path/ckpt-<N>`).
    """
    root = pathlib.Path(path).expanduser().absolute()
    if root.exists() and not root.is_dir():
      raise ValueError(f"checkpoint path {str(root)!r} exists and is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    latest = _read_latest(root)
    number = (int(latest.split("-")[1]) + 1) if latest else 1
    while (root / f"ckpt-{number:06d}").exists():
      number += 1
    name = f"ckpt-{number:06d}"
    tmp = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{name}-"))
    try:
      arrays, meta = self._snapshot()
      _write_arrays(tmp / _ARRAYS, arrays)
      _write_json(tmp / _META, meta)
      _fsync_dir(tmp)
      os.rename(tmp, root / name)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)  # an exception (not a kill): leave no debris
      raise
    _fsync_dir(root)
    _write_json(root / _LATEST, {"checkpoint": name, "format": CHECKPOINT_FORMAT})
    _fsync_dir(root)
    for old in root.iterdir():  # the new checkpoint is live: drop the others and stale temps
      if old.name != name and old.is_dir() and (old.name.startswith("ckpt-")
                                                or old.name.startswith(".tmp-ckpt-")):
        shutil.rmtree(old, ignore_errors=True)
    return root / name

  def _snapshot(self):
    n = len(self._ids)
    leaves = jax.tree_util.tree_leaves(self.state)
    arrays = {"learner": {f"{i:04d}": np.asarray(x) for i, x in enumerate(leaves)},
              "hparams": {k: np.asarray(v) for k, v in dataclasses.asdict(self.hparams).items()}}
    if n:
      arrays["bank"] = {"embeddings": self._emb[:n].copy(), "stores": self._stores[:n].copy()}
    sids = list(self._sessions)
    if sids:
      ss = [self._sessions[s] for s in sids]
      arrays["sessions"] = {f: np.stack([getattr(s, f) for s in ss]) for f in (
          "query_emb", "cand_idx", "cand_emb", "cand_mask", "mean", "counts", "slates",
          "slate_mask", "labels")}
    meta = {
        "format": CHECKPOINT_FORMAT,
        "config": self.config.to_dict(),
        "encoder": {"spec": self._encoder_spec, "identity_hash": self._encoder_identity,
                    "dim": self.config.dim},
        "seed": self.seed, "multistore": self.multistore, "max_sessions": self.max_sessions,
        "cache_dir": self.cache_dir,
        "num_learner_leaves": len(leaves),
        "counters": {"next_retrieval": self._next_retrieval, "next_session": self._next_session,
                     "num_batches": self._num_batches, "clock": self._clock},
        "ids": self._ids, "texts": self._texts,
        "sessions": [{"id": sid, "query": s.query, "rounds": s.rounds, "trained": s.trained,
                      "open_id": s.open_id,
                      "open_slate": None if s.open_slate is None else s.open_slate.tolist(),
                      "open_explore": s.open_explore, "consumed": s.consumed,
                      "last_used": s.last_used}
                     for sid, s in self._sessions.items()],
        "pending": self._pending,
        "stats": dict(self.stats),
    }
    return arrays, meta

  @classmethod
  def load(cls, path, *, encoder: Any = "saved", config: Optional[EARConfig] = None) -> "Memory":
    """Restores a memory saved with `save`.

    Args:
      path: the checkpoint directory given to `save`.
      encoder: 'saved' (the saved spec, loaded lazily and checked against the saved model
        identity), an `Encoder` / spec to use instead (its dimension and identity must match), or
        None (embeddings only).
      config: optional expected `EARConfig`; a different one is an error.

    Raises:
      ValueError: if there is no checkpoint at `path`, or it was written with another config,
        encoder dimension or encoder model.
    """
    root = pathlib.Path(path).expanduser().absolute()
    name = _read_latest(root) if root.is_dir() else None
    if name is None or not (root / name / _META).is_file():
      raise ValueError(f"no ear_jax Memory checkpoint at {str(root)!r} (missing {_LATEST} or "
                       f"{name}/{_META})")
    ckpt = root / name
    meta = json.loads((ckpt / _META).read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
      raise ValueError(f"{ckpt}: unknown checkpoint format {meta.get('format')!r}, expected "
                       f"{CHECKPOINT_FORMAT!r}")
    saved_cfg = EARConfig(**meta["config"])
    if config is not None and config != saved_cfg:
      diffs = [f"{f}={getattr(saved_cfg, f)!r} in the checkpoint vs {getattr(config, f)!r} given"
               for f in meta["config"] if getattr(saved_cfg, f) != getattr(config, f)]
      raise ValueError(f"checkpoint {str(root)!r} was written with another config: "
                       + "; ".join(diffs))
    enc_meta = meta["encoder"]
    from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
    if isinstance(encoder, str) and encoder == "saved":
      enc_arg = enc_meta["spec"]
    elif encoder is None:
      enc_arg = None
    else:
      enc_arg = encoders.load_encoder(encoder)
      if enc_arg.dim != saved_cfg.dim:
        raise ValueError(f"checkpoint {str(root)!r} was written with encoder dimension "
                         f"d={saved_cfg.dim}, but encoder {enc_arg.name!r} has dimension "
                         f"{enc_arg.dim}")
      if enc_meta["identity_hash"] and enc_arg.identity_hash != enc_meta["identity_hash"]:
        raise ValueError(f"checkpoint {str(root)!r} was written with another encoder model "
                         f"(identity {enc_meta['identity_hash'][:16]}), not {enc_arg.name!r} "
                         f"(identity {enc_arg.identity_hash[:16]})")
    mem = cls.__new__(cls)
    Memory.__init__(mem, None, config=saved_cfg, seed=meta["seed"],
                    multistore=meta["multistore"], cache_dir=meta["cache_dir"],
                    max_sessions=meta["max_sessions"])
    if isinstance(enc_arg, str):
      mem._encoder_spec = enc_arg
    elif enc_arg is not None:
      mem._encoder = enc_arg
      mem._encoder_spec = enc_meta["spec"]
    mem._encoder_identity = enc_meta["identity_hash"] if enc_arg is not None else None
    if enc_arg is not None and not isinstance(enc_arg, str):
      mem._encoder_identity = enc_arg.identity_hash
    arrays = _read_arrays(ckpt / _ARRAYS)
    template = jax.tree_util.tree_leaves(mem.state)
    stored = arrays["learner"]
    if len(stored) != len(template) or meta["num_learner_leaves"] != len(template):
      raise ValueError(f"{ckpt}: the learner state has {len(stored)} arrays, expected "
                       f"{len(template)} for this config")
    leaves = []
    for i, t in enumerate(template):
      x = np.asarray(stored[f"{i:04d}"])
      if x.shape != t.shape:
        raise ValueError(f"{ckpt}: learner array {i} has shape {x.shape}, expected {t.shape}")
      leaves.append(jnp.asarray(x, t.dtype))
    mem.state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(mem.state), leaves)
    mem.hparams = HParams(**{k: jnp.asarray(v, jnp.float32) for k, v in arrays["hparams"].items()})
    n = len(meta["ids"])
    if n:
      bank = arrays["bank"]
      if bank["embeddings"].shape != (n, saved_cfg.dim):
        raise ValueError(f"{ckpt}: bank embeddings have shape {bank['embeddings'].shape}, "
                         f"expected {(n, saved_cfg.dim)}")
      cap = _pow2_at_least(max(n, saved_cfg.num_candidates), _MIN_CAPACITY)
      mem._emb = np.zeros((cap, saved_cfg.dim), np.float32)
      mem._valid = np.zeros((cap,), bool)
      mem._stores = np.zeros((cap,), np.int8)
      mem._emb[:n] = bank["embeddings"]
      mem._valid[:n] = True
      mem._stores[:n] = bank["stores"]
    mem._ids = list(meta["ids"])
    mem._texts = list(meta["texts"])
    mem._row_of = {i: r for r, i in enumerate(mem._ids)}
    if meta["sessions"]:
      sa = arrays["sessions"]
      for j, sm in enumerate(meta["sessions"]):
        s = _Session(query=sm["query"], **{f: np.asarray(sa[f][j]) for f in sa},
                     rounds=sm["rounds"], trained=sm["trained"], open_id=sm["open_id"],
                     open_slate=None if sm["open_slate"] is None
                     else np.asarray(sm["open_slate"], np.int32),
                     open_explore=sm["open_explore"], consumed=list(sm["consumed"]),
                     last_used=sm["last_used"])
        mem._sessions[sm["id"]] = s
        if s.open_id >= 0:
          mem._open[s.open_id] = sm["id"]
    mem._pending = list(meta["pending"])
    c = meta["counters"]
    mem._next_retrieval, mem._next_session = c["next_retrieval"], c["next_session"]
    mem._num_batches, mem._clock = c["num_batches"], c["clock"]
    mem.stats = collections.Counter(meta["stats"])
    return mem


def llm_feedback(memory: Memory, critic, query: str, k: int = 5, explore: bool = True, *,
                 query_embedding=None) -> tuple[Retrieval, Any]:
  """One agent step with an LLM critic: retrieve -> critique -> feedback.

  Unparseable or failed critic calls apply no update (counted in `memory.stats['critic_no_update']`
  and in the critic's own `stats`); the agent loop never crashes on them.

  Returns:
    `(retrieval, critic_result)`.
  """
  r = memory.retrieve(query, k=k, explore=explore, query_embedding=query_embedding)
  return r, memory.feedback_from_critic(r, critic)


def run_critic_episode(key: jax.Array, stream: Stream, query_texts: Sequence[str],
                       candidate_texts: np.ndarray, critic, config: EARConfig, hparams: HParams,
                       *, state: Optional[learner_lib.LearnerState] = None, progress=None):
  """An online EAR training episode whose critic lives on the host (e.g. an `LLMCritic`).

  The loop of Alg. 1 with the Explorer's rounds unrolled on the host: for each batch of `b` queries,
  T rounds of (one jitted Explorer round for the batch, Eq. (5)-(8) -> one `critic.critique` per
  query -> bandit update, Eq. (9)); then ONE jitted learner step
  (`learner.train_batch_on_feedback_jit`: Eq. (10)-(18)). A critic call without usable citations
  (`result.labels is None`: unparseable reply, HTTP error, timeout) leaves that round out of the
  loss and of the bandit statistics (no update) and is counted.

  Symbols: `N` queries, `K` candidates, `s` slate size, `T` rounds, `b` batch size.

  Args:
    key: PRNG key of the episode (learner init and replay); the key is consumed.
    stream: `N` training queries (`gold` is not used: the critic decides).
    query_texts: `N` question texts shown to the critic.
    candidate_texts: `[N, K]` memory texts of the candidates.
    critic: an object with `critique(question, memory_texts) -> result` (`result.labels`: `[s]`
      ±1 or None).
    config: static config (`train_slate` must be 'explorer').
    hparams: hyperparameters.
    state: a learner state to continue from (default: a fresh one from the key).
    progress: optional callable `(queries_done, num_queries)`.

  Returns:
    `(state, stats)` with `stats` counting critic calls, usable / unusable replies and steps.
  """
  if config.train_slate != "explorer":
    raise ValueError(f"run_critic_episode runs the Explorer: train_slate must be 'explorer', got "
                     f"{config.train_slate!r}")
  learner_lib.validate_stream(stream, config)
  n = stream.num_queries
  if len(query_texts) != n or np.shape(candidate_texts)[:2] != (n, config.num_candidates):
    raise ValueError(f"need {n} query texts and [{n}, {config.num_candidates}] candidate texts, "
                     f"got {len(query_texts)} and {np.shape(candidate_texts)}")
  k_init, keys = learner_lib.episode_keys(key, n)
  if state is None:
    state = learner_lib.init_learner(k_init, config)
  b, T, s, K = config.batch_size, config.num_rounds, config.slate_size, config.num_candidates
  stats = collections.Counter()
  queries = np.asarray(stream.queries)
  cands = np.asarray(stream.candidates)
  masks = np.asarray(stream.mask)
  keys = np.asarray(keys)
  for start in range(0, n, b):
    rows = np.arange(start, min(start + b, n))
    nb = len(rows)
    idx = np.concatenate([rows, np.full(b - nb, rows[-1])])  # pad the last batch (masked)
    mean = np.zeros((b, K), np.float32)
    counts = np.zeros((b, K), np.float32)
    slates = np.full((b, T, s), -1, np.int32)
    slate_mask = np.zeros((b, T, s), bool)
    labels = np.full((b, T, s), -1.0, np.float32)
    for t in range(T):
      sl, sm, _ = _slates(state.params, queries[idx], cands[idx], masks[idx], mean, counts,
                          hparams, k=s, explore=True)
      sl, sm = np.asarray(sl), np.asarray(sm)
      for i in range(nb):
        pos = sl[i][sm[i]]
        result = critic.critique(query_texts[rows[i]], [str(candidate_texts[rows[i]][p])
                                                        for p in pos])
        stats["critic_calls"] += 1
        if getattr(result, "labels", None) is None:
          stats["critic_no_update"] += 1
          continue
        stats["critic_ok"] += 1
        lab = np.full((s,), -1.0, np.float32)
        lab[:len(pos)] = np.asarray(result.labels, np.float32)
        slates[i, t], slate_mask[i, t], labels[i, t] = sl[i], sm[i], np.where(sm[i], lab, -1.0)
        st = _update_bandit(explorer_lib.BanditStats(mean=jnp.asarray(mean[i]),
                                                     counts=jnp.asarray(counts[i])),
                            jnp.asarray(sl[i]), jnp.asarray(sm[i]), jnp.asarray(labels[i, t]))
        mean[i], counts[i] = np.asarray(st.mean), np.asarray(st.counts)
    batch = jax.tree_util.tree_map(lambda x: np.asarray(x)[idx], stream)
    where = np.arange(b) < nb
    state, _ = learner_lib.train_batch_on_feedback_jit(state, jnp.asarray(keys[idx]), batch,
                                                       slates, slate_mask, labels, where, config,
                                                       hparams)
    stats["learner_steps"] += 1
    stats["queries"] += nb
    if progress is not None:
      progress(int(stats["queries"]), n)
  return state, dict(stats)


# ------------------------------------------------------------------------------------------------
# checkpoint files


def _read_latest(root: pathlib.Path) -> Optional[str]:
  try:
    name = json.loads((root / _LATEST).read_text())["checkpoint"]
  except (OSError, ValueError, KeyError, TypeError):
    return None
  return name if isinstance(name, str) and name.startswith("ckpt-") else None


def _write_json(path: pathlib.Path, obj) -> None:
  """Writes JSON atomically (temp file + fsync + `os.replace`)."""
  blob = json.dumps(obj).encode("utf-8")
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name, suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(blob)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def _fsync_dir(path: pathlib.Path) -> None:
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def _write_arrays(path: pathlib.Path, arrays) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  ocp.PyTreeCheckpointer().save(str(path), arrays)


def _read_arrays(path: pathlib.Path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp.PyTreeCheckpointer().restore(str(path))
