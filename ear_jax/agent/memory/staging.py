"""`Stage`: a `Memory` call's texts encoded (outside the lock) and its first stage run under it.

Symbols: `n` texts, `q` queries, `d` dimension, `K` candidates, `s` slate size.

A query's checks, first stage and the caller's `finish` run in one locked section, so a query sees
every add that returned before it was called. With `batch_window_ms > 0` calls share windows.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ear_jax.agent.memory import batcher as batcher_lib
from ear_jax.agent.memory import checks as checks_lib
from ear_jax.agent.memory.checks import InputTypeError


class Stage:
  """Encoding and the first stage of one memory (`learning` is set by `Memory` once built)."""

  def __init__(self, cfg, config, hparams, encoder, rows, lock):
    self.cfg, self.config, self.hparams = cfg, config, hparams
    self.encoder, self.rows, self._lock = encoder, rows, lock
    self.learning, self.batcher = None, None
    if cfg.batch_window_ms > 0:
      self.batcher = batcher_lib.Batcher(
          cfg.batch_window_ms / 1e3, cfg.batch_max_queries,
          lambda texts, what: encoder.embed(texts, config.dim, cfg.cache_dir, what),
          lambda key, texts, q_emb, scopes: self.first_stage(texts, q_emb, scopes, *key),
          lock)

  def embed(self, texts, embeddings, n, what: str) -> np.ndarray:
    """Checked `[n, d]` embeddings, given or encoded (outside the lock)."""
    if embeddings is not None:
      return checks_lib.check_embeddings(embeddings, n, self.config.dim, f"{what} embeddings")
    if self.batcher is not None:
      return self.batcher.submit(batcher_lib.Request(texts, None, None, what=what))
    return self.encoder.embed(texts, self.config.dim, self.cfg.cache_dir, what)

  def embed_answer(self, texts: list[str]) -> np.ndarray:
    """`[n, d]` embeddings of an answer's texts by this memory's encoder (outside the lock)."""
    if self.encoder.get(self.config.dim) is None:
      raise ValueError("this memory has no encoder, so it cannot embed an answer: feedback from "
                       "an answer needs the memories' encoder (build the Memory with one); give "
                       "cited ids instead")
    return self.embed(texts, None, len(texts), "the answer's")

  def queries(self, question, query_embedding, batch: bool):
    """`(texts [n] or None, [n, d] given unit embeddings or None)`, checked."""
    if question is None and query_embedding is None:
      raise ValueError("pass a question (text) or query_embedding")
    if question is not None and not batch and not isinstance(question, str):
      raise InputTypeError(f"question must be a string, got {type(question).__name__}")
    texts = None if question is None else checks_lib.check_text_list(question, "question")
    if query_embedding is None:
      return texts, None
    emb = query_embedding
    if not batch:
      emb = checks_lib.real_query_vector(query_embedding, self.config.dim)[None]
    emb = self.embed(texts, emb, None if texts is None else len(texts), "query")
    if not len(emb):
      raise ValueError("no question: pass at least one")
    if self.rows.lexical is not None and texts is None:
      raise ValueError(f"candidates={self.cfg.first_stage_name!r} ranks by the question's text "
                       "(BM25): pass the question, with query_embedding or without")
    return texts, emb

  def run(self, texts, emb, names, size, k: Optional[int], finish):
    """`finish(texts, q_emb, first stage)` under the lock after the query's first stage in `names`
    (with `size`, its slate); scopes without a candidate are refused before any encoding."""
    search_texts = texts if texts is not None else [""] * len(emb)
    prepare = lambda: self.rows.scopes.check_any(self.config.num_candidates,
                                                 self.cfg.multistore, names, k)
    with self._lock:  # (before the encoder: an empty memory answers at once)
      prepare()
      if emb is None:
        self._check_encodable()
    if self.batcher is not None:
      return self.batcher.submit(batcher_lib.Request(
          texts if emb is None else None, emb, (size,), search_texts, prepare, finish,
          scope=names, what="query"))
    if emb is None:
      emb = self.embed(texts, None, len(texts), "query")
    with self._lock:
      prepare()
      return finish(search_texts, emb, self.first_stage(search_texts, emb, [names] * len(emb),
                                                        size))

  def source(self, embeddings) -> str:
    """Where rows' embeddings come from (`Table.embedded_by`): 'encoder' or 'caller'."""
    return "caller" if embeddings is not None and not self.encoder.explicit else "encoder"

  def _check_encodable(self) -> None:
    """ValueError when a default encoder that made no row would embed a question."""
    if self.rows.table.embedded_by == "caller" and not self.encoder.explicit:
      raise ValueError(
          f"this memory's memories all came with your own embeddings (add(..., embeddings=...)), "
          f"and its encoder {self.encoder.spec!r} is only the default, not one you named: a "
          "question's text embedded by it need not match them. Pass query_embedding= (your "
          "embedder's vector of the question), or name the encoder that made the memories' "
          "embeddings (Memory(encoder=...), Memory.open(path, encoder=...))")

  def first_stage(self, texts, q_emb, scopes, size):
    """The first stage of `[q, d]` queries, with the served slate of `size`. Under the lock."""
    slate = None if size is None else (self.learning.served_params(), self.hparams, size, False)
    return self.rows.first_stage(texts, q_emb, scopes, self.config.num_candidates, slate)
