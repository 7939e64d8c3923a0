"""Prompts for question answering from selected memories, the LLM judges, and verdict parsing.

Answer prompt (`answer_messages`, ours: the paper's Appendix D is empty): a short answer from the
memories, each with its session date (and the question's date where given). It offers no "I don't
know": small models overuse it even when shown the gold turns.

Judges (J, one CORRECT / WRONG verdict per answer):
  * LoCoMo: mem0's judge (`LOCOMO_JUDGE_PROMPT`, verbatim), answered as JSON `{"label": ...}`;
    `parse_locomo_verdict` follows mem0's parser except that "INCORRECT" counts as WRONG.
  * LongMemEval: the official per-question-type prompts (verbatim, abstention included); the
    verdict is `'yes' in reply.lower()`, temperature 0 and max_tokens 10 as there.
An empty reply is unusable (None), never a verdict. Pure text: no I/O.
"""
from __future__ import annotations

import json
import re
from typing import Optional, Sequence

ANSWER_SYSTEM = (
    "You answer questions about people's past conversations from the memories given; each memory "
    "is dated with its session. Resolve relative times (\"yesterday\", \"last week\") with that "
    "date. Answer with a short phrase taken from the memories, no explanation.")

# mem0 evaluation/metrics/llm_judge.py, ACCURACY_PROMPT (verbatim; its typographic quotes kept).
LOCOMO_JUDGE_PROMPT = """
Your task is to label an answer to a question as ’CORRECT’ or ’WRONG’. You will be given the following data:
    (1) a question (posed by one user to another user), 
    (2) a ’gold’ (ground truth) answer, 
    (3) a generated answer
which you will score as CORRECT/WRONG.

The point of the question is to ask about something one user should know about the other user based on their prior conversations.
The gold answer will usually be a concise and short answer that includes the referenced topic, for example:
Question: Do you remember what I got the last time I went to Hawaii?
Gold answer: A shell necklace
The generated answer might be much longer, but you should be generous with your grading - as long as it touches on the same topic as the gold answer, it should be counted as CORRECT. 

For time related questions, the gold answer will be a specific date, month, year, etc. The generated answer might be much longer or use relative time references (like "last Tuesday" or "next month"), but you should be generous with your grading - as long as it refers to the same date or time period as the gold answer, it should be counted as CORRECT. Even if the format differs (e.g., "May 7th" vs "7 May"), consider it CORRECT if it's the same date.

Now it's time for the real question:
Question: {question}
Gold answer: {gold_answer}
Generated answer: {generated_answer}

First, provide a short (one sentence) explanation of your reasoning, then finish with CORRECT or WRONG. 
Do NOT include both CORRECT and WRONG in your response, or it will break the evaluation script.

Just return the label CORRECT or WRONG in a json format with the key as "label".
"""  # noqa: E501

JUDGE_RESPONSE_FORMAT = {
    "type": "json_object",
    "schema": {"type": "object", "properties": {"label": {"type": "string",
                                                          "enum": ["CORRECT", "WRONG"]}},
               "required": ["label"]}}

_LME_INTRO = ("I will give you a question, a correct answer, and a response from a model. Please "
              "answer yes if the response contains the correct answer. Otherwise, answer no. ")
_LME_STEPS = ("If the response is equivalent to the correct answer or contains all the "
              "intermediate steps to get the correct answer, you should also answer yes. If the "
              "response only contains a subset of the information required by the answer, answer "
              "no. ")
_LME_TAIL = ("\n\nQuestion: {}\n\nCorrect Answer: {}\n\nModel Response: {}\n\nIs the model response "
             "correct? Answer yes or no only.")
# xiaowu0162/LongMemEval src/evaluation/evaluate_qa.py, get_anscheck_prompt (verbatim).
LONGMEMEVAL_JUDGE_TEMPLATES = {
    "single-session-user": _LME_INTRO + _LME_STEPS + _LME_TAIL,
    "single-session-assistant": _LME_INTRO + _LME_STEPS + _LME_TAIL,
    "multi-session": _LME_INTRO + _LME_STEPS + _LME_TAIL,
    "temporal-reasoning": _LME_INTRO + _LME_STEPS + (
        "In addition, do not penalize off-by-one errors for the number of days. If the question "
        "asks for the number of days/weeks/months, etc., and the model makes off-by-one errors "
        "(e.g., predicting 19 days when the answer is 18), the model's response is still "
        "correct. ") + _LME_TAIL,
    "knowledge-update": _LME_INTRO + (
        "If the response contains some previous information along with an updated answer, the "
        "response should be considered as correct as long as the updated answer is the required "
        "answer.") + _LME_TAIL,
    "single-session-preference": (
        "I will give you a question, a rubric for desired personalized response, and a response "
        "from a model. Please answer yes if the response satisfies the desired response. "
        "Otherwise, answer no. The model does not need to reflect all the points in the rubric. "
        "The response is correct as long as it recalls and utilizes the user's personal "
        "information correctly.\n\nQuestion: {}\n\nRubric: {}\n\nModel Response: {}\n\nIs the "
        "model response correct? Answer yes or no only."),
}
LONGMEMEVAL_ABSTENTION_TEMPLATE = (
    "I will give you an unanswerable question, an explanation, and a response from a model. Please "
    "answer yes if the model correctly identifies the question as unanswerable. The model could "
    "say that the information is incomplete, or some other information is given but the asked "
    "information is not.\n\nQuestion: {}\n\nExplanation: {}\n\nModel Response: {}\n\nDoes the "
    "model correctly identify the question as unanswerable? Answer yes or no only.")
LONGMEMEVAL_JUDGE_MAX_TOKENS = 10  # as in evaluate_qa.py
LOCOMO_JUDGE_MAX_TOKENS = 96  # one sentence of reasoning plus the JSON label
# A memory longer than this is cut (with " ..."): five LongMemEval turns must fit a small model.
MAX_MEMORY_CHARS = 2000


def format_memories(memories: Sequence[tuple[str, str]]) -> str:
  """One line per memory: `[i] (session date: <date>) <text>` (no date part when unknown)."""
  lines = []
  for i, (text, date) in enumerate(memories, 1):
    when = f"(session date: {date}) " if date else ""
    text = " ".join(str(text).split())
    if len(text) > MAX_MEMORY_CHARS:
      text = text[:MAX_MEMORY_CHARS] + " ..."
    lines.append(f"[{i}] {when}{text}")
  return "\n".join(lines) if lines else "(no memories)"


def answer_messages(question: str, memories: Sequence[tuple[str, str]],
                    question_date: Optional[str] = None) -> list[dict]:
  """The answering model's chat messages (see the module docstring)."""
  parts = ["Memories:", format_memories(memories), ""]
  if question_date:
    parts.append(f"Today's date: {question_date}")
  parts += [f"Question: {question}", "Short answer:"]
  return [{"role": "system", "content": ANSWER_SYSTEM},
          {"role": "user", "content": "\n".join(parts)}]


def longmemeval_judge_prompt(question_type: str, question: str, answer: str, response: str,
                             abstention: bool = False) -> str:
  """LongMemEval's official judge prompt for a question type (ValueError naming an unknown one)."""
  if abstention:
    return LONGMEMEVAL_ABSTENTION_TEMPLATE.format(question, answer, response)
  if question_type not in LONGMEMEVAL_JUDGE_TEMPLATES:
    raise ValueError(f"no LongMemEval judge prompt for question type {question_type!r}; known: "
                     f"{sorted(LONGMEMEVAL_JUDGE_TEMPLATES)}")
  return LONGMEMEVAL_JUDGE_TEMPLATES[question_type].format(question, answer, response)


def judge_request(benchmark: str, question: str, gold: str, response: str, category: str,
                  abstention: bool = False) -> tuple[list[dict], dict]:
  """`(messages, decoding)` of the judge call for one answer (LongMemEval's or the LoCoMo judge)."""
  if benchmark == "longmemeval":
    prompt = longmemeval_judge_prompt(category, question, gold, response, abstention)
    return ([{"role": "user", "content": prompt}],
            {"temperature": 0.0, "max_tokens": LONGMEMEVAL_JUDGE_MAX_TOKENS})
  prompt = LOCOMO_JUDGE_PROMPT.format(question=question, gold_answer=gold,
                                      generated_answer=response)
  return ([{"role": "user", "content": prompt}],
          {"temperature": 0.0, "max_tokens": LOCOMO_JUDGE_MAX_TOKENS,
           "response_format": JUDGE_RESPONSE_FORMAT})


def _json_objects(text: str):
  """Candidate JSON objects in `text`: fenced ```json blocks first, then each `{...}` span."""
  for m in re.finditer(r"```(?:json)?\s*(\{.*?\})\s*```", text, re.S):
    yield m.group(1)
  for m in re.finditer(r"\{[^{}]*\}", text):
    yield m.group(0)


def parse_locomo_verdict(text: str) -> Optional[bool]:
  """True (CORRECT), False (WRONG) or None (unusable) from a LoCoMo judge reply."""
  text = str(text or "")
  for candidate in _json_objects(text):
    try:
      obj = json.loads(candidate)
    except ValueError:
      continue
    label = obj.get("label") if isinstance(obj, dict) else None
    if isinstance(label, str) and label.strip().upper() in ("CORRECT", "WRONG", "INCORRECT"):
      return label.strip().upper() == "CORRECT"
  upper = text.upper()
  wrong = bool(re.search(r"\bWRONG\b|\bINCORRECT\b", upper))
  correct = bool(re.search(r"\bCORRECT\b", upper))
  return correct if correct != wrong else None  # exactly one of the two words


def parse_longmemeval_verdict(text: str) -> Optional[bool]:
  """LongMemEval's rule: `'yes' in reply.lower()`; None for an empty reply."""
  text = str(text or "").strip()
  return "yes" in text.lower() if text else None


def parse_verdict(benchmark: str, text: str) -> Optional[bool]:
  """The judge verdict for `benchmark` (None: unusable)."""
  if benchmark == "longmemeval":
    return parse_longmemeval_verdict(text)
  return parse_locomo_verdict(text)
