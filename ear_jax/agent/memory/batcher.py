"""`Batcher`: micro-batching of a `Memory`'s concurrent first stages and encodings.

Symbols: `n` texts or queries of one request, `q` queries of one search, `d` dimension.

Requests arriving within one window share ONE encoder call and, per key (the slate size), ONE
jitted first stage, each query in its own scopes. The first request's thread leads the window: it
waits (or until `max_queries`), encodes with no lock held, then takes the memory's lock ONCE for
every `prepare`, search and `finish`. A bad request fails alone (after a failure each is retried
alone). A search sees every add that returned before it was called.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Hashable, Optional

import jax
import numpy as np


class Request:
  """One caller's request, with its outcome once served.

  Args:
    texts, embeddings: `[n]` checked texts to encode, or `[n, d]` checked unit embeddings.
    key: requests with equal keys share one search; None: encode only.
    search_texts, prepare, finish: `[n]` texts for a lexical first stage; `prepare()` (raises to
      fail) and `finish(texts, embeddings, result) -> value`, under the lock around the search.
    scope, what: its queries' scope spec; what the texts are, for the encoder's errors.
  """

  def __init__(self, texts: Optional[list], embeddings: Optional[np.ndarray], key: Hashable,
               search_texts: Optional[list] = None, prepare: Optional[Callable] = None,
               finish: Optional[Callable] = None, *, scope=None, what: str = "query"):
    self.texts, self.embeddings, self.key, self.what = texts, embeddings, key, what
    self.scope, self.search_texts, self.prepare, self.finish = scope, search_texts, prepare, finish
    self.value: Any = None
    self.error: Optional[BaseException] = None
    self.done = threading.Event()

  def fail(self, error: BaseException) -> None:
    self.error = error
    self.done.set()

  def serve(self, value) -> None:
    self.value = value
    self.done.set()

  def outcome(self):
    """The value, or the request's error raised in the caller's thread."""
    self.done.wait()
    if self.error is not None:
      raise self.error
    return self.value


class Batcher:
  """The window, its leader and the one encoder call / one search per key (module docstring).

  Args:
    window, max_queries: seconds a window stays open (> 0); it closes early at `max_queries`.
    encode: `encode(texts, what) -> [n, d]` unit embeddings.
    search: `search(key, texts [q], queries [q, d], scopes [q]) -> pytree of [q, ...] numpy
      arrays`, called under `lock` (the memory's).
  """

  def __init__(self, window: float, max_queries: int, encode: Callable, search: Callable, lock):
    self.window, self.max_queries = float(window), int(max_queries)
    self._encode, self._search, self._lock = encode, search, lock
    self._cv = threading.Condition()
    self._queue: list[Request] = []
    self._queued = 0  # queries (rows) in `_queue`
    self._leading = False
    self._serving = threading.Lock()  # one window served at a time: the next collects meanwhile
    self._counts = {"batch_windows": 0, "batch_requests": 0, "batch_encoder_calls": 0,
                    "batch_searches": 0}

  def counts(self) -> dict:
    """Windows served, requests in them, encoder calls and searches they made."""
    with self._cv:
      return dict(self._counts)

  def _count(self, name: str, n: int = 1) -> None:
    with self._cv:
      self._counts[name] += n

  def submit(self, request: Request):
    """Queues `request` (its thread leads the window when it opens one) and returns its value."""
    with self._cv:
      self._queue.append(request)
      self._queued += _rows(request)
      lead, self._leading = not self._leading, True
      if self._queued >= self.max_queries:
        self._cv.notify_all()
    if lead:
      self._lead()
    return request.outcome()

  def _lead(self) -> None:
    deadline = time.perf_counter() + self.window
    with self._serving:  # (while a window is served the next one keeps collecting requests)
      with self._cv:
        while self._queued < self.max_queries and (left := deadline - time.perf_counter()) > 0:
          self._cv.wait(left)
        batch, self._queue, self._queued, self._leading = self._queue, [], 0, False
      try:
        self._serve(batch)
      finally:  # (nobody waits forever, whatever went wrong)
        for r in batch:
          if not r.done.is_set():
            r.fail(RuntimeError("the memory's batched request was not served (the leader "
                                "thread was interrupted)"))

  def _serve(self, batch: list[Request]) -> None:
    self._count("batch_windows")
    self._count("batch_requests", len(batch))
    self._encode_all([r for r in batch if r.texts is not None])
    groups: dict = {}
    for r in batch:
      if r.error is None and r.key is None:
        r.serve(r.embeddings)
      elif r.error is None:
        groups.setdefault(r.key, []).append(r)
    if not groups:
      return
    with self._lock:
      for key, group in groups.items():
        self._search_group(key, group)

  def _encode_all(self, todo: list[Request]) -> None:
    """Each request's `[n, d]` embeddings by ONE encoder call (one per request if it fails)."""
    if not todo:
      return
    whats = {r.what for r in todo}
    try:
      self._count("batch_encoder_calls")
      emb = self._encode([t for r in todo for t in r.texts],
                         whats.pop() if len(whats) == 1 else "the batched")
    except Exception as e:  # pylint: disable=broad-except
      if len(todo) == 1:
        todo[0].fail(e)
        return
      for r in todo:
        self._encode_all([r])
      return
    at = 0
    for r in todo:
      r.embeddings, at = emb[at:at + len(r.texts)], at + len(r.texts)

  def _search_group(self, key, group: list[Request]) -> None:
    """`prepare`, ONE search, `finish` for the requests of one key (call under the lock)."""
    ready = []
    for r in group:
      try:
        if r.prepare is not None:
          r.prepare()
        ready.append(r)
      except Exception as e:  # pylint: disable=broad-except
        r.fail(e)
    if not ready:
      return
    texts = [t for r in ready for t in r.search_texts]
    scopes = [r.scope for r in ready for _ in range(_rows(r))]
    try:
      self._count("batch_searches")
      out = self._search(key, texts, np.concatenate([r.embeddings for r in ready]), scopes)
    except Exception as e:  # pylint: disable=broad-except
      if len(ready) == 1:
        ready[0].fail(e)
        return
      for r in ready:  # (alone, each with its own checks again: the state may have moved)
        self._search_group(key, [r])
      return
    at = 0
    for r in ready:
      n = _rows(r)
      part = jax.tree_util.tree_map(lambda a, at=at, n=n: a[at:at + n], out)
      at += n
      try:
        r.serve(r.finish(r.search_texts, r.embeddings, part))
      except Exception as e:  # pylint: disable=broad-except
        r.fail(e)


def _rows(r: Request) -> int:
  return len(r.texts) if r.texts is not None else len(r.embeddings)
