"""Hostile conditions for ear_jax/io/checkpoints.py, with real processes: saves killed with SIGKILL
at random moments, two processes saving to one directory, a reader during saves, and a restore
in a fresh interpreter (of a good and a corrupted checkpoint) that must print no asyncio "Event loop
is closed" noise nor tracebacks."""
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
