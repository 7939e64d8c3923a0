"""`CheckpointStore`: atomic, verified, locked Orbax checkpoints of (arrays, JSON meta).

The one checkpoint mechanism of ear_jax (`RunCheckpointer`, `Memory`). One Orbax step per
subdirectory, each of two items: `state` (the array pytree; its custom metadata records every
leaf's path, shape, dtype and SHA-256) and `meta` (the caller's JSON dict). A SHA-256 of meta and
leaf record is written into both, so any changed value is a `CheckpointError` naming the file.

Guarantees:
  * Atomic: a step is written under a temporary name and renamed when complete, so a save killed
    at any moment (even SIGKILL) leaves the latest complete step.
  * Verified before cleanup: the new step is read back before older steps are deleted.
  * Serialised: a save holds an exclusive `fcntl.flock` on `<directory>/.lock`.
  * Owned (opt-in): `own` takes an owner lock, one holder in one process, dropped when it dies.
  * Clear errors: a bad checkpoint is a `CheckpointError` naming the path; a read never deletes or
    rewrites anything.
  * No growth: reads never open an array for its metadata (tensorstore leaks what that returns).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import time
from typing import Optional

import numpy as np

from ear_jax.io import _leaves, _quiet
from ear_jax.io._lock import DirLock, HeldHere, Hold, LockTimeout, hold

_STATE, _META = "state", "meta"
_META_FILE = "metadata"  # the file name of Orbax's JsonCheckpointHandler
_TMP_MARK = ".orbax-checkpoint-tmp"
_TRASH = ".trash-"
_RECORD = "ear_jax.io/leaves-1"  # key of the leaf record in the `state` item's custom metadata
_DIGEST = "ear_jax.io/sha256"  # key of the meta + record digest (custom metadata and meta file)
_CUSTOM_KEYS = (_RECORD, _DIGEST)  # the custom metadata fields this version reads
_ORBAX_METADATA = "_METADATA"  # Orbax's array metadata file (it holds the custom metadata)
OWNER_LOCK = ".owner"  # the lock of `CheckpointStore.own`


class _Missing:
  def __repr__(self):
    return "<missing>"


_MISSING = _Missing()


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be read or written: corrupted, foreign, missing or locked."""


class CheckpointFormatError(CheckpointError, ValueError):
  """A checkpoint of another or unknown format, layout or version; also a `ValueError`."""


class DirectoryInUseError(CheckpointError, ValueError):
  """A directory another process owns (`CheckpointStore.own`); also a `ValueError`."""


def check_compatible(stored: dict, expected: dict, what: str) -> None:
  """Raises a ValueError listing every key that differs; `what` is its subject ("checkpoint x")."""
  keys = sorted(set(stored) | set(expected), key=str)
  diffs = [f"{k}: stored={stored.get(k, _MISSING)!r} vs expected={expected.get(k, _MISSING)!r}"
           for k in keys if stored.get(k, _MISSING) != expected.get(k, _MISSING)]
  if diffs:
    raise ValueError(f"{what} differs in {len(diffs)} field(s): " + "; ".join(diffs))


def _ocp():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  _quiet.install()
  return ocp


def _this_process_only() -> dict:
  """Orbax keyword arguments that keep a save / restore inside the calling process (no barriers)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() == 1:
    return {}
  me = jax.process_index()
  return {"multiprocessing_options": _ocp().options.MultiprocessingOptions(
      primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"ear_jax_p{me}")}


def _canonical(obj) -> str:
  return json.dumps(obj, sort_keys=True)


def _meta_digest(meta: dict, record) -> str:
  """SHA-256 of the canonical JSON of a step's meta dict and leaf record."""
  return hashlib.sha256(_canonical({"meta": meta, "leaves": record}).encode("utf-8")).hexdigest()


def _zeros_target(tree: Optional[dict], record: dict):
  """The as-saved restore target from Orbax's tree metadata, numpy zeros of each recorded shape
  (so Orbax never opens an array for its metadata); None when unreadable."""
  empty = {"None": None, "Dict": {}, "List": []}
  root, kinds = {}, {1: list, 2: dict}
  try:
    for entry in tree.values():
      keys = [(int(k["key"]) if k["key_type"] == 1 else k["key"], kinds[k["key_type"]])
              for k in entry["key_metadata"]]
      name = "/".join(str(k) for k, _ in keys)
      kind = entry["value_metadata"]["value_type"]
      if name in record and kind == "np.ndarray":  # (a jax.Array leaf: Orbax's own reading)
        rec = record[name]
        leaf = np.zeros(() if rec["empty"] else rec["shape"], rec["dtype"])
      else:
        leaf = empty[kind]
      node = root
      for (key, kind), (_, child) in zip(keys, keys[1:] + [(None, None)]):
        if not isinstance(node, kind):
          return None
        if kind is list:
          node.extend([None] * (key + 1 - len(node)))
        if child is None:
          node[key] = leaf
        else:
          if node[key] is None if kind is list else key not in node:
            node[key] = child()
          node = node[key]
  except (AttributeError, KeyError, TypeError, ValueError):
    return None
  return root


# -- the store -------------------------------------------------------------------------------
class CheckpointStore:
  """Atomic Orbax checkpoints of (array pytree, JSON meta), one subdirectory per step.

  Args:
    directory: the store's directory (made absolute; created by the first save).
    max_to_keep: how many of the newest steps a save keeps (None: all).
    lock_timeout_s: how long a save waits for another process's save to the same directory.
  """

  def __init__(self, directory, *, max_to_keep: int | None = 3, lock_timeout_s: float = 60.0):
    if max_to_keep is not None and (isinstance(max_to_keep, bool) or int(max_to_keep) < 1):
      raise ValueError(f"max_to_keep must be None or >= 1, got {max_to_keep!r}")
    self.directory = pathlib.Path(directory).expanduser().absolute()
    self.max_to_keep = None if max_to_keep is None else int(max_to_keep)
    self.lock_timeout_s = float(lock_timeout_s)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self) -> None:
    """Releases resources (every Orbax object is closed after each call)."""

  def __repr__(self):
    return f"CheckpointStore({str(self.directory)!r}, max_to_keep={self.max_to_keep})"

  # -- listing --------------------------------------------------------------------------------
  def steps(self) -> list[int]:
    """The complete steps on disk, ascending."""
    try:
      entries = list(os.scandir(self.directory))
    except (FileNotFoundError, NotADirectoryError):
      return []
    return sorted(int(e.name) for e in entries
                  if e.name.isascii() and e.name.isdigit() and str(int(e.name)) == e.name
                  and e.is_dir())

  def latest_step(self) -> int | None:
    return max(self.steps(), default=None)

  def _step_dir(self, step: int | None) -> pathlib.Path:
    if step is None:
      step = self.latest_step()
      if step is None:
        raise CheckpointError(f"no checkpoint in {self.directory}")
    path = self.directory / str(int(step))
    if not path.is_dir():
      raise CheckpointError(f"checkpoint step {step} not found: no directory {path} (steps on "
                            f"disk: {self.steps()})")
    return path

  def _latest_retry(self, fn, step):
    """fn(step dir); with step=None, retries if a concurrent save removed that step meanwhile."""
    for attempt in range(3):
      path = self._step_dir(step)
      try:
        return fn(path)
      except CheckpointError:
        if step is not None or path.is_dir() or attempt == 2:
          raise

  # -- reading --------------------------------------------------------------------------------
  def read_meta(self, step: int | None = None) -> dict:
    """The JSON meta of `step` (default: the latest), checked against its digest.

    Raises:
      CheckpointError: no such step, or its meta file is missing, corrupted or does not match its
        digest; the message names the file.
    """
    return self._latest_retry(self._read_meta_at, step)

  def meta_file(self, step: int) -> pathlib.Path:
    """The path of `step`'s meta file (what error messages about a meta field name)."""
    return self.directory / str(int(step)) / _META / _META_FILE

  def _read_meta_at(self, path: pathlib.Path) -> dict:
    raw = self._read_meta_file(path)
    state_dir = path / _STATE
    if _DIGEST not in raw and not state_dir.is_dir():
      return raw  # written before digests, without arrays: nothing to check against
    custom, _ = self._read_array_metadata(path, state_dir, shapes=False)
    return self._checked_meta(path, raw, custom)

  @staticmethod
  def _read_meta_file(path: pathlib.Path) -> dict:
    """The meta file's JSON object as written (digest key included), unverified."""
    file = path / _META / _META_FILE
    try:
      text = file.read_text(encoding="utf-8")
    except FileNotFoundError as e:
      raise CheckpointError(f"checkpoint {path} has no meta file {file}: it was not written by "
                            "ear_jax.io or is incomplete") from e
    except (OSError, UnicodeDecodeError) as e:
      raise CheckpointError(f"meta file {file} is unreadable: {e}") from e
    try:
      data = json.loads(text)
    except ValueError as e:
      raise CheckpointError(f"meta file {file} is truncated or corrupted (invalid JSON: {e})") from e
    if not isinstance(data, dict):
      raise CheckpointError(f"meta file {file} holds a {type(data).__name__}, not a JSON object")
    return data

  @staticmethod
  def _checked_meta(path: pathlib.Path, raw: dict, custom: dict) -> dict:
    """`raw` without its digest, checked against both copies of the digest (none: an older step)."""
    meta = {k: v for k, v in raw.items() if k != _DIGEST}
    in_file, in_custom = raw.get(_DIGEST), custom.get(_DIGEST)
    if in_file is None and in_custom is None:
      return meta
    file = path / _META / _META_FILE
    if in_file != in_custom:
      raise CheckpointError(
          f"meta file {file} and the array metadata {path / _STATE / _ORBAX_METADATA} hold "
          f"different digests (field {_DIGEST!r}): the checkpoint is corrupted")
    if _meta_digest(meta, custom.get(_RECORD)) != in_custom:
      raise CheckpointError(
          f"meta file {file} (or the leaf record in {path / _STATE / _ORBAX_METADATA}) does not "
          "match the SHA-256 recorded at save time: the checkpoint's metadata is corrupted or was "
          "edited")
    return meta

  def _read_array_metadata(self, path: pathlib.Path, state_dir: pathlib.Path,
                           shapes: bool = True):
    """`(custom metadata, {leaf: (shape, dtype)})` of a step's array item (`shapes` False: `(custom,
    tree)` from Orbax's metadata file alone); CheckpointError naming the file."""
    if not state_dir.is_dir():
      raise CheckpointError(f"checkpoint {path} has no array directory {state_dir}")
    read = self._array_metadata if shapes else self._metadata_file
    found, failure = _quiet.call(lambda: read(state_dir), state_dir)
    if failure:
      raise CheckpointError(f"checkpoint {path}: the array metadata in {state_dir} is unreadable "
                            f"(truncated or corrupted?): {failure}")
    custom, shapes = found
    if not isinstance(custom, dict):
      raise CheckpointError(f"checkpoint {path}: the custom metadata in "
                            f"{state_dir / _ORBAX_METADATA} is a {type(custom).__name__}, not a "
                            "JSON object (corrupted?)")
    unknown = sorted(set(custom) - set(_CUSTOM_KEYS), key=str)
    if unknown:
      raise CheckpointFormatError(
          f"checkpoint {path}: the array metadata {state_dir / _ORBAX_METADATA} holds unknown "
          f"field(s) {unknown} (written by a newer ear_jax, or corrupted); this version reads "
          f"{list(_CUSTOM_KEYS)}")
    return custom, shapes

  @staticmethod
  def _array_metadata(state_dir: pathlib.Path) -> tuple[dict, dict]:
    """(custom metadata, {leaf: (shape, dtype)}) through Orbax, which opens every array."""
    ocp = _ocp()
    with contextlib.closing(ocp.StandardCheckpointHandler(**_this_process_only())) as handler:
      md = handler.metadata(state_dir)
    custom = md.custom_metadata
    return ({} if custom is None else custom), _leaves.metadata_shapes(md.tree)

  @staticmethod
  def _metadata_file(state_dir: pathlib.Path) -> tuple[dict, Optional[dict]]:
    """(custom metadata, Orbax's tree metadata or None) from Orbax's JSON metadata file alone."""
    found = json.loads((state_dir / _ORBAX_METADATA).read_text(encoding="utf-8"))
    if not isinstance(found, dict):
      raise ValueError(f"{_ORBAX_METADATA} holds a {type(found).__name__}, not a JSON object")
    custom, tree = found.get("custom_metadata"), found.get("tree_metadata")
    return ({} if custom is None else custom), (tree if isinstance(tree, dict) else None)

  def restore(self, step: int | None = None, target=None):
    """`(arrays, meta)` of `step` (default: the latest).

    `target`: an abstract pytree (`jax.ShapeDtypeStruct` leaves, or arrays) whose structure, shapes,
    dtypes and shardings the arrays come back in; None restores the tree as saved.

    Raises:
      CheckpointError: no such step, or its files are missing or corrupted (every leaf is checked
        against its save-time SHA-256); the message names the directory.
      ValueError: `target` does not match the stored arrays (the leaves that differ are listed).
    """
    return self._latest_retry(lambda path: self._restore_at(path, target), step)

  def _restore_at(self, path: pathlib.Path, target):
    raw = self._read_meta_file(path)
    state_dir = path / _STATE
    ocp = _ocp()
    custom, tree = self._read_array_metadata(path, state_dir, shapes=False)
    meta = self._checked_meta(path, raw, custom)
    record = custom.get(_RECORD)
    if record is not None and target is not None:
      target = _leaves.restore_target(target, record)  # ValueError before any array is read
    elif record is not None:  # (as saved: Orbax would open every array for its metadata)
      target = _zeros_target(tree, record)

    def read():
      with contextlib.closing(ocp.Checkpointer(
          ocp.StandardCheckpointHandler(**_this_process_only()), **_this_process_only())) as ckptr:
        return ckptr.restore(state_dir, args=ocp.args.StandardRestore(target))

    arrays, failure = _quiet.call(read, state_dir)
    if failure:
      raise CheckpointError(f"checkpoint {path}: the arrays in {state_dir} could not be restored "
                            f"(truncated or corrupted?): {failure}")
    if record is not None:
      arrays, bad = _leaves.check_restored(arrays, record)
      if bad:
        raise CheckpointError(
            f"checkpoint {path} is corrupted (its array data does not match what was saved): "
            + "; ".join(bad[:5]) + ("; ..." if len(bad) > 5 else ""))
    return arrays, meta

  # -- writing --------------------------------------------------------------------------------
  def save(self, step: int, arrays, meta: dict) -> pathlib.Path:
    """Saves `(arrays, meta)` as `step`, verifies it, then drops steps beyond `max_to_keep`.

    `step` must exceed every step on disk; `arrays` is a pytree of numeric arrays, `meta` a
    JSON-serialisable dict. Returns the new step's directory.

    Raises:
      ValueError: bad step, arrays or meta; nothing was written.
      CheckpointError: the lock was not had within `lock_timeout_s`, or the write or its
        verification failed (the older steps are kept).
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"step must be a non-negative int, got {step!r}")
    step = int(step)
    if not isinstance(meta, dict):
      raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
    try:
      expected_meta = json.loads(json.dumps(meta, allow_nan=True))
    except (TypeError, ValueError) as e:
      raise ValueError(f"meta is not JSON-serialisable: {e}") from e
    if _DIGEST in expected_meta:
      raise ValueError(f"meta key {_DIGEST!r} is reserved for the checkpoint's digest")
    tree, record = _leaves.prepare(arrays)
    digest = _meta_digest(expected_meta, record)
    self._make_directory()
    with self._locked():
      self._remove_debris()
      latest = self.latest_step()
      if latest is not None and step <= latest:
        raise ValueError(f"step {step} is not a new step: {self.directory} already holds step "
                         f"{latest} (a save needs a larger step)")
      self._write(step, tree, {_RECORD: record, _DIGEST: digest},
                  {**expected_meta, _DIGEST: digest})
      path = self.directory / str(step)
      try:
        self._verify(path, record, expected_meta)
      except CheckpointError:
        self._remove(path)
        raise
      self._prune()
    return path

  def own(self, what: str = "directory", holder: str = "") -> Hold:
    """This caller's exclusive owner lock of the directory, held until the `Hold` is released.

    One holder in one process; the kernel drops it when the process dies. Independent of the save
    lock: every writer must take it (`Memory` does). `what` / `holder` name the directory's kind /
    the taker in errors.

    Raises:
      DirectoryInUseError: another process owns it (naming its pid), or this process does (naming
        the first `holder`).
      CheckpointError: the directory cannot be created.
    """
    self._make_directory()
    try:
      return hold(self.directory, OWNER_LOCK, holder)
    except HeldHere as e:
      raise DirectoryInUseError(f"{what} {e}: one holder per directory per process (close that "
                                "one first, or share it)") from None
    except LockTimeout as e:
      raise DirectoryInUseError(f"{what} {e}: only one process may use it at a time (stop that "
                                "one first, or use another directory)") from None

  def _make_directory(self) -> None:
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise CheckpointError(f"cannot create checkpoint directory {self.directory}: {e}") from e

  @contextlib.contextmanager
  def _locked(self):
    lock = DirLock(self.directory, self.lock_timeout_s)
    try:
      lock.acquire()
    except LockTimeout as e:
      raise CheckpointError(f"checkpoint directory {e}. Nothing was written; retry when that "
                            "process has finished.") from None
    try:
      yield
    finally:
      lock.release()

  def _write(self, step: int, tree, custom: dict, meta: dict) -> None:
    ocp = _ocp()

    def write():
      manager = ocp.CheckpointManager(
          self.directory,
          options=ocp.CheckpointManagerOptions(
              # `save` created the directory (Orbax refuses `create` with one active process).
              max_to_keep=None, create=not _this_process_only(), enable_async_checkpointing=False,
              cleanup_tmp_directories=False, save_root_metadata=False,
              lightweight_initialize=True, **_this_process_only()),
          item_names=(_STATE, _META))
      with contextlib.closing(manager):
        manager.save(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(tree, custom_metadata=custom),
            _META: ocp.args.JsonSave(meta)}), force=True)
        manager.wait_until_finished()

    _, failure = _quiet.call(write, self.directory / str(step))
    if failure:
      self._remove_debris()
      raise CheckpointError(f"saving step {step} to {self.directory} failed: {failure}. The older "
                            "steps were kept.")
    if not (self.directory / str(step)).is_dir():
      raise CheckpointError(f"saving step {step} to {self.directory} wrote no step directory")

  def _verify(self, path: pathlib.Path, record: dict, expected_meta: dict) -> None:
    """Reads the new step's meta and array metadata back and compares them with what was saved."""
    try:
      custom, shapes = self._read_array_metadata(path, path / _STATE)
      meta = self._checked_meta(path, self._read_meta_file(path), custom)
    except CheckpointError as e:
      raise CheckpointError(f"verification of {path} failed: {e}") from e
    if _canonical(meta) != _canonical(expected_meta) or _DIGEST not in custom:
      raise CheckpointError(f"verification of {path} failed: its meta reads back differently")
    if custom.get(_RECORD) != record or shapes != _leaves.stored_shapes(record):
      raise CheckpointError(f"verification of {path} failed: its array metadata reads back "
                            "differently from what was saved")

  def _prune(self) -> None:
    if self.max_to_keep is None:
      return
    for step in self.steps()[:-self.max_to_keep]:
      self._remove(self.directory / str(step))

  def _remove(self, path: pathlib.Path) -> None:
    """Renames `path` out of the step namespace (atomic for readers), then deletes it."""
    trash = self.directory / f"{_TRASH}{path.name}-{os.getpid()}-{time.time_ns()}"
    try:
      os.rename(path, trash)
    except FileNotFoundError:
      return
    shutil.rmtree(trash, ignore_errors=True)

  def _remove_debris(self) -> None:
    """Removes temporaries of killed or failed saves (only called while holding the lock)."""
    try:
      entries = list(os.scandir(self.directory))
    except FileNotFoundError:
      return
    for e in entries:
      if (_TMP_MARK in e.name or e.name.startswith(_TRASH)) and e.is_dir(follow_symlinks=False):
        shutil.rmtree(e.path, ignore_errors=True)


fit_target = _leaves.fit_target  # a restored subtree in an abstract target's structure, by name

__all__ = ["CheckpointError", "CheckpointFormatError", "CheckpointStore", "DirectoryInUseError",
           "check_compatible", "fit_target"]
