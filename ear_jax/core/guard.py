"""The guard: serve the learned ranking only when the critic's feedback shows it beats the first
stage's (beyond the paper; `EARConfig.guard`).

Symbols: `b` queries in a batch, `K` candidates, `s` slate size, `R` slates per training query.

Prequential evidence (progressive validation): for every training query, with the parameters at
the batch's start (before the query's own update, so the evidence is out of sample),

  `d = |Y ∩ TopS(z^phi)| - |Y ∩ TopS(z^0)|`,

where `Y` is the set of candidates the critic labelled +1 in the query's slates, `z^phi` the
adapted relevance and `z^0` the first stage's: the relevance of the untrained adapter
(`first_stage_params`: identity adapter, `w_side` at its init), whose top-s is the first stage's
own top-s (the frozen "Only Retriever" slate, bit for bit). A query counts when `Y` is not empty
AND every candidate in one top-s but not the other (the only ones `d` depends on) was shown in its
slates: the slates are chosen with `z^phi`, so an unshown candidate of the first stage's top-s
would count as "not cited" and bias `d` toward the adapter (with a one-slate training policy
showing the adapter's top-s, `d >= 0` always). The guard keeps weighted sums
of `d` and `d^2` (each query's weight halves every `guard_half_life` evidence queries; 0 = equal
weights), and at test time serves the adapted ranking only when the lower confidence bound

  `mean(d) - guard_z * sqrt(var(d) / n_eff) > 0`   and   `count >= guard_min_queries`,

`n_eff = (sum w)^2 / sum w^2` (Kish's effective sample size), otherwise the first stage's
(`served_params`, a `jnp.where` on a scalar: no Python branch on traced values).
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
  """Weighted sums of the evidence `d` of the training queries seen so far (part of the learner
  state, `LearnerState.guard`)."""
  count: jax.Array  # [] int32, evidence queries seen (queries with a cited item)
  weight: jax.Array  # [] float32, sum of the queries' weights w
  weight_sq: jax.Array  # [] float32, sum of w^2
  total: jax.Array  # [] float32, sum of w d
  total_sq: jax.Array  # [] float32, sum of w d^2


def init_guard() -> GuardState:
  """No evidence yet: every sum 0 (the first stage is served)."""
  zero = jnp.zeros((), jnp.float32)
  return GuardState(count=jnp.zeros((), jnp.int32), weight=zero, weight_sq=zero, total=zero,
                    total_sq=zero)


def first_stage_params(config: EARConfig) -> adapter_lib.AdapterParams:
  """The untrained adapter (`adapter.init_adapter`): identity `W`, `w_side = [side_init, -1, 0..]`.

  Its relevance ranks the candidates as the first stage does (`z = side_init * f_0` up to float
  rounding; the frozen cosine without side features). The low-rank option's `B` is random but
  `A = 0`, so `W = A B^T = 0` whatever the key.
  """
  return adapter_lib.init_adapter(jax.random.PRNGKey(0), config)


def query_evidence(params: adapter_lib.AdapterParams, first: adapter_lib.AdapterParams,
                   query: jax.Array, candidates: jax.Array, where: jax.Array, slates: jax.Array,
                   slate_mask: jax.Array, labels: jax.Array, slate_size: int):
  """`d` of one training query and whether it counts (unbatched; vmap over a batch).

  Args:
    params: the adapter's parameters at the batch's start.
    first: `first_stage_params(config)`.
    query: `[d]` pre-adapter query.
    candidates: `[K, d (+ F)]` pre-adapter candidate rows.
    where: `[K]` bool, valid candidates.
    slates: `[R, s]` int32 slates shown to the critic (-1 = empty position).
    slate_mask: `[R, s]` bool.
    labels: `[R, s]` critic labels in {-1, +1}.
    slate_size: `s` (static).

  Returns:
    `(d [] float32, counts [] bool)`: `counts` is False when no item was labelled +1 or an item in
    one top-s but not the other was not shown.
  """
  k = candidates.shape[0]
  onehot = (slates[..., None] == jnp.arange(k)) & slate_mask[..., None]  # [R, s, K]
  shown = jnp.any(onehot, axis=(0, 1)) & where  # [K]
  cited = jnp.any(onehot & (labels > 0)[..., None], axis=(0, 1)) & where  # [K]

  def top(p):  # [K] bool, the top-s of p's relevance
    z = adapter_lib.adapter_scores(jax.lax.stop_gradient(p), query, candidates)
    slate, mask = top_s_slate(z, where, slate_size)
    return jnp.any((slate[:, None] == jnp.arange(k)) & mask[:, None], axis=0)

  in_a, in_f = top(params), top(first)
  d = jnp.sum(cited & in_a).astype(jnp.float32) - jnp.sum(cited & in_f).astype(jnp.float32)
  return d, jnp.any(cited) & jnp.all(shown | ~(in_a ^ in_f))


def update_guard(guard: GuardState, d: jax.Array, counts: jax.Array,
                 config: EARConfig) -> GuardState:
  """Adds a batch's evidence: `d [b]` float32, `counts [b]` bool (real queries with a cited item).

  The batch's queries get weight 1 and the earlier ones are multiplied by `2^(-m / h)` (`m` the
  batch's counted queries, `h = config.guard_half_life`; no decay for `h = 0`).
  """
  m = jnp.sum(counts).astype(jnp.float32)
  if config.guard_half_life:
    decay = jnp.exp2(-m / config.guard_half_life)
  else:
    decay = jnp.ones((), jnp.float32)
  d = jnp.where(counts, d, 0.0)
  return GuardState(count=guard.count + jnp.sum(counts).astype(jnp.int32),
                    weight=decay * guard.weight + m,
                    weight_sq=decay * decay * guard.weight_sq + m,
                    total=decay * guard.total + jnp.sum(d),
                    total_sq=decay * guard.total_sq + jnp.sum(d * d))


def lower_bound(guard: GuardState, z) -> jax.Array:
  """`mean(d) - z * se` with `se = sqrt(var / n_eff)` (`var` with Bessel's correction on
  `n_eff`); `-inf` before two evidence queries."""
  w = jnp.maximum(guard.weight, 1e-12)
  mean = guard.total / w
  n_eff = guard.weight ** 2 / jnp.maximum(guard.weight_sq, 1e-12)
  var = jnp.maximum(guard.total_sq / w - mean * mean, 0.0) * n_eff / jnp.maximum(n_eff - 1.0, 1e-12)
  lcb = mean - z * jnp.sqrt(var / jnp.maximum(n_eff, 1e-12))
  return jnp.where(n_eff > 1.0 + 1e-6, lcb, -jnp.inf)


def serve_adapted(guard: GuardState, config: EARConfig, z=None) -> jax.Array:
  """`[] bool`: the adapted ranking is served (the lower bound is above 0 after at least
  `config.guard_min_queries` evidence queries). `z` overrides `config.guard_z` (a float or a
  traced scalar: a test-time sweep of z needs no retraining)."""
  z = config.guard_z if z is None else z
  return (guard.count >= config.guard_min_queries) & (lower_bound(guard, z) > 0.0)


def served_params(params: adapter_lib.AdapterParams, guard, config: EARConfig,
                  z=None) -> adapter_lib.AdapterParams:
  """The parameters whose relevance is served at test time: `params` when `guard` is None (the
  guard off) or `serve_adapted`, else `first_stage_params(config)` (leafwise `jnp.where`)."""
  if guard is None:
    return params
  serve = serve_adapted(guard, config, z)
  return jax.tree_util.tree_map(lambda a, f: jnp.where(serve, a, f.astype(a.dtype)), params,
                                first_stage_params(config))


def guard_from_evidence(d: jax.Array, counts: jax.Array, config: EARConfig) -> GuardState:
  """The guard state after a stream's evidence (`QueryRecord.guard_d / guard_counts`, `[N]`),
  folded batch by batch (`config.batch_size`) as the learner folds it: for a test-time sweep of
  `guard_half_life` without retraining (the evidence does not depend on it)."""
  b = config.batch_size
  n = d.shape[0]
  pad = -n % b
  d = jnp.pad(jnp.asarray(d, jnp.float32), (0, pad)).reshape(-1, b)
  counts = jnp.pad(jnp.asarray(counts, bool), (0, pad)).reshape(-1, b)

  def body(g, x):
    return update_guard(g, x[0], x[1], config), None

  return jax.lax.scan(body, init_guard(), (d, counts))[0]
