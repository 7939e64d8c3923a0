"""The guard (issue 27, `EARConfig.guard`, `method="ear_safe"`) behind a live `Memory`: adapter-only
retrieval and `recall(learn=False)` rank by `core.inference.served_params`, the first stage's
ranking until the learner's own out-of-sample feedback trusts the adapter; exploring (training)
rounds keep the adapter's; the guard's state is saved and loaded with the learner's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.agent.memory import Memory
from ear_jax.core import guard as guard_lib

D = 16
N = 40


def _memory():
  m = Memory(None, method="ear_safe", dim=D)
  rng = np.random.default_rng(0)
  emb = rng.normal(size=(N, D))
  m.add([f"memory {i}" for i in range(N)], embeddings=emb)
  return m, rng


def _trusted() -> guard_lib.GuardState:
  """Evidence of 100 queries, each putting one more cited memory in the adapter's top-s."""
  return guard_lib.GuardState(count=jnp.int32(100), weight=jnp.float32(100.0),
                              weight_sq=jnp.float32(100.0), total=jnp.float32(100.0),
                              total_sq=jnp.float32(100.0))


def _set(m, **fields):
  m._driver.state = m._driver.state.replace(**fields)  # pylint: disable=protected-access


def _ids(m, q, explore=False):
  r = m.retrieve(query_embedding=q, k=5, explore=explore)
  m.discard(r)
  m.close(r)
  return r.ids


def test_a_guarded_memory_serves_the_first_stage_until_its_feedback_trusts_the_adapter():
  m, rng = _memory()
  assert m.config.guard and m.state.guard is not None
  q = rng.normal(size=D)
  cosine = _ids(m, q)  # the untrained adapter: the first stage's top-5
  bad = m.params.replace(w_q=jnp.asarray(rng.normal(size=(D, D)) * 3.0, jnp.float32))
  _set(m, params=bad)  # an adapter that ranks otherwise, with no evidence for it yet
  assert _ids(m, q) == cosine  # served: the first stage's ranking
  _set(m, guard=_trusted())
  adapted = _ids(m, q)
  assert adapted != cosine  # trusted now: the adapter's own ranking is served
  _set(m, guard=guard_lib.init_guard())
  assert _ids(m, q) == cosine


def _first_round(m, q):
  seen = []

  def critic(key, view):  # cites nothing
    del key
    seen.append(list(view.ids))
    return -np.ones(len(view.ids), np.float32)

  m.recall("a question", critic, k=5, query_embedding=q, learn=False)
  return seen[0]


def test_recall_without_learning_explores_over_the_served_ranking():
  m, rng = _memory()
  q = rng.normal(size=D)
  first_stage = _first_round(m, q)  # the untrained adapter = the first stage's ranking
  _set(m, params=m.params.replace(w_q=jnp.asarray(rng.normal(size=(D, D)) * 3.0, jnp.float32)))
  assert _first_round(m, q) == first_stage  # untrusted adapter: explored over the first stage
  _set(m, guard=_trusted())
  assert _first_round(m, q) != first_stage  # trusted: over the adapter's ranking


def test_the_guard_state_is_saved_and_loaded_with_the_learner(tmp_path):
  m, _ = _memory()
  _set(m, guard=_trusted())
  m.save(tmp_path / "mem")
  m.release()
  loaded = Memory.load(tmp_path / "mem")
  for a, b in zip(jax.tree_util.tree_leaves(loaded.state.guard),
                  jax.tree_util.tree_leaves(_trusted())):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert bool(guard_lib.serve_adapted(loaded.state.guard, loaded.config))
