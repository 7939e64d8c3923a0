"""The encoder interface (`Encoder`) and the helpers every encoder shares.

Symbols: `n` texts, `d` embedding dimension.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Sequence

import numpy as np


class Encoder:
  """Base class: `identity` (JSON-able) names the model and keys the cache; `encode_new` embeds.

  `cacheable`: whether `encoders.encode` keeps its embeddings in the on-disk cache.
  """
  name: str
  dim: int
  cacheable: bool = True

  @property
  def identity(self) -> dict:
    raise NotImplementedError

  @property
  def identity_hash(self) -> str:
    return hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()

  def encode_new(self, texts: Sequence[str], progress: bool = True, bar=None
                 ) -> tuple[np.ndarray, int]:
    """Embeds `texts` (no cache): (`[n, d]` float32 unit vectors, number truncated)."""
    raise NotImplementedError


def _show(text: str, limit: int = 40) -> str:
  return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def check_texts(texts: Sequence[str]) -> list[str]:
  """`texts` as a list, each checked to be a string that UTF-8 can encode.

  Raises:
    ValueError: naming the index and a short repr of the first bad text.
  """
  texts = list(texts)
  for i, t in enumerate(texts):
    if not isinstance(t, str):
      shown = repr(t) if len(repr(t)) <= 40 else repr(t)[:40] + "..."
      raise ValueError(f"text {i} is {type(t).__name__} ({shown}), not a string")
    try:
      t.encode("utf-8")
    except UnicodeEncodeError as e:
      raise ValueError(f"text {i} {_show(t)} is not valid Unicode: character {e.start} is a lone "
                       f"surrogate {t[e.start]!r} (mis-decoded input?)") from None
  return texts


# A float32 row whose norm is at most this (or infinite) is rescaled before it is normalised.
_MIN_NORM = 1e-12
_NOT_REAL = {"c": "complex numbers (the imaginary part would be dropped; pass np.real(x) or "
                  "np.abs(x) explicitly if that is meant)",
             "b": "booleans", "U": "strings", "S": "bytes", "O": "Python objects (ragged rows, "
             "None or non-numeric values?)", "M": "dates", "m": "time deltas",
             "V": "structured records"}


def _is_real_dtype(dtype: np.dtype) -> bool:
  """Float or integer dtypes, including JAX's extra floats (bfloat16, float8_*)."""
  if dtype.kind in "fiu":
    return True
  if dtype.kind != "V":  # ml_dtypes' floats are kind "V"; its finfo would accept complex too
    return False
  try:
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    ml_dtypes.finfo(dtype)
    return True
  except (ImportError, ValueError, TypeError):
    return False


def real_array(x, what: str) -> np.ndarray:
  """`x` as a NumPy array of real numbers (float or integer dtype), never silently converted.

  Raises:
    ValueError: naming `what` and the problem (complex, boolean, string, object, not an array).
  """
  if isinstance(x, (str, bytes)):
    raise ValueError(f"{what} must be an array of real numbers, got a {type(x).__name__}")
  try:
    arr = np.asarray(x)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{what} must be an array of real numbers: {e}") from None
  if not _is_real_dtype(arr.dtype):
    kind = _NOT_REAL.get(arr.dtype.kind, "not real numbers")
    raise ValueError(f"{what} has dtype {arr.dtype}: {kind}; embeddings must be real numbers "
                     "(a float array)")
  return arr


def unit_rows(x: np.ndarray, what: str) -> np.ndarray:
  """`[n, d]` real rows scaled to unit L2 norm, float32, without overflow or underflow.

  An ordinary row is `x / ||x||` in float32, bit for bit; a row whose float32 squares overflow or
  underflow is first divided by its largest `|x_i|` in a wider float. `what` names `x` in errors.

  Raises:
    ValueError: naming `what` and the rows that hold NaN or Inf, or that are all zero.
  """
  x = np.asarray(x)
  bad = ~np.all(np.isfinite(x), axis=-1)
  if bad.any():
    raise ValueError(f"{what} contains non-finite values (NaN or Inf) in row(s) "
                     f"{np.nonzero(bad)[0][:10].tolist()}")
  with np.errstate(over="ignore", under="ignore"):
    x32 = x.astype(np.float32)  # as np.asarray(x, np.float32): a float64 beyond 3.4e38 -> inf
    norm = np.linalg.norm(x32, axis=-1, keepdims=True)
  ok = np.isfinite(norm[:, 0]) & (norm[:, 0] > _MIN_NORM)
  out = x32 / np.where(ok[:, None], norm, np.float32(1))
  if not ok.all():
    rows = np.nonzero(~ok)[0]
    wide = np.longdouble if x.dtype == np.longdouble else np.float64
    r = x[rows].astype(wide)
    scale = np.max(np.abs(r), axis=-1, keepdims=True)
    zero = scale[:, 0] == 0
    if zero.any():
      raise ValueError(f"{what} contains all-zero row(s) {rows[zero][:10].tolist()}: an "
                       "embedding must have a direction")
    r = r / scale  # entries in [-1, 1], the largest +-1: the squares neither overflow nor vanish
    out[rows] = (r / np.linalg.norm(r, axis=-1, keepdims=True)).astype(np.float32)
  return out


def hash_file(path: pathlib.Path) -> str:
  """Hex sha256 of a file's bytes."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
  return h.hexdigest()


def progress_bar(total, desc, enabled):
  """A tqdm bar counting texts (disabled unless `enabled`)."""
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm(total=total, desc=desc, unit="text", disable=not enabled, dynamic_ncols=True,
              mininterval=2.0)
