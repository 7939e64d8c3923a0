"""JAX's persistent compilation cache: a second process loads what the first compiled.

`enable()` points JAX at `directory()` (`$EAR_CACHE_DIR/xla`, else `$XDG_CACHE_HOME/ear_jax/xla`,
else `~/.cache/ear_jax/xla`) and caches every compiled program, unless the caller chose a cache or
set `EAR_NO_COMPILATION_CACHE`. It holds compiled programs only, never a memory's data; JAX treats
it as trusted code, so keep it in a directory only you can write. Each `enable()` keeps it under
`MAX_BYTES`, removing the least recently used programs first (JAX's own size bound would rescan
the directory on every write).
"""
from __future__ import annotations

import os
import pathlib
import stat
from typing import Optional

OFF = "EAR_NO_COMPILATION_CACHE"  # the opt-out
MAX_BYTES = 1 << 30  # the cache's size after `enable()` prunes it


def directory() -> pathlib.Path:
  """The cache's directory (see the module docstring)."""
  from ear_jax.data.embedding_cache import default_cache_dir  # pylint: disable=g-import-not-at-top
  return default_cache_dir() / "xla"


def enable() -> Optional[str]:
  """Turns the cache on at `directory()` unless set or opted out; returns it (None: no cache)."""
  import jax  # pylint: disable=g-import-not-at-top
  chosen = jax.config.jax_compilation_cache_dir
  if chosen:
    return chosen
  if os.environ.get(OFF, "") not in ("", "0"):
    return None
  path = directory()
  try:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
  except OSError:  # (a read-only home: no cache, as before)
    return None
  prune(path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_compilation_cache_dir", str(path))
  return str(path)


def prune(path: pathlib.Path, max_bytes: int = MAX_BYTES) -> int:
  """Removes the least recently used files of `path` until it holds `max_bytes`; returns how many."""
  entries = []
  for f in path.iterdir():
    try:
      st = f.stat()
    except OSError:  # (removed by another process meanwhile)
      continue
    if stat.S_ISREG(st.st_mode):
      entries.append((max(st.st_atime, st.st_mtime), st.st_size, f))
  total, removed = sum(e[1] for e in entries), 0
  for _, size, f in sorted(entries, key=lambda e: e[0]):
    if total <= max_bytes:
      break
    f.unlink(missing_ok=True)
    total, removed = total - size, removed + 1
  return removed
