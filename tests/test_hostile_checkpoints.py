"""Hostile conditions for ear_jax/io/checkpoints.py, with real processes: saves killed with SIGKILL
at random moments, two processes saving to one directory, a reader during saves, and a restore
in a fresh interpreter (of a good and a corrupted checkpoint) that must print no asyncio "Event loop
is closed" noise nor tracebacks. Then `Memory` checkpoints (issue 20): a loaded ANN memory retrieves
exactly what it did, one flipped bit in the JSON metadata is refused, unknown formats and layouts
name the file and the field, and shards are compacted (also under SIGKILL)."""
import inspect
import multiprocessing
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ear_jax.io.checkpoints import CheckpointError, CheckpointStore
from tests.kill_helpers import STALLED_SAVE_CHILD

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
  print("saved", step, flush=True)
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
  for _ in range(10):
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
from tests.kill_helpers import STALLED_SAVE_CHILD
from ear_jax.experiment import checkpointing
with CheckpointStore(sys.argv[1]) as store:
  arrays, meta = store.restore()
  target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays)
  again, _ = store.restore(target=target)
  print("restored", meta["step"], float(np.asarray(again["w"]).sum()))
  store.save(meta["step"] + 1, again, meta)
try:
  checkpointing.restore_adapter(sys.argv[1])
except checkpointing.CheckpointError as e:
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


# ------------------------------------------------------------------------------------------------
# Memory checkpoints (issue 20): identical ANN indexes, every byte verified, unknown formats,
# compacted shards.

def _mem_config():
  from ear_jax.core.config import EARConfig  # pylint: disable=g-import-not-at-top
  return EARConfig(dim=16, num_candidates=8, slate_size=3, num_rounds=1, batch_size=1,
                   buffer_capacity=8, replay_size=2)


def _unit_rows(n, seed, d=16):
  x = np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)
  return x / np.linalg.norm(x, axis=1, keepdims=True)


# Small settings so that rebuilding an index differs visibly: IVF trains at 39 * 8 = 312 vectors of
# a store, PQ at 200, HNSW with few links and a narrow search (and one thread, so that two
# memories adding the same rows build the same graph).
_ANN = {"faiss_ivf": {"nlist": 8, "nprobe": 2},
        "faiss_pq": {"pq_m": 4, "train_size": 200, "rerank": 2},
        "faiss_hnsw": {"hnsw_m": 4, "ef_construction": 8, "ef_search": 8, "build_threads": 1}}


def _candidates(m, q):
  rows = m._bank.search(q, 8, True)[0]  # pylint: disable=protected-access
  return rows, [m.retrieve(query_embedding=x, k=3).ids for x in q[:5]]


@pytest.mark.slow
@pytest.mark.parametrize("index", sorted(_ANN))
def test_a_loaded_ann_memory_retrieves_exactly_what_it_did_whatever_the_save_boundaries(tmp_path,
                                                                                        index):
  """Adds in 6 batches, saves after the 2nd and the 6th: the dialogue store trains inside the
  second shard (on 400 vectors; rebuilt shard by shard it would train on 450) and the observation
  store is still untrained (flat) when saved, and trains after the load."""
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  m = Memory(None, config=_mem_config(), index=index, index_options=_ANN[index], multistore=True)
  emb, q, at = _unit_rows(900, 0), _unit_rows(40, 1), 0
  for size, store, save in [(150, "dialogue", False), (130, "observation", True),
                            (90, "dialogue", False), (160, "dialogue", False),
                            (120, "observation", False), (50, "dialogue", True)]:
    m.add([f"t{at + i}" for i in range(size)], embeddings=emb[at:at + size], store=store)
    at += size
    if save:
      m.save(tmp_path / "m")
  rows, ids = _candidates(m, q)
  back = Memory.load(tmp_path / "m")
  rows_back, ids_back = _candidates(back, q)
  np.testing.assert_array_equal(rows_back, rows)
  assert ids_back == ids
  # Both go on identically: the observation store trains now, on the restored vectors plus these.
  for mem in (m, back):
    mem.add([f"o{i}" for i in range(200)], embeddings=emb[700:900], store="observation")
  np.testing.assert_array_equal(_candidates(back, q)[0], _candidates(m, q)[0])
  back.save(tmp_path / "m")
  back.save(tmp_path / "m")  # nothing added: the listed index is reused, not written again
  indexes = CheckpointStore(tmp_path / "m" / "ann_index", max_to_keep=None)
  assert len(indexes.steps()) == 2
  np.testing.assert_array_equal(_candidates(Memory.load(tmp_path / "m"), q)[0],
                                _candidates(m, q)[0])


def _trained_memory(seed=0, feedbacks=6):
  """An exact memory with `num_batches` = feedbacks (batch size 1)."""
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  m = Memory(None, config=_mem_config(), seed=seed)
  m.add([f"t{i}" for i in range(30)], embeddings=_unit_rows(30, 3))
  for x in _unit_rows(feedbacks, 4):
    r = m.retrieve(query_embedding=x, k=3)
    m.feedback(r, [r.ids[0]])
  return m


def _flip(path: pathlib.Path, old: str, new: str) -> None:
  text = path.read_text()
  assert text.count(old) == 1, (old, text)
  assert bin(int.from_bytes(old.encode(), "big") ^ int.from_bytes(new.encode(), "big")).count(
      "1") == 1  # one bit
  path.write_text(text.replace(old, new))


@pytest.mark.parametrize("old,new", [('"seed": 0', '"seed": 1'),
                                     ('"num_batches": 3', '"num_batches": 2')])
def test_one_flipped_bit_in_the_checkpoints_json_metadata_is_a_checkpoint_error_naming_the_file(
    tmp_path, old, new):
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  m = _trained_memory(feedbacks=3)
  step = m.save(tmp_path / "m")
  meta = step / "meta" / "metadata"
  _flip(meta, old, new)
  with pytest.raises(CheckpointError, match=f"meta file {meta} .*does not match the SHA-256"):
    Memory.load(tmp_path / "m")
  with pytest.raises(CheckpointError, match=str(meta)):
    m.restore(tmp_path / "m")
  _flip(meta, new, old)
  assert Memory.load(tmp_path / "m").ids == m.ids


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
  """A checkpoint without the digest (neither in the meta files nor in the array metadata, as the
  earlier writer left them) loads, identically."""
  import json  # pylint: disable=g-import-not-at-top
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  m = _trained_memory()
  m.save(tmp_path / "m")
  m.add(["u"], embeddings=_unit_rows(1, 9))
  m.save(tmp_path / "m")
  stripped = 0
  for meta_file in (tmp_path / "m").rglob("meta/metadata"):
    meta = json.loads(meta_file.read_text())
    del meta["ear_jax.io/sha256"]
    meta_file.write_text(json.dumps(meta))
    md_file = meta_file.parent.parent / "state" / "_METADATA"
    md = json.loads(md_file.read_text())
    del md["custom_metadata"]["ear_jax.io/sha256"]
    md_file.write_text(json.dumps(md))
    stripped += 1
  assert stripped >= 4  # main steps and shards
  back = Memory.load(tmp_path / "m")
  assert back.ids == m.ids and back._driver.num_batches == m._driver.num_batches
  np.testing.assert_array_equal(back.embeddings(), m.embeddings())


def test_unknown_format_layout_dtype_index_or_record_version_is_a_checkpoint_error_naming_both(
    tmp_path):
  """Each written with a valid digest (as a newer writer would), so only the value is unknown."""
  import json  # pylint: disable=g-import-not-at-top
  from ear_jax.agent.memory import persistence  # pylint: disable=g-import-not-at-top
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  from ear_jax.io.checkpoints import CheckpointFormatError  # pylint: disable=g-import-not-at-top
  m = _trained_memory()
  m.save(tmp_path / "m")
  for field, value in [("layout", "shards-2"), ("bank_dtype", "float8"), ("index", "annoy")]:
    path = tmp_path / field
    m.save(path)
    arrays, meta = persistence.main_step(m._parts())
    meta["bank"] = {**CheckpointStore(path).read_meta()["bank"], field: value}
    step = persistence.write(path, arrays, meta)
    with pytest.raises(CheckpointFormatError,
                       match=f"{step / 'meta' / 'metadata'}: field 'bank.{field}' is '{value}'"):
      Memory.load(path)
    with pytest.raises(CheckpointFormatError, match=f"field 'bank.{field}'"):
      m.restore(path)
  with CheckpointStore(tmp_path / "f") as store:
    step = store.save(1, {"x": np.zeros(3)}, {"format": "ear_jax.agent.memory/3"})
  with pytest.raises(CheckpointFormatError, match=f"field 'format' of {step / 'meta' / 'metadata'}"):
    Memory.load(tmp_path / "f")
  md_file = step / "state" / "_METADATA"  # a newer leaf record version
  md_file.write_text(md_file.read_text().replace("ear_jax.io/leaves-1", "ear_jax.io/leaves-2"))
  with pytest.raises(CheckpointFormatError, match=f"{md_file} holds unknown field.*leaves-2"):
    CheckpointStore(tmp_path / "f").restore()
  assert json.loads(md_file.read_text())  # still JSON: only the field is unknown


def test_compaction_keeps_log2_shards_and_rewrites_each_row_at_most_log2_times():
  """The save's merge rule alone, over 3,000 saves of random sizes (1 to 2,000 rows, many small)."""
  from ear_jax.agent.memory.persistence import _compaction_start  # pylint: disable=g-import-not-at-top
  rng = random.Random(0)
  shards, writes, n = [], 0, 0  # shards: [rows]; writes: rows written in total
  for _ in range(3000):
    m = rng.choice([1, 1, 2, 3, 10, 50, 2000])
    n += m
    first = _compaction_start(shards + [m])
    merged = sum(shards[first:]) + m
    shards = shards[:first] + [merged]
    writes += merged
    assert len(shards) <= np.log2(n) + 1
    assert all(c > sum(shards[i + 1:]) for i, c in enumerate(shards))
  assert writes <= n * (np.log2(n) + 1)
  assert _compaction_start([1000, 10]) == 2  # a few rows after a big save: only they are written
  assert _compaction_start([1000, 10, 10]) == 1


@pytest.mark.slow
def test_after_150_small_saves_a_checkpoint_has_few_shards_and_loads_as_fast_as_one(tmp_path):
  from ear_jax.agent.memory import persistence  # pylint: disable=g-import-not-at-top
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  m = Memory(None, config=_mem_config())
  m.add([f"t{i}" for i in range(1000)], embeddings=_unit_rows(1000, 0))
  m.save(tmp_path / "m")
  first = CheckpointStore(tmp_path / "m").read_meta()["bank"]["shards"][0]
  emb = _unit_rows(300, 1)
  for i in range(150):
    m.add([f"u{2 * i}", f"u{2 * i + 1}"], embeddings=emb[2 * i:2 * i + 2])
    m.save(tmp_path / "m")
  listed = CheckpointStore(tmp_path / "m").read_meta()["bank"]["shards"]
  assert listed[0] == first  # the big first shard was never rewritten
  assert len(listed) <= np.log2(300) + 1  # 150 saves, 300 small rows: <= 9 shards
  shard_dirs = CheckpointStore(tmp_path / "m" / persistence.SHARDS).steps()
  assert len(shard_dirs) <= 3 * len(listed)  # those the 3 kept main steps list
  restores = []
  real = CheckpointStore.restore

  def counting(self, *args, **kw):
    restores.append(self.directory.name)
    return real(self, *args, **kw)

  CheckpointStore.restore = counting
  try:
    t = time.perf_counter()
    back = Memory.load(tmp_path / "m")
    seconds = time.perf_counter() - t
  finally:
    CheckpointStore.restore = real
  assert restores.count(persistence.SHARDS) == len(listed)
  assert back.ids == m.ids
  np.testing.assert_array_equal(back.embeddings(), m.embeddings())
  print(f"{len(listed)} shards listed, {len(shard_dirs)} on disk, load {seconds:.2f} s")


_COMPACTING_CHILD = STALLED_SAVE_CHILD + textwrap.dedent("""
    m = Memory(None, config=cfg)
    for i in range(5):  # shards after each save: 1 | 2 | 2,1 | 4 | 4,1
      m.add([f"t{i}"], embeddings=rng.normal(size=(1, 8)))
      m.save(path)
    m.add(["t5"], embeddings=rng.normal(size=(1, 8)))  # the 6th save merges 1 + 1 and prunes
    stall_save(stage, leave_tmp=True)
    m.save(path)
    print("SAVE_FINISHED", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["shard", "main", "prune"])
def test_sigkill_during_a_compacting_save_leaves_the_previous_or_the_new_checkpoint(tmp_path,
                                                                                  stage):
  from ear_jax.agent.memory import persistence  # pylint: disable=g-import-not-at-top
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  from tests.kill_helpers import sigkill_at  # pylint: disable=g-import-not-at-top
  path = tmp_path / "ckpt"
  sigkill_at(_COMPACTING_CHILD, [path, stage])
  m = Memory.load(path)
  counts = [r["count"] for r in CheckpointStore(path).read_meta()["bank"]["shards"]]
  if stage == "prune":  # the new checkpoint was complete: 6 memories, the merged shard listed
    assert len(m) == 6 and counts == [4, 2]
  else:  # the previous one
    assert len(m) == 5 and counts == [4, 1]
  m.add(["v"], embeddings=_unit_rows(1, 5, d=8))
  m.save(path)  # works after the kill and cleans up
  assert not list(path.rglob("*orbax-checkpoint-tmp*"))
  back = Memory.load(path)
  assert back.ids == m.ids
  np.testing.assert_array_equal(back.embeddings(), m.embeddings())
  listed = {r["step"] for s in CheckpointStore(path).steps()
            for r in CheckpointStore(path).read_meta(s)["bank"]["shards"]}
  assert set(CheckpointStore(path / persistence.SHARDS).steps()) == listed
