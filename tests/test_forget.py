"""`Memory.delete` (issue 19 item 4, `ear_jax/agent/memory/forget.py`): a deleted memory never comes back,
in results, sessions, queued items, the replay buffer, a loaded memory or the checkpoint's bytes."""
import json
import os
import pathlib
import shutil
import textwrap
import time

import jax
import numpy as np
import pytest

from ear_jax import EARConfig
from ear_jax.agent.memory import forget
from ear_jax.agent.memory import Memory
from ear_jax.io.checkpoints import CheckpointStore
from tests.kill_helpers import STALLED_SAVE_CHILD

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


def _files_holding(root: pathlib.Path, needle: bytes) -> list[str]:
  """The files under `root` holding `needle`: raw, or in the arrays and meta of a checkpoint step
  restored (the arrays are stored compressed, so their raw bytes would never match)."""
  found = [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]
  for d in [root] + [p for p in root.rglob("*") if p.is_dir()]:
    store = CheckpointStore(d)
    for step in store.steps():
      arrays, meta = store.restore(step)
      blobs = [np.ascontiguousarray(a).tobytes() for a in jax.tree_util.tree_leaves(arrays)]
      blobs.append(json.dumps(meta, ensure_ascii=False).encode())
      found += [f"{d / str(step)} (restored)" for b in blobs if needle in b]
  return found


def _train(m, emb, rounds=6):
  """Sessions with feedback until the learner took steps (fills the replay buffer)."""
  for j in range(rounds):
    r = m.retrieve(query_embedding=emb[j % len(emb)], k=3, explore=True)
    m.feedback(r, r.ids[:1])
    r2 = m.retrieve(continue_from=r, k=3, explore=True)
    m.feedback(r2, r2.ids[:1])


def test_deleted_memory_is_never_a_candidate_again():
  m, emb = _memory()
  target = m.ids[3]
  m.delete(target)
  assert target not in m.ids and len(m) == 11
  for q in np.random.default_rng(1).normal(size=(20, D)):
    for explore in (False, True):
      r = m.retrieve(query_embedding=q, k=6 if not explore else 3, explore=explore)
      assert target not in r.ids
      m.discard(r)
  r = m.retrieve(query_embedding=emb[3], k=5)  # its own vector: still not retrieved
  assert target not in r.ids
  with pytest.raises(ValueError, match="unknown memory id"):
    m.get([target])
  assert m.get([m.ids[0]])[0]["text"].startswith("memory text number 0")


def test_searching_a_memory_whose_memories_were_all_deleted_says_so():
  m, emb = _memory()
  for i in m.ids:  # (one at a time: the shapes the tests above compiled)
    m.delete(i)
  with pytest.raises(ValueError, match=r"^k=1 is larger than the memory bank: the memory holds "
                     r"no memories \(all were deleted\)$"):
    m.search(query_embedding=emb[0], k=1)


def test_unknown_ids_are_refused_and_nothing_changes():
  m, _ = _memory()
  before = (m.ids, m.embeddings().copy(), len(m))
  with pytest.raises(ValueError, match=r"unknown memory id\(s\) 'nope'.*nothing was changed"):
    m.delete([m.ids[0], "nope"])
  with pytest.raises(ValueError, match="duplicate"):
    m.delete([m.ids[0], m.ids[0]])
  with pytest.raises(TypeError, match="must be a string"):
    m.delete([3])
  with pytest.raises(ValueError, match="empty"):
    m.delete([])
  assert (m.ids, len(m)) == (before[0], before[2])
  np.testing.assert_array_equal(m.embeddings(), before[1])
  m.delete(m.ids[0])
  with pytest.raises(ValueError, match="unknown"):
    m.delete(before[0][0])  # twice
  with pytest.raises(ValueError, match="unknown"):
    m.delete(forget.TOMBSTONE + "0")  # a tombstone cannot be named


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
def test_delete_drops_open_sessions_and_masks_the_buffer_and_queue():
  m, emb = _memory()
  _train(m, emb, rounds=5)
  assert int(m.state.buffer.valid.sum()) > 0
  r = m.retrieve(query_embedding=emb[0], k=3, explore=True)  # an open session
  victim = r.ids[0]
  row = m.ids.index(victim)
  m.delete(victim)
  with pytest.raises(ValueError, match="session was dropped because .*deleted"):  # (item 3)
    m.feedback(r, [])
  drv = m._driver  # pylint: disable=protected-access
  assert not (drv.buffer_rows == row).any()
  buf = m.state.buffer
  hit = np.all(np.asarray(buf.candidates[..., :D]) == emb[row] / np.linalg.norm(emb[row]), -1)
  assert not (hit & np.asarray(buf.mask)).any()
  for it in drv.ready:
    assert not (it.rows == row).any()
  _train(m, emb, rounds=3)  # still learns
  assert victim not in m.ids


@pytest.mark.slow  # (~3 s: checkpoints, faiss, BM25)
def test_checkpoint_bytes_and_reload_after_delete(tmp_path):
  m, emb = _memory(n=40)
  _train(m, emb, rounds=4)
  path = tmp_path / "ckpt"
  m.save(path)
  m.add(["a later memory"], embeddings=np.ones((1, D)))
  m.save(path)
  victim = m.ids[5]
  secret_text = m.get([victim])[0]["text"].encode()
  secret_vec = m.embeddings()[5].astype(np.float32).tobytes()
  assert _files_holding(path, secret_vec) and _files_holding(path, secret_text)
  m.delete(victim)
  m.save(path)
  assert _files_holding(path, secret_vec) == [] and _files_holding(path, secret_text) == []
  back = Memory.load(path)
  assert back.ids == m.ids and len(back) == 40 and victim not in back.ids
  r = back.retrieve(query_embedding=emb[5], k=5)
  assert victim not in r.ids
  back.add(["new"], embeddings=np.ones((1, D)) * 2)  # the bank continues after the tombstone
  back.save(path)
  assert Memory.load(path).ids == back.ids


@pytest.mark.slow  # (~3 s: checkpoints, faiss, BM25)
def test_delete_with_lexical_and_ann_first_stages(tmp_path):
  m, emb = _memory(n=30, candidates="bm25")
  victim = m.ids[4]
  m.delete(victim)
  for q in ("memory text number 4", "topic1 text", "number"):
    r = m.retrieve(q, query_embedding=emb[4], k=5)
    assert victim not in r.ids
  m3 = Memory(None, config=_config(), candidates="hybrid", multistore=True)
  m3.add([f"note {i} about topic{i % 3}" for i in range(20)], embeddings=emb[:20],
         store=["dialogue", "observation"] * 10)
  m3.delete(["m1", "m2"])  # an observation and a dialogue memory
  for q in ("note 1 about topic1", "note 2 about topic2", "topic1"):
    for j in (1, 2):
      assert not {"m1", "m2"} & set(m3.retrieve(q, query_embedding=emb[j], k=6).ids)
  m2, emb2 = _memory(n=64, index="faiss_hnsw")
  victim = m2.ids[7]
  m2.save(tmp_path / "ann")
  vec = m2.embeddings()[7].astype(np.float32).tobytes()
  m2.delete(victim)
  near = emb2[7] + 0.01  # (not the vector itself: sessions save their query's embedding)
  assert victim not in m2.retrieve(query_embedding=near, k=5).ids
  m2.save(tmp_path / "ann")
  assert _files_holding(tmp_path / "ann", vec) == []
  assert victim not in Memory.load(tmp_path / "ann").retrieve(query_embedding=emb2[7], k=5).ids


_KILLED_CHILD = STALLED_SAVE_CHILD + textwrap.dedent("""
    m = Memory(None, config=cfg)
    m.add([f"forgettable text {i}" for i in range(6)], embeddings=rng.normal(size=(6, 8)))
    m.save(path)
    m.delete("m2")
    stall_save(stage)
    m.save(path)
""")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["shard", "main", "purge"])
def test_sigkill_during_the_save_after_a_delete(tmp_path, stage):
  from tests.kill_helpers import sigkill_at  # pylint: disable=g-import-not-at-top
  path = tmp_path / "ckpt"
  sigkill_at(_KILLED_CHILD, [path, stage])
  m = Memory.load(path)
  if stage == "purge":  # the new checkpoint is complete: the memory is gone
    assert len(m) == 5 and "m2" not in m.ids
  else:  # the previous one
    assert len(m) == 6 and "m2" in m.ids
  m.delete("m2") if "m2" in m.ids else None
  m.save(path)  # the next save purges whatever the killed one left
  # (a long needle: two bytes such as b"t2" also turn up inside Orbax's binary manifests)
  assert _files_holding(path, b"forgettable text 2") == []
  assert _files_holding(path, b"forgettable text 3") != []  # (the search does find texts)
  assert Memory.load(path).ids == m.ids
  store = CheckpointStore(path)  # no step from before the deletion is kept
  assert [store.read_meta(s)["stats"][forget.DELETED_STAT] for s in store.steps()] == [1] * len(
      store.steps())


def _trash(root: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(root)) for p in root.rglob(".trash-*"))


@pytest.mark.slow  # (~3 s: checkpoints, faiss)
@pytest.mark.parametrize("index, store", [("exact", "bank_shards"), ("faiss_hnsw", "ann_index")])
def test_trash_a_killed_delete_left_is_removed_by_a_load_and_by_a_save_without_adds(
    tmp_path, index, store):
  m, _ = _memory(n=20, index=index)
  path = tmp_path / "ckpt"
  m.save(path)
  secret = m.get(["m2"])[0]["text"].encode()
  old = tmp_path / "old-step"
  shutil.copytree(path / store / "1", old)
  m.delete("m2")
  m.save(path)
  assert not (path / store / "1").exists() and _files_holding(path, secret) == []

  def crash():  # the state a SIGKILL between `_remove`'s rename and its rmtree leaves
    shutil.copytree(old, path / store / f".trash-1-{os.getpid()}-{time.time_ns()}")
    assert _trash(path)
    if store == "bank_shards":
      assert _files_holding(path, secret)

  crash()
  back = Memory.load(path)  # a load alone (then recalls: nothing written) ...
  assert _trash(path) == [] and _files_holding(path, secret) == []
  assert "m2" not in back.ids and len(back) == 19
  crash()
  m.save(path)  # ... or a save that adds nothing removes it
  assert _trash(path) == [] and _files_holding(path, secret) == []
  assert Memory.load(path).ids == m.ids


_TRASH_CHILD = STALLED_SAVE_CHILD + textwrap.dedent("""
    import shutil
    from ear_jax.io import checkpoints as ckpt_lib
    m = Memory(None, config=cfg, index=stage)
    m.add([f"forgettable text {i}" for i in range(6)], embeddings=rng.normal(size=(6, 8)))
    m.save(path)
    m.delete("m2")
    store = "bank_shards" if stage == "exact" else "ann_index"
    real_rmtree = shutil.rmtree
    def rmtree(p, *args, **kw):  # killed while it deletes the old shard / index it renamed away
      if f"{store}/.trash-" in str(p):
        print("IN_SAVE", flush=True)
        time.sleep(120)
      return real_rmtree(p, *args, **kw)
    ckpt_lib.shutil.rmtree = rmtree
    m.save(path)
""")


@pytest.mark.slow
@pytest.mark.parametrize("index", ["exact", "faiss_hnsw"])
def test_sigkill_while_a_delete_removes_the_old_shard_leaves_nothing_after_a_load(tmp_path, index):
  from tests.kill_helpers import sigkill_at  # pylint: disable=g-import-not-at-top
  path = tmp_path / "ckpt"
  sigkill_at(_TRASH_CHILD, [path, index])
  store = "bank_shards" if index == "exact" else "ann_index"
  assert [t.split("/")[0] for t in _trash(path)] == [store]  # what the kill left
  m = Memory.load(path)  # the new checkpoint (complete before the old shard went)
  assert len(m) == 5 and "m2" not in m.ids
  m.search(query_embedding=np.ones(D), k=2)  # recall and search write nothing
  assert _trash(path) == [] and _files_holding(path, b"forgettable text 2") == []
  assert _files_holding(path, b"forgettable text 3") != []
