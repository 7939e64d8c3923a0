"""Append-only bank shards: a save writes only the rows added since the latest checkpoint."""
import os
import pathlib
import shutil
import textwrap

import jax
import numpy as np
import pytest

from ear_jax import EARConfig
from tests.kill_helpers import sigkill_at
from ear_jax.agent.memory import persistence
from ear_jax.agent.memory import Memory
from ear_jax.io import checkpoints

D = 8
CFG = EARConfig(dim=D, num_candidates=4, slate_size=2, num_rounds=1, batch_size=1,
                buffer_capacity=8, replay_size=2)


def _emb(n, seed):
  return np.random.default_rng(seed).normal(size=(n, D)).astype(np.float32)


def _shards(path):
  store = checkpoints.CheckpointStore(pathlib.Path(path) / persistence.SHARDS, max_to_keep=None)
  return {s: store.read_meta(s) for s in store.steps()}


def _listed(path):
  return checkpoints.CheckpointStore(path).read_meta()["bank"]["shards"]


def test_a_save_writes_only_the_new_rows_and_loads_back_the_whole_bank(tmp_path):
  path = tmp_path / "m"
  m = Memory(None, config=CFG)
  m.add([f"a{i}" for i in range(50)], embeddings=_emb(50, 0))
  m.save(path)
  m.add([f"b{i}" for i in range(7)], embeddings=_emb(7, 1), store="observation")
  m.save(path)
  m.save(path)  # nothing added: no new shard
  shards = _shards(path)
  assert [(meta["start"], len(meta["ids"])) for meta in shards.values()] == [(0, 50), (50, 7)]
  assert [(r["start"], r["count"]) for r in _listed(path)] == [(0, 50), (50, 7)]
  back = Memory.load(path)
  assert back.ids == m.ids and len(back) == 57
  np.testing.assert_array_equal(back.embeddings(), m.embeddings())
  assert back._bank.describe([55])[2] == ("observation",)
  # The loaded memory knows its rows are saved: adding 3 and saving writes a 3-row shard.
  back.add(["c0", "c1", "c2"], embeddings=_emb(3, 2))
  back.save(path)
  assert [(r["start"], r["count"]) for r in _listed(path)] == [(0, 50), (50, 7), (57, 3)]
  assert Memory.load(path).ids == back.ids


def test_another_memory_saving_into_the_directory_rewrites_its_own_bank(tmp_path):
  path = tmp_path / "m"
  a = Memory(None, config=CFG)
  a.add([f"a{i}" for i in range(10)], embeddings=_emb(10, 0))
  a.save(path)
  b = Memory(None, config=CFG)  # the same ids, other embeddings: the shard is not reused
  b.add([f"a{i}" for i in range(10)], embeddings=_emb(10, 5))
  b.save(path)
  assert [r["count"] for r in _listed(path)] == [10] and _listed(path)[0]["step"] == 2
  np.testing.assert_allclose(Memory.load(path).embeddings(), b.embeddings())
  assert sorted(_shards(path)) == [1, 2]  # shard 1 is still listed by the kept step 1


def test_shards_no_kept_step_lists_are_deleted(tmp_path):
  path = tmp_path / "m"
  m = Memory(None, config=CFG)
  for i in range(5):  # 5 saves, each with new rows; max_to_keep=3 main steps
    m.add([f"x{i}"], embeddings=_emb(1, i))
    m.save(path)
  # Compacted: 1 | 1+1 -> shard 2 | 2, 1 (3) | 2+1+1 -> shard 4 | 4, 1 (5). Shard 1 is listed by
  # no kept main step (3, 4, 5), shards 2 and 3 by step 3.
  assert [(r["start"], r["count"], r["step"]) for r in _listed(path)] == [(0, 4, 4), (4, 1, 5)]
  assert sorted(_shards(path)) == [2, 3, 4, 5]
  c = Memory(None, config=CFG)  # another bank replaces it: old shards go once unlisted
  c.add(["y"] * 1, embeddings=_emb(1, 9))
  for _ in range(3):
    c.save(path)
  assert sorted(_shards(path)) == [6]


def test_a_missing_or_foreign_shard_is_a_checkpoint_error_naming_it(tmp_path):
  path = tmp_path / "m"
  m = Memory(None, config=CFG)
  m.add([f"a{i}" for i in range(6)], embeddings=_emb(6, 0))
  m.save(path)
  m.add(["b"], embeddings=_emb(1, 1))
  m.save(path)
  shard = pathlib.Path(path) / persistence.SHARDS / "2"
  os.rename(shard, shard.with_name("2x"))
  with pytest.raises(checkpoints.CheckpointError, match=r"checkpoint step 2 not found"):
    Memory.load(path)
  os.rename(shard.with_name("2x"), shard)
  meta = shard / "meta" / "metadata"
  text = meta.read_text()
  meta.write_text(text.replace('"b"', '"z"'))  # edited: the store's digest no longer matches
  with pytest.raises(checkpoints.CheckpointError, match=f"meta file {meta} .*does not match"):
    Memory.load(path)
  meta.write_text(text)
  other = Memory(None, config=CFG)  # a complete shard of another memory in its place
  other.add([f"a{i}" for i in range(6)], embeddings=_emb(6, 0))
  other.save(tmp_path / "o")
  other.add(["z"], embeddings=_emb(1, 1))
  other.save(tmp_path / "o")
  shutil.rmtree(shard)
  shutil.copytree(tmp_path / "o" / persistence.SHARDS / "2", shard)
  with pytest.raises(checkpoints.CheckpointError, match=r"bank shard 2 of checkpoint .* does not "
                                                        r"hold the rows"):
    Memory.load(path)


_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from ear_jax import EARConfig
    from ear_jax.agent.memory import Memory
    from ear_jax.io import checkpoints
    path, stage = sys.argv[1], sys.argv[2]
    cfg = EARConfig(dim=8, num_candidates=4, slate_size=2, num_rounds=1, batch_size=1,
                    buffer_capacity=8, replay_size=2)
    rng = np.random.default_rng(0)
    m = Memory(None, config=cfg)
    m.add([f"t{i}" for i in range(10)], embeddings=rng.normal(size=(10, 8)))
    m.save(path)
    m.add([f"u{i}" for i in range(5)], embeddings=rng.normal(size=(5, 8)))
    real = checkpoints.CheckpointStore._write
    def stalled(self, step, *args):
      if (self.directory.name == "bank_shards") == (stage == "shard"):
        (self.directory / f"{step}.orbax-checkpoint-tmp-0").mkdir()
        print("IN_SAVE", flush=True)
        time.sleep(120)
      return real(self, step, *args)
    checkpoints.CheckpointStore._write = stalled
    m.save(path)
    print("SAVE_FINISHED", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["shard", "main"])
def test_sigkill_during_an_incremental_save_leaves_the_previous_checkpoint_loadable(tmp_path,
                                                                                   stage):
  path = str(tmp_path / "ckpt")
  sigkill_at(_CHILD, [path, stage])
  m = Memory.load(path)  # the previous checkpoint: 10 memories in one shard
  assert len(m) == 10 and [r["count"] for r in _listed(path)] == [10]
  assert sorted(_shards(path)) == ([1] if stage == "shard" else [1, 2])  # 2: written, unlisted
  m.add(["v0", "v1"], embeddings=_emb(2, 3))
  m.save(path)  # works after the kill; reuses shard 1, deletes the unlisted one and the debris
  assert [(r["start"], r["count"]) for r in _listed(path)] == [(0, 10), (10, 2)]
  assert sorted(_shards(path)) == [1, _listed(path)[1]["step"]]
  assert not [p for p in pathlib.Path(path).rglob("*orbax-checkpoint-tmp*")]
  assert Memory.load(path).ids == m.ids


def _trained(seed=0, n=40, feedbacks=30, bank_dtype="float32"):
  """A memory whose 8-slot replay buffer has wrapped around, with open sessions left."""
  m = Memory(None, config=CFG, bank_dtype=bank_dtype)
  m.add([f"a{i}" for i in range(n)], embeddings=_emb(n, seed))
  q = _emb(feedbacks + 3, seed + 1)
  for i in range(feedbacks):
    r = m.retrieve(query_embedding=q[i], k=2, explore=i % 2 == 0)
    m.feedback(r, [r.ids[0]] if i % 3 else [])
  for i in range(feedbacks, feedbacks + 3):  # sessions left open, one with a pending retrieval
    m.retrieve(query_embedding=q[i], k=2)
  return m


def _state_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a._driver.state), jax.tree_util.tree_leaves(b._driver.state)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("bank_dtype", ["float32", "bfloat16"])
def test_buffer_and_sessions_are_saved_as_bank_rows_and_restored_bit_for_bit(tmp_path, bank_dtype):
  m = _trained(bank_dtype=bank_dtype)
  assert int(m._driver.state.buffer.num_pushed) > CFG.buffer_capacity  # the ring wrapped
  # The host mirror of the buffer's rows gathers back exactly the buffer's candidates.
  buf = m._driver.state.buffer
  np.testing.assert_array_equal(
      np.asarray(m._bank.gather(m._driver.buffer_rows, m._driver.buffer_rows >= 0, "t")),
      np.asarray(buf.candidates))
  m.save(tmp_path / "m")
  arrays, _ = checkpoints.CheckpointStore(tmp_path / "m").restore()
  sizes = [np.shape(x) for x in jax.tree_util.tree_leaves(arrays)]
  assert (CFG.buffer_capacity, CFG.num_candidates, D) not in sizes  # no [C, K, d] array
  assert "cand_emb" not in arrays["sessions"]
  back = Memory.load(tmp_path / "m")
  _state_equal(m, back)
  for sid, s in m._sessions.by_id.items():
    np.testing.assert_array_equal(back._sessions.by_id[sid].cand_emb, s.cand_emb)
  # Both go on learning identically (the restored mirror is the original's).
  np.testing.assert_array_equal(back._driver.buffer_rows, m._driver.buffer_rows)
  for mem in (m, back):
    for i in range(12):
      r = mem.retrieve(query_embedding=_emb(12, 7)[i], k=2)
      mem.feedback(r, [r.ids[1]])
  _state_equal(m, back)


def test_checkpoints_with_the_buffer_and_sessions_inline_still_load_and_save_inline(tmp_path):
  m = _trained()
  arrays, meta = persistence.main_step(m._parts())  # rewritten as before rows were kept (and named)
  arrays["driver"]["learner"] = {f"{i:04d}": np.asarray(x) for i, x in  # by flatten position
                                 enumerate(jax.tree_util.tree_leaves(m._driver.state))}
  del meta["driver"]["learner_layout"]
  del arrays["driver"]["buffer_rows"]
  arrays["sessions"]["cand_emb"] = np.stack([s.cand_emb for s in m._sessions.by_id.values()])
  m.save(tmp_path / "m")  # the bank shards and a main step, then the old-style main step on top
  with checkpoints.CheckpointStore(tmp_path / "m") as store:
    meta["bank"] = store.read_meta()["bank"]
  persistence.write(tmp_path / "m", arrays, meta)
  back = Memory.load(tmp_path / "m")
  _state_equal(m, back)
  assert back._driver.buffer_rows is None  # rows unknown: later saves keep the inline form
  back.save(tmp_path / "n")
  _state_equal(back, Memory.load(tmp_path / "n"))


def test_buffer_rows_outside_the_bank_are_an_error_naming_the_checkpoint(tmp_path):
  m = _trained()
  m.save(tmp_path / "m")
  arrays, meta = persistence.main_step(m._parts())
  arrays["driver"]["buffer_rows"][0, 0] = 10_000
  with checkpoints.CheckpointStore(tmp_path / "m") as store:
    meta["bank"] = store.read_meta()["bank"]
  persistence.write(tmp_path / "m", arrays, meta)
  with pytest.raises(ValueError, match=r"replay buffer of checkpoint .*outside the bank"):
    Memory.load(tmp_path / "m")
