"""Tests of ear_jax/io/checkpoints.py in one process: round trip, verification before cleanup,
corrupted files, the lock, compatibility messages. The multi-process ones are in
test_hostile_checkpoints.py."""
import fcntl
import gc
import json
import logging
import os
import pathlib
import shutil
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ear_jax
from ear_jax.io import run_checkpoints
from ear_jax.io import checkpoints
from ear_jax.io.checkpoints import CheckpointError, CheckpointStore, check_compatible


class Pair(NamedTuple):
  w: jax.Array
  n: np.ndarray


def _arrays(seed=0):
  rng = np.random.default_rng(seed)
  return {"pair": Pair(w=jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
                       n=rng.integers(-5, 5, (7,)).astype(np.int8)),
          "big": rng.standard_normal((64, 64)).astype(np.float32),
          "flags": rng.random(9) > 0.5, "half": jnp.asarray(rng.random(5), jnp.bfloat16),
          "scalar": np.float32(seed), "empty": np.zeros((0, 3), np.int32), "nested": [{}]}


def _by_name(tree):
  """{leaf name: (dtype, shape, bytes)}, names independent of the container (NamedTuple / dict)."""
  def name(path):
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
  return {name(p): (np.asarray(x).dtype, np.asarray(x).shape, np.asarray(x).tobytes())
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _bitwise_equal(a, b):
  return _by_name(a) == _by_name(b)


def _abstract(tree):
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


META = {"step": 1, "config": {"dim": 16, "lr": 0.1}, "texts": ["a", "ü"], "nan": float("nan")}


def test_round_trip_is_bitwise_and_meta_equal(tmp_path):
  arrays = _arrays()
  with CheckpointStore(tmp_path / "c") as store:
    path = store.save(1, arrays, META)
    assert path == (tmp_path / "c" / "1").absolute() and store.steps() == [1]
    got, meta = store.restore()
    assert json.dumps(meta, sort_keys=True) == json.dumps(META, sort_keys=True)
    assert store.read_meta(1) == meta
    assert _bitwise_equal(arrays, got)  # as saved: the NamedTuple comes back as a dict
    assert got["empty"].shape == (0, 3) and got["empty"].dtype == np.int32
    typed, _ = store.restore(1, target=_abstract(arrays))
    assert isinstance(typed["pair"], Pair)
    assert jax.tree_util.tree_structure(typed) == jax.tree_util.tree_structure(arrays)
    assert _bitwise_equal(arrays, typed)
  assert sorted(os.listdir(tmp_path / "c")) == ["1"]  # no lock file or temporary left


def test_restoring_host_arrays_as_saved_reads_what_orbax_reads_and_keeps_no_object(
    tmp_path, monkeypatch):
  """Orbax's own reading opens every array for its metadata, and tensorstore's `Spec.to_json`
  (0.1.86) never frees what it returns: ~200 objects kept per read of a memory's learner item."""
  rng = np.random.default_rng(0)
  arrays = {"pair": Pair(w=rng.standard_normal((16, 8)).astype(np.float32),
                         n=rng.integers(-5, 5, (7,)).astype(np.int8)),
            "flags": rng.random(9) > 0.5, "scalar": np.float32(3),
            "empty": np.zeros((0, 3), np.int32), "nested": [{}, {"x": np.arange(3)}],
            "seq": (np.ones(2), None, np.eye(2, dtype=np.int64))}
  store = CheckpointStore(tmp_path / "c")
  store.save(1, arrays, META)
  got, meta = store.restore()
  monkeypatch.setattr(checkpoints, "_zeros_target", lambda tree, record: None, raising=False)
  orbax_own, _ = store.restore()
  monkeypatch.undo()
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(orbax_own)
  assert [type(x) for x in jax.tree_util.tree_leaves(got)] == [
      type(x) for x in jax.tree_util.tree_leaves(orbax_own)]
  assert _bitwise_equal(got, orbax_own) and _bitwise_equal(got, arrays) and meta["step"] == 1
  for _ in range(3):
    store.restore(), store.read_meta()
  gc.collect()
  before = len(gc.get_objects())
  for _ in range(20):
    store.restore(), store.read_meta()
  gc.collect()
  assert len(gc.get_objects()) - before < 100


def test_restore_target_that_does_not_match_is_a_value_error_listing_leaves(tmp_path):
  store = CheckpointStore(tmp_path)
  store.save(0, _arrays(), {})
  target = _abstract(_arrays())
  target["big"] = jax.ShapeDtypeStruct((64, 65), jnp.float32)
  del target["flags"]
  with pytest.raises(ValueError, match=r"big: stored float32\[64, 64\] vs expected "
                                       r"float32\[64, 65\].*flags: stored but not in the target"):
    store.restore(target=target)


def test_a_save_needs_a_new_larger_step_and_valid_input(tmp_path):
  store = CheckpointStore(tmp_path, max_to_keep=None)
  store.save(5, _arrays(), {"v": 1})
  for step in (5, 4):
    with pytest.raises(ValueError, match="not a new step"):
      store.save(step, _arrays(1), {"v": 2})
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match="non-negative int"):
      store.save(bad, _arrays(), {})
  with pytest.raises(ValueError, match="JSON"):
    store.save(6, _arrays(), {"x": object()})
  with pytest.raises(ValueError, match="only numeric"):
    store.save(6, {"s": np.array(["text"])}, {})
  assert store.steps() == [5] and store.read_meta() == {"v": 1}
  assert sorted(os.listdir(tmp_path)) == ["5"]


def test_max_to_keep_deletes_older_steps_only_after_the_new_one_is_verified(tmp_path,
                                                                         monkeypatch):
  store = CheckpointStore(tmp_path, max_to_keep=2)
  seen = []
  real_verify = CheckpointStore._verify

  def spy(self, path, record, expected_meta):
    seen.append((int(path.name), self.steps()))
    return real_verify(self, path, record, expected_meta)

  monkeypatch.setattr(CheckpointStore, "_verify", spy)
  for step in (1, 2, 3, 4):
    store.save(step, _arrays(step), {"step": step})
  assert store.steps() == [3, 4]
  assert seen == [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [2, 3, 4])]  # nothing gone before

  def corrupt_then_verify(self, path, record, expected_meta):
    (path / "meta" / "metadata").write_text('{"step": ')  # the new step reads back truncated
    return real_verify(self, path, record, expected_meta)

  monkeypatch.setattr(CheckpointStore, "_verify", corrupt_then_verify)
  with pytest.raises(CheckpointError, match="metadata is truncated or corrupted"):
    store.save(5, _arrays(5), {"step": 5})
  assert store.steps() == [3, 4]  # the failed step is discarded, the older ones are all kept
  got, meta = store.restore()
  assert meta == {"step": 4} and _bitwise_equal(got, store.restore(4)[0])
  assert sorted(os.listdir(tmp_path)) == ["3", "4"]


def _saved(tmp_path):
  src = tmp_path / "src"
  arrays = _arrays()
  CheckpointStore(src).save(3, arrays, META)
  return src, arrays


def _damaged_copies(tmp_path, src, damage):
  """Yields (copy, relative file) with `damage(bytes) -> bytes` applied to one file of the arrays."""
  files = sorted(p.relative_to(src) for p in (src / "3" / "state").rglob("*")
                 if p.is_file() and p.name != "commit_success.txt" and p.stat().st_size)
  assert len(files) >= 3
  for rel in files:
    copy = tmp_path / "copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(src, copy)
    (copy / rel).write_bytes(damage((copy / rel).read_bytes()))
    yield copy, rel


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["bit flip", "truncation"])
def test_damaged_array_files_are_checkpoint_errors_naming_the_path_never_wrong_data(tmp_path,
                                                                                   damage):
  src, arrays = _saved(tmp_path)
  largest = max((p for p in (src / "3" / "state").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)

  def flip(b):
    b = bytearray(b)
    b[len(b) // 2] ^= 0x04
    return bytes(b)

  detected = []
  for copy, rel in _damaged_copies(tmp_path, src, flip if damage == "bit flip"
                                   else lambda b: b[:len(b) // 2]):
    before = sorted(p.relative_to(copy) for p in copy.rglob("*"))
    try:
      got, _ = CheckpointStore(copy).restore()
    except CheckpointError as e:
      assert str(copy / "3") in str(e)
      detected.append(rel)
    else:  # a file that the restore does not read: the arrays must still be exactly right
      assert _bitwise_equal(arrays, got), rel
    assert sorted(p.relative_to(copy) for p in copy.rglob("*")) == before  # nothing deleted
  assert largest.relative_to(src) in detected  # the array data itself


def test_truncated_meta_json_and_missing_steps_are_checkpoint_errors_naming_the_file(tmp_path):
  store = CheckpointStore(tmp_path / "c")
  with pytest.raises(CheckpointError, match="no checkpoint in"):
    store.restore()
  store.save(1, _arrays(), META)
  store.save(2, _arrays(), META)
  meta_file = tmp_path / "c" / "2" / "meta" / "metadata"
  meta_file.write_bytes(meta_file.read_bytes()[:20])
  for call in (store.read_meta, store.restore):
    with pytest.raises(CheckpointError, match=str(meta_file)):
      call()
  with pytest.raises(CheckpointError, match=r"step 7 not found.*steps on disk: \[1, 2\]"):
    store.read_meta(7)
  assert store.read_meta(1)["step"] == 1  # the earlier step is untouched and readable
  foreign = tmp_path / "c" / "9"
  foreign.mkdir()
  (foreign / "model.bin").write_bytes(b"not ours")
  with pytest.raises(CheckpointError, match="no meta file"):
    store.restore()


def test_debris_of_killed_saves_is_invisible_to_readers_and_removed_by_the_next_save(tmp_path):
  store = CheckpointStore(tmp_path, max_to_keep=None)
  store.save(1, _arrays(), {"step": 1})
  (tmp_path / "2.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
  (tmp_path / "2.orbax-checkpoint-tmp" / "state" / "junk").write_bytes(b"half")
  (tmp_path / ".trash-0-1-2").mkdir()
  (tmp_path / ".lock").write_text("12345\n")  # left by a writer killed with SIGKILL
  assert store.steps() == [1] and store.restore()[1] == {"step": 1}
  store.save(2, _arrays(2), {"step": 2})
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]
  assert store.restore()[1] == {"step": 2}


def test_a_save_waits_for_the_directory_lock_then_fails_clearly(tmp_path):
  store = CheckpointStore(tmp_path, lock_timeout_s=0.3)
  store.save(1, _arrays(), {})
  fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)  # another writer holds the lock
    os.write(fd, b"4242\n")
    with pytest.raises(CheckpointError, match=r"being written by another process \(pid 4242\)"):
      store.save(2, _arrays(), {})
    assert store.steps() == [1]
  finally:
    os.close(fd)
  store.save(2, _arrays(), {})
  assert store.steps() == [1, 2]


def test_check_compatible_lists_each_differing_field():
  check_compatible({"a": 1, "b": [1, 2]}, {"b": [1, 2], "a": 1}, "same")
  with pytest.raises(ValueError) as e:
    check_compatible({"dim": 16, "lr": 0.1, "old": 1, "same": 2},
                     {"dim": 32, "lr": 0.1, "new": "x", "same": 2}, "checkpoint /x config")
  msg = str(e.value)
  assert msg.startswith("checkpoint /x config differs in 3 field(s): ")
  for part in ("dim: stored=16 vs expected=32", "old: stored=1 vs expected=<missing>",
               "new: stored=<missing> vs expected='x'"):
    assert part in msg
  assert "lr" not in msg and "same:" not in msg


def test_checkpoints_written_without_a_leaf_record_still_restore(tmp_path):
  """Runner checkpoints written before ear_jax.io (plain Orbax, no SHA-256 record)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  arrays = {"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 2), np.int32)}
  with ocp.CheckpointManager(tmp_path.absolute(), item_names=("state", "meta"),
                             options=ocp.CheckpointManagerOptions(
                                 enable_async_checkpointing=False)) as m:
    m.save(4, args=ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                      meta=ocp.args.JsonSave({"old": True})))
  got, meta = CheckpointStore(tmp_path).restore(target=_abstract(arrays))
  assert meta == {"old": True} and _bitwise_equal(arrays, got)


def test_one_checkpoint_error_class_everywhere():
  assert ear_jax.CheckpointError is run_checkpoints.CheckpointError is checkpoints.CheckpointError
  assert issubclass(CheckpointError, RuntimeError)
  assert pathlib.Path(CheckpointStore("relative").directory).is_absolute()


def test_only_event_loop_closed_and_abandoned_orbax_coroutines_are_silenced():
  from ear_jax.io import _quiet  # pylint: disable=g-import-not-at-top
  passed = []
  hook = _quiet._filtered_unraisable(passed.append)  # pylint: disable=protected-access

  class Unraisable(NamedTuple):
    exc_value: BaseException
    object: object = None

  async def orbax_like():
    pass

  coro = orbax_like()
  coro.close()
  hook(Unraisable(RuntimeError("Event loop is closed")))
  hook(Unraisable(RuntimeError("something else")))
  hook(Unraisable(ValueError("x"), coro))  # not an Orbax coroutine: reported
  assert [str(u.exc_value) for u in passed] == ["something else", "x"]


def test_run_checkpointer_refuses_overwrites_and_lists_differing_fields(tmp_path):
  from ear_jax.core import learner  # pylint: disable=g-import-not-at-top
  from ear_jax.core.config import EARConfig, default_hparams  # pylint: disable=g-import-not-at-top
  config = EARConfig(dim=8, num_candidates=8, buffer_capacity=8)
  states = jax.vmap(lambda k: learner.init_learner(k, config))(
      jnp.stack([jax.random.PRNGKey(s) for s in (0, 1)]))

  def bound(cfg):
    ckpt = run_checkpoints.RunCheckpointer(tmp_path / "run")
    ckpt.bind(config=cfg, hparams=default_hparams(), seeds=[0, 1], num_train=32, segment=16,
              target=states)
    return ckpt

  ckpt = bound(config)
  ckpt.save(16, states, {"curve": []})
  with pytest.raises(ValueError, match="--resume"):
    bound(config).save(16, states, {})  # a fresh run over these checkpoints
  restored, position, _ = bound(config).restore()
  assert position == 16 and _bitwise_equal(restored, states)
  other = EARConfig(dim=8, num_candidates=8, buffer_capacity=8, num_rounds=config.num_rounds + 1)
  with pytest.raises(ValueError, match=rf"config.num_rounds: stored={config.num_rounds} vs "
                                       rf"expected={config.num_rounds + 1}.*left untouched"):
    bound(other).restore()
  assert sorted(os.listdir(tmp_path / "run")) == ["16"]


def test_never_retrieved_reports_are_dropped_only_for_a_directory_whose_failure_was_reported(
    tmp_path, caplog):
  """The sibling reads of a failed restore die later as 'Task exception was never retrieved'."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top
  from ear_jax.io import _quiet  # pylint: disable=g-import-not-at-top
  _quiet.install()
  failed, other = tmp_path / "failed" / "state", tmp_path / "other" / "state"

  def boom():
    raise ValueError(f"OUT_OF_RANGE reading {failed}")

  assert _quiet.call(boom, failed)[1].startswith("ValueError: OUT_OF_RANGE")

  async def read(directory):
    raise ValueError(f"OUT_OF_RANGE: Error reading 'v/0.0' at {directory}")

  async def abandon(directory):
    task = asyncio.ensure_future(read(directory))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    return id(task)

  with caplog.at_level(logging.ERROR, logger="asyncio"):
    for directory in (failed, other):
      asyncio.run(abandon(directory))
      gc.collect()
  reports = [r for r in caplog.records if "never retrieved" in r.getMessage()]
  assert len(reports) == 1 and str(other) in str(reports[0].exc_info[1])
