"""Fetching the official benchmark files (`ear_jax.data.sources.SOURCES`) into the data directory.

LoCoMo (CC BY-NC 4.0) is verified against a pinned sha256; LongMemEval_S (MIT) comes from the
cleaned Hugging Face dataset, else the original. Files are written atomically, so an interrupted
download never leaves a truncated file; offline, the error says which file to put where.
`base_url` overrides the host part (tests use a loopback server).
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
import urllib.error
import urllib.request

from ear_jax.data import corpora
from ear_jax.data import sources


class DownloadError(RuntimeError):
  """A benchmark file could not be fetched; the message says what to put where."""


def fetch(url: str, dest, *, sha256: str | None = None, timeout: float = 60.0) -> pathlib.Path:
  """Downloads `url` to `dest` atomically, checking `sha256` when given.

  Raises:
    DownloadError: on a network error or a digest mismatch (nothing is left at `dest`).
  """
  dest = pathlib.Path(dest)
  dest.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix="." + dest.name, suffix=".part")
  try:
    h = hashlib.sha256()
    with os.fdopen(fd, "wb") as f:
      req = urllib.request.Request(url, headers={"User-Agent": "ear_jax"})
      with urllib.request.urlopen(req, timeout=timeout) as resp:
        for chunk in iter(lambda: resp.read(1 << 20), b""):
          f.write(chunk)
          h.update(chunk)
    if sha256 is not None and h.hexdigest() != sha256:
      raise DownloadError(f"{url}: sha256 {h.hexdigest()} does not match the expected {sha256}; "
                          f"not written to {dest}")
    os.replace(tmp, dest)
    return dest
  except (urllib.error.URLError, OSError, TimeoutError) as e:
    raise DownloadError(f"cannot fetch {url}: {e}") from e
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def download(name: str, data_dir=None, *, base_url: str | None = None, force: bool = False,
             timeout: float = 60.0) -> pathlib.Path:
  """Makes sure the benchmark file of `name` ('locomo' | 'longmemeval') is in the data directory.

  `data_dir` as `corpora.resolve_data_dir`; `base_url` replaces `https://github.com` /
  `https://huggingface.co`; `force` fetches even when a file is there; `timeout` per connection.

  Returns:
    The path of the benchmark file.

  Raises:
    DownloadError: naming the file to put where, when every source failed.
  """
  if name not in sources.SOURCES:
    raise ValueError(f"unknown benchmark {name!r}; expected one of {sorted(sources.SOURCES)}")
  d = corpora.resolve_data_dir(data_dir)
  if not force:
    try:
      return corpora.find_benchmark_file(name, d)
    except FileNotFoundError:
      pass
  errors = []
  for s in sources.SOURCES[name]:
    url = s.url if base_url is None else base_url.rstrip("/") + s.path
    try:
      return fetch(url, d / s.filename, sha256=s.sha256, timeout=timeout)
    except DownloadError as e:
      errors.append(str(e))
  raise DownloadError("; ".join(errors) + "\n" + sources.missing_file_message(name, d))
