"""The learner item saves the learner state as its named pytree and restores it by name against
the abstract state of the config: a leaf that does not fit is refused, named."""
import jax
import numpy as np
import pytest

from ear_jax.agent.memory import Memory
from ear_jax.io import checkpoints
from tests.test_incremental_save import _leaves_equal, _trained


def _saved(tmp_path):
  """A trained memory saved to `tmp_path / 'm'` (and closed) and its unsaved twin."""
  m, _ = _trained()
  twin, _ = _trained()
  m.save(tmp_path / "m")
  m.close()
  return tmp_path / "m", twin


def _rewrite(path, edit):
  """The learner item written again as a new step after `edit(learner arrays)` (a valid digest)."""
  store = checkpoints.CheckpointStore(path / "learner")
  arrays, meta = store.restore()
  arrays["driver"]["learner"] = edit(jax.tree_util.tree_map(np.asarray,
                                                            arrays["driver"]["learner"]))
  store.save(store.latest_step() + 1, arrays, meta)


def test_the_learner_state_is_saved_by_name(tmp_path):
  path, twin = _saved(tmp_path)
  arrays, _ = checkpoints.CheckpointStore(path / "learner").restore()
  learner = arrays["driver"]["learner"]
  state = twin.learner
  np.testing.assert_array_equal(learner["params"]["w_q"], np.asarray(state.params.w_q))
  np.testing.assert_array_equal(learner["buffer"]["ybar"], np.asarray(state.buffer.ybar))
  # the replay buffer's candidates are saved as bank rows, not embeddings
  assert np.size(learner["buffer"].get("candidates", np.zeros(0))) == 0
  assert arrays["driver"]["buffer_rows"].shape == state.buffer.mask.shape


def test_two_same_shaped_leaves_are_restored_by_name_not_position(tmp_path):
  """Stored in the opposite order, w_q and w_m still come back as themselves."""
  path, twin = _saved(tmp_path)
  assert twin.learner.params.w_q.shape == twin.learner.params.w_m.shape

  def reorder(learner):  # a dict with the keys in the other order, as another writer could write
    return {**learner, "params": {"w_m": learner["params"]["w_m"],
                                  "w_q": learner["params"]["w_q"]}}

  _rewrite(path, reorder)
  with Memory.open(path) as back:
    _leaves_equal(back, twin)


@pytest.mark.parametrize("change", ["rename", "drop", "reshape"])
def test_a_learner_leaf_that_does_not_fit_is_named(tmp_path, change):
  path, _ = _saved(tmp_path)

  def edit(learner):
    params = {"w_q": learner["params"]["w_q"]}
    w_m = learner["params"]["w_m"]
    if change == "rename":
      params["w_x"] = w_m
    elif change == "reshape":
      params["w_m"] = w_m[:-1]
    return {**learner, "params": params}

  _rewrite(path, edit)
  expected = {"rename": r"params/w_m: not in the checkpoint.*params/w_x: stored but not in",
              "drop": r"params/w_m: not in the checkpoint",
              "reshape": r"params/w_m: stored float32\[\d+, \d+\] vs expected"}[change]
  with pytest.raises(ValueError, match=f"{path / 'learner'}.*the learner state does not match .*"
                                       + expected):
    Memory.open(path)


def test_fit_target_matches_by_name():
  target = {"a": jax.ShapeDtypeStruct((2,), np.float32), "b": jax.ShapeDtypeStruct((2,), np.float32)}
  got = checkpoints.fit_target(target, {"b": np.ones(2, np.float32), "a": np.zeros(2, np.float32)},
                               "t")
  np.testing.assert_array_equal(got["a"], np.zeros(2))
  with pytest.raises(ValueError, match=r"t does not match the stored arrays in 1 leaves: b: not"):
    checkpoints.fit_target(target, {"a": np.zeros(2, np.float32)}, "t")
