"""The growable memory bank of `Memory`: ids, texts, stores and device-resident embeddings.

Symbols: `n` memories in the bank, `C` capacity (`capacity_for(n)`: a power of two up to 4,096,
then a multiple of a quarter power of two, so `C <= 1.25 n`), `d` dimension, `K` candidates per
query, `q` queries of one call.

The embeddings live on the device as a `[C, d]` array with a `[C]` validity mask and a `[C]` store
code (0 dialogue / episodic, 1 observation / semantic). `C` grows when the bank is full (one copy of
the bank), so the jitted candidate search compiles once per capacity (and per power-of-two query
count), i.e. O(log n) times; an add writes its rows in place (donated buffers). One `search` call is
one jitted computation (search, candidate gather and, for `Memory`, the first-round slate) whose
outputs come back packed in two host copies. The search is `ear_jax.core.retrieval.top_k_search`,
the same as the benchmark pipeline's:

* without `multistore` only dialogue memories (store 0) are candidates (as in the benchmark pipeline
  and `docs/jsonl_format.md`);
* with `multistore` the candidates are the top-K/2 of each store (Section 5).

Scopes (`Memory.add(..., scope=...)`): every row has a scope (`DEFAULT_SCOPE` unless named), kept
as a `[C]` int32 scope code on the device beside the stores and the validity mask (written by the
same jitted `_write`) and as a host table name <-> code (`Bank.scope_names`, in order of first
use). A query's scope spec (None: every scope; a name; a list of names) becomes `allowed`, a bool
vector over the scope codes padded to a power of two (`ScopeFilter`: the search compiles once per
power of two of scopes), gathered by the row codes inside the jitted search (`allowed[scopes]`) and
ANDed with `valid` (and the store rule), so rows of other scopes are never candidates, however few
the scope holds (the candidates are then padded and masked as for a small bank); nothing filters
the bank's rows on the host per query. An ANN searcher gets the scope codes too and searches with
a faiss ID selector (`ear_jax.index.ann`); the device re-score applies `allowed` again. A searcher
whose faiss index cannot filter (PQ fast-scan once trained), a store holding few rows of the
scopes, or a search in which a query found fewer rows than it may return leaves the batch to the
exact device search, so every query gets `min(K, rows of its scopes)` candidates whatever the
index (`ann.FaissSearcher.search`). `check_k` / `available` count the memories of the requested scopes (per store).
Each row also keeps a date (free text, e.g. LoCoMo's "1:56 pm on 8 May, 2023", or ISO 8601).

Options (`Memory(bank_dtype=..., index=...)`): the embeddings may be stored as bfloat16 (half the
memory and bytes per exact search); `index` replaces the exact device search by an approximate
faiss searcher (`ear_jax.index.ann`), which returns rows that are then gathered from the same
device array, so EAR sees the same kind of candidates.

The bank is not thread-safe on its own: `Memory` serialises every call under its lock. Its device
arrays are updated in place by `append` (donated: an earlier reference to them is invalid
afterwards), so nothing keeps a reference beyond the lock; reads copy to the host under it (the ANN
searcher, a host object, is updated in place under that lock too).
"""
from __future__ import annotations

import collections.abc
import functools
import datetime
import hashlib
import json
import re
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import explorer as explorer_lib
from ear_jax.core import retrieval as retrieval_lib
from ear_jax.data import encoder_base

STORES = {"dialogue": 0, "episodic": 0, "observation": 1, "semantic": 1}
STORE_NAMES = ("dialogue", "observation")
BANK_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
MIN_CAPACITY = 32
FINE_CAPACITY = 4096  # beyond this the capacity grows in quarter steps (`capacity_for`)
DEFAULT_SCOPE = "default"  # the scope of memories added without one (scope code 0)


class InputTypeError(TypeError, ValueError):
  """An argument of the wrong type (a `TypeError`, and a `ValueError` like every input error)."""


def pow2_at_least(n: int, minimum: int = 1) -> int:
  """The smallest power of two `>= max(n, minimum, 1)`."""
  n = max(n, minimum, 1)
  return 1 << (n - 1).bit_length()


def capacity_for(n: int, minimum: int = MIN_CAPACITY) -> int:
  """The bank capacity `C` that holds `n` rows: a power of two up to `FINE_CAPACITY`, then the next
  multiple of a quarter of the power of two below (5/4, 6/4, 7/4, 8/4 of it). An exact search reads
  all `C` rows, so this bounds the rows read to 1.25 `n` (2 `n` with powers of two) for 4 compiles
  of the search per doubling."""
  n = max(n, minimum, 1)
  if n <= FINE_CAPACITY:
    return pow2_at_least(n)
  step = 1 << (n.bit_length() - 3)  # a quarter of the power of two <= n
  return -(-n // step) * step


# ------------------------------------------------------------------------------------------------
# input validation (pure: no state is read or written)


def _check_encodable(values: list[str], what: str) -> None:
  """`encoder_base.check_texts` (no lone surrogate: UTF-8 encodable), its ValueError prefixed by
  `what` (the argument's name)."""
  try:
    encoder_base.check_texts(values)
  except ValueError as e:
    raise ValueError(f"{what}: {e}") from None


def string_list(values, what: str, noun: str) -> list[str]:
  """One string, or a non-empty sequence (list, tuple) of strings, as a list.

  Raises:
    InputTypeError: not a string or a sequence (a dict, a set, bytes, a number...), or an element
      that is not a string (naming its index).
    ValueError: an empty sequence.
  """
  if isinstance(values, str):
    return [values]
  if (not isinstance(values, collections.abc.Sequence)
      or isinstance(values, (bytes, bytearray, memoryview))):
    raise InputTypeError(f"{what} must be a {noun} (string) or a sequence (list, tuple) of "
                         f"strings, got {type(values).__name__}")
  values = list(values)
  if not values:
    raise ValueError(f"{what} is empty: pass at least one {noun}")
  for i, v in enumerate(values):
    if not isinstance(v, str):
      raise InputTypeError(f"{what}[{i}] must be a string, got {type(v).__name__}")
  return values


def check_text_list(texts, what: str) -> list[str]:
  """One string, or a sequence of non-empty strings that UTF-8 can encode, as a list.

  Raises:
    InputTypeError: `texts` is not a string or a sequence (a dict, a set, bytes, a number...), or
      one element is not a string.
    ValueError: an empty sequence, an empty text, or a text with a lone surrogate (naming its
      index).
  """
  texts = string_list(texts, what, "text")
  for i, t in enumerate(texts):
    if not t.strip():
      raise ValueError(f"{what}[{i}] is an empty text")
  _check_encodable(texts, what)
  return texts


def check_embeddings(emb, n: Optional[int], dim: int, what: str) -> np.ndarray:
  """`[n, d]` real, finite, non-zero rows, returned L2-normalised as float32.

  Rows of any magnitude are normalised without overflow or underflow (`encoder_base.unit_rows`);
  complex, boolean, string or object arrays are refused, never silently converted.

  Raises:
    ValueError: naming what is wrong: the dtype, the number of rows (one per text), the
      dimension, or the offending rows (NaN / Inf, all zero).
  """
  arr = encoder_base.real_array(emb, what)
  rows = n if n is not None else "n"
  if arr.ndim != 2:
    raise ValueError(f"{what} has shape {arr.shape}, expected a 2-D [{rows}, {dim}] array "
                     "(one row per text)")
  problems = []
  if n is not None and arr.shape[0] != n:
    problems.append(f"{arr.shape[0]} row(s) for {n} text(s): pass one embedding per text")
  if arr.shape[1] != dim:
    problems.append(f"wrong dimension: this memory's encoder dimension is d={dim}")
  if problems:
    raise ValueError(f"{what} has shape {arr.shape}, expected [{rows}, {dim}] "
                     f"({'; '.join(problems)})")
  return encoder_base.unit_rows(arr, what)


def real_query_vector(emb, dim: int) -> np.ndarray:
  """One `[d]` query embedding as a real array (checked and normalised by `check_embeddings`).

  Raises:
    ValueError: for a non-real dtype, or a shape other than `[d]`.
  """
  arr = encoder_base.real_array(emb, "query_embedding")
  if arr.ndim != 1:
    raise ValueError(f"query_embedding has shape {arr.shape}, expected one [{dim}] vector "
                     "(for several queries pass retrieve_batch(query_embeddings=[n, d]))")
  return arr


def store_codes(store, n: int) -> np.ndarray:
  """`[n]` int8 store codes from one store (name or 0/1) or one per memory."""

  def code(s):
    if isinstance(s, (int, np.integer)) and not isinstance(s, bool) and int(s) in (0, 1):
      return int(s)
    if isinstance(s, str) and s in STORES:
      return STORES[s]
    raise ValueError(f"unknown store {s!r}; expected one of {sorted(STORES)} or 0/1")

  if isinstance(store, (str, int, np.integer)):
    return np.full(n, code(store), np.int8)
  if not isinstance(store, collections.abc.Sequence):
    raise InputTypeError(f"store must be a store name, 0/1, or a sequence of them, got "
                         f"{type(store).__name__}")
  if len(store) != n:
    raise ValueError(f"store has {len(store)} entries for {n} texts")
  return np.asarray([code(s) for s in store], np.int8)


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")  # Unicode category Cc


def check_id_chars(ids: list[str], what: str) -> None:
  """ValueError naming `what` (and the index) for an id holding a control character: NUL-prefixed
  ids are the tombstones of deleted memories (`forget.TOMBSTONE`), and none may be forged."""
  for j, i in enumerate(ids):
    bad = _CONTROL.search(i)
    if bad is None:
      continue
    where = what if len(ids) == 1 and what != "ids" else f"{what}[{j}]"
    why = ("starts with NUL, the prefix reserved for the ids of deleted memories"
           if i.startswith("\x00") else
           f"holds the control character U+{ord(bad.group()):04X} at position {bad.start()}")
    raise ValueError(f"{where}={i!r} {why}: memory ids may not contain control characters")


def check_id_list(ids, n: int) -> list[str]:
  """`n` distinct, non-empty string ids (UTF-8 encodable, no control character)."""
  if isinstance(ids, str):
    ids = [ids]
  elif not isinstance(ids, collections.abc.Sequence):
    raise InputTypeError(f"ids must be a string or a sequence of strings, got {type(ids).__name__}")
  ids = list(ids)
  if len(ids) != n:
    raise ValueError(f"ids has {len(ids)} entries for {n} texts")
  for i in ids:
    if not isinstance(i, str) or not i:
      raise ValueError(f"memory ids must be non-empty strings, got {i!r}")
  _check_encodable(ids, "ids")
  check_id_chars(ids, "ids")
  seen, dup = set(), set()
  for i in ids:
    (dup if i in seen else seen).add(i)
  if dup:
    raise ValueError(f"duplicate memory ids {sorted(dup)[:5]} in this call")
  return ids


def check_scope(scope) -> str:
  """The scope of an `add`: None -> `DEFAULT_SCOPE`, else a non-empty string (UTF-8 encodable)."""
  if scope is None:
    return DEFAULT_SCOPE
  if not isinstance(scope, str):
    raise InputTypeError(f"scope must be a string (one scope for the memories of this call) or "
                         f"None, got {type(scope).__name__}")
  if not scope:
    raise ValueError("scope is an empty string: pass a scope name or None (the default scope)")
  _check_encodable([scope], "scope")
  return scope


def check_scope_spec(scope) -> Optional[tuple[str, ...]]:
  """The scopes a query may see: None (every scope), or the names of one string or a non-empty
  list / tuple of strings (unknown names are allowed: they hold no memories)."""
  if scope is None:
    return None
  if isinstance(scope, str):
    return (check_scope(scope),)
  if not isinstance(scope, (list, tuple)):
    raise InputTypeError(f"scope must be None, a scope name or a list / tuple of names, got "
                         f"{type(scope).__name__}")
  if not scope:
    raise ValueError("scope is an empty list: pass None for every scope, or at least one name")
  names = []
  for i, s in enumerate(scope):
    if not isinstance(s, str):
      raise InputTypeError(f"scope[{i}] must be a string, got {type(s).__name__}")
    names.append(check_scope(s))
  return tuple(dict.fromkeys(names))


def now_date() -> str:
  """The date of a memory added without one: the UTC time as ISO 8601, to the second."""
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def check_dates(dates, n: int) -> list[str]:
  """`n` dates (free text), one per memory; None -> `n` times `now_date()`."""
  if dates is None:
    return [now_date()] * n
  if isinstance(dates, str) or not isinstance(dates, collections.abc.Sequence):
    raise InputTypeError(f"dates must be a sequence (list, tuple) of strings, one per text, got "
                         f"{type(dates).__name__}")
  dates = list(dates)
  if len(dates) != n:
    raise ValueError(f"dates has {len(dates)} entries for {n} texts")
  for i, d in enumerate(dates):
    if not isinstance(d, str):
      raise InputTypeError(f"dates[{i}] must be a string, got {type(d).__name__}")
  _check_encodable(dates, "dates")
  return dates


def scope_label(names: Sequence[str]) -> str:
  """`scope 'a'` or `scopes ['a', 'b']`, for messages."""
  return f"scope {names[0]!r}" if len(names) == 1 else f"scopes {list(names)!r}"


class ScopeFilter(NamedTuple):
  """A query's scope spec against one bank's scope table.

  Attributes:
    names: the scope names asked for.
    codes: their scope codes in the bank (sorted; unknown names have none).
    allowed: `[S']` bool, True at those codes, `S'` the number of scopes padded to a power of two.
  """
  names: tuple[str, ...]
  codes: tuple[int, ...]
  allowed: np.ndarray


# ------------------------------------------------------------------------------------------------
# jitted kernels (compiled once per capacity C and query count)


def _candidates(queries, emb, valid, stores, scopes, allowed, rows, mask, k, multistore):
  """Traced: `(rows [q, K], mask [q, K], embeddings [q, K, d] float32)` of `[q, d]` queries, by the
  exact search (`rows is None`) or for the rows an ANN searcher found; with `allowed [S']` (a
  `ScopeFilter`'s) only rows whose scope code `scopes [C]` is allowed (None: every scope). The
  gather reads the bank through an optimisation barrier: otherwise XLA shares one float32 widening
  of a bfloat16 bank between the search and the gather and materialises it (~8x slower)."""
  if allowed is not None:
    valid = valid & allowed[scopes]
    if rows is not None:  # (the searcher proposed rows of these scopes only: checked again here)
      mask = mask & valid[jnp.maximum(rows, 0)]
      rows = jnp.where(mask, rows, -1)
  if rows is None:
    if multistore:
      rows, _, mask = retrieval_lib.top_k_search(queries, emb, valid, k, stores)
    else:  # dialogue memories only (store 0), as the benchmark pipeline
      rows, _, mask = retrieval_lib.top_k_search(queries, emb, valid & (stores == 0), k)
  elif rows.shape[1] > k:  # an ANN searcher's `rerank * K` proposals: keep the exact top K
    rows, mask = _rerank(queries, emb, stores, rows, mask, k, multistore)
  return rows, mask, _rows_of(jax.lax.optimization_barrier(emb), rows, mask)


def _rerank(queries, emb, stores, rows, mask, k, multistore):
  """The exact top-`k` (per store: top-`k/2` of each, merged) of proposed rows `[q, R]`."""
  cands = _rows_of(emb, rows, mask)  # [q, R, d]
  scores = jnp.einsum("qd,qrd->qr", queries.astype(jnp.float32), cands)
  if multistore:
    row_stores = stores[jnp.maximum(rows, 0)]
    groups = [(mask & (row_stores == s), k // 2) for s in (0, 1)]
  else:
    groups = [(mask, k)]
  lists = []
  for ok, per in groups:
    vals, pos = jax.lax.top_k(jnp.where(ok, scores, -jnp.inf), per)
    lists.append((vals, jnp.take_along_axis(rows, pos, 1)))
  vals = jnp.concatenate([v for v, _ in lists], 1)
  got = jnp.concatenate([r for _, r in lists], 1)
  vals, order = jax.lax.top_k(vals, k)  # equal scores: store 0 first
  got = jnp.take_along_axis(got, order, 1)
  keep = vals > -jnp.inf
  return jnp.where(keep, got, -1).astype(jnp.int32), keep


def _rows_of(emb, rows, mask):
  """`[..., d]` float32 bank rows (zero where masked)."""
  return jnp.where(mask[..., None], emb[jnp.maximum(rows, 0)].astype(jnp.float32), 0.0)


_gather = jax.jit(_rows_of)


def _pack(rows, mask, cands, slates=None):
  """The outputs of a search as two arrays (one device-to-host copy each): `[q, 2K (+ 2s)]` int32
  (rows, mask, slate, slate mask) and `[q, K d (+ K)]` float32 (candidates' embeddings, z)."""
  q = rows.shape[0]
  ints, floats = [rows, mask.astype(jnp.int32)], [cands.reshape(q, -1)]
  if slates is not None:
    slate, slate_mask, z = slates
    ints += [slate, slate_mask.astype(jnp.int32)]
    floats.append(z)
  return jnp.concatenate(ints, 1), jnp.concatenate(floats, 1)


def _unpack(ints: np.ndarray, floats: np.ndarray, q: int, k: int, d: int, slate_size=None):
  """`_pack`'s outputs, host views of the first `q` queries."""
  ints, floats = ints[:q], floats[:q]
  out = (ints[:, :k], ints[:, k:2 * k].astype(bool), floats[:, :k * d].reshape(q, k, d))
  if slate_size is None:
    return out
  s = slate_size
  return out + ((ints[:, 2 * k:2 * k + s], ints[:, 2 * k + s:].astype(bool), floats[:, k * d:]),)


@functools.partial(jax.jit, static_argnames=("k", "multistore"))
def _search(queries, emb, valid, stores, scopes, allowed, rows, mask, *, k, multistore):
  """`_candidates` as one jitted call (packed, `_pack`)."""
  return _pack(*_candidates(queries, emb, valid, stores, scopes, allowed, rows, mask, k,
                            multistore))


@functools.partial(jax.jit, static_argnames=("k", "multistore", "slate_size", "explore"))
def _search_slates(queries, emb, valid, stores, scopes, allowed, rows, mask, params, hparams, *, k,
                   multistore, slate_size, explore):
  """`_candidates`, then each query's first-round slate (fresh bandit statistics, Alg. 2 line 3)
  in the same jitted call: `_pack(rows, mask, embeddings, (slate, slate_mask, z))`."""
  rows, mask, cands = _candidates(queries, emb, valid, stores, scopes, allowed, rows, mask, k,
                                  multistore)
  fresh = jnp.zeros(mask.shape, jnp.float32)
  stats = explorer_lib.BanditStats(mean=fresh, counts=fresh) if explore else None
  return _pack(rows, mask, cands,
               retrieval_lib.batch_slates(params, queries, cands, mask, slate_size, hparams, stats))


@functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
def _write(emb, valid, stores, scopes, rows, row_stores, row_scopes, row_valid, start):
  """Writes `[m, d]` rows (those with `row_valid`) with their store and scope codes `[m]` at rows
  `start..` of the `[C, d]` bank, in place (the bank's arrays are donated: an add costs the rows it
  writes, not a copy of the bank). Rows of store 2, deleted memories' tombstones
  (`ear_jax.agent.memory.forget`), are written invalid."""
  cap = emb.shape[0]
  at = jnp.where(row_valid, start + jnp.arange(rows.shape[0]), cap)  # C = dropped
  return (emb.at[at].set(rows.astype(emb.dtype), mode="drop"),
          valid.at[at].set(row_stores < 2, mode="drop"),
          stores.at[at].set(row_stores, mode="drop"),
          scopes.at[at].set(row_scopes, mode="drop"))


def rows_digest(ids, texts, codes: np.ndarray, emb: np.ndarray, scopes=None, scope_names=None,
                dates=None) -> str:
  """SHA-256 of bank rows (ids, texts, store codes, float32 embeddings, and, when given, scope
  codes `[n]` with their names and dates): what a saved shard holds. Without scopes and dates it is
  the digest of the shards written before scopes (which load in `DEFAULT_SCOPE`, date "")."""
  h = hashlib.sha256()
  h.update(json.dumps([list(ids), list(texts)], ensure_ascii=False).encode("utf-8"))
  h.update(np.ascontiguousarray(codes, np.int8).tobytes())
  h.update(np.ascontiguousarray(emb, np.float32).tobytes())
  if scopes is not None or scope_names is not None or dates is not None:
    h.update(json.dumps(["scopes", None if scope_names is None else list(scope_names),
                         None if dates is None else list(dates)],
                        ensure_ascii=False).encode("utf-8"))
    if scopes is not None:
      h.update(np.ascontiguousarray(scopes, np.int32).tobytes())
  return h.hexdigest()


def shard_digest(arrays, meta) -> str:
  """`rows_digest` of saved rows `(arrays, meta)` as `Bank.rows` gives them (or an older shard
  without scopes and dates); "" for fields no shard holds (never a shard's digest)."""
  try:
    return rows_digest(meta["ids"], meta["texts"], arrays["stores"], arrays["embeddings"],
                       arrays.get("scopes"), meta.get("scope_names"), meta.get("dates"))
  except (TypeError, ValueError):
    return ""


class Bank:
  """Ids, texts, store and scope codes and dates on the host; `[C, d]` embeddings, mask, stores and
  scope codes on the device.

  Args:
    dim: `d`.
    initial_capacity: rounded up by `capacity_for` (at least `MIN_CAPACITY`).
    dtype: 'float32' or 'bfloat16', the dtype of the device embeddings (bf16 halves the bank's
      memory and bytes read per exact search; candidates and scores are float32 either way).
    index: 'exact' (the device search) or an ANN searcher of `ear_jax.index.ann.SEARCHERS`.
    index_options: keyword options of that searcher (e.g. `{'nprobe': 64}`).
  """

  def __init__(self, dim: int, initial_capacity: int = MIN_CAPACITY, dtype: str = "float32",
               index: str = "exact", index_options: Optional[dict] = None):
    from ear_jax.index import ann  # pylint: disable=g-import-not-at-top
    if dtype not in BANK_DTYPES:
      raise ValueError(f"unknown bank_dtype {dtype!r}; expected one of {sorted(BANK_DTYPES)}")
    if not isinstance(index, str):
      raise InputTypeError(f"index must be a string, got {type(index).__name__}")
    self.dim, self.dtype = int(dim), dtype
    self.index_name, self.index_options = index, dict(index_options or {})
    self.searcher = ann.make_searcher(index, self.dim, self.index_options)
    cap = capacity_for(initial_capacity)
    self.emb = jnp.zeros((cap, self.dim), BANK_DTYPES[dtype])  # [C, d]
    self.valid = jnp.zeros((cap,), bool)  # [C]
    self.stores = jnp.zeros((cap,), jnp.int32)  # [C]
    self.scopes = jnp.zeros((cap,), jnp.int32)  # [C] scope code of each row
    self.ids: list[str] = []
    self.texts: list[str] = []
    self.dates: list[str] = []
    self.store_codes = np.zeros((0,), np.int8)  # [n], host copy of the stores
    self.store_counts = [0, 0]  # memories per store (O(1) `available` at any bank size)
    self.scope_codes = np.zeros((0,), np.int32)  # [n], host copy of the scopes
    self.scope_names: list[str] = [DEFAULT_SCOPE]  # scope code -> name (code 0: the default)
    self.scope_index: dict[str, int] = {DEFAULT_SCOPE: 0}  # name -> scope code
    self.scope_counts = np.zeros((1, 2), np.int64)  # [S, 2] memories per scope and store
    self.row_of: dict[str, int] = {}
    self.digests: dict[tuple[int, int], str] = {}  # (start, count) -> rows_digest, rows are final

  def __len__(self):
    return len(self.ids)

  @property
  def capacity(self) -> int:
    return int(self.emb.shape[0])

  def settings(self) -> dict:
    """The bank's options as `Memory` takes them (saved in checkpoints)."""
    return {"bank_dtype": self.dtype, "index": self.index_name,
            "index_options": dict(self.index_options)}

  def nbytes(self) -> int:
    """Bytes held for the bank's vectors: the device arrays plus any ANN index."""
    dev = sum(int(a.size) * a.dtype.itemsize
              for a in (self.emb, self.valid, self.stores, self.scopes))
    return dev + (self.searcher.nbytes() if self.searcher is not None else 0)

  def default_ids(self, n: int) -> list[str]:
    """`n` free ids `"m<j>"`, `j` counting up from the next row, skipping any taken by an
    explicit id (so `"m<row>"` whenever it is free). A function of the bank's ids alone, so a
    loaded memory gives the same defaults as the one that was saved."""
    ids, j = [], len(self.ids)
    while len(ids) < n:
      if f"m{j}" not in self.row_of:
        ids.append(f"m{j}")
      j += 1
    return ids

  def check_new_ids(self, ids: list[str]) -> None:
    taken = [i for i in ids if i in self.row_of]
    if taken:
      raise ValueError(f"memory ids {taken[:5]} are already in the bank")

  def scope_code(self, name: str) -> int:
    """The code of scope `name`, registered (the next code) when it is new."""
    code = self.scope_index.get(name)
    if code is None:
      code = self.scope_index[name] = len(self.scope_names)
      self.scope_names.append(name)
      self.scope_counts = np.concatenate([self.scope_counts, np.zeros((1, 2), np.int64)])
    return code

  def count_rows(self, codes: np.ndarray, scopes: np.ndarray, sign: int = 1) -> None:
    """Adds (`sign` 1) or removes (-1) rows with store `codes` and scope codes `scopes` from the
    per-store and per-scope counts (rows of store 2, tombstones, count nowhere)."""
    live = codes < 2
    np.add.at(self.scope_counts, (scopes[live], codes[live].astype(np.int64)), sign)
    self.store_counts = [c + sign * int((codes == s).sum()) for s, c in enumerate(self.store_counts)]

  def append(self, ids: list[str], texts: list[str], codes: np.ndarray, emb: np.ndarray,
             scopes: Optional[Sequence[str]] = None,
             dates: Optional[Sequence[str]] = None) -> None:
    """Appends validated memories (`check_new_ids` first); grows `C` when it is too small.

    Args:
      ids, texts: `n` each.
      codes: `[n]` store codes.
      emb: `[n, d]` unit rows.
      scopes: `n` scope names (None: `DEFAULT_SCOPE`).
      dates: `n` dates (None: "").
    """
    n, start = len(ids), len(self.ids)
    scopes = [DEFAULT_SCOPE] * n if scopes is None else list(scopes)
    dates = [""] * n if dates is None else list(dates)
    if len(scopes) != n or len(dates) != n:
      raise ValueError(f"{len(scopes)} scopes / {len(dates)} dates for {n} memories")
    scope_codes = np.asarray([self.scope_code(x) for x in scopes], np.int32).reshape(n)
    if start + n > self.capacity:
      cap = capacity_for(start + n, self.capacity)
      grow = lambda a: jnp.concatenate([a, jnp.zeros((cap - a.shape[0],) + a.shape[1:], a.dtype)])
      self.emb, self.valid, self.stores = grow(self.emb), grow(self.valid), grow(self.stores)
      self.scopes = grow(self.scopes)
    m = pow2_at_least(n)  # the write compiles once per power-of-two batch size
    pad = lambda a: np.concatenate([a, np.zeros((m - n,) + a.shape[1:], a.dtype)])
    self.emb, self.valid, self.stores, self.scopes = _write(
        self.emb, self.valid, self.stores, self.scopes, pad(emb), pad(codes.astype(np.int32)),
        pad(scope_codes), np.arange(m) < n, np.int32(start))
    if self.searcher is not None:
      self.searcher.add(emb, codes, start)
    for j, i in enumerate(ids):
      self.row_of[i] = start + j
    self.ids.extend(ids)
    self.texts.extend(texts)
    self.dates.extend(dates)
    self.store_codes = np.concatenate([self.store_codes, codes.astype(np.int8)])
    self.scope_codes = np.concatenate([self.scope_codes, scope_codes])
    self.count_rows(codes.astype(np.int8), scope_codes)

  def scope_filter(self, scope: Optional[Sequence[str]]) -> Optional[ScopeFilter]:
    """The `ScopeFilter` of a checked scope spec (`check_scope_spec`); None for every scope."""
    if scope is None:
      return None
    names = tuple(scope)
    codes = tuple(sorted({self.scope_index[x] for x in names if x in self.scope_index}))
    allowed = np.zeros(pow2_at_least(len(self.scope_names)), bool)
    allowed[list(codes)] = True
    return ScopeFilter(names, codes, allowed)

  def available(self, num_candidates: int, multistore: bool,
                scope: Optional[Sequence[str]] = None) -> int:
    """How many candidates a query can get: `min(n_dialogue, K)`, or per store `min(., K/2)`,
    counting the memories of the scopes `scope` names (None: every scope)."""
    counts = self.store_counts
    if scope is not None:
      codes = list(self.scope_filter(scope).codes)
      counts = [int(c) for c in self.scope_counts[codes].sum(0)] if codes else [0, 0]
    if not multistore:
      return min(counts[0], num_candidates)
    return sum(min(c, num_candidates // 2) for c in counts)

  def check_k(self, k: int, num_candidates: int, multistore: bool,
              scope: Optional[Sequence[str]] = None) -> None:
    """ValueError when a query (of the scopes `scope` names; None: every scope) cannot get `k`
    candidates from this bank."""
    avail = self.available(num_candidates, multistore, scope)
    if k <= avail:
      return
    if scope is None:  # (the live memories: deleted ones leave tombstone rows)
      of, where, held = "", "the bank", sum(self.store_counts)
    else:
      where = scope_label(tuple(scope))
      of = " of " + where
      codes = list(self.scope_filter(scope).codes)
      held = int(self.scope_counts[codes].sum()) if codes else 0
    if avail == 0:
      if scope is None and not held and len(self):
        empty = "the memory holds no memories (all were deleted)"
      elif multistore or not held:
        empty = "the bank is empty" if scope is None else f"{where} holds no memories"
      elif scope is None:  # (the message of a bank without scopes, unchanged)
        empty = ("the bank is empty of dialogue memories (observations are candidates only with "
                 "multistore)")
      else:
        empty = (f"{where} holds no dialogue memories (observations are candidates only with "
                 "multistore)")
      raise ValueError(f"k={k} is larger than the memory bank{of}: {empty}")
    raise ValueError(f"k={k} is larger than the memory bank{of}: only {avail} memories can be "
                     f"retrieved ({held} in {where})")

  def search(self, queries: np.ndarray, num_candidates: int, multistore: bool, slate=None,
             scope: Optional[Sequence[str]] = None):
    """Top-K candidates of `[q, d]` unit queries (see the module docstring), by the exact device
    search or the ANN searcher, in one jitted call and two host copies (`_pack`).

    Args:
      queries: `[q, d]` unit queries.
      num_candidates: `K`.
      multistore: the top-K/2 of each store instead of the dialogue memories' top-K.
      slate: optional `(params, hparams, slate_size, explore)`: also each query's first-round slate
        (adapter top-s, or an Explorer round from fresh bandit statistics), computed in the same
        call as the search.
      scope: the scope names the candidates come from (`check_scope_spec`; None: every scope).

    Returns:
      `(rows [q, K] int32 (-1 = padding), mask [q, K] bool, embeddings [q, K, d] float32)`, numpy,
      best first; with `slate` a fourth element `(slate [q, s] int32, slate_mask [q, s] bool,
      z [q, K] float32)`.
    """
    q = queries.shape[0]
    q_pad = pow2_at_least(q)
    padded = np.asarray(queries, np.float32)
    if q_pad != q:
      padded = np.concatenate([padded, np.zeros((q_pad - q, self.dim), np.float32)])
    rows = mask = None
    filt = self.scope_filter(scope)
    allowed = None if filt is None else filt.allowed
    if self.searcher is not None:  # (the q queries only: a zero padding query finds nothing)
      found = self.searcher.search(
          padded[:q], num_candidates * self.searcher.rerank, multistore,
          scopes=None if filt is None else (filt.codes, self.scope_codes))
      if found is not None:  # (None: the exact search does it, see `ann.FaissSearcher.search`)
        rows, mask = (np.concatenate([a, np.full((q_pad - q,) + a.shape[1:], fill, a.dtype)])
                      for a, fill in zip(found, (-1, False)))
    args = (padded, self.emb, self.valid, self.stores, self.scopes, allowed, rows, mask)
    size = None
    if slate is None:
      out = _search(*args, k=num_candidates, multistore=multistore)
    else:
      params, hparams, size, explore = slate
      out = _search_slates(*args, params, hparams if explore else None, k=num_candidates,
                           multistore=multistore, slate_size=int(size), explore=bool(explore))
    ints, floats = (np.asarray(a) for a in out)  # (jax.device_get costs ~0.1 ms more here)
    return _unpack(ints, floats, q, num_candidates, self.dim, size)

  def gather(self, rows, mask, where: str) -> jax.Array:
    """`[n, K, d]` float32 device array of bank rows `rows [n, K]` (zero where not `mask`), exactly
    the candidates' embeddings `search` gave for them; ValueError naming `where` for rows outside
    the bank (what checkpoints store instead of candidates' embeddings)."""
    rows, mask = np.asarray(rows), np.asarray(mask)
    if rows.ndim != 2 or rows.shape != mask.shape or mask.dtype != bool:
      raise ValueError(f"{where}: candidate rows {rows.shape} and mask {mask.shape} "
                       f"({mask.dtype}) do not match")
    if (mask & ((rows < 0) | (rows >= len(self)))).any():
      raise ValueError(f"{where}: candidate rows outside the bank's {len(self)} memories")
    return _gather(self.emb, rows.astype(np.int32), mask)

  def embeddings(self, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
    """`[n, d]` the frozen (pre-adapter) unit embeddings of rows `start:stop` (a float32 host
    copy)."""
    stop = len(self.ids) if stop is None else stop
    return np.asarray(self.emb[start:stop].astype(jnp.float32))

  def describe(self, rows) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """`(ids, texts, store names)` of bank rows (a deleted memory's row, a tombstone: its
    tombstone id, "" and 'deleted'; `Memory.recall` never shows one, `recall._answer`)."""
    rows = [int(r) for r in rows]
    names = STORE_NAMES + ("deleted",)  # (store code 2: `forget.DELETED`)
    return (tuple(self.ids[r] for r in rows), tuple(self.texts[r] for r in rows),
            tuple(names[int(self.store_codes[r])] for r in rows))

  def records(self, rows) -> list[dict]:
    """`[{'id', 'text', 'store', 'scope', 'date'}]` of (live) bank rows, in order."""
    return [{"id": self.ids[r], "text": self.texts[r],
             "store": STORE_NAMES[int(self.store_codes[r])],
             "scope": self.scope_names[int(self.scope_codes[r])], "date": self.dates[r]}
            for r in (int(r) for r in rows)]

  # ----------------------------------------------------------------------------------------------
  # rows for snapshots and shards (`ear_jax.agent.memory.persistence`)

  def rows(self, start: int, stop: int):
    """`(arrays, meta)` of rows `start:stop`: embeddings (float32), stores and scope codes `[m]`
    int32 (codes into `meta['scope_names']`, this run's own table of the scopes it uses); ids,
    texts, scope names and dates."""
    codes = self.scope_codes[start:stop]
    used, local = np.unique(codes, return_inverse=True)
    arrays = {"embeddings": self.embeddings(start, stop),
              "stores": self.store_codes[start:stop].copy(),
              "scopes": local.reshape(-1).astype(np.int32)}
    return arrays, {"ids": self.ids[start:stop], "texts": self.texts[start:stop],
                    "scope_names": [self.scope_names[int(c)] for c in used],
                    "dates": self.dates[start:stop]}

  def digest(self, start: int, stop: int) -> str:
    """`shard_digest` of rows `start:stop` (cached: rows never change once appended)."""
    key = (int(start), int(stop) - int(start))
    if key not in self.digests:
      self.digests[key] = shard_digest(*self.rows(start, stop))
    return self.digests[key]

  def extend_rows(self, arrays, meta, where: str) -> None:
    """Appends saved rows (a snapshot or a shard); ValueError naming `where` when they disagree."""
    ids, texts = list(meta["ids"]), list(meta["texts"])
    n = len(ids)
    if len(texts) != n:
      raise ValueError(f"{where}: {n} memory ids but {len(texts)} texts")
    if not n:
      return
    emb = np.asarray(arrays["embeddings"], np.float32)
    codes = np.asarray(arrays["stores"]).astype(np.int8)
    if emb.shape != (n, self.dim) or codes.shape != (n,):
      raise ValueError(f"{where}: bank embeddings {emb.shape} / stores {codes.shape} do not "
                       f"match {n} memories of dimension {self.dim}")
    dup = [i for i in ids if i in self.row_of]
    if dup or len(set(ids)) != n:
      raise ValueError(f"{where}: duplicate memory ids {dup[:5]}")
    scopes, dates = _saved_scopes(arrays, meta, n, where)
    self.append(ids, texts, codes, emb, scopes, dates)


def _saved_scopes(arrays, meta, n: int, where: str):
  """`(scope names [n] or None, dates [n] or None)` of saved rows (None: rows saved before scopes
  and dates, which are in `DEFAULT_SCOPE` with date ""); ValueError naming `where`."""
  names, dates = meta.get("scope_names"), meta.get("dates")
  scopes = None
  if "scopes" in arrays or names is not None:
    local = np.asarray(arrays.get("scopes", ()))
    if (not isinstance(names, list) or not all(isinstance(x, str) and x for x in names)
        or local.shape != (n,) or not np.issubdtype(local.dtype, np.integer)
        or (n and (local.min() < 0 or local.max() >= len(names)))):
      raise ValueError(f"{where}: the rows' scopes (codes {local.shape} into "
                       f"{len(names) if isinstance(names, list) else names!r} names) do not "
                       f"match {n} memories")
    scopes = [names[int(c)] for c in local]
  if dates is not None and (not isinstance(dates, list) or len(dates) != n
                            or not all(isinstance(x, str) for x in dates)):
    raise ValueError(f"{where}: field 'dates' is not {n} strings")
  return scopes, dates
