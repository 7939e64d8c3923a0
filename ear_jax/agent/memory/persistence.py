"""Checkpoints of `Memory`, through the shared checkpoint mechanism `ear_jax.io.checkpoints`.

A memory directory is a `CheckpointStore`: numbered steps (1, 2, ...), each holding the arrays
(learner state, hyperparameters, sessions, queued training items) and one JSON meta dict (format
tag, config, encoder, bank settings, sessions, counters, stats, and the list of bank shards). The
store writes atomically under an inter-process lock and verifies a new step before it deletes older
ones (it keeps the last few), so a save killed at any moment leaves the previous checkpoint
loadable.

The bank is append-only, so it is saved as shards: `<directory>/bank_shards/` is a second
`CheckpointStore` whose steps each hold a contiguous run of bank rows (embeddings, stores, scope
codes with the shard's scope names, ids, texts, dates: `Bank.rows`); a shard step is never
modified. Shards written before scopes (no scope codes, names or dates) load in `DEFAULT_SCOPE`
with date "" (`Bank.extend_rows`; their digest is the older one, `bank.shard_digest`). A save writes at most ONE new shard with the rows added
since the latest checkpoint (recognised by the SHA-256 of each listed shard's rows, cached in the
bank), then the main step that lists every shard. Saving after adding 1,000 memories to a 1M bank
therefore writes 1,000 rows plus the learner state, not the bank.

Compaction keeps loading as fast after 200 saves as after one: every listed shard holds more rows
than all later shards together (`_compaction_start`); when the new rows break that, the tail of
small shards is merged with them into the one shard the save writes (its rows copied from the bank
in memory). At most log2(n) + 1 shards are listed, and a row is rewritten at most log2(n) times in
all, so a save writes, amortised, O(log n) rows per row added: usually just the new rows, sometimes
the last few small shards too; a large shard is rewritten only once the rows after it outgrow it.

An ANN searcher (`index=...`) is saved as itself in `<directory>/ann_index/` (faiss's own
serialisation, `ann.FaissSearcher.state`, verified like every array), so a loaded memory retrieves
exactly what it retrieved before, whatever the save and add boundaries; a save writes it only when
rows were added since the index the latest checkpoint lists (O(index bytes) then).

The main step does not repeat what the bank holds: the replay buffer's candidates and the sessions'
candidates (`[C, K, d]` and `[sessions, K, d]`, the bulk of the learner's state) are saved as their
bank rows and gathered back from the restored bank (`Bank.gather`), bit for bit.

Atomicity: shards and indexes are complete before the main step that lists them exists; a save
killed before its main step leaves unlisted ones that the next save deletes; they are deleted only
when no kept main step lists them (so a killed compacting save leaves the previous checkpoint with
all its shards). One memory save at a time per directory (`CheckpointStore.writer`, an
inter-process lock), and one process at a time uses a memory directory (`own`: `Memory.load`,
`restore`, `save` and `claim` take its owner lock; a second process is refused naming the first).
A load finishes what a killed save left undone once the checkpoint it read is verified (`tidy`:
the older steps a deletion purges, shards and indexes no kept step lists, `.trash-*`
directories), so a memory that only loads and recalls keeps no byte of a deleted memory either.
Checkpoints written with the bank inline (before shards), or before indexes were saved (the index
is then rebuilt by adding the rows), still load.

The first stage (`Memory(candidates=...)`, meta field `first_stage`: the generator and the hybrid
fusion's options; absent in older checkpoints, which load as 'dense') is saved in the verified
meta; its BM25 index is not saved but rebuilt from the bank's texts (verified by the shards'
digests) at the first search after `load` / `restore` (`ear_jax.agent.memory.lexical_bank`), so it has
the bank's guarantees and nothing more to tamper with.

A checkpoint of another format or config is refused with the differing fields
(`checkpoints.check_compatible`); a truncated or corrupted one (the meta JSON included: the store
verifies it against its digest) raises `checkpoints.CheckpointError` naming the path; an unknown
format, bank layout, bank dtype or index is a `checkpoints.CheckpointFormatError` naming the meta
file and the field.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import os
import pathlib
from typing import Any, Optional

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import forget
from ear_jax.agent.memory import lexical_bank
from ear_jax.agent.memory.bank import Bank
from ear_jax.agent.memory.encoder_slot import EncoderSlot
from ear_jax.agent.memory.driver import Driver
from ear_jax.agent.memory.sessions import Sessions
from ear_jax.core.config import EARConfig
from ear_jax.index import ann

FORMAT = "ear_jax.agent.memory/2"
BANK_LAYOUT = "shards-1"  # meta["bank"]["layout"] of a checkpoint with the bank in shards
SHARDS = "bank_shards"
ANN_INDEX = "ann_index"  # the store of saved ANN searchers (meta["bank"]["ann_index"] lists one)


def _checkpoints():
  from ear_jax.io import checkpoints  # pylint: disable=g-import-not-at-top
  return checkpoints


def checkpoint_dir(path) -> pathlib.Path:
  """The absolute checkpoint directory of `path`.

  Raises:
    ValueError: `path` is empty (never write into the working directory by accident), not a path,
      or an existing non-directory.
  """
  if not isinstance(path, (str, os.PathLike)):
    raise ValueError(f"checkpoint path must be a str or os.PathLike, got {type(path).__name__}")
  if not str(os.fspath(path)).strip():
    raise ValueError("checkpoint path is empty: pass a directory name (nothing is written into the "
                     "current directory)")
  root = pathlib.Path(path).expanduser().absolute()
  if root.exists() and not root.is_dir():
    raise ValueError(f"checkpoint path {str(root)!r} exists and is not a directory")
  return root


def write(root: pathlib.Path, arrays, meta: dict) -> pathlib.Path:
  """Saves `(arrays, meta)` as the next step of the store at `root`; returns the step's path."""
  ckpt = _checkpoints()
  with ckpt.CheckpointStore(root) as store:
    for attempt in range(3):  # another process may take the next step between the two calls
      latest = store.latest_step()
      try:
        return store.save(1 if latest is None else latest + 1, arrays, {**meta, "format": FORMAT})
      except ValueError as e:
        if "is not a new step" not in str(e) or attempt == 2:
          raise


def _listed(store) -> tuple[list[dict], Optional[dict]]:
  """`(shard records, ANN index record or None)` of the latest main step of `store` (nothing when
  none can be reused)."""
  try:
    meta = store.read_meta(verify=False)  # what is reused is checked against the bank
  except Exception:  # pylint: disable=broad-except  (no step, or an unreadable one: write afresh)
    return [], None
  bank = meta.get("bank") if meta.get("format") == FORMAT else None
  if not isinstance(bank, dict) or bank.get("layout") != BANK_LAYOUT:
    return [], None
  index = bank.get("ann_index")
  return list(bank.get("shards", [])), (index if isinstance(index, dict) else None)


def _compaction_start(counts: list[int]) -> int:
  """Where the shards to merge start: the smallest `i` with `counts[i] <= sum(counts[i+1:])`, or
  `len(counts)` when every shard holds more rows than all later ones together.

  Merging `counts[i:]` into one shard restores that invariant (every earlier shard was larger than
  all later rows, the new ones included), under which a bank of n rows has at most log2(n) + 1
  shards; a row is rewritten only into a shard at least twice the size of the one it was in, so at
  most log2(n) times.

  Args:
    counts: the row counts of the shards, oldest first (the one a save adds last).
  """
  start, later = len(counts), 0
  for i in range(len(counts) - 1, -1, -1):
    if counts[i] <= later:
      start = i
    later += counts[i]
  return start


def _reusable(bank: Bank, records: list[dict]) -> list[dict]:
  """The leading shard records whose rows are this bank's rows (call under the memory's lock)."""
  out, covered = [], 0
  for r in records:
    start, count = int(r["start"]), int(r["count"])
    if start != covered or start + count > len(bank) or bank.digest(start, start + count) != (
        r["digest"]):
      break
    out.append(r)
    covered += count
  return out


def _prune(store, shards, indexes) -> None:
  """Deletes shards and saved ANN indexes that no kept main step lists and that are older than the
  newest listed one (compacted, replaced, or left by killed saves; all of them when none is
  listed). Called under the store's writer lock, after the new main step was written."""
  listed_shards, listed_indexes = set(), set()
  for step in store.steps():
    try:
      bank = store.read_meta(step, verify=False).get("bank", {})
      listed_shards.update(int(r["step"]) for r in bank.get("shards", []))
      if bank.get("ann_index"):
        listed_indexes.add(int(bank["ann_index"]["step"]))
    except Exception:  # pylint: disable=broad-except  (unreadable step: keep everything)
      return
  for sub, listed in ((shards, listed_shards), (indexes, listed_indexes)):
    newest = max(listed) if listed else float("inf")
    for step in sub.steps():
      if step not in listed and step < newest:
        sub.delete(step)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """The latest main step of a memory directory, as `read` found it.

  Attributes:
    arrays, meta: the step's arrays (as saved) and verified meta.
    where: "checkpoint '<root>' (step N)", for messages.
    root: the memory directory.
    meta_file: the step's meta file, for messages naming a field.
  """
  arrays: dict
  meta: dict
  where: str
  root: pathlib.Path
  meta_file: pathlib.Path


def read(path) -> Checkpoint:
  """The latest memory checkpoint at `path`.

  Raises:
    ValueError: no checkpoint there.
    CheckpointFormatError: one of another format (naming the meta file, with the differing field).
    CheckpointError: a truncated, unreadable or corrupted checkpoint (naming the path).
  """
  ckpt = _checkpoints()
  root = checkpoint_dir(path)
  if not root.is_dir():
    raise ValueError(f"no ear_jax Memory checkpoint at {str(root)!r}: no such directory")
  with ckpt.CheckpointStore(root) as store:
    step = store.latest_step()
    if step is None:
      raise ValueError(f"no ear_jax Memory checkpoint at {str(root)!r}: the directory holds no "
                       "checkpoint step")
    where = f"checkpoint {str(root)!r} (step {step})"
    meta_file = store.meta_file(step)
    meta = store.read_meta(step)
    try:
      ckpt.check_compatible({k: meta[k] for k in ("format",) if k in meta}, {"format": FORMAT},
                            where)
    except ValueError as e:
      raise ckpt.CheckpointFormatError(f"{e} (field 'format' of {meta_file}: not a Memory "
                                       "checkpoint this version reads)") from None
    arrays, meta = store.restore(step)
  return Checkpoint(arrays=arrays, meta=meta, where=where, root=root, meta_file=meta_file)


def check_config(stored: dict, expected: EARConfig, where: str) -> None:
  """ValueError listing the fields where the checkpoint's config differs from `expected`."""
  _checkpoints().check_compatible(stored, expected.to_dict(), f"the config of {where}")


@dataclasses.dataclass
class Parts:
  """A memory's state as a checkpoint holds it: what `Memory` hands to `Writer.snapshot` and
  installs from `restore_parts` (persistence never reads `Memory` itself).

  Attributes:
    bank: the `Bank` (ids, texts, embeddings; an ANN searcher).
    sessions: the open `Sessions`.
    driver: the learner `Driver` (state, hyperparameters, queued items).
    settings: JSON settings: config (dict), seed, multistore, max_sessions, cache_dir, stats,
      encoder (`EncoderSlot.meta`) and first_stage (`lexical_bank.options_meta`).
  """
  bank: Bank
  sessions: Sessions
  driver: Driver
  settings: dict


def main_step(parts: Parts):
  """`(arrays, meta)` of the main step of `parts` except the bank's listing (host copies; call
  under the memory's lock). Arrays: `sessions` (their stacked arrays), `driver` (the named learner
  state, hyperparameters, queued items); empty parts are left out. Meta: the settings and each
  part's JSON meta under its name."""
  got = {"sessions": parts.sessions.snapshot(), "driver": parts.driver.snapshot()}
  arrays = {name: a for name, (a, _) in got.items() if a}
  return arrays, {**parts.settings, **{name: m for name, (_, m) in got.items()}}


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """A memory at one moment, everything a save writes (taken under the memory's lock by
  `Writer.snapshot`, written outside it by `Writer.write`).

  Attributes:
    arrays, meta: the main step (`main_step`) without the bank's listing.
    records: the listed shards this save keeps.
    start, stop: the bank rows `[start, stop)` of the one shard this save writes (none if equal).
    new_rows: `Bank.rows(start, stop)` (host copies) or None.
    digest: their digest or None.
    index_state: the ANN searcher's state to write (`FaissSearcher.state`) or None.
    index_record: the saved index the checkpoint lists (None without a searcher).
    bank_settings: `Bank.settings()`.
  """
  arrays: dict
  meta: dict
  records: list
  start: int
  stop: int
  new_rows: Optional[tuple]
  digest: Optional[str]
  index_state: Optional[tuple]
  index_record: Optional[dict]
  bank_settings: dict


class Writer:
  """One save of a memory directory: `with Writer(path) as w: snap = w.snapshot(parts)` (under the
  memory's lock), then `w.write(snap)` (outside it, so agents are not blocked by disk I/O). Holds
  the store's inter-process writer lock; only the bank rows added since the latest checkpoint at
  `path` are written."""

  def __init__(self, path):
    self.root = checkpoint_dir(path)
    self._stack = contextlib.ExitStack()

  def __enter__(self) -> "Writer":
    ckpt = _checkpoints()
    self.store = self._stack.enter_context(ckpt.CheckpointStore(self.root).writer())
    self.shards = ckpt.CheckpointStore(self.root / SHARDS, max_to_keep=None)
    self.indexes = ckpt.CheckpointStore(self.root / ANN_INDEX, max_to_keep=None)
    self.listed, self.listed_index = _listed(self.store)
    return self

  def __exit__(self, *exc):
    return self._stack.__exit__(*exc)

  def snapshot(self, parts: Parts) -> Snapshot:
    """What a save of `parts` writes (call under the memory's lock).

    Raises:
      CheckpointError: the bank holds one id twice (such a checkpoint could not be loaded); nothing
        was written.
    """
    bank = parts.bank
    if len(bank.row_of) != len(bank.ids):  # (row_of maps each distinct id to its row)
      dup = sorted(i for i, c in collections.Counter(bank.ids).items() if c > 1)
      raise _checkpoints().CheckpointError(
          f"refusing to save {self.root}: the bank holds duplicate memory ids {dup[:5]!r} (a "
          "checkpoint with them could not be loaded); nothing was written")
    arrays, meta = main_step(parts)
    records = _reusable(bank, self.listed)
    stop = len(bank)
    counts = [int(r["count"]) for r in records]
    covered = sum(counts)
    # The one shard this save writes: the new rows, merged with the tail of shards that breaks
    # the compaction invariant (then those rows are rewritten from the bank).
    first = min(_compaction_start(counts + ([stop - covered] if stop > covered else [])),
                len(records))
    start = int(records[first]["start"]) if first < len(records) else covered
    index_state, searcher, listed_index = None, bank.searcher, self.listed_index
    if searcher is not None and not (
        listed_index and listed_index.get("state_id") == searcher.state_id
        and listed_index.get("n") == stop and listed_index.get("name") == searcher.name):
      index_state = searcher.state()  # under the lock: an add changes the index in place
    return Snapshot(arrays=arrays, meta=meta, records=records[:first], start=start, stop=stop,
                    new_rows=bank.rows(start, stop) if stop > start else None,
                    digest=bank.digest(start, stop) if stop > start else None,
                    index_state=index_state,
                    index_record=listed_index if searcher is not None else None,
                    bank_settings=bank.settings())

  def write(self, snap: Snapshot) -> pathlib.Path:
    """Writes the shard, the ANN index (when changed) and the main step of `snap`; returns the
    main step's directory."""
    records, index_record = list(snap.records), snap.index_record
    if snap.new_rows is not None:
      step = (self.shards.latest_step() or 0) + 1
      self.shards.save(step, snap.new_rows[0],
                       {**snap.new_rows[1], "start": snap.start, "digest": snap.digest})
      records.append({"step": step, "start": snap.start, "count": snap.stop - snap.start,
                      "digest": snap.digest})
    if snap.index_state is not None:
      step = (self.indexes.latest_step() or 0) + 1
      index_meta = {**snap.index_state[1], "n": snap.stop}
      self.indexes.save(step, snap.index_state[0], index_meta)
      index_record = {"step": step, "n": snap.stop, "name": index_meta["name"],
                      "state_id": index_meta["state_id"]}
    meta = dict(snap.meta)
    meta["bank"] = {"layout": BANK_LAYOUT, "n": snap.stop, "shards": records,
                    **snap.bank_settings}
    if index_record is not None:
      meta["bank"]["ann_index"] = index_record
    path = write(self.root, snap.arrays, meta)
    _tidy(self.store, self.shards, self.indexes, int(meta["stats"].get(forget.DELETED_STAT, 0)))
    return path


def _tidy(store, shards, indexes, deleted: int) -> None:
  """What a save does once its main step is written and verified: after a deletion no older step
  may keep the deleted rows (`forget.purge_older_steps`), then the shards and indexes no kept step
  lists go (`_prune`), and the trash a killed delete left in any of the three stores. Call under
  the store's writer lock."""
  forget.purge_older_steps(store, deleted)
  _prune(store, shards, indexes)
  for s in (store, shards, indexes):
    s.remove_trash()


def tidy(root: pathlib.Path) -> None:
  """Finishes what a killed save of the memory directory `root` left undone (`_tidy` for its
  latest step), so a memory that only loads never keeps a deleted memory's bytes. Call after that
  step was read and verified (`read`, `restore_parts`), holding the directory (`own`). A
  directory this process cannot write (read-only) is left as it is."""
  ckpt = _checkpoints()
  try:
    with ckpt.CheckpointStore(root).writer() as store:
      deleted = int(store.read_meta(verify=False).get("stats", {}).get(forget.DELETED_STAT, 0))
      _tidy(store, ckpt.CheckpointStore(root / SHARDS, max_to_keep=None),
            ckpt.CheckpointStore(root / ANN_INDEX, max_to_keep=None), deleted)
  except (OSError, ckpt.CheckpointError):
    pass


def own(path, *, create: bool):
  """This process's owner lock (`CheckpointStore.own`, a `Hold`) of the memory directory `path`:
  one process at a time loads, restores or saves a memory directory. None when there is nothing
  to hold: no directory and `create` False (`read` then names the missing directory), or one
  this process cannot write (read-only: it cannot change it either).

  Raises:
    DirectoryInUseError: another process holds it (naming the directory and that process's pid).
  """
  root = checkpoint_dir(path)
  if not create and not root.is_dir():
    return None
  try:
    return _checkpoints().CheckpointStore(root).own("memory directory")
  except OSError as e:  # (DirectoryInUseError is not one)
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
      return None
    raise


def _bank_info(meta, meta_file) -> dict:
  """`meta['bank']`, with its layout, dtype and index checked: CheckpointFormatError naming the
  meta file and the field for a value this version does not know."""
  ckpt = _checkpoints()
  info = meta.get("bank")
  if not isinstance(info, dict):
    raise ckpt.CheckpointFormatError(f"{meta_file}: field 'bank' is a {type(info).__name__}, not "
                                     "an object")
  known = {"layout": (BANK_LAYOUT,), "bank_dtype": tuple(bank_lib.BANK_DTYPES),
           "index": ann.INDEXES}  # each may be absent (older checkpoints: inline bank, defaults)
  for field, values in known.items():
    if field in info and info[field] not in values:
      raise ckpt.CheckpointFormatError(
          f"{meta_file}: field 'bank.{field}' is {info[field]!r}, which this version of ear_jax "
          f"does not know (it reads {list(values)}"
          + (" or no layout: the inline bank of older checkpoints" if field == "layout" else "")
          + "); written by a newer ear_jax, or corrupted")
  if not isinstance(info.get("index_options", {}), dict):
    raise ckpt.CheckpointFormatError(f"{meta_file}: field 'bank.index_options' is not an object")
  return info


def _restore_index(root: pathlib.Path, record, bank: Bank, where: str) -> None:
  """Installs the saved ANN searcher `record` lists into `bank`'s searcher (rows already in)."""
  ckpt = _checkpoints()
  at = f"ANN index {record.get('step') if isinstance(record, dict) else record!r} of {where}"
  try:
    step = int(record["step"])
  except (TypeError, KeyError, ValueError):
    raise ckpt.CheckpointError(f"{at}: field 'bank.ann_index' is not an index record") from None
  indexes = ckpt.CheckpointStore(root / ANN_INDEX, max_to_keep=None)
  state, imeta = indexes.restore(step)
  if imeta.get("n") != len(bank) or imeta.get("state_id") != record.get("state_id"):
    raise ckpt.CheckpointError(f"{at} does not hold the index the checkpoint lists (it covers "
                               f"{imeta.get('n')} rows, the bank {len(bank)}; another memory's?)")
  try:
    bank.searcher.restore_state(state, imeta, bank.store_codes, at)
  except (ValueError, KeyError, TypeError) as e:
    raise ckpt.CheckpointError(f"{at}: {e}") from None


def read_bank(root: pathlib.Path, settings: dict, config: EARConfig, arrays, meta,
              where: str, meta_file) -> Bank:
  """The bank of a checkpoint (its shards, or the inline rows of an older checkpoint) with the bank
  `settings` (dtype, index); ValueError / CheckpointError naming `where` or the shard.

  An ANN searcher is the saved one when the checkpoint has one and `settings` are the saved
  settings (then it is exactly the searcher that was saved); otherwise it is built by adding the
  rows (checkpoints written before searchers were saved, or a memory restoring with other
  index settings)."""
  ckpt = _checkpoints()
  info = _bank_info(meta, meta_file)
  layout = info.get("layout")
  n = int(info["n"]) if layout == BANK_LAYOUT else len(info["ids"])
  bank = Bank(config.dim, max(n, config.num_candidates), settings["bank_dtype"],
              settings["index"], settings["index_options"])
  saved_index = info.get("ann_index")
  searcher = bank.searcher
  if searcher is None or saved_index is None or not _same_settings(_saved_settings(meta),
                                                                    settings):
    saved_index = None
  else:
    bank.searcher = None  # not fed row by row: its saved state is installed below
  if layout != BANK_LAYOUT:  # the bank inline (checkpoints written before shards)
    bank.extend_rows(arrays.get("bank", {}), info, where)
  else:
    _extend_from_shards(bank, root, info, where)
  if len(bank) != n:
    raise ckpt.CheckpointError(f"{where}: its shards hold {len(bank)} memories, expected {n}")
  if saved_index is not None:
    bank.searcher = searcher
    _restore_index(root, saved_index, bank, where)
  return bank


def _extend_from_shards(bank: Bank, root: pathlib.Path, info: dict, where: str) -> None:
  ckpt = _checkpoints()
  shards = ckpt.CheckpointStore(root / SHARDS, max_to_keep=None)
  for r in info["shards"]:
    at = f"bank shard {r['step']} of {where}"
    if int(r["start"]) != len(bank):
      raise ckpt.CheckpointError(f"{at} starts at row {r['start']}, expected {len(bank)}")
    rows, rmeta = shards.restore(int(r["step"]))
    digest = bank_lib.shard_digest(rows, rmeta)
    if digest != r["digest"] or len(rmeta["ids"]) != int(r["count"]):
      raise ckpt.CheckpointError(f"{at} does not hold the rows the checkpoint lists (another "
                                 "memory's shard?)")
    bank.extend_rows(rows, rmeta, at)
    bank.digests[(int(r["start"]), int(r["count"]))] = digest


def restore_parts(ckpt: Checkpoint, bank_settings: dict, config: EARConfig, token: str,
                  generation: int) -> Parts:
  """The parts of a checkpoint, for a memory with `config`, bank settings and session `token`
  (its `Retrieval`s of `generation` are the valid ones)."""
  meta = ckpt.meta
  bank = read_bank(ckpt.root, bank_settings, config, ckpt.arrays, meta, ckpt.where, ckpt.meta_file)
  sessions = Sessions.restore(config, meta["max_sessions"], ckpt.arrays.get("sessions", {}),
                              meta["sessions"], ckpt.where, token, generation, bank.gather)
  driver = Driver.restore(config, meta["seed"], ckpt.arrays["driver"], meta["driver"], ckpt.where,
                          bank.gather)
  settings = {k: meta[k] for k in ("seed", "multistore", "max_sessions", "cache_dir", "stats")}
  return Parts(bank=bank, sessions=sessions, driver=driver, settings=settings)


def _first_stage(meta, meta_file):
  """`(candidates, FirstStageOptions)` of a checkpoint (dense for one written before first stages);
  CheckpointFormatError naming the meta file and the field for one this version does not know."""
  try:
    return lexical_bank.options_from_meta(meta.get("first_stage"), str(meta_file))
  except ValueError as e:
    raise _checkpoints().CheckpointFormatError(str(e)) from None


def _saved_settings(meta) -> dict:
  """The bank options a checkpoint was written with (defaults for older checkpoints)."""
  info = meta["bank"]
  return {k: info[k] for k in ("bank_dtype", "index", "index_options") if k in info}


def _same_settings(saved: dict, settings: dict) -> bool:
  keys = ("bank_dtype", "index", "index_options")
  return json.dumps([saved.get(k) for k in keys], sort_keys=True) == json.dumps(
      [settings.get(k) for k in keys], sort_keys=True, default=str)


def memory_args(ckpt: Checkpoint, *, encoder: Any = "saved",
                config: Optional[EARConfig] = None) -> dict:
  """The `Memory(...)` arguments of a checkpoint, for `Memory.load` (which then installs
  `restore_parts`).

  Args:
    ckpt: `read`'s checkpoint.
    encoder: 'saved' (the saved spec, loaded lazily and checked against the saved model identity),
      an `Encoder` / spec to use instead (dimension and identity must match), or None.
    config: optional expected `EARConfig`; a different one is an error listing the fields.

  Raises:
    ValueError: another config, encoder dimension or model.
    CheckpointFormatError: an unknown layout, dtype, index or first stage (naming the file and
      the field).
  """
  meta = ckpt.meta
  if config is not None:
    check_config(meta["config"], config, ckpt.where)
  slot = EncoderSlot.for_checkpoint(encoder, meta["encoder"], ckpt.where)
  _bank_info(meta, ckpt.meta_file)  # an unknown layout, dtype or index names the file and field
  candidates, fs_options = _first_stage(meta, ckpt.meta_file)
  return dict(encoder=slot, config=EARConfig.from_dict(meta["config"]), seed=meta["seed"],
              multistore=meta["multistore"], cache_dir=meta["cache_dir"],
              max_sessions=meta["max_sessions"], candidates=candidates,
              first_stage_options=fs_options, **_saved_settings(meta))


def check_restorable(ckpt: Checkpoint, config: EARConfig, candidates: str,
                     first_stage_options, encoder_identity: Optional[str]) -> None:
  """`Memory.restore`'s checks: the checkpoint's config must equal the memory's, its first stage
  the memory's, and its encoder identity (when both are known) the memory's; ValueError naming
  the checkpoint and the difference."""
  meta, where = ckpt.meta, ckpt.where
  check_config(meta["config"], config, where)
  stage = _first_stage(meta, ckpt.meta_file)  # (the fusion's options matter to 'hybrid' only)
  if stage[0] != candidates or (stage[0] == "hybrid" and stage[1] != first_stage_options):
    raise ValueError(f"{where} was written with candidates={stage[0]!r} ({stage[1]}); this memory "
                     f"uses candidates={candidates!r} ({first_stage_options}): load it with "
                     "Memory.load")
  saved = meta["encoder"]["identity_hash"]
  if saved and encoder_identity and saved != encoder_identity:
    raise ValueError(f"{where} was written with another encoder model (identity {saved[:16]}, "
                     f"this memory's is {encoder_identity[:16]})")
