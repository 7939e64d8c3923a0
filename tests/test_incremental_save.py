"""Append-only bank shards: a save writes only the rows added since the latest checkpoint."""
import os
import pathlib
import textwrap

import numpy as np
import pytest

from ear_jax import EARConfig
from tests.kill_helpers import sigkill_at
from ear_jax.agent import persistence
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
  assert sorted(_shards(path)) == [1, 2, 3, 4, 5]  # all listed by the newest step (append-only)
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
  meta.write_text(meta.read_text().replace('"b"', '"z"'))
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
