"""The Experience Buffer: a fixed-capacity ring buffer of experiences (Eq. (13)-(15), Table 7).

Symbols: `C` capacity, `K` candidates, `d` dimension, `B` replayed experiences, `b` a batch.
Experiences are stored BEFORE the adapter (re-applied at replay time); the oldest is overwritten.
"""
from __future__ import annotations

from typing import NamedTuple

import chex
import flax
import jax
import jax.numpy as jnp

from ear_jax.core.config import EARConfig, resolve_strategy
from ear_jax.core.types import ReplayStrategy


@flax.struct.dataclass
class ReplayBuffer:
  """Fixed-capacity ring buffer of experiences."""
  queries: jax.Array  # [C, d] float32, pre-adapter query embeddings
  candidates: jax.Array  # [C, K, d (+ F)] float32, pre-adapter candidate rows (+ side features)
  mask: jax.Array  # [C, K] bool, valid candidates
  observed: jax.Array  # [C, K] bool, candidates that received feedback (Eq. (11))
  ybar: jax.Array  # [C, K] float32, mean labels (Eq. (12)); 0 where unobserved
  valid: jax.Array  # [C] bool, slots holding an experience
  insert_index: jax.Array  # [] int32, next slot to write
  num_pushed: jax.Array  # [] int32, experiences pushed in total


def init_buffer(config: EARConfig) -> ReplayBuffer:
  """An empty buffer of capacity `config.buffer_capacity`."""
  c, k, d = config.buffer_capacity, config.num_candidates, config.dim
  return ReplayBuffer(
      queries=jnp.zeros((c, d), jnp.float32),
      candidates=jnp.zeros((c, k, d + config.side_features), jnp.float32),
      mask=jnp.zeros((c, k), bool), observed=jnp.zeros((c, k), bool),
      ybar=jnp.zeros((c, k), jnp.float32), valid=jnp.zeros((c,), bool),
      insert_index=jnp.zeros((), jnp.int32), num_pushed=jnp.zeros((), jnp.int32))


def push_experiences(buffer: ReplayBuffer, queries: jax.Array, candidates: jax.Array,
                     mask: jax.Array, observed: jax.Array, ybar: jax.Array,
                     where: jax.Array) -> ReplayBuffer:
  """Appends a batch of experiences in order, overwriting the oldest, Eq. (13)-(14).

  `queries [b, d]`, `candidates [b, K, d]`, `mask`, `observed`, `ybar` `[b, K]`; `where [b]` bool
  rows to push (padding skipped); `b <= C`.
  """
  chex.assert_rank([queries, candidates, where], [2, 3, 1])
  capacity = buffer.valid.shape[0]
  if queries.shape[0] > capacity:
    raise ValueError(f"cannot push {queries.shape[0]} experiences at once into a buffer of "
                     f"capacity {capacity}")
  offset = jnp.cumsum(where.astype(jnp.int32)) - 1
  slot = jnp.where(where, (buffer.insert_index + offset) % capacity, capacity)  # C = dropped
  put = lambda dst, src: dst.at[slot].set(src, mode="drop")
  n = jnp.sum(where.astype(jnp.int32))
  return ReplayBuffer(
      queries=put(buffer.queries, queries), candidates=put(buffer.candidates, candidates),
      mask=put(buffer.mask, mask), observed=put(buffer.observed, observed),
      ybar=put(buffer.ybar, ybar), valid=put(buffer.valid, jnp.ones_like(where)),
      insert_index=(buffer.insert_index + n) % capacity, num_pushed=buffer.num_pushed + n)


def experience_rewards(buffer: ReplayBuffer) -> jax.Array:
  """`[C]` mean aggregated label over each experience's observed candidates (0 if none)."""
  num = jnp.sum(jnp.where(buffer.observed, buffer.ybar, 0.0), axis=-1)
  return num / jnp.maximum(jnp.sum(buffer.observed, axis=-1), 1)


def similarity_replay(key: jax.Array, buffer: ReplayBuffer, query: jax.Array) -> jax.Array:
  """Eq. (15): replay the experiences whose pre-adapter query is most similar, `q^T q_r`."""
  del key
  return buffer.queries @ query


def reward_replay(key: jax.Array, buffer: ReplayBuffer, query: jax.Array) -> jax.Array:
  """Table 7 'reward': replay the experiences with the lowest mean reward."""
  del key, query
  return -experience_rewards(buffer)


def random_replay(key: jax.Array, buffer: ReplayBuffer, query: jax.Array) -> jax.Array:
  """Table 7 'random': replay uniformly at random (without replacement); the key is consumed."""
  del query
  return jax.random.uniform(key, buffer.valid.shape)


# Replay strategies (`core.types.ReplayStrategy`) by name.
REPLAY_STRATEGIES: dict[str, ReplayStrategy] = {
    "similarity": similarity_replay,
    "reward": reward_replay,
    "random": random_replay,
}


def replay_strategy(value) -> ReplayStrategy:
  """`EARConfig.replay_strategy` (a name in `REPLAY_STRATEGIES`, or a function) -> the function.

  Raises:
    ValueError: for a name not in `REPLAY_STRATEGIES`.
  """
  return resolve_strategy("replay_strategy", value, REPLAY_STRATEGIES)


def select_replay(key: jax.Array, buffer: ReplayBuffer, query: jax.Array, replay_size: int,
                  strategy="similarity"):
  """Chooses the experiences to replay for one query, Eq. (15) and Table 7.

  The key is consumed (by the strategy); `buffer` as it stood before this query's batch; `query
  [d]`; `strategy` a `ReplayStrategy` or its name: the `B` valid slots with the top scores.

  Returns:
    `(indices [B] int32, replay_mask [B] bool)`; fewer than B valid while the buffer is short.
  """
  chex.assert_rank(query, 1)
  score = replay_strategy(strategy)(key, buffer, query)
  vals, idx = jax.lax.top_k(jnp.where(buffer.valid, score, -jnp.inf), replay_size)
  return idx.astype(jnp.int32), vals > -jnp.inf


class Experiences(NamedTuple):
  """The buffer's fields of these names at some slots (leading axes `[...]`: the indices')."""
  queries: jax.Array  # [..., d] float32, pre-adapter query embeddings
  candidates: jax.Array  # [..., K, d] float32, pre-adapter candidate embeddings
  mask: jax.Array  # [..., K] bool, valid candidates
  observed: jax.Array  # [..., K] bool, candidates that received feedback
  ybar: jax.Array  # [..., K] float32, mean labels (Eq. (12))
  valid: jax.Array  # [...] bool, slot held an experience


def gather_experiences(buffer: ReplayBuffer, indices: jax.Array) -> Experiences:
  """The experiences in slots `indices [...]` (e.g. `[b, B]`), with leading axes `[...]`."""
  return Experiences(*(getattr(buffer, f)[indices] for f in Experiences._fields))


def after_reads(buffer: ReplayBuffer, indices: jax.Array,
                experiences: Experiences) -> ReplayBuffer:
  """The buffer with `experiences` (gathered at `indices`) written back: values unchanged.

  The write orders every later push after the reads, so inside a jitted loop XLA updates the
  `[C, K, d]` buffer in place instead of copying it every step. Pass the indices that decided the
  reads (e.g. `select_replay`'s).
  """
  idx = indices.reshape(-1)
  put = lambda dst, src: dst.at[idx].set(src.reshape((idx.shape[0],) + dst.shape[1:]))
  return buffer.replace(**{f: put(getattr(buffer, f), getattr(experiences, f))
                           for f in Experiences._fields})
