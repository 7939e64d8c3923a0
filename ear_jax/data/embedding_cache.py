"""The on-disk embedding cache: embeddings of one encoder model, keyed by the sha256 of each text.

Layout: `<cache root>/<encoder name>-<identity hash[:16]>/` holds `meta.json` (the full model
identity) and `.npz` shards of (`keys`: text sha256, `embeddings`, `identity_hash`), each written
atomically, so an interrupted run keeps the shards it finished. A directory written by another model
is an error, never a silent mix. The cache root is `$EAR_CACHE_DIR`, else `$XDG_CACHE_HOME/ear_jax`,
else `~/.cache/ear_jax`.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
import time
from typing import Sequence

import numpy as np


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


class EmbeddingCache:
  """On-disk embeddings of one model, keyed by text sha256.

  Args:
    root: cache root (a per-model subdirectory is made under it), or a model's cache directory
      itself (one holding `meta.json`), which must then belong to `encoder`.
    encoder: the encoder whose embeddings are stored (`name`, `dim`, `identity`, `identity_hash`).

  Raises:
    ValueError: if the directory holds another model's cache.
  """

  def __init__(self, root, encoder):
    root = pathlib.Path(root).expanduser()
    ident_hash = encoder.identity_hash
    if (root / "meta.json").is_file():
      self.dir = root
    else:
      self.dir = root / f"{_safe(encoder.name)}-{ident_hash[:16]}"
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
    self.identity_hash = ident_hash
    self.dim = encoder.dim
    self._emb: dict[str, np.ndarray] = {}
    for shard in sorted(self.dir.glob("shard-*.npz")):
      with np.load(shard, allow_pickle=False) as z:
        if str(z["identity_hash"]) != ident_hash:
          raise ValueError(f"cache shard {shard} belongs to another model; remove it")
        for k, e in zip(z["keys"], z["embeddings"]):
          self._emb[str(k)] = e

  def __len__(self):
    return len(self._emb)

  def get(self, key: str):
    return self._emb.get(key)

  def add(self, keys: Sequence[str], embeddings: np.ndarray) -> None:
    """Stores and persists a shard (atomically)."""
    if not keys:
      return
    keys_arr = np.asarray(list(keys))
    embeddings = np.asarray(embeddings, np.float32)
    name = f"shard-{time.time_ns():020d}-{os.getpid()}.npz"

    def writer(f):
      np.savez(f, keys=keys_arr, embeddings=embeddings, identity_hash=np.asarray(self.identity_hash))

    _atomic_write_bytes(self.dir / name, writer)
    for k, e in zip(keys, embeddings):
      self._emb[k] = e
