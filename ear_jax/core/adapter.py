"""The residual retrieval adapter (Eq. (3)) and the relevance distribution it defines (Eq. (4)).

Symbols: `d` embedding dimension, `K` candidates, `F` first-stage side features.
`W_q, W_m` are `[d, d]`, zero-initialised (the identity map); `I + W` is never materialised.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import chex
import flax
import jax
import jax.numpy as jnp

if TYPE_CHECKING:
  from ear_jax.core.config import EARConfig

_NORM_EPS = 1e-12
# Logit given to masked candidates inside softmaxes (finite, so masked reductions never make NaN).
MASKED_LOGIT = -1e9


@flax.struct.dataclass
class AdapterParams:
  """Adapter parameters phi = {W_q, W_m} (Eq. (3)), and `w_side` weighing the side features."""
  w_q: jax.Array  # [d, d] float32
  w_m: jax.Array  # [d, d] float32
  w_side: Optional[jax.Array] = None  # [F] float32, None without side features


def init_adapter(key: jax.Array, config: EARConfig) -> AdapterParams:
  """Identity-initialised adapter parameters (`W_q = W_m = 0`).

  With side features `w_side = [side_init, -1, 0, ...]`: the initial relevance is `side_init` times
  the first stage's normalised score. The key is consumed (the init draws nothing from it).
  """
  w_side = None
  if config.side_features:
    w_side = jnp.zeros((config.side_features,), jnp.float32).at[:2].set(
        jnp.asarray([config.side_init, -1.0], jnp.float32))
  del key
  zeros = jnp.zeros((config.dim, config.dim), jnp.float32)
  return AdapterParams(w_q=zeros, w_m=zeros, w_side=w_side)


def safe_normalize(x: jax.Array) -> jax.Array:
  """`x / ||x||` along the last axis; a zero vector stays zero (finite value and gradient)."""
  sq = jnp.sum(x * x, axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(jnp.maximum(sq, _NORM_EPS))


def _residual(x: jax.Array, w: jax.Array) -> jax.Array:
  """`(I + W) x` for row vectors `x [..., d]`, as `x + x W^T` (never forming `I + W`)."""
  return x + x @ w.T


def adapt_queries(params: AdapterParams, q: jax.Array) -> jax.Array:
  """Adapted query `q~ = (I + W_q) q / ||(I + W_q) q||`, Eq. (3), `[..., d]`."""
  return safe_normalize(_residual(q, params.w_q))


def adapt_memories(params: AdapterParams, m: jax.Array) -> jax.Array:
  """Adapted memories `m~_i = (I + W_m) m_i / ||(I + W_m) m_i||`, Eq. (3), `[..., d]`."""
  return safe_normalize(_residual(m, params.w_m))


def relevance_logits(q_adapted: jax.Array, m_adapted: jax.Array) -> jax.Array:
  """Relevance logits `z_i = q~^T m~_i`, Eq. (4): `[d]`, `[K, d]` -> `[K]`."""
  chex.assert_rank([q_adapted, m_adapted], [1, 2])
  return m_adapted @ q_adapted


def relevance_log_probs(logits: jax.Array, where: jax.Array) -> jax.Array:
  """`log p_phi(i | x, C)`: log-softmax of `[K]` logits over valid candidates `where`, Eq. (4).

  Masked entries hold a large negative finite value; an all-masked input gives finite values.
  """
  chex.assert_rank([logits, where], 1)
  return jax.nn.log_softmax(jnp.where(where, logits, MASKED_LOGIT))


def split_candidates(params: AdapterParams, c: jax.Array):
  """`(embeddings [..., d], side features [..., F] or None)` of candidate rows `c [..., d + F]`."""
  if params.w_side is None:
    return c, None
  f = params.w_side.shape[-1]
  return c[..., :-f], c[..., -f:]


def relevance(params: AdapterParams, q: jax.Array, c: jax.Array):
  """Adapt -> relevance of one query's candidates: Eq. (3)-(4), plus the side term.

  `z_i = q~ . m~_i (+ w_side . f_i)` for candidate rows `[m_i (d) | f_i (F)]` (Appendix B.6).

  Args:
    q: `[d]` pre-adapter query.
    c: `[K, d]` pre-adapter candidates (`[K, d + F]` with side features).

  Returns:
    `(z [K] logits, m~ [K, d] adapted candidate embeddings)` (the latter for Eq. (6)).
  """
  m, f = split_candidates(params, c)
  m_t = adapt_memories(params, m)
  z = relevance_logits(adapt_queries(params, q), m_t)
  if f is not None:
    z = z + f @ params.w_side
  return z, m_t


def gram(m_adapted: jax.Array) -> jax.Array:
  """`G_il = m~_i . m~_l`, the adapted candidates' similarities of Eq. (6): `[K, d]` -> `[K, K]`."""
  return m_adapted @ m_adapted.T


def adapter_scores(params: AdapterParams, q: jax.Array, m: jax.Array) -> jax.Array:
  """`z` of `relevance` alone, for `q [d]` and candidates `m [K, d]` (`[K, d + F]`) -> `[K]`."""
  return relevance(params, q, m)[0]
