"""Precomputed embeddings, looked up by text: a file, or an embedding cache directory.

Symbols: `n` texts, `d` embedding dimension. `PrecomputedEncoder`: a `.npz` with `embeddings
[n, d]` and either `texts [n]` or `keys [n]` (each text's sha256, `embedding_cache.text_key`), or
a `.npy` with a `<stem>.texts.json` list; rows are normalised on load (`encoder_base.unit_rows`).

`CacheDirEncoder`: one model's cache directory used as the encoder with no model; it returns the
cached rows bit for bit, so a run over cached texts equals the model's own.
"""
from __future__ import annotations

import json
import pathlib
import zipfile

import numpy as np

from ear_jax.data import embedding_cache
from ear_jax.data import encoder_base


def _read(z, name: str, path: pathlib.Path) -> np.ndarray:
  """Array `name` of an open `.npz`; an object array (ragged rows, None) is an error naming both."""
  try:
    return z[name]
  except ValueError as e:
    raise ValueError(f"{path}: array {name!r} cannot be read ({e}; an array of Python objects, "
                     "e.g. ragged rows or None, is not allowed)") from None


class PrecomputedEncoder(encoder_base.Encoder):
  """Embeddings looked up in a `.npz` (`embeddings` + `texts` or `keys`) or `.npy` + `.texts.json`.

  Raises:
    ValueError: naming the file, when it is missing, malformed or holds bad values.
  """

  cacheable = False  # (the file is the cache)

  def __init__(self, path):
    path = pathlib.Path(path).expanduser()
    if not path.is_file():
      raise ValueError(f"precomputed embedding file {str(path)!r} does not exist")
    self.path = path.resolve()
    self.name = path.stem
    text_key = embedding_cache.text_key
    if path.suffix == ".npz":
      try:
        with np.load(path, allow_pickle=False) as z:
          if "embeddings" not in z:
            raise ValueError(f"{path}: missing array 'embeddings' (expected 'embeddings' and "
                             "'texts' or 'keys')")
          emb = _read(z, "embeddings", path)
          if "keys" in z:
            keys = [str(k) for k in _read(z, "keys", path)]
          elif "texts" in z:
            keys = [text_key(str(t)) for t in _read(z, "texts", path)]
          else:
            raise ValueError(f"{path}: missing array 'texts' or 'keys' next to 'embeddings'")
      except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable .npz file ({type(e).__name__}: {e})") from None
    elif path.suffix == ".npy":
      try:
        emb = np.load(path, allow_pickle=False)
      except (OSError, EOFError, ValueError) as e:
        raise ValueError(f"{path}: not a readable .npy array of numbers ({type(e).__name__}: "
                         f"{e})") from None
      side = path.with_suffix(".texts.json")
      if not side.is_file():
        raise ValueError(f"{path}: a .npy of embeddings needs its texts in {side} (a JSON list)")
      keys = [text_key(t) for t in json.loads(side.read_text())]
    else:
      raise ValueError(f"{path}: precomputed embeddings must be a .npy or .npz file")
    emb = encoder_base.real_array(emb, f"{path}: embeddings")
    if emb.ndim != 2 or emb.shape[0] != len(keys):
      raise ValueError(f"{path}: embeddings shape {emb.shape} does not match {len(keys)} texts/keys")
    self._emb = encoder_base.unit_rows(emb, f"{path}: embeddings")  # NaN / Inf / zero rows refused
    self._index = {k: i for i, k in enumerate(keys)}
    self.dim = int(emb.shape[1])
    self.max_length = None
    self._sha = encoder_base.hash_file(path)

  @property
  def identity(self) -> dict:
    return {"kind": "precomputed", "sha256": self._sha, "dim": self.dim}

  def encode_new(self, texts, progress=True, bar=None):
    texts = encoder_base.check_texts(texts)
    rows = [self._index.get(embedding_cache.text_key(t)) for t in texts]
    missing = [t for t, r in zip(texts, rows) if r is None]
    if missing:
      raise ValueError(f"{self.path}: {len(missing)} texts have no precomputed embedding, "
                       f"e.g. {missing[0][:80]!r}")
    return self._emb[np.asarray(rows, np.int64)].reshape(len(texts), self.dim), 0


class CacheDirEncoder(encoder_base.Encoder):
  """The embeddings of one model's cache directory (holding `meta.json`), with no model.

  Raises:
    ValueError: naming the directory, when its `meta.json` is missing, unreadable or inconsistent.
  """
  cacheable = False  # (the directory is the cache)

  def __init__(self, path):
    path = pathlib.Path(path).expanduser()
    try:
      meta = json.loads((path / "meta.json").read_text())
      self.name, self._identity, self.dim = meta["name"], meta["identity"], int(meta["dim"])
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ValueError(f"embedding cache directory {str(path)!r}: unreadable meta.json "
                       f"({type(e).__name__}: {e})") from None
    if self.identity_hash != meta.get("identity_hash"):
      raise ValueError(f"embedding cache directory {str(path)!r}: meta.json's identity does not "
                       "hash to its identity_hash (edited by hand?)")
    self.path = path.resolve()
    self.max_length = self._identity.get("max_length")
    self._cache = embedding_cache.EmbeddingCache(self.path, self)

  @property
  def identity(self) -> dict:
    return self._identity

  def encode_new(self, texts, progress=True, bar=None):
    texts = encoder_base.check_texts(texts)
    self._cache.refresh()
    rows = [self._cache.get(embedding_cache.text_key(t)) for t in texts]
    missing = [t for t, r in zip(texts, rows) if r is None]
    if missing:
      raise ValueError(f"embedding cache directory {str(self.path)!r} (model {self.name!r}, no "
                       f"model loaded): {len(missing)} texts are not in it, e.g. "
                       f"{missing[0][:80]!r}")
    return np.stack(rows).reshape(len(texts), self.dim).astype(np.float32, copy=False), 0
