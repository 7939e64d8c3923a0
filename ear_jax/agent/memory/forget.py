"""Forgetting: what `Memory.delete` / `update` do to the learner's side of a memory.

Symbols: `K` candidates, `C` replay buffer capacity, `r` rows deleted.

A deleted memory's row leaves the table in one transaction (`table.Table.delete`: SQLite's
`secure_delete` overwrites its bytes, the rollback journal is unlinked at the commit), is
tombstoned on the device (`bank.tombstone`: invalid, zero) and in the lexical index and the ANN
searcher, and `<dir>/ann` is removed when it covers the row, all in the locked call of
`Memory.delete`. Row numbers are never reused, so everything that refers to the row forgets it
here, in the same call:

* open sessions whose candidates include it are DROPPED without training (their rounds' feedback
  was given on slates that contained it; their handles then raise `SessionDroppedError` naming
  the memory); a frozen session (`recall(learn=False)`) only masks it out of its later rounds;
* queued training items and the replay buffer keep their experiences with that candidate masked
  out (`driver.Driver.forget`), so the rest of the feedback still trains.

The saved learner item never held the memory's embedding or text (candidates are saved as bank
rows, `driver`), so no file of the memory directory keeps its bytes once the call returns; on
open, a saved session or item that refers to a row deleted since is dropped or masked the same
way. The learner item holds the question of an open session only (`sessions.Sessions.snapshot`);
when a delete drops a session whose question it holds, `Memory` saves it again before the call
returns, and an open that drops one (a process killed in between) saves it before serving.

Correcting: `Memory.update(id, text=..., embedding=...)` is a delete of the memory's row (all of
the above) and an insert of a new row with the same id, store, scope and date, in ONE table
transaction (`Table.replace`) and one locked call.
"""
from __future__ import annotations

import numpy as np

from ear_jax.agent.memory import checks as checks_lib
from ear_jax.data import encoder_base


def check_ids(ids, what: str = "ids") -> list[str]:
  """One id or a non-empty sequence of distinct string ids, as a list (no lookup)."""
  ids = checks_lib.string_list(ids, what, "memory id")
  dup = sorted({i for i in ids if ids.count(i) > 1})
  if dup:
    raise ValueError(f"{what}: duplicate memory ids {dup[:5]}")
  return ids


def unknown_ids(ids: list[str], rows: np.ndarray, what: str) -> ValueError:
  """The error of ids whose `rows` are -1 (never added, or deleted)."""
  unknown = [i for i, r in zip(ids, rows) if r < 0]
  shown = ", ".join(repr(i) for i in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
  return ValueError(f"{what}: unknown memory id(s) {shown} ({len(unknown)} of {len(ids)}; they "
                    "were never added or were deleted); nothing was changed")


def check_update(memory_id, text, embedding, dim: int):
  """`(memory_id, text or None, [1, d] embedding or None)` of an update, validated before anything
  changes: ValueError / InputTypeError for a non-string id or text, an invalid embedding, or an
  update that changes nothing."""
  if not isinstance(memory_id, str):
    raise checks_lib.InputTypeError(f"memory_id must be a string, got {type(memory_id).__name__}")
  checks_lib.check_id_chars([memory_id], "memory_id")
  if text is None and embedding is None:
    raise ValueError(f"update of memory {memory_id!r} changes nothing: pass text= and/or "
                     "embedding=")
  if text is not None:
    if not isinstance(text, str):
      raise checks_lib.InputTypeError(f"text must be a string, got {type(text).__name__}")
    text = checks_lib.check_text_list(text, "text")[0]
  emb = None
  if embedding is not None:
    arr = encoder_base.real_array(embedding, "embedding")
    emb = checks_lib.check_embeddings(arr[None] if arr.ndim == 1 else arr, 1, dim, "embedding")
  return memory_id, text, emb


def forget_rows(sessions, driver, rows: np.ndarray, names: dict, stats, verb: str) -> None:
  """The learner's side of deleting bank `rows` (see the module docstring): sessions showing one
  dropped (naming the memory, `names[row]`, and `verb`), frozen ones masked, queued items and the
  replay buffer masked. Call under the memory's lock."""
  for sid, s in list(sessions.by_id.items()):
    hit = np.isin(s.cand_idx, rows) & s.cand_mask
    if not hit.any():
      continue
    if s.frozen:
      s.cand_mask = s.cand_mask & ~hit
      continue
    memory_id = names[int(s.cand_idx[np.flatnonzero(hit)[0]])]
    sessions.drop(sid, f"memory {memory_id!r} among its candidates was {verb} "
                       f"(Memory.{'update' if verb == 'updated' else 'delete'})")
    stats["sessions_dropped_by_delete"] += 1
  driver.forget(rows)
