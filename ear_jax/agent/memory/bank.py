"""The device bank of `Memory` (`[C, d]` embeddings with their masks, pure functions) and its
search. Ids, texts and files live in `table.Table`; scope names and rows in `scopes`.

Symbols: `C` capacity (`capacity_for`), `d` dimension, `K` candidates, `s` slate size, `q`
queries of one call (padded to a power of two), `S` scope codes, `P` gathered scope rows.

Rows are the table's device rows (0-based, never reused; a deleted row stays a zero, invalid
tombstone). `write` / `tombstone` are jitted with the bank donated. `search` is ONE jitted call
(search, gather, optionally each query's first-round slate) read back in two host copies. The
exact search is `core.retrieval.top_k_search` (ties: lower row first) over dialogue memories
(store 0), or each store's top-K/2 with `multistore`; rows of other scopes are never candidates.
Gathering a small scope's rows, an ANN `searcher`'s re-scored proposals, and per-query scope specs
all give the masked full scan's answer (`tests/test_scoped_search.py`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory.checks import InputTypeError
from ear_jax.core import explorer as explorer_lib
from ear_jax.core import retrieval as retrieval_lib
from ear_jax.index import ann

BANK_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
MIN_CAPACITY = 32
FINE_CAPACITY = 4096  # beyond this the capacity grows in quarter steps (`capacity_for`)
# A scoped search gathers its scopes' rows (`scope_candidates`) when their count, padded to a
# power of two, is at most 1 / GATHER_SHARE of the capacity (there gathering ties or beats the
# masked scan of the whole bank).
GATHER_SHARE = 4
Searcher = ann.FaissSearcher  # the ANN hookup (`ear_jax.index.ann`'s module docstring)


def pow2_at_least(n: int, minimum: int = 1) -> int:
  """The smallest power of two `>= max(n, minimum, 1)`."""
  n = max(n, minimum, 1)
  return 1 << (n - 1).bit_length()


def capacity_for(n: int, minimum: int = MIN_CAPACITY) -> int:
  """The bank capacity `C` for `n` rows: a power of two, then quarter steps past `FINE_CAPACITY`."""
  n = max(n, minimum, 1)
  if n <= FINE_CAPACITY:
    return pow2_at_least(n)
  step = 1 << (n.bit_length() - 3)  # a quarter of the power of two <= n
  return -(-n // step) * step


# ------------------------------------------------------------------------------------------------
# the device bank


class DeviceBank(NamedTuple):
  """The bank's device arrays (a pytree; `C` capacity, `d` dimension)."""
  emb: jax.Array  # [C, d] bank dtype, unit rows (zero where never written or tombstoned)
  valid: jax.Array  # [C] bool, the live rows
  stores: jax.Array  # [C] int8 store code (0 dialogue / episodic, 1 observation / semantic)
  scopes: jax.Array  # [C] int32 scope code (`ScopeNames`)


def empty(dim: int, capacity: int = MIN_CAPACITY, dtype: str = "float32") -> DeviceBank:
  """An empty bank of `capacity_for(capacity)` rows; ValueError for an unknown `dtype`."""
  if dtype not in BANK_DTYPES:
    raise ValueError(f"unknown bank_dtype {dtype!r}; expected one of {sorted(BANK_DTYPES)}")
  cap = capacity_for(capacity)
  return DeviceBank(jnp.zeros((cap, int(dim)), BANK_DTYPES[dtype]), jnp.zeros((cap,), bool),
                    jnp.zeros((cap,), jnp.int8), jnp.zeros((cap,), jnp.int32))


def grow(bank: DeviceBank, rows: int) -> DeviceBank:
  """A bank holding rows `< rows`: `bank` itself, or a copy into `capacity_for(rows, C)` rows."""
  cap = bank.emb.shape[0]
  if rows <= cap:
    return bank
  new = capacity_for(rows, cap)
  return DeviceBank(*(jnp.concatenate([a, jnp.zeros((new - cap,) + a.shape[1:], a.dtype)])
                      for a in bank))


def _padded_rows(rows, cap: int) -> np.ndarray:
  """`[m]` int32 rows padded to a power of two with `cap` (dropped by the scatters)."""
  rows = np.asarray(rows, np.int64).reshape(-1)
  return np.concatenate([rows, np.full(pow2_at_least(len(rows)) - len(rows), cap)]).astype(np.int32)


@functools.partial(jax.jit, donate_argnums=0)
def _write(bank, at, emb, stores, scopes):
  return DeviceBank(bank.emb.at[at].set(emb.astype(bank.emb.dtype), mode="drop"),
                    bank.valid.at[at].set(True, mode="drop"),
                    bank.stores.at[at].set(stores, mode="drop"),
                    bank.scopes.at[at].set(scopes, mode="drop"))


@functools.partial(jax.jit, donate_argnums=0)
def _tombstone(bank, at):
  return DeviceBank(bank.emb.at[at].set(0, mode="drop"), bank.valid.at[at].set(False, mode="drop"),
                    bank.stores.at[at].set(0, mode="drop"), bank.scopes.at[at].set(0, mode="drop"))


def write(bank: DeviceBank, rows, emb, stores, scopes) -> DeviceBank:
  """Writes `[n, d]` unit rows and their `[n]` codes at `rows [n]`, growing; `bank` is donated."""
  rows = np.asarray(rows, np.int64).reshape(-1)
  if not len(rows):
    return bank
  bank = grow(bank, int(rows.max()) + 1)
  at = _padded_rows(rows, bank.emb.shape[0])
  pad = lambda a, t: np.concatenate([np.asarray(a, t), np.zeros((len(at) - len(rows),)
                                                                   + np.shape(a)[1:], t)])
  return _write(bank, at, pad(emb, np.float32), pad(stores, np.int8), pad(scopes, np.int32))


def tombstone(bank: DeviceBank, rows) -> DeviceBank:
  """Zeroes and invalidates device `rows [n]`, in place: `bank` is donated."""
  if not np.size(rows):
    return bank
  return _tombstone(bank, _padded_rows(rows, bank.emb.shape[0]))


def _rows_of(emb, rows, mask):
  """`[..., d]` float32 bank rows (zero where masked)."""
  return jnp.where(mask[..., None], emb[jnp.maximum(rows, 0)].astype(jnp.float32), 0.0)


@jax.jit
def gather(bank: DeviceBank, rows, mask) -> jax.Array:
  """`[n, K, d]` float32 bank rows `rows [n, K]` (zero where not `mask [n, K]`)."""
  return _rows_of(bank.emb, rows, mask)


# ------------------------------------------------------------------------------------------------
# the search (one jitted call)


def _rerank(queries, emb, stores, rows, mask, k, multistore):
  """The exact top-`k` (per store: top-`k/2` of each, merged) of proposed rows `[q, R]`."""
  scores = jnp.einsum("qd,qrd->qr", queries.astype(jnp.float32), _rows_of(emb, rows, mask))
  if multistore:
    row_stores = stores[jnp.maximum(rows, 0)]
    groups = [(mask & (row_stores == s), k // 2) for s in (0, 1)]
  else:
    groups = [(mask, k)]
  lists = []
  for ok, per in groups:
    vals, pos = jax.lax.top_k(jnp.where(ok, scores, -jnp.inf), per)
    lists.append((vals, jnp.take_along_axis(rows, pos, 1)))
  vals, order = jax.lax.top_k(jnp.concatenate([v for v, _ in lists], 1), k)  # ties: store 0
  got = jnp.take_along_axis(jnp.concatenate([r for _, r in lists], 1), order, 1)
  keep = vals > -jnp.inf
  return jnp.where(keep, got, -1).astype(jnp.int32), keep


def _pack(rows, mask, cands, slates=None):
  """A search's outputs as `[q, 2K (+ 2s)]` int32 and `[q, K w (+ K)]` float32 (two host copies)."""
  q = rows.shape[0]
  ints, floats = [rows, mask.astype(jnp.int32)], [cands.reshape(q, -1)]
  if slates is not None:
    slate, slate_mask, z = slates
    ints += [slate, slate_mask.astype(jnp.int32)]
    floats.append(z)
  return jnp.concatenate(ints, 1), jnp.concatenate(floats, 1)


def finish(queries, emb, rows, mask, features=None, slate=None):
  """Traced: candidates `[q, K, d (+ F)]` and, with `slate`, each query's first-round slate,
  `_pack`ed (the optimisation barrier keeps XLA from materialising a float32 copy of the bank)."""
  cands = _rows_of(jax.lax.optimization_barrier(emb), rows, mask)
  if features is not None:
    cands = jnp.concatenate([cands, features.astype(jnp.float32)], -1)
  if slate is None:
    return _pack(rows, mask, cands)
  params, hparams, size, explore = slate
  fresh = jnp.zeros(mask.shape, jnp.float32)
  stats = explorer_lib.BanditStats(mean=fresh, counts=fresh) if explore else None
  return _pack(rows, mask, cands, retrieval_lib.batch_slates(
      params, queries, cands, mask, size, hparams if explore else None, stats))


def gathered(bank: DeviceBank, allowed, cand):
  """Traced: `(emb [P, d], valid [P], stores [P])` at rows `cand [P]` (row order: same ties), or
  the whole bank's (`P = C`) when `cand` is None; `valid`: the live rows of the scopes `allowed`."""
  if cand is None:
    valid = bank.valid if allowed is None else bank.valid & allowed[bank.scopes]
    return bank.emb, valid, bank.stores
  cap = bank.emb.shape[0]
  at = jnp.minimum(cand, cap - 1)
  valid = (cand < cap) & bank.valid[at]
  if allowed is not None:
    valid = valid & allowed[bank.scopes[at]]
  return bank.emb[at], valid, bank.stores[at]


def rows_at(cand, pos, mask):
  """Traced: the bank rows `[q, K]` at positions `pos [q, K]` of `cand [P]` (-1 where masked)."""
  return jnp.where(mask, cand[jnp.maximum(pos, 0)], -1).astype(jnp.int32)


def _candidates(queries, bank, allowed, rows, mask, cand, k, multistore):
  """Traced `(rows [q, K], mask [q, K])`: exact search, or the re-score of a searcher's `rows`."""
  if rows is None:
    emb, valid, stores = gathered(bank, allowed, cand)
    if multistore:
      rows, _, mask = retrieval_lib.top_k_search(queries, emb, valid, k, stores)
    else:  # dialogue memories only (store 0), as the benchmark pipeline
      rows, _, mask = retrieval_lib.top_k_search(queries, emb, valid & (stores == 0), k)
    if cand is not None:
      rows = rows_at(cand, rows, mask)
    return rows, mask
  # (the searcher proposed live rows of these scopes: checked again here)
  valid = bank.valid if allowed is None else bank.valid & allowed[bank.scopes]
  mask = mask & valid[jnp.maximum(rows, 0)]
  rows = jnp.where(mask, rows, -1)
  if rows.shape[1] > k:  # `rerank * K` proposals: keep the exact top K
    rows, mask = _rerank(queries, bank.emb, bank.stores, rows, mask, k, multistore)
  return rows, mask


def per_query(fn, queries, allowed, cand, *batched):
  """Traced: `fn(queries, allowed, cand, *batched)`, vmapped when each query has its own spec."""
  if allowed is None or allowed.ndim == 1:
    return fn(queries, allowed, cand, *batched)
  lead = lambda x: None if x is None else x[None]
  one = lambda q, a, c, *xs: tuple(y[0] for y in fn(q[None], a, c, *map(lead, xs)))
  return jax.vmap(one)(queries, allowed, cand, *batched)


@functools.partial(jax.jit, static_argnames=("k", "multistore", "slate_size", "explore"))
def _search(queries, bank, allowed, rows, mask, cand, params, hparams, *, k, multistore,
            slate_size, explore):
  """`_candidates` (per query with `allowed [q, S]`: `per_query`), then `finish`."""
  rows, mask = per_query(lambda q, a, c, r, m: _candidates(q, bank, a, r, m, c, k, multistore),
                         queries, allowed, cand, rows, mask)
  slate = None if slate_size is None else (params, hparams, slate_size, explore)
  return finish(queries, bank.emb, rows, mask, slate=slate)


def pad_queries(queries) -> np.ndarray:
  """`[q', d]` float32: `[q, d]` queries padded with zero rows to a power of two `q'`."""
  queries = np.asarray(queries, np.float32)
  q = queries.shape[0]
  return np.concatenate([queries, np.zeros((pow2_at_least(q) - q, queries.shape[1]), np.float32)])


def unpack(packed, q: int, k: int, width: int, slate_size: Optional[int] = None):
  """`_pack`'s outputs as host arrays of the first `q` queries (rows, mask, cands, slates)."""
  ints, floats = (np.asarray(a)[:q] for a in packed)
  out = (ints[:, :k], ints[:, k:2 * k].astype(bool), floats[:, :k * width].reshape(q, k, width))
  if slate_size is None:
    return out + (None,)
  s = slate_size
  return out + ((ints[:, 2 * k:2 * k + s], ints[:, 2 * k + s:].astype(bool),
                 floats[:, k * width:]),)


def search(bank: DeviceBank, queries, *, k: int, multistore: bool, allowed=None, slate=None,
           searcher: Optional[Searcher] = None, scope_rows=None):
  """Top-K candidates of `[q, d]` unit queries in one jitted call (see the module docstring).

  `allowed`: `[S]` bool (`ScopeNames.allowed`), None (every scope), or a list of `q` such specs,
  one per query. `scope_rows`: the bank's `ScopeRows` (a small scope's rows are gathered).
  `slate = (params, hparams, s, explore)`: also each query's first-round slate.

  Returns:
    `(rows [q, K] int32 (-1 = padding), mask [q, K] bool, cands [q, K, d] float32, slates)`,
    numpy, best first; `slates`: `(slate [q, s] int32, slate_mask [q, s] bool, z [q, K]
    float32)`, or None without `slate`.
  """
  q, padded = len(queries), pad_queries(queries)
  cand = scope_candidates(scope_rows, allowed, bank.emb.shape[0], len(padded))
  rows = mask = None
  if searcher is not None and cand is None:  # (the q queries only: a zero query finds nothing)
    found = _proposals(searcher, padded[:q], k * searcher.rerank, multistore, allowed)
    if found is not None:
      rows, mask = (np.concatenate([a, np.full((len(padded) - q,) + a.shape[1:], fill, a.dtype)])
                    for a, fill in zip(found, (-1, False)))
  params, hparams, size, explore = slate if slate is not None else (None, None, None, False)
  out = _search(padded, bank, query_allowed(allowed, len(padded)), rows, mask, cand, params,
                hparams if explore else None, k=k, multistore=multistore,
                slate_size=None if size is None else int(size), explore=bool(explore))
  return unpack(out, q, k, bank.emb.shape[1], size)


def _proposals(searcher: Searcher, queries, r: int, multistore: bool, allowed):
  """The searcher's `(rows [q, r], mask [q, r])`, or None (search exactly) if any answer is None."""
  if not isinstance(allowed, list):
    return searcher.search(queries, r, multistore, allowed)
  parts = [searcher.search(queries[i:i + 1], r, multistore, a) for i, a in enumerate(allowed)]
  if any(p is None for p in parts):
    return None
  return tuple(np.concatenate(x) for x in zip(*parts))


def query_allowed(allowed, num_padded: int):
  """`allowed` for the jitted search: per-query specs as `[num_padded, S]` bool (or None)."""
  if not isinstance(allowed, list):
    return allowed
  width = {len(a) for a in allowed if a is not None}
  if not width:
    return None
  if len(width) > 1:
    raise ValueError(f"per-query scope specs of different widths {sorted(width)} (one "
                     "ScopeNames makes them all)")
  out = np.zeros((num_padded, width.pop()), bool)
  for i, a in enumerate(allowed):
    out[i] = True if a is None else a
  return out


def scope_candidates(scope_rows, allowed, capacity: int,
                     num_padded: Optional[int] = None) -> Optional[np.ndarray]:
  """`[P]` rows of the scopes `allowed`, ascending, padded with `capacity` (`[num_padded, P]`
  per query); None (scan the whole bank) when unscoped or `P > capacity / GATHER_SHARE`."""
  if scope_rows is None or allowed is None:
    return None
  specs = allowed if isinstance(allowed, list) else [allowed]
  if any(a is None for a in specs):
    return None
  sizes = [scope_rows.size(a) for a in specs]
  p = pow2_at_least(max(sizes), MIN_CAPACITY)
  if p * GATHER_SHARE > capacity:
    return None
  per = isinstance(allowed, list)
  rows = (num_padded or len(specs)) if per else 1
  cand = np.full((rows, p), capacity, np.int32)
  for i, (a, n) in enumerate(zip(specs, sizes)):
    cand[i, :n] = scope_rows.of(a)
  return cand if per else cand[0]


def ann_searcher(name: str, options, dim: int) -> Optional[Searcher]:
  """The ANN searcher of index `name` (None for 'exact'); ValueError naming the known ones."""
  if not isinstance(name, str):
    raise InputTypeError(f"index must be a string, got {type(name).__name__}")
  return ann.make_searcher(name, dim, options)
