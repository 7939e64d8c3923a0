"""Ranking losses, feedback aggregation and replay slates (Eq. (10)-(12), (16), (19), (20)).

Symbols: `K` candidates, `s` slate size, `R` slates of one query (T rounds of the Explorer, or 1).
All functions work on one query (unbatched); masks are True = valid.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from ear_jax.core.adapter import MASKED_LOGIT, relevance_log_probs
from ear_jax.core.slates import top_s_slate


def _safe_div(num, den):
  return num / jnp.maximum(den, 1.0)


def slate_log_probs(logits: jax.Array, where: jax.Array, slate: jax.Array, slate_mask: jax.Array,
                    loss_form: str) -> jax.Array:
  """`log p_phi(i_j)` of each slate position, in one of the two readings of Eq. (10).

  `logits [K]` (`z` or `z / tau`), `where [K]`, `slate [s]` (-1 = empty), `slate_mask [s]`.
  `loss_form`: 'flat', `log softmax(z)` over the valid candidates (Alg. 3 line 7), or
  'sequential', Plackett-Luce: position j excludes the items chosen before it (Section 3.4).

  Returns:
    `[s]` log-probabilities (0 at empty positions).
  """
  chex.assert_rank([logits, where, slate, slate_mask], 1)
  num_k = logits.shape[0]
  safe = jnp.maximum(slate, 0)
  if loss_form == "flat":
    lp = relevance_log_probs(logits, where)[safe]
  elif loss_form == "sequential":
    onehot = (safe[:, None] == jnp.arange(num_k)[None, :]) & slate_mask[:, None]  # [s, K]
    before = jnp.cumsum(onehot, axis=0) - onehot  # chosen at positions < j
    available = where[None, :] & (before == 0)
    lse = jax.nn.logsumexp(jnp.where(available, logits[None, :], MASKED_LOGIT), axis=1)
    lp = logits[safe] - lse
  else:
    raise ValueError(f"unknown loss_form={loss_form!r}")
  return jnp.where(slate_mask, lp, 0.0)


def loss_support(where: jax.Array, observed: jax.Array, mode: str, window: int) -> jax.Array:
  """The candidates Eq. (10)'s softmax runs over (`EARConfig.loss_support`).

  Args:
    where: `[K]` bool, valid candidates (in the first stage's rank order).
    observed: `[K]` bool, candidates that received feedback (Eq. (11)).
    mode: 'all' (every valid candidate, the paper), 'labelled' (those with feedback), 'window'
      (the first stage's top `window` and every labelled one) or 'auto' ('all' when `K <= window`,
      else 'labelled'); at `K <= window`, 'window' and 'auto' are 'all' bit for bit.
    window: `T s` (static).

  Returns:
    `[K]` bool.
  """
  num_k = where.shape[-1]
  if mode == "all" or (mode in ("window", "auto") and num_k <= window):
    return where
  if mode == "window":
    return where & ((jnp.arange(num_k) < window) | observed)
  if mode in ("labelled", "auto"):
    return where & observed
  raise ValueError(f"unknown loss_support={mode!r}")


def ranking_loss(logits: jax.Array, where: jax.Array, slates: jax.Array, slate_mask: jax.Array,
                 rewards: jax.Array, baseline: jax.Array, loss_form: str,
                 count_mask: jax.Array | None = None) -> jax.Array:
  """Feedback-weighted ranking loss `-1/(R s) sum_t sum_j (y_tj - b) log p_phi(i_tj)`, Eq. (10).

  The normaliser is the number of counted positions, so an all-masked input gives 0.

  Args:
    logits: `[K]` relevance logits; where: `[K]` bool.
    slates, slate_mask, rewards: `[R, s]` slates, positions holding an item, rewards in {-1, +1}.
    baseline: `[]` the baseline `b`.
    loss_form: 'flat' or 'sequential' (see `slate_log_probs`).
    count_mask: optional `[R, s]` bool, positions that count in the loss (default `slate_mask`).

  Returns:
    `[]` loss.
  """
  chex.assert_rank([slates, slate_mask, rewards], 2)
  lp = jax.vmap(slate_log_probs, in_axes=(None, None, 0, 0, None))(
      logits, where, slates, slate_mask, loss_form)
  counted = slate_mask if count_mask is None else count_mask & slate_mask
  total = jnp.sum(jnp.where(counted, (rewards - baseline) * lp, 0.0))
  return -_safe_div(total, jnp.sum(counted))


def aggregate_feedback(slates: jax.Array, slate_mask: jax.Array, labels: jax.Array,
                       num_candidates: int):
  """Observed set and mean label per candidate over the rounds, Eq. (11)-(12).

  Returns:
    `(observed [K] bool, ybar [K] float32)`; `ybar` is 0 for never-chosen candidates.
  """
  onehot = (slates[..., None] == jnp.arange(num_candidates)) & slate_mask[..., None]  # [R, s, K]
  counts = jnp.sum(onehot, axis=(0, 1)).astype(jnp.float32)
  sums = jnp.sum(jnp.where(onehot, labels[..., None], 0.0), axis=(0, 1))
  observed = counts > 0
  return observed, jnp.where(observed, _safe_div(sums, counts), 0.0)


def replay_rewards(ybar: jax.Array, observed: jax.Array, replay_unobserved: str):
  """Binary replay rewards `r~_i = +1 if ybar_i > 0 else -1`, Eq. (20).

  Args:
    ybar: `[K]` aggregated labels of a stored experience.
    observed: `[K]` bool, candidates that received feedback.
    replay_unobserved: 'negative' (never-chosen items get -1 and count) or 'ignore' (left out).

  Returns:
    `(rewards [K] float32, counted [K] bool)`.
  """
  rewards = jnp.where(ybar > 0, 1.0, -1.0).astype(jnp.float32)
  if replay_unobserved == "negative":
    counted = jnp.ones_like(observed)
  elif replay_unobserved == "ignore":
    counted = observed
  else:
    raise ValueError(f"unknown replay_unobserved={replay_unobserved!r}")
  return rewards, counted


def gumbel_top_s(key: jax.Array, logits: jax.Array, where: jax.Array, tau: jax.Array,
                 slate_size: int):
  """A slate of `s` items without replacement: top-s of `z / tau + g`, `g ~ Gumbel(0, 1)`, Eq. (19).

  The key is consumed; `logits [K]` are constants, `where [K]`, `tau []`.

  Returns:
    `(slate [s] int32, slate_mask [s] bool)`, ordered by perturbed score.
  """
  g = jax.random.gumbel(key, logits.shape, jnp.float32)
  return top_s_slate(jax.lax.stop_gradient(logits) / tau + g, where, slate_size)


def replay_loss(per_experience_losses: jax.Array, replay_mask: jax.Array) -> jax.Array:
  """`L_rep = 1/|J| sum_{r in J} L_rank(e_r)`, Eq. (16), over `[B]` losses; 0 when empty."""
  return _safe_div(jnp.sum(jnp.where(replay_mask, per_experience_losses, 0.0)),
                   jnp.sum(replay_mask))


def combined_loss(current: jax.Array, replay: jax.Array, lambda_rep: jax.Array) -> jax.Array:
  """`L_EAR = L_cur + lambda_rep L_rep`, Eq. (17)."""
  return current + lambda_rep * replay
