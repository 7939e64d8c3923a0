"""The prequential guard (issue 27, `EARConfig.guard`, `ear_safe` before session 11: its held-out
ring off, `tests/test_guard_holdout.py` has the ring) behind a live `Memory`: adapter-only
retrieval and `recall(learn=False)` rank by `core.inference.served_params`, the first stage's
ranking until the learner's own out-of-sample feedback trusts the adapter; exploring (training)
rounds keep the adapter's; the guard's state is saved and loaded with the learner's. (A test
sets the learner's state through `Memory.open(path, learner=...)`, on a new directory.)"""
import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.core import guard as guard_lib
from ear_jax.core.config import Method

D = 16
N = 40


def _memory(tmp_path=None, **learner_fields):
  """A guarded memory of N memories; with `learner_fields`, opened at a new directory under
  `tmp_path` with its learner state changed so (`Memory.open(learner=)`)."""
  m = Method.named("ear_safe", dim=D, guard_holdout=0, guard_z=0.5,  # the prequential guard
                   guard_evidence="items")
  config = MemoryConfig(encoder=None, config=m.config, hparams=m.hparams)
  if learner_fields:
    start = Memory(config).learner.replace(**learner_fields)
    m = Memory.open(tmp_path / f"m{len(list(tmp_path.iterdir()))}", config, learner=start)
  else:
    m = Memory(config)
  rng = np.random.default_rng(0)
  emb = rng.normal(size=(N, D))
  m.add([f"memory {i}" for i in range(N)], embeddings=emb)
  return m, rng


def _trusted() -> guard_lib.GuardState:
  """Evidence of 100 queries, each putting one more cited memory in the adapter's top-s."""
  return guard_lib.GuardState(count=jnp.int32(100), weight=jnp.float32(100.0),
                              weight_sq=jnp.float32(100.0), total=jnp.float32(100.0),
                              total_sq=jnp.float32(100.0))


def _bad_params(m, rng):
  """An adapter that ranks otherwise than the first stage (with no evidence for it)."""
  return m.learner.params.replace(w_q=jnp.asarray(rng.normal(size=(D, D)) * 3.0, jnp.float32))


def _ids(m, q):
  """The adapter-only top-5 of `q`: `search`'s, which a session's adapter-only round equals."""
  hit = m.search(query_embedding=q, k=5).ids
  s = m.session(query_embedding=q)
  assert s.round(5, explore=False).ids == hit
  s.close()
  return hit


def test_a_guarded_memory_serves_the_first_stage_until_its_feedback_trusts_the_adapter(tmp_path):
  m, rng = _memory()
  assert m.config.ear.guard and m.learner.guard is not None
  q = rng.normal(size=D)
  cosine = _ids(m, q)  # the untrained adapter: the first stage's top-5
  bad = _bad_params(m, rng)
  assert _ids(_memory(tmp_path, params=bad)[0], q) == cosine  # served: the first stage's ranking
  assert m.stats["serves_adapter"] == 0 and m.stats["guard_evidence"] == 0
  trusted = _memory(tmp_path, params=bad, guard=_trusted())[0]
  assert _ids(trusted, q) != cosine  # trusted now: the adapter's own ranking is served
  assert trusted.stats["serves_adapter"] == 1 and trusted.stats["guard_evidence"] == 100


def _first_round(m, q):
  seen = []

  def critic(key, view):  # cites nothing
    del key
    seen.append(list(view.ids))
    return -np.ones(len(view.ids), np.float32)

  m.recall("a question", critic, k=5, query_embedding=q, learn=False, rule="explorer")
  return seen[0]


def test_recall_without_learning_explores_over_the_served_ranking(tmp_path):
  m, rng = _memory()
  q = rng.normal(size=D)
  first_stage = _first_round(m, q)  # the untrained adapter = the first stage's ranking
  bad = _bad_params(m, rng)
  # untrusted adapter: explored over the first stage; trusted: over the adapter's ranking
  assert _first_round(_memory(tmp_path, params=bad)[0], q) == first_stage
  assert _first_round(_memory(tmp_path, params=bad, guard=_trusted())[0], q) != first_stage


def test_the_guard_state_is_saved_and_loaded_with_the_learner(tmp_path):
  m, _ = _memory(tmp_path, guard=_trusted())
  m.save()
  m.close()
  [path] = tmp_path.iterdir()
  with Memory.open(path) as loaded:
    for a, b in zip(jax.tree_util.tree_leaves(loaded.learner.guard),
                    jax.tree_util.tree_leaves(_trusted())):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert bool(guard_lib.serve_adapted(loaded.learner.guard, loaded.config.ear))
