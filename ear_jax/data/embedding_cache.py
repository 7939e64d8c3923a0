"""The on-disk embedding cache: embeddings of one encoder model, keyed by the sha256 of each text.

Layout: `<cache root>/<encoder name>-<identity hash[:16]>/` holds `meta.json` (the model identity)
and `.npz` shards (`keys`, `embeddings`, `identity_hash`), each written atomically, so an
interrupted run keeps the shards it finished. Another model's directory is an error, never a
silent mix. The cache root: `default_cache_dir`.

A process reads each shard once (`open_cache`); beyond `COMPACT_AT` shards the small ones are
merged (written before they are removed: a concurrent reader never loses an embedding). At most
`MAX_RESIDENT_ROWS` rows of embeddings stay in memory (whole shards, least recently used dropped).
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import pathlib
import tempfile
import threading
import time
from typing import Sequence

import numpy as np

COMPACT_AT = 256  # shards in a directory above which the small ones read are merged into one
SMALL_SHARD = 4096  # rows of a shard that compaction merges
MAX_RESIDENT_ROWS = 1 << 18  # embeddings a process keeps in memory (~400 MB at d = 384)
_OPEN: dict = {}  # (directory, identity hash) -> EmbeddingCache, for `open_cache`
_OPEN_LOCK = threading.Lock()


def default_cache_dir() -> pathlib.Path:
  """`$EAR_CACHE_DIR`, else `$XDG_CACHE_HOME/ear_jax`, else `~/.cache/ear_jax`."""
  if os.environ.get("EAR_CACHE_DIR"):
    return pathlib.Path(os.environ["EAR_CACHE_DIR"]).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "ear_jax"


def text_key(text: str) -> str:
  """The cache / precomputed-embedding key of a text: hex sha256 of its UTF-8 bytes."""
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _atomic_write_bytes(path: pathlib.Path, writer) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name, suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      writer(f)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def _safe(name: str) -> str:
  return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "model"


def _model_dir(root: pathlib.Path, encoder) -> pathlib.Path:
  """`root` itself if it holds a `meta.json`, else `encoder`'s directory under it."""
  if (root / "meta.json").is_file():
    return root
  return root / f"{_safe(encoder.name)}-{encoder.identity_hash[:16]}"


class EmbeddingCache:
  """On-disk embeddings of one model, keyed by text sha256.

  Args:
    root: cache root (a per-model subdirectory is made under it), or a model's cache directory
      itself (holding `meta.json`), which must then belong to `encoder`.
    encoder: the encoder whose embeddings are stored.

  Raises:
    ValueError: if the directory holds another model's cache.
  """

  def __init__(self, root, encoder):
    self.identity_hash = ident_hash = encoder.identity_hash
    self.dir = _model_dir(pathlib.Path(root).expanduser(), encoder)
    self.meta_path = self.dir / "meta.json"
    if self.meta_path.is_file():
      meta = json.loads(self.meta_path.read_text())
      if meta.get("identity_hash") != ident_hash:
        raise ValueError(
            f"embedding cache {self.dir} was written by another model "
            f"({meta.get('name')!r}, identity {str(meta.get('identity_hash'))[:16]}), not by "
            f"{encoder.name!r} (identity {ident_hash[:16]}); use another cache directory")
    else:
      meta = {"name": encoder.name, "identity_hash": ident_hash, "identity": encoder.identity,
              "dim": encoder.dim}
      blob = json.dumps(meta, indent=1, sort_keys=True).encode()
      _atomic_write_bytes(self.meta_path, lambda f: f.write(blob))
    self.dim = encoder.dim
    self._where: dict[str, str] = {}  # every key seen -> the shard that holds it
    # shards in memory, least recently used first: name -> {key: embedding}
    self._loaded: "collections.OrderedDict[str, dict]" = collections.OrderedDict()
    self._resident = 0  # rows in `_loaded`
    self._read: dict[str, list | None] = {}  # shards indexed: name -> keys if small
    self._lock = threading.Lock()
    self.refresh()

  def refresh(self) -> None:
    """Reads the shards that appeared since the last call, merging small ones beyond `COMPACT_AT`.

    Raises:
      ValueError: naming a shard of another model.
    """
    with self._lock:
      names = sorted(p.name for p in self.dir.glob("shard-*.npz"))
      for name in names:
        if name in self._read:
          continue
        rows = self._load(name)
        if rows is None:
          continue  # merged by another process; its merged shard is read on a later call
        for k in rows:
          self._where.setdefault(k, name)
        self._read[name] = list(rows) if len(rows) < SMALL_SHARD else None
      if len(names) > COMPACT_AT:
        self._compact()

  def _load(self, name: str):
    """Shard `name`'s `{key: embedding}`, kept as the most recently used (None: it is gone)."""
    if name in self._loaded:
      self._loaded.move_to_end(name)
      return self._loaded[name]
    shard = self.dir / name
    try:
      with np.load(shard, allow_pickle=False) as z:
        if str(z["identity_hash"]) != self.identity_hash:
          raise ValueError(f"cache shard {shard} belongs to another model; remove it")
        rows = dict(zip(map(str, z["keys"]), z["embeddings"]))
    except FileNotFoundError:
      return None
    self._keep(name, rows)
    return rows

  def _keep(self, name: str, rows: dict) -> None:
    """Shard `name` kept as the most recently used; others dropped beyond `MAX_RESIDENT_ROWS`."""
    self._loaded[name] = rows
    self._resident += len(rows)
    while self._resident > MAX_RESIDENT_ROWS and len(self._loaded) > 1:
      _, dropped = self._loaded.popitem(last=False)
      self._resident -= len(dropped)

  def _compact(self) -> None:
    """Writes the small shards read as one shard, then removes them."""
    small = {n: k for n, k in self._read.items() if k is not None}
    if len(small) < 2:
      return
    rows = {}
    for name in list(small):
      got = self._load(name)
      if got is None:  # (another process merged it meanwhile: its keys are in its merged shard)
        del small[name], self._read[name]
        continue
      rows.update(got)
    if len(small) < 2:
      return
    keys = list(dict.fromkeys(k for ks in small.values() for k in ks))
    embeddings = np.stack([rows[k] for k in keys])
    merged = self._write(keys, embeddings)
    for name in small:
      del self._read[name]
      self._resident -= len(self._loaded.pop(name, {}))
      (self.dir / name).unlink(missing_ok=True)
    self._where.update(dict.fromkeys(keys, merged))
    self._read[merged] = keys if len(keys) < SMALL_SHARD else None
    self._keep(merged, dict(zip(keys, embeddings)))

  def _write(self, keys, embeddings) -> str:
    """Writes one shard atomically; returns its name."""
    name = f"shard-{time.time_ns():020d}-{os.getpid()}.npz"
    arrays = dict(keys=np.asarray(list(keys)), embeddings=np.asarray(embeddings, np.float32),
                  identity_hash=np.asarray(self.identity_hash))
    _atomic_write_bytes(self.dir / name, lambda f: np.savez(f, **arrays))
    return name

  def __len__(self):
    return len(self._where)

  def get(self, key: str):
    """The embedding of `key`, or None (not cached, or its shard was removed by hand)."""
    with self._lock:
      name = self._where.get(key)
      if name is None:
        return None
      rows = self._load(name)
      if rows is None:  # (removed meanwhile: encoded again by the caller)
        del self._where[key]
        return None
      return rows.get(key)

  def add(self, keys: Sequence[str], embeddings: np.ndarray) -> None:
    """Stores and persists a shard (atomically)."""
    if not keys:
      return
    keys, embeddings = list(keys), np.asarray(embeddings, np.float32)
    with self._lock:
      name = self._write(keys, embeddings)
      self._read[name] = keys if len(keys) < SMALL_SHARD else None
      self._where.update(dict.fromkeys(keys, name))
      self._keep(name, dict(zip(keys, embeddings)))


def open_cache(root, encoder) -> EmbeddingCache:
  """This process's `EmbeddingCache` of `encoder` under `root` (made once, then `refresh`ed)."""
  directory = _model_dir(pathlib.Path(root).expanduser(), encoder)
  key = (str(directory.resolve()), encoder.identity_hash)
  with _OPEN_LOCK:
    cache = _OPEN.get(key)
    if cache is None or not cache.meta_path.is_file():  # new, or its directory was removed
      cache = _OPEN[key] = EmbeddingCache(root, encoder)
      return cache
  cache.refresh()
  return cache
