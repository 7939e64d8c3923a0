"""The LongMemEval loader (`longmemeval_s*.json[.gz]`, `_m`, `_oracle`, cleaned releases).

Bank = the USER turns of the question's haystack (id `session_id + "_" + (i + 1)`, i over all
turns); gold = user turns with `has_answer`; `_abs` questions and questions without a gold user turn
are excluded and counted; category = `question_type`. Duplicate sessions are kept (as the official
protocol does). A field of the wrong type is a `ValueError` naming file, question and field.
"""
from __future__ import annotations

import collections
import pathlib

import numpy as np

from ear_jax.data import corpus as corpus_lib
from ear_jax.data import parsing
from ear_jax.data import sources

# Looked up in the data directory in this order; the first that exists is used.
FILES = (
    "longmemeval_s_cleaned.json", "longmemeval_s_cleaned.json.gz",
    "longmemeval_s.json", "longmemeval_s.json.gz", "longmemeval_s.reassembled.json.gz",
)


def load_longmemeval(path, *, limit: int | None = None) -> corpus_lib.Corpus:
  """LongMemEval (module docstring). `limit`: only the first `limit` questions of the file.

  Raises:
    FileNotFoundError: no such file.
    ValueError: naming the file, the question and the field, for malformed input.
  """
  path = pathlib.Path(path)
  data = parsing.read_json_list(path, "questions", limit)
  banks, queries = [], []
  st, per_type = collections.Counter(), collections.Counter()
  texts_seen = set()
  for g, item in enumerate(data):
    qid = parsing.name(item, "question_id", f"{path}: question {g}")
    where = f"{path}: question {qid!r}"
    qtype = parsing.name(item, "question_type", where)
    question = parsing.require(item, "question", where, parsing.STRING)
    sids = parsing.require(item, "haystack_session_ids", where, parsing.LIST)
    sessions = parsing.require(item, "haystack_sessions", where, parsing.LIST)
    if len(sids) != len(sessions):
      raise ValueError(f"{where}: {len(sids)} haystack_session_ids but {len(sessions)} "
                       "haystack_sessions")
    hdates = parsing.optional(item, "haystack_dates", where, parsing.LIST, None)
    if hdates is not None and len(hdates) != len(sessions):
      raise ValueError(f"{where}: {len(hdates)} haystack_dates but {len(sessions)} haystack_sessions")
    answer = parsing.optional(item, "answer", where, parsing.ANSWER, None)
    qdate = parsing.optional(item, "question_date", where, parsing.STRING_OR_NULL, None)
    ids, texts, gold, dates = [], [], [], []
    for s, (sid, sess) in enumerate(zip(sids, sessions)):
      sdate = "" if hdates is None else hdates[s]
      if not isinstance(sdate, str):
        raise ValueError(f"{where}: field 'haystack_dates' entry {s} must be a string, got "
                         f"{parsing.json_type(sdate)}")
      if not parsing.is_kind(sid, parsing.NAME):
        raise ValueError(f"{where}: field 'haystack_session_ids' entry {s} must be a string, got "
                         f"{parsing.json_type(sid)}")
      parsing.check(sess, parsing.LIST, where, f"haystack_sessions[{s}]")
      st["sessions"] += 1
      for i, turn in enumerate(sess):
        role, content = (turn.get("role"), turn.get("content")) if isinstance(turn, dict) else (0, 0)
        if not (isinstance(role, str) and isinstance(content, str)):  # the error, naming the field
          w = f"{where}, session {sid!r} turn {i}"
          role = parsing.require(turn, "role", w, parsing.STRING)
          content = parsing.require(turn, "content", w, parsing.STRING)
        st["turns"] += 1
        if role != "user":
          continue
        tid = f"{sid}_{i + 1}"
        ids.append(tid)
        texts.append(content)
        dates.append(sdate)
        texts_seen.add(content)
        if turn.get("has_answer"):
          gold.append(tid)
    if not ids:
      raise ValueError(f"{where}: empty memory bank (no user turns in its haystack)")
    st["user_turns"] += len(ids)
    banks.append(corpus_lib.Bank(ids=ids, texts=texts, stores=np.zeros(len(ids), np.int8),
                                 refs=[()] * len(ids), dates=dates))
    st["questions"] += 1
    if qid.endswith("_abs"):
      st["questions_abs_excluded"] += 1
      continue
    if not gold:
      st["questions_without_gold_excluded"] += 1
      continue
    per_type[qtype] += 1
    queries.append(corpus_lib.Query(id=qid, text=question, gold=tuple(dict.fromkeys(gold)),
                                    category=qtype, group=g,
                                    answer=None if answer is None else str(answer), date=qdate))
  stats = {"file": sources.shown_path(path), "questions": st["questions"],
           "queries_evaluable": len(queries),
           "questions_abs_excluded": st["questions_abs_excluded"],
           "questions_without_gold_excluded": st["questions_without_gold_excluded"],
           "sessions": st["sessions"], "turns": st["turns"], "user_turns": st["user_turns"],
           "user_turns_distinct_texts": len(texts_seen),
           "queries_per_category": dict(sorted(per_type.items()))}
  return corpus_lib.Corpus(name="longmemeval", banks=banks, queries=queries, stats=stats)
