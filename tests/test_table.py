"""The SQLite table of a memory's rows (`ear_jax.agent.memory.table`): durable, verified, and a
forgotten row leaves no byte in any file of the directory."""
import contextlib
import os
import pathlib
import random
import signal
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

from ear_jax.agent.memory.table import Table
from ear_jax.io.checkpoints import CheckpointError

_REPO = pathlib.Path(__file__).resolve().parent.parent
D = 8


def _add(table, ids, *, texts=None, scope="s", emb=None, terms=None, new_vocab=()):
  n = len(ids)
  emb = np.arange(n * D, dtype=np.float32).reshape(n, D) if emb is None else emb
  return table.insert(ids, texts or [f"text of {i}" for i in ids], np.zeros(n, np.int8),
                      [scope] * n, ["2024-05-01"] * n, emb, terms, new_vocab)


def _files_holding(directory: pathlib.Path, needle: bytes) -> list[str]:
  return [p.name for p in directory.iterdir() if p.is_file() and needle in p.read_bytes()]


@pytest.fixture
def path(tmp_path):
  return tmp_path / "rows.sqlite"


def test_rows_round_trip_in_row_order_with_their_columns(path):
  t = Table(path, D)
  terms = [np.array([3, 1], np.int32), np.array([], np.int32), np.array([2], np.int32)]
  rows = t.insert(["a", "b\u00e9", "c"], ["x\x00y", "y", "z"], np.array([0, 1, 0], np.int8),
                  ["one", "two", "one"], ["d0", "", "d2"], np.eye(3, D, dtype=np.float32), terms,
                  [("x", 1), ("y", 2), ("z", 3)])
  np.testing.assert_array_equal(rows, [0, 1, 2])
  t.close()
  t = Table(path, D)
  got = t.read_all()
  np.testing.assert_array_equal(got.rows, [0, 1, 2])
  np.testing.assert_array_equal(got.stores, [0, 1, 0])
  assert [got.scope_names[c] for c in got.scope_codes] == ["one", "two", "one"]
  np.testing.assert_array_equal(got.embeddings, np.eye(3, D))
  assert [got.terms[a:b].tolist() for a, b in zip(got.term_offsets, got.term_offsets[1:])] == [
      [3, 1], [], [2]]
  assert got.vocab == [("x", 1), ("y", 2), ("z", 3)] and got.next_row == 3 and len(t) == 3
  assert t.records([2, 0]) == [
      dict(id="c", text="z", store=0, scope="one", date="d2", row=2),
      dict(id="a", text="x\x00y", store=0, scope="one", date="d0", row=0)]
  assert t.records([1])[0]["text"] == "y"
  np.testing.assert_array_equal(t.rows_of(["c", "nope", "b\u00e9"]), [2, -1, 1])
  np.testing.assert_array_equal(t.list_rows(["one"]), [0, 2])
  np.testing.assert_array_equal(t.list_rows(), [0, 1, 2])
  with pytest.raises(KeyError, match="no memory at rows"):
    t.records([7])


def test_row_numbers_are_never_reused_after_deletes_and_reopen(path):
  t = Table(path, D)
  _add(t, ["a", "b", "c", "d"])
  t.delete([2, 3])
  t.close()
  t = Table(path, D)
  assert t.read_all().next_row == 4
  np.testing.assert_array_equal(_add(t, ["e"]), [4])
  assert t.replace(4, "e", "e again", 0, "s", "", np.ones(D)) == 5
  t.delete([0, 1, 5])
  t.close()
  t = Table(path, D)
  assert len(t) == 0 and t.read_all().next_row == 6
  np.testing.assert_array_equal(_add(t, ["a"]), [6])


def test_a_failed_insert_writes_nothing(path):
  t = Table(path, D)
  _add(t, ["a"])
  with pytest.raises(ValueError, match="already stored"):
    _add(t, ["b", "a"])
  with pytest.raises(ValueError, match="do not match"):
    t.insert(["c"], ["t"], [0], ["s"], [""], np.ones((1, D + 1)))
  assert len(t) == 1 and t.rows_of(["b"])[0] == -1
  np.testing.assert_array_equal(_add(t, ["b"]), [1])


def test_the_table_records_where_its_embeddings_came_from_across_reopen_and_rollback(path):
  t = Table(path, D)
  assert t.embedded_by is None  # (no row yet)
  t.insert(["a"], ["x"], [0], ["s"], [""], np.ones((1, D)), source="caller")
  assert t.embedded_by == "caller"
  with pytest.raises(ValueError, match="already stored"):  # (rolled back: still 'caller')
    t.insert(["b", "a"], ["x", "y"], [0, 0], ["s"] * 2, [""] * 2, np.ones((2, D)),
             source="encoder")
  assert t.embedded_by == "caller"
  t.close()
  t = Table(path, D)
  assert t.embedded_by == "caller"
  t.insert(["b"], ["y"], [0], ["s"], [""], np.ones((1, D)), source="encoder")
  t.insert(["c"], ["z"], [0], ["s"], [""], np.ones((1, D)), source="caller")
  assert t.embedded_by == "encoder"  # (one row of the memory's encoder is enough)
  t.close()
  assert Table(path, D).embedded_by == "encoder"


def _marker_row(t, marker: bytes, vec: np.ndarray):
  return _add(t, ["marker-id-1"], texts=[marker.decode() * 40], emb=vec[None])[0]


@pytest.mark.parametrize("how", ["delete", "replace"])
def test_forgetting_leaves_no_bytes_in_any_file_of_the_directory(path, how):
  marker = b"FORGET-ME-7c1e"
  vec = np.linspace(-3.3, 7.7, D).astype(np.float32) * np.float32(1.2345)
  t = Table(path, D)
  _add(t, [f"before{i}" for i in range(50)])
  row = _marker_row(t, marker, vec)
  _add(t, [f"after{i}" for i in range(200)])  # page splits move the marker's cell around
  assert _files_holding(path.parent, marker) and _files_holding(path.parent, vec.tobytes())
  if how == "delete":
    t.delete([row])
  else:
    t.replace(row, "marker-id-1", "corrected text", 0, "s", "", np.ones(D, np.float32))
  assert _files_holding(path.parent, marker) == []
  assert _files_holding(path.parent, vec.tobytes()) == []
  assert _files_holding(path.parent, b"marker-id-1") == ([] if how == "delete" else ["rows.sqlite"])
  assert sorted(p.name for p in path.parent.iterdir()) == ["rows.sqlite"]  # no journal left
  t.close()
  assert _files_holding(path.parent, marker) == []


def test_dead_terms_leave_the_vocabulary_and_every_file(path):
  t = Table(path, D)
  _add(t, ["a", "b"], terms=[np.array([0, 1], np.int32), np.array([0], np.int32)],
       new_vocab=[("common", 0), ("zyxmarkerterm", 1)])
  assert _files_holding(path.parent, b"zyxmarkerterm")
  t.delete([0], dead_terms=["zyxmarkerterm"])
  assert t.read_all().vocab == [("common", 0)]
  assert _files_holding(path.parent, b"zyxmarkerterm") == []


@pytest.mark.parametrize("column, value", [("text", "edited"), ("embedding", b"\0" * 4 * D),
                                           ("scope", "other"), ("store", 1), ("row", 99)])
def test_a_row_changed_outside_ear_jax_is_refused_naming_its_id(path, column, value):
  t = Table(path, D)
  _add(t, ["a", "victim", "c"])
  t.close()
  with sqlite3.connect(path) as db:
    db.execute(f"UPDATE memories SET {column} = ? WHERE id = 'victim'", (value,))
  t = Table(path, D)
  with pytest.raises(CheckpointError, match=f"{path}.*'victim'.*SHA-256"):
    t.read_all()
  with pytest.raises(CheckpointError, match="'victim'"):
    t.records(t.rows_of(["victim"]))
  assert t.records([0])[0]["text"] == "text of a"  # the other rows still read


def _overwrite(path: pathlib.Path, old: bytes, new: bytes) -> None:
  """Writes `new` over the one occurrence of `old` in the file (what a damaged disk might do)."""
  data = path.read_bytes()
  assert data.count(old) == 1, data.count(old)
  path.write_bytes(data.replace(old, new))


def test_an_id_index_entry_naming_another_row_is_refused_at_open_naming_the_file(path):
  """The index maps id-0010 to id-0020's row: SQLite would serve and delete id-0020 for it."""
  t = Table(path, D)
  _add(t, [f"id-{i:04d}" for i in range(30)])
  t.close()
  entry = b"\x03\x1b\x01id-0010"  # the id index's record (id, row): header, id, then the row
  _overwrite(path, entry + b"\x0b", entry + b"\x15")  # row 11 -> 21
  with contextlib.closing(sqlite3.connect(path)) as db:
    assert db.execute("SELECT row FROM memories WHERE id = 'id-0010'").fetchone() == (21,)
  with pytest.raises(CheckpointError, match=f"{path}: fails SQLite's integrity check .*"
                     "sqlite_autoindex_memories_1.*changed outside ear_jax"):
    Table(path, D)


@pytest.mark.parametrize("old, new", [
    (b"\x03'\x09zyxmarkerterm", b"\x03'\x09zyxmarkerterX"),  # the term of the vocabulary row
    (b"\x03'\x09zyxmarkerterm", b"\x03'\x08zyxmarkerterm"),  # its id (serial type 9: 1)
    (b"\x03'\x01zyxmarkerterm\x02", b"\x03'\x01zyxmarkerterX\x02"),  # the term index's entry
], ids=["term", "id", "term-index"])
def test_a_changed_byte_in_the_vocabulary_is_refused_at_open_naming_the_file(path, old, new):
  """A changed term silently drops its memories from a search for the word."""
  t = Table(path, D)
  _add(t, ["a", "b"], terms=[np.array([0, 1], np.int32), np.array([0], np.int32)],
       new_vocab=[("common", 0), ("zyxmarkerterm", 1)])
  t.close()
  _overwrite(path, old, new)
  with pytest.raises(CheckpointError, match=f"{path}: fails SQLite's integrity check"):
    Table(path, D)


def test_a_changed_byte_in_the_meta_table_is_refused_at_open_naming_the_file(path):
  t = Table(path, D)
  _add(t, ["a", "b", "c"])
  t.set_meta("places", '{"3": 1}')  # (as an older version's update wrote it)
  t.close()
  _overwrite(path, b'{"3": 1}', b'{"3": 2}')  # the places of updated rows: b's turn moves
  with pytest.raises(CheckpointError, match=f"{path}: its meta table .* fails its SHA-256 check"):
    Table(path, D)


def test_a_table_written_before_the_meta_digest_gets_an_identity_and_the_digest_at_open(path):
  t = Table(path, D)
  _add(t, ["a"])
  assert len(t.identity) == 32 and Table(None, D).identity != t.identity
  t.close()
  with contextlib.closing(sqlite3.connect(path)) as db, db:
    db.execute("DELETE FROM meta WHERE key IN ('identity', 'sha256')")
  t = Table(path, D)
  identity = t.identity
  assert len(identity) == 32 and t.read_all().rows.tolist() == [0]
  t.close()
  assert Table(path, D).identity == identity


def test_records_are_read_from_the_file_once_kept_at_most_record_cache_and_a_delete_drops_them(
    path, monkeypatch):
  from ear_jax.agent.memory import table as table_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(table_lib, "RECORD_CACHE", 4)
  t = Table(path, D)
  _add(t, [f"m{i}" for i in range(10)])
  reads = []
  verified = t._verified
  monkeypatch.setattr(t, "_verified", lambda *a: reads.append(a) or verified(*a))
  first = t.records([3, 1, 3])
  assert [r["id"] for r in first] == ["m3", "m1", "m3"] and len(reads) == 1
  assert t.records([1, 3]) == [first[1], first[0]] and len(reads) == 1  # kept: no file read
  first[0]["text"] = "changed by the caller"  # (a caller's dict is its own copy)
  assert t.records([3])[0]["text"] == "text of m3"
  assert [r["id"] for r in t.records(range(10))] == [f"m{i}" for i in range(10)]
  assert len(t._recent) == 4 and list(t._recent) == [6, 7, 8, 9]  # the newest 4
  t.delete([8])
  with pytest.raises(KeyError, match=r"rows \[8\]"):
    t.records([8])
  new = t.replace(9, "m9", "an updated text", 0, "s", "2024-05-02", np.ones(D, np.float32))
  with pytest.raises(KeyError, match=r"rows \[9\]"):
    t.records([9])
  assert t.records([new])[0]["text"] == "an updated text"


def test_a_kept_record_is_the_verified_one_and_a_changed_row_read_from_the_file_is_refused(path):
  t = Table(path, D)
  _add(t, ["a", "victim", "c"])
  kept = t.records([1])
  with sqlite3.connect(path) as db:  # (outside ear_jax, while the table is open)
    db.execute("UPDATE memories SET text = 'edited' WHERE id IN ('victim', 'c')")
  assert t.records([1]) == kept  # served from memory: what was verified
  with pytest.raises(CheckpointError, match="'c'.*SHA-256"):
    t.records([2])
  t.close()
  with pytest.raises(CheckpointError, match="'victim'"):
    Table(path, D).records([1])


def test_a_file_that_is_not_this_table_is_refused_naming_it(tmp_path, path):
  t = Table(path, D)
  _add(t, [f"m{i}" for i in range(300)])
  t.close()
  with pytest.raises(CheckpointError, match=f"{path}: holds embeddings of dimension {D}, "
                     f"expected {D + 1}"):
    Table(path, D + 1)
  data = path.read_bytes()
  for name, content in [("garbage", b"not a database at all" * 100),
                        ("truncated", data[:len(data) // 2]), ("torn", data[:len(data) - 100])]:
    bad = tmp_path / name
    bad.write_bytes(content)
    with pytest.raises(CheckpointError, match=str(bad)):
      Table(bad, D).read_all()
  other = tmp_path / "other.sqlite"
  with sqlite3.connect(other) as db:
    db.execute("CREATE TABLE memories(x)")
  with pytest.raises(CheckpointError, match=f"{other}: not a memory table"):
    Table(other, D)


def test_an_in_memory_table_backs_up_to_a_file_with_its_rows_and_sequence(tmp_path):
  t = Table(None, D)
  _add(t, ["a", "b", "c"], terms=[np.array([1], np.int32)] * 3, new_vocab=[("w", 1)])
  marker = b"FORGOTTEN-IN-MEMORY"
  t.delete([_marker_row(t, marker, np.full(D, 0.123, np.float32))])
  t.delete([1])
  t.set_meta("note", '{"x": 1}')
  t.backup_to(tmp_path / "rows.sqlite")
  copy = Table(tmp_path / "rows.sqlite", D)
  want, got = t.read_all(), copy.read_all()
  for a, b in zip(want, got):
    np.testing.assert_array_equal(np.asarray(a, object), np.asarray(b, object))
  assert copy.get_meta("note") == '{"x": 1}' and copy.records([2])[0]["id"] == "c"
  assert _files_holding(tmp_path, marker) == []
  np.testing.assert_array_equal(_add(copy, ["d"]), [4])


_WRITER = """
import sys
import numpy as np
from ear_jax.agent.memory.table import Table
t = Table(sys.argv[1], 8)
def say(line):  # ONE write per line: with PYTHONUNBUFFERED, print() writes its parts one by one
  sys.stdout.write(line + "\\n")
  sys.stdout.flush()
for i in range(100000):
  memory_id = f"{sys.argv[2]}-{i}"
  if i % 7 == 3:
    memory_id = f"{sys.argv[2]}-{i - 1}"
    say("TRY DEL " + memory_id)
    t.delete(t.rows_of([memory_id]))
    say("ACK DEL " + memory_id)
  else:
    say("TRY ADD " + memory_id)
    t.insert([memory_id], [f"text {i} " * (1 + i % 50)], [0], ["s"], [""],
             np.full((1, 8), i, np.float32), [np.arange(i % 5, dtype=np.int32)])
    say("ACK ADD " + memory_id)
"""


@pytest.mark.slow
def test_every_acknowledged_write_survives_kill_9_at_random_points(tmp_path):
  path = tmp_path / "rows.sqlite"
  Table(path, D).close()
  rng = random.Random(29)
  acked = {"ADD": set(), "DEL": set()}
  for trial in range(4):
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), f"t{trial}"],
                             stdout=subprocess.PIPE, text=True, cwd=_REPO)
    lines = [child.stdout.readline() for _ in range(rng.randint(1, 80))]
    os.kill(child.pid, signal.SIGKILL)  # most likely inside a transaction
    child.wait()
    tried = {"ADD": set(), "DEL": set()}
    text = "".join(lines) + child.stdout.read()
    for line in text.split("\n")[:-1]:  # (a line cut by the kill has no newline: never said)
      state, kind, memory_id = line.split()
      (acked if state == "ACK" else tried)[kind].add(memory_id)
    child.stdout.close()
    t = Table(path, D)
    live = {r["id"] for r in t.records(t.read_all().rows)}  # every row verifies
    pending_add, pending_del = tried["ADD"] - acked["ADD"], tried["DEL"] - acked["DEL"]
    assert acked["ADD"] - acked["DEL"] - pending_del <= live
    assert live <= acked["ADD"] | pending_add and not live & acked["DEL"]
    t.close()


def test_an_older_version_s_places_entry_opens_verified_and_is_kept(path):
  t = Table(path, D)
  _add(t, ["a", "b", "c"])
  t.set_meta("places", '{"3": 1}')  # (an older version's update of b wrote it)
  t.close()
  t = Table(path, D)
  new = t.replace(1, "b", "b again", 0, "s", "2024-05-01", np.ones(D, np.float32))
  t.delete([0])
  t.close()
  t = Table(path, D)
  assert t.read_all().rows.tolist() == [2, new] and t.get_meta("places") == '{"3": 1}'
  t.close()


def test_a_failed_update_rolls_back_the_whole_transaction(path):
  t = Table(path, D)
  _add(t, ["a", "b"])
  with pytest.raises(ValueError):  # (a wrong dimension: the delete is rolled back too)
    t.replace(0, "a", "x", 0, "s", "d", np.ones(D + 1, np.float32))
  assert len(t) == 2 and [r["text"] for r in t.records([0, 1])] == ["text of a", "text of b"]
  t.close()
  t = Table(path, D)  # (and so on disk)
  assert len(t) == 2 and t.records([0])[0]["id"] == "a"
  t.close()


def test_places_changed_outside_ear_jax_are_refused_naming_the_file(path):
  t = Table(path, D)
  _add(t, ["a"])
  t.set_meta("places", "[1, 2]")
  t.close()
  with pytest.raises(CheckpointError, match="rows.sqlite.*places"):
    Table(path, D)
