"""The simulated citation critic of Appendix A.2, as a pure function (so episodes stay in `jit`).

Symbols: `s` slate size.

A critic is any pure function `critic(key, slate_gold, slate_mask, hparams) -> labels` with
`slate_gold [s]` bool (which slate items are gold), `slate_mask [s]` bool (which positions hold an
item) and `labels [s]` float32 in {-1, +1}. Research code can pass its own to the episode functions.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from ear_jax.core.config import HParams


def false_positive_rate(num_gold: jax.Array, num_other: jax.Array, precision: jax.Array,
                        recall: jax.Array) -> jax.Array:
  """`p_fp = n r (1 - p) / (u p)`, clipped to [0, 1]; 0 when `n = 0` or `u = 0` (Appendix A.2).

  Args:
    num_gold: `n`, gold items in the slate.
    num_other: `u`, non-gold items in the slate.
    precision: `p`, target precision.
    recall: `r`, target recall.
  """
  n = jnp.asarray(num_gold, jnp.float32)
  u = jnp.asarray(num_other, jnp.float32)
  rate = n * recall * (1.0 - precision) / (jnp.maximum(u, 1.0) * precision)
  return jnp.where((n > 0) & (u > 0), jnp.clip(rate, 0.0, 1.0), 0.0)


def simulated_critic(key: jax.Array, slate_gold: jax.Array, slate_mask: jax.Array,
                     hparams: HParams) -> jax.Array:
  """Labels a slate like an LLM citing memories with given precision and recall (Appendix A.2).

  Each gold item is cited with probability `r`; each non-gold item with `p_fp` (see
  `false_positive_rate`). Cited -> +1, else -1. One uniform draw per slate position:
  `u = jax.random.uniform(key, (s,))`, cited iff `u < r` (gold) or `u < p_fp` (non-gold).

  Args:
    key: PRNG key; the key is consumed.
    slate_gold: `[s]` bool, which slate items are gold.
    slate_mask: `[s]` bool, which slate positions hold an item.
    hparams: `critic_precision` (p) and `critic_recall` (r).

  Returns:
    `[s]` float32 labels in {-1, +1} (-1 at empty positions).
  """
  chex.assert_rank([slate_gold, slate_mask], 1)
  gold = slate_gold & slate_mask
  other = ~slate_gold & slate_mask
  p_fp = false_positive_rate(jnp.sum(gold), jnp.sum(other), hparams.critic_precision,
                             hparams.critic_recall)
  u = jax.random.uniform(key, slate_mask.shape)
  cited = (gold & (u < hparams.critic_recall)) | (other & (u < p_fp))
  return jnp.where(cited, 1.0, -1.0).astype(jnp.float32)


def oracle_critic(key: jax.Array, slate_gold: jax.Array, slate_mask: jax.Array,
                  hparams: HParams) -> jax.Array:
  """A noiseless critic: +1 exactly for gold items (precision = recall = 1). The key is unused."""
  del key, hparams
  return jnp.where(slate_gold & slate_mask, 1.0, -1.0).astype(jnp.float32)
