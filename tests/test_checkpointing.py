"""Tests of ear_jax/io/run_checkpoints.py: bitwise kill-and-resume, restore_adapter, bad checkpoints."""
import hashlib
import os
import pathlib

import jax
import numpy as np
import pytest

from ear_jax.data import candidates
from ear_jax.io import run_checkpoints
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
                               checkpointer=run_checkpoints.RunCheckpointer(directory), **kw)


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
  params, config, meta = run_checkpoints.restore_adapter(d, seed_index=1)
  assert config == setup[3] and meta["position"] == 51
  np.testing.assert_array_equal(np.asarray(params.w_m), np.asarray(full.final_state.params.w_m[1]))
  other = setup[3].__class__(**{**setup[3].__dict__, "num_rounds": 2})
  with pytest.raises(ValueError, match="num_rounds"):
    run_checkpoints.restore_adapter(d, config=other)


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
  with pytest.raises(run_checkpoints.CheckpointError, match="left untouched"):
    _run(setup, tmp_path / "c", eval_every=None, resume=True)
  assert _tree_hash(tmp_path / "c") == before
  assert sorted(os.listdir(tmp_path / "c")) == ["16", "32"]


def test_foreign_checkpoint_directory_is_a_clear_error_and_is_left_alone(setup, tmp_path):
  d = tmp_path / "c" / "16"
  d.mkdir(parents=True)
  (d / "model.bin").write_bytes(b"not ours")
  before = _tree_hash(tmp_path / "c")
  with pytest.raises(run_checkpoints.CheckpointError, match="not an ear_jax run checkpoint"):
    _run(setup, tmp_path / "c", resume=True)
  assert _tree_hash(tmp_path / "c") == before
  with pytest.raises(run_checkpoints.CheckpointError):
    run_checkpoints.restore_adapter(tmp_path / "c")


def test_final_adapter_is_replaced_atomically_and_only_training_checkpoints_have_positions(
    tmp_path):
  """`save_adapter` keeps one small step (a rerun replaces it); asking such a workdir for an
  intermediate position names the flag that would have written it."""
  from ear_jax.core import adapter as adapter_lib
  config = ex.build_config("ear", dim=8, num_candidates=20)
  store = tmp_path / "wd" / "runs" / "ear" / run_checkpoints.ADAPTER_DIR

  def params(v):
    return adapter_lib.AdapterParams(w_q=np.full((2, 8, 8), v, np.float32),
                                     w_m=np.full((2, 8, 8), -v, np.float32))

  for v in (1.0, 2.0):
    run_checkpoints.save_adapter(store, params(v), config=config, hparams=default_hparams(),
                               seeds=[0, 1], position=40)
  assert [p.name for p in store.iterdir() if p.name.isdigit()] == ["1"]
  got, stored, meta = run_checkpoints.restore_adapter(tmp_path / "wd", run="ear", seed_index=1)
  assert stored == config and meta["position"] == 40 and meta["seeds"] == [0, 1]
  np.testing.assert_array_equal(np.asarray(got.w_q), np.full((8, 8), 2.0, np.float32))
  with pytest.raises(FileNotFoundError, match="--checkpoint_every"):
    run_checkpoints.restore_adapter(tmp_path / "wd", run="ear", position=16)
  with pytest.raises(ValueError, match="num_rounds"):
    run_checkpoints.restore_adapter(store, config=ex.build_config("ear", dim=8, num_candidates=20,
                                                                num_rounds=2))


def _guarded_params(v, num_seeds=2, dim=8, side=2):
  from ear_jax.core import adapter as adapter_lib  # pylint: disable=g-import-not-at-top
  return adapter_lib.AdapterParams(
      w_q=np.full((num_seeds, dim, dim), v, np.float32),
      w_m=np.full((num_seeds, dim, dim), -v, np.float32),
      w_side=np.full((num_seeds, side), 3 * v, np.float32))


def test_a_guarded_adapter_restores_what_its_guard_serves_and_the_trained_one_on_request(
    tmp_path):
  """A user who deploys `ear_safe`'s saved adapter gets what the run served: the adapter where
  the guard trusts it, the first stage's parameters (identity, `w_side` at its init) where not."""
  from ear_jax.core import guard as guard_lib  # pylint: disable=g-import-not-at-top
  config = ex.build_config("ear_safe", dim=8, num_candidates=20, side_features=2)
  store = tmp_path / "wd" / "runs" / "ear_safe" / run_checkpoints.ADAPTER_DIR
  save = lambda **kw: run_checkpoints.save_adapter(store, _guarded_params(1.0), config=config,
                                                 hparams=default_hparams(), seeds=[0, 1],
                                                 position=40, **kw)
  with pytest.raises(ValueError, match="guard's decision per seed"):
    save()
  with pytest.raises(ValueError, match="2 seeds"):
    save(served=[True])
  assert not store.exists()  # (nothing written by a refused save)
  save(served=np.array([True, False]))
  first = guard_lib.first_stage_params(config)
  got, stored, meta = run_checkpoints.restore_adapter(tmp_path / "wd", seed_index=None)
  assert stored == config and meta["served"] == [True, False]
  np.testing.assert_array_equal(got.w_q[0], np.full((8, 8), 1.0, np.float32))
  np.testing.assert_array_equal(got.w_side[0], np.full((2,), 3.0, np.float32))
  for leaf in ("w_q", "w_m", "w_side"):  # seed 1: the guard serves the first stage
    np.testing.assert_array_equal(getattr(got, leaf)[1], np.asarray(getattr(first, leaf)))
  one, _, _ = run_checkpoints.restore_adapter(tmp_path / "wd", seed_index=1)
  np.testing.assert_array_equal(one.w_side, np.asarray(first.w_side))
  raw, _, meta = run_checkpoints.restore_adapter(tmp_path / "wd", seed_index=1, guarded=False)
  np.testing.assert_array_equal(raw.w_m, np.full((8, 8), -1.0, np.float32))
  assert meta["served"] == [True, False]
  plain = ex.build_config("ear", dim=8, num_candidates=20)
  with pytest.raises(ValueError, match="no guard"):
    run_checkpoints.save_adapter(tmp_path / "other", _guarded_params(1.0, side=0).replace(
        w_side=None), config=plain, hparams=default_hparams(), seeds=[0, 1], position=40,
                               served=[True, True])


def test_a_guarded_adapter_saved_without_the_decision_is_refused_unless_asked_for_raw(tmp_path):
  """An adapter stored before the decision was (no `served` in its metadata) must not be served
  as if the guard had trusted it."""
  import contextlib  # pylint: disable=g-import-not-at-top
  config = ex.build_config("ear_safe", dim=8, num_candidates=20, side_features=2)
  store = tmp_path / "runs" / "ear_safe" / run_checkpoints.ADAPTER_DIR
  params = _guarded_params(1.0)
  meta = run_checkpoints._identity(run_checkpoints.ADAPTER_FORMAT, config, default_hparams(),
                                   [0, 1], params, position=40)
  with contextlib.closing(run_checkpoints.CheckpointStore(store, max_to_keep=1)) as s:
    s.save(0, {"params": params}, meta)
  with pytest.raises(ValueError, match="guarded=False"):
    run_checkpoints.restore_adapter(tmp_path)
  raw, _, _ = run_checkpoints.restore_adapter(tmp_path, guarded=False)
  np.testing.assert_array_equal(raw.w_q, np.full((8, 8), 1.0, np.float32))


@pytest.mark.slow
def test_a_guarded_run_restores_the_parameters_its_test_set_was_scored_with(setup, tmp_path):
  """From a training checkpoint (the learner state with the guard) and from the final adapter
  `experiments.run` writes: the served parameters are `runner.served_params` of the final state."""
  from ear_jax.core import guard as guard_lib  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import suites  # pylint: disable=g-import-not-at-top
  bench, train, test, _ = setup
  config = ex.build_config("ear_safe", dim=16, num_candidates=20, buffer_capacity=64,
                           guard_holdout=2, guard_min_queries=4)
  hp = ex.build_method("ear_safe", dim=16, num_candidates=20).hparams
  full = ex.train_and_evaluate("ear_safe", bench.stream, train, test, config, hp, [0, 1],
                               checkpoint_every=16,
                               checkpointer=run_checkpoints.RunCheckpointer(tmp_path / "c"))
  served = run_checkpoints.guard_decisions(full.final_state, config)
  want = ex.served_params(full.final_state, config)
  assert not served.all()  # (a seed whose guard serves the first stage: the raw adapter differs)
  got, _, meta = run_checkpoints.restore_adapter(tmp_path / "c", seed_index=None)
  assert meta["served"] == served.tolist()
  assert _equal(got, want)
  raw, _, _ = run_checkpoints.restore_adapter(tmp_path / "c", seed_index=None, guarded=False)
  assert _equal(raw, full.final_state.params)
  out = suites.run(suites.Options(benchmark="synthetic", seeds=2, synthetic_queries=60,
                                  synthetic_dim=16, progress=False, workdir=str(tmp_path / "wd"),
                                  suite=None, method="ear_safe",
                                  config_overrides={"buffer_capacity": 64, "guard_min_queries": 4,
                                                    "guard_holdout": 2}))
  (name, run), = out["runs"].items()
  got, _, meta = run_checkpoints.restore_adapter(tmp_path / "wd", run=name, seed_index=None)
  assert len(meta["served"]) == 2 and not all(meta["served"])
  raw, stored, _ = run_checkpoints.restore_adapter(tmp_path / "wd", run=name, seed_index=None,
                                                 guarded=False)
  first = guard_lib.first_stage_params(stored)
  seed = lambda tree, i: jax.tree_util.tree_map(lambda x: np.asarray(x)[i], tree)
  for i, s in enumerate(meta["served"]):
    assert _equal(seed(got, i), seed(raw, i) if s else first)


def test_an_adapter_saved_by_the_previous_layout_restores_what_its_guard_served(tmp_path):
  """tests/fixtures/old_run_adapter: an `ear_safe` run's final adapters saved by the code that
  stored the guard's retired config fields and the adapter's empty low-rank fields (made by
  tests/fixtures/make_previous_layouts.py with that code)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  from ear_jax.core import guard as guard_lib  # pylint: disable=g-import-not-at-top
  from ear_jax.core.config import EARConfig  # pylint: disable=g-import-not-at-top
  fixtures = pathlib.Path(__file__).parent / "fixtures"
  old = json.loads((fixtures / "old_run_adapter.json").read_text())
  assert "adapter_rank" in old["config"] and "guard_evidence" in old["config"]
  shutil.copytree(fixtures / "old_run_adapter", tmp_path / "wd")
  got, stored, meta = run_checkpoints.restore_adapter(tmp_path / "wd", seed_index=None)
  # Stored before `loss_support` existed (that run trained with the paper's softmax over all K)
  # and while `ear_safe`'s side_init was 0.05.
  assert stored == dataclasses.replace(
      EARConfig.for_method("ear_safe", dim=4, num_candidates=6, side_features=2),
      loss_support="all", side_init=0.05)
  assert meta["served"] == [True, False]
  first = guard_lib.first_stage_params(stored)
  for name in ("w_q", "w_m", "w_side"):
    want = np.asarray(old["params"][name], np.float32)
    np.testing.assert_array_equal(np.asarray(getattr(got, name))[0], want[0])  # served
    np.testing.assert_array_equal(np.asarray(getattr(got, name))[1], getattr(first, name))
  raw, _, _ = run_checkpoints.restore_adapter(tmp_path / "wd", seed_index=1, guarded=False)
  np.testing.assert_array_equal(np.asarray(raw.w_q), np.asarray(old["params"]["w_q"][1],
                                                                np.float32))
