"""The guard: serve the learned ranking only when held-out feedback shows it beats the first
stage's (beyond the paper; `EARConfig.guard_holdout`).

Symbols: `b` queries in a batch, `K` candidates, `s` slate size, `R` slates per training query,
`H` held-out queries kept, `D = d (+ F)` a candidate row.

With `guard_holdout = n`, every n-th training query (`held_out`) is a small validation set built
online: its slates are pages of the first stage's ranking (with `T s >= K` every candidate is
labelled; with `T s < K`, of both rankings interleaved, `page_relevance`), it is never trained
on, and its candidates and citations go to a ring of the newest
`H = guard_holdout_capacity` (`GuardState`, `push_holdout`). The first stage's ranking is that of
the untrained adapter (`first_stage_params`: identity `W`, `w_side` at its init), whose top-s is
the first stage's own top-s. At test time the guard scores the CURRENT parameters on the ring:
per held-out question `j` with a citation,

  `d_j = 1[Y_j ⊆ TopS(z^phi_j)] - 1[Y_j ⊆ TopS(z^0_j)]`,

whether every cited item is in the adapted top-s minus whether every one is in the first stage's
(Recall@s's unit), and serves the adapted ranking when `mean(d) - guard_z * sd / sqrt(n) > 0`
over `n >= guard_min_queries` such questions (`holdout_decision`), else the first stage's
(`served_params`, a leafwise `jnp.where` on a scalar: no Python branch on traced values). An
unshown candidate counts as not cited, so pages of the first stage's ranking alone would favour
it whenever `T s < K`: there the pages alternate the two rankings.
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
  """The newest `H` held-out training queries: what the guard scores the current parameters on
  (part of the learner state, `LearnerState.guard`). Slot `i` holds the `i`-th held-out query
  modulo `H`."""
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
  """`[num]` bool: which of the training queries `first_index, ..., first_index + num - 1` (stream
  positions, 0-based) are held out: every `config.guard_holdout`-th (positions n - 1, 2n - 1, ...);
  all False when it is 0."""
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
    guard: the ring.
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
  """`(d [H] float32, counts [H] bool)` of `params` on the held-out ring: 1[every cited item in
  the adapted top-s] - 1[every cited item in the first stage's]; a slot counts when it holds a
  query with a citation."""
  params = jax.lax.stop_gradient(params)
  cited = guard.cited
  in_a = jax.vmap(lambda q, c, m: _top_mask(adapter_lib.adapter_scores(params, q, c), m,
                                            slate_size))(guard.queries, guard.candidates,
                                                         guard.mask)
  d = (jnp.all(~cited | in_a, -1).astype(jnp.float32)
       - jnp.all(~cited | guard.in_first, -1).astype(jnp.float32))
  return d, jnp.any(cited, -1)


def holdout_lower_bound(params: adapter_lib.AdapterParams, guard: GuardState,
                        config: EARConfig, z):
  """`(mean(d) - z * sd / sqrt(n), n)` of `params` on the held-out ring (`holdout_evidence`;
  `sd` with Bessel's correction); `-inf` before two counted queries."""
  d, counts = holdout_evidence(params, guard, config.slate_size)
  n = jnp.sum(counts).astype(jnp.float32)
  mean = jnp.sum(jnp.where(counts, d, 0.0)) / jnp.maximum(n, 1.0)
  var = jnp.sum(jnp.where(counts, (d - mean) ** 2, 0.0)) / jnp.maximum(n - 1.0, 1.0)
  lcb = mean - z * jnp.sqrt(var / jnp.maximum(n, 1.0))
  return jnp.where(n > 1.0, lcb, -jnp.inf), n


def holdout_decision(params: adapter_lib.AdapterParams, guard: GuardState, config: EARConfig,
                     z=None):
  """`(serve [] bool, lcb, n)` of `params` on the held-out ring: the adapted ranking is served
  when at least `config.guard_min_queries` held-out queries have a citation and the lower bound
  (`holdout_lower_bound`) is above 0. `z` overrides `config.guard_z` (a float or a traced scalar:
  a test-time sweep of z needs no retraining)."""
  lcb, n = holdout_lower_bound(params, guard, config, config.guard_z if z is None else z)
  return (n >= config.guard_min_queries) & (lcb > 0.0), lcb, n


def page_relevance(z_adapted: jax.Array, z_first: jax.Array, where: jax.Array,
                   config: EARConfig) -> jax.Array:
  """`[K]` scores whose ranking pages a held-out query (`retrieval.paging_slate`).

  With `K <= T s` (every candidate is shown) the first stage's relevance `z_first` itself. With
  `K > T s` the two rankings interleaved, `-min(2 r_a, 2 r_f + 1)` for a candidate at rank `r_a`
  of `z_adapted` and `r_f` of `z_first` (0-based, ties to the lower index): the adapted top
  candidate, the first stage's, the adapted second, ... each candidate once, so the `T s` pages
  show both top-`T s / 2` and the guard's evidence (`holdout_evidence`) labels both top-s.

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
  """The untrained adapter (`adapter.init_adapter`): identity `W`, `w_side = [side_init, -1, 0..]`.

  Its relevance ranks the candidates as the first stage does (`z = side_init * f_0` up to float
  rounding; the frozen cosine without side features).
  """
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
  """The parameters whose relevance is served at test time: `params` when `guard` is None (the
  guard off) or `serve_adapted`, else `first_stage_params(config)` (leafwise `jnp.where`)."""
  if guard is None:
    return params
  return choose_params(serve_adapted(params, guard, config, z), params, config)


def choose_params(serve: jax.Array, params: adapter_lib.AdapterParams,
                  config: EARConfig) -> adapter_lib.AdapterParams:
  """`params` where `serve` (`[]` bool, a guard's decision), else `first_stage_params(config)`
  (leafwise `jnp.where`; callers vmap it over seeds)."""
  return jax.tree_util.tree_map(lambda a, f: jnp.where(serve, a, f.astype(a.dtype)), params,
                                first_stage_params(config))
