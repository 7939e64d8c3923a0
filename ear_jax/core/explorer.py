"""Exploratory Reflection: a query-local UCB bandit with a diversity penalty (Eq. (5)-(9)).

Symbols: `K` candidates, `s` slate size, `T` exploration rounds.

Every function works on ONE query; callers `vmap`. Slates are `[s]` int32 indices with a `[s]`
bool mask; with fewer than `s` valid candidates the remaining positions are empty (-1, False).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import chex
import flax
import jax
import jax.numpy as jnp

from ear_jax.core.types import SlateFeedback

if TYPE_CHECKING:
  from ear_jax.core.config import HParams

# The s picks and T rounds are short static loops: unrolled, XLA fuses them.
_UNROLL = True


@flax.struct.dataclass
class BanditStats:
  """Per-query bandit statistics over the K candidates (reset for every query, Alg. 2 line 3)."""
  mean: jax.Array  # [K] float32, mu-hat_i
  counts: jax.Array  # [K] float32, N_i (pull counts; float so Eq. (9) divides without casts)


class ExplorerOutput(NamedTuple):
  """What T rounds of exploration produce."""
  slates: jax.Array  # [T, s] int32, slate of each round (-1 = empty position)
  slate_mask: jax.Array  # [T, s] bool
  labels: jax.Array  # [T, s] float32 critic labels in {-1, +1} (-1 at empty positions)
  stats: BanditStats  # statistics after round T


def init_bandit(num_candidates: int) -> BanditStats:
  """Zero statistics `N_i = mu_i = 0` (Alg. 2 line 3)."""
  return BanditStats(mean=jnp.zeros((num_candidates,), jnp.float32),
                     counts=jnp.zeros((num_candidates,), jnp.float32))


def ucb_scores(stats: BanditStats, alpha: jax.Array) -> jax.Array:
  """Upper-confidence values `U_i = mu_i + alpha sqrt(log(1 + sum_l N_l) / (1 + N_i))`, Eq. (5).

  Returns:
    `[K]` UCB values.
  """
  total = jnp.sum(stats.counts)
  return stats.mean + alpha * jnp.sqrt(jnp.log1p(total) / (1.0 + stats.counts))


def redundancy(gram: jax.Array, chosen: jax.Array) -> jax.Array:
  """Redundancy `D_i = max_{l chosen} m~_i^T m~_l`, 0 when nothing is chosen yet, Eq. (6).

  Args:
    gram: `[K, K]` adapted candidate similarities `m~ m~^T`.
    chosen: `[K]` bool, the partial slate.

  Returns:
    `[K]` redundancies.
  """
  chex.assert_rank([gram, chosen], [2, 1])
  d = jnp.max(jnp.where(chosen[None, :], gram, -jnp.inf), axis=1)
  return jnp.where(jnp.any(chosen), d, 0.0)


def greedy_slate(relevance: jax.Array, ucb: jax.Array, gram: jax.Array, where: jax.Array,
                 hparams: HParams, slate_size: int):
  """Greedy slate of `s` picks of `argmax lambda_rel z - lambda_div D + lambda_exp U`, Eq. (7)-(8).

  Each pick is over valid, not-yet-chosen candidates; ties go to the lowest index. Inputs:
  `relevance [K]` (`z_i = q~^T m~_i`), `ucb [K]` (Eq. (5)), `gram [K, K]` (Eq. (6)), `where [K]`.

  Returns:
    `(slate [s] int32, slate_mask [s] bool)`.
  """
  chex.assert_rank([relevance, ucb, where], 1)
  base = hparams.lambda_rel * relevance + hparams.lambda_exp * ucb
  num_k = relevance.shape[0]

  def pick(carry, _):
    chosen, max_sim = carry  # [K] bool, [K] running max similarity to the chosen items
    div = jnp.where(jnp.any(chosen), max_sim, 0.0)
    score = base - hparams.lambda_div * div
    available = where & ~chosen
    idx = jnp.argmax(jnp.where(available, score, -jnp.inf)).astype(jnp.int32)
    ok = jnp.any(available)
    picked = ok & (jnp.arange(num_k) == idx)
    chosen = chosen | picked
    max_sim = jnp.where(ok, jnp.maximum(max_sim, gram[:, idx]), max_sim)
    return (chosen, max_sim), (jnp.where(ok, idx, -1), ok)

  init = (jnp.zeros((num_k,), bool), jnp.full((num_k,), -jnp.inf, relevance.dtype))
  _, (slate, slate_mask) = jax.lax.scan(pick, init, None, length=slate_size, unroll=_UNROLL)
  return slate, slate_mask


def update_bandit(stats: BanditStats, slate: jax.Array, slate_mask: jax.Array,
                  labels: jax.Array) -> BanditStats:
  """Bandit update for the chosen items only, Eq. (9): `N_i += 1`, `mu_i += (y_i - mu_i) / N_i`.

  `slate [s]` int32 (no repeats; -1 = empty), `slate_mask [s]`, `labels [s]`.
  """
  num_k = stats.mean.shape[0]
  onehot = (slate[:, None] == jnp.arange(num_k)[None, :]) & slate_mask[:, None]  # [s, K]
  pulled = jnp.any(onehot, axis=0)
  y = jnp.sum(jnp.where(onehot, labels[:, None], 0.0), axis=0)
  counts = stats.counts + pulled
  mean = jnp.where(pulled, stats.mean + (y - stats.mean) / jnp.maximum(counts, 1.0), stats.mean)
  return BanditStats(mean=mean, counts=counts)


def explore(key: jax.Array, relevance: jax.Array, gram: jax.Array, where: jax.Array,
            feedback: SlateFeedback, hparams: HParams, num_rounds: int,
            slate_size: int) -> ExplorerOutput:
  """T rounds of Exploratory Reflection (Alg. 2, Alg. 1 lines 3-7) as a `lax.scan` over rounds.

  Each round: greedy slate (Eq. (7)-(8)), the critic's labels, bandit update (Eq. (9)). The key is
  split into one key per round and consumed; `relevance [K]` and `gram [K, K]` are constants,
  `feedback` is `(key, slate, slate_mask) -> labels [s]`.

  Returns:
    `ExplorerOutput` with the `[T, s]` slates, masks and labels and the final statistics.
  """
  relevance = jax.lax.stop_gradient(relevance)
  gram = jax.lax.stop_gradient(gram)

  def round_fn(stats, round_key):
    ucb = ucb_scores(stats, hparams.alpha)
    slate, slate_mask = greedy_slate(relevance, ucb, gram, where, hparams, slate_size)
    labels = jnp.where(slate_mask, feedback(round_key, slate, slate_mask), -1.0)
    return update_bandit(stats, slate, slate_mask, labels), (slate, slate_mask, labels)

  stats, (slates, masks, labels) = jax.lax.scan(
      round_fn, init_bandit(relevance.shape[0]), jax.random.split(key, num_rounds),
      unroll=_UNROLL)
  return ExplorerOutput(slates=slates, slate_mask=masks, labels=labels.astype(jnp.float32),
                        stats=stats)


def exploit_slate(stats: BanditStats, relevance: jax.Array, where: jax.Array, slate_size: int):
  """The top-s by bandit mean after the T rounds, ties by adapted relevance (beyond the paper).

  Confirmed candidates (mean > 0) first, never-pulled ones next, refuted ones last.

  Returns:
    `(slate [s] int32, slate_mask [s] bool)`.
  """
  chex.assert_rank([relevance, where], 1)
  mean = jnp.where(where, stats.mean, -jnp.inf)
  rel = jnp.where(where, jax.lax.stop_gradient(relevance), -jnp.inf)
  order = jnp.lexsort((rel, mean))[::-1][:slate_size].astype(jnp.int32)  # mean, then relevance
  ok = where[order]
  return jnp.where(ok, order, -1), ok
