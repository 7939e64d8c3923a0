"""An on-disk cache of chat-completion replies, so an interrupted run resumes and a rerun is free.

The key: the SHA-256 of the endpoint (`cache_endpoint`) and the canonical JSON of the request body
(never the API key). An entry, `<dir>/<key[:2]>/<key>.json`, is written atomically; a corrupted
one is a miss with a warning. Only 'ok' replies are stored. Safe between threads and processes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import tempfile
import urllib.parse
from typing import Any

from absl import logging

_VERSION = 1
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def cache_endpoint(url: str) -> str:
  """The endpoint as cache key material: the URL, a loopback host's port dropped."""
  parts = urllib.parse.urlsplit(url)
  if (parts.hostname or "").lower() in _LOOPBACK:
    return urllib.parse.urlunsplit((parts.scheme, "loopback", parts.path, "", ""))
  return url


def cache_key(url: str, body: dict[str, Any]) -> str:
  """The hex SHA-256 of `cache_endpoint(url)` and the canonical (sorted-keys) JSON of the body."""
  canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                         allow_nan=False)
  return hashlib.sha256(f"{cache_endpoint(url)}\n{canonical}".encode("utf-8")).hexdigest()


class ResponseCache:
  """Reply texts on disk under `directory` (created on the first write), keyed by `cache_key`."""

  def __init__(self, directory: str | os.PathLike):
    self.directory = pathlib.Path(directory).expanduser()
    if self.directory.exists() and not self.directory.is_dir():
      raise ValueError(f"LLM cache directory {str(self.directory)!r} exists and is not a folder")

  def __repr__(self):
    return f"ResponseCache({str(self.directory)!r})"

  def path(self, key: str) -> pathlib.Path:
    return self.directory / key[:2] / f"{key}.json"

  def get(self, key: str) -> tuple[str, dict[str, Any]] | None:
    """`(text, usage)` stored under `key`, or None (missing, unreadable or corrupted: warned)."""
    path = self.path(key)
    try:
      raw = path.read_bytes()
    except FileNotFoundError:
      return None
    except OSError as e:
      logging.warning("LLM cache: entry %s cannot be read (%s); ignoring it", path, e)
      return None
    try:
      entry = json.loads(raw.decode("utf-8"))
      text, usage = entry["text"], entry.get("usage", {})
      if entry.get("version") != _VERSION or entry.get("key") != key:
        raise ValueError("version or key does not match")
      if not isinstance(text, str) or not isinstance(usage, dict):
        raise ValueError("text or usage has the wrong type")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
      logging.warning("LLM cache: entry %s is corrupted (%s: %s); ignoring it", path,
                      type(e).__name__, str(e)[:120])
      return None
    return text, usage

  def put(self, key: str, text: str, usage: dict[str, Any], *, url: str = "", model: str = ""):
    """Stores a reply atomically; an I/O error is logged, never raised (the run goes on)."""
    path = self.path(key)
    entry = {"version": _VERSION, "key": key, "url": url, "model": model, "text": text,
             "usage": usage}
    tmp = None
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:8]}.", suffix=".tmp")
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(entry, f, ensure_ascii=False)
      os.replace(tmp, path)
      tmp = None
    except OSError as e:
      logging.warning("LLM cache: could not write %s (%s); the reply is not cached", path, e)
    finally:
      if tmp is not None:
        with contextlib.suppress(OSError):
          os.unlink(tmp)
