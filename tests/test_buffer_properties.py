"""Property test of the ring buffer (Eq. (13)-(14)) against `collections.deque(maxlen=C)`.

Random sequences of pushes with random `where` masks: after every push the valid slots hold
exactly the deque's contents, oldest first from `insert_index - len`, every field of an experience
stays with its query, and `insert_index` / `num_pushed` agree with the model. Small shapes (d = 3,
K = 2, C <= 6); every batch is padded to C rows (`where` = False on the padding), so one shape
compiles per capacity.
"""
import collections
import functools

import hypothesis
from hypothesis import strategies as st
import jax
import numpy as np
import pytest

from ear_jax.core import buffer
from ear_jax.core.config import EARConfig

D, K = 3, 2


_push = jax.jit(buffer.push_experiences)


@functools.lru_cache(maxsize=None)
def _empty(capacity):
  """`init_buffer` of capacity C, jitted (one compile per C instead of one per array)."""
  config = EARConfig(dim=D, num_candidates=K, slate_size=1, replay_size=1,
                     buffer_capacity=capacity, batch_size=1)
  return jax.jit(buffer.init_buffer, static_argnums=0)(config)


def _experiences(ids):
  """Rows whose every field encodes the row's id (so a misplaced field is detected)."""
  ids = np.asarray(ids, np.float32)
  n = len(ids)
  q = np.stack([ids, -ids, np.ones(n)], -1).astype(np.float32)  # [b, d]
  c = (ids[:, None, None] + np.arange(K * D, dtype=np.float32).reshape(1, K, D) / 8)  # [b, K, d]
  mask = np.stack([ids % 2 == 0, np.ones(n, bool)], -1)  # [b, K]
  observed = np.stack([np.ones(n, bool), ids % 3 == 0], -1)
  ybar = np.stack([ids, ids / 2], -1).astype(np.float32)
  return q, c.astype(np.float32), mask, observed, ybar


@st.composite
def _push_sequences(draw):
  capacity = draw(st.integers(1, 6))
  pushes = []
  for _ in range(draw(st.integers(1, 10))):
    n = draw(st.integers(1, capacity))  # the batch's size; rows n..C-1 are padding
    where = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    pushes.append(where + [False] * (capacity - n))
  return capacity, pushes


@hypothesis.settings(max_examples=40, deadline=None, database=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(_push_sequences())
def test_ring_buffer_matches_a_bounded_deque(case):
  capacity, pushes = case
  buf = _empty(capacity)
  model = collections.deque(maxlen=capacity)
  next_id, total = 1, 0
  for where in pushes:
    ids = np.arange(next_id, next_id + capacity)
    next_id += capacity
    buf = _push(buf, *_experiences(ids), np.asarray(where))
    model.extend(ids[np.asarray(where)].tolist())
    total += int(np.sum(where))

    host = jax.device_get(buf)
    assert int(host.num_pushed) == total
    assert int(host.insert_index) == total % capacity
    valid = host.valid
    assert int(valid.sum()) == len(model) == min(total, capacity)
    q = host.queries
    assert sorted(q[valid, 0].tolist()) == sorted(model)
    # Oldest first, starting at the slot that the next push overwrites once the buffer is full.
    order = [(total - len(model) + j) % capacity for j in range(len(model))]
    assert q[order, 0].tolist() == list(model)
    want = _experiences(np.asarray(list(model), np.float32))
    got = (q[order], host.candidates[order], host.mask[order], host.observed[order],
           host.ybar[order])
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w.reshape(g.shape))
    # Empty slots were never written.
    assert not np.any(q[~valid])


def test_pushing_more_than_the_capacity_at_once_is_an_error():
  config = EARConfig(dim=D, num_candidates=K, slate_size=1, replay_size=1, buffer_capacity=2,
                     batch_size=1)
  with pytest.raises(ValueError, match="capacity 2"):
    buffer.push_experiences(buffer.init_buffer(config),
                            *_experiences(np.arange(1, 4)), np.ones(3, bool))
