"""Inter-process directory locks: an exclusive `fcntl.flock` on `<directory>/.lock` (`DirLock`),
and a directory's owner lock held by one holder of one process (`hold`).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import threading
import time
import weakref


class LockTimeout(TimeoutError):
  """Another process held the lock longer than the timeout."""


class HeldHere(LockTimeout):
  """This process holds the owner lock already (`hold`); the message names its holder."""


class DirLock:
  """An exclusive `flock` on `<directory>/.lock`, removed again on release.

  The file is unlinked while still held; a waiter that got the unlinked inode retries on the
  current file, so two holders never overlap. A SIGKILLed holder's lock dies with its descriptor.

  Args:
    directory: an existing directory.
    timeout_s: how long `acquire` waits before raising `LockTimeout`.
    name: the lock file's name (another name is another, independent lock).
  """

  def __init__(self, directory: pathlib.Path, timeout_s: float, name: str = ".lock"):
    self.path = pathlib.Path(directory) / name
    self.timeout_s = float(timeout_s)
    self._fd = None

  def acquire(self) -> "DirLock":
    """Takes the lock, waiting up to `timeout_s`; raises `LockTimeout` after that."""
    deadline = time.monotonic() + self.timeout_s
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        while True:
          try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
          except BlockingIOError:
            if time.monotonic() >= deadline:
              raise LockTimeout(
                  f"{self.path.parent} is being written by another process ({self.holder()}); "
                  f"waited {self.timeout_s:g} s for its lock {self.path}") from None
            time.sleep(0.02)
        with contextlib.suppress(FileNotFoundError):
          if os.path.samestat(os.fstat(fd), os.stat(self.path)):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._fd = fd
            return self
      except BaseException:
        os.close(fd)
        raise
      os.close(fd)  # the previous holder removed that file: lock the current one

  def holder(self) -> str:
    """'pid N' of the process that last took the lock (best effort)."""
    try:
      return f"pid {int(self.path.read_text().strip())}"
    except (OSError, ValueError):
      return "pid unknown"

  def release(self) -> None:
    """Removes the lock file and releases the lock."""
    try:
      self.path.unlink(missing_ok=True)
    finally:
      os.close(self._fd)  # releases the flock
      self._fd = None


class Hold:
  """A process's owner lock on a directory (`hold`); `release` or garbage collection frees it."""

  def __init__(self, key: str):
    self._finalizer = weakref.finalize(self, _drop, key)

  def release(self) -> None:
    """Idempotent."""
    self._finalizer()


# The owner locks this process holds, by the lock file's real path (flock alone would not refuse a
# second holder in this process). Process state by nature, hence module state.
_OWNED: dict[str, tuple] = {}  # realpath of the lock file -> (DirLock, its holder's description)
_OWNED_LOCK = threading.Lock()


def hold(directory: pathlib.Path, name: str, holder: str = "") -> Hold:
  """This process's exclusive owner lock `<directory>/<name>` (never waits), for ONE holder.

  The directory's real path names it, so another spelling of the path is the same lock; `holder`
  is named in the error of a second `hold` in this process.

  Raises:
    HeldHere: this process holds it already (naming the directory and the first `holder`).
    LockTimeout: another process holds it (naming the directory and its pid).
  """
  key = os.path.realpath(pathlib.Path(directory) / name)
  with _OWNED_LOCK:
    if key in _OWNED:
      raise HeldHere(f"{pathlib.Path(key).parent} is in use by this process already ("
                     f"{_OWNED[key][1] or 'another holder'})")
    lock = DirLock(pathlib.Path(key).parent, 0.0, name)
    try:
      lock.acquire()
    except LockTimeout:
      raise LockTimeout(f"{lock.path.parent} is in use by another process ({lock.holder()}, "
                        f"which holds its lock {lock.path})") from None
    _OWNED[key] = (lock, holder)
  return Hold(key)


def _drop(key: str) -> None:
  with _OWNED_LOCK:
    entry = _OWNED.pop(key, None)
    if entry is not None:
      entry[0].release()


def _forget_in_child() -> None:
  """A forked child closes its copies of the parent's lock files (the parent keeps the flock)."""
  global _OWNED_LOCK  # (another thread may have held it at the fork)
  _OWNED_LOCK = threading.Lock()
  for lock, _ in _OWNED.values():
    with contextlib.suppress(OSError):
      os.close(lock._fd)  # pylint: disable=protected-access
  _OWNED.clear()


os.register_at_fork(after_in_child=_forget_in_child)
