"""Retrieval metrics: Recall@s (ALL gold in the slate) and Hitrate@s (ANY gold), Section 4.4.

Gold outside the top-K count as misses; an empty or all-masked set gives 0, not NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ear_jax.core.slates import gather_slate


def gold_in_slate(gold: jax.Array, slate: jax.Array, slate_mask: jax.Array) -> jax.Array:
  """`[]` int32: gold candidates in a slate (`gold [K]`, `slate [s]`, `slate_mask [s]`)."""
  return jnp.sum(gather_slate(gold, slate, slate_mask, False)).astype(jnp.int32)


def slate_recall(num_hit: jax.Array, num_gold: jax.Array) -> jax.Array:
  """Recall@s of one query: True iff every gold memory is in the slate (and there is gold)."""
  return (num_gold > 0) & (num_hit >= num_gold)


def slate_hit(num_hit: jax.Array) -> jax.Array:
  """Hitrate@s of one query: True iff any gold memory is in the slate."""
  return num_hit > 0


def masked_mean(values: jax.Array, where: jax.Array | None = None) -> jax.Array:
  """Mean of `values` over `where` (all by default); 0 for an empty set."""
  values = jnp.asarray(values, jnp.float32)
  where = jnp.ones(values.shape, bool) if where is None else where
  return jnp.sum(jnp.where(where, values, 0.0)) / jnp.maximum(jnp.sum(where), 1)
