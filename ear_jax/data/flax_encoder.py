"""A local Hugging Face checkpoint run with transformers' `FlaxAutoModel` (MiniLM, Contriever, BGE, ...).

Symbols: `n` texts, `d` embedding dimension, `B` batch size, `L` padded token length.

Nothing is fetched from the Hub: every file is read from the checkpoint directory
(`local_files_only=True`). Pooling is `"mean"` over the attention mask (sentence-transformers /
Contriever) or `"cls"`; by default it is read from the checkpoint's `1_Pooling/config.json` when
present, else mean. The maximum length comes from `sentence_bert_config.json` (`max_seq_length`, 256
for MiniLM), else from the tokenizer/model config; the tokenizer truncates longer texts (keeping its
special tokens) and they are counted.

Speed: texts are bucketed by token length into a few padded lengths (32/64/128/256 for MiniLM), each
bucket with a fixed batch shape, so the jitted encoder compiles a handful of shapes. The tokenizer
pads each text to its bucket length; the last batch of a bucket is filled with empty rows that are
discarded.
"""
from __future__ import annotations

import json
import logging
import pathlib
from typing import Sequence

import numpy as np

from ear_jax.data import encoder_base

DEFAULT_BUCKETS = (32, 64, 128, 256)
DEFAULT_TOKENS_PER_BATCH = 4096
_WEIGHTS = ("flax_model.msgpack", "model.safetensors", "pytorch_model.bin")


def weights_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
  """The weight files of a checkpoint directory (single-file and sharded)."""
  files = [model_dir / n for n in _WEIGHTS if (model_dir / n).exists()]
  files += sorted(model_dir.glob("model-*.safetensors")) + sorted(model_dir.glob("flax_model-*.msgpack"))
  return files


def _default_max_length(model_dir: pathlib.Path, model, tokenizer) -> int:
  st_cfg = model_dir / "sentence_bert_config.json"
  if st_cfg.is_file() and "max_seq_length" in json.loads(st_cfg.read_text()):
    return int(json.loads(st_cfg.read_text())["max_seq_length"])
  limits = [getattr(model.config, "max_position_embeddings", 512)]
  tok_max = getattr(tokenizer, "model_max_length", None)
  if tok_max and tok_max < 1_000_000:
    limits.append(int(tok_max))
  return min(limits)


def _default_pooling(model_dir: pathlib.Path) -> str:
  pool_cfg = model_dir / "1_Pooling" / "config.json"
  if pool_cfg.is_file():
    cfg = json.loads(pool_cfg.read_text())
    if cfg.get("pooling_mode_cls_token") and not cfg.get("pooling_mode_mean_tokens"):
      return "cls"
  return "mean"


class FlaxEncoder(encoder_base.Encoder):
  """A local Hugging Face checkpoint run with `FlaxAutoModel`, jitted per (batch, length) bucket.

  Args:
    model_dir: directory with `config.json`, weights and tokenizer files.
    name: short name used in cache directory names.
    pooling: `"mean"` (over the attention mask) or `"cls"`; None = from `1_Pooling/config.json`.
    max_length: token limit; None = `sentence_bert_config.json`, else tokenizer/model limit.
    buckets: padded lengths (values above `max_length` are dropped, `max_length` is added).
    tokens_per_batch: batch size of a bucket of length L is `max(1, tokens_per_batch // L)`.

  Raises:
    ValueError: naming the directory, when it is not a loadable checkpoint.
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
    if not weights_files(model_dir):
      raise ValueError(f"encoder directory {str(model_dir)!r} has no weights "
                       "(flax_model.msgpack / model.safetensors / pytorch_model.bin)")
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    self.model_dir = model_dir.resolve()
    self.name = name or model_dir.name
    try:
      self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir),
                                                                  local_files_only=True)
    except (OSError, ValueError) as e:
      raise ValueError(f"encoder directory {str(model_dir)!r}: cannot load its tokenizer: {e}") from e
    if self.tokenizer.pad_token is None:  # padded positions are masked out: any token will do
      self.tokenizer.pad_token = self.tokenizer.sep_token or self.tokenizer.eos_token
    try:
      self.model = transformers.FlaxAutoModel.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, EnvironmentError):
      # Only PyTorch weights: converting them needs torch.
      self.model = transformers.FlaxAutoModel.from_pretrained(
          str(model_dir), local_files_only=True, from_pt=True)
    pooling = _default_pooling(model_dir) if pooling is None else pooling
    if pooling not in ("mean", "cls"):
      raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
    self.pooling = pooling
    if max_length is None:
      max_length = _default_max_length(model_dir, self.model, self.tokenizer)
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
      files = {p.name: encoder_base.hash_file(p) for p in weights_files(self.model_dir)}
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

  def _tokenize(self, texts: list[str], length: int) -> tuple[np.ndarray, np.ndarray]:
    """`[len(texts), length]` int32 token ids and attention mask, truncated and padded to `length`."""
    enc = self.tokenizer(texts, add_special_tokens=True, truncation=True, max_length=length,
                         padding="max_length", return_attention_mask=True,
                         return_token_type_ids=False, return_tensors="np", verbose=False)
    return enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)

  def encode_new(self, texts, progress=True, bar=None):
    texts = encoder_base.check_texts(texts)
    n = len(texts)
    out = np.zeros((n, self.dim), np.float32)
    if n == 0:
      return out, 0
    # Untruncated lengths pick each text's bucket and count the texts that will be truncated.
    lengths = np.asarray(self.tokenizer(
        texts, add_special_tokens=True, truncation=False, padding=False,
        return_attention_mask=False, return_token_type_ids=False, return_length=True,
        verbose=False)["length"])
    num_truncated = int((lengths > self.max_length).sum())
    bucket_of = np.searchsorted(np.array(self.buckets), np.minimum(lengths, self.max_length))
    order = np.argsort(lengths, kind="stable")
    pad = self.tokenizer.pad_token_id or 0
    own_bar = bar is None
    if own_bar:
      bar = encoder_base.progress_bar(n, f"encoding with {self.name}", progress)
    try:
      for b, length in enumerate(self.buckets):
        rows = order[bucket_of[order] == b]
        bs = self.batch_size(length)
        for start in range(0, len(rows), bs):
          chunk = rows[start:start + bs]
          input_ids = np.full((bs, length), pad, np.int32)  # rows past the chunk: discarded
          mask = np.zeros((bs, length), np.int32)
          input_ids[:len(chunk)], mask[:len(chunk)] = self._tokenize([texts[i] for i in chunk],
                                                                     length)
          emb = np.asarray(self._embed(self._params, input_ids, mask))
          out[chunk] = emb[:len(chunk)]
          bar.update(len(chunk))
    finally:
      if own_bar:
        bar.close()
    return out, num_truncated
