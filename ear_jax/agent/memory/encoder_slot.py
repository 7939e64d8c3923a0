"""`EncoderSlot`: the frozen encoder f_theta of a `Memory` (an `Encoder`, or a spec, lazily)."""
from __future__ import annotations

import os
import threading
from typing import Any, Optional

import numpy as np

from ear_jax.agent.memory.checks import InputTypeError, check_embeddings


class EncoderSlot:
  """The frozen encoder f_theta of a memory: an `Encoder`, or a spec checked at once and loaded at
  first use, then checked against the memory's dimension and model identity.

  Args:
    encoder: 'minilm', a checkpoint directory, a `.npy`/`.npz` file, an `Encoder`, or None.
    identity: the model identity of the memory's embeddings (None: not known yet).
    explicit: the caller named this encoder (not the default): added embeddings are its.
  """

  def __init__(self, encoder: Any, identity: Optional[str] = None, explicit: bool = True):
    self.explicit = bool(explicit)
    from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
    self._lock = threading.Lock()
    # One encode at a time: a shared Hugging Face fast tokenizer fails with "Already borrowed".
    self._encode_lock = threading.Lock()
    self.encoder, self.spec, self.identity = None, None, identity
    if isinstance(encoder, encoders.Encoder):
      self.encoder = encoder
      src = getattr(encoder, "model_dir", None) or getattr(encoder, "path", None)
      self.spec = "minilm" if encoder.name == "minilm" else (str(src) if src is not None else None)
      self._check_identity(encoder)
    elif isinstance(encoder, (str, os.PathLike)):
      self.spec = str(encoders.check_encoder_spec(encoder))
    elif encoder is not None:
      raise InputTypeError(f"encoder must be a spec string, an Encoder or None, got "
                           f"{type(encoder).__name__}")

  def _check_identity(self, enc) -> None:
    if self.identity is not None and enc.identity_hash != self.identity:
      raise ValueError(f"encoder {self.spec or enc.name!r} is not the model this memory was "
                       f"built with (identity {enc.identity_hash[:16]} != {self.identity[:16]}): "
                       "its embeddings would not match the bank")
    self.identity = enc.identity_hash

  @property
  def dim(self) -> Optional[int]:
    """The dimension when known without loading a model."""
    if self.encoder is not None:
      return self.encoder.dim
    return 384 if self.spec == "minilm" else None

  def check_dim(self, dim: int, root=None) -> None:
    """ValueError when the encoder's dimension (if known) is not the memory's `dim`."""
    if self.dim is None or self.dim == dim:
      return
    if root is None:
      raise ValueError(f"config.dim={dim} does not match the encoder's dimension {self.dim}")
    raise ValueError(f"{root} was written with encoder dimension d={dim}, but encoder "
                     f"{(self.encoder.name if self.encoder else self.spec)!r} has dimension "
                     f"{self.dim}")

  def adopt_identity(self, saved: Optional[str], where: str) -> None:
    """Takes the identity a learner item saved, unless the encoder is another model."""
    if saved and self.identity and saved != self.identity:
      raise ValueError(f"{where} was written with another encoder model (identity "
                       f"{saved[:16]}), not this one (identity {self.identity[:16]})")
    self.identity = self.identity or saved

  def get(self, dim: int):
    """The encoder (loaded now if it was given as a spec), or None."""
    with self._lock:
      if self.encoder is None and self.spec is not None:
        from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
        enc = encoders.load_encoder(self.spec)
        if enc.dim != dim:
          raise ValueError(f"encoder {self.spec!r} has dimension {enc.dim}, but this memory uses "
                           f"d={dim}")
        self._check_identity(enc)
        self.encoder = enc
      return self.encoder

  def embed(self, texts: list[str], dim: int, cache_dir, what: str) -> np.ndarray:
    """`[n, d]` unit embeddings of checked texts (ValueError without an encoder)."""
    enc = self.get(dim)
    if enc is None:
      raise ValueError(f"this memory has no encoder: pass {what} embeddings explicitly")
    from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
    with self._encode_lock:
      emb = encoders.encode(enc, texts, cache_dir=cache_dir, use_cache=cache_dir is not None,
                            progress=False)
    return check_embeddings(emb, len(texts), dim, f"encoder output for {what}")
