"""Keeps Orbax's asyncio noise off stderr: "Event loop is closed" reports, tracebacks of coroutines
left pending by a failed restore or save, and "Task exception was never retrieved" for the sibling
reads of a failed restore. Every other report passes through.
"""
from __future__ import annotations

import functools
import gc
import logging
import os
import sys
import threading

_LOOP_CLOSED = "Event loop is closed"
_NEVER_RETRIEVED = "Task exception was never retrieved"
_failed_dirs: set[str] = set()  # directories whose read / write `call` already reported as failed
_failed_lock = threading.Lock()


def _drop_loop_closed(record: logging.LogRecord) -> bool:
  """Logging filter: drops 'Event loop is closed' noise (tasks finalised after their loop ended)."""
  try:
    text = record.getMessage()
  except Exception:  # pylint: disable=broad-except
    text = str(record.msg)
  exc = record.exc_info[1] if record.exc_info else None
  if _LOOP_CLOSED in text or _LOOP_CLOSED in str(exc or ""):
    return False
  if _NEVER_RETRIEVED not in text:
    return True
  with _failed_lock:  # (only for a directory whose failure `call` reported)
    return not any(d in f"{text} {exc or ''}" for d in _failed_dirs)


def _loop_closed(exc) -> bool:
  return isinstance(exc, RuntimeError) and _LOOP_CLOSED in str(exc)


def _abandoned_orbax_coroutine(u) -> bool:
  """An Orbax coroutine left pending by a failed restore/save, finalised after its loop closed."""
  code = getattr(u.object, "cr_code", None)
  if code is None or f"{os.sep}orbax{os.sep}" not in code.co_filename:
    return False
  exc = u.exc_value
  return _loop_closed(exc) or isinstance(exc, GeneratorExit) or isinstance(
      getattr(exc, "__cause__", None) or getattr(exc, "__context__", None), GeneratorExit)


def _filtered_unraisable(prev):
  def hook(u):
    if not (_loop_closed(u.exc_value) or _abandoned_orbax_coroutine(u)):
      prev(u)
  return hook


@functools.cache
def install() -> None:
  """Silences only 'Event loop is closed' reports and Orbax's abandoned coroutines (at exit)."""
  for name in ("asyncio", "absl"):
    logging.getLogger(name).addFilter(_drop_loop_closed)
  prev_thread = threading.excepthook

  def thread_hook(a):
    if not _loop_closed(a.exc_value):
      prev_thread(a)

  sys.unraisablehook, threading.excepthook = _filtered_unraisable(sys.unraisablehook), thread_hook


def call(fn, directory):
  """`(fn(), None)`, or `(None, "Type: message")` if it raised.

  After a failure, asyncio's reports naming `directory` are dropped for the rest of the process and
  the coroutines Orbax left pending are collected at once, silently.
  """
  try:
    return fn(), None
  except Exception as e:  # pylint: disable=broad-except
    failure = f"{type(e).__name__}: {str(e)[:300]}"
  with _failed_lock:
    _failed_dirs.add(str(directory))
  prev = sys.unraisablehook
  sys.unraisablehook = _filtered_unraisable(prev)
  try:
    gc.collect()
  finally:
    sys.unraisablehook = prev
  return None, failure
