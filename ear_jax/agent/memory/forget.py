"""Forgetting: `Memory.delete` removes memories from every part of a memory and its next checkpoint.

Symbols: `n` bank rows, `K` candidates, `d` dimension, `C` replay buffer capacity, `r` rows
deleted.

A deleted memory keeps its bank ROW (rows are what sessions, the replay buffer and checkpoints
refer to) but nothing else: the row becomes a tombstone with store code `DELETED` (2), an id
`TOMBSTONE + row` that no caller can name, an empty text and a zero embedding, invalid on the
device. So it is never a candidate again: the exact search, the lexical first stage
(`ear_jax.agent.memory.lexical_bank`: only stores 0 / 1 are indexed or valid) and the ANN searchers (only
stores 0 / 1 are added; the searcher is rebuilt without the row) never see it. A loaded checkpoint
keeps the tombstones (`bank._write` marks store-2 rows invalid).

Everything that held the memory forgets it in the same locked call:

* open sessions whose candidates include it are DROPPED without training (their rounds' feedback
  was given on slates that contained it; their open retrievals are no longer open);
* queued training items and the replay buffer keep their experiences with that candidate masked
  out (mask, observed and the Eq. (12) mean label cleared, its embedding zeroed, its saved bank row
  -1), so the rest of the feedback still trains;
* the checkpoint: the bank shard digests of the touched rows are dropped, so the next save rewrites
  the shards that held them (`persistence._reusable` stops at the first changed shard), and
  `purge_older_steps` deletes every older main step written before the deletion (with them the
  shards and ANN indexes only they listed), so no file under the checkpoint directory keeps the
  memory's vector or text once that save returns. A save killed in between leaves the old or the
  new checkpoint (the store's atomic steps); the older steps are purged by the next save or load
  (`persistence.tidy`), since each main step records the number of deletions so far
  (`stats['memories_deleted']`), and so are the `.trash-*` directories a delete killed while it
  removed an old shard or index leaves.

Correcting: `Memory.update(id, text=..., embedding=...)` is a delete of the memory's row (all of
the above: the old text and vector leave candidates, sessions, the buffer and the next
checkpoint) and an append of a new row with the same id, store, scope and date, in one locked
call. `Memory.get` / `Memory.list` give `{'id', 'text', 'store', 'scope', 'date'}` records.

The functions work on the memory's parts (bank, sessions, driver, stats), never on `Memory`: the
front validates, takes its lock and calls them (`Memory.delete`, `update`, `get`, `list`).
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.data import encoder_base

DELETED = 2  # the store code of a deleted row
TOMBSTONE = "\x00deleted:"  # + row: the id of a deleted row (no caller's id holds a NUL:
# `bank.check_id_chars`; `rows_of` refuses it)
DELETED_STAT = "memories_deleted"


def is_tombstone(memory_id: str) -> bool:
  return memory_id.startswith(TOMBSTONE)


def check_ids(ids, what: str = "ids") -> list[str]:
  """One id or a non-empty sequence of distinct string ids, as a list (no bank lookup)."""
  ids = bank_lib.string_list(ids, what, "memory id")
  dup = sorted({i for i in ids if ids.count(i) > 1})
  if dup:
    raise ValueError(f"{what}: duplicate memory ids {dup[:5]}")
  return ids


def rows_of(bank: bank_lib.Bank, ids: list[str], what: str = "ids") -> np.ndarray:
  """`[r]` bank rows of live memory ids; ValueError listing the unknown ones (call under the
  memory's lock)."""
  unknown = [i for i in ids if is_tombstone(i) or i not in bank.row_of]
  if unknown:
    shown = ", ".join(repr(i) for i in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
    raise ValueError(f"{what}: unknown memory id(s) {shown} ({len(unknown)} of {len(ids)}; they "
                     "were never added or were deleted); nothing was changed")
  return np.asarray([bank.row_of[i] for i in ids], np.int32)


def num_deleted(bank: bank_lib.Bank) -> int:
  return int(np.count_nonzero(bank.store_codes == DELETED))


def live_ids(bank: bank_lib.Bank) -> list[str]:
  return [i for i in bank.ids if not is_tombstone(i)]


def _forget_bank(bank: bank_lib.Bank, rows: np.ndarray) -> np.ndarray:
  """Tombstones bank `rows` in place; returns their former `[r, d]` embeddings."""
  old = np.asarray(bank.emb[rows].astype(jnp.float32))
  at = jnp.asarray(rows)
  bank.emb = bank.emb.at[at].set(0)
  bank.valid = bank.valid.at[at].set(False)
  bank.stores = bank.stores.at[at].set(DELETED)
  bank.scopes = bank.scopes.at[at].set(0)
  bank.count_rows(bank.store_codes[rows], bank.scope_codes[rows], -1)
  for r in rows.tolist():
    bank.store_codes[r] = DELETED
    bank.scope_codes[r] = 0  # (a tombstone is in the default scope, with no date)
    bank.dates[r] = ""
    bank.row_of.pop(bank.ids[r])
    bank.ids[r] = f"{TOMBSTONE}{r}"
    bank.row_of[bank.ids[r]] = r
    bank.texts[r] = ""
  bank.digests = {(s, c): h for (s, c), h in bank.digests.items()
                  if not ((rows >= s) & (rows < s + c)).any()}
  if bank.searcher is not None:  # rebuilt without the rows (faiss indexes cannot all remove)
    from ear_jax.index import ann  # pylint: disable=g-import-not-at-top
    bank.searcher = ann.make_searcher(bank.index_name, bank.dim, bank.index_options)
    if len(bank):
      bank.searcher.add(bank.embeddings(), bank.store_codes, 0)
  return old


def _mask_item(item, rows: np.ndarray):
  """A queued `TrainItem` with the candidates at deleted `rows` masked out."""
  hit = np.isin(item.rows, rows) & item.mask
  if not hit.any():
    return item
  pos = np.flatnonzero(hit)
  in_slate = np.isin(item.slates, pos) & item.slate_mask
  cands = item.candidates.copy()
  cands[hit] = 0.0
  return item._replace(candidates=cands, mask=item.mask & ~hit,
                       slate_mask=item.slate_mask & ~in_slate,
                       labels=np.where(in_slate, 0.0, item.labels).astype(item.labels.dtype),
                       rows=np.where(hit, -1, item.rows).astype(item.rows.dtype))


def _forget_buffer(driver, rows: np.ndarray, old_emb: np.ndarray, dim: int) -> None:
  """Masks the deleted candidates out of the replay buffer (by their saved bank rows, or by their
  exact embeddings when the buffer came from a checkpoint without rows)."""
  buf = driver.state.buffer
  if driver.buffer_rows is not None:
    hit = np.isin(driver.buffer_rows, rows)
    driver.buffer_rows[hit] = -1
  else:
    cands = np.asarray(buf.candidates[..., :dim])
    hit = np.zeros(cands.shape[:2], bool)
    for e in old_emb:
      hit |= np.all(cands == e, -1)
  hit &= np.asarray(buf.mask)
  if not hit.any():
    return
  h = jnp.asarray(hit)
  buf = buf.replace(candidates=jnp.where(h[..., None], 0.0, buf.candidates),
                    mask=buf.mask & ~h, observed=buf.observed & ~h,
                    ybar=jnp.where(h, 0.0, buf.ybar))
  driver.state = driver.state.replace(buffer=buf)


def forget_rows(bank: bank_lib.Bank, sessions, driver, rows: np.ndarray, stats,
                verb: str = "deleted") -> None:
  """Deletes live bank `rows` everywhere (see the module docstring): tombstones in the bank, the
  open sessions that showed them dropped (`Sessions.drop`, naming the memory and `verb`: later
  feedback on them says so), masked out of the queued items and the replay buffer; counted in
  `stats` (a Counter). Call under the memory's lock; the caller refreshes a lexical index
  (`LexicalBank.fresh`)."""
  names = {int(r): bank.ids[int(r)] for r in rows}  # (read before the tombstones replace them)
  old = _forget_bank(bank, rows)
  for sid, s in list(sessions.by_id.items()):
    hit = np.intersect1d(s.cand_idx[s.cand_mask], rows)
    if hit.size:
      sessions.drop(sid, f"memory {names[int(hit[0])]!r} among its candidates was {verb} "
                         f"(Memory.{'update' if verb == 'updated' else 'delete'})")
      stats["sessions_dropped_by_delete"] += 1
  driver.ready = [_mask_item(it, rows) for it in driver.ready]
  _forget_buffer(driver, rows, old, driver.config.dim)
  stats[DELETED_STAT] += len(rows)


def records(bank: bank_lib.Bank, ids: list[str]) -> list[dict]:
  """`[{'id', 'text', 'store', 'scope', 'date'}]` of live memory ids (checked), in order."""
  return bank.records(rows_of(bank, ids))


def list_records(bank: bank_lib.Bank, names: Optional[tuple]) -> list[dict]:
  """`records` of the live memories of scopes `names` (None: every scope), in bank row order."""
  live = bank.store_codes < DELETED
  if names is not None:
    live &= np.isin(bank.scope_codes, np.asarray(bank.scope_filter(names).codes, np.int32))
  return bank.records(np.flatnonzero(live))


def check_update(memory_id, text, embedding, dim: int):
  """`(memory_id, text or None, [1, d] embedding or None)` of an update, validated before anything
  changes: ValueError / InputTypeError for a non-string id or text, an invalid embedding, or an
  update that changes nothing."""
  if not isinstance(memory_id, str):
    raise bank_lib.InputTypeError(f"memory_id must be a string, got {type(memory_id).__name__}")
  bank_lib.check_id_chars([memory_id], "memory_id")  # (a tombstone's id is never a memory's)
  if text is None and embedding is None:
    raise ValueError(f"update of memory {memory_id!r} changes nothing: pass text= and/or "
                     "embedding=")
  if text is not None:
    if not isinstance(text, str):
      raise bank_lib.InputTypeError(f"text must be a string, got {type(text).__name__}")
    text = bank_lib.check_text_list(text, "text")[0]
  emb = None
  if embedding is not None:
    arr = encoder_base.real_array(embedding, "embedding")
    emb = bank_lib.check_embeddings(arr[None] if arr.ndim == 1 else arr, 1, dim, "embedding")
  return memory_id, text, emb


def replace_row(bank: bank_lib.Bank, sessions, driver, memory_id: str, text: Optional[str],
                emb: np.ndarray, stats) -> None:
  """The update itself (call under the lock): `forget_rows` of the memory's row, then a new row
  with the same id, store, scope and date, the new text (None: the old one) and `emb [1, d]`."""
  row = int(rows_of(bank, [memory_id], "memory_id")[0])
  new_text = bank.texts[row] if text is None else text
  code = bank.store_codes[row:row + 1].copy()
  scope, date = bank.scope_names[int(bank.scope_codes[row])], bank.dates[row]
  forget_rows(bank, sessions, driver, np.asarray([row], np.int32), stats, verb="updated")
  bank.append([memory_id], [new_text], code, emb, [scope], [date])
  stats["memories_updated"] += 1


def purge_older_steps(store, deleted: int) -> None:
  """Deletes the main steps older than the newest that were written before its `deleted`-th
  deletion (their shards and indexes go with the `_prune` that follows). Call under the store's
  writer lock, after the new step was written and verified."""
  steps = store.steps()
  for step in steps[:-1]:
    try:
      got = int(store.read_meta(step, verify=False).get("stats", {}).get(DELETED_STAT, 0))
    except Exception:  # pylint: disable=broad-except  (unreadable: it may hold a deleted memory)
      got = None
    if (got is None and deleted) or (got is not None and got != deleted):
      store.delete(step)
