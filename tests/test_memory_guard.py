"""The guard (`EARConfig.guard_holdout`, `ear_safe`) behind a live `Memory`: adapter-only retrieval
and `recall(learn=False)` rank by `core.inference.served_params`, the first stage's ranking until
the held-out ring trusts the adapter; the ring is saved and loaded with the learner. (A test sets
the learner's state through `Memory.open(path, learner=...)`, on a new directory.)"""
import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.agent.memory.checks import check_embeddings
from ear_jax.core import adapter as adapter_lib
from ear_jax.core import guard as guard_lib
from ear_jax.core.config import EARConfig, Method

D = 16
N = 40
H = 60  # held-out questions of the trusted ring (>= guard_min_queries)
METHOD = Method.named("ear_safe", dim=D)


def _embeddings():
  return np.random.default_rng(0).normal(size=(N, D))


def _memory(tmp_path=None, **learner_fields):
  """An `ear_safe` memory of N memories; with `learner_fields`, opened at a new directory under
  `tmp_path` with its learner state changed so (`Memory.open(learner=)`)."""
  config = MemoryConfig(encoder=None, config=METHOD.config, hparams=METHOD.hparams)
  if learner_fields:
    start = Memory(config).learner.replace(**learner_fields)
    m = Memory.open(tmp_path / f"m{len(list(tmp_path.iterdir()))}", config, learner=start)
  else:
    m = Memory(config)
  m.add([f"memory {i}" for i in range(N)], embeddings=_embeddings())
  return m, np.random.default_rng(1)


def _trusted(params) -> guard_lib.GuardState:
  """A ring of H held-out questions over the memories, each citing the candidates `params` puts
  in its top-s and the first stage does not: every question says the adapter wins."""
  cfg = METHOD.config
  rng = np.random.default_rng(2)
  unit = check_embeddings(_embeddings(), N, D, "embeddings")  # (as `add` stores them)
  k, s = cfg.num_candidates, cfg.slate_size
  queries = rng.normal(size=(H, D)).astype(np.float32)
  cands = unit[np.stack([rng.choice(N, k, replace=False) for _ in range(H)])]
  top = lambda p: jax.vmap(lambda q, c: jax.lax.top_k(adapter_lib.adapter_scores(p, q, c), s)[1])(
      queries, cands)
  slates = np.asarray(top(params))[:, None]  # [H, 1, s]: the adapter's top-s, one page
  in_first = np.asarray(jax.vmap(lambda a, b: jnp.isin(a, b))(slates[:, 0], top(
      guard_lib.first_stage_params(cfg))))
  labels = np.where(in_first, -1.0, 1.0).astype(np.float32)[:, None]
  assert (labels > 0).any(-1).all()  # (the two rankings differ on every question)
  return guard_lib.push_holdout(guard_lib.init_guard(cfg), guard_lib.first_stage_params(cfg),
                                queries, cands, np.ones((H, k), bool), slates,
                                np.ones(slates.shape, bool), labels, np.ones((H,), bool), s)


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


def test_a_guarded_memory_serves_the_first_stage_until_its_ring_trusts_the_adapter(tmp_path):
  m, rng = _memory()
  assert m.config.ear.guard and m.learner.guard is not None
  q = rng.normal(size=D)
  cosine = _ids(m, q)  # the untrained adapter: the first stage's top-5
  bad = _bad_params(m, rng)
  assert _ids(_memory(tmp_path, params=bad)[0], q) == cosine  # served: the first stage's ranking
  assert m.stats["serves_adapter"] == 0 and m.stats["guard_evidence"] == 0
  trusted = _memory(tmp_path, params=bad, guard=_trusted(bad))[0]
  assert bool(guard_lib.serve_adapted(bad, trusted.learner.guard, METHOD.config))
  assert _ids(trusted, q) != cosine  # trusted now: the adapter's own ranking is served
  assert trusted.stats["serves_adapter"] == 1 and trusted.stats["guard_evidence"] == H


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
  assert _first_round(_memory(tmp_path, params=bad, guard=_trusted(bad))[0], q) != first_stage


def test_the_guard_ring_is_saved_and_loaded_with_the_learner(tmp_path):
  m, rng = _memory()
  bad = _bad_params(m, rng)
  ring = _trusted(bad)
  m, _ = _memory(tmp_path, params=bad, guard=ring)
  m.save()
  m.close()
  [path] = tmp_path.iterdir()
  with Memory.open(path) as loaded:
    for a, b in zip(jax.tree_util.tree_leaves(loaded.learner.guard),
                    jax.tree_util.tree_leaves(ring)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert bool(guard_lib.serve_adapted(loaded.learner.params, loaded.learner.guard,
                                        loaded.config.ear))


def test_a_directory_saved_with_the_guards_evidence_sums_opens_and_serves_as_before(tmp_path):
  # tests/fixtures/guard_sums_memory: `ear_safe` saved by the code that also kept evidence sums
  # beside the held-out ring (made by tests/fixtures/make_previous_layouts.py with that code).
  import json  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  fixtures = pathlib.Path(__file__).parent / "fixtures"
  old = json.loads((fixtures / "guard_sums_memory.json").read_text())
  shutil.copytree(fixtures / "guard_sums_memory", tmp_path / "m")
  with Memory.open(tmp_path / "m") as m:  # (written under presets 4: side_init 0.05)
    assert m.config.ear == EARConfig.for_method("ear_safe", dim=8, side_init=0.05)
    assert int(m.learner.guard.count) == old["ring_count"] == 2
    assert int(m.learner.queries_seen) == old["queries_seen"]
    np.testing.assert_array_equal(np.asarray(m.learner.params.w_q), np.float32(old["w_q"]))
    assert [list(m.search(query_embedding=q, k=5).ids) for q in old["queries"]] == old["search"]
    m.recall("one more", lambda key, view: -np.ones(len(view.ids), np.float32), k=5,
             query_embedding=np.ones(8))
    m.save()
  with Memory.open(tmp_path / "m") as again:  # (saved without the sums, opened again)
    assert int(again.learner.guard.count) == 2 and len(again.list()) == 30
