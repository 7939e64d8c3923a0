"""The checks of `Memory`'s arguments (pure: no state is read or written), the store names and
the default scope. Each raises a ValueError (or `InputTypeError`) naming the argument."""
from __future__ import annotations

import collections.abc
import datetime
import re
from typing import Optional

import numpy as np

from ear_jax.data import encoder_base

STORES = {"dialogue": 0, "episodic": 0, "observation": 1, "semantic": 1}
STORE_NAMES = ("dialogue", "observation")
DEFAULT_SCOPE = "default"  # the scope of memories added without one (scope code 0)


class InputTypeError(TypeError, ValueError):
  """An argument of the wrong type (a `TypeError`, and a `ValueError` like every input error)."""


def _check_encodable(values: list[str], what: str) -> None:
  """`encoder_base.check_texts` (UTF-8 encodable), its error prefixed by `what`."""
  try:
    encoder_base.check_texts(values)
  except ValueError as e:
    raise ValueError(f"{what}: {e}") from None


def string_list(values, what: str, noun: str) -> list[str]:
  """One string, or a non-empty list / tuple of strings, as a list (errors name the index)."""
  if isinstance(values, str):
    return [values]
  if (not isinstance(values, collections.abc.Sequence)
      or isinstance(values, (bytes, bytearray, memoryview))):
    raise InputTypeError(f"{what} must be a {noun} (string) or a sequence (list, tuple) of "
                         f"strings, got {type(values).__name__}")
  values = list(values)
  if not values:
    raise ValueError(f"{what} is empty: pass at least one {noun}")
  for i, v in enumerate(values):
    if not isinstance(v, str):
      raise InputTypeError(f"{what}[{i}] must be a string, got {type(v).__name__}")
  return values


def check_text_list(texts, what: str) -> list[str]:
  """One string, or a list / tuple of non-empty UTF-8-encodable strings, as a list."""
  texts = string_list(texts, what, "text")
  for i, t in enumerate(texts):
    if not t.strip():
      raise ValueError(f"{what}[{i}] is an empty text")
  _check_encodable(texts, what)
  return texts


def check_embeddings(emb, n: Optional[int], dim: int, what: str) -> np.ndarray:
  """`[n, d]` real, finite, non-zero rows (any magnitude), returned L2-normalised as float32.

  Raises:
    ValueError: naming the dtype (complex, boolean, string, object), row count, dimension, or
      offending rows (NaN / Inf, all zero).
  """
  arr = encoder_base.real_array(emb, what)
  rows = n if n is not None else "n"
  if arr.ndim != 2:
    raise ValueError(f"{what} has shape {arr.shape}, expected a 2-D [{rows}, {dim}] array "
                     "(one row per text)")
  problems = []
  if n is not None and arr.shape[0] != n:
    problems.append(f"{arr.shape[0]} row(s) for {n} text(s): pass one embedding per text")
  if arr.shape[1] != dim:
    problems.append(f"wrong dimension: this memory's encoder dimension is d={dim}")
  if problems:
    raise ValueError(f"{what} has shape {arr.shape}, expected [{rows}, {dim}] "
                     f"({'; '.join(problems)})")
  return encoder_base.unit_rows(arr, what)


def real_query_vector(emb, dim: int) -> np.ndarray:
  """One `[d]` query embedding, checked and normalised (ValueError: dtype or shape)."""
  arr = encoder_base.real_array(emb, "query_embedding")
  if arr.ndim != 1:
    raise ValueError(f"query_embedding has shape {arr.shape}, expected one [{dim}] vector")
  return arr


def store_codes(store, n: int) -> np.ndarray:
  """`[n]` int8 store codes from one store (name or 0/1) or one per memory."""
  def code(s):
    if isinstance(s, (int, np.integer)) and not isinstance(s, bool) and int(s) in (0, 1):
      return int(s)
    if isinstance(s, str) and s in STORES:
      return STORES[s]
    raise ValueError(f"unknown store {s!r}; expected one of {sorted(STORES)} or 0/1")

  if isinstance(store, (str, int, np.integer)):
    return np.full(n, code(store), np.int8)
  if not isinstance(store, collections.abc.Sequence):
    raise InputTypeError(f"store must be a store name, 0/1, or a sequence of them, got "
                         f"{type(store).__name__}")
  if len(store) != n:
    raise ValueError(f"store has {len(store)} entries for {n} texts")
  return np.asarray([code(s) for s in store], np.int8)


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")  # Unicode category Cc


def check_id_chars(ids: list[str], what: str, noun: str = "memory ids") -> None:
  """ValueError naming `what` (and the index) for an id or name holding a control character
  (U+0000: SQLite's JSON functions cut a string there)."""
  for j, i in enumerate(ids):
    bad = _CONTROL.search(i)
    if bad is not None:
      where = what if len(ids) == 1 and what != "ids" else f"{what}[{j}]"
      raise ValueError(f"{where}={i!r} holds the control character U+{ord(bad.group()):04X} at "
                       f"position {bad.start()}: {noun} may not contain control characters")


def check_id_list(ids, n: int) -> list[str]:
  """`n` distinct, non-empty string ids (UTF-8 encodable, no control character)."""
  if isinstance(ids, str):
    ids = [ids]
  elif not isinstance(ids, collections.abc.Sequence):
    raise InputTypeError(f"ids must be a string or a sequence of strings, got {type(ids).__name__}")
  ids = list(ids)
  if len(ids) != n:
    raise ValueError(f"ids has {len(ids)} entries for {n} texts")
  for i in ids:
    if not isinstance(i, str) or not i:
      raise ValueError(f"memory ids must be non-empty strings, got {i!r}")
  _check_encodable(ids, "ids")
  check_id_chars(ids, "ids")
  dup = sorted(i for i, c in collections.Counter(ids).items() if c > 1)
  if dup:
    raise ValueError(f"duplicate memory ids {dup[:5]} in this call")
  return ids


def check_scope(scope, what: str = "scope") -> str:
  """The scope of an `add`: None -> `DEFAULT_SCOPE`, else a non-empty string."""
  if scope is None:
    return DEFAULT_SCOPE
  if not isinstance(scope, str):
    raise InputTypeError(f"scope must be a string (one scope for the memories of this call) or "
                         f"None, got {type(scope).__name__}")
  if not scope:
    raise ValueError("scope is an empty string: pass a scope name or None (the default scope)")
  _check_encodable([scope], what)
  check_id_chars([scope], what, "scope names")
  return scope


def check_scope_spec(scope) -> Optional[tuple[str, ...]]:
  """The scopes a query may see: None (every scope), one name, or a non-empty list of names."""
  if scope is None:
    return None
  if isinstance(scope, str):
    return (check_scope(scope),)
  if not isinstance(scope, (list, tuple)):
    raise InputTypeError(f"scope must be None, a scope name or a list / tuple of names, got "
                         f"{type(scope).__name__}")
  if not scope:
    raise ValueError("scope is an empty list: pass None for every scope, or at least one name")
  names = []
  for i, s in enumerate(scope):
    if not isinstance(s, str):
      raise InputTypeError(f"scope[{i}] must be a string, got {type(s).__name__}")
    names.append(check_scope(s, f"scope[{i}]"))
  return tuple(dict.fromkeys(names))


def check_dates(dates, n: int) -> list[str]:
  """`n` dates (free text), one per memory; None -> `n` times now (UTC, ISO 8601, to the second)."""
  if dates is None:
    return [datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")] * n
  if isinstance(dates, str) or not isinstance(dates, collections.abc.Sequence):
    raise InputTypeError(f"dates must be a sequence (list, tuple) of strings, one per text, got "
                         f"{type(dates).__name__}")
  dates = list(dates)
  if len(dates) != n:
    raise ValueError(f"dates has {len(dates)} entries for {n} texts")
  for i, d in enumerate(dates):
    if not isinstance(d, str):
      raise InputTypeError(f"dates[{i}] must be a string, got {type(d).__name__}")
  _check_encodable(dates, "dates")
  return dates


def check_ids(ids, what: str = "ids") -> list[str]:
  """One id or a non-empty sequence of distinct string ids, as a list (no lookup)."""
  ids = string_list(ids, what, "memory id")
  dup = sorted(i for i, c in collections.Counter(ids).items() if c > 1)
  if dup:
    raise ValueError(f"{what}: duplicate memory ids {dup[:5]}")
  return ids


def unknown_ids(ids: list[str], rows: np.ndarray, what: str) -> ValueError:
  """The error of ids whose `rows` are -1 (never added, or deleted)."""
  unknown = [i for i, r in zip(ids, rows) if r < 0]
  shown = ", ".join(repr(i) for i in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
  return ValueError(f"{what}: unknown memory id(s) {shown} ({len(unknown)} of {len(ids)}; they "
                    "were never added or were deleted); nothing was changed")


def check_update(memory_id, text, embedding, dim: int):
  """`(memory_id, text or None, [1, d] embedding or None)` of an update, validated."""
  if not isinstance(memory_id, str):
    raise InputTypeError(f"memory_id must be a string, got {type(memory_id).__name__}")
  check_id_chars([memory_id], "memory_id")
  if text is None and embedding is None:
    raise ValueError(f"update of memory {memory_id!r} changes nothing: pass text= and/or "
                     "embedding=")
  if text is not None:
    if not isinstance(text, str):
      raise InputTypeError(f"text must be a string, got {type(text).__name__}")
    text = check_text_list(text, "text")[0]
  emb = None
  if embedding is not None:
    arr = encoder_base.real_array(embedding, "embedding")
    emb = check_embeddings(arr[None] if arr.ndim == 1 else arr, 1, dim, "embedding")
  return memory_id, text, emb


def check_int(value, name: str, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise InputTypeError(f"{name} must be an int, got {type(value).__name__}")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {name}={value}")
  return int(value)


def check_k(k, num_candidates: int) -> int:
  """`k`, the memories a slate shows: an int in `[1, K]`."""
  k = check_int(k, "k", 1)
  if k > num_candidates:
    raise ValueError(f"k={k} is larger than num_candidates K={num_candidates}")
  return k
