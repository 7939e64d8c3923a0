"""Hostile conditions for ear_jax/io/checkpoints.py, with real processes: saves killed with SIGKILL
at random moments, two processes saving to one directory, a reader during saves, and a restore in a
fresh interpreter (of a good and a corrupted checkpoint) that must print no asyncio "Event loop is
closed" noise nor tracebacks; bit flips in a step's metadata. Then a memory directory: a row changed
outside ear_jax (its SHA-256), a truncated or foreign `rows.sqlite`, a tampered or truncated learner
item, a learner item naming more rows than the table and an unknown format are refused naming the
file (and the memory); a reopened ANN memory retrieves exactly what it did."""
import inspect
import json
import multiprocessing
import os
import pathlib
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ear_jax.io.checkpoints import CheckpointError, CheckpointStore

REPO = pathlib.Path(__file__).resolve().parent.parent
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}


def expected_arrays(step):
  """The arrays saved as step `step`, so that any restored step can be checked bitwise."""
  rng = np.random.default_rng(step)
  return {"w": rng.standard_normal((384, 384)).astype(np.float32),
          "b": {"i": np.arange(step, step + 4096, dtype=np.int64), "e": np.zeros((0, 4))}}


_WRITER = textwrap.dedent('''
import sys
import numpy as np
from ear_jax.io.checkpoints import CheckpointStore
''') + inspect.getsource(expected_arrays) + textwrap.dedent('''
store = CheckpointStore(sys.argv[1], max_to_keep=int(sys.argv[2]))
count = int(sys.argv[3])
print("ready", flush=True)
step = (store.latest_step() or 0) + 1
while count:
  store.save(step, expected_arrays(step), {"step": step, "pad": "x" * 4096})
  sys.stdout.write(f"saved {step}\\n")  # (one write: a kill never leaves half a line)
  sys.stdout.flush()
  step, count = step + 1, count - 1
''')


def _check_step(store, step=None):
  """Restores `step` (default latest) and checks it is exactly what was saved for its step."""
  arrays, meta = store.restore(step)
  want = expected_arrays(meta["step"])
  assert step is None or meta["step"] == step
  np.testing.assert_array_equal(arrays["w"], want["w"])
  np.testing.assert_array_equal(arrays["b"]["i"], want["b"]["i"])
  assert arrays["b"]["e"].shape == (0, 4)
  return meta["step"]


def _writer(tmp_path, directory, *, max_to_keep=2, count=-1):
  script = tmp_path / "writer.py"
  script.write_text(_WRITER)
  return subprocess.Popen([sys.executable, str(script), str(directory), str(max_to_keep),
                           str(count)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=ENV, cwd=REPO)


@pytest.mark.slow
def test_saves_killed_with_sigkill_always_leave_the_latest_complete_step_loadable(tmp_path):
  directory = tmp_path / "ckpt"
  rng = random.Random(0)
  store = CheckpointStore(directory, max_to_keep=2)
  completed, mid_save = 0, 0
  for _ in range(6):
    proc = _writer(tmp_path, directory)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    time.sleep(rng.uniform(0.3, 2.5))
    proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err  # killed, not crashed
    saved = [int(l.split()[1]) for l in out.splitlines() if l.startswith("saved")]
    completed += len(saved)
    steps = store.steps()
    mid_save += any(".orbax-checkpoint-tmp" in n or n.startswith(".trash")
                    for n in os.listdir(directory)) if directory.exists() else 0
    if saved:  # every step the writer reported is there (or was superseded by a newer one)
      assert steps and steps[-1] >= saved[-1]
    if steps:
      assert _check_step(store) == steps[-1]
      for s in steps:
        _check_step(store, s)
  assert completed > 0
  latest = store.latest_step()
  store.save(latest + 1, expected_arrays(latest + 1), {"step": latest + 1})  # cleans the debris
  assert _check_step(store) == latest + 1
  assert sorted(os.listdir(directory)) == [str(latest), str(latest + 1)]
  print(f"{completed} saves completed, {mid_save} kills left debris")


def _concurrent_saver(directory, writer, n, barrier, results):
  """Saves `n` new steps to `directory` (racing another process); reports every outcome."""
  store = CheckpointStore(directory, max_to_keep=3, lock_timeout_s=120)
  barrier.wait()
  outcomes = []
  while sum(o in ("saved", "locked") for o in outcomes) < n:
    step = (store.latest_step() or 0) + 1
    try:
      store.save(step, expected_arrays(step), {"step": step, "writer": writer})
      outcomes.append("saved")
    except ValueError as e:  # the other process took that step first: pick the next one
      outcomes.append("taken" if "not a new step" in str(e) else f"ValueError: {e}")
      if not outcomes[-1] == "taken":
        break
    except CheckpointError as e:
      outcomes.append("locked" if "being written by another process" in str(e)
                      else f"CheckpointError: {e}")
      if outcomes[-1] != "locked":
        break
    except Exception as e:  # pylint: disable=broad-except
      outcomes.append(f"{type(e).__name__}: {e}")
      break
  results.put((writer, outcomes))


@pytest.mark.slow
def test_two_processes_saving_to_one_directory_are_serialised(tmp_path):
  directory = tmp_path / "ckpt"
  ctx = multiprocessing.get_context("spawn")
  barrier, results = ctx.Barrier(2), ctx.Queue()
  procs = [ctx.Process(target=_concurrent_saver, args=(str(directory), w, 10, barrier, results))
           for w in (0, 1)]
  for p in procs:
    p.start()
  outcomes = dict(results.get(timeout=600) for _ in procs)
  for p in procs:
    p.join(timeout=60)
    assert p.exitcode == 0
  for writer, outs in outcomes.items():
    assert set(outs) <= {"saved", "taken", "locked"}, (writer, outs)  # no other failure
    assert outs.count("saved") >= 1
  total = sum(outs.count("saved") for outs in outcomes.values())
  store = CheckpointStore(directory)
  steps = store.steps()
  assert steps == list(range(total - 2, total + 1))  # consecutive: no save lost or overwritten
  for s in steps:
    assert _check_step(store, s) == s
  assert sorted(os.listdir(directory)) == [str(s) for s in steps]  # no temporaries, no lock


@pytest.mark.slow
def test_a_reader_during_saves_sees_only_complete_steps(tmp_path):
  directory = tmp_path / "ckpt"
  store = CheckpointStore(directory, max_to_keep=2)
  store.save(1, expected_arrays(1), {"step": 1})
  proc = _writer(tmp_path, directory, count=12)
  seen = set()
  while proc.poll() is None:
    seen.add(_check_step(store))  # never a CheckpointError, never a half-written step
  assert proc.returncode == 0, proc.stderr.read()
  assert _check_step(store) == 13 and len(seen) >= 2


_RESTORER = '''
import sys
import jax
import numpy as np
from ear_jax.io.checkpoints import CheckpointError, CheckpointStore
from ear_jax.io import run_checkpoints
with CheckpointStore(sys.argv[1]) as store:
  arrays, meta = store.restore()
  target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays)
  again, _ = store.restore(target=target)
  print("restored", meta["step"], float(np.asarray(again["w"]).sum()))
  store.save(meta["step"] + 1, again, meta)
try:
  run_checkpoints.restore_adapter(sys.argv[1])
except run_checkpoints.CheckpointError as e:
  print("foreign ok")
bad = CheckpointStore(sys.argv[2])  # many arrays, read concurrently: some are pending when one fails
rng = np.random.default_rng(0)
bad.save(3, {"w": rng.standard_normal((384, 384)).astype(np.float32), "i": np.arange(5000),
             "v": rng.standard_normal((100, 30)).astype(np.float32)}, {})
for p in (bad.directory / "3" / "state").rglob("*"):
  if p.is_file() and p.stat().st_size > 1000:
    p.write_bytes(p.read_bytes()[:100])
for _ in range(8):
  try:
    bad.restore(3)
  except CheckpointError as e:
    print("corrupt ok")
'''


@pytest.mark.slow
def test_restore_in_a_fresh_process_prints_no_event_loop_closed_nor_tracebacks(tmp_path):
  store = CheckpointStore(tmp_path / "c")
  store.save(3, expected_arrays(3), {"step": 3})
  script = tmp_path / "restore.py"
  script.write_text(_RESTORER)
  out = subprocess.run([sys.executable, str(script), str(tmp_path / "c"), str(tmp_path / "bad")],
                       capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
  assert out.returncode == 0, out.stderr
  assert "restored 3" in out.stdout and "foreign ok" in out.stdout
  assert out.stdout.count("corrupt ok") == 8
  assert "Event loop is closed" not in out.stderr + out.stdout
  assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr
  assert store.steps() == [3, 4]


@pytest.mark.slow
def test_every_single_bit_flip_in_a_steps_metadata_files_is_refused_or_harmless(tmp_path):
  """400 random one-bit flips in the meta file and in Orbax's array metadata (which holds the leaf
  record and the digest): each restore is a CheckpointError or gives back exactly what was saved."""
  store = CheckpointStore(tmp_path / "c")
  arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "i": np.arange(5)}
  meta = {"seed": 0, "num_batches": 3, "name": "x", "nested": {"a": [1, 2.5, None, True]}}
  step = store.save(1, arrays, meta)
  rng = random.Random(0)
  outcomes = {"refused": 0, "harmless": 0}
  for file in (step / "meta" / "metadata", step / "state" / "_METADATA"):
    good = file.read_bytes()
    for _ in range(200):
      pos, bit = rng.randrange(len(good)), rng.randrange(8)
      bad = bytearray(good)
      bad[pos] ^= 1 << bit
      file.write_bytes(bytes(bad))
      try:
        got, got_meta = store.restore(1)
      except CheckpointError:
        outcomes["refused"] += 1
        continue
      finally:
        file.write_bytes(good)
      assert got_meta == meta, (file.name, pos, bit)  # e.g. 'e' -> 'E' in a number: same value
      for k in arrays:
        np.testing.assert_array_equal(np.asarray(got[k]), arrays[k])
      outcomes["harmless"] += 1
  assert outcomes["refused"] >= 300, outcomes
  print(outcomes)


def test_checkpoints_written_before_metadata_digests_still_load(tmp_path):
  """A step without the digest (neither in the meta file nor in the array metadata, as the earlier
  writer left them) restores, identically, its arrays still verified."""
  store = CheckpointStore(tmp_path / "c")
  step = store.save(3, expected_arrays(3), {"step": 3})
  meta_file, md_file = step / "meta" / "metadata", step / "state" / "_METADATA"
  meta = json.loads(meta_file.read_text())
  del meta["ear_jax.io/sha256"]
  meta_file.write_text(json.dumps(meta))
  md = json.loads(md_file.read_text())
  del md["custom_metadata"]["ear_jax.io/sha256"]
  md_file.write_text(json.dumps(md))
  assert _check_step(store, 3) == 3
  for p in (step / "state").rglob("*"):  # the arrays are still checked against their SHA-256
    if p.is_file() and p.stat().st_size > 1000:
      p.write_bytes(p.read_bytes()[:100])
  with pytest.raises(CheckpointError, match=str(step)):
    store.restore(3)


# ------------------------------------------------------------------------------------------------
# A memory directory: `rows.sqlite` (every row with its SHA-256) and the learner item (`learner/`,
# one CheckpointStore step).

def _mem_config(**kw):
  from ear_jax.agent.memory import MemoryConfig  # pylint: disable=g-import-not-at-top
  from ear_jax.core.config import EARConfig  # pylint: disable=g-import-not-at-top
  return MemoryConfig(encoder=None, config=EARConfig(dim=16, num_candidates=8, slate_size=3,
                                                     num_rounds=1, batch_size=1,
                                                     buffer_capacity=8, replay_size=2), **kw)


def _unit_rows(n, seed, d=16):
  x = np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def _cite_first(key, view):
  del key
  return np.where(np.arange(len(view.ids)) == 0, 1.0, -1.0).astype(np.float32)


def _saved_memory(path, n=300, feedbacks=3):
  """A closed memory directory: `n` memories (`t<i>`, rows over several SQLite pages) and a
  trained learner item."""
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  with Memory.open(path, _mem_config()) as m:
    m.add([f"memory text {i}" for i in range(n)], ids=[f"t{i}" for i in range(n)],
          embeddings=_unit_rows(n, 3))
    for x in _unit_rows(feedbacks, 4):
      m.recall("q", _cite_first, k=3, query_embedding=x)
    m.save()
  return path


def _open(path):
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  Memory.open(path).close()


@pytest.mark.parametrize("column,value", [("text", "'an edited text'"), ("store", "1"),
                                          ("scope", "'another-tenant'"), ("date", "'2020-01-01'"),
                                          ("embedding", "zeroblob(64)"),
                                          ("sha256", "'00' || substr(sha256, 3)")])
def test_a_row_changed_outside_ear_jax_is_refused_naming_the_file_and_the_memory(tmp_path,
                                                                                column, value):
  path = _saved_memory(tmp_path / "m")
  with sqlite3.connect(path / "rows.sqlite") as db:
    assert db.execute(f"UPDATE memories SET {column} = {value} WHERE id = 't17'").rowcount == 1
  with pytest.raises(CheckpointError, match=f"{path / 'rows.sqlite'}.*'t17'"):
    _open(path)
  assert not (path / ".owner").exists()  # the refused open holds nothing


def test_a_truncated_or_foreign_table_is_refused_naming_the_file(tmp_path):
  path = _saved_memory(tmp_path / "m")
  table = path / "rows.sqlite"
  good = table.read_bytes()
  assert len(good) > 8 * 4096  # (many pages: the truncation cuts rows)
  for bad in (good[:len(good) // 2], good[:4096 * 3], good[:100], b"",
              np.random.default_rng(0).bytes(len(good)), b"SQLite format 3\0" + bytes(200)):
    table.write_bytes(bad)
    with pytest.raises(CheckpointError, match=str(table)):
      _open(path)
  table.write_bytes(good)
  _open(path)


def _learner_step(path) -> pathlib.Path:
  store = CheckpointStore(path / "learner")
  return store.directory / str(store.latest_step())


def test_a_tampered_or_truncated_learner_item_is_refused_naming_the_file(tmp_path):
  path = _saved_memory(tmp_path / "m")
  step = _learner_step(path)
  meta_file = step / "meta" / "metadata"
  good = meta_file.read_text()
  rows = json.loads(good)["rows"]
  assert f'"rows": {rows}' in good
  meta_file.write_text(good.replace(f'"rows": {rows}', f'"rows": {rows ^ 1}'))  # one bit
  with pytest.raises(CheckpointError, match=f"meta file {meta_file} .*does not match the SHA-256"):
    _open(path)
  meta_file.write_text(good)
  arrays = [p for p in (step / "state").rglob("*") if p.is_file() and p.stat().st_size > 1000]
  assert arrays
  saved = {p: p.read_bytes() for p in arrays}
  for p in arrays:
    p.write_bytes(saved[p][:100])
  with pytest.raises(CheckpointError, match=str(step)):
    _open(path)
  for p in arrays:
    p.write_bytes(saved[p])
  _open(path)


def _rewritten(path, **changes) -> pathlib.Path:
  """The learner item rewritten as a new step with `changes` to its meta (a valid digest: only the
  values are wrong); returns its meta file."""
  store = CheckpointStore(path / "learner")
  arrays, meta = store.restore()
  step = store.save(store.latest_step() + 1, arrays, {**meta, **changes})
  return step / "meta" / "metadata"


def test_a_learner_item_naming_more_rows_than_the_table_is_refused(tmp_path):
  path = _saved_memory(tmp_path / "m", n=30)
  _rewritten(path, rows=35)  # the table ends at row 30: it is not this table's learner
  with pytest.raises((CheckpointError, ValueError)) as e:
    _open(path)
  assert str(path / "learner") in str(e.value) and "35" in str(e.value), e.value


def test_replay_buffer_rows_beyond_the_learner_items_rows_are_refused(tmp_path):
  path = _saved_memory(tmp_path / "m", n=30)
  store = CheckpointStore(path / "learner")
  arrays, meta = store.restore()
  rows = np.asarray(arrays["driver"]["buffer_rows"]).copy()
  assert (rows >= 0).any()  # (the recalls pushed experiences)
  rows[rows >= 0] = 10_000  # no row of the table, nor of the learner item's `rows`
  arrays["driver"]["buffer_rows"] = rows
  store.save(store.latest_step() + 1, arrays, meta)
  with pytest.raises((CheckpointError, ValueError)) as e:
    _open(path)
  assert str(path / "learner") in str(e.value) and "10000" in str(e.value), e.value


def test_an_unknown_learner_format_is_a_format_error_naming_the_file_and_the_field(tmp_path):
  from ear_jax.io.checkpoints import CheckpointFormatError  # pylint: disable=g-import-not-at-top
  path = _saved_memory(tmp_path / "m", n=30)
  _rewritten(path, format=3)
  with pytest.raises(CheckpointFormatError) as e:
    _open(path)
  assert str(path / "learner") in str(e.value) and "'format'" in str(e.value), e.value


def test_another_config_for_a_stored_memory_is_refused_naming_the_fields(tmp_path):
  from ear_jax.agent.memory import Memory, MemoryConfig  # pylint: disable=g-import-not-at-top
  from ear_jax.core.config import EARConfig  # pylint: disable=g-import-not-at-top
  path = _saved_memory(tmp_path / "m", n=30)
  other = MemoryConfig(encoder=None, config=EARConfig(dim=16, num_candidates=6, slate_size=3),
                       seed=3)
  with pytest.raises(ValueError, match=r"num_candidates[\s\S]*seed|seed[\s\S]*num_candidates"):
    Memory.open(path, other)
  _open(path)  # the refused open changed nothing and holds nothing


# Small settings so that rebuilding an index differs visibly: IVF trains at 39 * 8 = 312 vectors of
# a store, PQ at 200, HNSW with few links and a narrow search (and one thread, so that two
# memories adding the same rows build the same graph).
_ANN = {"faiss_ivf": {"nlist": 8, "nprobe": 2},
        "faiss_pq": {"pq_m": 4, "train_size": 200, "rerank": 2},
        "faiss_hnsw": {"hnsw_m": 4, "ef_construction": 8, "ef_search": 8, "build_threads": 1}}


def _candidates(m, q):
  """Every query's K candidates (search with k = K: the whole candidate set, adapter-ranked)."""
  return [m.search(query_embedding=x, k=8).ids for x in q]


@pytest.mark.slow
@pytest.mark.parametrize("index", sorted(_ANN))
def test_a_reopened_ann_memory_retrieves_exactly_what_it_did_whatever_the_save_boundaries(tmp_path,
                                                                                          index):
  """Adds in 6 batches, saves after the 2nd and the 6th: the dialogue store trains inside the
  second batch (on 400 vectors; rebuilt batch by batch it would train on 450) and the observation
  store is still untrained (flat) when saved, and trains after the reopen; a delete after the last
  save (the saved index may hold its row) is honoured too."""
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  settings = _mem_config(index=index, index_options=_ANN[index], multistore=True)
  twin = Memory(settings)  # the same adds, never saved nor reopened
  emb, q, at = _unit_rows(900, 0), _unit_rows(40, 1), 0
  with Memory.open(tmp_path / "m", settings) as m:
    for size, store, save in [(150, "dialogue", False), (130, "observation", True),
                              (90, "dialogue", False), (160, "dialogue", False),
                              (120, "observation", False), (50, "dialogue", True)]:
      for mem in (m, twin):
        mem.add([f"text {at + i}" for i in range(size)], ids=[f"t{at + i}" for i in range(size)],
                embeddings=emb[at:at + size], store=store)
      at += size
      if save:
        m.save()
    assert _candidates(m, q) == _candidates(twin, q)
  with Memory.open(tmp_path / "m") as back:
    assert _candidates(back, q) == _candidates(twin, q)
    # Both go on identically: the observation store trains now, on the restored vectors plus these.
    for mem in (back, twin):
      mem.add([f"o{i}" for i in range(200)], embeddings=emb[700:900], store="observation")
      mem.delete(["t3"])
    assert _candidates(back, q) == _candidates(twin, q)
  with Memory.open(tmp_path / "m") as again:  # unsaved adds and the delete after the last save
    assert _candidates(again, q) == _candidates(twin, q)
