"""The one retrieval path: top-K candidate search (Eq. (1)), then adapt -> slate (Section 3.6).

Symbols: `n` queries, `M` bank rows, `d` dimension, `K` candidates, `s` slate size.

Every caller (benchmark streams, `ear_jax.agent.Memory`, `inference.evaluate`, `experiments.bench`)
goes through these functions.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp

from ear_jax.core import adapter as adapter_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import explorer as explorer_lib
from ear_jax.core.slates import top_s_slate
from ear_jax.core.types import SlateFeedback


# The streamed search holds about this many scores at a time (16 MB of float32); a block is a power
# of two of rows, so it divides the power-of-two capacities of `DeviceBank`.
SCORE_BUDGET = 1 << 22
MIN_CHUNK = 1 << 12


def block_rows(num_queries: int) -> int:
  """Rows per block of the streamed search for `num_queries` queries (a power of two)."""
  rows = max(MIN_CHUNK, SCORE_BUDGET // max(num_queries, 1))
  return 1 << (rows.bit_length() - 1)


def _chunk_scores(queries: jax.Array, rows: jax.Array) -> jax.Array:
  """`[n, c]` float32 cosines of queries against a block of rows (bfloat16 widened on read)."""
  queries = queries.astype(jnp.float32)
  if rows.dtype != jnp.float32 and queries.shape[0] <= 4:
    return jnp.stack([(rows.astype(jnp.float32) * q).sum(-1) for q in queries])
  return jax.lax.dot_general(queries, rows.astype(jnp.float32), (((1,), (1,)), ((), ())))


def _masked_top(scores, where, k):
  """`(values [n, k], index [n, k])` of `scores [n, c]` restricted to `where [c]` (or `[n, c]`)."""
  return jax.lax.top_k(jnp.where(where, scores, -jnp.inf), k)


def _merge(best, new, k):
  """Merges two `(values, index)` lists; `best` first, so equal values keep the lower bank index."""
  vals = jnp.concatenate([best[0], new[0]], 1)
  idx = jnp.concatenate([best[1], new[1]], 1)
  vals, order = jax.lax.top_k(vals, k)
  return vals, jnp.take_along_axis(idx, order, 1)


def _block_top(queries, rows, valid, stores, offset, per_store):
  """Top-`per_store` of one block of rows: one list, or one per store (0, 1)."""
  scores = _chunk_scores(queries, rows)
  groups = (valid,) if stores is None else (valid & (stores == 0), valid & (stores == 1))
  tops = (_masked_top(scores, where[None, :], per_store) for where in groups)
  return tuple((vals, idx + offset) for vals, idx in tops)


def _streaming_top(queries, bank, valid, stores, per_store, chunk):
  """Top-`per_store` lists over the whole bank in `chunk`-row blocks; `[n, M]` is never formed."""
  m, n = bank.shape[0], queries.shape[0]
  num_full = m // chunk
  full = num_full * chunk
  init = tuple((jnp.full((n, per_store), -jnp.inf, jnp.float32),
                jnp.zeros((n, per_store), jnp.int32)) for _ in range(1 if stores is None else 2))
  blocks = (bank[:full].reshape(num_full, chunk, -1), valid[:full].reshape(num_full, chunk),
            None if stores is None else stores[:full].reshape(num_full, chunk),
            jnp.arange(num_full, dtype=jnp.int32) * chunk)

  def step(best, block):
    rows, v, st, start = block
    new = _block_top(queries, rows, v, st, start, per_store)
    return tuple(_merge(b, x, per_store) for b, x in zip(best, new)), None

  best, _ = jax.lax.scan(step, init, blocks)
  if m > full:  # the tail rows (a bank whose size is not a multiple of the chunk)
    tail = slice(full, m)
    new = _block_top(queries, bank[tail], valid[tail], None if stores is None else stores[tail],
                     full, min(per_store, m - full))
    best = tuple(_merge(b, x, per_store) for b, x in zip(best, new))
  return best


def top_k_search(queries: jax.Array, bank: jax.Array, valid: jax.Array, k: int,
                 stores: Optional[jax.Array] = None, chunk: Optional[int] = None):
  """Top-K bank rows by cosine (Eq. (1)); with `stores`, the top-K/2 of each of two stores.

  Ties go to the lower index; missing rows are masked padding. A bank of more than `chunk` rows is
  streamed (a `lax.scan` with a running top-K), so at most `n chunk` scores exist at once.

  Args:
    queries: `[n, d]` unit query embeddings.
    bank: `[M, d]` unit memory embeddings (float32 or bfloat16); valid: `[M]` bool.
    k: `K` (static).
    stores: optional `[M]` int32 store code (0 episodic, 1 semantic; Section 5).
    chunk: rows per block of the streamed search (static); default `block_rows(n)`.

  Returns:
    `(index [n, K] int32 (-1 = padding), scores [n, K] float32 (-inf = padding), mask [n, K] bool)`,
    best first.
  """
  per_store = k if stores is None else k // 2
  chunk = block_rows(queries.shape[0]) if chunk is None else int(chunk)
  if bank.shape[0] > chunk:
    parts = _streaming_top(queries, bank, valid, stores, per_store, chunk)
  else:
    if bank.shape[0] < per_store:  # a bank smaller than K: pad with invalid rows (static shapes)
      pad = per_store - bank.shape[0]
      bank = jnp.pad(bank, ((0, pad), (0, 0)))
      valid = jnp.pad(valid, (0, pad))
      stores = None if stores is None else jnp.pad(stores, (0, pad), constant_values=-1)
    parts = _block_top(queries, bank, valid, stores, 0, per_store)
  vals, idx = parts[0] if stores is None else _merge(*parts, k)
  mask = vals > -jnp.inf
  return jnp.where(mask, idx, -1).astype(jnp.int32), vals, mask


def slate_from_candidates(params: adapter_lib.AdapterParams, query: jax.Array,
                          candidates: jax.Array, where: jax.Array, slate_size: int, hparams=None,
                          stats: Optional[explorer_lib.BanditStats] = None):
  """Adapt -> slate for one query: the adapter's top-s (Section 3.6), or one Explorer round.

  Without `stats`: `S = TopS_i z_i^phi`. With the query's `BanditStats`: one Explorer round
  (Eq. (5)-(8)), which needs `hparams`. `query [d]`, `candidates [K, d]`, `where [K]`.

  Returns:
    `(slate [s] int32, slate_mask [s] bool, logits z [K])`.
  """
  z, m_t = adapter_lib.relevance(params, query, candidates)
  if stats is None:
    slate, slate_mask = top_s_slate(z, where, slate_size)
  else:
    ucb = explorer_lib.ucb_scores(stats, hparams.alpha)
    slate, slate_mask = explorer_lib.greedy_slate(z, ucb, adapter_lib.gram(m_t), where, hparams,
                                                  slate_size)
  return slate, slate_mask, z


def batch_slates(params: adapter_lib.AdapterParams, queries: jax.Array, candidates: jax.Array,
                 where: jax.Array, slate_size: int, hparams=None,
                 stats: Optional[explorer_lib.BanditStats] = None):
  """`slate_from_candidates` vmapped over `n` queries (`[n, ...]` inputs and `stats`).

  Returns:
    `(slate [n, s] int32, slate_mask [n, s] bool, logits z [n, K])`.
  """
  return jax.vmap(slate_from_candidates, in_axes=(None, 0, 0, 0, None, None, 0))(
      params, queries, candidates, where, slate_size, hparams, stats)


def retrieve(params: adapter_lib.AdapterParams, queries: jax.Array, bank: jax.Array,
             valid: jax.Array, k: int, slate_size: int):
  """Batched adapter-only retrieval: `top_k_search`, then the adapter's top-s of each query.

  `queries [n, d]`, `bank [M, d]`, `valid [M]`. When `n K > M` the bank is adapted once and rows
  gathered; both paths give the same logits.

  Returns:
    `(memory rows [n, s] int32 (-1 = empty), candidates [n, K] int32, logits [n, K])`.
  """
  idx, _, mask = top_k_search(queries, bank, valid, k)
  safe = jnp.maximum(idx, 0)
  if queries.shape[0] * k > bank.shape[0]:
    bank_t = adapter_lib.adapt_memories(params, bank)  # [M, d], Eq. (3) once per bank row
    q_t = adapter_lib.adapt_queries(params, queries)  # [n, d]
    z = jax.vmap(adapter_lib.relevance_logits)(q_t, bank_t[safe])  # [n, K], Eq. (4)
    slate, slate_mask = jax.vmap(top_s_slate, in_axes=(0, 0, None))(z, mask, slate_size)
  else:
    slate, slate_mask, z = batch_slates(params, queries, bank[safe], mask, slate_size)
  rows = jnp.where(slate_mask, jnp.take_along_axis(idx, jnp.maximum(slate, 0), 1), -1)
  return rows, idx, z


def explorer_slate(key: jax.Array, params: adapter_lib.AdapterParams, query: jax.Array,
                   candidates: jax.Array, where: jax.Array, feedback, num_rounds: int,
                   slate_size: int, hparams) -> explorer_lib.ExplorerOutput:
  """Explorer-assisted slate of one query: T rounds with the critic (Section 3.6, Alg. 2).

  The key is consumed; `feedback` is `(key, slate, slate_mask) -> labels [s]`; inputs as in
  `slate_from_candidates`.

  Returns:
    The `ExplorerOutput`; the final slate is `out.slates[-1]`.
  """
  z, m_t = adapter_lib.relevance(params, query, candidates)
  return explorer_lib.explore(key, z, adapter_lib.gram(m_t), where, feedback, hparams, num_rounds,
                              slate_size)


def explorer_retrieve(key: jax.Array, params: adapter_lib.AdapterParams, queries: jax.Array,
                      bank: jax.Array, valid: jax.Array, gold: jax.Array, k: int,
                      num_rounds: int, slate_size: int, hparams, critic: critic_lib.Critic):
  """Batched explorer-assisted retrieval: `top_k_search`, then `explorer_slate` per query.

  Inputs as `retrieve`, plus `key` (consumed), `gold [n, M]` bool (what a simulated critic sees),
  `num_rounds` `T` and a jitted `critic`.

  Returns:
    `[n, s]` int32 memory rows of round T's slate (-1 = empty).
  """
  idx, _, mask = top_k_search(queries, bank, valid, k)
  safe = jnp.maximum(idx, 0)
  cand_gold = jnp.take_along_axis(gold, safe, 1) & mask

  def one(kk, q, c, g, where):
    def feedback(k2, slate, slate_mask):
      return critic(k2, critic_lib.slate_view(q, c, g, slate, slate_mask))

    out = explorer_slate(kk, params, q, c, where, feedback, num_rounds, slate_size, hparams)
    return out.slates[-1], out.slate_mask[-1]

  slate, slate_mask = jax.vmap(one)(jax.random.split(key, queries.shape[0]), queries, bank[safe],
                                    cand_gold, mask)
  return jnp.where(slate_mask, jnp.take_along_axis(idx, jnp.maximum(slate, 0), 1), -1)


class PagingOutput(NamedTuple):
  """What paging's T critic calls show and the answer they give (`paging_slate`)."""
  pages: jax.Array  # [T, s] int32, call t's slate: ranks t s .. t s + s - 1 (-1 = empty)
  page_mask: jax.Array  # [T, s] bool
  labels: jax.Array  # [T, s] float32 critic labels in {-1, +1} (-1 at empty positions)
  slate: jax.Array  # [s] int32, the answer: cited candidates first (by rank), then the ranking
  slate_mask: jax.Array  # [s] bool


def paging_slate(key: jax.Array, relevance: jax.Array, where: jax.Array,
                 feedback: SlateFeedback, num_pages: int, slate_size: int) -> PagingOutput:
  """Paging, the test-time baseline of explorer-assisted inference (beyond the paper).

  The critic sees the ranking's top `T s` in T pages of `s` (ties to the lower index); the answer
  is the cited candidates first, then the rest by the ranking, cut to `s`: with nothing cited,
  `top_s_slate` bit for bit. Empty pages are still shown. One query; callers vmap.

  Args:
    key: PRNG key, split per page as `explorer.explore` splits it per round; consumed.
    relevance: `[K]` scores to rank by (constants); where: `[K]` bool.
    feedback: `(key, slate, slate_mask) -> labels [s]`, the critic of this query.
    num_pages, slate_size: `T`, `s` (static).

  Returns:
    A `PagingOutput` (`[T, s]` pages, masks and labels; the `[s]` answer slate and mask).
  """
  chex.assert_rank([relevance, where], 1)
  k = relevance.shape[0]
  shown = min(num_pages * slate_size, k)  # static: ranks shown (all K when T s >= K)
  vals, order = jax.lax.top_k(jnp.where(where, jax.lax.stop_gradient(relevance), -jnp.inf), k)
  ranked_ok = vals > -jnp.inf  # [K] a prefix: the valid candidates come first
  ranked = jnp.where(ranked_ok, order, -1).astype(jnp.int32)  # [K] candidate at each rank
  pad = num_pages * slate_size - shown
  pages = jnp.pad(ranked[:shown], (0, pad), constant_values=-1).reshape(num_pages, slate_size)
  page_mask = jnp.pad(ranked_ok[:shown], (0, pad)).reshape(num_pages, slate_size)
  labels = jax.vmap(feedback)(jax.random.split(key, num_pages), pages, page_mask)
  labels = jnp.where(page_mask, labels, -1.0).astype(jnp.float32)
  cited = jnp.pad((labels > 0).reshape(-1)[:shown], (0, k - shown))  # [K] by rank
  rank = jnp.arange(k, dtype=jnp.int32)
  # Cited ranks sort before every other rank, each group in ranking order; integer keys: no ties.
  _, pos = jax.lax.top_k(-jnp.where(cited, rank - k, rank), slate_size)
  return PagingOutput(pages=pages, page_mask=page_mask, labels=labels, slate=ranked[pos],
                      slate_mask=ranked_ok[pos])
