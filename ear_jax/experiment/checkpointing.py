"""Orbax checkpoints of a whole EAR run: the learner state of every seed plus the stream position.

Symbols: `S` seeds.

A run directory holds an Orbax `CheckpointManager` whose step is the number of training queries
processed (the position in the stream). Each step stores two items:

  * `state`: the stacked `LearnerState` `[S, ...]` (adapter, optimizer state, Experience Buffer,
    counters) and the seeds' PRNG keys, saved with `StandardSave`;
  * `meta`: JSON with a format tag, the `EARConfig`, the hyperparameters, the seeds, the stream
    length and segment length, every leaf's shape/dtype, and run extras (learning curve so far,
    per-query training log so far).

Restoring checks the JSON BEFORE touching the arrays: a checkpoint of another config, shape, seed set
or segmentation is a `ValueError` that says what differs; an unreadable or foreign directory is a
`CheckpointError`. Nothing here ever deletes or rewrites an existing checkpoint on a failed restore.

Research code restores a trained adapter with `restore_adapter(workdir)`.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import learner
from ear_jax.core.config import EARConfig, HParams

FORMAT = "ear_jax.run_checkpoint/2"
_META_FILE = "ear_run.json"  # written next to the step directories once a run is bound


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be read: corrupted, truncated or not written by ear_jax."""


def _ocp():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp


def _leaf_specs(tree) -> list:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [[jax.tree_util.keystr(p), list(np.shape(x)), str(np.asarray(x).dtype)
           if not hasattr(x, "dtype") else str(x.dtype)] for p, x in leaves]


def _hparams_json(hparams: HParams) -> dict:
  return {f.name: np.asarray(getattr(hparams, f.name)).tolist()
          for f in dataclasses.fields(hparams)}


def _config_from_json(d: dict) -> EARConfig:
  return EARConfig.from_dict(d)


def _abstract(tree):
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


class RunCheckpointer:
  """Checkpoints of one run (one method on S seeds) in `directory`, keeping the last `max_to_keep`.

  Usage: `bind(...)` with the run's identity and an example state, then `save(position, state,
  extra)` / `latest_position()` / `restore()`.
  """

  def __init__(self, directory, *, max_to_keep: int = 3):
    self.directory = pathlib.Path(directory).absolute()
    self.max_to_keep = max_to_keep
    self._manager = None
    self._ident = None
    self._target = None

  # -- identity -------------------------------------------------------------------------------
  def bind(self, *, config: EARConfig, hparams: HParams, seeds: Sequence[int], num_train: int,
           segment: int, target) -> None:
    """Sets the identity that every checkpoint of this run must match, and the restore target."""
    self._target = {"state": _abstract(target), "keys": jax.ShapeDtypeStruct((len(seeds), 2),
                                                                              jnp.uint32)}
    self._ident = {"format": FORMAT, "config": config.to_dict(),
                   "hparams": _hparams_json(hparams), "seeds": [int(s) for s in seeds],
                   "num_train": int(num_train), "segment": int(segment),
                   "leaves": _leaf_specs(self._target)}

  def _mgr(self):
    if self._manager is None:
      ocp = _ocp()
      self._manager = ocp.CheckpointManager(
          self.directory,
          options=ocp.CheckpointManagerOptions(max_to_keep=self.max_to_keep, create=True,
                                               enable_async_checkpointing=False),
          item_names=("state", "meta"))
    return self._manager

  def existing_steps(self) -> list:
    """Step directories present on disk (without opening them)."""
    if not self.directory.is_dir():
      return []
    return sorted(int(p.name) for p in self.directory.iterdir()
                  if p.is_dir() and p.name.isdigit())

  def latest_position(self) -> Optional[int]:
    steps = self.existing_steps()
    return steps[-1] if steps else None

  # -- save / restore -------------------------------------------------------------------------
  def save(self, position: int, state, extra: Optional[dict] = None) -> None:
    """Saves `(state, position)` (and JSON `extra`) as step `position`; waits until written."""
    if self._ident is None:
      raise RuntimeError("call bind() before save()")
    ocp = _ocp()
    keys = jnp.stack([jax.random.PRNGKey(s) for s in self._ident["seeds"]]).astype(jnp.uint32)
    meta = dict(self._ident, position=int(position), extra=extra or {})
    self._mgr().save(int(position), args=ocp.args.Composite(
        state=ocp.args.StandardSave({"state": state, "keys": keys}),
        meta=ocp.args.JsonSave(meta)), force=True)
    self._mgr().wait_until_finished()

  def read_meta(self, position: Optional[int] = None) -> dict:
    """The JSON metadata of a step (default: the latest). Raises CheckpointError if unreadable."""
    position = self.latest_position() if position is None else position
    if position is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    path = self.directory / str(position) / "meta"
    try:
      files = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else []
      data = None
      for p in files:
        if p.suffix == ".json" or p.name == "metadata":
          with open(p) as f:
            cand = json.load(f)
          if isinstance(cand, dict) and "format" in cand:
            data = cand
            break
    except (OSError, ValueError) as e:
      raise CheckpointError(
          f"checkpoint {path.parent} is unreadable (corrupted?): {e}. The existing checkpoints "
          f"were left untouched.") from e
    if data is None or data.get("format") != FORMAT:
      raise CheckpointError(
          f"{path.parent} is not an ear_jax run checkpoint (no '{FORMAT}' metadata): it was "
          "written by another program or is corrupted. The existing checkpoints were left "
          "untouched; use another --workdir or remove it.")
    return data

  def check_compatible(self, meta: dict) -> None:
    """ValueError naming every field in which `meta` differs from this run."""
    diffs = []
    for key in ("config", "hparams", "seeds", "num_train", "segment"):
      if meta.get(key) != self._ident[key]:
        if key in ("config", "hparams"):
          a, b = meta.get(key) or {}, self._ident[key]
          fields = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
          diffs.append(f"{key} fields {', '.join(f'{k}: checkpoint={a.get(k)!r} vs run={b.get(k)!r}' for k in fields)}")
        else:
          diffs.append(f"{key}: checkpoint={meta.get(key)!r} vs run={self._ident[key]!r}")
    if meta.get("leaves") != self._ident["leaves"] and not diffs:
      diffs.append("array shapes differ")
    if diffs:
      raise ValueError(
          f"checkpoint in {self.directory} was written by a different run and cannot be resumed "
          f"here: " + "; ".join(diffs) + ". The existing checkpoints were left untouched; use "
          "another --workdir, or the original settings.")

  def restore(self, position: Optional[int] = None):
    """`(state, position, extra)` of a step (default: the latest), after checking compatibility.

    Raises:
      ValueError: the checkpoint belongs to another config / shape / seed set.
      CheckpointError: unreadable or foreign checkpoint.
    """
    if self._ident is None:
      raise RuntimeError("call bind() before restore()")
    position = self.latest_position() if position is None else position
    meta = self.read_meta(position)
    self.check_compatible(meta)
    ocp = _ocp()
    try:
      restored = self._mgr().restore(position, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(self._target)))
      tree = restored["state"]
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f"checkpoint step {position} in {self.directory} could not be restored (corrupted or "
          f"truncated): {type(e).__name__}: {str(e)[:300]}. The existing checkpoints were left "
          "untouched; remove that step directory to fall back to an earlier one, or use another "
          "--workdir.") from e
    expected = jnp.stack([jax.random.PRNGKey(s) for s in self._ident["seeds"]])
    if not np.array_equal(np.asarray(tree["keys"]), np.asarray(expected, np.uint32)):
      raise ValueError(f"checkpoint in {self.directory} holds keys of other seeds")
    return tree["state"], int(meta["position"]), meta.get("extra", {})

  def close(self):
    if self._manager is not None:
      self._manager.close()
      self._manager = None


def find_run_dirs(workdir) -> list:
  """Run checkpoint directories under `workdir` (`workdir/checkpoints/<run>`, or `workdir` itself)."""
  workdir = pathlib.Path(workdir)
  cands = [workdir] + (sorted(p for p in (workdir / "checkpoints").iterdir() if p.is_dir())
                       if (workdir / "checkpoints").is_dir() else [])
  return [p for p in cands if any(c.is_dir() and c.name.isdigit() for c in p.iterdir())]


def restore_adapter(workdir, *, run: Optional[str] = None, config: Optional[EARConfig] = None,
                    seed_index: Optional[int] = 0, position: Optional[int] = None):
  """Restores a trained adapter from a run's workdir, for use in research code.

  The arrays are restored against an abstract target built from the stored config
  (`jax.eval_shape` of `learner.init_learner`), so nothing is allocated twice and a shape mismatch
  is caught before any array is read.

  Args:
    workdir: the `--workdir` of `experiments.run` (its `checkpoints/<run>` subdirectories are
      searched) or a run checkpoint directory itself.
    run: the run name (e.g. 'ear'); needed when the workdir holds several runs.
    config: optional expected `EARConfig`; a checkpoint of another config is a ValueError naming
      the fields that differ.
    seed_index: which seed's adapter (`0..S-1`); None returns the stacked `[S, ...]` adapter.
    position: the step (training queries seen); default the latest.

  Returns:
    `(params: AdapterParams, config: EARConfig, meta: dict)`.

  Raises:
    FileNotFoundError: no checkpoint found.
    ValueError: other config / shape, ambiguous run.
    CheckpointError: unreadable or foreign checkpoint.
  """
  workdir = pathlib.Path(workdir)
  if not workdir.exists():
    raise FileNotFoundError(f"workdir {str(workdir)!r} does not exist")
  if run is not None:
    dirs = [workdir / "checkpoints" / run] if (workdir / "checkpoints" / run).is_dir() else []
  else:
    dirs = find_run_dirs(workdir)
  if not dirs:
    raise FileNotFoundError(f"no run checkpoint found under {str(workdir)!r}"
                            + (f" for run {run!r}" if run else ""))
  if len(dirs) > 1:
    raise ValueError(f"{str(workdir)!r} holds several runs ({', '.join(p.name for p in dirs)}); "
                     "pass run=<name>")
  ckpt = RunCheckpointer(dirs[0])
  meta = ckpt.read_meta(position)
  stored = _config_from_json(meta["config"])
  if config is not None and config != stored:
    a, b = stored.to_dict(), config.to_dict()
    fields = sorted(k for k in a if a[k] != b[k])
    raise ValueError(
        f"checkpoint in {dirs[0]} has another config: "
        + ", ".join(f"{k}: checkpoint={a[k]!r} vs requested={b[k]!r}" for k in fields))
  seeds = meta["seeds"]
  target = jax.eval_shape(
      jax.vmap(lambda k: learner.init_learner(k, stored)),
      jax.ShapeDtypeStruct((len(seeds), 2), jnp.uint32))
  ckpt._target = {"state": target,  # pylint: disable=protected-access
                  "keys": jax.ShapeDtypeStruct((len(seeds), 2), jnp.uint32)}
  ckpt._ident = dict(meta)  # pylint: disable=protected-access
  if _leaf_specs(ckpt._target) != meta["leaves"]:  # pylint: disable=protected-access
    raise ValueError(f"checkpoint in {dirs[0]} has array shapes that do not match its config "
                     f"{stored}")
  state, _, _ = ckpt.restore(meta["position"])
  ckpt.close()
  params = state.params
  if seed_index is not None:
    if not 0 <= seed_index < len(seeds):
      raise ValueError(f"seed_index={seed_index} out of range for {len(seeds)} seeds")
    params = jax.tree_util.tree_map(lambda x: x[seed_index], params)
  return params, stored, meta


__all__ = ["CheckpointError", "RunCheckpointer", "find_run_dirs", "restore_adapter", "FORMAT"]
