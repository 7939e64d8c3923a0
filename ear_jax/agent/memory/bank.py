"""The device bank of `Memory` (`[C, d]` embeddings with their masks, pure functions) and its
search. Ids, texts and files live in the table (`table.Table`); scope names and each scope's rows
in `scopes` (`ScopeNames`, `ScopeRows`).

Symbols: `C` capacity (`capacity_for`), `d` dimension, `K` candidates, `s` slate size, `q`
queries of one call (padded to a power of two), `S` scope codes (padded to a power of two).

Rows are the table's device rows (0-based, never reused): a deleted memory's row stays a
tombstone (zero, invalid). `write` / `tombstone` are jitted with the bank donated (an add costs
the rows it writes), batches padded to a power of two; `write` grows the bank when a row is
beyond it. `search` is ONE jitted call (the search, the gather and, with `slate = (params,
hparams, s, explore)`, each query's first-round slate) read back in two host copies (`_pack`).
The exact search is `core.retrieval.top_k_search`, the benchmark pipeline's (ties: lower row
first): only dialogue memories (store 0) are candidates, or with `multistore` the top-K/2 of each
store (Section 5). A query's `allowed` mask over scope codes is ANDed with `valid` inside the
call, so rows of other scopes are never candidates. When the scopes hold few rows
(`scope_candidates`) the call gathers those `[P, d]` rows and runs the same top-K over them (the
masked scan's answer: same rows, same order; `tests/test_scoped_search.py`). An ANN `searcher`
(`ear_jax.index.ann`) proposes `rerank * K` rows that the same call re-scores exactly; when it
answers None (it cannot filter, few rows of the scopes) the batch is searched exactly. `allowed`
may be a list of per-query specs (several users' questions in one call, `per_query`): each query
is searched on its own scopes, the same answer as each spec's own call.
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
# power of two, is at most 1 / GATHER_SHARE of the capacity. Measured (BENCHMARKS.md "Scoped search
# at scale", 6,000 memories in 10 scopes: 1,024 padded rows of 6,144, which 8 (before) scanned):
# gathered p50 0.55 / 0.89 / 0.87 ms against the masked scan's 0.56 / 0.91 / 1.06 (exact / bm25 /
# hybrid): a tie for the exact search, faster for hybrid.
GATHER_SHARE = 4
Searcher = ann.FaissSearcher  # the ANN hookup (`ear_jax.index.ann`'s module docstring)


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
# the device bank


class DeviceBank(NamedTuple):
  """The bank's device arrays (a pytree; `C` capacity, `d` dimension)."""
  emb: jax.Array  # [C, d] bank dtype, unit rows (zero where never written or tombstoned)
  valid: jax.Array  # [C] bool, the live rows
  stores: jax.Array  # [C] int8 store code (0 dialogue / episodic, 1 observation / semantic)
  scopes: jax.Array  # [C] int32 scope code (`ScopeNames`)
  # The "context" features' inputs (`first_stage.Context`; -1 = unknown / none):
  sessions: jax.Array  # [C] int32 session code of the row (its date's, `front`)
  speakers: jax.Array  # [C] int32 term id of the row's speaker (`lexical_bank.speakers`)
  turns: jax.Array  # [C] int32 the row's place among its session's rows (`first_stage.Context`)


def empty(dim: int, capacity: int = MIN_CAPACITY, dtype: str = "float32") -> DeviceBank:
  """An empty bank of `capacity_for(capacity)` rows; ValueError for an unknown `dtype`."""
  if dtype not in BANK_DTYPES:
    raise ValueError(f"unknown bank_dtype {dtype!r}; expected one of {sorted(BANK_DTYPES)}")
  cap = capacity_for(capacity)
  return DeviceBank(jnp.zeros((cap, int(dim)), BANK_DTYPES[dtype]), jnp.zeros((cap,), bool),
                    jnp.zeros((cap,), jnp.int8), jnp.zeros((cap,), jnp.int32),
                    jnp.full((cap,), -1, jnp.int32), jnp.full((cap,), -1, jnp.int32),
                    jnp.full((cap,), -1, jnp.int32))


def grow(bank: DeviceBank, rows: int) -> DeviceBank:
  """A bank holding rows `< rows`: `bank` itself when it does, else a copy into
  `capacity_for(rows, C)` rows (the new rows empty)."""
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
def _write(bank, at, emb, stores, scopes, sessions, speakers, turns):
  return DeviceBank(bank.emb.at[at].set(emb.astype(bank.emb.dtype), mode="drop"),
                    bank.valid.at[at].set(True, mode="drop"),
                    bank.stores.at[at].set(stores, mode="drop"),
                    bank.scopes.at[at].set(scopes, mode="drop"),
                    bank.sessions.at[at].set(sessions, mode="drop"),
                    bank.speakers.at[at].set(speakers, mode="drop"),
                    bank.turns.at[at].set(turns, mode="drop"))


@functools.partial(jax.jit, donate_argnums=0)
def _tombstone(bank, at):
  return DeviceBank(bank.emb.at[at].set(0, mode="drop"), bank.valid.at[at].set(False, mode="drop"),
                    bank.stores.at[at].set(0, mode="drop"), bank.scopes.at[at].set(0, mode="drop"),
                    bank.sessions.at[at].set(-1, mode="drop"),
                    bank.speakers.at[at].set(-1, mode="drop"),
                    bank.turns.at[at].set(-1, mode="drop"))


def write(bank: DeviceBank, rows, emb, stores, scopes, sessions=None, speakers=None,
          turns=None) -> DeviceBank:
  """Writes `[n, d]` unit rows with store codes `[n]`, scope codes `[n]` and (None: -1) session,
  speaker and turn codes `[n]` (`first_stage.Context`) at device `rows [n]` (growing the bank
  when a row is beyond it), in place: `bank` is donated."""
  rows = np.asarray(rows, np.int64).reshape(-1)
  if not len(rows):
    return bank
  bank = grow(bank, int(rows.max()) + 1)
  at = _padded_rows(rows, bank.emb.shape[0])
  pad = lambda a, t: np.concatenate([np.asarray(a, t), np.zeros((len(at) - len(rows),)
                                                                   + np.shape(a)[1:], t)])
  unknown = np.full(len(rows), -1, np.int32)
  return _write(bank, at, pad(emb, np.float32), pad(stores, np.int8), pad(scopes, np.int32),
                pad(unknown if sessions is None else sessions, np.int32),
                pad(unknown if speakers is None else speakers, np.int32),
                pad(unknown if turns is None else turns, np.int32))


@functools.partial(jax.jit, donate_argnums=0)
def _set_turns(bank, at, turns):
  return bank._replace(turns=bank.turns.at[at].set(turns, mode="drop"))


def set_turns(bank: DeviceBank, rows, turns) -> DeviceBank:
  """Sets the turn codes `[n]` of device `rows [n]` (`features='context'`: a session's later rows
  after a delete), in place: `bank` is donated."""
  rows = np.asarray(rows, np.int64).reshape(-1)
  if not len(rows):
    return bank
  at = _padded_rows(rows, bank.emb.shape[0])
  return _set_turns(bank, at, np.concatenate([np.asarray(turns, np.int32),
                                              np.zeros(len(at) - len(rows), np.int32)]))


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
  """`[n, K, d]` float32 bank rows `rows [n, K]` (zero where not `mask [n, K]`): the candidates'
  embeddings `search` gave for them."""
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
  """The outputs of a search as two arrays (one device-to-host copy each): `[q, 2K (+ 2s)]` int32
  (rows, mask, slate, slate mask) and `[q, K w (+ K)]` float32 (candidates, z)."""
  q = rows.shape[0]
  ints, floats = [rows, mask.astype(jnp.int32)], [cands.reshape(q, -1)]
  if slates is not None:
    slate, slate_mask, z = slates
    ints += [slate, slate_mask.astype(jnp.int32)]
    floats.append(z)
  return jnp.concatenate(ints, 1), jnp.concatenate(floats, 1)


def finish(queries, emb, rows, mask, features=None, slate=None):
  """Traced (inside a caller's jit): the candidates' embeddings `[q, K, d]` (`| features [q, K,
  F]`), with `slate = (params, hparams, s, explore)` (`s`, `explore` static) each query's
  first-round slate (fresh bandit statistics, Alg. 2 line 3), packed by `_pack`. The gather reads
  the bank through an optimisation barrier: otherwise XLA shares one float32 widening of a
  bfloat16 bank between the search and the gather and materialises it (~8x slower)."""
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
  """Traced: the bank restricted to rows `cand [P]` (ascending, `C` = padding; `scope_candidates`):
  `(emb [P, d], valid [P] (live, of the scopes `allowed [S]` if given), stores [P])`. Positions
  keep the rows' order, so a search over them breaks ties to the lower row as over the bank. (A
  row's cosine is the same float32 dot product; XLA may sum it in another order for another
  matrix shape, so it can differ in its last bit: seen here at d = 8 inside `rank_bank`.)"""
  cap = bank.emb.shape[0]
  at = jnp.minimum(cand, cap - 1)
  valid = (cand < cap) & bank.valid[at]
  if allowed is not None:
    valid = valid & allowed[bank.scopes[at]]
  return bank.emb[at], valid, bank.stores[at]


def context_of(bank: DeviceBank, cand=None):
  """Traced: `(sessions, speakers, turns)` `[C]` of the bank (or `[P]` at its rows `cand`,
  `gathered`'s), the row-side inputs of `first_stage.Context`."""
  if cand is None:
    return bank.sessions, bank.speakers, bank.turns
  at = jnp.minimum(cand, bank.emb.shape[0] - 1)
  return bank.sessions[at], bank.speakers[at], bank.turns[at]


def rows_at(cand, pos, mask):
  """Traced: the bank rows `[q, K]` at positions `pos [q, K]` of `cand [P]` (-1 where not
  `mask`)."""
  return jnp.where(mask, cand[jnp.maximum(pos, 0)], -1).astype(jnp.int32)


def _candidates(queries, bank, allowed, rows, mask, cand, k, multistore):
  """Traced: `(rows [q, K], mask [q, K])` of the exact search over the bank (`rows is None`; over
  its rows `cand [P]` when given, the scopes' gathered rows), or the re-score of a searcher's rows,
  for the scopes `allowed [S]` (None: every scope)."""
  if rows is None:
    if cand is None:
      emb, stores = bank.emb, bank.stores
      valid = bank.valid if allowed is None else bank.valid & allowed[bank.scopes]
    else:
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
  """Traced: `fn(queries [q, d], allowed [S] | None, cand [P] | None, *batched [q, ...])`, a
  tuple of `[q, ...]` arrays; with one scope spec per query (`allowed [q, S]`, `cand [q, P]` or
  None: a micro-batched window of several users' questions in one call) `fn` vmapped over the
  queries, each on its own scopes, rows and `[1, ...]` slices (None passes as None)."""
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
  """`_pack`'s outputs as host arrays of the first `q` queries: `(rows [q, K], mask [q, K],
  cands [q, K, width], slates or None)`."""
  ints, floats = (np.asarray(a)[:q] for a in packed)  # (jax.device_get costs ~0.1 ms more here)
  out = (ints[:, :k], ints[:, k:2 * k].astype(bool), floats[:, :k * width].reshape(q, k, width))
  if slate_size is None:
    return out + (None,)
  s = slate_size
  return out + ((ints[:, 2 * k:2 * k + s], ints[:, 2 * k + s:].astype(bool),
                 floats[:, k * width:]),)


def search(bank: DeviceBank, queries, *, k: int, multistore: bool, allowed=None, slate=None,
           searcher: Optional[Searcher] = None, scope_rows=None):
  """Top-K candidates of `[q, d]` unit queries in one jitted call (module docstring): the
  dialogue memories' top-K, or each store's top-K/2 with `multistore`, of the scopes `allowed`,
  by the exact search or a `searcher`; with `scope_rows` (the bank's `ScopeRows`) a scoped search
  of few rows reads only those rows (`scope_candidates`); with `slate = (params, hparams, s,
  explore)` also each query's first-round slate.

  `allowed`: `[S]` bool (`ScopeNames.allowed`) or None (every scope) for all the queries, or a
  list of `q` such specs, one per query (several users' questions in one call: the same
  candidates as each spec's own search, `tests/test_scoped_search.py`).

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
  """The searcher's `(rows [q, r], mask [q, r])` (per query for per-query specs), or None when
  it answers None for any query (the caller searches exactly)."""
  if not isinstance(allowed, list):
    return searcher.search(queries, r, multistore, allowed)
  parts = [searcher.search(queries[i:i + 1], r, multistore, a) for i, a in enumerate(allowed)]
  if any(p is None for p in parts):
    return None
  return tuple(np.concatenate(x) for x in zip(*parts))


def query_allowed(allowed, num_padded: int):
  """`allowed` as the jitted search takes it: one spec (`[S]` or None) as it is; a list of
  per-query specs as `[num_padded, S]` bool (None: every code; padding queries: none), or None
  when every entry is None."""
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
  """`[P]` int32 the rows of the scopes `allowed` (`scope_rows.of`), ascending, padded with
  `capacity` to `P = pow2_at_least(n, MIN_CAPACITY)`: what a scoped search reads instead of the
  bank. None (search the whole bank, masked) for an unscoped search, without `scope_rows`, or
  when `P > capacity / GATHER_SHARE` (gathering that many rows costs about what the scan costs).
  For a list of per-query specs (`search`): `[num_padded, P]`, each query's rows, `P` of the
  largest; None when one is unscoped or too large."""
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
  """The ANN searcher of index `name` with keyword `options` (None for 'exact'); ValueError naming
  the known indexes or a bad option."""
  if not isinstance(name, str):
    raise InputTypeError(f"index must be a string, got {type(name).__name__}")
  return ann.make_searcher(name, dim, options)
