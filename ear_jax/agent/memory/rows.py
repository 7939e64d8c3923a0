"""`Rows`: where a `Memory`'s memories live, and the one place a row is written or dropped.

Symbols: `n` rows of one call, `d` dimension, `K` candidates, `q` queries, `C` bank capacity.

A row lives in the table (the durable copy) and, derived from it, in the device bank, the scope
bookkeeping, the lexical index and an optional ANN searcher. `insert`, `delete` and `replace` write
the table first (one transaction), then every other place, so each holds exactly the table's
rows. Row numbers are never reused. Not thread-safe on its own: `Memory` holds its lock.
"""
from __future__ import annotations

import pathlib
from typing import Optional

import numpy as np

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import checks as checks_lib
from ear_jax.agent.memory import lexical_bank
from ear_jax.agent.memory import persistence
from ear_jax.agent.memory import scopes as scopes_lib
from ear_jax.agent.memory import table as table_lib
from ear_jax.core.config import EARConfig


class Rows:
  """The memories of one `Memory`: `table` and everything derived from it (`root`'s `ann/`
  loaded when present)."""

  def __init__(self, table: table_lib.Table, cfg, config: EARConfig,
               root: Optional[pathlib.Path] = None):
    self.table, self.dim, self.root = table, config.dim, root
    self.multistore = cfg.multistore
    held = table.read_all()
    self.next_row = int(held.next_row)
    self.scopes, codes = scopes_lib.ScopeNames.from_rows(
        [held.scope_names[c] for c in held.scope_codes], held.stores,
        held_before=held.next_row > len(held.rows))
    self.scope_rows = scopes_lib.ScopeRows(held.rows, codes)
    self.lexical = None
    if lexical_bank.needs_lexical(cfg.first_stage_name, config.side_features):
      self.lexical = lexical_bank.LexicalBank(cfg.first_stage_name, cfg.first_stage,
                                              cfg.multistore)
      self.lexical.restore(held, codes)
    self.bank = bank_lib.write(
        bank_lib.empty(self.dim, max(cfg.initial_capacity, config.num_candidates, held.next_row),
                       cfg.bank_dtype),
        held.rows, held.embeddings, held.stores, codes)
    self.searcher = None
    if cfg.index != "exact" and root is not None:
      self.searcher = bank_lib.Searcher.load(root / persistence.ANN, cfg.index,
                                             dict(cfg.index_options), self.dim, held.rows,
                                             held.embeddings, held.stores, codes)
      if self.searcher.stale_file is not None:  # (a kill between a delete's commit and its
        persistence.remove_ann(root)  # `remove_ann`: it may hold the deleted rows' vectors)
    elif cfg.index != "exact":
      self.searcher = bank_lib.ann_searcher(cfg.index, dict(cfg.index_options), self.dim)
      self.searcher.add(held.rows, held.embeddings, held.stores, codes)
    self._ann_rows = self.next_row if root is not None and (root / persistence.ANN).exists() else 0

  def __len__(self):
    return len(self.table)

  @property
  def capacity(self) -> int:
    return self.bank.emb.shape[0]

  # -- reading -------------------------------------------------------------------------------------

  def records(self, rows) -> list[dict]:
    """`{id, text, store (name), scope, date, row}` of held rows, in order."""
    return [dict(r, store=checks_lib.STORE_NAMES[int(r["store"])])
            for r in self.table.records(rows)]

  def rows_of(self, ids: list[str], what: str) -> np.ndarray:
    """`[n]` the rows of memory ids (ValueError naming the unknown ones, nothing changed)."""
    rows = self.table.rows_of(ids)
    if (rows < 0).any():
      raise checks_lib.unknown_ids(ids, rows, what)
    return rows

  def held_records(self, ids) -> dict:
    """`{id: record}` of those of `ids` the table holds."""
    rows = self.table.rows_of(ids)
    return {r["id"]: r for r in self.records(rows[rows >= 0])}

  def live(self, rows) -> np.ndarray:
    """`[..]` bool: which device rows hold a memory now."""
    rows = np.asarray(rows)
    ok = (rows >= 0) & (rows < self.capacity)
    return ok & np.asarray(self.bank.valid)[np.where(ok, rows, 0)]

  def gather(self, rows, mask):
    """`[n, K, d]` embeddings of device rows `[n, K]` that are live and in `mask` (0 elsewhere)."""
    ok = self.live(rows) & mask
    return bank_lib.gather(self.bank, np.where(ok, rows, 0), ok)

  def rows_of_embeddings(self, emb: np.ndarray) -> np.ndarray:
    """`[n]` the rows holding exactly the embeddings `emb [n, d]`; -1: none."""
    held = self.table.read_all()
    index = {e.tobytes(): int(r) for r, e in zip(held.rows, held.embeddings)}
    emb = np.asarray(emb, np.float32)
    again = checks_lib.check_embeddings(emb, len(emb), self.dim, "the learner's candidates")
    return np.asarray([index.get(e.tobytes(), index.get(a.tobytes(), -1))
                       for e, a in zip(emb, again)], np.int64)

  def first_stage(self, texts, q_emb, scopes, k: int, slate=None):
    """The top `k` candidates of `[q, d]` queries in their `scopes`, in one call (`bank.search`)."""
    allowed = (self.scopes.allowed(scopes[0]) if all(x == scopes[0] for x in scopes)
               else [self.scopes.allowed(x) for x in scopes])
    if self.lexical is None:
      return bank_lib.search(self.bank, q_emb, k=k, multistore=self.multistore, allowed=allowed,
                             slate=slate, searcher=self.searcher, scope_rows=self.scope_rows)
    return self.lexical.search(self.bank, q_emb, texts, k, allowed=allowed, slate=slate,
                               scope_rows=self.scope_rows)

  # -- writing: the table first (one transaction), then every other place --------------------------

  def check_new(self, ids: list[str]) -> None:
    taken = [i for i, r in zip(ids, self.table.rows_of(ids)) if r >= 0]
    if taken:
      raise ValueError(f"memory ids {taken[:5]} are already in the bank")

  def new_ids(self, n: int) -> list[str]:
    """`n` free ids `"m<j>"`, `j` counting up from the next row, skipping taken ones."""
    ids, j = [], self.next_row
    while len(ids) < n:
      want = [f"m{i}" for i in range(j, j + n - len(ids))]
      ids += [i for i, r in zip(want, self.table.rows_of(want)) if r < 0]
      j += len(want)
    return ids

  def tokenize(self, texts):
    """The texts' tokens for the lexical index (None without one): pure, outside the lock."""
    return None if self.lexical is None else lexical_bank.tokenize(texts)

  def insert(self, ids, texts, codes, scope: str, dates, emb, tokens, source: str) -> np.ndarray:
    """Inserts checked rows: ONE table transaction, then every other place. Returns their rows."""
    enc = None if tokens is None else self.lexical.encode(tokens, codes)
    terms = None if enc is None else [np.zeros(0, np.int32) if t is None else t
                                      for t in enc.terms]  # (not indexed: no terms)
    rows = self.table.insert(ids, texts, codes, [scope] * len(ids), dates, emb, terms,
                             () if enc is None else enc.new_vocab, source)
    self._put(rows, emb, codes, scope, enc)
    return rows

  def delete(self, rows: np.ndarray) -> list[dict]:
    """Drops held rows (table first, then every other place); returns their records."""
    recs = self.records(rows)
    self.table.delete(rows, () if self.lexical is None else self.lexical.dead_terms(rows))
    if self.lexical is not None:
      self.lexical.delete(rows)
    self._unput(rows, recs)
    return recs

  def replace(self, row: int, text: Optional[str], emb, source: str) -> tuple[dict, int]:
    """Replaces a held row's text (None: kept) and `[1, d]` embedding in ONE table transaction
    (same id, store, scope, date and place). Returns `(the old record, the new row)`."""
    rows = np.asarray([row])
    rec = self.records(rows)[0]
    new_text = rec["text"] if text is None else text
    code = np.asarray([checks_lib.STORES[rec["store"]]], np.int8)
    enc, lex = None, (None, (), ())
    if self.lexical is not None:
      enc = self.lexical.encode(lexical_bank.tokenize([new_text]), code)
      lex = (enc.terms[0], enc.new_vocab, self.lexical.dead_terms(rows, keep=enc))
    new = self.table.replace(int(row), rec["id"], new_text, int(code[0]), rec["scope"],
                             rec["date"], emb[0], *lex, source=source)
    self._unput(rows, [rec])
    self._put(np.asarray([new]), emb, code, rec["scope"], enc)
    if self.lexical is not None:
      self.lexical.delete(rows)
    return rec, int(new)

  def _put(self, rows, emb, codes, scope: str, enc) -> None:
    """Rows the table just took into the bank, the scopes, the searcher and the lexicon."""
    scodes = self.scopes.codes([scope] * len(rows))
    self.scopes.count(scodes, codes)
    self.scope_rows.add(rows, scodes)
    self.bank = bank_lib.write(self.bank, rows, emb, codes, scodes)
    if self.searcher is not None:
      self.searcher.add(rows, emb, codes, scodes)
    if self.lexical is not None:
      self.lexical.add(rows, enc, scodes)
    self.next_row = int(rows[-1]) + 1

  def _unput(self, rows: np.ndarray, recs: list[dict]) -> None:
    """Rows the table just dropped out of the bank, the scopes, the searcher and its file."""
    self.scopes.count(self.scopes.codes([r["scope"] for r in recs]),
                      checks_lib.store_codes([r["store"] for r in recs], len(recs)), -1)
    self.bank = bank_lib.tombstone(self.bank, rows)
    self.scope_rows.remove(rows)
    if self.searcher is not None:
      self.searcher.remove(rows, self.bank)
      if self.root is not None and int(rows.min()) < self._ann_rows:
        persistence.remove_ann(self.root)
        self._ann_rows = 0

  # -- files ---------------------------------------------------------------------------------------

  def save_ann(self) -> None:
    """Writes the searcher's files (`<dir>/ann`), covering every row so far."""
    if self.searcher is not None:
      self.searcher.save(self.root / persistence.ANN)
      self._ann_rows = self.next_row

  @property
  def closed(self) -> bool:
    return isinstance(self.table, _ClosedTable)

  def close(self) -> None:
    """Closes the table: every later use of these rows is a ValueError saying so."""
    if not self.closed:
      self.table.close()
      self.table = _ClosedTable(self.root)

  def move_to(self, root: pathlib.Path, path: pathlib.Path) -> None:
    """Copies the table into the new database file `path` of the directory `root` and uses it."""
    self.table.backup_to(path)
    self.table.close()
    self.table = table_lib.Table(path, self.dim)
    self.root = root


class _ClosedTable:
  """The table of a closed memory: every use is a ValueError saying so."""

  def __init__(self, root):
    self._where = "this memory" if root is None else f"memory {str(root)!r}"

  def __getattr__(self, name):
    raise ValueError(f"{self._where} is closed (Memory.close): open it again")

  def __len__(self):
    return self.__getattr__("__len__")
