"""Tests of ear_jax/checkpointing.py: bitwise kill-and-resume, restore_adapter, bad checkpoints."""
import hashlib
import os
import pathlib

import jax
import numpy as np
import pytest

from ear_jax.data import candidates
from ear_jax.experiment import checkpointing
from ear_jax.experiment import runner as ex
from ear_jax.data import synthetic
from ear_jax.core.config import default_hparams


@pytest.fixture(scope="module")
def setup():
  bench = candidates.build_benchmark(
      synthetic.make_synthetic(seed=0, num_queries=64, num_banks=6, dim=16), k=20)
  train, test = ex.seed_splits(bench.num_queries, [0, 1])  # 51 training queries: a padded tail
  config = ex.build_config("ear", dim=16, num_candidates=20, buffer_capacity=64)
  return bench, train, test, config


def _run(setup, directory, eval_every=16, **kw):
  """A 2-seed EAR run checkpointed every 16 queries; `eval_every=None` skips the learning curve
  (and its compilation) for the tests that never reach an evaluation."""
  bench, train, test, config = setup
  kw.setdefault("config", config)
  config = kw.pop("config")
  return ex.train_and_evaluate("ear", bench.stream, train, test, config, default_hparams(),
                               [0, 1], eval_every=eval_every, checkpoint_every=16,
                               checkpointer=checkpointing.RunCheckpointer(directory), **kw)


def _tree_hash(path):
  h = hashlib.sha256()
  for p in sorted(pathlib.Path(path).rglob("*")):
    h.update(str(p).encode())
    if p.is_file():
      h.update(p.read_bytes())
  return h.hexdigest()


def _equal(a, b):
  return all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
      lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


@pytest.fixture(scope="module")
def uninterrupted(setup, tmp_path_factory):
  d = tmp_path_factory.mktemp("full") / "ckpt"
  return _run(setup, d), d


@pytest.mark.slow
def test_interrupted_then_resumed_run_is_bitwise_identical(setup, uninterrupted, tmp_path):
  full, _ = uninterrupted
  with pytest.raises(ex.Interrupted) as e:
    _run(setup, tmp_path / "ckpt", stop_after_chunks=2)
  assert e.value.position == 32
  resumed = _run(setup, tmp_path / "ckpt", resume=True)
  assert resumed.resumed_from == 32
  assert _equal(full.final_state, resumed.final_state)
  for k in full.eval:
    np.testing.assert_array_equal(full.eval[k], resumed.eval[k])
  assert full.curve == resumed.curve
  for k in full.train_log:
    np.testing.assert_array_equal(full.train_log[k], resumed.train_log[k])


@pytest.mark.slow
def test_restore_adapter_gives_the_final_adapter_and_rejects_another_config(setup, uninterrupted):
  full, d = uninterrupted
  params, config, meta = checkpointing.restore_adapter(d, seed_index=1)
  assert config == setup[3] and meta["position"] == 51
  np.testing.assert_array_equal(np.asarray(params.w_m), np.asarray(full.final_state.params.w_m[1]))
  other = setup[3].__class__(**{**setup[3].__dict__, "num_rounds": 2})
  with pytest.raises(ValueError, match="num_rounds"):
    checkpointing.restore_adapter(d, config=other)


@pytest.mark.slow
def test_resume_with_another_config_is_a_clear_error_and_keeps_checkpoints(setup, tmp_path):
  with pytest.raises(ex.Interrupted):
    _run(setup, tmp_path / "c", eval_every=None, stop_after_chunks=1)
  before = _tree_hash(tmp_path / "c")
  other = setup[3].__class__(**{**setup[3].__dict__, "replay_size": 2})
  with pytest.raises(ValueError, match="replay_size"):
    _run(setup, tmp_path / "c", eval_every=None, resume=True, config=other)
  assert _tree_hash(tmp_path / "c") == before


@pytest.mark.slow
def test_corrupted_checkpoint_is_a_clear_error_and_keeps_checkpoints(setup, tmp_path):
  with pytest.raises(ex.Interrupted):
    _run(setup, tmp_path / "c", eval_every=None, stop_after_chunks=2)
  step = tmp_path / "c" / "32" / "state"
  data = [p for p in step.rglob("*") if p.is_file() and p.stat().st_size > 64]
  assert data
  for p in data:  # truncate the array data of the latest step
    p.write_bytes(p.read_bytes()[:16])
  before = _tree_hash(tmp_path / "c")
  with pytest.raises(checkpointing.CheckpointError, match="left untouched"):
    _run(setup, tmp_path / "c", eval_every=None, resume=True)
  assert _tree_hash(tmp_path / "c") == before
  assert sorted(os.listdir(tmp_path / "c")) == ["16", "32"]


def test_foreign_checkpoint_directory_is_a_clear_error_and_is_left_alone(setup, tmp_path):
  d = tmp_path / "c" / "16"
  d.mkdir(parents=True)
  (d / "model.bin").write_bytes(b"not ours")
  before = _tree_hash(tmp_path / "c")
  with pytest.raises(checkpointing.CheckpointError, match="not an ear_jax run checkpoint"):
    _run(setup, tmp_path / "c", resume=True)
  assert _tree_hash(tmp_path / "c") == before
  with pytest.raises(checkpointing.CheckpointError):
    checkpointing.restore_adapter(tmp_path / "c")


def test_final_adapter_is_replaced_atomically_and_only_training_checkpoints_have_positions(
    tmp_path):
  """Issue 20 item 10: `save_adapter` keeps one small step (a rerun replaces it); asking such a
  workdir for an intermediate position names the flag that would have written it."""
  from ear_jax.core import adapter as adapter_lib
  config = ex.build_config("ear", dim=8, num_candidates=20)
  store = tmp_path / "wd" / "runs" / "ear" / checkpointing.ADAPTER_DIR

  def params(v):
    return adapter_lib.AdapterParams(w_q=np.full((2, 8, 8), v, np.float32),
                                     w_m=np.full((2, 8, 8), -v, np.float32))

  for v in (1.0, 2.0):
    checkpointing.save_adapter(store, params(v), config=config, hparams=default_hparams(),
                               seeds=[0, 1], position=40)
  assert [p.name for p in store.iterdir() if p.name.isdigit()] == ["1"]
  got, stored, meta = checkpointing.restore_adapter(tmp_path / "wd", run="ear", seed_index=1)
  assert stored == config and meta["position"] == 40 and meta["seeds"] == [0, 1]
  np.testing.assert_array_equal(np.asarray(got.w_q), np.full((8, 8), 2.0, np.float32))
  with pytest.raises(FileNotFoundError, match="--checkpoint_every"):
    checkpointing.restore_adapter(tmp_path / "wd", run="ear", position=16)
  with pytest.raises(ValueError, match="num_rounds"):
    checkpointing.restore_adapter(store, config=ex.build_config("ear", dim=8, num_candidates=20,
                                                                num_rounds=2))
