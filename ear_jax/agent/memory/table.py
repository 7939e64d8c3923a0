"""The rows of a memory in SQLite (`<dir>/rows.sqlite`): dumb, durable, verified storage.

Symbols: `n` live rows, `d` embedding dimension.

A `memories` table (id, text, store, scope, date, float32 embedding `[d]`, term ids, and a SHA-256
of them with the row number), the lexical vocabulary, and a `meta` table with its own SHA-256.
  * Durable: each `insert` / `delete` / `replace` is ONE transaction (`synchronous=FULL`) on disk
    when it returns; a kill leaves every acknowledged row, nothing half-written.
  * Forgetting leaves no bytes: `secure_delete=ON` and `journal_mode=DELETE`.
  * Row numbers are never reused (`AUTOINCREMENT`); the API speaks device rows, `row - 1`.
  * Verified: each row read against its SHA-256; at open, `integrity_check` and the meta digest.
    A damaged or foreign file is a `CheckpointError` naming the file (and the row's id).
Not thread-safe: `Memory` calls it under its lock.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import pathlib
import secrets
import sqlite3
from typing import NamedTuple, Optional, Sequence

import numpy as np

from ear_jax.io.checkpoints import CheckpointError

_SCHEMA = (
    "CREATE TABLE memories(row INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, "
    "text TEXT NOT NULL, store INTEGER NOT NULL, scope TEXT NOT NULL, date TEXT NOT NULL, "
    "embedding BLOB NOT NULL, terms BLOB, sha256 TEXT NOT NULL)",
    "CREATE INDEX memories_scope ON memories(scope)",
    "CREATE TABLE vocab(term TEXT PRIMARY KEY, id INTEGER UNIQUE NOT NULL)",
    "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT)",
)
_FORMAT = "ear_jax.agent.memory.table/1"
_COLUMNS = "row, id, text, store, scope, date, embedding, terms, sha256"
_PART = 65536  # rows of embeddings joined at a time by read_all
_PLACES = "places"  # meta entry: {row: place} of updated memories, written by older versions
_IDENTITY = "identity"  # meta entry: a random id made with the table (`Table.identity`)
_META_DIGEST = "sha256"  # meta entry: SHA-256 of the other entries (`_meta_digest`)
_EMBEDDED_BY = "embedded_by"  # meta entry: `Table.embedded_by`
RECORD_CACHE = 1 << 15  # verified records `records` keeps (the least recently read dropped first)


class TableRows(NamedTuple):
  """Every live row of a table, verified (`Table.read_all`), in row order."""
  rows: np.ndarray  # [n] int64 device rows (ascending)
  stores: np.ndarray  # [n] int8 store codes
  scope_codes: np.ndarray  # [n] int32 codes into `scope_names` (in order of first row)
  scope_names: list
  embeddings: np.ndarray  # [n, d] float32
  terms: np.ndarray  # [sum] int32 term ids; row i's: `terms[term_offsets[i]:term_offsets[i + 1]]`
  term_offsets: np.ndarray  # [n + 1] int64
  vocab: list  # (term, id) pairs of the lexical vocabulary
  next_row: int  # the device rows < next_row were ever used (the next insert gets next_row)


def _digest(row: int, memory_id: str, text: str, store: int, scope: str, date: str,
            embedding: bytes, terms: Optional[bytes]) -> str:
  """SHA-256 (hex) of a row: the embedding's bytes; the sqlite row, the store and the byte lengths
  of id, text, scope, date and terms (-1: NULL) as decimal text; then the bytes of those five."""
  fields = (memory_id.encode(), text.encode(), scope.encode(), date.encode())
  h = hashlib.sha256(embedding)
  h.update(b"%d,%d,%d,%d,%d,%d,%d;" % (row, store, *map(len, fields),
                                       -1 if terms is None else len(terms)))
  h.update(b"".join(fields))
  if terms:
    h.update(terms)
  return h.hexdigest()


class Table:
  """The table at `path` (created when new; None: in memory) of embeddings of dimension `dim`.

  Raises:
    CheckpointError: `path` is not this table or was damaged, naming the file and the problem.
  """

  def __init__(self, path: Optional[pathlib.Path], dim: int):
    self.dim = int(dim)
    self.where = "an in-memory table" if path is None else str(path)
    with self._errors():
      self._db = sqlite3.connect(":memory:" if path is None else str(path), isolation_level=None,
                                 check_same_thread=False)
    try:
      with self._errors():
        for pragma in ("secure_delete=ON", "synchronous=FULL", "foreign_keys=ON",
                       "cache_size=-65536", "mmap_size=2147418112"):  # (64 MB cache; reads mapped)
          self._db.execute(f"PRAGMA {pragma}")
        mode = self._db.execute("PRAGMA journal_mode=DELETE").fetchone()[0]
        if mode != ("memory" if path is None else "delete"):
          raise CheckpointError(f"{self.where}: cannot use a rollback journal (mode {mode})")
        self._open(path)
    except BaseException:
      self._db.close()
      raise

  def _open(self, path) -> None:
    found = [s for (s,) in self._db.execute(  # (rolls back what a killed writer left)
        "SELECT sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY rowid")]
    if path is not None:  # a journal now is not hot (that read rolled a hot one back): a writer
      # killed before its first sync left it, with old pages (owner-locked)
      pathlib.Path(f"{path}-journal").unlink(missing_ok=True)
      if os.path.getsize(path) % self._db.execute("PRAGMA page_size").fetchone()[0]:
        raise CheckpointError(f"{self.where}: not a memory table (not a whole number of pages: "
                              "truncated?)")
    if not found:
      with self._transaction():
        for statement in _SCHEMA:
          self._db.execute(statement)
        self._db.executemany("INSERT INTO meta VALUES (?, ?)",
                             [("format", _FORMAT), ("dim", str(self.dim)),
                              (_IDENTITY, secrets.token_hex(16))])
        self._seal_meta()
    elif found != list(_SCHEMA):
      raise CheckpointError(f"{self.where}: not a memory table of this version (another schema)")
    else:
      with self._errors():
        problems = [p for (p,) in self._db.execute("PRAGMA integrity_check(5)")]
      if problems != ["ok"]:
        raise CheckpointError(
            f"{self.where}: fails SQLite's integrity check ({'; '.join(problems)}): the file was "
            "changed outside ear_jax (an index that disagrees with its table would name another "
            "memory for an id or a word)")
      if self.get_meta("format") != _FORMAT:
        raise CheckpointError(f"{self.where}: not a memory table of this version (another "
                              "schema)")
    if self.get_meta("dim") != str(self.dim):
      raise CheckpointError(f"{self.where}: holds embeddings of dimension {self.get_meta('dim')}, "
                            f"expected {self.dim}")
    self.identity = self._check_meta()  # a random hex id made with the table (a copy keeps it)
    self._n = self._db.execute("SELECT count(*) FROM memories").fetchone()[0]
    self._check_places()
    # 'encoder' (some row's embedding came from an encoder), 'caller' (all from the caller), None
    self.embedded_by = self.get_meta(_EMBEDDED_BY)
    self._recent = collections.OrderedDict()  # device row -> (id, text, store, scope, date)

  def _meta_digest(self) -> str:
    """SHA-256 (hex) of the meta table's entries but the digest, in key order."""
    with self._errors():
      entries = self._db.execute("SELECT key, value FROM meta WHERE key != ? ORDER BY key",
                                 (_META_DIGEST,)).fetchall()
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()

  def _seal_meta(self) -> None:
    """Writes the meta table's digest (inside the caller's transaction)."""
    self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                     (_META_DIGEST, self._meta_digest()))

  def _check_meta(self) -> str:
    """The table's identity, after checking the meta table against its digest."""
    digest = self.get_meta(_META_DIGEST)
    if digest is None:
      with self._transaction():
        if self.get_meta(_IDENTITY) is None:
          self._db.execute("INSERT INTO meta VALUES (?, ?)", (_IDENTITY, secrets.token_hex(16)))
        self._seal_meta()
    elif digest != self._meta_digest():
      raise CheckpointError(f"{self.where}: its meta table (dimension, identity, places of "
                            "updated memories) fails its SHA-256 check: it was changed outside "
                            "ear_jax")
    return self.get_meta(_IDENTITY)

  def _check_places(self) -> None:
    """Checks an older version's meta `places` (device row -> place of updated memories)."""
    raw = self.get_meta(_PLACES)
    try:
      if raw:
        for r, p in json.loads(raw).items():  # validate only: the places are no longer read
          int(r)
          int(p)
    except (ValueError, TypeError, AttributeError):
      raise CheckpointError(f"{self.where}: its '{_PLACES}' entry is not a JSON object of row "
                            "places: it was changed outside ear_jax") from None

  @contextlib.contextmanager
  def _errors(self):
    """sqlite3 errors as CheckpointError (ValueError for a duplicate id) naming the file."""
    try:
      yield
    except sqlite3.IntegrityError as e:
      raise ValueError(f"{self.where}: {e} (a memory id that is already stored?)") from None
    except sqlite3.Error as e:
      raise CheckpointError(f"{self.where}: not a readable memory table ({e})") from None

  @contextlib.contextmanager
  def _transaction(self):
    """One transaction, committed (durably) when the block ends, rolled back when it raises."""
    with self._errors():
      self._db.execute("BEGIN IMMEDIATE")
      try:
        yield
      except BaseException:
        if self._db.in_transaction:
          self._db.execute("ROLLBACK")
        self._n = self._db.execute("SELECT count(*) FROM memories").fetchone()[0]
        self.embedded_by = self.get_meta(_EMBEDDED_BY)
        raise
      self._db.execute("COMMIT")

  def __len__(self) -> int:
    return self._n

  def close(self) -> None:
    self._db.close()

  def _next(self) -> int:
    got = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'memories'").fetchone()
    return got[0] if got else 0

  def _note_source(self, source: Optional[str]) -> None:
    """Records `embedded_by` for new rows (inside the caller's transaction)."""
    if source is None:
      return
    new = "encoder" if "encoder" in (source, self.embedded_by) else "caller"
    if new != self.embedded_by:
      self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (_EMBEDDED_BY, new))
      self._seal_meta()
      self.embedded_by = new

  def _insert(self, ids, texts, stores, scopes, dates, embeddings, terms, new_vocab):
    emb = np.ascontiguousarray(embeddings, np.float32)
    columns = (ids, texts, stores, scopes, dates, emb) + (() if terms is None else (terms,))
    if emb.ndim != 2 or emb.shape[1] != self.dim or len({len(c) for c in columns}) != 1:
      raise ValueError(f"{self.where}: columns of lengths {[len(c) for c in columns]} and "
                       f"embeddings {emb.shape} do not match rows of dimension {self.dim}")
    first, rows = self._next() + 1, []
    for j, (i, t, st, sc, da, e) in enumerate(zip(ids, texts, stores, scopes, dates, emb)):
      te = None if terms is None else np.ascontiguousarray(terms[j], np.int32).tobytes()
      e, row = e.tobytes(), first + j
      rows.append((row, i, t, int(st), sc, da, e, te, _digest(row, i, t, int(st), sc, da, e, te)))
    self._db.executemany(f"INSERT INTO memories({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)", rows)
    self._db.executemany("INSERT INTO vocab VALUES (?, ?)", new_vocab)
    self._n += len(rows)
    return np.arange(first - 1, first - 1 + len(rows), dtype=np.int64)

  def _delete(self, rows, dead_terms) -> None:
    for r in rows:  # (before the delete: a rolled-back one only costs a read again)
      self._recent.pop(int(r), None)
    self._n -= self._db.executemany("DELETE FROM memories WHERE row = ?",
                                    [(int(r) + 1,) for r in rows]).rowcount
    self._db.executemany("DELETE FROM vocab WHERE term = ?", [(t,) for t in dead_terms])

  def insert(self, ids, texts, stores: np.ndarray, scopes: Sequence[str], dates, embeddings,
             terms: Optional[Sequence[np.ndarray]] = None,
             new_vocab: Sequence[tuple[str, int]] = (), source: Optional[str] = None
             ) -> np.ndarray:
    """Appends rows in one transaction; returns their device rows `[n]` (`source`: `embedded_by`).

    Raises:
      ValueError: lengths or dimension do not match, or an id is already stored (nothing written).
    """
    with self._transaction():
      rows = self._insert(ids, texts, stores, scopes, dates, embeddings, terms, new_vocab)
      self._note_source(source)
      return rows

  def delete(self, rows, dead_terms: Sequence[str] = ()) -> None:
    """Deletes device `rows` and vocabulary `dead_terms` in one transaction (bytes overwritten)."""
    with self._transaction():
      self._delete(rows, dead_terms)

  def replace(self, row: int, memory_id: str, text: str, store: int, scope: str, date: str,
              embedding, terms=None, new_vocab=(), dead_terms=(), source=None) -> int:
    """An update in one transaction: row `row` deleted, the memory inserted anew; the new row."""
    with self._transaction():
      self._delete([row], dead_terms)
      new = int(self._insert([memory_id], [text], [store], [scope], [date],
                             np.reshape(embedding, (1, -1)), None if terms is None else [terms],
                             new_vocab)[0])
      self._note_source(source)
      return new

  def set_meta(self, key: str, value: str) -> None:
    with self._transaction():
      self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
      self._seal_meta()

  def get_meta(self, key: str) -> Optional[str]:
    with self._errors():
      got = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if got is None else got[0]

  def _verified(self, where: str = "", args=()):
    """The rows (`_COLUMNS`) `where` selects, in row order, each checked against its SHA-256."""
    with self._errors():
      for r in self._db.execute(f"SELECT {_COLUMNS} FROM memories {where} ORDER BY row", args):
        if _digest(*r[:8]) != r[8] or len(r[6]) != 4 * self.dim:
          raise CheckpointError(f"{self.where}: the row of memory id {r[1]!r} fails its SHA-256 "
                                "check: it was changed outside ear_jax")
        yield r

  def read_all(self) -> TableRows:
    """Every live row, verified (`TableRows`)."""
    n, d = self._n, self.dim
    rows, stores, codes, names, terms = [], [], [], {}, []
    emb, part = np.empty((n, d), np.float32), []  # copied in parts: no second [n, d] of bytes
    for row, _, _, store, scope, _, e, t, _ in self._verified():
      rows.append(row - 1)
      stores.append(store)
      codes.append(names.setdefault(scope, len(names)))
      terms.append(t or b"")
      part.append(e)
      if len(part) == _PART or len(rows) == n:
        emb[len(rows) - len(part):len(rows)] = np.frombuffer(b"".join(part), np.float32).reshape(
            -1, d)
        part = []
    if len(rows) != n or part:
      raise CheckpointError(f"{self.where}: changed by another process while it was read")
    with self._errors():
      vocab = self._db.execute("SELECT term, id FROM vocab ORDER BY id").fetchall()
    return TableRows(
        rows=np.asarray(rows, np.int64).reshape(n), stores=np.asarray(stores, np.int8),
        scope_codes=np.asarray(codes, np.int32), scope_names=list(names), embeddings=emb,
        terms=np.frombuffer(b"".join(terms), np.int32),
        term_offsets=np.cumsum([0] + [len(t) // 4 for t in terms], dtype=np.int64),
        vocab=vocab, next_row=self._next())

  def records(self, rows) -> list[dict]:
    """`{id, text, store, scope, date, row}` of the device rows `rows`, verified (the newest
    `RECORD_CACHE` cached); KeyError naming a row that holds no memory."""
    rows = [int(r) for r in rows]
    got = {r: self._recent[r] for r in rows if r in self._recent}
    read = [r for r in dict.fromkeys(rows) if r not in got]
    if read:
      for r in self._verified("WHERE row IN (SELECT value + 1 FROM json_each(?))",
                              (json.dumps(read),)):
        got[r[0] - 1] = r[1:6]
    missing = [r for r in rows if r not in got]
    if missing:
      raise KeyError(f"{self.where}: no memory at rows {missing[:5]}")
    for r in dict.fromkeys(rows):
      self._recent[r] = got[r]
      self._recent.move_to_end(r)
    while len(self._recent) > RECORD_CACHE:
      self._recent.popitem(last=False)
    return [dict(zip(("id", "text", "store", "scope", "date"), got[r]), row=r) for r in rows]

  def rows_of(self, ids) -> np.ndarray:
    """`[n]` int64 device rows of the memory ids `ids` (-1 for an id not stored)."""
    with self._errors():
      got = dict(self._db.execute(
          "SELECT j.value, m.row - 1 FROM json_each(?) j JOIN memories m ON m.id = j.value",
          (json.dumps(list(ids)),)))
    return np.asarray([got.get(i, -1) for i in ids], np.int64)

  def list_rows(self, scopes: Optional[Sequence[str]] = None) -> np.ndarray:
    """`[m]` int64 live device rows of the scopes `scopes` (None: all), in row order."""
    with self._errors():
      if scopes is None:
        got = self._db.execute("SELECT row - 1 FROM memories ORDER BY row")
      else:
        got = self._db.execute("SELECT row - 1 FROM memories WHERE scope IN (SELECT value FROM "
                               "json_each(?)) ORDER BY row", (json.dumps(list(scopes)),))
      return np.asarray([r for (r,) in got], np.int64)

  def backup_to(self, path) -> None:
    """Copies the whole table into a new database file `path` (sqlite3's backup API), durably."""
    with self._errors():
      dst = sqlite3.connect(str(path))
      try:
        dst.execute("PRAGMA synchronous=FULL")
        self._db.backup(dst)
      finally:
        dst.close()

