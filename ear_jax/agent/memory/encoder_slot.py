"""`EncoderSlot`: the frozen encoder f_theta of a `Memory` (an `Encoder`, or a spec loaded lazily)."""
from __future__ import annotations

import os
import threading
from typing import Any, Optional

import numpy as np

from ear_jax.agent.memory.bank import InputTypeError, check_embeddings


class EncoderSlot:
  """The frozen encoder f_theta of a memory: an `Encoder`, or a spec loaded at first use.

  A spec string is checked at once (`encoders.check_encoder_spec`: the data layer names a missing
  path) and loaded lazily under a lock, then checked against the dimension and, when known, the
  model identity the memory was built with. Encoding itself runs outside `Memory`'s state lock.

  Args:
    encoder: 'minilm', a checkpoint directory, a `.npy`/`.npz` file, an `Encoder`, or None.
  """

  def __init__(self, encoder: Any):
    from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
    self._lock = threading.Lock()
    # One encode at a time: a Hugging Face fast tokenizer shared by two threads fails with
    # "RuntimeError: Already borrowed" (Memory encodes outside its own lock).
    self._encode_lock = threading.Lock()
    self.encoder, self.spec = None, None
    if isinstance(encoder, encoders.Encoder):
      self.encoder = encoder
      src = getattr(encoder, "model_dir", None) or getattr(encoder, "path", None)
      self.spec = "minilm" if encoder.name == "minilm" else (str(src) if src is not None else None)
    elif isinstance(encoder, (str, os.PathLike)):
      self.spec = str(encoders.check_encoder_spec(encoder))
    elif encoder is not None:
      raise InputTypeError(f"encoder must be a spec string, an Encoder or None, got "
                           f"{type(encoder).__name__}")
    self.identity = self.encoder.identity_hash if self.encoder is not None else None

  @property
  def dim(self) -> Optional[int]:
    """The dimension when known without loading a model."""
    if self.encoder is not None:
      return self.encoder.dim
    return 384 if self.spec == "minilm" else None

  def get(self, dim: int):
    """The encoder (loaded now if it was given as a spec), or None."""
    with self._lock:
      if self.encoder is None and self.spec is not None:
        from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
        enc = encoders.load_encoder(self.spec)
        if enc.dim != dim:
          raise ValueError(f"encoder {self.spec!r} has dimension {enc.dim}, but this memory uses "
                           f"d={dim}")
        if self.identity is not None and enc.identity_hash != self.identity:
          raise ValueError(f"encoder {self.spec!r} is not the model this memory was built with "
                           f"(identity {enc.identity_hash[:16]} != {self.identity[:16]}): its "
                           "embeddings would not match the bank")
        self.encoder, self.identity = enc, enc.identity_hash
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

  def meta(self, dim: int) -> dict:
    return {"spec": self.spec, "identity_hash": self.identity, "dim": dim}

  @classmethod
  def for_checkpoint(cls, encoder: Any, saved: dict, where: str) -> "EncoderSlot":
    """The slot of a loaded memory: 'saved' (the saved spec, checked lazily against the saved
    identity), None, or an encoder / spec whose dimension and identity must match the saved ones."""
    if isinstance(encoder, str) and encoder == "saved":
      slot = cls(None)
      slot.spec, slot.identity = saved["spec"], saved["identity_hash"]
      return slot
    if encoder is None:
      return cls(None)
    from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
    enc = encoders.load_encoder(encoder)
    if enc.dim != saved["dim"]:
      raise ValueError(f"{where} was written with encoder dimension d={saved['dim']}, but encoder "
                       f"{enc.name!r} has dimension {enc.dim}")
    if saved["identity_hash"] and enc.identity_hash != saved["identity_hash"]:
      raise ValueError(f"{where} was written with another encoder model (identity "
                       f"{saved['identity_hash'][:16]}), not {enc.name!r} (identity "
                       f"{enc.identity_hash[:16]})")
    return cls(enc)
