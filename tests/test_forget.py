"""`Memory.delete`: a deleted memory never comes back, in results, sessions, queued items, the
replay buffer, a reopened memory, or the bytes of any file of the memory directory (`rows.sqlite`
and its journal, the learner's Orbax steps, the faiss index)."""
import contextlib
import json
import pathlib
import shutil
import sqlite3
import tempfile
import textwrap

import jax
import numpy as np
import pytest

from ear_jax import EARConfig
from ear_jax.agent.memory import Memory, SessionDroppedError
from ear_jax.io.checkpoints import CheckpointStore

D = 8


def _config(**kw):
  base = dict(dim=D, num_candidates=6, slate_size=3, num_rounds=2, batch_size=2,
              buffer_capacity=16, replay_size=2)
  return EARConfig(**{**base, **kw})


def _memory(n=12, seed=0, **kw):
  rng = np.random.default_rng(seed)
  emb = rng.normal(size=(n, D)).astype(np.float32)
  m = Memory(None, config=_config(), **kw)
  m.add([f"memory text number {i} about topic{i % 3}" for i in range(n)], embeddings=emb)
  return m, emb


def _ids(m, scope=None) -> list[str]:
  return [r["id"] for r in m.list(scope)]


def _steps_under(root: pathlib.Path):
  """Every Orbax step directory under `root` (steps, temporaries of killed saves, `.trash-*`)."""
  return [p for p in root.rglob("*") if p.is_dir() and (p / "meta" / "metadata").is_file()]


def _files_holding(root: pathlib.Path, needle: bytes) -> list[str]:
  """The files under `root` holding `needle`: raw, or in the arrays and meta of an Orbax step
  restored (its arrays are stored compressed, so their raw bytes would never match)."""
  found = [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]
  for step in _steps_under(root):
    with tempfile.TemporaryDirectory() as probe:  # (a copy: trash and temporaries too)
      shutil.copytree(step, pathlib.Path(probe) / "0")
      try:
        arrays, meta = CheckpointStore(probe).restore(0)
      except Exception:  # pylint: disable=broad-except  (a half-written temporary)
        continue
    blobs = [np.ascontiguousarray(a).tobytes() for a in jax.tree_util.tree_leaves(arrays)]
    blobs.append(json.dumps(meta, ensure_ascii=False).encode())
    found += [f"{step} (restored)" for b in blobs if needle in b]
  return found


def stored_embeddings(root: pathlib.Path, ids) -> np.ndarray:
  """`[len(ids), d]` float32: the embeddings `rows.sqlite` holds for `ids` (as stored)."""
  with sqlite3.connect(f"file:{pathlib.Path(root) / 'rows.sqlite'}?mode=ro", uri=True) as db:
    got = dict(db.execute("SELECT id, embedding FROM memories"))
  return np.stack([np.frombuffer(got[i], np.float32) for i in ids])


def _train(m, emb, rounds=6):
  """Sessions with feedback until the learner took steps (fills the replay buffer)."""
  for j in range(rounds):
    s = m.session(query_embedding=emb[j % len(emb)])
    r = s.round(3, explore=True)
    s.feedback(r.ids[:1])
    r2 = s.round(3, explore=True)
    s.feedback(r2.ids[:1])


def test_deleted_memory_is_never_a_candidate_again():
  m, emb = _memory()
  target = _ids(m)[3]
  assert m.delete(target) == [target]
  assert target not in _ids(m) and len(m) == 11 and m.stats["memories"] == 11
  for q in np.random.default_rng(1).normal(size=(10, D)):
    assert target not in m.search(query_embedding=q, k=6).ids
    s = m.session(query_embedding=q)
    assert target not in s.round(3, explore=True).ids
    s.close()
  assert target not in m.search(query_embedding=emb[3], k=5).ids  # its own vector
  with pytest.raises(ValueError, match="unknown memory id"):
    m.get([target])
  assert m.get([_ids(m)[0]])[0]["text"].startswith("memory text number 0")


def test_searching_a_memory_whose_memories_were_all_deleted_says_so():
  m, emb = _memory()
  for i in _ids(m):  # (one at a time: the shapes the tests above compiled)
    m.delete(i)
  with pytest.raises(ValueError, match=r"^no memory to retrieve \(k=1\): the memory holds "
                     r"no memories \(all were deleted\)$"):
    m.search(query_embedding=emb[0], k=1)


def test_unknown_ids_are_refused_and_nothing_changes():
  m, emb = _memory()
  ids = _ids(m)

  def seen():
    r = m.search(query_embedding=emb[0], k=6)
    return m.list(), len(m), r.ids, r.scores

  before = seen()
  with pytest.raises(ValueError, match=r"unknown memory id\(s\) 'nope'.*nothing was changed"):
    m.delete([ids[0], "nope"])
  with pytest.raises(ValueError, match="duplicate"):
    m.delete([ids[0], ids[0]])
  with pytest.raises(TypeError, match="must be a string"):
    m.delete([3])
  with pytest.raises(ValueError, match="empty"):
    m.delete([])
  with pytest.raises(ValueError):
    m.delete("\x00deleted:0")  # (the old layout's tombstone ids name nothing)
  assert seen() == before
  m.delete(ids[0])
  with pytest.raises(ValueError, match="unknown"):
    m.delete(ids[0])  # twice


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
def test_delete_drops_open_sessions_and_masks_the_buffer_and_queue():
  m, emb = _memory()
  _train(m, emb, rounds=4)  # (4 sessions: 2 learner steps, none queued)
  assert int(m.learner.buffer.valid.sum()) > 0 and m.stats["ready"] == 0
  victim = "m3"
  queued = m.session(query_embedding=emb[3])  # a closed session waiting for a batch
  assert victim in queued.round(3, explore=False).ids
  queued.feedback([victim])
  queued.close()
  assert m.stats["ready"] == 1
  s = m.session(query_embedding=emb[3])  # an open session
  assert victim in s.round(3, explore=True).ids
  m.delete(victim)
  with pytest.raises(SessionDroppedError, match=f"dropped because memory '{victim}'.* deleted"):
    s.feedback([])
  unit = emb[3] / np.linalg.norm(emb[3])

  def in_buffer():
    buf = m.learner.buffer
    hit = np.isclose(np.asarray(buf.candidates[..., :D]), unit, atol=1e-6).all(-1)
    return bool((hit & np.asarray(buf.mask)).any())

  assert not in_buffer()
  _train(m, emb, rounds=3)  # still learns, and the queued item was trained without it
  assert m.stats["ready"] == 0 and not in_buffer() and victim not in _ids(m)


_MARKER = "qzxwvmarker unforgettable secret"


@pytest.mark.slow  # (~3 s: saves, faiss, BM25)
@pytest.mark.parametrize("stage", [dict(), dict(candidates="hybrid"), dict(index="faiss_hnsw")],
                         ids=["exact", "hybrid", "faiss_hnsw"])
def test_forgetting_leaves_no_bytes_in_any_file_of_the_memory_directory(tmp_path, stage):
  m, emb = _memory(n=30, **stage)
  rng = np.random.default_rng(5)
  marker_emb = rng.normal(size=D)
  [victim] = m.add([_MARKER], embeddings=marker_emb[None])
  for _ in range(4):  # rounds citing the marker: the learner's buffer holds its embedding
    s = m.session("which note?", query_embedding=marker_emb + 0.05 * rng.normal(size=D))
    for _ in range(2):
      r = s.round(3, explore=True)
      assert victim in r.ids
      s.feedback([victim])
  path = tmp_path / "mem"
  assert m.save(path) == path  # binds the in-memory memory to `path`
  vec = stored_embeddings(path, [victim])[0].tobytes()
  text, token = _MARKER.encode(), b"qzxwvmarker"
  assert any("rows.sqlite" in f for f in _files_holding(path, text))
  holding = _files_holding(path, vec)
  assert any("rows.sqlite" in f for f in holding)
  assert not any("learner" in f for f in holding)  # (the learner item saves rows, not vectors)
  if "index" in stage:
    assert any("ann" in f for f in holding)
  m.delete(victim)  # durable when it returns: no save
  for needle in (text, vec, token):
    assert _files_holding(path, needle) == [], needle
  m.add(["a later memory"], embeddings=np.ones((1, D)))
  m.save()
  assert _files_holding(path, vec) == [] and _files_holding(path, text) == []
  assert sorted(p.name for p in path.iterdir() if p.name.startswith("rows.sqlite")) == [
      "rows.sqlite"]  # (no journal left)
  ids = _ids(m)
  m.close()
  with Memory.open(path) as back:
    assert _ids(back) == ids and victim not in ids and len(back) == 31
    assert victim not in back.search("which note?", 5, query_embedding=marker_emb).ids
  assert _files_holding(path, vec) == []


def test_the_learner_item_keeps_the_question_of_an_open_session_only_and_none_once_dropped(
    tmp_path):
  """The learner item kept closed sessions' questions, and an open one's in clear after a
  `delete` of a memory it showed dropped the session (until the next save)."""
  path = tmp_path / "mem"
  m, emb = _memory(n=12)
  m.save(path)
  done = m.session("closed question qzx1", query_embedding=emb[0])
  done.feedback(done.round(2, explore=False).ids[:1])  # (an adapter-only round: closes it)
  kept = m.session("open question qzx2", query_embedding=emb[1])
  shown = kept.round(2, explore=True)
  other = m.session("open question qzx3", query_embedding=-emb[1])
  others = other.round(6, explore=False).ids  # (all its K candidates)
  m.save()
  assert _files_holding(path, b"closed question qzx1") == []
  assert _files_holding(path, b"open question qzx2") and _files_holding(path, b"qzx3")
  victim = next(i for i in shown.ids if i not in others)
  m.delete(victim)  # drops `kept`, not `other`
  with pytest.raises(SessionDroppedError):
    kept.round(2)
  assert _files_holding(path, b"open question qzx2") == [] and _files_holding(path, b"qzx3")
  m.close()
  with Memory.open(path) as back:
    assert back.session(resume=other.id).question == "open question qzx3"


def test_an_open_that_drops_a_saved_session_rewrites_the_learner_item_before_serving(tmp_path):
  """A process killed between a delete's commit and the learner item's new save: the item holds
  the question of a session the delete dropped; the next open drops it and saves."""
  path = tmp_path / "mem"
  m, emb = _memory(n=12)
  m.save(path)
  s = m.session("a question qzx4", query_embedding=emb[2])
  victim = s.round(2, explore=True).ids[0]
  m.save()
  m.close()
  with contextlib.closing(sqlite3.connect(path / "rows.sqlite")) as db, db:
    db.execute("DELETE FROM memories WHERE id = ?", (victim,))  # (as the killed delete did)
  assert _files_holding(path, b"a question qzx4")
  with Memory.open(path) as back:
    assert back.stats["sessions_dropped_by_delete"] == 1
    assert _files_holding(path, b"a question qzx4") == []


@pytest.mark.slow  # (~2 s: BM25, hybrid, faiss)
def test_delete_with_lexical_and_ann_first_stages():
  m, emb = _memory(n=30, candidates="bm25")
  victim = _ids(m)[4]
  m.delete(victim)
  for q in ("memory text number 4", "topic1 text", "number"):
    assert victim not in m.search(q, 5, query_embedding=emb[4]).ids
  m3 = Memory(None, config=_config(), candidates="hybrid", multistore=True)
  m3.add([f"note {i} about topic{i % 3}" for i in range(20)], embeddings=emb[:20],
         store=["dialogue", "observation"] * 10)
  m3.delete(["m1", "m2"])  # an observation and a dialogue memory
  for q in ("note 1 about topic1", "note 2 about topic2", "topic1"):
    for j in (1, 2):
      assert not {"m1", "m2"} & set(m3.search(q, 6, query_embedding=emb[j]).ids)
      s = m3.session(q, query_embedding=emb[j])
      assert not {"m1", "m2"} & set(s.round(3, explore=True).ids)
      s.close()
  m2, emb2 = _memory(n=64, index="faiss_hnsw")
  victim = _ids(m2)[7]
  m2.delete(victim)
  assert victim not in m2.search(query_embedding=emb2[7], k=5).ids
  m2.update("m8", embedding=emb2[7])
  assert m2.search(query_embedding=emb2[7], k=1).ids == ("m8",)


# A child that trains on six memories (faiss HNSW: `ann/` holds their vectors), saves, and then
# deletes one and saves, SIGKILLed where `stage` says: 'write' (writing the learner item),
# 'trash' (removing the `ann/` that held the deleted vector, after renaming it away) or 'commit'
# (the delete committed, its `ann/` not yet renamed away: the file is stale).
_KILLED_CHILD = textwrap.dedent("""
    import shutil, sqlite3, sys, time
    import numpy as np
    from ear_jax import EARConfig
    from ear_jax.agent.memory import Memory
    from ear_jax.io import checkpoints
    path, stage, vec_file = sys.argv[1:4]
    cfg = EARConfig(dim=8, num_candidates=4, slate_size=2, num_rounds=1, batch_size=1,
                    buffer_capacity=8, replay_size=2)
    rng = np.random.default_rng(0)
    m = Memory(None, config=cfg, index="faiss_hnsw")
    emb = rng.normal(size=(6, 8))
    m.add([f"forgettable text {i}" for i in range(6)], embeddings=emb)
    for i in range(6):  # (one-round sessions, batch size 1: each trains, into the buffer)
      s = m.session(query_embedding=emb[i] + 0.1)
      s.feedback(s.round(2, explore=False).ids[:1])
    m.save(path)
    with sqlite3.connect(path + "/rows.sqlite") as db:
      blob = db.execute("SELECT embedding FROM memories WHERE id = 'm2'").fetchone()[0]
    open(vec_file, "wb").write(blob)

    def stall():
      print("IN_SAVE", flush=True)
      time.sleep(120)
    real_rmtree = shutil.rmtree
    def rmtree(p, *args, **kw):
      if "-trash-" in str(p):
        stall()
      return real_rmtree(p, *args, **kw)
    if stage == "write":
      checkpoints.CheckpointStore._write = lambda self, *args: stall()
    elif stage == "trash":
      shutil.rmtree = rmtree
    else:
      from ear_jax.agent.memory import persistence
      persistence.remove_ann = lambda root, only_trash=False: stall()
    m.delete("m2")
    m.add(["a later memory"], embeddings=np.ones((1, 8)))
    m.save()
""")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["write", "trash", "commit"])
def test_sigkill_after_a_delete_leaves_no_bytes_once_reopened(tmp_path, stage):
  from tests.kill_helpers import sigkill_at  # pylint: disable=g-import-not-at-top
  path, vec_file = tmp_path / "mem", tmp_path / "vec"
  sigkill_at(_KILLED_CHILD, [path, stage, vec_file])
  vec = vec_file.read_bytes()
  assert len(vec) == 4 * D
  if stage == "trash":  # what the kill left: the old index, holding the deleted vector
    assert [p.name for p in path.glob(".*trash*")] and _files_holding(path, vec)
  if stage == "commit":  # the stale index file itself
    assert _files_holding(path, vec) == [str(path / "ann" / "index.npz")]
  with Memory.open(path) as m:  # the delete returned before the kill: it holds
    assert "m2" not in _ids(m) and {"m0", "m1", "m3", "m4", "m5"} <= set(_ids(m))
    assert not list(path.glob(".*trash*"))  # the open removed what the kill left
    # (a long needle: two bytes such as b"t2" also turn up inside Orbax's binary manifests)
    assert _files_holding(path, b"forgettable text 2") == [] and _files_holding(path, vec) == []
    assert _files_holding(path, b"forgettable text 3") != []  # (the search does find texts)
    assert "m2" not in m.search(query_embedding=np.frombuffer(vec, np.float32), k=3).ids
