"""An inter-process lock on a directory: an exclusive `fcntl.flock` on `<directory>/.lock`."""
from __future__ import annotations

import fcntl
import os
import pathlib
import time

LOCK_NAME = ".lock"


class LockTimeout(TimeoutError):
  """Another process held the lock longer than the timeout."""


class DirLock:
  """An exclusive `flock` on `<directory>/.lock`, removed again on release.

  The file is unlinked while the lock is still held; a waiter that then gets the lock on the
  unlinked inode notices (the path no longer names its inode) and retries on the current file, so
  two holders never overlap. A holder killed with SIGKILL loses its lock with its file descriptor;
  the stale file it leaves is reused by the next holder.

  Args:
    directory: an existing directory.
    timeout_s: how long `__enter__` waits before raising `LockTimeout`.
    name: the lock file's name (another name is another, independent lock).
  """

  def __init__(self, directory: pathlib.Path, timeout_s: float, name: str = LOCK_NAME):
    self.path = pathlib.Path(directory) / name
    self.timeout_s = float(timeout_s)
    self._fd = None

  def __enter__(self) -> "DirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()

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
        try:
          same = os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
          same = False
        if same:
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
      os.unlink(self.path)
    except FileNotFoundError:
      pass
    finally:
      os.close(self._fd)  # releases the flock
      self._fd = None
