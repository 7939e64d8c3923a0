"""Checkpoints of `Memory`, through the shared checkpoint mechanism `ear_jax.io.checkpoints`.

A memory directory is a `CheckpointStore`: numbered steps (1, 2, ...), each holding the arrays
(learner state, hyperparameters, sessions, queued training items) and one JSON meta dict (format
tag, config, encoder, bank settings, sessions, counters, stats, and the list of bank shards). The
store writes atomically under an inter-process lock and verifies a new step before it deletes older
ones (it keeps the last few), so a save killed at any moment leaves the previous checkpoint
loadable.

The bank is append-only, so it is saved as append-only shards: `<directory>/bank_shards/` is a
second `CheckpointStore` whose steps each hold a contiguous run of bank rows (embeddings, stores,
ids, texts) and are never rewritten. A save writes ONE new shard with the rows added since the
latest checkpoint (recognised by the SHA-256 of each listed shard's rows, cached in the bank), then
the main step that lists every shard. Saving after adding 1,000 memories to a 1M bank therefore
writes 1,000 rows plus the learner state, not the bank. Nor does the main step repeat what the
bank holds: the replay buffer's candidates and the sessions' candidates (`[C, K, d]` and
`[sessions, K, d]`, the bulk of the learner's state) are saved as their bank rows and gathered back
from the restored bank (`Bank.gather`), bit for bit. Atomicity: a shard is complete before the
main step that lists it exists; a save killed before its main step leaves an unlisted shard that
the next save deletes; shards are deleted only when no kept main step lists them. One memory save
at a time per directory (`CheckpointStore.writer`, an inter-process lock). Checkpoints written with
the bank inline (before shards) still load.

A checkpoint of another format or config is refused with the differing fields
(`checkpoints.check_compatible`); a truncated one raises `checkpoints.CheckpointError` naming the
path.
"""
from __future__ import annotations

import collections
import os
import pathlib
from typing import Any, Optional

from ear_jax.agent import bank as bank_lib
from ear_jax.agent.bank import Bank
from ear_jax.agent.encoder_slot import EncoderSlot
from ear_jax.agent.driver import Driver, seed_keys
from ear_jax.agent.sessions import Sessions
from ear_jax.core.config import EARConfig

FORMAT = "ear_jax.agent.memory/2"
BANK_LAYOUT = "shards-1"  # meta["bank"]["layout"] of a checkpoint with the bank in shards
SHARDS = "bank_shards"


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


def _listed_shards(store) -> list[dict]:
  """The shard records of the latest main step of `store` ([] when none can be reused)."""
  try:
    meta = store.read_meta()
  except Exception:  # pylint: disable=broad-except  (no step, or an unreadable one: write afresh)
    return []
  bank = meta.get("bank") if meta.get("format") == FORMAT else None
  if not isinstance(bank, dict) or bank.get("layout") != BANK_LAYOUT:
    return []
  return list(bank.get("shards", []))


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


def _prune_shards(store, shards) -> None:
  """Deletes shards no kept main step lists, older than the newest listed one (killed saves)."""
  listed = set()
  for step in store.steps():
    try:
      listed.update(int(r["step"]) for r in store.read_meta(step).get("bank", {}).get("shards", []))
    except Exception:  # pylint: disable=broad-except  (unreadable step: keep everything)
      return
  newest = max(listed, default=0)
  for step in shards.steps():
    if step not in listed and step < newest:
      shards.delete(step)


def read(path):
  """`(arrays, meta, where, root)` of the latest memory checkpoint at `path`.

  Raises:
    ValueError: no checkpoint there, or one of another format (with the differing fields).
    CheckpointError: a truncated or unreadable checkpoint (naming the path).
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
    meta = store.read_meta(step)
    ckpt.check_compatible({k: meta[k] for k in ("format",) if k in meta}, {"format": FORMAT},
                          where)
    arrays, meta = store.restore(step)
  return arrays, meta, where, root


def check_config(stored: dict, expected: EARConfig, where: str) -> None:
  """ValueError listing the fields where the checkpoint's config differs from `expected`."""
  _checkpoints().check_compatible(stored, expected.to_dict(), f"the config of {where}")


def snapshot(memory):
  """`(arrays, meta)` of a memory at one moment (host copies; call under its lock).

  Arrays: `sessions` (their stacked arrays), `driver` (learner leaves, hyperparameters, queued
  items); empty parts are left out. Meta: the settings (config, seed, encoder, ...), the stats and
  each part's JSON meta under its name. The bank is saved in shards by `save`.
  """
  parts = {"sessions": memory._sessions.snapshot(), "driver": memory._driver.snapshot()}
  arrays = {name: a for name, (a, _) in parts.items() if a}
  meta = dict(config=memory.config.to_dict(), seed=memory.seed, multistore=memory.multistore,
              max_sessions=memory.max_sessions, cache_dir=memory.cache_dir,
              stats=dict(memory.stats), encoder=memory._encoder.meta(memory.config.dim))
  return arrays, {**meta, **{name: m for name, (_, m) in parts.items()}}


def save(memory, path) -> pathlib.Path:
  """`Memory.save`: the snapshot is taken under the memory's lock (arrays and metadata of one
  moment, new bank rows copied to the host) and written OUTSIDE it, so agents are not blocked by
  disk I/O; saves of one memory are serialised by its save lock, and processes by the store's
  writer lock. Only the bank rows added since the latest checkpoint at `path` are written."""
  ckpt = _checkpoints()
  root = checkpoint_dir(path)
  with memory._save_lock, ckpt.CheckpointStore(root).writer() as store:
    shards = ckpt.CheckpointStore(root / SHARDS, max_to_keep=None)
    listed = _listed_shards(store)
    with memory._lock:
      arrays, meta = snapshot(memory)
      bank = memory._bank
      records = _reusable(bank, listed)
      start, stop = sum(int(r["count"]) for r in records), len(bank)
      new_rows = bank.rows(start, stop) if stop > start else None
      digest = bank.digest(start, stop) if stop > start else None
    if new_rows is not None:
      step = (shards.latest_step() or 0) + 1
      shards.save(step, new_rows[0], {**new_rows[1], "start": start, "digest": digest})
      records.append({"step": step, "start": start, "count": stop - start, "digest": digest})
    meta["bank"] = {"layout": BANK_LAYOUT, "n": stop, "shards": records,
                    **memory._bank.settings()}
    path = write(root, arrays, meta)
    _prune_shards(store, shards)
    return path


def read_bank(root: pathlib.Path, settings: dict, config: EARConfig, arrays, meta,
              where: str) -> Bank:
  """The bank of a checkpoint (its shards, or the inline rows of an older checkpoint) with the bank
  `settings` (dtype, index); ValueError / CheckpointError naming `where` or the shard."""
  ckpt = _checkpoints()
  info = meta["bank"]
  layout = info.get("layout") if isinstance(info, dict) else None
  n = int(info["n"]) if layout == BANK_LAYOUT else len(info["ids"])
  bank = Bank(config.dim, max(n, config.num_candidates), settings["bank_dtype"],
              settings["index"], settings["index_options"])
  if layout != BANK_LAYOUT:  # the bank inline (checkpoints written before shards)
    bank.extend_rows(arrays.get("bank", {}), info, where)
    return bank
  shards = ckpt.CheckpointStore(root / SHARDS, max_to_keep=None)
  for r in info["shards"]:
    at = f"bank shard {r['step']} of {where}"
    if int(r["start"]) != len(bank):
      raise ckpt.CheckpointError(f"{at} starts at row {r['start']}, expected {len(bank)}")
    rows, rmeta = shards.restore(int(r["step"]))
    digest = bank_lib.rows_digest(rmeta["ids"], rmeta["texts"], rows["stores"], rows["embeddings"])
    if digest != r["digest"] or len(rmeta["ids"]) != int(r["count"]):
      raise ckpt.CheckpointError(f"{at} does not hold the rows the checkpoint lists (another "
                                 "memory's shard?)")
    bank.extend_rows(rows, rmeta, at)
    bank.digests[(int(r["start"]), int(r["count"]))] = digest
  if len(bank) != n:
    raise ckpt.CheckpointError(f"{where}: its shards hold {len(bank)} memories, expected {n}")
  return bank


def _install(memory, root, arrays, meta, where: str, generation: int) -> None:
  """Replaces a memory's parts, settings and stats by a checkpoint's (call under its lock)."""
  config = memory.config
  bank = read_bank(root, memory._bank.settings(), config, arrays, meta, where)
  sessions = Sessions.restore(config, meta["max_sessions"], arrays.get("sessions", {}),
                              meta["sessions"], where, memory._sessions.token, generation,
                              bank.gather)
  driver = Driver.restore(config, meta["seed"], arrays["driver"], meta["driver"], where,
                          bank.gather)
  memory._bank, memory._sessions, memory._driver = bank, sessions, driver
  memory.seed, memory.multistore = int(meta["seed"]), bool(meta["multistore"])
  memory.max_sessions, memory.cache_dir = int(meta["max_sessions"]), meta["cache_dir"]
  memory._critic_key = seed_keys(memory.seed)[2]
  memory.stats = collections.Counter(meta["stats"])


def _saved_settings(meta) -> dict:
  """The bank options a checkpoint was written with (defaults for older checkpoints)."""
  info = meta["bank"]
  return {k: info[k] for k in ("bank_dtype", "index", "index_options") if k in info}


def load(cls, path, *, encoder: Any = "saved", config: Optional[EARConfig] = None):
  """`Memory.load`: a new memory (a new identity) from the latest checkpoint at `path`.

  Args:
    cls: the `Memory` class.
    path: the checkpoint directory given to `save`.
    encoder: 'saved' (the saved spec, loaded lazily and checked against the saved model identity),
      an `Encoder` / spec to use instead (dimension and identity must match), or None.
    config: optional expected `EARConfig`; a different one is an error listing the fields.

  Raises:
    ValueError: no checkpoint at `path`, another format, config, encoder dimension or model.
    CheckpointError: a truncated checkpoint (naming its path).
  """
  arrays, meta, where, root = read(path)
  if config is not None:
    check_config(meta["config"], config, where)
  slot = EncoderSlot.for_checkpoint(encoder, meta["encoder"], where)
  memory = cls(slot, config=EARConfig.from_dict(meta["config"]), seed=meta["seed"],
               multistore=meta["multistore"], cache_dir=meta["cache_dir"],
               max_sessions=meta["max_sessions"], **_saved_settings(meta))
  _install(memory, root, arrays, meta, where, generation=0)
  return memory


def restore(memory, path) -> None:
  """`Memory.restore`: the latest checkpoint at `path` replaces the memory's state in place.

  The checkpoint's config must equal the memory's, and its encoder identity (when both are known)
  the memory's. The memory's generation is bumped, so every `Retrieval` returned before is stale.
  """
  arrays, meta, where, root = read(path)
  check_config(meta["config"], memory.config, where)
  saved, ours = meta["encoder"]["identity_hash"], memory._encoder.identity
  if saved and ours and saved != ours:
    raise ValueError(f"{where} was written with another encoder model (identity {saved[:16]}, "
                     f"this memory's is {ours[:16]})")
  with memory._lock:
    _install(memory, root, arrays, meta, where, memory.generation + 1)
