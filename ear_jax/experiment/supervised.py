"""How far the adapter could go: the adapter trained on GOLD labels (an upper bound for EAR).

EAR learns `phi = {W_q, W_m, w_side}` (Eq. (3)-(4), plus the first stage's side term) online from a
critic's citations of the slates it chose. Here the same parameters are fitted offline with full
information: every candidate of every training query labelled with its gold mask, the listwise
loss `-mean_{i gold} log softmax(beta z)_i` over the valid candidates (`beta` an inverse
temperature: the top-s ranking does not depend on it, only the loss's shape does), Adam on
minibatches. No critic, no exploration, no slate feedback: whatever Recall@5 this reaches on
queries it was not fitted on is more than an online learner of the same parameters can expect
from a critic's citations; whatever it cannot reach even on the queries it was fitted on is
beyond the adapter's model class. Used by `--suite=headroom`.

Symbols: `S` seeds, `n` queries, `K` candidates, `d` dim, `F` side features, `s` slate size,
`E` evaluations (one per `eval_every` steps), `G` the grid of (learning rate, beta).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from ear_jax.core import adapter as adapter_lib
from ear_jax.core import metrics
from ear_jax.core import retrieval
from ear_jax.core.stream import Stream


class FitCurve(NamedTuple):
  """Recall@s (fraction) after every `eval_every` steps of `fit`; index 0 = before any step."""
  fitted: jax.Array  # [E + 1] float32, on the queries the adapter is fitted on
  held_out: jax.Array  # [E + 1] float32, on the queries it never sees


def recall_at(params: adapter_lib.AdapterParams, part: Stream, slate_size: int) -> jax.Array:
  """`[]` Recall@s of the adapter-only top-s (all gold in the slate; gold outside K misses)."""
  slate, slate_mask, _ = retrieval.batch_slates(params, part.queries, part.candidates,
                                                 part.mask, slate_size)
  hit = jax.vmap(metrics.gold_in_slate)(part.gold, slate, slate_mask)
  return metrics.masked_mean(metrics.slate_recall(hit, part.num_gold))


def listwise_loss(params: adapter_lib.AdapterParams, queries: jax.Array, candidates: jax.Array,
                  where: jax.Array, gold: jax.Array, beta: jax.Array) -> jax.Array:
  """`[]` mean over queries with a gold candidate of `-mean_{i gold} log softmax(beta z)_i`.

  Args:
    params: adapter parameters.
    queries: `[n, d]`; candidates: `[n, K, d (+ F)]`; where, gold: `[n, K]` bool.
    beta: `[]` inverse temperature of the softmax.

  Returns:
    The loss (0 for a batch without gold: a safe mean).
  """
  z = jax.vmap(adapter_lib.adapter_scores, in_axes=(None, 0, 0))(params, queries, candidates)
  logp = jax.vmap(adapter_lib.relevance_log_probs)(beta * z, where)
  g = (gold & where).astype(jnp.float32)
  num = jnp.sum(g, -1)
  per_query = -jnp.sum(g * logp, -1) / jnp.maximum(num, 1.0)
  return metrics.masked_mean(per_query, num > 0)


def fit(key: jax.Array, params: adapter_lib.AdapterParams, train: Stream, held_out: Stream, *,
        learning_rate: jax.Array, beta: jax.Array, steps: int, batch_size: int,
        eval_every: int, slate_size: int, frozen: tuple = ()) -> FitCurve:
  """Fits `params` on `train`'s gold labels; Recall@s on both parts every `eval_every` steps.

  One jitted `lax.scan` (vmap it over seeds and over the grid). Minibatches are drawn uniformly
  with replacement from `train`'s queries. The key is consumed.

  Args:
    key: PRNG key (minibatches).
    params: the starting adapter (the untrained one: the first stage's ranking).
    train: `[n, ...]` queries fitted on; held_out: `[m, ...]` queries only scored.
    learning_rate, beta: `[]` Adam's step size and the loss's inverse temperature.
    steps, batch_size, eval_every, slate_size: static; `steps` a multiple of `eval_every`.
    frozen: names of `AdapterParams` fields kept at their start (e.g. `('w_q', 'w_m')`: only the
      side weights are fitted).

  Returns:
    `FitCurve` of `steps // eval_every + 1` points.
  """
  if steps % eval_every:
    raise ValueError(f"steps ({steps}) must be a multiple of eval_every ({eval_every})")
  train, held_out = jax.tree_util.tree_map(jnp.asarray, (train, held_out))
  opt = optax.adam(learning_rate)
  n = train.queries.shape[0]

  def step(carry, k):
    p, o = carry
    idx = jax.random.randint(k, (batch_size,), 0, n)
    grads = jax.grad(listwise_loss)(p, train.queries[idx], train.candidates[idx],
                                    train.mask[idx], train.gold[idx], beta)
    grads = grads.replace(**{f: jnp.zeros_like(getattr(grads, f)) for f in frozen})
    updates, o = opt.update(grads, o, p)
    return (optax.apply_updates(p, updates), o), None

  def chunk(carry, k):
    carry, _ = jax.lax.scan(step, carry, jax.random.split(k, eval_every))
    p = carry[0]
    return carry, (recall_at(p, train, slate_size), recall_at(p, held_out, slate_size))

  _, (fitted, held) = jax.lax.scan(chunk, (params, opt.init(params)),
                                   jax.random.split(key, steps // eval_every))
  first = lambda part: recall_at(params, part, slate_size)[None]
  return FitCurve(fitted=jnp.concatenate([first(train), fitted]),
                  held_out=jnp.concatenate([first(held_out), held]))
