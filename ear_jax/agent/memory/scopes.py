"""Scopes on the host: scope name <-> int32 code with the live rows per scope and store
(`ScopeNames`), and each scope's device rows in order (`ScopeRows`, so a scoped search reads only
its scopes' rows)."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ear_jax.agent.memory.bank import pow2_at_least
from ear_jax.agent.memory.checks import DEFAULT_SCOPE


class ScopeNames:
  """Scope name <-> int32 code (`DEFAULT_SCOPE` is 0), live rows per scope and store."""

  def __init__(self):
    self.names: list[str] = [DEFAULT_SCOPE]
    self._index = {DEFAULT_SCOPE: 0}
    self.counts = np.zeros((1, 2), np.int64)
    self.held_before = False  # whether rows were ever counted (then "all were deleted")

  @classmethod
  def from_rows(cls, scopes: Sequence[str], stores, held_before: bool = False):
    """`(ScopeNames, codes [n] int32)` of the live rows' scope names and store codes `[n]`."""
    names = cls()
    codes = names.codes(scopes)
    names.count(codes, stores)
    names.held_before = names.held_before or held_before
    return names, codes

  def codes(self, names: Sequence[str]) -> np.ndarray:
    """`[n]` int32 codes of scope names, registering the new ones."""
    for name in names:
      if name not in self._index:
        self._index[name] = len(self.names)
        self.names.append(name)
    if len(self.names) > len(self.counts):
      self.counts = np.concatenate([self.counts,
                                    np.zeros((len(self.names) - len(self.counts), 2), np.int64)])
    return np.asarray([self._index[x] for x in names], np.int32).reshape(-1)

  def _known(self, names: Sequence[str]) -> list[int]:
    return sorted({self._index[x] for x in names if x in self._index})

  def allowed(self, names: Optional[Sequence[str]]) -> Optional[np.ndarray]:
    """`[S]` bool, True at the codes of `names`, `S` padded to a power of two; None for None."""
    if names is None:
      return None
    allowed = np.zeros(pow2_at_least(len(self.names)), bool)
    allowed[self._known(names)] = True
    return allowed

  def count(self, codes, stores, sign: int = 1) -> None:
    """Adds (`sign` 1) or removes (-1) live rows of scope `codes [n]` and `stores [n]`."""
    np.add.at(self.counts, (np.asarray(codes, np.int64), np.asarray(stores, np.int64)), sign)
    self.held_before = self.held_before or (sign > 0 and np.size(codes) > 0)

  def _held(self, names) -> np.ndarray:
    return self.counts.sum(0) if names is None else self.counts[self._known(names)].sum(0)

  def available(self, num_candidates: int, multistore: bool,
                names: Optional[Sequence[str]] = None) -> int:
    """How many candidates a query of the scopes `names` can get (at most `K`)."""
    held = self._held(names)
    if not multistore:
      return min(int(held[0]), num_candidates)
    return sum(min(int(c), num_candidates // 2) for c in held)

  def check_any(self, num_candidates: int, multistore: bool,
                names: Optional[Sequence[str]] = None, k: Optional[int] = None) -> None:
    """ValueError naming the scopes (and `k`) when a query of `names` has no candidate at all."""
    if self.available(num_candidates, multistore, names):
      return
    held = int(self._held(names).sum())
    where = "the bank" if names is None else (
        f"scope {names[0]!r}" if len(names) == 1 else f"scopes {list(names)!r}")
    if names is None and not held and self.held_before:
      empty_ = "the memory holds no memories (all were deleted)"
    elif multistore or not held:
      empty_ = "the bank is empty" if names is None else f"{where} holds no memories"
    else:
      empty_ = (f"{'the bank is empty of' if names is None else where + ' holds no'} dialogue "
                "memories (observations are candidates only with multistore)")
    raise ValueError(f"no memory to retrieve{'' if k is None else f' (k={k})'}: {empty_}")


class ScopeRows:
  """The device rows `[n]` of each scope code (`codes [n]`), ascending; no pass over the bank."""

  def __init__(self, rows=(), codes=()):
    self._code = np.zeros(0, np.int32)  # [rows] scope code + 1 of each held row (0: none)
    self._bufs: list[np.ndarray] = []  # per code, its rows ascending in the first `_sizes[c]`
    self._sizes = np.zeros(0, np.int64)  # [S] rows held per code
    self.add(rows, codes)

  def add(self, rows, codes) -> None:
    """Holds device `rows [n]` (not held now) of scope `codes [n]`."""
    rows = np.asarray(rows, np.int64).reshape(-1)
    codes = np.broadcast_to(np.asarray(codes, np.int64), rows.shape)
    if not len(rows):
      return
    if rows.max() >= len(self._code):
      self._code = np.concatenate([self._code, np.zeros(
          max(int(rows.max()) + 1, 2 * len(self._code)) - len(self._code), np.int32)])
    self._code[rows] = codes + 1
    order = np.lexsort((rows, codes))
    rows, codes = rows[order], codes[order]
    cut = np.flatnonzero(np.diff(codes)) + 1
    top = int(codes[-1]) + 1
    if top > len(self._sizes):
      self._bufs += [np.zeros(0, np.int32)] * (top - len(self._sizes))
      self._sizes = np.concatenate([self._sizes, np.zeros(top - len(self._sizes), np.int64)])
    for c, new in zip(codes[np.concatenate([[0], cut])].tolist(), np.split(rows, cut)):
      buf, n = self._bufs[c], int(self._sizes[c])
      if n and new[0] <= buf[n - 1]:  # (not above the rows held: merge)
        new = np.union1d(buf[:n], new)
        n = 0
      if n + len(new) > len(buf):
        buf = np.concatenate([buf[:n], np.zeros(max(n + len(new), 2 * len(buf)) - n, np.int32)])
      buf[n:n + len(new)] = new
      self._bufs[c], self._sizes[c] = buf, n + len(new)

  def remove(self, rows) -> None:
    """Drops device `rows [n]` (those not held are ignored)."""
    rows = np.asarray(rows, np.int64).reshape(-1)
    rows = rows[rows < len(self._code)]
    codes = self._code[rows].astype(np.int64) - 1
    rows, codes = rows[codes >= 0], codes[codes >= 0]
    self._code[rows] = 0
    for c in np.unique(codes).tolist():
      n = int(self._sizes[c])
      keep = self._bufs[c][:n][~np.isin(self._bufs[c][:n], rows[codes == c])]
      self._bufs[c][:len(keep)] = keep
      self._sizes[c] = len(keep)

  def _codes(self, allowed: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.asarray(allowed, bool)[:len(self._sizes)])

  def size(self, allowed: np.ndarray) -> int:
    """Rows held in the scopes `allowed` (`[S]` bool over scope codes)."""
    return int(self._sizes[self._codes(allowed)].sum())

  def of(self, allowed: np.ndarray) -> np.ndarray:
    """`[n]` int32 rows of the scopes `allowed`, ascending (may be a view: copy before writing)."""
    parts = [self._bufs[c][:self._sizes[c]] for c in self._codes(allowed).tolist()]
    if len(parts) == 1:
      return parts[0]
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int32)

