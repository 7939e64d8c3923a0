"""A memory directory is used by one process at a time: `Memory.open` (and the `save` that binds an
in-memory memory to a directory) takes its owner lock; a second process (a second MCP server on one
`--memory_dir`) is refused, naming the first one's pid, until the first closes the memory or dies
(even by SIGKILL)."""
import inspect
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from ear_jax import EARConfig
from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.io.checkpoints import DirectoryInUseError
from tests.kill_helpers import ENV, REPO

OWNER_LOCK = ".owner"  # (`checkpoints.OWNER_LOCK`)

D = 8
SETTINGS = MemoryConfig(encoder=None, config=EARConfig(
    dim=D, num_candidates=4, slate_size=2, num_rounds=1, batch_size=1, buffer_capacity=8,
    replay_size=2))

# A child that opens argv[1], adds one memory (durable: no save), prints HOLDING and waits.
_HOLDER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from ear_jax import EARConfig
    from ear_jax.agent.memory import Memory, MemoryConfig
    cfg = EARConfig(dim=8, num_candidates=4, slate_size=2, num_rounds=1, batch_size=1,
                    buffer_capacity=8, replay_size=2)
    m = Memory.open(sys.argv[1], MemoryConfig(encoder=None, config=cfg))
    m.add(["the first process's memory"], embeddings=np.ones((1, 8)))
    print("HOLDING", flush=True)
    time.sleep(300)
""")

# A child that tries to open argv[1]: prints OPENED and its ids, or REFUSED and the error.
_OPENER = textwrap.dedent("""
    import sys
    from ear_jax.agent.memory import Memory
    try:
      m = Memory.open(sys.argv[1])
    except ValueError as e:  # (a checkpoints.DirectoryInUseError)
      print("REFUSED", type(e).__name__, e, flush=True)
    else:
      print("OPENED", [r["id"] for r in m.list()], flush=True)
""")


def _memory(n=2):
  m = Memory(SETTINGS)
  m.add([f"memory {i}" for i in range(n)], embeddings=np.eye(n, D))
  return m


def test_an_open_memory_holds_its_directory_naming_this_process_until_closed(tmp_path):
  path = tmp_path / "mem"
  m = Memory.open(path, SETTINGS)
  lock = path / OWNER_LOCK
  assert lock.read_text().strip() == str(os.getpid())
  m.close()
  assert not lock.exists()
  m.close()  # idempotent
  with Memory.open(path) as again:  # opened again after the close
    assert lock.read_text().strip() == str(os.getpid())
    assert again.save() == path  # (a save keeps the lock)
    assert lock.exists()
  assert not lock.exists()


def test_a_second_open_of_one_directory_in_one_process_is_refused_naming_the_first(tmp_path):
  """Two `Memory.open` of one directory in one process both succeeded (the owner lock was the
  process's): after `a.delete(['sec'])` returned, `b.search` still found it."""
  path, link = tmp_path / "mem", tmp_path / "link"
  line = inspect.currentframe().f_lineno + 1
  first = Memory.open(path, SETTINGS)
  first.add(["sec"], ids=["sec"], embeddings=np.ones((1, D)))
  link.symlink_to(path)
  where = (f"memory directory {path} is in use by this process already \\(Memory.open at "
           f"{__file__}:{line} in thread 'MainThread'\\): one holder per directory per process")
  others = []
  for attempt in (lambda: Memory.open(path), lambda: Memory.open(tmp_path / "." / "mem"),
                  lambda: Memory.open(link), lambda: _memory().save(path),
                  lambda: others.append(Memory.open(path))):
    with pytest.raises(DirectoryInUseError, match=where):
      attempt()
  in_thread = []
  thread = threading.Thread(target=lambda: in_thread.append(_refusal(path)))
  thread.start()
  thread.join()
  assert in_thread and "in use by this process already" in in_thread[0]
  first.delete(["sec"])
  assert len(first) == 0 and not others
  first.close()
  with Memory.open(link) as again:  # released at close
    assert len(again) == 0


def _refusal(path) -> str:
  try:
    Memory.open(path).close()
  except DirectoryInUseError as e:
    return str(e)
  return "opened"


def test_saving_an_in_memory_memory_binds_it_to_the_directory_and_its_lock(tmp_path):
  path = tmp_path / "mem"
  m = _memory()
  assert not path.exists()
  assert m.save(path) == path
  assert (path / OWNER_LOCK).read_text().strip() == str(os.getpid())
  m.add(["after the save"], embeddings=np.ones((1, D)))  # durable in the bound directory
  m.close()
  assert not (path / OWNER_LOCK).exists()
  with Memory.open(path) as back:
    assert [r["text"] for r in back.list()] == ["memory 0", "memory 1", "after the save"]


@pytest.mark.slow  # (subprocesses)
def test_second_process_on_one_memory_dir_is_refused_naming_the_first_until_it_is_killed(tmp_path):
  path = tmp_path / "mem"
  holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=ENV)
  try:
    assert holder.stdout.readline().strip() == "HOLDING"
    where = f"pid {holder.pid}"
    table = (path / "rows.sqlite").read_bytes()
    for attempt in (lambda: Memory.open(path), lambda: Memory.open(path, SETTINGS),
                    lambda: _memory().save(path)):
      with pytest.raises(DirectoryInUseError, match=f"memory directory {path} .*{where}"):
        attempt()
    assert (path / "rows.sqlite").read_bytes() == table  # nothing was written
    # the MCP server's start: one clear line, no traceback
    server = subprocess.run([sys.executable, "-m", "ear_jax.agent.mcp_cli",
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
  with Memory.open(path) as back:  # the kernel dropped the killed holder's lock
    assert [r["text"] for r in back.list()] == ["the first process's memory"]  # (never saved)
    back.add(["the second process's memory"], embeddings=np.ones((1, D)) * 2)
  with Memory.open(path) as again:
    assert len(again) == 2


@pytest.mark.slow  # (subprocesses)
def test_a_directory_is_free_for_another_process_once_its_memory_is_closed(tmp_path):
  path = tmp_path / "mem"
  m = _memory()
  m.save(path)

  def open_in_child():
    out = subprocess.run([sys.executable, "-c", _OPENER, str(path)], capture_output=True,
                         text=True, env=ENV, timeout=120)
    return out.stdout.strip()

  assert open_in_child() == (f"REFUSED DirectoryInUseError memory directory {path} is in use by "
                             f"another process (pid {os.getpid()}, which holds its lock "
                             f"{path / OWNER_LOCK}): "
                             "only one process may use it at a time (stop that one first, or use "
                             "another directory)")
  m.close()
  assert open_in_child() == "OPENED ['m0', 'm1']"
