"""Kill a child Python process with SIGKILL at a point it announces (the kill tests)."""
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "JAX_PLATFORMS": "cpu"}

# The start of a child killed at a write point (`sigkill_at(STALLED_CHILD + body, [path, stage],
# marker="STALLED")`): `path, stage` from argv, a tiny `cfg`, `rng`, and `stall_at(stage)`, after
# which the memory's next write of that kind prints STALLED and blocks: 'commit' (the next SQLite
# COMMIT, before it runs), 'learner' / 'ann' (writing a step of the learner's / the faiss index's
# checkpoint store) or 'prune' (deleting an older step once the new one was verified, after its
# rename to `.trash-*`).
# `sqlite3.connect` is wrapped before ear_jax is imported, so every connection is traced.
STALLED_CHILD = textwrap.dedent("""
    import shutil, sqlite3, sys, time
    _connect, _armed = sqlite3.connect, []
    def _traced(*args, **kw):
      db = _connect(*args, **kw)
      db.set_trace_callback(
          lambda sql: _armed and sql.strip().upper().startswith(("COMMIT", "END")) and stall())
      return db
    sqlite3.connect = _traced
    import numpy as np
    from ear_jax import EARConfig
    from ear_jax.agent.memory import Memory, MemoryConfig
    from ear_jax.io import checkpoints
    path, stage = sys.argv[1], sys.argv[2]
    cfg = EARConfig(dim=8, num_candidates=4, slate_size=2, num_rounds=1, batch_size=1,
                    buffer_capacity=8, replay_size=2)
    rng = np.random.default_rng(0)

    def stall():
      print("STALLED", flush=True)
      time.sleep(120)

    def stall_at(stage):
      if stage == "commit":
        _armed.append(True)
      elif stage == "prune":  # once the older step is renamed to `.trash-*`, before it is deleted
        real_rmtree = shutil.rmtree
        def rmtree(p, *args, **kw):
          if ".trash-" in str(p):
            stall()
          return real_rmtree(p, *args, **kw)
        shutil.rmtree = rmtree
      else:
        real_write = checkpoints.CheckpointStore._write
        def write(self, step, *args):
          if self.directory.name == stage:
            stall()
          return real_write(self, step, *args)
        checkpoints.CheckpointStore._write = write
""")


def sigkill_at(code: str, args, marker: str = "IN_SAVE", timeout_s: float = 180) -> list[str]:
  """Runs `python -c code *args`, SIGKILLs it once it prints a line holding `marker`; returns the
  lines it printed before.

  Fails the test if the child never prints `marker` within `timeout_s` or was not killed by the
  signal (e.g. it crashed first).
  """
  err = tempfile.TemporaryFile("w+")  # (not a pipe: a full pipe would block the child)
  proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                          stderr=err, text=True, env=ENV)
  lines = []
  try:
    deadline, line = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
      line = proc.stdout.readline()
      if not line or marker in line:
        break
      lines.append(line.rstrip("\n"))
    if marker not in line:
      proc.kill()
      proc.wait(timeout=30)
      err.seek(0)
      raise AssertionError(f"the child never printed {marker}: {lines}\n{err.read()[-3000:]}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
    err.close()
  assert proc.returncode == -signal.SIGKILL
  return lines
