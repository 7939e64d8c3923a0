"""Slate primitives: gathering values at slate positions, and the top-s slate.

Symbols: `K` candidates, `s` slate size. Empty positions: index -1, mask False.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def top_s_slate(scores: jax.Array, where: jax.Array, slate_size: int):
  """The `s` highest-scoring valid candidates of `scores [K]`, best first (Section 3.6).

  Returns:
    `(slate [s] int32, slate_mask [s] bool)`.
  """
  vals, idx = jax.lax.top_k(jnp.where(where, scores, -jnp.inf), slate_size)
  ok = vals > -jnp.inf
  return jnp.where(ok, idx, -1).astype(jnp.int32), ok


def gather_slate(values: jax.Array, slate: jax.Array, slate_mask: jax.Array, fill=0):
  """`values[slate]` along axis 0 with `fill` at empty positions (index -1 never wraps around)."""
  got = values[jnp.maximum(slate, 0)]
  shape = slate_mask.shape + (1,) * (got.ndim - slate_mask.ndim)
  return jnp.where(slate_mask.reshape(shape), got, fill)
