"""`Memory` under hostile use: unknown, closed and dropped sessions, threads, saves during
mutation, adversarial critics, malformed input, foreign or truncated memory directories
(issues 10, 20 and 29)."""
from __future__ import annotations

import contextlib
import gc
import os
import re
import shutil
import sqlite3
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.core import learner as learner_lib
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.core.stream import Stream
from ear_jax.data import encoders
from ear_jax.io import checkpoints
from tests.test_forget import stored_embeddings
from tests.memory_helpers import config as _config, equal as _equal, unit as _unit

_D = 16


def _memory(seed=0, n=24, max_sessions=4096, path=None, **cfg):
  """A memory of `n` memories `id<i>` (in memory, or opened at `path`)."""
  config = MemoryConfig(encoder=None, config=_config(**cfg), seed=seed, max_sessions=max_sessions)
  m = Memory(config) if path is None else Memory.open(path, config)
  rng = np.random.default_rng(100)
  m.add([f"memory text {i}" for i in range(n)], ids=[f"id{i}" for i in range(n)],
        embeddings=rng.normal(size=(n, _D)))
  return m


def _queries(n, seed=7):
  return _unit(np.random.default_rng(seed).normal(size=(n, _D)))


def _leaves(m: Memory) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(m.learner)]


def fingerprint(m: Memory) -> dict:
  """What the public API shows of a memory's state (to assert 'unchanged'): its records, what a
  query finds, the stats (but the count of searches, the fingerprint's own) and the learner's
  leaves."""
  hit = m.search(query_embedding=_queries(1, 99)[0], k=3) if len(m) >= 3 else None
  return {"records": m.list(), "len": len(m),
          "search": None if hit is None else (hit.ids, hit.scores),
          "stats": {k: v for k, v in m.stats.items() if k != "searches"}, "learner": _leaves(m)}


def rejects(m, fn, match, error=ValueError, counted=()):
  """`fn()` raises `error` matching `match`, and the memory is unchanged (but the stats named in
  `counted`, which count the attempt)."""
  before, after = fingerprint(m), None
  with pytest.raises(error, match=match):
    fn()
  after = fingerprint(m)
  for fp in (before, after):
    fp["stats"] = {k: v for k, v in fp["stats"].items() if k not in counted}
  for key in before:
    assert _equal(before[key], after[key]), key


def _finite(m: Memory) -> bool:
  return all(np.all(np.isfinite(x)) for x in _leaves(m) if np.issubdtype(x.dtype, np.floating))


# ------------------------------------------------------------------------------------------------
# sessions: unknown, closed, from before a reopen


def test_resuming_an_unknown_or_closed_session_raises_naming_it_and_changes_nothing():
  m = _memory()
  s = m.session(query_embedding=_queries(1)[0])
  r = s.round(3, explore=True)
  rejects(m, lambda: m.session(resume=s.id + 1000), f"{s.id + 1000}")
  rejects(m, lambda: m.session(resume="0"), "resume", error=TypeError)
  rejects(m, lambda: m.session(resume=True), "resume", error=TypeError)
  again = m.session(resume=s.id)  # the same open session, from its id (the MCP server's cite)
  assert again.id == s.id and again.question == s.question
  again.feedback([r.ids[0]])
  assert s.rounds == again.rounds == 1
  s.close()
  assert s.closed and not s.close() and s.closed  # idempotent
  rejects(m, lambda: m.session(resume=s.id), f"{s.id}")
  rejects(m, lambda: s.feedback([]), "closed")
  rejects(m, lambda: s.round(3), "closed")


def test_a_session_survives_save_and_reopen_and_the_old_handle_is_refused(tmp_path):
  m = _memory(path=tmp_path / "mem")
  s = m.session("q", query_embedding=_queries(1)[0])
  r = s.round(3, explore=True)
  s.feedback([r.ids[1]])
  r2 = s.round(3, explore=True)  # open, no feedback yet
  m.save()
  m.close()
  with pytest.raises(ValueError, match="closed"):
    s.feedback([])  # its memory is closed
  with Memory.open(tmp_path / "mem") as back:
    s2 = back.session(resume=s.id)
    assert s2.rounds == 1 and s2.question == "q"
    s2.feedback([r2.ids[0]])  # the round that was open when saved
    assert s2.closed and back.stats["ready"] == 1  # T=2 rounds of feedback: queued


def test_open_refuses_another_config_naming_the_field_and_changes_nothing(tmp_path):
  other = _memory(path=tmp_path / "c", batch_size=4)
  records = other.list()
  other.close()
  with pytest.raises(ValueError, match="batch_size"):
    Memory.open(tmp_path / "c", MemoryConfig(encoder=None, config=_config()))
  with Memory.open(tmp_path / "c") as back:  # the stored config
    assert back.list() == records and back.config.ear.batch_size == 4


# ------------------------------------------------------------------------------------------------
# threads


@pytest.mark.slow
def test_two_threads_opening_sessions_and_giving_feedback_take_exactly_the_expected_steps():
  """300 one-round sessions per thread: one thread adapter-only (300 sessions), the other T=2
  Explorer rounds per session (150 sessions); batch size 2 -> exactly 225 steps."""
  m = _memory(batch_size=2, num_rounds=2)
  errors = []

  def adapter_only():
    q = _queries(300, 1)
    for i in range(300):
      s = m.session(f"a{i}", query_embedding=q[i])
      r = s.round(3, explore=False)
      s.feedback([r.ids[0]] if i % 2 else [])
      s.close()

  def explorer():
    q = _queries(150, 2)
    for i in range(150):
      s = m.session(f"e{i}", query_embedding=q[i])
      s.round(3, explore=True)
      s.feedback([])
      r = s.round(3, explore=True)
      s.feedback([r.ids[1]])
      assert s.closed

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
  st = m.learner
  assert int(st.step) == 450 // 2 == m.stats["learner_steps"]
  assert int(st.queries_seen) == 450 == int(st.buffer.num_pushed)
  assert m.stats["feedback"] == 600 and m.stats["pending"] == 0 and m.stats["ready"] == 0
  assert _finite(m)


def test_the_critic_is_called_outside_the_lock():
  m = _memory()
  done = []

  def critic(key, view):  # another thread must be able to use the memory meanwhile
    if not done:
      t = threading.Thread(target=lambda: done.append(m.add(["during the critic call"],
                                                            embeddings=_queries(1, 3))))
      t.start()
      t.join(timeout=60)
    return np.full(len(view.texts), -1.0)

  m.recall("q", critic, k=3, query_embedding=_queries(1)[0])
  assert done == [["m24"]] and m.stats["critic_calls"] == 2 and len(m) == 25


@pytest.mark.slow
def test_save_while_another_thread_mutates_gives_self_consistent_learner_steps(tmp_path):
  path = tmp_path / "mem"
  m = _memory(batch_size=2, num_rounds=2, max_sessions=10**6, path=path)
  stop = threading.Event()
  errors = []

  def mutate():
    rng = np.random.default_rng(0)
    i = 0
    try:
      while not stop.is_set():
        m.add([f"new {i}"], embeddings=rng.normal(size=(1, _D)))
        s = m.session(f"q{i}", query_embedding=rng.normal(size=_D))
        r = s.round(3, explore=bool(i % 2))
        s.feedback([r.ids[i % 3]])
        s.close()
        i += 1
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  t = threading.Thread(target=mutate)
  t.start()
  snapshots = []
  try:
    for i in range(10):
      m.save()  # the mutator writes rows only; the learner step stands until the next save
      snapshots.append(tmp_path / f"learner{i}")
      shutil.copytree(path / "learner", snapshots[-1])
  finally:
    stop.set()
    t.join()
  assert not errors, errors
  rows = m.list()
  m.close()
  seen = set()
  for snap in snapshots:  # every step, beside the final rows, opens as a consistent memory
    shutil.rmtree(path / "learner")
    shutil.copytree(snap, path / "learner")
    with Memory.open(path) as x:
      assert x.list() == rows  # rows added after the step's save are kept (acknowledged)
      st = x.learner
      assert int(st.queries_seen) == 2 * int(st.step) == int(st.buffer.num_pushed)
      assert int(st.queries_seen) + x.stats["ready"] == x.stats["queries_queued"]
      seen.add(x.stats["queries_queued"])
      s = x.session("after open", query_embedding=_queries(1)[0])
      s.feedback(s.round(3, explore=False).ids[:1])
  assert len(seen) > 1  # the saves really interleaved with the mutations


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
    for i, q in enumerate(_unit(rng.normal(size=(667, 8)))):
      s = m.session(query_embedding=q)
      r = s.round(4, explore=bool(c))
      s.feedback([] if c == 0 else (list(r.ids) if i % 2 else []) if c == 1 else
                 [x for x in r.ids if rng.random() < 0.5])
      s.close()
  assert int(m.learner.step) == 2001 and _finite(m)
  assert all(np.isfinite(m.search(query_embedding=np.ones(8), k=4).scores))


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
  obs = set(m.add([f"o{i}" for i in range(20)], store="observation", embeddings=q))  # best matches
  for i in range(20):
    s = m.session(f"q{i}", query_embedding=q[i])
    shown = [s.round(8 if i % 2 else 3, explore=bool(i % 2))]  # k = K: every candidate
    if i % 2:
      s.feedback([shown[0].ids[0]])
      shown.append(s.round(3, explore=True))
    s.close()
    shown.append(m.search(query_embedding=q[i], k=8))
    for r in shown:
      assert not obs & set(r.ids) and set(r.stores) == {"dialogue"}
  only_obs = Memory(None, config=_config())
  only_obs.add(["o"], store="observation", embeddings=q[:1])
  rejects(only_obs, lambda: only_obs.session("q", query_embedding=q[0]).round(1),
          "observations are candidates only with multistore")
  rejects(only_obs, lambda: only_obs.search(query_embedding=q[0], k=1),
          "observations are candidates only with multistore")


# ------------------------------------------------------------------------------------------------
# malformed input


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "8"])
def test_max_sessions_must_be_a_positive_int(value):
  with pytest.raises((TypeError, ValueError), match="max_sessions"):
    Memory(None, config=_config(), max_sessions=value)


def test_an_unknown_setting_is_refused_naming_it():
  with pytest.raises(TypeError, match="max_sesions"):
    Memory(None, config=_config(), max_sesions=3)


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
  rejects(m, lambda: m.search(["fine", "x\udc80"], k=3), r"text 1 ")
  rejects(m, lambda: m.session("x\udc80"), r"not valid Unicode")


@pytest.mark.parametrize("bad, problem", [
    ("\x00deleted:3", "control character U\\+0000 at position 0"),
    ("a\x00b", "control character U\\+0000 at position 1"),
    ("two\nlines", "control character U\\+000A at position 3"),
    ("del\x7f", "control character U\\+007F at position 3"),
    ("c1\x85", "control character U\\+0085 at position 2")])
def test_ids_with_a_control_character_are_refused(bad, problem):
  m = _memory()
  rejects(m, lambda: m.add(["x", "y"], ids=["fine", bad], embeddings=np.ones((2, _D))),
          f"ids\\[1\\]=.* {problem}")
  rejects(m, lambda: m.update(bad, text="x", embedding=np.ones(_D)), f"memory_id=.* {problem}")
  rejects(m, lambda: m.delete([bad]), r"unknown memory id\(s\)")  # (no memory holds one)
  assert m.add(["x"], ids=["tab-free, unicode ok: \u00e9\u4e2d"], embeddings=np.ones((1, _D)))


def test_an_id_already_stored_is_refused_and_nothing_is_added():
  m = _memory(n=6)
  rejects(m, lambda: m.add(["a", "b"], ids=["new", "id4"], embeddings=np.ones((2, _D))), "id4")
  rejects(m, lambda: m.add(["a", "b"], ids=["x", "x"], embeddings=np.ones((2, _D))), "x")


def test_feedback_rejects_malformed_arguments():
  m = _memory()
  s = m.session("q", query_embedding=_queries(1)[0])
  r = s.round(3, explore=True)
  rejects(m, lambda: s.feedback({r.ids[0]: True}), "cited_ids must be a collection",
          error=TypeError)
  rejects(m, lambda: s.feedback(5), "cited_ids must be a collection", error=TypeError)
  rejects(m, lambda: s.feedback([None]), r"cited ids \[None\] were not in the slate")
  rejects(m, lambda: s.feedback(["id23" if "id23" not in r.ids else "nope"]),
          "were not in the slate")
  rejects(m, lambda: s.round(True), "k must be an int", error=TypeError)
  rejects(m, lambda: m.search(query_embedding=_queries(1)[0], k=True), "k must be an int",
          error=TypeError)
  rejects(m, lambda: m.search(query_embedding=_queries(1)[0], k=0), "k must be >= 1")
  for learn in (True, False):  # (the failed recall leaves no session open)
    rejects(m, lambda: m.recall("q", lambda key, view: [1.0, 0.5, -1.0], k=3,
                                query_embedding=_queries(1)[0], learn=learn),
            r"\[3\] labels in \{-1, \+1\}", counted=("rounds", "sessions_opened"))
  s.feedback([])  # still open
  assert s.rounds == 1


def test_memory_with_a_missing_encoder_path_fails_at_once_naming_it():
  with pytest.raises(encoders.EncoderNotFoundError, match="/nonexistent"):
    Memory("/nonexistent")


# ------------------------------------------------------------------------------------------------
# memory directories


def test_save_to_an_empty_path_or_a_file_raises_and_writes_nothing(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  m = _memory()
  with pytest.raises(ValueError, match="pass the directory"):
    m.save()  # an in-memory memory: where to?
  for empty in ("", "  "):
    with pytest.raises(ValueError, match="path is empty"):
      m.save(empty)
    with pytest.raises(ValueError, match="path is empty"):
      Memory.open(empty)
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(ValueError, match="exists and is not a directory"):
    m.save("a_file")
  with pytest.raises(ValueError, match="exists and is not a directory"):
    Memory.open("a_file")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
  assert len(m) == 24  # still in memory, still usable
  m.save("mem")
  with pytest.raises(ValueError, match="mem"):  # bound: another directory is refused
    m.save("elsewhere")


def test_open_refuses_a_run_checkpoint_and_writes_nothing(tmp_path):
  with checkpoints.CheckpointStore(tmp_path / "run") as store:
    store.save(1, {"x": np.zeros(3)}, {"format": "ear_jax.run_checkpoint/3"})
  before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*"))
  with pytest.raises(ValueError, match="not a memory directory"):
    Memory.open(tmp_path / "run", MemoryConfig(encoder=None, config=_config()))
  assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == before


def test_a_truncated_learner_step_is_a_checkpoint_error_naming_the_file(tmp_path):
  m = _memory(path=tmp_path / "c")
  m.save()
  m.close()
  [meta] = (tmp_path / "c" / "learner").glob("*/meta/metadata")
  meta.write_text(meta.read_text()[:100])
  with pytest.raises(checkpoints.CheckpointError, match=str(meta)):
    Memory.open(tmp_path / "c")


def test_a_truncated_or_foreign_table_is_a_checkpoint_error_naming_the_file(tmp_path):
  m = _memory(path=tmp_path / "c")
  m.close()
  db = tmp_path / "c" / "rows.sqlite"
  data = db.read_bytes()
  db.write_bytes(data[:len(data) // 2 + 7])
  with pytest.raises(checkpoints.CheckpointError, match=str(db)):
    Memory.open(tmp_path / "c")
  db.write_bytes(b"not a database" * 100)
  with pytest.raises(checkpoints.CheckpointError, match=str(db)):
    Memory.open(tmp_path / "c")


def test_an_id_index_naming_another_row_or_a_changed_word_is_refused_at_open(tmp_path):
  """The id index named id-0020's row for id-0010: `get(['id-0010'])` returned id-0020 and
  `delete(['id-0010'])` deleted id-0020; a changed vocabulary term silently dropped its memory
  from a search for the word. Each is refused at open, naming the file."""
  path = tmp_path / "m"
  m = Memory.open(path, MemoryConfig(encoder=None, config=_config(), candidates="bm25"))
  texts = [f"memory text {i}" for i in range(30)]
  texts[5] = "the zyxmarkerterm memory"
  m.add(texts, ids=[f"id-{i:04d}" for i in range(30)],
        embeddings=np.random.default_rng(0).normal(size=(30, _D)))
  m.close()
  db = path / "rows.sqlite"
  clean = db.read_bytes()
  # the id index's record of id-0010 (header, id, row 11) made row 21; the word's records in the
  # vocabulary and in its term index (header 3 bytes: size, the term's type, an integer's type)
  words = [m.start() + 3 for m in re.finditer(rb"\x03'.zyxmarkerterm", clean, re.DOTALL)]
  assert len(words) == 2
  damaged = [clean.replace(b"\x03\x1b\x01id-0010\x0b", b"\x03\x1b\x01id-0010\x15")]
  damaged += [clean[:at] + b"Z" + clean[at + 1:] for at in words]
  for data in damaged:
    assert data != clean
    db.write_bytes(data)
    with pytest.raises(checkpoints.CheckpointError, match=f"{db}: fails SQLite's integrity check"):
      Memory.open(path)
  db.write_bytes(clean)
  with Memory.open(path) as back:
    assert back.get(["id-0010"])[0]["text"] == "memory text 10"
    assert back.search("zyxmarkerterm", k=1, query_embedding=np.ones(_D)).ids == ("id-0005",)


def _table_identity(path) -> str:
  with contextlib.closing(sqlite3.connect(path / "rows.sqlite")) as db:
    return db.execute("SELECT value FROM meta WHERE key = 'identity'").fetchone()[0]


def test_a_learner_item_of_another_directory_is_refused_naming_both_tables(tmp_path):
  """A's `learner/` copied into B (same settings) opened: B reported A's counters, and A's replay
  rows pointed at B's memories."""
  for name in ("a", "b"):
    m = _memory(path=tmp_path / name)
    m.save()
    m.close()
  shutil.rmtree(tmp_path / "b" / "learner")
  shutil.copytree(tmp_path / "a" / "learner", tmp_path / "b" / "learner")
  with pytest.raises(checkpoints.CheckpointError, match="belongs to the table with") as e:
    Memory.open(tmp_path / "b")
  a, b = _table_identity(tmp_path / "a"), _table_identity(tmp_path / "b")
  assert a != b and str(e.value).startswith(f"the learner item {tmp_path / 'b' / 'learner'}")
  assert (f"belongs to the table with identity {a}, not to {tmp_path / 'b' / 'rows.sqlite'} "
          f"(identity {b})") in str(e.value)
  with Memory.open(tmp_path / "a") as back:  # (its own directory still opens)
    assert len(back) == 24


def _rss_mb() -> float:
  with open("/proc/self/status", encoding="ascii") as f:
    return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow  # 220 opens: ~15 s
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS")
def test_200_open_close_cycles_keep_the_process_from_growing(tmp_path):
  """Each open read the learner item through Orbax's metadata reader three times, and tensorstore
  kept ~200 objects per read for good: RSS grew ~0.6-1.5 MB per cycle (471 -> 736 MB over 200).
  Bound: after 20 warm-up cycles, 200 more add under 1,000 Python objects and under 64 MB RSS."""
  m = _memory(path=tmp_path / "m")
  m.save()
  m.close()
  q = _queries(1)[0]

  def cycle():
    with Memory.open(tmp_path / "m") as back:
      back.search(query_embedding=q, k=3)

  for _ in range(20):
    cycle()
  gc.collect()
  objects, rss = len(gc.get_objects()), _rss_mb()
  for _ in range(200):
    cycle()
  gc.collect()
  assert len(gc.get_objects()) - objects < 1000
  assert _rss_mb() - rss < 64


# ------------------------------------------------------------------------------------------------
# embeddings of any magnitude; non-real embeddings refused


@pytest.mark.parametrize("scale", [1e20, 1e30, 1e-25, 1e300, 1e-300])
def test_huge_or_tiny_embeddings_are_normalised_never_zeroed(tmp_path, scale):
  """A float32 norm of 1e20 x overflows to inf (and x / inf = 0); one of 1e-25 x underflows to 0."""
  m = _memory(path=tmp_path / "m")
  v = np.random.default_rng(3).normal(size=(2, _D))
  ids = m.add(["huge or tiny a", "huge or tiny b"], embeddings=v * scale)
  stored = stored_embeddings(tmp_path / "m", ids)
  np.testing.assert_allclose(np.linalg.norm(stored, axis=1), 1.0, atol=1e-6)
  np.testing.assert_allclose(stored, _unit(v), atol=1e-6)
  plain = m.search(query_embedding=v[0], k=3)
  scaled = m.search(query_embedding=v[0] * scale, k=3)
  assert scaled.ids == plain.ids and scaled.ids[0] == ids[0]
  np.testing.assert_allclose(scaled.scores, plain.scores, atol=1e-5)
  assert scaled.scores[0] > 0.99  # the query is (a multiple of) the stored row: cosine 1, not 0
  s = m.session(query_embedding=v[0] * scale)
  assert s.round(3, explore=False).ids == plain.ids


def test_ordinary_embeddings_are_normalised_bit_for_bit_as_before(tmp_path):
  """The overflow-safe path is taken only by rows whose float32 norm overflows or underflows."""
  m = _memory(path=tmp_path / "m")
  v = np.random.default_rng(4).normal(size=(5, _D)) * np.array([[1e-3], [1e-1], [1.0], [10], [1e6]])
  ids = m.add([f"t{i}" for i in range(5)], embeddings=v)
  x = v.astype(np.float32)
  np.testing.assert_array_equal(stored_embeddings(tmp_path / "m", ids),
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
  rejects(m, lambda: m.search(query_embedding=emb[0], k=3),
          rf"query_embedding has dtype .*{problem}")
  rejects(m, lambda: m.session(query_embedding=emb[0]), rf"query_embedding has dtype .*{problem}")
  rejects(m, lambda: m.update("id0", embedding=emb[0]), rf"embedding has dtype .*{problem}")


def test_ragged_or_none_embeddings_are_refused_naming_the_argument():
  m = _memory()
  rejects(m, lambda: m.add(["x", "y"], embeddings=[[0.5] * _D, [0.5] * 3]), "memory embeddings")
  rejects(m, lambda: m.add(["x"], embeddings=[[None] * _D]), "memory embeddings has dtype object")
  rejects(m, lambda: m.search(query_embedding="0.5", k=3), "query_embedding must be an array")


def test_embeddings_beyond_float64_are_refused_as_non_finite():
  m = _memory()
  rejects(m, lambda: m.add(["x"], embeddings=np.full((1, _D), np.inf)), "non-finite")
  rejects(m, lambda: m.search(query_embedding=np.full(_D, -np.inf), k=3), "non-finite")
  rejects(m, lambda: m.session(query_embedding=np.full(_D, np.nan)), "non-finite")


# ------------------------------------------------------------------------------------------------
# default ids beside explicit ones; messages that say what is wrong


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
  ids = [r["id"] for r in m.list()]
  assert len(set(ids)) == len(m) == 46
  assert [r["row"] for r in m.get(["m36", "m45"])] == [0, 43]


def test_a_count_mismatch_is_reported_as_a_count_not_a_dimension():
  m = _memory()
  with pytest.raises(ValueError) as info:
    m.add(["a", "b"], embeddings=np.ones((3, _D)))
  assert "3 row(s) for 2 text(s)" in str(info.value)
  assert "dimension" not in str(info.value)
  rejects(m, lambda: m.add(["a"], embeddings=np.ones((2, _D + 1))),
          r"1 text\(s\).*; wrong dimension")  # both problems named
  rejects(m, lambda: m.add(["a"], embeddings=np.ones(_D)), r"has shape \(16,\), expected a 2-D")
  rejects(m, lambda: m.session(query_embedding=np.ones((1, _D))),
          r"query_embedding has shape \(1, 16\), expected one \[16\] vector")


# ------------------------------------------------------------------------------------------------
# a float64 run keeps its float dtype


@pytest.mark.slow  # an x64 compile of one training step: ~5 s
def test_a_float64_step_equals_the_float64_numpy_reference():
  """Under `jax_enable_x64`, with float64 parameters, inputs and hyperparameters, one Adam step
  equals the float64 NumPy reference to rounding (it differed by 2e-10 when the injected learning
  rate was rounded to float32)."""
  from tests import numpy_reference as ref  # pylint: disable=g-import-not-at-top
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
