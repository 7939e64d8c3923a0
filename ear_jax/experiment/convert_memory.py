"""The one-shot converter of memory directories of the old layout (ear_jax 0.1.0) to the new one.

The old layout (`Memory.save` of ear_jax 0.1.0): the directory is an `io.checkpoints.
CheckpointStore` whose latest step holds the learner (`driver`: the learner state as its named
pytree, the replay buffer's candidates saved as bank rows `buffer_rows [C, K]` or inline), the
open sessions and queued training items, and a meta dict (format 'ear_jax.agent.memory/2': the
config, the settings, the bank's listing); the bank's rows live in `<dir>/bank_shards/`, a second
store whose steps each hold a contiguous run of rows (embeddings, store and scope codes; ids,
texts, scope names, dates). Deleted memories are tombstones (store code 2) that keep their row.

`convert(old, new)` reads that with `CheckpointStore` (which verifies every array and meta byte),
then writes the new layout through the public API only: `Memory.open(new, MemoryConfig(<the old
settings>), learner=<the old LearnerState, its buffer's candidates gathered from the old rows>)`,
`add` of the live memories in row order (ids, texts, stores, scopes, dates and embeddings as
stored; `add` normalises the unit rows again, so they are equal up to float32 rounding), `save()`.
Open sessions and queued training items refer to old row numbers and are dropped (the report says
how many); the memory's counters start again. Layouts older than the newest old one (an inline
bank, a positional learner state, rows without scopes or dates) are refused: load and save them
with ear_jax 0.1.0 first. `old` is only read; `new` must be absent or empty, and is left so when
the conversion fails.
"""
from __future__ import annotations

import itertools
import pathlib
import shutil
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.core import learner as learner_lib
from ear_jax.core.config import EARConfig, HParams
from ear_jax.data.first_stage import FirstStageOptions
from ear_jax.io import checkpoints

OLD_FORMAT = "ear_jax.agent.memory/2"
_DELETED = 2  # the old store code of a tombstone
_BATCH = 4096  # rows per add (one transaction each)


class Report(NamedTuple):
  """What `convert` did: memories written, old tombstones skipped, what was dropped."""
  memories: int
  tombstones: int
  open_sessions: int
  queued_items: int

  def __str__(self):
    return (f"converted {self.memories} memories ({self.tombstones} deleted rows skipped); "
            f"dropped {self.open_sessions} open session(s) and {self.queued_items} queued "
            "training item(s): they refer to the old layout's row numbers")


def _older(where: str, what: str) -> ValueError:
  return checkpoints.CheckpointFormatError(
      f"{where}: {what}, a layout older than the one this converter reads: load it and save it "
      "again with ear_jax 0.1.0 (Memory.load(path).save(path)), then convert it")


def _rows(root: pathlib.Path, bank: dict, dim: int, where: str):
  """`(ids, texts, stores [n] int8, scopes, dates, embeddings [n, d])` of the old bank, every
  row (tombstones included), from its shards."""
  if bank.get("layout") != "shards-1":
    raise _older(where, f"its bank is stored inline (layout {bank.get('layout')!r})")
  shards = checkpoints.CheckpointStore(root / "bank_shards", max_to_keep=None)
  ids, texts, stores, scopes, dates, emb = [], [], [], [], [], []
  for r in bank["shards"]:
    arrays, meta = shards.restore(int(r["step"]))
    at = f"bank shard {r['step']} of {where}"
    if "scopes" not in arrays or "dates" not in meta:
      raise _older(at, "rows without scopes or dates")
    n = len(meta["ids"])
    if int(r["start"]) != len(ids) or n != int(r["count"]) or np.shape(arrays["embeddings"]) != (
        n, dim):
      raise checkpoints.CheckpointError(f"{at} does not hold the rows the checkpoint lists")
    ids += meta["ids"]
    texts += meta["texts"]
    stores.append(np.asarray(arrays["stores"], np.int8))
    scopes += [meta["scope_names"][int(c)] for c in np.asarray(arrays["scopes"])]
    dates += meta["dates"]
    emb.append(np.asarray(arrays["embeddings"], np.float32))
  if len(ids) != int(bank["n"]):
    raise checkpoints.CheckpointError(f"{where}: its shards hold {len(ids)} rows, not {bank['n']}")
  return (ids, texts, np.concatenate(stores or [np.zeros(0, np.int8)]), scopes, dates,
          np.concatenate(emb) if emb else np.zeros((0, dim), np.float32))


def _learner(config: EARConfig, arrays: dict, meta: dict, emb: np.ndarray, where: str):
  """The old `LearnerState` (the replay buffer's candidates gathered from the old rows `emb`)."""
  if meta.get("learner_layout") != "named-1":
    raise _older(where, "its learner state is stored by position")
  target = jax.eval_shape(lambda: learner_lib.init_learner(jax.random.PRNGKey(0), config))
  cands = target.buffer.candidates
  by_rows = "buffer_rows" in arrays
  abstract = target.replace(buffer=target.buffer.replace(
      candidates=jax.ShapeDtypeStruct((0,), cands.dtype))) if by_rows else target
  state = checkpoints.fit_target(abstract, arrays["learner"], f"{where}: the learner state")
  state = jax.tree_util.tree_map(lambda x, t: jnp.asarray(x, t.dtype), state, abstract)
  if by_rows:
    rows = np.asarray(arrays["buffer_rows"])
    if rows.shape != cands.shape[:2] or rows.max(initial=-1) >= len(emb):
      raise checkpoints.CheckpointError(f"{where}: buffer_rows {rows.shape} do not fit the bank")
    got = np.where((rows >= 0)[..., None], emb[np.maximum(rows, 0)], 0).astype(np.float32)
    if config.side_features:
      got = np.concatenate([got, np.asarray(arrays["buffer_features"], np.float32)], -1)
    state = state.replace(buffer=state.buffer.replace(candidates=jnp.asarray(got, cands.dtype)))
  return state


def convert(old, new) -> Report:
  """Converts the old-layout memory directory `old` into a new memory directory `new`.

  Raises:
    ValueError: `new` exists and is not empty, or `old` holds no memory checkpoint.
    CheckpointFormatError: `old` is of another format or an older layout (naming the file).
    CheckpointError: `old` is truncated or corrupted (naming the path).
  """
  old, new = pathlib.Path(old).expanduser().absolute(), pathlib.Path(new).expanduser().absolute()
  if new.exists() and (not new.is_dir() or any(new.iterdir())):
    raise ValueError(f"--new={new} exists and is not an empty directory: convert into a new one")
  with checkpoints.CheckpointStore(old) as store:
    step = store.latest_step() if old.is_dir() else None
    if step is None:
      raise ValueError(f"--old={old} holds no memory checkpoint of ear_jax 0.1.0")
    where = str(store.meta_file(step))
    arrays, meta = store.restore(step)
  if meta.get("format") != OLD_FORMAT:
    raise checkpoints.CheckpointFormatError(
        f"{where}: format {meta.get('format')!r} is not an old memory checkpoint "
        f"({OLD_FORMAT!r})")
  ear = EARConfig.from_dict(meta["config"])
  ids, texts, stores, scopes, dates, emb = _rows(old, meta["bank"], ear.dim, where)
  driver = arrays["driver"]
  learner = _learner(ear, driver, meta["driver"], emb, where)
  stage = meta.get("first_stage") or {"candidates": "dense", "options": {}}
  config = MemoryConfig(
      encoder=meta["encoder"]["spec"], config=ear,
      hparams=HParams(**{k: jnp.asarray(v, jnp.float32) for k, v in driver["hparams"].items()}),
      seed=int(meta["seed"]), multistore=bool(meta["multistore"]), cache_dir=meta["cache_dir"],
      max_sessions=int(meta["max_sessions"]), bank_dtype=meta["bank"].get("bank_dtype", "float32"),
      index=meta["bank"].get("index", "exact"), index_options=meta["bank"].get("index_options", {}),
      candidates=stage["candidates"], first_stage=FirstStageOptions(**stage["options"]))
  live = np.flatnonzero(stores != _DELETED)
  created = not new.exists()
  try:
    # (the encoder named: the old rows' embeddings are its, and text questions stay answerable)
    with Memory.open(new, config, encoder=config.encoder, learner=learner) as memory:
      # one add per run of rows of one scope (add takes one scope), at most _BATCH rows each
      runs = itertools.groupby(enumerate(live), key=lambda jr: (scopes[jr[1]], jr[0] // _BATCH))
      for (scope, _), run in runs:
        rows = [r for _, r in run]
        memory.add([texts[r] for r in rows], store=[int(stores[r]) for r in rows],
                   ids=[ids[r] for r in rows], embeddings=emb[rows], scope=scope,
                   dates=[dates[r] for r in rows])
      memory.save()
  except BaseException:  # leave --new as it was (absent or empty), so a rerun can convert
    for p in [new] if created else list(new.iterdir()):
      shutil.rmtree(p) if p.is_dir() else p.unlink()
    raise
  sessions = meta.get("sessions", {}).get("sessions", [])
  return Report(memories=len(live), tombstones=len(ids) - len(live),
                open_sessions=sum(not s.get("closed") for s in sessions),
                queued_items=int(meta["driver"].get("num_ready", 0)))
