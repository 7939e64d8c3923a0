"""The encoder interface (`Encoder`) and the helpers every encoder shares.

Symbols: `n` texts, `d` embedding dimension.

An encoder has a `name` (used in cache directory names), a dimension `dim`, an `identity` (a JSON-able
dict naming the model exactly; its hash keys the embedding cache) and `encode_new(texts)`, which
embeds texts without any cache and returns L2-normalised float32 `[n, d]` rows plus the number of
texts it truncated. `check_texts` rejects what no encoder can embed (non-strings, lone surrogates).
"""
from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Sequence

import numpy as np


class Encoder:
  """Base class: `identity` (a JSON-able dict) names the model; `encode_new` embeds texts."""
  name: str
  dim: int

  @property
  def identity(self) -> dict:
    raise NotImplementedError

  @property
  def identity_hash(self) -> str:
    blob = json.dumps(self.identity, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()

  def encode_new(self, texts: Sequence[str], progress: bool = True, bar=None
                 ) -> tuple[np.ndarray, int]:
    """Embeds `texts` (no cache). Returns (`[n, d]` float32 unit vectors, number truncated).

    `bar`: an open tqdm bar to advance (else one is made when `progress`)."""
    raise NotImplementedError


def _show(text: str, limit: int = 40) -> str:
  return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def check_texts(texts: Sequence[str]) -> list[str]:
  """`texts` as a list, each checked to be a string that UTF-8 can encode.

  Raises:
    ValueError: naming the index and a short repr of the first bad text (not a string, or a lone
      surrogate such as `"a\\ud800b"`, which has no UTF-8 form and no tokenisation).
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


def l2_normalize(x: np.ndarray) -> np.ndarray:
  """Rows scaled to unit L2 norm (zero rows stay zero), float32."""
  norm = np.linalg.norm(x, axis=-1, keepdims=True)
  return (x / np.maximum(norm, 1e-12)).astype(np.float32)


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
