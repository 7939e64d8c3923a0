"""A memory directory is used by one process at a time (issue 31 item 6, `Memory.claim`): a second
process (a second MCP server on one `--memory_dir`) is refused, naming the first one's pid, until
the first releases it or dies (even by SIGKILL); `Memory` instances of one process share it."""
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ear_jax import EARConfig
from ear_jax.agent.memory import Memory
from tests.kill_helpers import REPO

OWNER_LOCK = ".owner"  # (`checkpoints.OWNER_LOCK`)

D = 8
CFG = EARConfig(dim=D, num_candidates=4, slate_size=2, num_rounds=1, batch_size=1,
                buffer_capacity=8, replay_size=2)
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "JAX_PLATFORMS": "cpu"}

# A child that saves a memory to argv[1] (so it holds the directory), prints HOLDING and waits.
_HOLDER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from ear_jax import EARConfig
    from ear_jax.agent.memory import Memory
    cfg = EARConfig(dim=8, num_candidates=4, slate_size=2, num_rounds=1, batch_size=1,
                    buffer_capacity=8, replay_size=2)
    m = Memory(None, config=cfg)
    m.add(["the first process's memory"], embeddings=np.ones((1, 8)))
    m.save(sys.argv[1])
    print("HOLDING", flush=True)
    time.sleep(300)
""")

# A child that tries to open argv[1]: prints OPENED and its ids, or REFUSED and the error.
_OPENER = textwrap.dedent("""
    import sys
    from ear_jax.agent.memory import Memory
    try:
      m = Memory.load(sys.argv[1])
    except ValueError as e:  # (a checkpoints.DirectoryInUseError)
      print("REFUSED", type(e).__name__, e, flush=True)
    else:
      print("OPENED", m.ids, flush=True)
""")


def _memory(n=2):
  m = Memory(None, config=CFG)
  m.add([f"memory {i}" for i in range(n)], embeddings=np.eye(n, D))
  return m


def test_a_claimed_directory_names_this_process_until_released(tmp_path):
  m = _memory()
  root = m.claim(tmp_path / "mem")
  lock = root / OWNER_LOCK
  assert lock.read_text().strip() == str(os.getpid())
  other = _memory()
  assert other.claim(root) == root  # another instance of this process shares the lock
  m.release()
  assert lock.exists()  # `other` still holds it
  other.release()
  other.release()  # idempotent
  assert not lock.exists()
  assert m.claim(root) == root and lock.exists()  # claimed again after release
  del m  # (garbage-collected: released)
  assert not lock.exists()


@pytest.mark.slow  # (subprocesses)
def test_second_process_on_one_memory_dir_is_refused_naming_the_first_until_it_is_killed(tmp_path):
  from ear_jax.agent import mcp_server  # pylint: disable=g-import-not-at-top
  path = tmp_path / "mem"
  holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=ENV)
  try:
    assert holder.stdout.readline().strip() == "HOLDING"
    where = f"pid {holder.pid}"
    for attempt in (lambda: Memory.load(path), lambda: _memory().save(path),
                    lambda: _memory().restore(path), lambda: _memory().claim(path),
                    lambda: mcp_server.open_memory(path)):
      with pytest.raises(ValueError, match=f"memory directory {path} .*{where}") as e:
        attempt()
      assert type(e.value).__name__ == "DirectoryInUseError"
    assert not list(path.glob("2"))  # nothing was written
    # the MCP server's start: one clear line, no traceback
    server = subprocess.run([sys.executable, "-m", "experiments.mcp_server",
                             f"--memory_dir={path}"], capture_output=True, text=True, env=ENV,
                            cwd=str(REPO), timeout=120, stdin=subprocess.DEVNULL)
    assert server.returncode != 0
    assert where in server.stderr and str(path) in server.stderr, server.stderr
    assert "Traceback" not in server.stderr, server.stderr
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
  finally:
    if holder.poll() is None:
      holder.kill()
  back = Memory.load(path)  # the kernel dropped the killed holder's lock
  assert back.ids == ["m0"]
  back.add(["the second process's memory"], embeddings=np.ones((1, D)) * 2)
  back.save(path)
  assert Memory.load(path).ids == ["m0", "m1"]


@pytest.mark.slow  # (subprocesses)
def test_memories_of_one_process_share_the_directory_and_the_last_release_frees_it(tmp_path):
  path = tmp_path / "mem"
  m = _memory()
  m.save(path)
  back = Memory.load(path)  # the same process: allowed

  def open_in_child():
    out = subprocess.run([sys.executable, "-c", _OPENER, str(path)], capture_output=True,
                         text=True, env=ENV, timeout=120)
    return out.stdout.strip()

  assert open_in_child() == (f"REFUSED DirectoryInUseError memory directory {path} is in use by "
                             f"another process (pid {os.getpid()}, which holds its lock "
                             f"{path / OWNER_LOCK}): "
                             "only one process may use it at a time (stop that one first, or use "
                             "another directory)")
  m.release()
  assert open_in_child().startswith("REFUSED")  # `back` still holds it
  back.release()
  assert open_in_child() == "OPENED ['m0', 'm1']"
