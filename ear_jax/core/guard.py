"""The guard: serve the learned ranking only when held-out feedback shows it beats the first stage.

Beyond the paper (`EARConfig.guard_holdout`). Symbols: `b` batch queries, `K` candidates, `s`
slate size, `R` slates per query, `H` held-out queries kept, `D = d (+ F)` a candidate row.

Every n-th training query (`held_out`) is never trained on: its slates are pages of the first
stage's ranking (both rankings interleaved when `T s < K`, `page_relevance`) and its citations go
to a ring of the newest `H` (`GuardState`). At test time, per held-out question with a citation,

  `d_j = 1[Y_j ⊆ TopS(z^phi_j)] - 1[Y_j ⊆ TopS(z^0_j)]`,

and the adapted ranking is served when `mean(d) - guard_z * sd / sqrt(n) > 0` over
`n >= guard_min_queries` questions (`holdout_decision`), else the first stage's.
"""
from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from ear_jax.core import adapter as adapter_lib
from ear_jax.core.config import EARConfig
from ear_jax.core.slates import top_s_slate


@flax.struct.dataclass
class GuardState:
  """The newest `H` held-out training queries (slot `i`: the `i`-th held-out query modulo `H`)."""
  queries: jax.Array  # [H, d] pre-adapter queries
  candidates: jax.Array  # [H, K, D] pre-adapter candidate rows
  mask: jax.Array  # [H, K] bool, valid candidates (all False: an empty slot)
  cited: jax.Array  # [H, K] bool, labelled +1 in the query's pages
  in_first: jax.Array  # [H, K] bool, the first stage's top-s (it does not change: kept)
  count: jax.Array  # [] int32, held-out queries pushed so far


def init_guard(config: EARConfig) -> GuardState:
  """An empty held-out ring of `config.guard_holdout_capacity` slots (the first stage is served)."""
  h, k = config.guard_holdout_capacity, config.num_candidates
  return GuardState(
      queries=jnp.zeros((h, config.dim), jnp.float32),
      candidates=jnp.zeros((h, k, config.dim + config.side_features), jnp.float32),
      mask=jnp.zeros((h, k), bool), cited=jnp.zeros((h, k), bool),
      in_first=jnp.zeros((h, k), bool), count=jnp.zeros((), jnp.int32))


def held_out(first_index: jax.Array, num: int, config: EARConfig) -> jax.Array:
  """`[num]` bool: which stream positions `first_index ..` are held out (every n-th; none at 0)."""
  n = config.guard_holdout
  if not n:
    return jnp.zeros((num,), bool)
  return (first_index + jnp.arange(num)) % n == n - 1


def push_holdout(guard: GuardState, first: adapter_lib.AdapterParams, queries: jax.Array,
                 candidates: jax.Array, mask: jax.Array, slates: jax.Array,
                 slate_mask: jax.Array, labels: jax.Array, held: jax.Array,
                 slate_size: int) -> GuardState:
  """The batch's held-out queries (`held [b]`) written to the ring, in batch order.

  Args:
    first: `first_stage_params(config)`.
    queries: `[b, d]`; candidates: `[b, K, D]`; mask: `[b, K]`.
    slates, slate_mask, labels: `[b, R, s]` the queries' pages and the critic's labels.
    held: `[b]` bool, the held-out real queries.
    slate_size: `s` (static).
  """
  h, k = guard.mask.shape
  onehot = (slates[..., None] == jnp.arange(k)) & slate_mask[..., None]  # [b, R, s, K]
  cited = jnp.any(onehot & (labels > 0)[..., None], axis=(1, 2)) & mask
  in_first = jax.vmap(lambda q, c, m: _top_mask(adapter_lib.adapter_scores(first, q, c), m,
                                                slate_size))(queries, candidates, mask)
  order = jnp.cumsum(held.astype(jnp.int32)) - 1
  slot = jnp.where(held, (guard.count + order) % h, h)  # h: dropped
  put = lambda ring, x: ring.at[slot].set(x.astype(ring.dtype), mode="drop")
  return GuardState(queries=put(guard.queries, queries),
                    candidates=put(guard.candidates, candidates), mask=put(guard.mask, mask),
                    cited=put(guard.cited, cited), in_first=put(guard.in_first, in_first),
                    count=guard.count + jnp.sum(held).astype(jnp.int32))


def holdout_evidence(params: adapter_lib.AdapterParams, guard: GuardState, slate_size: int):
  """`(d [H] float32, counts [H] bool)` of `params` on the ring; a slot counts with a citation."""
  params = jax.lax.stop_gradient(params)
  top = lambda q, c, m: _top_mask(adapter_lib.adapter_scores(params, q, c), m, slate_size)
  in_a = jax.vmap(top)(guard.queries, guard.candidates, guard.mask)
  d = (jnp.all(~guard.cited | in_a, -1).astype(jnp.float32)
       - jnp.all(~guard.cited | guard.in_first, -1).astype(jnp.float32))
  return d, jnp.any(guard.cited, -1)


def holdout_lower_bound(params: adapter_lib.AdapterParams, guard: GuardState,
                        config: EARConfig, z):
  """`(mean(d) - z * sd / sqrt(n), n)` on the ring (Bessel's `sd`); `-inf` before two queries."""
  d, counts = holdout_evidence(params, guard, config.slate_size)
  n = jnp.sum(counts).astype(jnp.float32)
  mean = jnp.sum(jnp.where(counts, d, 0.0)) / jnp.maximum(n, 1.0)
  var = jnp.sum(jnp.where(counts, (d - mean) ** 2, 0.0)) / jnp.maximum(n - 1.0, 1.0)
  lcb = mean - z * jnp.sqrt(var / jnp.maximum(n, 1.0))
  return jnp.where(n > 1.0, lcb, -jnp.inf), n


def holdout_decision(params: adapter_lib.AdapterParams, guard: GuardState, config: EARConfig,
                     z=None):
  """`(serve [] bool, lcb, n)`: serve when `n >= guard_min_queries` and `lcb > 0`.

  `z` overrides `config.guard_z` (a float or a traced scalar: a sweep of z needs no retraining).
  """
  lcb, n = holdout_lower_bound(params, guard, config, config.guard_z if z is None else z)
  return (n >= config.guard_min_queries) & (lcb > 0.0), lcb, n


def page_relevance(z_adapted: jax.Array, z_first: jax.Array, where: jax.Array,
                   config: EARConfig) -> jax.Array:
  """`[K]` scores whose ranking pages a held-out query (`retrieval.paging_slate`).

  With `K <= T s`, `z_first` itself. Otherwise the two rankings interleaved,
  `-min(2 r_a, 2 r_f + 1)` (0-based ranks, ties to the lower index), so the pages label both
  rankings' top-s.

  Args:
    z_adapted: `[K]` relevance of the parameters training the query.
    z_first: `[K]` relevance of `first_stage_params(config)`.
    where: `[K]` bool, valid candidates.
    config: static config (`num_rounds`, `slate_size`).
  """
  k = z_first.shape[-1]
  if k <= config.num_rounds * config.slate_size:
    return z_first

  def ranks(z):
    order = jnp.argsort(-jnp.where(where, jax.lax.stop_gradient(z), -jnp.inf), stable=True)
    return jnp.zeros((k,), jnp.int32).at[order].set(jnp.arange(k, dtype=jnp.int32))

  return -jnp.minimum(2 * ranks(z_adapted), 2 * ranks(z_first) + 1).astype(jnp.float32)


def first_stage_params(config: EARConfig) -> adapter_lib.AdapterParams:
  """The untrained adapter: its relevance ranks the candidates as the first stage does."""
  return adapter_lib.init_adapter(jax.random.PRNGKey(0), config)


def _top_mask(relevance, where, slate_size):
  """`[K]` bool, the top-s of `relevance` over the valid candidates (`top_s_slate`'s ties)."""
  slate, mask = top_s_slate(jax.lax.stop_gradient(relevance), where, slate_size)
  return jnp.any((slate[:, None] == jnp.arange(relevance.shape[0])) & mask[:, None], axis=0)


def serve_adapted(params: adapter_lib.AdapterParams, guard: GuardState, config: EARConfig,
                  z=None) -> jax.Array:
  """`[] bool`: the guard serves `params` (`holdout_decision`)."""
  return holdout_decision(params, guard, config, z)[0]


def served_params(params: adapter_lib.AdapterParams, guard, config: EARConfig,
                  z=None) -> adapter_lib.AdapterParams:
  """`params` when `guard` is None or `serve_adapted`, else `first_stage_params(config)`."""
  if guard is None:
    return params
  return choose_params(serve_adapted(params, guard, config, z), params, config)


def choose_params(serve: jax.Array, params: adapter_lib.AdapterParams,
                  config: EARConfig) -> adapter_lib.AdapterParams:
  """`params` where `serve` (`[]` bool), else `first_stage_params(config)`, leafwise."""
  return jax.tree_util.tree_map(lambda a, f: jnp.where(serve, a, f.astype(a.dtype)), params,
                                first_stage_params(config))
