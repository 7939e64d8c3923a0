"""The LLM critic's prompts and citation formats: building the messages, parsing the replies.

Symbols: `s` slate size (the number of memories shown to the model).

The memories are numbered from 0 as `[0] text`, `[1] text`, ... `PROMPTS` maps a name to an
instruction and, for JSON prompts, the reply's JSON schema (sent as `response_format` for
constrained decoding): `cite_json` asks `{"cited": [numbers]}`, `answer_cite_json` asks an answer
first, `judge_each_json` asks one true/false per memory (`{"useful": [...]}`), `free_text` asks for
an answer ending with a bracketed citation line (`[0, 2]` or `[NO_CITE]`, RMM / EAR's format).
`parse_reply` reads any of them: a JSON object first (`parse_json_citations`), else the free-text
line (`parse_citations`). Every parser is total: it never raises on any reply text.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. You answer the user's question using memories retrieved from "
    "earlier conversations, and you say which memories you used."
)

_INSTRUCTION = (
    "Answer the question using the memories above where they help. Then, on the last line, cite the "
    "memories you actually used to answer, by their numbers, as a bracketed comma-separated list, "
    "for example [0, 2]. If none of the memories was useful, write [NO_CITE] on the last line "
    "instead. Write nothing after that line."
)


def citation_schema(num_memories: int, with_answer: bool = False) -> dict[str, Any]:
  """The JSON schema of a reply citing some of `num_memories` memories: `{"cited": [i, ...]}`
  (each `i` one of `0..num_memories-1`, at most `num_memories` of them), with a string `answer`
  first when `with_answer`."""
  cited = {"type": "array", "items": {"type": "integer", "enum": list(range(num_memories))},
           "maxItems": num_memories}
  properties = ({"answer": {"type": "string"}} if with_answer else {}) | {"cited": cited}
  return {"type": "object", "properties": properties, "required": list(properties)}


def judgement_schema(num_memories: int) -> dict[str, Any]:
  """The JSON schema of one true/false per memory, in order: `{"useful": [b_0, ..., b_{s-1}]}`."""
  useful = {"type": "array", "items": {"type": "boolean"}, "minItems": num_memories,
            "maxItems": num_memories}
  return {"type": "object", "properties": {"useful": useful}, "required": ["useful"]}


class CriticPrompt(NamedTuple):
  """A critic prompt: the instruction after the memories and question, and the reply's JSON schema
  as a function of the slate size (None: free text, no `response_format`)."""
  instruction: str
  schema: Callable[[int], dict[str, Any]] | None


# No instruction shows concrete memory numbers: small models copy them (measured: SmolLM2-135M
# answered '{"cited": [0, 2]}' to 7 of 8 slates of a smoke run when the example was `[0, 2]`).
PROMPTS: dict[str, CriticPrompt] = {
    "cite_json": CriticPrompt(
        "Which of the numbered memories above contain information needed to answer the question? "
        'Reply with JSON only: {"cited": [...]} listing the numbers of the useful memories, or '
        '{"cited": []} if no memory is useful.',
        lambda s: citation_schema(s, with_answer=False)),
    "answer_cite_json": CriticPrompt(
        "Answer the question in a few words using the memories above, and list the numbers of the "
        'memories you used. Reply with JSON only: {"answer": "...", "cited": [...]}, with '
        '"cited": [] if no memory was useful.',
        lambda s: citation_schema(s, with_answer=True)),
    "judge_each_json": CriticPrompt(
        "For each numbered memory above, in order, decide whether it contains information needed "
        'to answer the question. Reply with JSON only: {"useful": [...]} with one true or false '
        "per memory.",
        judgement_schema),
    "free_text": CriticPrompt(_INSTRUCTION, None),
}


# Chosen on pilot slates of LoCoMo's training split (disjoint from the measured ones) with
# SmolLM2-135M-Instruct, by citation F1 (the comparison: RESULTS.md, "LLM critic").
DEFAULT_PROMPT = "judge_each_json"


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
  """The `response_format` asking for JSON that follows `schema` (llama.cpp server's form)."""
  return {"type": "json_object", "schema": schema}

# The last bracketed group of a reply (innermost brackets: no `[` or `]` inside).
_BRACKET_GROUP = re.compile(r"\[([^\[\]]*)\]")
_INDEX = re.compile(r"[0-9]+")
_NO_CITE = "NO_CITE"


def parse_citations(text: str, num_memories: int) -> tuple[int, ...] | None:
  """Parses the citations of a reply, strictly. Never raises on any `text`.

  The citation list is the LAST bracketed group of the reply (inline markers such as `... Paris [0].`
  earlier in the answer are ignored). It is accepted only if it is exactly one of:
  `[NO_CITE]` (any ASCII case, surrounding spaces allowed) -> `()`; or one or more non-negative ASCII
  decimal integers separated by commas, spaces around them allowed (`[0, 2]`, `[0,2]`, `[ 2 ]`), every
  one `< num_memories`. Duplicates (`[1, 1]`) are collapsed: they name the same memory, so no
  information is lost. Anything else gives None: no bracketed group, an empty list `[]`, an index out
  of range (however many digits), a negative or non-integer entry (`[-1]`, `[1.5]`, `[a]`, `[+1]`),
  `NO_CITE` mixed with indices, a missing or trailing comma (`[0 2]`, `[0, 2,]`), or a last group that
  is not a citation list at all. `format_citations` writes a list this function reads back.

  Args:
    text: the model's reply.
    num_memories: `s`, the number of memories shown to the model.

  Returns:
    The sorted, de-duplicated cited indices, each in `[0, num_memories)` (`()` for `[NO_CITE]`), or
    None when the reply has no valid citation list.

  Raises:
    ValueError: if `num_memories` is negative.
  """
  if num_memories < 0:
    raise ValueError(f"num_memories must be >= 0, got {num_memories}")
  if not isinstance(text, str):
    return None
  groups = _BRACKET_GROUP.findall(text)
  if not groups:
    return None
  body = groups[-1].strip()
  if body.isascii() and body.upper() == _NO_CITE:
    return ()
  items = [item.strip() for item in body.split(",")]
  if not all(_INDEX.fullmatch(item) for item in items):
    return None
  items = [item.lstrip("0") or "0" for item in items]
  if any(len(item) > len(str(num_memories)) for item in items):
    return None  # out of range, however many digits (int() would refuse over 4300)
  indices = {int(item) for item in items}
  if any(i >= num_memories for i in indices):
    return None
  return tuple(sorted(indices))


def parse_json_citations(text: str, num_memories: int) -> tuple[int, ...] | None | bool:
  """The citations of a JSON reply (`{"cited": [0, 2], ...}` or `{"useful": [true, false, ...]}`),
  strictly. Never raises.

  The object is the text from its first `{` to its last `}` (code fences or words around it are
  ignored). `cited` must be a list of integers (not booleans), each in `[0, num_memories)`;
  duplicates are collapsed; `[]` means no memory was useful. Without `cited`, `useful` must be a
  list of exactly `num_memories` booleans (memory `i` is cited iff `useful[i]`).

  Returns:
    The sorted cited indices (`()` for `[]`); None when the reply is a JSON object whose `cited`
    is missing or invalid; False when the reply holds no JSON object at all.
  """
  if not isinstance(text, str) or "{" not in text or "}" not in text:
    return False
  try:
    obj = json.loads(text[text.index("{"):text.rindex("}") + 1])
  except (ValueError, RecursionError):
    return False
  if not isinstance(obj, dict):
    return False
  useful = obj.get("useful")
  if "cited" not in obj and isinstance(useful, list):  # judge_each_json: one boolean per memory
    if len(useful) != num_memories or not all(isinstance(u, bool) for u in useful):
      return None
    return tuple(i for i, u in enumerate(useful) if u)
  cited = obj.get("cited")
  if not isinstance(cited, list) or not all(
      isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_memories for i in cited):
    return None
  return tuple(sorted(set(cited)))


def parse_reply(text: str, num_memories: int) -> tuple[int, ...] | None:
  """The cited indices of a reply in either format: a JSON object (`parse_json_citations`) if the
  reply holds one, else the free-text citation line (`parse_citations`). None: no valid citations."""
  if num_memories < 0:
    raise ValueError(f"num_memories must be >= 0, got {num_memories}")
  cited = parse_json_citations(text, num_memories)
  return parse_citations(text, num_memories) if cited is False else cited


def format_citations(cited: Sequence[int]) -> str:
  """The citation line for `cited`: `[0, 2]`, or `[NO_CITE]` when empty (inverse of the parser)."""
  cited = sorted({int(i) for i in cited})
  return "[" + ", ".join(map(str, cited)) + "]" if cited else f"[{_NO_CITE}]"


def labels_from_citations(cited: Sequence[int], slate_size: int) -> np.ndarray:
  """Turns cited slate positions into the critic's labels (+1 cited, -1 not cited).

  Args:
    cited: 0-based positions in the slate, each in `[0, slate_size)`.
    slate_size: `s`.

  Returns:
    `[s]` float32 of ±1.

  Raises:
    ValueError: if a position is out of range.
  """
  labels = np.full((slate_size,), -1.0, dtype=np.float32)
  for i in cited:
    if not 0 <= int(i) < slate_size:
      raise ValueError(f"cited position {i} is outside the slate of size {slate_size}")
    labels[int(i)] = 1.0
  return labels


def format_memories(memory_texts: Sequence[str]) -> str:
  """Numbers the memories from 0, one per line: `[0] text`. Whitespace runs become one space."""
  return "\n".join(f"[{i}] {' '.join(text.split())}" for i, text in enumerate(memory_texts))


def build_messages(question: str, memory_texts: Sequence[str],
                   system_prompt: str = DEFAULT_SYSTEM_PROMPT,
                   prompt: str = "free_text") -> list[dict[str, str]]:
  """The chat messages asking the model which memories help with `question` (and to cite them).

  Args:
    question: the user's question.
    memory_texts: `s` memory texts, in slate order (memory `i` is shown as `[i]`).
    system_prompt: the system message.
    prompt: a `PROMPTS` name (its instruction ends the user message).

  Returns:
    `[{"role": "system", ...}, {"role": "user", ...}]`.
  """
  user = (f"Memories:\n{format_memories(memory_texts)}\n\n"
          f"Question: {' '.join(question.split())}\n\n{PROMPTS[prompt].instruction}")
  return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]
