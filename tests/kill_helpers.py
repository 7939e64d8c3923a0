"""Kill a child Python process with SIGKILL at a point it announces (the kill-during-save tests)."""
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

# The start of a kill-during-save child (`sigkill_at(STALLED_SAVE_CHILD + body, [path, stage])`):
# `path, stage` from argv, a tiny `cfg`, `rng`, and `stall_save(stage, leave_tmp)`, after which the
# next `Memory.save` prints IN_SAVE and blocks where `stage` says: 'shard' (writing a bank shard),
# 'main' (writing the main step) or any other name (deleting an older step: prune / purge).
# `leave_tmp`: a stalled write first leaves an Orbax temporary directory behind, as a real one would.
STALLED_SAVE_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from ear_jax import EARConfig
    from ear_jax.agent.memory import Memory
    from ear_jax.io import checkpoints
    path, stage = sys.argv[1], sys.argv[2]
    cfg = EARConfig(dim=8, num_candidates=4, slate_size=2, num_rounds=1, batch_size=1,
                    buffer_capacity=8, replay_size=2)
    rng = np.random.default_rng(0)

    def stall_save(stage, leave_tmp=False):
      real_write = checkpoints.CheckpointStore._write
      real_delete = checkpoints.CheckpointStore.delete
      in_write = stage in ("shard", "main")
      def stall():
        print("IN_SAVE", flush=True)
        time.sleep(120)
      def write(self, step, *args):
        if in_write and (stage == "shard") == (self.directory.name == "bank_shards"):
          if leave_tmp:
            (self.directory / f"{step}.orbax-checkpoint-tmp-0").mkdir()
          stall()
        return real_write(self, step, *args)
      def delete(self, step):
        if not in_write:
          stall()
        return real_delete(self, step)
      checkpoints.CheckpointStore._write = write
      checkpoints.CheckpointStore.delete = delete
""")


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
