"""Answer support: how much an agent's answer draws on each candidate memory.

Symbols: `N` queries, `K` candidates per query, `d` embedding dimension, `F` answer-support
features (`core.critic.ANSWER_FEATURES`), computed on the host from the texts (0 at padding):

- `new_words`: the answer's content words not in the question that appear in the memory
  (`lexical.tokenize` tokens, Porter-stemmed, compared as sets);
- `new_word_share`: `new_words` over the answer's content words not in the question;
- `answer_cosine`: the cosine of the answer's embedding with the memory's (the frozen encoder);
- `question_answer_cosine`: the cosine of "question answer" with the memory's.

`with_answer_support(bench, answers)` sets `stream.answer_support`, which travels with the stream
like `gold`, so a jitted critic reads it through `SlateView.answer_support`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ear_jax.core.critic import ANSWER_FEATURES
from ear_jax.data import encoders
from ear_jax.data import lexical
from ear_jax.data.answer_metrics import stem


def content_words(texts: Sequence[str]) -> list[frozenset[str]]:
  """Per text, its set of stemmed content words (see the module docstring)."""
  return [frozenset(stem(t) for t in tokens) for tokens in lexical.tokenize(texts)]


def lexical_support(questions: Sequence[str], answers: Sequence[str],
                    candidate_texts: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """`[N, K, 2]` float32 (`new_words`, `new_word_share`) of every candidate (0 at padding).

  `answers` '' gives all zeros; `candidate_texts [N, K]`, `mask [N, K]`.
  """
  n, k = np.shape(mask)
  q_words = content_words(questions)
  a_words = content_words(answers)
  m_words = content_words([str(t) for t in np.asarray(candidate_texts, object).reshape(-1)])
  out = np.zeros((n, k, 2), np.float32)
  for i in range(n):
    new = a_words[i] - q_words[i]
    if not new:
      continue
    for j in np.nonzero(np.asarray(mask[i], bool))[0]:
      shared = len(new & m_words[i * k + j])
      out[i, j] = (shared, shared / len(new))
  return out


def embedding_support(answer_emb: np.ndarray, question_answer_emb: np.ndarray,
                      candidate_emb: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """`[N, K, 2]` float32 (`answer_cosine`, `question_answer_cosine`), 0 at padding.

  Inputs: `answer_emb [N, d]`, `question_answer_emb [N, d]`, `candidate_emb [N, K, d]` unit rows.
  """
  cos = np.einsum("nd,nkd->nk", answer_emb, candidate_emb)
  qa_cos = np.einsum("nd,nkd->nk", question_answer_emb, candidate_emb)
  return np.where(np.asarray(mask, bool)[..., None], np.stack([cos, qa_cos], -1),
                  0.0).astype(np.float32)


def answer_support(questions: Sequence[str], answers: Sequence[str], candidate_texts: np.ndarray,
                   candidate_emb: np.ndarray, mask: np.ndarray, encoder="minilm", *,
                   cache_dir=None, progress: bool = False) -> np.ndarray:
  """`[N, K, F]` float32 answer support of every candidate, in `ANSWER_FEATURES` order.

  `questions`, `answers` `[N]` texts; `candidate_texts [N, K]`; `candidate_emb [N, K, d]` frozen
  unit rows; `mask [N, K]`; `encoder` the memories' own (answers use its cache).

  Raises:
    ValueError: when the lengths or shapes disagree.
  """
  answers = ["" if a is None else str(a) for a in answers]
  n, k = np.shape(mask)
  if len(questions) != n or len(answers) != n or np.shape(candidate_texts) != (n, k):
    raise ValueError(f"answer support needs {n} questions, {n} answers and [{n}, {k}] candidate "
                     f"texts, got {len(questions)}, {len(answers)} and "
                     f"{np.shape(candidate_texts)}")
  enc = encoders.load_encoder(encoder)  # (an `Encoder` is returned as is)
  if np.shape(candidate_emb)[:2] != (n, k) or np.shape(candidate_emb)[2] != enc.dim:
    raise ValueError(f"candidate_emb must be [{n}, {k}, {enc.dim}] (the encoder's dim), got "
                     f"{np.shape(candidate_emb)}")
  both = encoders.encode(enc, answers + [f"{q} {a}" for q, a in zip(questions, answers)],
                         cache_dir=cache_dir, progress=progress)
  has = np.asarray([bool(a.strip()) for a in answers])
  emb = embedding_support(both[:n], both[n:], np.asarray(candidate_emb, np.float32), mask)
  feats = np.concatenate([lexical_support(questions, answers, candidate_texts, mask), emb], -1)
  assert feats.shape[-1] == len(ANSWER_FEATURES)
  return np.where(has[:, None, None], feats, 0.0).astype(np.float32)


def slate_support(question: str, answer: str, texts: Sequence[str], memories: np.ndarray,
                  embed) -> np.ndarray:
  """`[s, F]` float32 answer support of ONE slate of `s` shown memories (`Memory` feedback).

  `texts [s]`, `memories [s, d (+ F)]` (columns beyond `d` ignored); `embed(texts) -> [n, d]` by
  the memories' own encoder. An empty `answer` gives zeros.

  Raises:
    ValueError: when the lengths or shapes disagree.
  """
  texts = [str(t) for t in texts]
  s = len(texts)
  memories = np.asarray(memories, np.float32)
  if memories.ndim != 2 or memories.shape[0] != s:
    raise ValueError(f"slate support needs [{s}, d] memory embeddings for {s} texts, got "
                     f"{memories.shape}")
  out = np.zeros((s, len(ANSWER_FEATURES)), np.float32)
  if not answer.strip() or not s:
    return out
  both = np.asarray(embed([answer, f"{question} {answer}"]), np.float32)
  d = both.shape[-1]
  if memories.shape[1] < d:
    raise ValueError(f"the memories' embeddings have {memories.shape[1]} columns, fewer than the "
                     f"answer's d={d}: they must come from the same encoder")
  mask = np.ones((1, s), bool)
  lex = lexical_support([question], [answer], np.asarray([texts], object).reshape(1, s), mask)
  emb = embedding_support(both[:1], both[1:], memories[None, :, :d], mask)
  return np.concatenate([lex, emb], -1)[0].astype(np.float32)


def with_answer_support(bench, answers: Sequence[str] | None = None, encoder="minilm", *,
                        cache_dir=None, progress: bool = False):
  """`bench` with `stream.answer_support` from `answers` (default: its gold answers).

  `encoder` must be the benchmark's (the memories' embeddings come from it).

  Raises:
    ValueError: for a benchmark without answers (synthetic) or answers of the wrong length.
  """
  if answers is None:
    answers = bench.answers
    if answers is None or not any(a for a in answers):
      raise ValueError(f"benchmark {bench.name!r} holds no answers: answer support needs the "
                       "agent's answers (pass answers=...)")
  strm = bench.stream
  support = answer_support(bench.query_texts, answers, bench.candidate_texts,
                           np.asarray(strm.candidates)[..., :strm.dim], np.asarray(strm.mask),
                           encoder, cache_dir=cache_dir, progress=progress)
  return dataclasses.replace(bench, stream=strm.replace(answer_support=support))
