"""Memory checkpoints save the learner state as its named pytree and restore it by name against the
abstract state of the config (issue 19 item 6); checkpoints keyed by flatten position still load."""
import jax
import numpy as np
import pytest

from ear_jax.agent.memory import Memory
from ear_jax.agent.memory import persistence
from ear_jax.io import checkpoints
from tests.test_incremental_save import _state_equal, _trained


def _rewrite(path, m, edit):
  """Writes `m`'s main step again at `path` (on top of its shards) after `edit(arrays, meta)`."""
  m.save(path)
  arrays, meta = persistence.main_step(m._parts())
  with checkpoints.CheckpointStore(path) as store:
    meta["bank"] = store.read_meta()["bank"]
  edit(arrays, meta)
  persistence.write(path, arrays, meta)


def test_the_learner_state_is_saved_by_name(tmp_path):
  m = _trained()
  m.save(tmp_path / "m")
  with checkpoints.CheckpointStore(tmp_path / "m") as store:
    arrays, meta = store.restore()
  learner = arrays["driver"]["learner"]
  assert meta["driver"]["learner_layout"] == "named-1"
  np.testing.assert_array_equal(learner["params"]["w_q"], np.asarray(m.params.w_q))
  np.testing.assert_array_equal(learner["buffer"]["ybar"], np.asarray(m.state.buffer.ybar))
  assert learner["buffer"]["candidates"].shape == (0,)  # saved as bank rows instead


def test_two_same_shaped_leaves_are_restored_by_name_not_position(tmp_path):
  """Stored in the opposite order, w_q and w_m still come back as themselves."""
  m = _trained()
  assert m.params.w_q.shape == m.params.w_m.shape

  def reorder(arrays, meta):
    # a plain dict with the keys in the other order, as another writer could produce
    learner = jax.tree_util.tree_map(np.asarray, arrays["driver"]["learner"])
    as_dict = {"params": {"w_m": learner.params.w_m, "w_q": learner.params.w_q}}
    as_dict.update({f: getattr(learner, f) for f in ("opt_state", "buffer", "step",
                                                     "queries_seen", "critic_calls")})
    arrays["driver"]["learner"] = as_dict

  _rewrite(tmp_path / "m", m, reorder)
  back = Memory.load(tmp_path / "m")
  np.testing.assert_array_equal(np.asarray(back.params.w_q), np.asarray(m.params.w_q))
  np.testing.assert_array_equal(np.asarray(back.params.w_m), np.asarray(m.params.w_m))
  _state_equal(m, back)


@pytest.mark.parametrize("change", ["rename", "drop", "reshape"])
def test_a_learner_leaf_that_does_not_fit_is_named(tmp_path, change):
  m = _trained()

  def edit(arrays, meta):
    learner = arrays["driver"]["learner"]
    w_m = np.asarray(learner.params.w_m)
    params = {"w_q": np.asarray(learner.params.w_q)}
    if change == "rename":
      params["w_x"] = w_m
    elif change == "reshape":
      params["w_m"] = w_m[:-1]
    rest = {f: getattr(learner, f) for f in ("opt_state", "buffer", "step", "queries_seen",
                                             "critic_calls")}
    arrays["driver"]["learner"] = {"params": params, **rest}

  _rewrite(tmp_path / "m", m, edit)
  expected = {"rename": r"params/w_m: not in the checkpoint.*params/w_x: stored but not in",
              "drop": r"params/w_m: not in the checkpoint",
              "reshape": r"params/w_m: stored float32\[\d+, \d+\] vs expected"}[change]
  with pytest.raises(ValueError, match=r"the learner state does not match .*" + expected):
    Memory.load(tmp_path / "m")


def test_a_checkpoint_keyed_by_flatten_position_still_loads(tmp_path):
  """The layout before names: leaves '0000'.. in flatten order, the buffer's candidates as rows."""
  m = _trained()

  def positional(arrays, meta):
    paths = jax.tree_util.tree_flatten_with_path(m._driver.state)[0]
    arrays["driver"]["learner"] = {
        f"{i:04d}": np.asarray(x) for i, (p, x) in enumerate(paths)
        if jax.tree_util.keystr(p) != ".buffer.candidates"}
    del meta["driver"]["learner_layout"]

  _rewrite(tmp_path / "m", m, positional)
  back = Memory.load(tmp_path / "m")
  _state_equal(m, back)
  np.testing.assert_array_equal(back._driver.buffer_rows, m._driver.buffer_rows)


def test_fit_target_matches_by_name():
  target = {"a": jax.ShapeDtypeStruct((2,), np.float32), "b": jax.ShapeDtypeStruct((2,), np.float32)}
  got = checkpoints.fit_target(target, {"b": np.ones(2, np.float32), "a": np.zeros(2, np.float32)},
                               "t")
  np.testing.assert_array_equal(got["a"], np.zeros(2))
  with pytest.raises(ValueError, match=r"t does not match the stored arrays in 1 leaves: b: not"):
    checkpoints.fit_target(target, {"a": np.zeros(2, np.float32)}, "t")
