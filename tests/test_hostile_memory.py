"""`Memory` under hostile use: foreign and stale retrievals, threads, saves during mutation,
adversarial critics, malformed input, foreign or truncated checkpoints (issue 10)."""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.agent.memory import Memory, Retrieval
from ear_jax.core import learner as learner_lib
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.core.stream import Stream
from ear_jax.data import encoders
from ear_jax.io import checkpoints
from tests.test_memory import _D, _config, _memory, _queries, _unit, rejects


def _finite(m: Memory) -> bool:
  return all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(m.state))


# ------------------------------------------------------------------------------------------------
# identity of retrievals


def test_feedback_with_another_memorys_retrieval_raises_and_changes_nothing():
  a, b = _memory(), _memory()
  ra = a.retrieve("q", k=3, explore=True, query_embedding=_queries(1)[0])
  rb = b.retrieve("q", k=3, explore=True, query_embedding=_queries(1)[0])
  assert (ra.retrieval_id, ra.session_id, ra.ids) == (rb.retrieval_id, rb.session_id, rb.ids)
  for call in (lambda: a.feedback(rb, [rb.ids[0]]), lambda: a.feedback_batch([rb], [[]]),
               lambda: a.discard(rb), lambda: a.close(rb)):
    rejects(a, call, "belongs to another Memory")
  b.feedback(rb, [])
  rejects(a, lambda: a.retrieve(continue_from=rb, k=3, explore=True), "belongs to another Memory")
  forged = Retrieval(**{**vars(ra), "session_id": 5})
  rejects(a, lambda: a.feedback(forged, []), "does not match its session")
  a.feedback(ra, [])  # the real one still works


def test_feedback_with_a_retrieval_from_before_restore_or_load_raises_and_changes_nothing(tmp_path):
  m = _memory()
  r_old = m.retrieve("q", k=3, explore=True, query_embedding=_queries(1)[0])
  m.save(tmp_path / "c")
  m.restore(tmp_path / "c")
  assert m.generation == 1
  rejects(m, lambda: m.feedback(r_old, []), r"is stale: it was returned at generation 0")
  rejects(m, lambda: m.discard(r_old), "is stale")
  m.feedback(r_old.retrieval_id, [])  # the bare id names the restored (still open) retrieval
  r_new = m.retrieve("q", k=3, explore=True, query_embedding=_queries(1)[0])
  assert r_new.generation == 1
  loaded = Memory.load(tmp_path / "c")  # a new memory: a new identity
  rejects(loaded, lambda: loaded.feedback(r_old, []), "belongs to another Memory")
  m.feedback(r_new, [])


def test_restore_refuses_another_config_and_changes_nothing(tmp_path):
  other = _memory(batch_size=4)
  other.save(tmp_path / "c")
  m = _memory()
  rejects(m, lambda: m.restore(tmp_path / "c"), r"batch_size: stored=4 vs expected=2")
  assert m.generation == 0


# ------------------------------------------------------------------------------------------------
# threads


@pytest.mark.slow
def test_two_threads_retrieving_and_giving_feedback_take_exactly_the_expected_learner_steps():
  """300 retrieve+feedback pairs per thread: one thread adapter-only (300 one-round sessions), the
  other T=2 Explorer rounds per session (150 sessions); batch size 2 -> exactly 225 steps."""
  m = _memory(batch_size=2, num_rounds=2)
  errors = []

  def adapter_only():
    q = _queries(300, 1)
    for i in range(300):
      r = m.retrieve(f"a{i}", k=3, query_embedding=q[i])
      m.feedback(r, [r.ids[0]] if i % 2 else [])

  def explorer():
    q = _queries(150, 2)
    for i in range(150):
      r = m.retrieve(f"e{i}", k=3, explore=True, query_embedding=q[i])
      m.feedback(r, [])
      r = m.retrieve(continue_from=r, k=3, explore=True)
      m.feedback(r, [r.ids[1]])

  def guarded(fn):
    try:
      fn()
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=guarded, args=(f,)) for f in (adapter_only, explorer)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  assert int(m.state.step) == 450 // 2 == m.stats["learner_steps"]
  assert int(m.state.queries_seen) == 450 == int(m.state.buffer.num_pushed)
  assert m.stats["feedback"] == m.stats["retrievals"] == 600 and m.num_pending == 0
  assert _finite(m)


def test_the_critic_is_called_outside_the_lock():
  m = _memory()
  done = []

  def critic(key, view):  # another thread must be able to use the memory meanwhile
    t = threading.Thread(target=lambda: done.append(m.add(["during the critic call"],
                                                          embeddings=_queries(1, 3))))
    t.start()
    t.join(timeout=60)
    return np.full(len(view.texts), -1.0)

  r = m.retrieve("q", k=3, query_embedding=_queries(1)[0])
  m.feedback_from_critic(r, critic)
  assert done == [["m24"]] and m.num_ready == 1 and m.stats["critic_calls"] == 1


@pytest.mark.slow
def test_save_while_another_thread_mutates_gives_self_consistent_checkpoints(tmp_path):
  m = _memory(batch_size=2, num_rounds=2, max_sessions=10**6)
  stop = threading.Event()
  errors = []

  def mutate():
    rng = np.random.default_rng(0)
    i = 0
    try:
      while not stop.is_set():
        m.add([f"new {i}"], embeddings=rng.normal(size=(1, _D)))
        r = m.retrieve(f"q{i}", k=3, explore=bool(i % 2), query_embedding=rng.normal(size=_D))
        m.feedback(r, [r.ids[i % 3]])
        i += 1
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  t = threading.Thread(target=mutate)
  t.start()
  try:
    for i in range(10):
      m.save(tmp_path / f"c{i}")
  finally:
    stop.set()
    t.join()
  assert not errors, errors
  sizes = set()
  for i in range(10):
    x = Memory.load(tmp_path / f"c{i}")
    n = len(x)
    sizes.add(n)
    bank, ss, st = x._bank, x._sessions, x.state
    assert n == len(bank.texts) == bank.store_codes.size == int(np.asarray(bank.valid).sum())
    assert n == x.stats["memories_added"] and x.ids == [f"id{j}" for j in range(24)] + [
        f"m{j}" for j in range(24, n)]
    assert sum(s.rounds for s in ss.by_id.values()) == x.stats["feedback"]
    assert x.stats["retrievals"] == ss.next_retrieval == len(ss.by_id)
    assert int(st.queries_seen) == 2 * int(st.step) == int(st.buffer.num_pushed)
    assert int(st.queries_seen) + x.num_ready == x.stats["queries_queued"]
    assert all(ss.by_id[sid].open_id == rid for rid, sid in ss.open.items())
    r = x.retrieve("after load", k=3, query_embedding=_queries(1)[0])
    x.feedback(r, [])
  assert len(sizes) > 1  # the saves really interleaved with the mutations


# ------------------------------------------------------------------------------------------------
# adversarial critics: numerics


@pytest.mark.slow
def test_2000_adversarial_feedback_updates_keep_parameters_finite():
  """2,001 learner steps through the API (batch size 1): all-negative, alternating all / none, and
  random citations, on a small bank whose memories come back again and again."""
  cfg = EARConfig(dim=8, num_candidates=8, slate_size=4, num_rounds=1, batch_size=1,
                  buffer_capacity=32, replay_size=4)
  rng = np.random.default_rng(0)
  m = Memory(None, config=cfg)
  m.add([f"t{i}" for i in range(12)], embeddings=_unit(rng.normal(size=(12, 8))))
  for c in range(3):
    for chunk in range(0, 667, 100):
      n = min(100, 667 - chunk)
      rs = m.retrieve_batch(query_embeddings=_unit(rng.normal(size=(n, 8))), k=4,
                            explore=bool(c))
      m.feedback_batch(rs, [[] if c == 0 else (list(r.ids) if i % 2 else []) if c == 1 else
                            [x for x in r.ids if rng.random() < 0.5] for i, r in enumerate(rs)])
  assert int(m.state.step) == 2001 and _finite(m)
  r = m.retrieve("q", k=4, query_embedding=np.ones(8))
  assert all(np.isfinite(r.scores))


@pytest.mark.slow
def test_10000_adversarial_steps_of_memorys_learner_step_keep_params_finite():
  """10,000 optimizer steps of the exact learner step `Memory` calls (K-wide slates), for three
  adversarial critics (all negative, alternating all/none, noisy), compiled as one scan."""
  cfg = EARConfig(dim=8, num_candidates=8, slate_size=4, num_rounds=1, batch_size=1,
                  buffer_capacity=32, replay_size=4)
  hp = default_hparams()
  rng = np.random.default_rng(0)
  bank = _unit(rng.normal(size=(12, 8)))
  cand_idx = np.stack([rng.choice(12, 8, replace=False) for _ in range(64)])
  queries = _unit(rng.normal(size=(64, 8)))

  def run(pattern):
    def body(state, i):
      j = i % 64
      q, c = jnp.asarray(queries)[j], jnp.asarray(bank)[jnp.asarray(cand_idx)[j]]
      slate = jax.lax.top_k(c @ q, 4)[1].astype(jnp.int32)
      noisy = jax.random.bernoulli(jax.random.fold_in(jax.random.PRNGKey(1), i), 0.5, (4,))
      cite = jnp.select([pattern == 0, pattern == 1],
                        [jnp.zeros(4, bool), jnp.full(4, i % 2 == 0)], noisy)
      pad = lambda x, v: jnp.concatenate([x, jnp.full((4,), v, x.dtype)])
      batch = Stream(queries=q[None], candidates=c[None], mask=jnp.ones((1, 8), bool),
                     gold=jnp.zeros((1, 8), bool), num_gold=jnp.zeros((1,), jnp.int32))
      state, _ = learner_lib.train_batch_on_feedback(
          state, jax.random.fold_in(jax.random.PRNGKey(2), i)[None], batch,
          pad(slate, -1)[None, None], pad(jnp.ones(4, bool), False)[None, None],
          pad(jnp.where(cite, 1.0, -1.0), -1.0)[None, None], jnp.ones((1,), bool), cfg, hp)
      return state, None

    return jax.lax.scan(body, learner_lib.init_learner(jax.random.PRNGKey(0), cfg),
                        jnp.arange(10_000))[0]

  states = jax.jit(jax.vmap(run))(jnp.arange(3))
  assert np.all(np.asarray(states.step) == 10_000)
  for leaf in jax.tree_util.tree_leaves((states.params, states.opt_state)):
    assert np.all(np.isfinite(np.asarray(leaf)))


# ------------------------------------------------------------------------------------------------
# the retrieval rule


@pytest.mark.slow
def test_without_multistore_observations_are_never_candidates():
  rng = np.random.default_rng(1)
  m = Memory(None, config=_config())
  q = _queries(20, 4)
  m.add([f"d{i}" for i in range(12)], embeddings=rng.normal(size=(12, _D)))
  m.add([f"o{i}" for i in range(20)], store="observation", embeddings=q)  # each query's best match
  obs = {i for i, c in zip(m.ids, m._bank.store_codes) if c == 1}
  for i in range(20):
    r = m.retrieve(f"q{i}", k=3, explore=bool(i % 2), query_embedding=q[i])
    for _ in range(1 if i % 2 else 0):
      m.feedback(r, [r.ids[0]])
      r = m.retrieve(continue_from=r, k=3, explore=True)
    assert not obs & set(r.ids) and r.stores == ("dialogue",) * 3
    m.feedback(r, [])
  rows = np.concatenate([s.cand_idx[s.cand_mask] for s in m._sessions.by_id.values()])
  assert rows.size == 20 * 8 and np.all(m._bank.store_codes[rows] == 0)
  only_obs = Memory(None, config=_config())
  only_obs.add(["o"], store="observation", embeddings=q[:1])
  rejects(only_obs, lambda: only_obs.retrieve("q", k=1, query_embedding=q[0]),
          "observations are candidates only with multistore")


# ------------------------------------------------------------------------------------------------
# malformed input


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "8"])
def test_max_sessions_must_be_a_positive_int(value):
  with pytest.raises((TypeError, ValueError), match="max_sessions"):
    Memory(None, config=_config(), max_sessions=value)


@pytest.mark.parametrize("texts", [{"a": 1}, {"a", "b"}, b"bytes", 42, ["ok", 7], ("ok", None)])
def test_add_rejects_a_dict_a_set_bytes_or_non_string_items(texts):
  m = _memory()
  rejects(m, lambda: m.add(texts, embeddings=np.ones((2, _D))), r"texts", error=TypeError)


def test_texts_ids_and_queries_with_lone_surrogates_are_rejected_naming_the_index():
  m = _memory()
  rejects(m, lambda: m.add(["fine", "a\ud800b"], embeddings=np.ones((2, _D))),
          r"texts: text 1 'a\\ud800b' is not valid Unicode")
  rejects(m, lambda: m.add(["x", "y"], ids=["ok", "\udfff"], embeddings=np.ones((2, _D))),
          r"ids: text 1 .* lone surrogate")
  rejects(m, lambda: m.retrieve_batch(["fine", "x\udc80"], k=3), r"queries: text 1 ")


@pytest.mark.parametrize("bad, problem", [
    ("\x00deleted:3", "starts with NUL, the prefix reserved for the ids of deleted memories"),
    ("a\x00b", "control character U\\+0000 at position 1"),
    ("two\nlines", "control character U\\+000A at position 3"),
    ("del\x7f", "control character U\\+007F at position 3"),
    ("c1\x85", "control character U\\+0085 at position 2")])
def test_ids_with_the_tombstone_prefix_or_a_control_character_are_refused(bad, problem):
  m = _memory()
  rejects(m, lambda: m.add(["x", "y"], ids=["fine", bad], embeddings=np.ones((2, _D))),
          f"ids\\[1\\]=.* {problem}: memory ids may not contain control characters")
  rejects(m, lambda: m.update(bad, text="x", embedding=np.ones(_D)),
          f"memory_id=.* {problem}")
  assert m.add(["x"], ids=["tab-free, unicode ok: \u00e9\u4e2d"], embeddings=np.ones((1, _D)))


@pytest.mark.slow  # (a save and a load)
def test_a_forged_tombstone_id_cannot_make_an_unloadable_checkpoint(tmp_path):
  m = _memory(n=6)
  with pytest.raises(ValueError, match="reserved for the ids of deleted memories"):
    m.add(["x"], ids=["\x00deleted:3"], embeddings=np.ones((1, _D)))
  m.delete("id3")
  m.save(tmp_path / "c")
  assert Memory.load(tmp_path / "c").ids == m.ids


def test_a_bank_with_one_id_twice_is_never_saved(tmp_path):
  # (defence in depth: no public call makes such a bank; a checkpoint of it could not be loaded)
  m = _memory(n=6)
  m._bank.append(["id4"], ["twice"], np.zeros(1, np.int8), np.ones((1, _D), np.float32))
  with pytest.raises(checkpoints.CheckpointError, match=r"refusing to save .*duplicate memory "
                     r"ids \['id4'\].*nothing was written"):
    m.save(tmp_path / "d")
  assert checkpoints.CheckpointStore(tmp_path / "d").steps() == []
  assert checkpoints.CheckpointStore(tmp_path / "d" / "bank_shards").steps() == []


def test_feedback_rejects_malformed_arguments():
  m = _memory()
  r = m.retrieve("q", k=3, query_embedding=_queries(1)[0])
  rejects(m, lambda: m.feedback(r, {r.ids[0]: True}), "cited_ids must be a collection",
          error=TypeError)
  rejects(m, lambda: m.feedback(r, 5), "cited_ids must be a collection", error=TypeError)
  rejects(m, lambda: m.feedback(r, [None]), r"cited ids \[None\] were not in the slate")
  rejects(m, lambda: m.feedback("0", []), "expected a Retrieval", error=TypeError)
  rejects(m, lambda: m.retrieve("q", k=True, query_embedding=_queries(1)[0]), "k must be an int",
          error=TypeError)
  rejects(m, lambda: m.retrieve(continue_from=r.retrieval_id, k=3), "takes Retrieval objects",
          error=TypeError)
  rejects(m, lambda: m.feedback_from_critic(r, lambda key, view: [1.0, 0.5, -1.0]),
          r"must return \[3\] labels in \{-1, \+1\}")
  m.feedback(r, [])


def test_memory_with_a_missing_encoder_path_fails_at_once_naming_it():
  with pytest.raises(encoders.EncoderNotFoundError, match="/nonexistent"):
    Memory("/nonexistent")


# ------------------------------------------------------------------------------------------------
# checkpoints


def test_save_to_an_empty_path_or_a_file_raises_and_writes_nothing(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  m = _memory()
  with pytest.raises(ValueError, match="checkpoint path is empty"):
    m.save("")
  with pytest.raises(ValueError, match="checkpoint path is empty"):
    m.save("  ")
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(ValueError, match="exists and is not a directory"):
    m.save("a_file")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_load_refuses_a_foreign_checkpoint_with_the_differing_fields(tmp_path):
  with checkpoints.CheckpointStore(tmp_path / "run") as store:
    store.save(1, {"x": np.zeros(3)}, {"format": "ear_jax.run_checkpoint/3"})
  with pytest.raises(ValueError, match=r"format: stored='ear_jax.run_checkpoint/3' vs "
                                       r"expected='ear_jax.agent.memory/2'"):
    Memory.load(tmp_path / "run")
  with checkpoints.CheckpointStore(tmp_path / "bare") as store:
    store.save(1, {"x": np.zeros(3)}, {})
  with pytest.raises(ValueError, match=r"format: stored=<missing>"):
    Memory.load(tmp_path / "bare")


def test_load_of_a_truncated_checkpoint_is_a_checkpoint_error_naming_the_file(tmp_path):
  m = _memory()
  step = m.save(tmp_path / "c")
  meta = step / "meta" / "metadata"
  meta.write_text(meta.read_text()[:100])
  with pytest.raises(checkpoints.CheckpointError, match=str(meta)):
    Memory.load(tmp_path / "c")


# ------------------------------------------------------------------------------------------------
# embeddings of any magnitude; non-real embeddings refused (issue 20, item 3)


@pytest.mark.parametrize("scale", [1e20, 1e30, 1e-25, 1e300, 1e-300])
def test_huge_or_tiny_embeddings_are_normalised_never_zeroed(scale):
  """A float32 norm of 1e20 x overflows to inf (and x / inf = 0); one of 1e-25 x underflows to 0."""
  m = _memory()
  v = np.random.default_rng(3).normal(size=(2, _D))
  ids = m.add(["huge or tiny a", "huge or tiny b"], embeddings=v * scale)
  stored = m.embeddings()[-2:]
  np.testing.assert_allclose(np.linalg.norm(stored, axis=1), 1.0, atol=1e-6)
  np.testing.assert_allclose(stored, _unit(v), atol=1e-6)
  plain = m.retrieve(query_embedding=v[0], k=3)
  scaled = m.retrieve(query_embedding=v[0] * scale, k=3)
  assert scaled.ids == plain.ids and scaled.ids[0] == ids[0]
  np.testing.assert_allclose(scaled.scores, plain.scores, atol=1e-5)
  assert scaled.scores[0] > 0.99  # the query is (a multiple of) the stored row: cosine 1, not 0


def test_ordinary_embeddings_are_normalised_bit_for_bit_as_before():
  """The overflow-safe path is taken only by rows whose float32 norm overflows or underflows."""
  m = _memory()
  v = np.random.default_rng(4).normal(size=(5, _D)) * np.array([[1e-3], [1e-1], [1.0], [10], [1e6]])
  m.add([f"t{i}" for i in range(5)], embeddings=v)
  x = v.astype(np.float32)
  np.testing.assert_array_equal(m.embeddings()[-5:],
                                (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32))


_NOT_REAL = [
    (np.ones((1, _D)) * (1 + 1j), "complex"),
    (np.ones((1, _D), bool), "bool"),
    (np.full((1, _D), "0.5"), "strings"),
    (np.full((1, _D), 0.5, dtype=object), "Python objects"),
]


@pytest.mark.parametrize("emb, problem", _NOT_REAL, ids=["complex", "bool", "str", "object"])
def test_non_real_embeddings_are_refused_naming_the_problem(emb, problem):
  m = _memory()
  rejects(m, lambda: m.add(["x"], embeddings=emb), rf"memory embeddings has dtype .*{problem}")
  rejects(m, lambda: m.retrieve(query_embedding=emb[0], k=3),
          rf"query_embedding has dtype .*{problem}")
  rejects(m, lambda: m.retrieve_batch(query_embeddings=emb, k=3),
          rf"query embeddings has dtype .*{problem}")


def test_ragged_or_none_embeddings_are_refused_naming_the_argument():
  m = _memory()
  rejects(m, lambda: m.add(["x", "y"], embeddings=[[0.5] * _D, [0.5] * 3]), "memory embeddings")
  rejects(m, lambda: m.add(["x"], embeddings=[[None] * _D]), "memory embeddings has dtype object")
  rejects(m, lambda: m.retrieve(query_embedding="0.5", k=3), "query_embedding must be an array")


def test_embeddings_beyond_float64_are_refused_as_non_finite():
  m = _memory()
  rejects(m, lambda: m.add(["x"], embeddings=np.full((1, _D), np.inf)), "non-finite")
  rejects(m, lambda: m.retrieve(query_embedding=np.full(_D, -np.inf), k=3), "non-finite")


# ------------------------------------------------------------------------------------------------
# default ids beside explicit ones; messages that say what is wrong (issue 20, item 6)


def test_default_ids_skip_explicit_ids_of_the_same_form():
  m = Memory(None, config=_config(), seed=0)
  v = np.random.default_rng(5).normal(size=(48, _D))
  assert m.add(["explicit"], ids=["m36"], embeddings=v[:1]) == ["m36"]
  got = [m.add([f"t{i}"], embeddings=v[1 + i:2 + i])[0] for i in range(40)]  # rows 1..40
  assert "m36" not in got and len(set(got)) == 40
  assert got[:35] == [f"m{i}" for i in range(1, 36)]  # "m<row>" while it is free
  assert got[35:] == ["m37", "m38", "m39", "m40", "m41"]
  assert m.add(["a", "b"], ids=["m43", "m44"], embeddings=v[41:43]) == ["m43", "m44"]
  assert m.add(["c", "d", "e"], embeddings=v[43:46]) == ["m45", "m46", "m47"]  # j from row 43
  assert len(set(m.ids)) == len(m) == 46


def test_a_count_mismatch_is_reported_as_a_count_not_a_dimension():
  m = _memory()
  with pytest.raises(ValueError) as info:
    m.add(["a", "b"], embeddings=np.ones((3, _D)))
  assert "3 row(s) for 2 text(s)" in str(info.value)
  assert "dimension" not in str(info.value)
  rejects(m, lambda: m.add(["a"], embeddings=np.ones((2, _D + 1))),
          r"1 text\(s\).*; wrong dimension")  # both problems named
  rejects(m, lambda: m.add(["a"], embeddings=np.ones(_D)), r"has shape \(16,\), expected a 2-D")
  rejects(m, lambda: m.retrieve(query_embedding=np.ones((1, _D)), k=3),
          r"query_embedding has shape \(1, 16\), expected one \[16\] vector")


# ------------------------------------------------------------------------------------------------
# a float64 run keeps its float dtype (issue 20, item 8)


@pytest.mark.slow  # an x64 compile of one training step: ~5 s
def test_a_float64_step_equals_the_float64_numpy_reference():
  """Under `jax_enable_x64`, with float64 parameters, inputs and hyperparameters, one Adam step
  equals the float64 NumPy reference to rounding (it differed by 2e-10 when the injected learning
  rate was rounded to float32)."""
  from ear_jax.core.stream import Stream  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import reference as ref  # pylint: disable=g-import-not-at-top
  d, k, b = 8, 6, 2
  config = EARConfig.for_method("ear", dim=d, num_candidates=k, slate_size=3, num_rounds=3,
                                replay_size=2, buffer_capacity=5, batch_size=b)
  rng = np.random.default_rng(0)
  q, c = rng.normal(size=(b, d)), rng.normal(size=(b, k, d))
  q /= np.linalg.norm(q, axis=-1, keepdims=True)
  c /= np.linalg.norm(c, axis=-1, keepdims=True)
  mask, gold = np.ones((b, k), bool), rng.random((b, k)) < 0.35
  gold[:, 0] = True
  lr = 0.0123456789  # not a float32 number
  with jax.enable_x64(True):
    keys = jax.random.split(jax.random.PRNGKey(0), b)
    randoms = [ref.draw_randoms(key, config) for key in keys]  # float64 draws, as the x64 step's
    state = learner_lib.init_learner(jax.random.PRNGKey(9), config)
    params64 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), state.params)
    state = state.replace(params=params64,
                          opt_state=learner_lib.make_optimizer(config).init(params64))
    state = state.replace(buffer=jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float64) if x.dtype == jnp.float32 else x, state.buffer))
    assert state.opt_state.hyperparams["learning_rate"].dtype == jnp.float64
    hparams = default_hparams(dtype=jnp.float64, learning_rate=lr)
    batch = Stream(queries=jnp.asarray(q), candidates=jnp.asarray(c), mask=jnp.asarray(mask),
                   gold=jnp.asarray(gold), num_gold=jnp.asarray(gold.sum(-1), jnp.int32))
    step = jax.jit(learner_lib.train_batch, static_argnames=("config",))
    new, _ = step(state, keys, batch, jnp.ones((b,), bool), config, hparams)
    assert new.params.w_q.dtype == jnp.float64
    assert new.opt_state.hyperparams["learning_rate"].dtype == jnp.float64
    hp = ref.hp_dict(hparams)
    assert hp["learning_rate"] == lr
    want, _ = ref.numpy_train_batch(ref.init_numpy_state(config),
                                    dict(queries=q, candidates=c, mask=mask, gold=gold), randoms,
                                    config, hp)
  np.testing.assert_allclose(np.asarray(new.params.w_q), want["wq"], rtol=0, atol=1e-15)
  np.testing.assert_allclose(np.asarray(new.params.w_m), want["wm"], rtol=0, atol=1e-15)


def test_a_float32_state_keeps_a_float32_learning_rate():
  """The float32 path is unchanged: the injected rate is float32 (bit-identical results)."""
  config = _config()
  state = learner_lib.init_learner(jax.random.PRNGKey(0), config)
  assert state.opt_state.hyperparams["learning_rate"].dtype == jnp.float32
  grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
  for hp in (default_hparams(learning_rate=0.05), default_hparams(learning_rate=np.float64(0.05))):
    new = learner_lib.apply_gradients(state, grads, config, hp)
    assert new.opt_state.hyperparams["learning_rate"].dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(new.params))
