"""The files of a memory directory besides its table, through `ear_jax.io.checkpoints`.

    <dir>/rows.sqlite   the rows (`table.Table`): every add / update / delete durable on return
    <dir>/learner/      the learner item: ONE `CheckpointStore` step per `Memory.save`
    <dir>/ann/          optional faiss index state (index='faiss_*'), covering rows < meta `rows`
    <dir>/.owner        the owner lock (`own`)

The learner item (learner state, hyperparameters, queued items, open sessions; candidates as bank
rows) carries a verified JSON meta naming its table's identity. A save verifies the new step before
deleting the old one: a kill leaves one of them. `<dir>/ann` is removed by a delete of a row it
covers (a stale one at open).
"""
from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import shutil
import sys
import threading
from typing import Optional

import numpy as np

from ear_jax.io import checkpoints

FORMAT = 2
TABLE, LEARNER, ANN = "rows.sqlite", "learner", "ann"
OLD_SHARDS = "bank_shards"  # what a directory of the older (Orbax shards) layout holds


def checkpoint_dir(path) -> pathlib.Path:
  """The absolute memory directory of `path` (ValueError: empty, not a path, or a file)."""
  if not isinstance(path, (str, os.PathLike)):
    raise ValueError(f"memory path must be a str or os.PathLike, got {type(path).__name__}")
  if not str(os.fspath(path)).strip():
    raise ValueError("memory path is empty: pass a directory name (nothing is written into the "
                     "current directory)")
  root = pathlib.Path(path).expanduser().absolute()
  if root.exists() and not root.is_dir():
    raise ValueError(f"memory path {str(root)!r} exists and is not a directory")
  return root


def check_directory(root: pathlib.Path) -> None:
  """Refuses a non-empty directory holding no memory (`CheckpointFormatError`: old layout)."""
  names = {p.name for p in root.iterdir()} - {".owner"} if root.is_dir() else set()
  if not names or names & {TABLE, LEARNER}:
    return
  if OLD_SHARDS in names:
    raise checkpoints.CheckpointFormatError(
        f"{root} is a memory directory of an older layout (Orbax bank shards, before the SQLite "
        "rows), which this version does not read")
  raise ValueError(f"{root} is not a memory directory (it holds {sorted(names)[:5]}); use a new "
                   "or empty directory")


def _caller() -> str:
  """`file:line` of the innermost frame outside the ear_jax package, and the thread: who opens."""
  package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
    frame = frame.f_back
  where = "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"
  return f"{where} in thread {threading.current_thread().name!r}"


def own(root: pathlib.Path, how: str = "Memory.open"):
  """The owner lock (a `Hold`) of `root`, one `Memory` at a time; None: `root` is not writable.

  Raises:
    DirectoryInUseError: another process (naming its pid) or `Memory` (naming where) holds it.
  """
  try:
    return checkpoints.CheckpointStore(root).own("memory directory", f"{how} at {_caller()}")
  except OSError as e:  # (DirectoryInUseError is not one)
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
      return None
    raise


def claim_new(path) -> tuple[pathlib.Path, object]:
  """`(root, owner lock)` of `path` for a first `Memory.save`; ValueError when it holds a memory."""
  root = checkpoint_dir(path)
  check_directory(root)
  hold = own(root, "Memory.save")
  if read_meta(root) is not None or (root / TABLE).exists():
    if hold is not None:
      hold.release()
    raise ValueError(f"{str(root)!r} holds a memory already: Memory.open it, or save to another "
                     "directory")
  return root, hold


def write_learner(root: pathlib.Path, arrays, meta: dict) -> pathlib.Path:
  """Saves the learner item as the next step of `<root>/learner`; returns its directory."""
  store = checkpoints.CheckpointStore(root / LEARNER, max_to_keep=1)
  return store.save(max(store.steps(), default=0) + 1, arrays, {**meta, "format": FORMAT})


def _learner_meta(store, step: int, meta: dict) -> dict:
  if meta.get("format") != FORMAT:
    raise checkpoints.CheckpointFormatError(
        f"{store.meta_file(step)}: field 'format' is {meta.get('format')!r}, not a learner item "
        f"this version reads ({FORMAT})")
  return meta


def read_meta(root: pathlib.Path) -> Optional[dict]:
  """The verified meta of the latest learner item of `root` (None: there is none)."""
  store = checkpoints.CheckpointStore(root / LEARNER)
  step = store.latest_step()
  return None if step is None else _learner_meta(store, step, store.read_meta(step))


def remove_ann(root: pathlib.Path, only_trash: bool = False) -> None:
  """Removes `<root>/ann`, renamed away first (every open deletes `.ann-trash-*` leftovers)."""
  if not only_trash:
    with contextlib.suppress(FileNotFoundError):
      os.rename(root / ANN, root / f".{ANN}-trash-{os.getpid()}")
  for p in root.glob(f".{ANN}-trash-*"):
    shutil.rmtree(p, ignore_errors=True)


def read_learner_of(root: pathlib.Path, table_identity: str, next_row: int
                    ) -> tuple[dict, dict, str]:
  """`(arrays, meta, where)` of the latest learner item of `root`, verified, of the table with
  `table_identity` ending at `next_row`.

  Raises:
    CheckpointError: none there, a corrupted one (`CheckpointFormatError`: another format), or
      one of another table or naming rows it lacks (naming the files).
  """
  store = checkpoints.CheckpointStore(root / LEARNER)
  step = store.latest_step()
  if step is None:
    raise checkpoints.CheckpointError(f"{root}: no learner item in {root / LEARNER}")
  arrays, meta = store.restore(step)
  meta = _learner_meta(store, step, meta)
  where = f"the learner item {root / LEARNER} (step {step})"
  table = meta.get("table")  # (None: an item saved before tables had an identity)
  if table is not None and table != table_identity:
    raise checkpoints.CheckpointError(
        f"{where} belongs to the table with identity {table}, not to {root / TABLE} (identity "
        f"{table_identity}): a learner item of another memory directory (copied here?) is never "
        "used")
  if int(meta["rows"]) > next_row:
    raise checkpoints.CheckpointError(
        f"{where} was saved when the table held rows up to {meta['rows']}, but the table "
        f"{root / TABLE} ends at row {next_row}: they are not one memory's (a table replaced by "
        "an older copy?)")
  driver, sessions = arrays.get("driver", {}), arrays.get("sessions", {})
  for name, rows in (("driver/buffer_rows", driver.get("buffer_rows")),
                     ("driver/holdout_rows", driver.get("holdout_rows")),
                     ("driver/ready/rows", driver.get("ready", {}).get("rows")),
                     ("sessions/cand_idx", sessions.get("cand_idx"))):
    rows = np.asarray([] if rows is None else rows)
    bad = rows[(rows < -1) | (rows >= int(meta["rows"]))]
    if bad.size:
      raise checkpoints.CheckpointError(
          f"{where}: {name} names row {int(bad[0])}, outside the {meta['rows']} rows it was "
          "saved with (corrupted, or another memory's)")
  return arrays, meta, where
