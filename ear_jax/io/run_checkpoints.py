"""Orbax checkpoints of a whole EAR run: the learner state of every seed plus the stream position.

Symbols: `S` seeds. A run directory is a `CheckpointStore` whose step is the number of training
queries processed. Each step stores `state` (the stacked `LearnerState [S, ...]` and the seeds' PRNG
keys) and `meta` (format tag, config, hyperparameters, seeds, stream and segment length, leaf
shapes, run extras). Restoring checks the JSON before touching the arrays: another config, shape,
seed set or segmentation is a `ValueError` saying what differs; a foreign directory is a
`CheckpointError`.

A finished run also keeps its final adapters alone (`save_adapter`, `runs/<run>/adapter/`);
`restore_adapter` reads them back, for a guarded config as the guard serves them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import guard as guard_lib
from ear_jax.core import learner
from ear_jax.core.config import EARConfig, HParams
from ear_jax.io.checkpoints import CheckpointError, CheckpointStore, check_compatible, fit_target

FORMAT = "ear_jax.run_checkpoint/2"
ADAPTER_FORMAT = "ear_jax.run_adapter/1"  # a finished run's final adapters alone (`save_adapter`)
ADAPTER_DIR = "adapter"  # `<workdir>/runs/<run>/adapter`
_UNTOUCHED = "The existing checkpoints were left untouched"


def _leaf_specs(tree) -> list:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [[jax.tree_util.keystr(p), list(np.shape(x)), str(np.asarray(x).dtype)
           if not hasattr(x, "dtype") else str(x.dtype)] for p, x in leaves]


def _identity(fmt: str, config: EARConfig, hparams: HParams, seeds: Sequence[int], tree,
              **more) -> dict:
  """A step's identity meta: format, config, hyperparameters, seeds, `more`, `tree`'s leaf specs."""
  return {"format": fmt, "config": config.to_dict(),
          "hparams": {f.name: np.asarray(getattr(hparams, f.name)).tolist()
                      for f in dataclasses.fields(hparams)},
          "seeds": [int(s) for s in seeds], **more, "leaves": _leaf_specs(tree)}


def _check_leaves(target, meta: dict, what: str, config: EARConfig) -> None:
  if _leaf_specs(target) != meta["leaves"]:
    raise ValueError(f"{what} has array shapes that do not match its config {config}")


def _flat_ident(ident: dict) -> dict:
  """The identity as one flat dict ('config.replay_size', 'seeds', ...), for `check_compatible`."""
  out = {}
  for key in ("config", "hparams", "seeds", "num_train", "segment"):
    value = ident.get(key)
    if key in ("config", "hparams") and isinstance(value, dict):
      out.update({f"{key}.{k}": v for k, v in value.items()})
    else:
      out[key] = value
  return out


class RunCheckpointer:
  """Checkpoints of one run (one method on S seeds) in `directory`, keeping the last `max_to_keep`.

  Usage: `bind(...)` with the run's identity and an example state, then `save(position, state,
  extra)` / `latest_position()` / `restore()`.
  """

  def __init__(self, directory, *, max_to_keep: int = 3):
    self.directory = pathlib.Path(directory).absolute()
    self._store = CheckpointStore(self.directory, max_to_keep=max_to_keep)
    self._ident = self._target = None  # (set by `bind`)

  # -- identity -------------------------------------------------------------------------------
  def bind(self, *, config: EARConfig, hparams: HParams, seeds: Sequence[int], num_train: int,
           segment: int, target) -> None:
    """Sets the identity that every checkpoint of this run must match, and the restore target."""
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                                      target)
    self._target = _run_target(abstract, len(seeds))
    self._ident = _identity(FORMAT, config, hparams, seeds, self._target,
                            num_train=int(num_train), segment=int(segment))

  def existing_steps(self) -> list:
    """Complete step directories present on disk (without opening them)."""
    return self._store.steps()

  def latest_position(self) -> Optional[int]:
    return self._store.latest_step()

  # -- save / restore -------------------------------------------------------------------------
  def _keys(self):
    return jnp.stack([jax.random.PRNGKey(s) for s in self._ident["seeds"]]).astype(jnp.uint32)

  def save(self, position: int, state, extra: Optional[dict] = None) -> None:
    """Saves `(state, position)` (and JSON `extra`) as step `position`; waits until verified.

    Raises:
      ValueError: the directory already holds a step >= `position` (nothing is overwritten).
      CheckpointError: the write failed or another process is writing the directory.
    """
    if self._ident is None:
      raise RuntimeError("call bind() before save()")
    meta = dict(self._ident, position=int(position), extra=extra or {})
    latest = self._store.latest_step()
    if latest is not None and int(position) <= latest:
      raise ValueError(f"{self.directory} already holds checkpoint step {latest} >= {position}: "
                       "pass --resume to continue that run, or choose another --workdir (nothing "
                       "was overwritten)")
    self._store.save(int(position), {"state": state, "keys": self._keys()}, meta)

  def read_meta(self, position: Optional[int] = None) -> dict:
    """The JSON metadata of a step (default: the latest). Raises CheckpointError if unreadable."""
    position = self.latest_position() if position is None else position
    if position is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    step_dir, data = self.directory / str(position), None
    if not step_dir.is_dir() or (step_dir / "meta").exists():
      try:
        data = self._store.read_meta(position)
      except CheckpointError as e:
        raise CheckpointError(f"checkpoint {step_dir} is unreadable (corrupted?): {e}. "
                              f"{_UNTOUCHED}.") from e
    if data is None or data.get("format") != FORMAT:
      raise CheckpointError(
          f"{step_dir} is not an ear_jax run checkpoint (no '{FORMAT}' metadata): it was "
          f"written by another program or is corrupted. {_UNTOUCHED}; use another --workdir or "
          "remove it.")
    return data

  def check_compatible(self, meta: dict) -> None:
    """ValueError naming every field in which `meta` differs from this run."""
    try:
      check_compatible(_flat_ident(meta), _flat_ident(self._ident),
                       f"checkpoint in {self.directory} (stored) and this run (expected)")
      if meta.get("leaves") != self._ident["leaves"]:
        stored = {p: (s, d) for p, s, d in meta.get("leaves") or []}
        check_compatible(stored, {p: (s, d) for p, s, d in self._ident["leaves"]},
                         f"array shapes of the checkpoint in {self.directory} and this run")
    except ValueError as e:
      raise ValueError(f"{e}. It was written by a different run and cannot be resumed here. "
                       f"{_UNTOUCHED}; use another --workdir, or the original settings.") from None

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
    try:
      tree, _ = self._store.restore(position, target=self._target)
    except (CheckpointError, ValueError) as e:
      raise CheckpointError(
          f"checkpoint step {position} in {self.directory} could not be restored (corrupted or "
          f"truncated): {e}. {_UNTOUCHED}; remove that step directory to fall back to an earlier "
          "one, or use another --workdir.") from e
    if not np.array_equal(np.asarray(tree["keys"]), np.asarray(self._keys())):
      raise ValueError(f"checkpoint in {self.directory} holds keys of other seeds")
    return tree["state"], int(meta["position"]), meta.get("extra", {})

  def close(self):
    self._store.close()


def save_adapter(directory, params, *, config: EARConfig, hparams: HParams, seeds: Sequence[int],
                 position: int, served: Optional[Sequence[bool]] = None) -> pathlib.Path:
  """Saves a finished run's final adapters (every seed) as one small verified checkpoint step.

  Only the `AdapterParams [S, ...]` are stored; a save replaces the previous one atomically, so a
  kill at any moment leaves one of the two. `position` is the run's stream length; `served` the
  `[S]` guard decisions (`guard_decisions`), required exactly with `config.guard`.

  Returns:
    The step directory written.

  Raises:
    ValueError: `served` missing, unexpected, or not one decision per seed.
    CheckpointError: the write or its verification failed (the previous adapter is kept).
  """
  meta = _identity(ADAPTER_FORMAT, config, hparams, seeds, params, position=int(position))
  if config.guard != (served is not None):
    raise ValueError(f"save_adapter({directory}): " + (
        "a guarded config needs the guard's decision per seed (served=...)" if config.guard else
        "served= is the guard's decision, and this config has no guard"))
  if served is not None:
    served = [bool(x) for x in np.asarray(served).reshape(-1)]
    if len(served) != len(meta["seeds"]):
      raise ValueError(f"save_adapter({directory}): {len(served)} guard decisions for "
                       f"{len(meta['seeds'])} seeds")
    meta["served"] = served
  with contextlib.closing(CheckpointStore(directory, max_to_keep=1)) as store:
    return store.save(max(store.steps(), default=-1) + 1, {"params": params}, meta)


def guard_decisions(states, config: EARConfig) -> np.ndarray:
  """`[S]` bool: whether each seed's guard serves its adapter (`states [S, ...]`)."""
  return np.asarray(jax.vmap(lambda st: guard_lib.serve_adapted(st.params, st.guard,
                                                                config))(states))


def _with_steps(dirs) -> list:
  return [p for p in dirs if any(c.is_dir() and c.name.isdigit() for c in p.iterdir())]


def find_run_dirs(workdir) -> list:
  """Run checkpoint directories under `workdir` (`checkpoints/<run>`, or `workdir` itself)."""
  workdir = pathlib.Path(workdir)
  return _with_steps(([workdir] if workdir.name != ADAPTER_DIR else []) + (
      sorted(p for p in (workdir / "checkpoints").iterdir() if p.is_dir())
      if (workdir / "checkpoints").is_dir() else []))


def find_adapter_dirs(workdir) -> list:
  """Final-adapter stores under `workdir` (`workdir/runs/<run>/adapter`, or `workdir` itself)."""
  workdir = pathlib.Path(workdir)
  cands = [workdir] if workdir.name == ADAPTER_DIR else []
  if (workdir / "runs").is_dir():
    cands += sorted(p / ADAPTER_DIR for p in (workdir / "runs").iterdir()
                    if (p / ADAPTER_DIR).is_dir())
  return _with_steps(cands)


def _run_name(path: pathlib.Path) -> str:
  return path.parent.name if path.name == ADAPTER_DIR else path.name


def _run_target(state, num_seeds: int) -> dict:
  """The abstract tree of a run step: the stacked state and the seeds' PRNG keys."""
  return {"state": state, "keys": jax.ShapeDtypeStruct((num_seeds, 2), jnp.uint32)}


def _stacked_state_target(config: EARConfig, num_seeds: int):
  """Abstract `[S, ...]` LearnerState of `config` (nothing is allocated)."""
  return jax.eval_shape(jax.vmap(lambda k: learner.init_learner(k, config)),
                        jax.ShapeDtypeStruct((num_seeds, 2), jnp.uint32))


def _stored_config(meta: dict, config: Optional[EARConfig], where) -> EARConfig:
  """The config of a step's `meta`; a ValueError naming the differences from `config` if given."""
  stored = EARConfig.from_dict(meta["config"])
  if config is not None and config != stored:
    check_compatible(stored.to_dict(), config.to_dict(),
                     f"config of the checkpoint in {where} (stored) and the requested one "
                     "(expected)")
  return stored


def _restore_final_adapter(directory: pathlib.Path, config: Optional[EARConfig]):
  """`(params [S, ...], config, meta)` from a `save_adapter` store."""
  with contextlib.closing(CheckpointStore(directory, max_to_keep=None)) as store:
    try:
      meta = store.read_meta()
    except CheckpointError as e:
      raise CheckpointError(f"adapter {directory} is unreadable (corrupted?): {e}") from e
    if meta.get("format") != ADAPTER_FORMAT:
      raise CheckpointError(f"{directory} is not an ear_jax run adapter (no '{ADAPTER_FORMAT}' "
                            "metadata): it was written by another program or is corrupted")
    stored = _stored_config(meta, config, directory)
    target = _stacked_state_target(stored, len(meta["seeds"])).params
    _check_leaves(target, meta, f"adapter in {directory}", stored)
    # As saved, then matched to the target by leaf name: retired fields' placeholders are dropped.
    tree, _ = store.restore()
  params = fit_target(target, tree["params"], f"the adapter in {directory}")
  return jax.tree_util.tree_map(jnp.asarray, params), stored, meta


def restore_adapter(workdir, *, run: Optional[str] = None, config: Optional[EARConfig] = None,
                    seed_index: Optional[int] = 0, position: Optional[int] = None,
                    guarded: bool = True):
  """Restores a trained adapter from a run's workdir (shapes checked before any array is read).

  Args:
    workdir: the `--workdir` of `experiments.run`, a run checkpoint or an adapter directory.
    run: the run name (e.g. 'ear'); needed when the workdir holds several runs.
    config: optional expected `EARConfig`; another config is a ValueError naming the differences.
    seed_index: which seed's adapter (`0..S-1`); None returns the stacked `[S, ...]` adapter.
    position: the step of a training checkpoint (`--checkpoint_every`); default the final adapter
      (`runs/<run>/adapter`).
    guarded: for a guarded config, what each seed's guard serves (what the test set was scored
      with); False: the trained adapter itself.

  Returns:
    `(params, config, meta)`; `meta["position"]` is the training queries seen, `meta["served"]`
    (with a guard) `[S]` the guard's decisions.

  Raises:
    FileNotFoundError: no adapter or checkpoint found (or none for `position`).
    ValueError: other config / shape, ambiguous run, or a guarded adapter without its decision.
    CheckpointError: unreadable or foreign checkpoint.
  """
  workdir = pathlib.Path(workdir)
  if not workdir.exists():
    raise FileNotFoundError(f"workdir {str(workdir)!r} does not exist")
  if run is not None:
    dirs = [workdir / "checkpoints" / run] if (workdir / "checkpoints" / run).is_dir() else []
    adapters = [p for p in find_adapter_dirs(workdir) if _run_name(p) == run]
  else:
    dirs, adapters = find_run_dirs(workdir), find_adapter_dirs(workdir)
  names = sorted({_run_name(p) for p in dirs + adapters})
  if not names:
    raise FileNotFoundError(f"no run adapter or checkpoint found under {str(workdir)!r}"
                            + (f" for run {run!r}" if run else ""))
  if len(names) > 1:
    raise ValueError(f"{str(workdir)!r} holds several runs ({', '.join(names)}); pass run=<name>")
  if position is None and adapters:
    params, stored, meta = _restore_final_adapter(adapters[0], config)
  else:
    if not dirs:
      raise FileNotFoundError(
          f"run {names[0]!r} in {str(workdir)!r} kept only its final adapter ({adapters[0]}), no "
          f"training checkpoint at position {position}: rerun it with --checkpoint_every=N")
    with contextlib.closing(RunCheckpointer(dirs[0])) as ckpt:
      meta = ckpt.read_meta(position)
      stored = _stored_config(meta, config, dirs[0])
      num_seeds = len(meta["seeds"])
      target = _run_target(_stacked_state_target(stored, num_seeds), num_seeds)
      _check_leaves(target, meta, f"checkpoint in {dirs[0]}", stored)
      ckpt._target = target  # pylint: disable=protected-access
      ckpt._ident = dict(meta)  # pylint: disable=protected-access
      state, _, _ = ckpt.restore(meta["position"])
    params = state.params
    if stored.guard:
      meta["served"] = guard_decisions(state, stored).tolist()
  if stored.guard and guarded:
    if "served" not in meta:
      raise ValueError(
          f"the adapter of run {names[0]!r} in {str(workdir)!r} has a guard but was saved "
          "without the guard's decision: pass guarded=False for the trained adapter itself, or "
          "rerun the method to store the decision")
    params = jax.vmap(lambda p, serve: guard_lib.choose_params(serve, p, stored))(
        params, np.asarray(meta["served"], bool))
  if seed_index is not None:
    if not 0 <= seed_index < len(meta["seeds"]):
      raise ValueError(f"seed_index={seed_index} out of range for {len(meta['seeds'])} seeds")
    params = jax.tree_util.tree_map(lambda x: x[seed_index], params)
  return params, stored, meta


__all__ = ["ADAPTER_DIR", "ADAPTER_FORMAT", "CheckpointError", "RunCheckpointer", "FORMAT",
           "find_adapter_dirs", "find_run_dirs", "guard_decisions", "restore_adapter",
           "save_adapter"]
