"""Durability of a memory directory: every add / update / delete is one SQLite transaction, durable
when it returns; `save` writes only the learner item; a process killed with SIGKILL at any write
point (or at random moments of a loop of writes) loses nothing acknowledged, leaves the last saved
learner item or the one being saved, and the directory opens cleanly."""
import hashlib
import pathlib
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from ear_jax import EARConfig
from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.io import checkpoints
from tests.kill_helpers import ENV, STALLED_CHILD, sigkill_at

D = 8
CFG = EARConfig(dim=D, num_candidates=4, slate_size=2, num_rounds=1, batch_size=1,
                buffer_capacity=8, replay_size=2)
SETTINGS = MemoryConfig(encoder=None, config=CFG)


def _emb(n, seed):
  return np.random.default_rng(seed).normal(size=(n, D)).astype(np.float32)


def _rows_in_file(path) -> dict:
  """id -> (row, text) of the table, read by a connection of its own (what another process sees)."""
  with sqlite3.connect(pathlib.Path(path) / "rows.sqlite") as db:
    return {i: (r, t) for r, i, t in db.execute("SELECT row, id, text FROM memories")}


def _cite_first(key, view):
  del key
  return np.where(np.arange(len(view.ids)) == 0, 1.0, -1.0).astype(np.float32)


def _digest(memory) -> str:
  """A digest of the learner's parameters (tells which save wrote a learner item)."""
  leaves = jax.tree_util.tree_leaves(memory.learner.params)
  return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()[:16]


def _learner_steps(path):
  return checkpoints.CheckpointStore(pathlib.Path(path) / "learner", max_to_keep=None).steps()


def _debris(path) -> list[str]:
  """What a killed write may leave: an SQLite journal, Orbax temporaries, `.trash-*` steps."""
  return sorted(str(p) for p in pathlib.Path(path).rglob("*")
                if p.name.endswith("-journal") or ".orbax-checkpoint-tmp" in p.name
                or p.name.startswith(".trash-"))


def test_every_add_update_and_delete_is_in_the_database_when_it_returns(tmp_path):
  path = tmp_path / "mem"
  with Memory.open(path, SETTINGS) as m:
    ids = m.add(["first", "second", "third"], embeddings=_emb(3, 0))
    assert {i: t for i, (_, t) in _rows_in_file(path).items()} == dict(
        zip(ids, ["first", "second", "third"]))
    m.update(ids[1], text="second, corrected", embedding=_emb(1, 1)[0])
    m.delete([ids[0]])
    rows = _rows_in_file(path)
    assert {i: t for i, (_, t) in rows.items()} == {ids[1]: "second, corrected",
                                                     ids[2]: "third"}
    [late] = m.add(["fourth"], embeddings=_emb(1, 2))
    # Row numbers are never reused: the deleted row's and the updated memory's old row stay free.
    assert _rows_in_file(path)[late][0] > max(r for r, _ in rows.values())
    assert len(_learner_steps(path)) <= 1  # nothing of this was a save


def test_save_writes_only_the_learner_item_naming_the_tables_rows(tmp_path):
  path = tmp_path / "mem"
  with Memory.open(path, SETTINGS) as m:
    m.add([f"t{i}" for i in range(6)], embeddings=_emb(6, 0))
    m.delete(["m5"])
    table = (path / "rows.sqlite").read_bytes()
    for q in _emb(3, 1):
      m.recall("q", _cite_first, k=2, query_embedding=q)
    m.save()
    assert (path / "rows.sqlite").read_bytes() == table  # the table is not written by a save
    first = _learner_steps(path)
    m.save()
    steps = _learner_steps(path)
    assert len(steps) == 1 and steps[0] > first[-1]  # the older step went once the new verified
    meta = checkpoints.CheckpointStore(path / "learner").read_meta()
    assert meta["rows"] == 6  # rows 0-5 were used (row 5 is deleted and never reused)
    assert MemoryConfig.from_dict(meta["memory_config"]) == m.config
    assert _debris(path) == []


def test_saving_another_memory_into_a_memory_directory_is_refused(tmp_path):
  path = tmp_path / "mem"
  with Memory.open(path, SETTINGS) as m:
    m.add(["kept"], embeddings=_emb(1, 0))
  other = Memory(SETTINGS)
  other.add(["another memory"], embeddings=_emb(1, 1))
  with pytest.raises(ValueError, match=f"{path}.* holds a memory already"):
    other.save(path)
  with Memory.open(path) as back:
    assert [r["text"] for r in back.list()] == ["kept"]


def _trained(seed=0, bank_dtype="float32"):
  """An in-memory memory whose 8-slot replay buffer has wrapped, with sessions left open."""
  m = Memory(MemoryConfig(encoder=None, config=CFG, seed=seed, bank_dtype=bank_dtype))
  m.add([f"a{i}" for i in range(40)], embeddings=_emb(40, seed))
  q = _emb(15, seed + 1)
  for i in range(12):  # (batch size 1: 12 learner steps, 12 experiences pushed)
    m.recall("q", _cite_first, k=2, query_embedding=q[i])
  sessions = [m.session(query_embedding=x) for x in q[12:]]
  sessions[0].round(2)  # shown, no feedback yet
  return m, [s.id for s in sessions]


def _leaves_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a.learner), jax.tree_util.tree_leaves(b.learner)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("bank_dtype", ["float32", "bfloat16"])
def test_the_learner_and_open_sessions_come_back_bit_for_bit_and_learn_on_identically(tmp_path,
                                                                                     bank_dtype):
  # (the replay buffer's candidates are saved as bank rows and gathered back from the bank)
  saved, open_ids = _trained(bank_dtype=bank_dtype)
  twin, _ = _trained(bank_dtype=bank_dtype)  # the same calls: the same state, never saved
  _leaves_equal(saved, twin)
  assert saved.save(tmp_path / "mem") == tmp_path / "mem"  # binds the in-memory memory
  saved.close()
  with Memory.open(tmp_path / "mem") as back:
    assert len(back) == 40 and back.config == twin.config
    _leaves_equal(back, twin)
    for mem in (back, twin):  # resumed sessions, then more training
      s = mem.session(resume=open_ids[0])
      s.feedback([])  # (the round shown before the save)
      for sid in open_ids[1:]:
        s = mem.session(resume=sid)
        s.feedback(s.round(2).ids[1:])
      for x in _emb(6, 7):
        mem.recall("q", _cite_first, k=2, query_embedding=x)
    _leaves_equal(back, twin)


# A child that opens the prepared memory at `path` and then does the write `stage` names:
# 'add' / 'update' / 'delete' stalled at its COMMIT, 'learner' / 'prune' a save stalled while it
# writes the learner item / deletes the older one, 'acked' every write acknowledged (then stalled).
_WRITE_POINT_CHILD = STALLED_CHILD + textwrap.dedent("""
    import hashlib, jax
    m = Memory.open(path)
    for i in range(3):
      m.recall("q", lambda key, view: np.eye(1, len(view.ids))[0] * 2 - 1, k=2,
               query_embedding=rng.normal(size=8))
    leaves = jax.tree_util.tree_leaves(m.learner.params)
    digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()[:16]
    print("DIGEST", digest, flush=True)
    if stage in ("add", "update", "delete"):
      stall_at("commit")
    if stage in ("learner", "prune"):
      stall_at(stage)
      m.save()
    if stage in ("add", "acked"):
      m.add(["a new memory"], ids=["new"], embeddings=rng.normal(size=(1, 8)))
    if stage in ("update", "acked"):
      m.update("m1", text="m1, updated", embedding=rng.normal(size=8))
    if stage in ("delete", "acked"):
      m.delete(["m2"])
    stall()
""")


def _prepared(path):
  """A memory directory of 6 memories with a trained, saved learner; returns its texts, digest."""
  with Memory.open(path, SETTINGS) as m:
    m.add([f"text {i}" for i in range(6)], embeddings=_emb(6, 0))
    for q in _emb(3, 1):
      m.recall("q", _cite_first, k=2, query_embedding=q)
    m.save()
    return {r["id"]: r["text"] for r in m.list()}, _digest(m)


def _reopened(path):
  """Opens `path` after a kill: `(texts, learner digest)` as opened, then the digest of the
  learner it trains and saves, and what a killed write left that survived the open and the save."""
  with Memory.open(path) as m:
    texts, digest = {r["id"]: r["text"] for r in m.list()}, _digest(m)
    assert len(m) == len(texts)
    for q in _emb(4, 9):  # every candidate is a live memory; recall works
      assert set(m.search(query_embedding=q, k=4).ids) <= set(texts)
    m.recall("q", _cite_first, k=2, query_embedding=_emb(1, 10)[0])
    m.save()
    saved = _digest(m)
  return texts, digest, saved, _debris(path)


@pytest.mark.slow  # (subprocesses)
@pytest.mark.parametrize("stage", ["add", "update", "delete", "learner", "prune", "acked"])
def test_sigkill_at_each_write_point_loses_nothing_acknowledged(tmp_path, stage):
  path = tmp_path / "mem"
  before, saved_digest = _prepared(path)
  [trained] = [l.split()[1] for l in sigkill_at(_WRITE_POINT_CHILD, [path, stage],
                                                marker="STALLED") if l.startswith("DIGEST")]
  texts, digest, _, debris = _reopened(path)
  after = dict(before)
  if stage == "acked":  # acknowledged before the kill: all there, without a save
    after.update(new="a new memory", m1="m1, updated")
    del after["m2"]
  assert texts == after  # a write killed before its COMMIT left no trace
  # The learner: the new item once it was complete (killed deleting the older one), else the
  # saved one (the three recalls' learner steps were never saved).
  assert trained != saved_digest
  assert digest == (trained if stage == "prune" else saved_digest)
  assert debris == []  # the directory opened cleanly


# A loop of random writes on the memory at `path` (seeded by argv[2]), printing each one before
# (BEGIN) and after it returned (ACK); a save prints the digest of the learner it writes.
_LOOP_CHILD = textwrap.dedent("""
    import hashlib, sys
    import jax
    import numpy as np
    from ear_jax.agent.memory import Memory
    path, seed = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(seed)
    m = Memory.open(path)
    live = [r["id"] for r in m.list()]
    def digest():
      leaves = jax.tree_util.tree_leaves(m.learner.params)
      return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()[:16]
    def say(*words):  # ONE write per line (with PYTHONUNBUFFERED print writes word by word)
      sys.stdout.write(" ".join(map(str, words)) + "\\n")
      sys.stdout.flush()
    say("READY", digest())
    n = 0
    while True:
      op = rng.choice(["add", "update", "delete", "recall", "save"], p=[.3, .2, .15, .25, .1])
      if op == "add" or len(live) < 4:
        ids = [f"s{seed}.{n + j}" for j in range(rng.integers(1, 4))]
        n += len(ids)
        say("BEGIN add", *ids)
        m.add([f"text-of-{i}" for i in ids], ids=ids, embeddings=rng.normal(size=(len(ids), 8)))
        say("ACK add", *ids)
        live += ids
      elif op == "update":
        i, text = live[rng.integers(len(live))], f"update-{seed}.{n}"
        n += 1
        say("BEGIN update", i, text)
        m.update(i, text=text, embedding=rng.normal(size=8))
        say("ACK update", i, text)
      elif op == "delete":
        i = live.pop(rng.integers(len(live)))
        say("BEGIN delete", i)
        m.delete([i])
        say("ACK delete", i)
      elif op == "recall":
        m.recall("q", lambda key, view: np.eye(1, len(view.ids))[0] * 2 - 1, k=2,
                 query_embedding=rng.normal(size=8))
      else:
        d = digest()
        say("BEGIN save", d)
        m.save()
        say("ACK save", d)
""")


def _apply(texts: dict, words: list[str]) -> dict:
  out = dict(texts)
  if words[0] == "add":
    out.update({i: f"text-of-{i}" for i in words[1:]})
  elif words[0] == "update":
    out[words[1]] = words[2]
  elif words[0] == "delete":
    del out[words[1]]
  return out


@pytest.mark.slow  # (subprocesses, ~1 min)
def test_sigkill_at_random_moments_of_a_write_loop_loses_nothing_acknowledged(tmp_path):
  path = tmp_path / "mem"
  texts, digest = _prepared(path)
  rng = random.Random(0)
  in_flight, leftovers = [], []
  for seed in range(5):
    proc = subprocess.Popen([sys.executable, "-c", _LOOP_CHILD, str(path), str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    try:
      ready = proc.stdout.readline().split()
      assert ready[:1] == ["READY"], ready
      assert ready[1] == digest  # the learner the last check found
      seen = [proc.stdout.readline() for _ in range(rng.randrange(60))]  # then a random moment
      time.sleep(rng.uniform(0.0, 0.03))
      proc.send_signal(signal.SIGKILL)
      proc.wait(timeout=30)
      out = "".join(seen) + proc.stdout.read()  # (not communicate: it would skip what readline
      #   already buffered)
    finally:
      if proc.poll() is None:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    lines = [l.split() for l in out.splitlines() if l.strip()]
    acked, pending, digests = dict(texts), None, [digest]
    for words in lines:
      if words[0] == "BEGIN":
        pending = words[1:]
      elif words[0] == "ACK" and words[1:] == pending:
        acked, pending = _apply(acked, pending), None
        if words[1] == "save":
          digests = [words[2]]
    allowed = [acked] + ([_apply(acked, pending)] if pending else [])
    if pending and pending[0] == "save":
      digests.append(pending[1])
    texts, opened, digest, debris = _reopened(path)
    assert texts in allowed, (seed, pending)  # nothing acknowledged lost, the in-flight write
    assert opened in digests, (seed, pending)  # whole or not at all; the last or the new learner
    in_flight.append(pending[0] if pending else "-")
    leftovers += [(seed, pending[0] if pending else "-", pathlib.Path(p).name) for p in debris]
  print("killed during:", in_flight)
  assert leftovers == []  # the directory opened cleanly after every kill
