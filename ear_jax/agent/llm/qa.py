"""Question answering from selected memories, scored with F1, BLEU-1 and an LLM judge (J).

`evaluate_qa` answers every `QAItem`, scores it with the benchmark's F1 (`data.answer_metrics`) and
BLEU-1, then asks the judge for a CORRECT / WRONG verdict (`qa_prompts`); `judge_agreement` checks
a judge on pairs of known verdict. Calls: temperature 0, at most `max_workers` in flight, through
the client's retries and cache. A failed or blank answer scores F1 = BLEU-1 = J = 0 (not judged), a
reply without a verdict J = 0; both are counted (`QAReport.counters`).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Optional, Sequence

from absl import logging

from ear_jax.agent.llm import qa_prompts
from ear_jax.agent.llm.client import ChatClient, ChatResult
from ear_jax.data import answer_metrics

ANSWER_MAX_TOKENS = 48
DEFAULT_WORKERS = 2


@dataclasses.dataclass(frozen=True)
class QAItem:
  """One question to answer from its selected memories."""
  id: str  # LongMemEval: `_abs` marks abstention
  question: str
  gold: str
  category: Any  # LoCoMo category name (or number) / LongMemEval question type
  memories: tuple  # in slate order, `(text, session date)` ('' = unknown date)
  question_date: Optional[str] = None  # when the question is asked (LongMemEval)
  benchmark: str = "locomo"  # or 'longmemeval': the F1 rules and the judge


@dataclasses.dataclass
class QAOutcome:
  """The answer to one `QAItem` and its scores (F1, BLEU-1, J in [0, 1])."""
  id: str
  category: Any
  answer: str
  answer_status: str  # the answer call's status ('ok', 'http_error', ...) or 'empty'
  f1: float
  bleu1: float
  j: float
  verdict: Optional[bool]  # None: no usable verdict (or no usable answer)
  judge_reply: str


@dataclasses.dataclass
class QAReport:
  """Outcomes in item order, the per-phase call counters and wall seconds."""
  outcomes: list
  counters: dict

  def means(self) -> dict:
    """Mean F1, BLEU-1 and J in percent, and the number of questions."""
    o = self.outcomes
    return {"n": len(o), "f1": answer_metrics.mean_percent([x.f1 for x in o]),
            "bleu1": answer_metrics.mean_percent([x.bleu1 for x in o]),
            "j": answer_metrics.mean_percent([x.j for x in o])}

  def per_category(self) -> dict:
    """`category -> means()` over that category's questions."""
    cats = sorted({str(x.category) for x in self.outcomes})
    return {c: QAReport([x for x in self.outcomes if str(x.category) == c], {}).means()
            for c in cats}


def run_requests(client: ChatClient, requests: Sequence[tuple[list, dict]], *,
                 max_workers: int = DEFAULT_WORKERS, desc: str = "LLM",
                 progress: bool = True) -> list[ChatResult]:
  """`client.complete` of each request, at most `max_workers` at a time, in request order (a call
  that raises: a `connection_error` result)."""
  if max_workers < 1:
    raise ValueError(f"max_workers must be >= 1, got {max_workers}")
  from tqdm import auto as tqdm  # pylint: disable=g-import-not-at-top
  results: list[Optional[ChatResult]] = [None] * len(requests)

  def call(messages, decoding):
    try:
      return client.complete(messages, **decoding)
    except Exception as e:  # pylint: disable=broad-except
      return ChatResult(text="", usage={}, status="connection_error", attempts=0,
                        error=f"{type(e).__name__}: {e}"[:300])

  with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as pool, tqdm.tqdm(
      total=len(requests), desc=desc, unit="req", mininterval=2.0, leave=False,
      disable=not (progress and requests)) as bar:
    futures = {pool.submit(call, *request): i for i, request in enumerate(requests)}
    for fut in concurrent.futures.as_completed(futures):
      results[futures[fut]] = fut.result()
      bar.update(1)
  return results


def _stats(client: ChatClient) -> dict:
  return dict(getattr(client, "stats", {}))


def _phase(client: ChatClient, before: dict, t0: float, unusable: int) -> dict:
  """A phase's counters: the client's counter deltas since `before`, `unusable` (also counted by
  the client) and `wall_seconds` since `t0`."""
  if unusable and hasattr(client, "count"):
    client.count("unusable", n=unusable)
  delta = {k: round(v - before.get(k, 0), 3) if isinstance(v, float) else v - before.get(k, 0)
           for k, v in _stats(client).items() if isinstance(v, (int, float))}
  return {**delta, "unusable": unusable, "wall_seconds": round(time.perf_counter() - t0, 2)}


def evaluate_qa(items: Sequence[QAItem], answer_client: ChatClient,
                judge_client: Optional[ChatClient] = None, *,
                max_workers: int = DEFAULT_WORKERS, progress: bool = True,
                desc: str = "QA") -> QAReport:
  """Answers (in `ANSWER_MAX_TOKENS` tokens), scores and judges `items` (the module docstring).

  Args:
    answer_client, judge_client: the clients (judge default: the answering one).
    max_workers: requests in flight at once, per phase.
    progress, desc: tqdm bars and their label.

  Returns:
    A `QAReport`; `counters` per phase: the client's counter deltas, `unusable`, `wall_seconds`.
  """
  judge_client = judge_client or answer_client
  items = list(items)
  t0, a0 = time.perf_counter(), _stats(answer_client)
  answers = run_requests(
      answer_client,
      [(qa_prompts.answer_messages(it.question, it.memories, it.question_date),
        {"temperature": 0.0, "max_tokens": ANSWER_MAX_TOKENS}) for it in items],
      max_workers=max_workers, desc=f"{desc}: answers", progress=progress)
  texts = [res.text.strip() if res.status == "ok" else "" for res in answers]
  statuses = [r.status if r.status != "ok" or t else "empty" for r, t in zip(answers, texts)]
  unusable_answers = sum(s != "ok" for s in statuses)
  counters = {"answer": _phase(answer_client, a0, t0, unusable_answers)}
  to_judge = [i for i, s in enumerate(statuses) if s == "ok"]
  t1, j0 = time.perf_counter(), _stats(judge_client)
  verdicts = run_requests(
      judge_client,
      [qa_prompts.judge_request(items[i].benchmark, items[i].question, items[i].gold, texts[i],
                                str(items[i].category), answer_metrics.is_abstention(items[i].id))
       for i in to_judge],
      max_workers=max_workers, desc=f"{desc}: judge", progress=progress)
  judged = dict(zip(to_judge, verdicts))
  outcomes = []
  for i, it in enumerate(items):
    res, ok = judged.get(i), statuses[i] == "ok"
    reply = res.text if res is not None and res.status == "ok" else ""
    verdict = qa_prompts.parse_verdict(it.benchmark, reply)  # (None for '': not judged, failed)
    outcomes.append(QAOutcome(
        id=it.id, category=it.category, answer=texts[i], answer_status=statuses[i],
        f1=answer_metrics.answer_f1(it.benchmark, texts[i], it.gold, it.category) if ok else 0.0,
        bleu1=answer_metrics.bleu1(texts[i], it.gold) if ok else 0.0,
        j=1.0 if verdict else 0.0, verdict=verdict, judge_reply=reply))
  unusable_verdicts = sum(outcomes[i].verdict is None for i in to_judge)
  counters["judge"] = _phase(judge_client, j0, t1, unusable_verdicts)
  if unusable_answers or unusable_verdicts:
    logging.info("%s: %d unusable answers, %d unusable verdicts (scored 0) of %d questions", desc,
                 unusable_answers, unusable_verdicts, len(items))
  return QAReport(outcomes=outcomes, counters=counters)


def judge_agreement(items: Sequence[QAItem], judge_client: ChatClient, *, limit: int = 20,
                    max_workers: int = DEFAULT_WORKERS, progress: bool = True) -> dict:
  """The judge on known pairs over the first `limit` items, in percent: each question's gold
  answer (should be CORRECT) and another question's gold answer (should be WRONG).

  Returns:
    `{"n", "gold_judged_correct", "other_judged_wrong", "unusable", "balanced_accuracy"}`.
  """
  items = list(items)[:limit]
  pairs = []
  for i, it in enumerate(items):
    for k in range(1, len(items)):
      other = items[(i + k) % len(items)].gold
      if answer_metrics.normalize_answer(other) != answer_metrics.normalize_answer(it.gold):
        break
    else:
      continue
    pairs += [(it, it.gold, True), (it, other, False)]
  results = run_requests(
      judge_client,
      [qa_prompts.judge_request(it.benchmark, it.question, it.gold, gen, str(it.category),
                                answer_metrics.is_abstention(it.id)) for it, gen, _ in pairs],
      max_workers=max_workers, desc="judge check", progress=progress)
  verdicts = [qa_prompts.parse_verdict(it.benchmark, res.text) if res.status == "ok" else None
              for (it, _, _), res in zip(pairs, results)]
  pos = [v for (_, _, t), v in zip(pairs, verdicts) if t]
  neg = [v for (_, _, t), v in zip(pairs, verdicts) if not t]
  correct = answer_metrics.mean_percent([v is True for v in pos])
  wrong = answer_metrics.mean_percent([v is False for v in neg])
  return {"n": len(pos), "gold_judged_correct": correct, "other_judged_wrong": wrong,
          "unusable": sum(v is None for v in verdicts), "balanced_accuracy": (correct + wrong) / 2}
