"""An agent's own answers for the answer-grounded critic: generated, stored, read back.

`AnswerCritic` reads how much an answer draws on each shown memory. The gold answers play a
competent agent; this module a weak one: the local LLM answering from the frozen first stage's top
`ANSWER_MEMORIES` memories with the QA suite's prompt (temperature 0), stored as JSON keyed by
query id and question (`read_answers` refuses a missing, foreign or misaligned file). A failed or
blank answer is stored as '' (zero support: the critic cites the whole slate).
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Optional, Sequence

import numpy as np

from ear_jax.agent.llm import qa as qa_lib
from ear_jax.agent.llm import qa_prompts

ANSWER_MEMORIES = 5  # the retriever's top-5: the QA suite's "Only Retriever" slate
FORMAT = "ear_jax.agent_answers.v1"


def memory_dates(corpus) -> dict:
  """`(bank, memory id) -> session date` ('' where the corpus has none) of every memory."""
  return {(g, mid): date for g, bank in enumerate(corpus.banks)
          for mid, date in zip(bank.ids, bank.dates or [""] * len(bank.ids))}


def answer_items(bench, corpus, rows: Sequence[int], top: int = ANSWER_MEMORIES) -> list:
  """`QAItem`s of queries `rows` of `bench`, each with its retriever top-`top` memories."""
  queries, dates = {q.id: q for q in corpus.queries}, memory_dates(corpus)
  items = []
  for n in rows:
    n = int(n)
    q = queries.get(bench.query_ids[n])
    mem = tuple((str(bench.candidate_texts[n, j]),
                 dates.get((int(bench.group[n]), str(bench.candidate_ids[n, j])), ""))
                for j in range(min(top, bench.candidate_ids.shape[1]))
                if bench.candidate_ids[n, j] != "")
    items.append(qa_lib.QAItem(id=bench.query_ids[n], question=bench.query_texts[n],
                               gold="" if q is None or q.answer is None else q.answer,
                               category=bench.categories[n], memories=mem,
                               question_date=None if q is None else q.date,
                               benchmark=bench.name))
  return items


def generate_answers(client, items: Sequence, *, max_workers: int = qa_lib.DEFAULT_WORKERS,
                     max_tokens: int = qa_lib.ANSWER_MAX_TOKENS,
                     progress: bool = True) -> list[dict]:
  """Per item `{"query_id", "question", "answer", "status"}`: one answer call each."""
  results = qa_lib.run_requests(
      client, [(qa_prompts.answer_messages(it.question, it.memories, it.question_date),
                {"temperature": 0.0, "max_tokens": int(max_tokens)}) for it in items],
      max_workers=max_workers, desc="agent answers", progress=progress)
  out = []
  for it, res in zip(items, results):
    text = res.text.strip() if res.status == "ok" else ""
    out.append({"query_id": it.id, "question": it.question, "answer": text,
                "status": res.status if res.status != "ok" or text else "empty"})
  return out


def write_answers(path, bench_name: str, answers: Sequence[dict], info: dict[str, Any]):
  """Writes `answers` (from `generate_answers`) and `info` (model, settings) as JSON at `path`."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  body = {"format": FORMAT, "benchmark": bench_name, **info, "answers": list(answers)}
  path.write_text(json.dumps(body, indent=1, default=str))


def load_answers(path) -> dict:
  """The JSON `write_answers` wrote.

  Raises:
    FileNotFoundError, ValueError: naming the file when it is missing or not such a JSON.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"agent answers file {path} not found: generate it with "
                            "`python -m experiments.critic_eval --critic=answer --answers=llm "
                            "--generate_answers ...`")
  try:
    body = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f"agent answers file {path} is not readable JSON: {e}") from None
  if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(
      body.get("answers"), list):
    raise ValueError(f"agent answers file {path} is not a {FORMAT} file (a JSON object with "
                     "'format' and an 'answers' list)")
  return body


def read_answers(path, bench, rows: Sequence[int], body: Optional[dict] = None) -> list[str]:
  """The stored answers in `bench`'s query order ('' outside `rows`); `body`: the file's JSON when
  the caller already loaded it (`load_answers`).

  Raises:
    FileNotFoundError: naming the file when it is missing.
    ValueError: naming the file when it belongs to another benchmark, lacks a query of `rows`,
      or a stored question differs from the benchmark's.
  """
  body = load_answers(path) if body is None else body
  if body.get("benchmark") != bench.name:
    raise ValueError(f"agent answers file {path} holds {body.get('benchmark')!r} answers, not "
                     f"{bench.name!r}")
  stored = {}
  for a in body["answers"]:
    if not isinstance(a, dict) or not {"query_id", "question", "answer"} <= set(a):
      raise ValueError(f"agent answers file {path}: an entry lacks query_id / question / answer: "
                       f"{str(a)[:120]}")
    stored[str(a["query_id"])] = a
  out = [""] * bench.num_queries
  missing, misaligned = [], []
  for n in np.asarray(rows, np.int64).reshape(-1):
    qid = bench.query_ids[int(n)]
    a = stored.get(qid)
    if a is None:
      missing.append(qid)
    elif a["question"] != bench.query_texts[int(n)]:
      misaligned.append(qid)
    else:
      out[int(n)] = str(a["answer"] or "")
  if missing:
    raise ValueError(f"agent answers file {path} has no answer for {len(missing)} of the "
                     f"{len(set(map(int, np.asarray(rows).reshape(-1))))} queries needed (e.g. "
                     f"{missing[:3]}): generate them with --generate_answers for these seeds")
  if misaligned:
    raise ValueError(f"agent answers file {path}: the stored question of {len(misaligned)} queries "
                     f"differs from the benchmark's (e.g. {misaligned[:3]}): the file belongs to "
                     "another version of the data; regenerate it")
  return out
