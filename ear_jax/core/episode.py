"""Whole online episodes: a stream of training queries as ONE `lax.scan` over batches (Alg. 1).

Symbols: `N` training queries, `b` batch size. `run_episode` splits the key once (an init key and
one key per query) and scans `learner.train_batch`; `vmap` it over seeds, `HParams` or critics.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ear_jax.core import critic as critic_lib
from ear_jax.core import learner
from ear_jax.core.config import EARConfig, HParams
from ear_jax.core.critic import Critic
from ear_jax.core.learner import LearnerState
from ear_jax.core.stream import Stream


def _pad_to_batches(tree, n: int, batch_size: int):
  num_batches = -(-n // batch_size)
  idx = jnp.minimum(jnp.arange(num_batches * batch_size), n - 1)
  return jax.tree_util.tree_map(
      lambda x: x[idx].reshape((num_batches, batch_size) + x.shape[1:]), tree)


def train_stream(state: LearnerState, keys: jax.Array, stream: Stream, config: EARConfig,
                 hparams: HParams, critic: Optional[Critic] = None,
                 where: Optional[jax.Array] = None):
  """Online training over a stream, in order, as ONE `lax.scan` over batches.

  Consecutive chunks whose lengths are multiples of the batch size give the same result as one
  call on the whole stream. `keys [N]` per-query keys (`episode_keys`) are consumed. `where [N]`
  (default: all real): masked queries are padding, and a batch without a real query leaves the
  state untouched with zero records (fixed-length segments reuse one compiled scan).

  Returns:
    `(new_state, records)`: `QueryRecord` fields stacked to `[N, ...]`; for an untrained method
    the state unchanged and None.
  """
  validate_stream(stream, config)
  if not config.trains:
    return state, None
  critic = critic_lib.or_default(critic)
  n, b = stream.queries.shape[0], config.batch_size
  real = jnp.ones((n,), bool) if where is None else jnp.asarray(where, bool)
  keys, stream, real = _pad_to_batches((keys, stream, real), n, b)
  real = real & (jnp.arange(real.size) < n).reshape(real.shape)

  def body(carry, x):
    k, batch, w = x
    run = lambda st: learner.train_batch(st, k, batch, w, config, hparams, critic)
    if where is None:  # padding only fills the last batch: every batch holds a real query
      return run(carry)

    def skip(st):
      records = jax.eval_shape(run, st)[1]
      return st, jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), records)

    return jax.lax.cond(jnp.any(w), run, skip, carry)

  state, records = jax.lax.scan(body, state, (keys, stream, real))
  records = jax.tree_util.tree_map(lambda r: r.reshape((-1,) + r.shape[2:])[:n], records)
  return state, records


def episode_keys(key: jax.Array, num_queries: int):
  """Splits an episode key into `(init_key, per_query_keys [N])`; the key is consumed."""
  k_init, k_stream = jax.random.split(key)
  return k_init, jax.random.split(k_stream, num_queries)


def run_episode(key: jax.Array, stream: Stream, config: EARConfig, hparams: HParams,
                critic: Optional[Critic] = None):
  """A whole online training episode: init, then `train_stream` over the stream (one scan).

  Args:
    key: PRNG key of the episode; the key is consumed.
    stream: `N` training queries, in the order they arrive.
    critic: the critic (default: the simulated critic of Appendix A.2).

  Returns:
    `(final LearnerState, records)` as in `train_stream`.
  """
  k_init, keys = episode_keys(key, stream.queries.shape[0])
  return train_stream(learner.init_learner(k_init, config), keys, stream, config, hparams, critic)


def validate_stream(stream: Stream, config: EARConfig) -> None:
  """Raises ValueError, before tracing, when the stream's shapes do not match the config."""
  shapes = {f: tuple(getattr(stream, f).shape) for f in
            ("queries", "candidates", "mask", "gold", "num_gold")}
  n = shapes["queries"][0] if shapes["queries"] else None
  expected = {"queries": (n, config.dim),
              "candidates": (n, config.num_candidates, config.dim + config.side_features),
              "mask": (n, config.num_candidates), "gold": (n, config.num_candidates),
              "num_gold": (n,)}
  for field, shape in shapes.items():
    if shape != expected[field]:
      raise ValueError(
          f"stream.{field} has shape {shape}, expected {expected[field]} for config "
          f"dim={config.dim}, num_candidates={config.num_candidates}, "
          f"side_features={config.side_features}")
  if n == 0:
    raise ValueError("the stream holds no queries")
  if stream.answer_support is not None and (
      tuple(stream.answer_support.shape[:2]) != (n, config.num_candidates)
      or len(stream.answer_support.shape) != 3):
    raise ValueError(f"stream.answer_support has shape {tuple(stream.answer_support.shape)}, "
                     f"expected ({n}, {config.num_candidates}, A)")

