"""Old checkpoints convert: `experiments.convert_memory` turns a memory directory of ear_jax 0.1.0's
layout (tests/fixtures/old_memory, made by the old code) into the new layout, keeping every live
memory and the learner."""
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ear_jax.agent.memory import Memory
from ear_jax.agent.memory.table import Table
from ear_jax.experiment import convert_memory
from ear_jax.io import checkpoints

_REPO = pathlib.Path(__file__).resolve().parent.parent
_FIXTURES = _REPO / "tests" / "fixtures"
OLD = json.loads((_FIXTURES / "old_memory.json").read_text())


@pytest.fixture
def old(tmp_path):
  shutil.copytree(_FIXTURES / "old_memory", tmp_path / "old")
  return tmp_path / "old"


@pytest.mark.slow
def test_conversion_keeps_the_live_memories_in_row_order_and_the_learner(old, tmp_path):
  report = convert_memory.convert(old, tmp_path / "new")
  assert report == (11, 2, OLD["open_sessions"], OLD["queued"])  # a2 and b0's old row skipped
  with Memory.open(tmp_path / "new") as m:
    got = m.list()
    assert [r["id"] for r in got] == OLD["ids"] and [r["text"] for r in got] == OLD["texts"]
    assert [r["scope"] for r in got] == OLD["scopes"] and [r["date"] for r in got] == OLD["dates"]
    assert [r["store"] for r in got] == OLD["stores"]
    learner = m.learner
    assert m.config.seed == OLD["seed"] and m.config.ear.to_dict() == OLD["config"]
    assert m.stats["pending"] == 0 and m.stats["ready"] == 0  # the old sessions were dropped
  for name, value in OLD["params"].items():
    np.testing.assert_array_equal(getattr(learner.params, name), np.float32(value), err_msg=name)
  assert int(learner.step) == OLD["step"] and int(learner.queries_seen) == OLD["queries_seen"]
  assert int(np.asarray(learner.buffer.valid).sum()) == OLD["buffer_valid"]
  # add normalises the stored unit rows again: equal up to float32 rounding (one ulp)
  np.testing.assert_allclose(Table(tmp_path / "new" / "rows.sqlite", 8).read_all().embeddings,
                             np.float32(OLD["embeddings"]), rtol=0, atol=1e-7)


def test_conversion_refuses_a_non_empty_target_and_a_missing_source(old, tmp_path):
  (tmp_path / "new").mkdir()
  (tmp_path / "new" / "keep.txt").write_text("mine")
  with pytest.raises(ValueError, match="not an empty directory"):
    convert_memory.convert(old, tmp_path / "new")
  assert [p.name for p in (tmp_path / "new").iterdir()] == ["keep.txt"]
  with pytest.raises(ValueError, match="holds no memory checkpoint"):
    convert_memory.convert(tmp_path / "nowhere", tmp_path / "new2")


@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    (lambda meta: meta["bank"].update(layout=None), "bank is stored inline"),
    (lambda meta: meta["driver"].pop("learner_layout"), "learner state is stored by position")],
                         ids=["inline_bank", "positional_learner"])
def test_an_older_layout_is_refused_saying_to_resave_it_with_the_old_version(old, tmp_path,
                                                                             change, message):
  with checkpoints.CheckpointStore(old) as store:
    arrays, meta = store.restore(1)
    change(meta)
    store.save(2, arrays, meta)
  with pytest.raises(checkpoints.CheckpointFormatError, match=f"{message}.*ear_jax 0.1.0"):
    convert_memory.convert(old, tmp_path / "new")
  assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


@pytest.mark.slow
def test_the_command_converts_and_says_what_it_dropped(old, tmp_path):
  cmd = [sys.executable, "-m", "experiments.convert_memory", f"--old={old}",
         f"--new={tmp_path / 'new'}"]
  done = subprocess.run(cmd, capture_output=True, text=True, cwd=_REPO, check=True)
  assert "converted 11 memories" in done.stdout and "dropped 1 open session(s) and 1 queued" in (
      done.stdout)
  again = subprocess.run(cmd, capture_output=True, text=True, cwd=_REPO)
  assert again.returncode == 1 and "not an empty directory" in again.stderr
  assert "Traceback" not in again.stderr
