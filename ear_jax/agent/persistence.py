"""Checkpoints of `Memory`, through the shared checkpoint mechanism `ear_jax.io.checkpoints`.

A memory directory is a `CheckpointStore`: numbered steps (1, 2, ...), each holding the arrays
(bank embeddings and stores, learner state, hyperparameters, sessions, queued training items) and
one JSON meta dict (format tag, config, encoder, ids, texts, sessions, counters, stats). The store
writes atomically under an inter-process lock and verifies a new step before it deletes older ones
(it keeps the last few), so a save killed at any moment leaves the previous checkpoint loadable.

A checkpoint of another format or config is refused with the differing fields
(`checkpoints.check_compatible`); a truncated one raises `checkpoints.CheckpointError` naming the
path.
"""
from __future__ import annotations

import collections
import os
import pathlib
from typing import Any, Optional

from ear_jax.agent.bank import Bank, EncoderSlot
from ear_jax.agent.driver import Driver, seed_keys
from ear_jax.agent.sessions import Sessions
from ear_jax.core.config import EARConfig

FORMAT = "ear_jax.agent.memory/2"


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


def read(path):
  """`(arrays, meta, where)` of the latest memory checkpoint at `path`.

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
  return arrays, meta, where


def check_config(stored: dict, expected: EARConfig, where: str) -> None:
  """ValueError listing the fields where the checkpoint's config differs from `expected`."""
  _checkpoints().check_compatible(stored, expected.to_dict(), f"the config of {where}")


def snapshot(memory):
  """`(arrays, meta)` of a memory at one moment (host copies; call under its lock).

  Arrays: `bank` (embeddings, stores), `sessions` (their stacked arrays), `driver` (learner leaves,
  hyperparameters, queued items); empty parts are left out. Meta: the settings (config, seed,
  encoder, ...), the stats and each part's JSON meta under its name.
  """
  parts = {"bank": memory._bank.snapshot(), "sessions": memory._sessions.snapshot(),
           "driver": memory._driver.snapshot()}
  arrays = {name: a for name, (a, _) in parts.items() if a}
  meta = dict(config=memory.config.to_dict(), seed=memory.seed, multistore=memory.multistore,
              max_sessions=memory.max_sessions, cache_dir=memory.cache_dir,
              stats=dict(memory.stats), encoder=memory._encoder.meta(memory.config.dim))
  return arrays, {**meta, **{name: m for name, (_, m) in parts.items()}}


def save(memory, path) -> pathlib.Path:
  """`Memory.save`: the snapshot is taken under the memory's lock (arrays and metadata of one
  moment, copied to the host) and written OUTSIDE it, so agents are not blocked by disk I/O; saves
  of one memory are serialised by its save lock, and processes by the store's file lock."""
  root = checkpoint_dir(path)
  with memory._save_lock:
    with memory._lock:
      arrays, meta = snapshot(memory)
    return write(root, arrays, meta)


def _install(memory, arrays, meta, where: str, generation: int) -> None:
  """Replaces a memory's parts, settings and stats by a checkpoint's (call under its lock)."""
  config = memory.config
  bank = Bank.restore(config.dim, arrays.get("bank", {}), meta["bank"], where,
                      config.num_candidates)
  sessions = Sessions.restore(config, meta["max_sessions"], arrays.get("sessions", {}),
                              meta["sessions"], where, memory._sessions.token, generation)
  driver = Driver.restore(config, meta["seed"], arrays["driver"], meta["driver"], where)
  memory._bank, memory._sessions, memory._driver = bank, sessions, driver
  memory.seed, memory.multistore = int(meta["seed"]), bool(meta["multistore"])
  memory.max_sessions, memory.cache_dir = int(meta["max_sessions"]), meta["cache_dir"]
  memory._critic_key = seed_keys(memory.seed)[2]
  memory.stats = collections.Counter(meta["stats"])


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
  arrays, meta, where = read(path)
  if config is not None:
    check_config(meta["config"], config, where)
  slot = EncoderSlot.for_checkpoint(encoder, meta["encoder"], where)
  memory = cls(slot, config=EARConfig.from_dict(meta["config"]), seed=meta["seed"],
               multistore=meta["multistore"], cache_dir=meta["cache_dir"],
               max_sessions=meta["max_sessions"])
  _install(memory, arrays, meta, where, generation=0)
  return memory


def restore(memory, path) -> None:
  """`Memory.restore`: the latest checkpoint at `path` replaces the memory's state in place.

  The checkpoint's config must equal the memory's, and its encoder identity (when both are known)
  the memory's. The memory's generation is bumped, so every `Retrieval` returned before is stale.
  """
  arrays, meta, where = read(path)
  check_config(meta["config"], memory.config, where)
  saved, ours = meta["encoder"]["identity_hash"], memory._encoder.identity
  if saved and ours and saved != ours:
    raise ValueError(f"{where} was written with another encoder model (identity {saved[:16]}, "
                     f"this memory's is {ours[:16]})")
  with memory._lock:
    _install(memory, arrays, meta, where, memory.generation + 1)
