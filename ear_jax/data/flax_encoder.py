"""A local BERT-family Hugging Face checkpoint run in Flax (MiniLM, Contriever, BGE, E5, ...).

Symbols: `n` texts, `d` embedding dimension, `B` batch size, `L` padded token length.

No Hub, no transformers: the model is `ear_jax.data.bert`, the tokenizer `hf_tokenizer`. Weights
are read at the first `encode_new`, so cached texts need no model. Texts over the maximum length
are truncated and counted; texts are bucketed by token length into a few padded shapes (a handful
of compilations); a call of at most `SMALL_CALL` texts pads only to the next power of two.
"""
from __future__ import annotations

import contextlib
import json
import math
import pathlib
import threading

import numpy as np

from ear_jax.data import bert
from ear_jax.data import encoder_base
from ear_jax.data import hf_tokenizer

BUCKETS = (32, 64, 128, 256)  # padded token lengths, plus max_length (those above it dropped)
DEFAULT_TOKENS_PER_BATCH = 4096
SMALL_CALL = 64  # texts of a call padded to powers of two (larger calls: to full batches)
_WEIGHTS = ("flax_model.msgpack", "model.safetensors", "pytorch_model.bin")


def weights_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
  """The weight files of a checkpoint directory (single-file and sharded)."""
  files = [model_dir / n for n in _WEIGHTS if (model_dir / n).exists()]
  files += sorted(model_dir.glob("model-*.safetensors")) + sorted(model_dir.glob("flax_model-*.msgpack"))
  return files


def _default_max_length(model_dir: pathlib.Path, config: dict,
                        tokenizer: hf_tokenizer.CheckpointTokenizer) -> int:
  st_cfg = model_dir / "sentence_bert_config.json"
  if st_cfg.is_file() and "max_seq_length" in json.loads(st_cfg.read_text()):
    return int(json.loads(st_cfg.read_text())["max_seq_length"])
  return min(int(config.get("max_position_embeddings", 512)),
             tokenizer.model_max_length or math.inf)


def _default_pooling(model_dir: pathlib.Path) -> str:
  pool_cfg = model_dir / "1_Pooling" / "config.json"
  if pool_cfg.is_file():
    cfg = json.loads(pool_cfg.read_text())
    if cfg.get("pooling_mode_cls_token") and not cfg.get("pooling_mode_mean_tokens"):
      return "cls"
  return "mean"


class FlaxEncoder(encoder_base.Encoder):
  """A local BERT-family checkpoint run in Flax, jitted per (batch, length) bucket.

  Args:
    model_dir: directory with `config.json`, weights and tokenizer files.
    name: short name used in cache directory names.
    pooling: `"mean"` (over the attention mask) or `"cls"`; None = from `1_Pooling/config.json`.
    max_length: token limit; None = `sentence_bert_config.json`, else tokenizer/model limit.
    tokens_per_batch: batch size of a bucket of length L is `max(1, tokens_per_batch // L)`.

  Raises:
    ValueError: naming the directory, when it is not a supported checkpoint.
  """

  def __init__(self, model_dir, *, name: str | None = None, pooling: str | None = None,
               max_length: int | None = None, tokens_per_batch: int = DEFAULT_TOKENS_PER_BATCH):
    model_dir = pathlib.Path(model_dir).expanduser()
    if not (model_dir / "config.json").is_file():
      raise ValueError(
          f"encoder path {str(model_dir)!r} is not a Hugging Face checkpoint directory "
          "(no config.json there); pass 'minilm', a local model directory, or a .npy/.npz "
          "file of precomputed embeddings")
    if not weights_files(model_dir):
      raise ValueError(f"encoder directory {str(model_dir)!r} has no weights "
                       "(flax_model.msgpack / model.safetensors / pytorch_model.bin)")
    try:
      self._config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
      raise ValueError(f"encoder directory {str(model_dir)!r}: unreadable config.json: {e}"
                       ) from None
    self._bert = bert.check_config(self._config, f"encoder directory {str(model_dir)!r}")
    self.model_dir = model_dir.resolve()
    self.name = name or model_dir.name
    self.tokenizer = hf_tokenizer.CheckpointTokenizer(model_dir)
    pooling = _default_pooling(model_dir) if pooling is None else pooling
    if pooling not in ("mean", "cls"):
      raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
    self.pooling = pooling
    if max_length is None:
      max_length = _default_max_length(model_dir, self._config, self.tokenizer)
    self.max_length = int(max_length)
    self.tokenizer.truncate_at(self.max_length)
    self.buckets = tuple(sorted({b for b in BUCKETS if b < self.max_length} | {self.max_length}))
    self.tokens_per_batch = int(tokens_per_batch)
    self.dim = int(self._config["hidden_size"])
    self._model = None  # (params, jitted embed), read at the first encode_new
    self._load_lock = threading.Lock()
    self._identity = None

  @property
  def loaded(self) -> bool:
    """Whether the weights were read (only `encode_new` reads them)."""
    return self._model is not None

  def _loaded_model(self):
    """`(params, embed)`: the weights on the device and the jitted `[B, L] -> [B, d]` encoder."""
    with self._load_lock:
      if self._model is None:
        import jax  # pylint: disable=g-import-not-at-top
        import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
        config = self._bert
        params = bert.load(self.model_dir, config)
        use_cls = self.pooling == "cls"

        def _embed(params, input_ids, attention_mask):
          hidden = bert.hidden_states(params, input_ids, attention_mask, config)
          if use_cls:
            pooled = hidden[:, 0]
          else:
            m = attention_mask[..., None].astype(hidden.dtype)
            pooled = (hidden * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)
          norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
          return pooled / jnp.maximum(norm, 1e-12)

        self._model = (params, jax.jit(_embed))
      return self._model

  @property
  def identity(self) -> dict:
    if self._identity is None:
      files = {p.name: encoder_base.hash_file(p) for p in weights_files(self.model_dir)}
      self._identity = {
          "kind": "flax",
          "config": self._config,
          "weights_sha256": files,
          "vocab_size": self.tokenizer.vocab_size,
          "pooling": self.pooling,
          "max_length": self.max_length,
          "normalize": True,
      }
    return self._identity

  def batch_size(self, length: int) -> int:
    return max(1, self.tokens_per_batch // length)

  def encode_new(self, texts, progress=True, bar=None):
    texts = encoder_base.check_texts(texts)
    n = len(texts)
    out = np.zeros((n, self.dim), np.float32)
    if n == 0:
      return out, 0
    params, embed = self._loaded_model()
    ids, truncated = self.tokenizer.encode(texts)
    lengths = np.asarray([len(t) for t in ids])
    bucket_of = np.searchsorted(np.array(self.buckets), lengths)
    order = np.argsort(lengths, kind="stable")
    with (contextlib.nullcontext(bar) if bar is not None  # (a caller's bar is left open)
          else encoder_base.progress_bar(n, f"encoding with {self.name}", progress)) as bar:
      for b, length in enumerate(self.buckets):
        rows = order[bucket_of[order] == b]
        bs = self.batch_size(length)
        for start in range(0, len(rows), bs):
          chunk = rows[start:start + bs]  # rows of the batch past the chunk: padding, discarded
          width = min(bs, 1 << (len(chunk) - 1).bit_length()) if n <= SMALL_CALL else bs
          input_ids, mask = self.tokenizer.pad([ids[i] for i in chunk], length, width)
          emb = np.asarray(embed(params, input_ids, mask))
          out[chunk] = emb[:len(chunk)]
          bar.update(len(chunk))
    return out, int(truncated.sum())
