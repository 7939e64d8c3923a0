"""Kill a child Python process with SIGKILL at a point it announces (the kill-during-save tests)."""
import os
import pathlib
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def sigkill_at(code: str, args, marker: str = "IN_SAVE", timeout_s: float = 180) -> None:
  """Runs `python -c code *args`, SIGKILLs it once it prints a line holding `marker`.

  Fails the test if the child never prints `marker` within `timeout_s` or was not killed by the
  signal (e.g. it crashed first).
  """
  env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, env=env)
  try:
    deadline, line = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
      line = proc.stdout.readline()
      if not line or marker in line:
        break
    assert marker in line, "the child never reached the save"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == -signal.SIGKILL
