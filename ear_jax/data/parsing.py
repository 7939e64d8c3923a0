"""Checked reading of benchmark JSON: every error names the file, the place in it and the field.

`require` / `optional` read one field and check its type, so hostile input (a `null`, a list where
an object belongs, ...) is a `ValueError` saying where and which field, never a bare `TypeError`.
"""
from __future__ import annotations

import gzip
import json
import pathlib
from typing import Any, NamedTuple


class Kind(NamedTuple):
  """An accepted JSON type: the Python types json produces for it, and its name in messages."""
  types: tuple[type, ...]
  name: str


STRING = Kind((str,), "a string")
OBJECT = Kind((dict,), "a JSON object")
LIST = Kind((list,), "a list")
NAME = Kind((str, int), "a string or an integer")  # ids, bank and category names
STRING_OR_LIST = Kind((str, list), "a string or a list of strings")
STRING_OR_NULL = Kind((str, type(None)), "a string or null")
ANSWER = Kind((str, int, float), "a string or a number")  # a gold answer

_MISSING = object()


def json_type(value: Any) -> str:
  """The JSON name of a parsed value's type (`null`, `boolean`, `number`, ...)."""
  for types, json_name in ((type(None), "null"), (bool, "boolean"), ((int, float), "number"),
                           (str, "string"), ((list, tuple), "list"), (dict, "JSON object")):
    if isinstance(value, types):
      return json_name
  return type(value).__name__


def _short(value: Any, limit: int = 60) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def is_kind(value: Any, kind: Kind) -> bool:
  """Whether `value` has JSON type `kind` (a boolean is never a number here)."""
  if isinstance(value, bool) and bool not in kind.types:
    return False
  return isinstance(value, kind.types)


def check(value: Any, kind: Kind, where: str, key: str) -> Any:
  """`value` (field `key` at `where`) if it has type `kind`, else a ValueError naming all three."""
  if not is_kind(value, kind):
    shown = "" if value is None else f" {_short(value)}"
    raise ValueError(f"{where}: field {key!r} must be {kind.name}, got {json_type(value)}{shown}")
  return value


def check_object(obj: Any, where: str) -> dict:
  """`obj` if it is a JSON object, else a ValueError naming `where`."""
  if not isinstance(obj, dict):
    raise ValueError(f"{where}: expected a JSON object, got {json_type(obj)}")
  return obj


def require(obj: Any, key: str, where: str, kind: Kind | None = None) -> Any:
  """`obj[key]`, checking that `obj` is an object, the field is present and (optionally) its type.

  Raises:
    ValueError: `"<where>: missing field 'key'"`, or a type error naming the field.
  """
  check_object(obj, where)
  if key not in obj:
    raise ValueError(f"{where}: missing field {key!r}")
  value = obj[key]
  return value if kind is None else check(value, kind, where, key)


def optional(obj: dict, key: str, where: str, kind: Kind, default: Any) -> Any:
  """`obj[key]` of type `kind`, or `default` when the field is absent (a `null` is an error)."""
  value = obj.get(key, _MISSING)
  if value is _MISSING:
    return default
  return check(value, kind, where, key)


def nonempty_text(obj: Any, key: str, where: str) -> str:
  """A required string field that is not empty or only whitespace."""
  value = require(obj, key, where, STRING)
  if not value.strip():
    raise ValueError(f"{where}: field {key!r} must be a non-empty string, got {_short(value)}")
  return value


def name(obj: Any, key: str, where: str, default: str | None = None) -> str:
  """An id / bank / category field: a non-empty string or an int (required if `default` is None)."""
  value = str(require(obj, key, where, NAME) if default is None
              else optional(obj, key, where, NAME, default))
  if not value.strip():
    raise ValueError(f"{where}: field {key!r} must not be empty")
  return value


def name_list(obj: Any, key: str, where: str, default: list | None = None) -> tuple[str, ...]:
  """A list of ids (strings or integers) as a tuple of strings; required when `default` is None."""
  items = (require(obj, key, where, LIST) if default is None
           else optional(obj, key, where, LIST, default))
  for i, item in enumerate(items):
    if not is_kind(item, NAME):
      raise ValueError(f"{where}: field {key!r} must be a list of ids (strings), but entry {i} is "
                       f"{json_type(item)}{'' if item is None else ' ' + _short(item)}")
  return tuple(str(x) for x in items)


def read_json(path) -> Any:
  """Parses a `.json` or `.json.gz` file.

  Raises:
    FileNotFoundError: the file does not exist.
    IsADirectoryError: the path is a directory.
    ValueError: naming the file, for invalid JSON, invalid UTF-8 or a truncated gzip stream.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    raise IsADirectoryError(f"benchmark file {str(path)!r} is a directory, not a JSON file")
  try:
    if path.suffix == ".gz":
      with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: invalid JSON (truncated or corrupt file?): {e}") from e
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not valid UTF-8 text ({e.reason}); save the file as UTF-8") from e
  except (EOFError, gzip.BadGzipFile, OSError) as e:
    if isinstance(e, FileNotFoundError):
      raise
    raise ValueError(f"{path}: cannot read (truncated or corrupt file?): {e}") from e


def read_json_list(path, what: str, limit: int | None = None) -> list:
  """`read_json` of a file holding a JSON list (of `what`), cut to its first `limit` items."""
  data = read_json(path)
  if not isinstance(data, list):
    raise ValueError(f"{path}: expected a JSON list of {what}, got {json_type(data)}")
  return data if limit is None else data[:limit]
