"""The LLM critic's prompts and citation formats: building the messages, parsing the replies.

Symbols: `s` slate size (the number of memories shown to the model).

Memories are numbered from 0 (`[0] text`). `PROMPTS` maps a name to an instruction and, for JSON
prompts, the reply's schema (`response_format`); `free_text` asks for a closing citation line
(`[0, 2]` or `[NO_CITE]`, RMM / EAR's format). `parse_reply` reads any of them, never raising.
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


def citation_schema(num_memories: int, with_answer: bool = False) -> dict[str, Any]:
  """The JSON schema of `{"cited": [i, ...]}` (`i < num_memories`), `answer` first if asked."""
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
  """A critic prompt: its instruction, the reply's JSON schema by slate size (None: free text)."""
  instruction: str
  schema: Callable[[int], dict[str, Any]] | None


# No instruction shows concrete memory numbers: small models copy them.
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
    "free_text": CriticPrompt(
        "Answer the question using the memories above where they help. Then, on the last line, "
        "cite the memories you actually used to answer, by their numbers, as a bracketed "
        "comma-separated list, for example [0, 2]. If none of the memories was useful, write "
        "[NO_CITE] on the last line instead. Write nothing after that line.",
        None),
}


# Chosen on pilot slates of LoCoMo's training split by citation F1.
DEFAULT_PROMPT = "judge_each_json"


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
  """The `response_format` asking for JSON that follows `schema` (llama.cpp server's form)."""
  return {"type": "json_object", "schema": schema}

# The last bracketed group of a reply (innermost brackets: no `[` or `]` inside).
_BRACKET_GROUP = re.compile(r"\[([^\[\]]*)\]")
_INDEX = re.compile(r"[0-9]+")
_NO_CITE = "NO_CITE"


def parse_citations(text: str, num_memories: int) -> tuple[int, ...] | None:
  """The sorted indices of a reply's LAST bracketed group, strictly: `[NO_CITE]` (any case) ->
  `()`, or comma-separated decimal integers `< num_memories` (`[0, 2]`, `[ 2 ]`; duplicates
  collapsed); anything else (`[]`, `[-1]`, `[1.5]`, `[0 2]`, `[0, 2,]`, out of range) -> None.

  Raises:
    ValueError: if `num_memories` is negative (never for any `text`).
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
  return None if any(i >= num_memories for i in indices) else tuple(sorted(indices))


def parse_json_citations(text: str, num_memories: int) -> tuple[int, ...] | None | bool:
  """The sorted cited indices of a JSON reply, from its first `{` to its last `}`, strictly:
  `cited`, integers in `[0, num_memories)` (duplicates collapsed), or else `useful`, exactly
  `num_memories` booleans. None: a JSON object without a valid one; False: no JSON object.
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
  """The cited indices of a reply: its JSON object if it holds one, else its citation line."""
  if num_memories < 0:
    raise ValueError(f"num_memories must be >= 0, got {num_memories}")
  cited = parse_json_citations(text, num_memories)
  return parse_citations(text, num_memories) if cited is False else cited


def format_citations(cited: Sequence[int]) -> str:
  """The citation line for `cited`: `[0, 2]`, or `[NO_CITE]` when empty (inverse of the parser)."""
  cited = sorted({int(i) for i in cited})
  return "[" + ", ".join(map(str, cited)) + "]" if cited else f"[{_NO_CITE}]"


def labels_from_citations(cited: Sequence[int], slate_size: int) -> np.ndarray:
  """`[s]` float32 labels: +1 at cited slate positions, -1 elsewhere (ValueError: out of range)."""
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
  """The chat messages asking which of the `s` `memory_texts` help with `question` (`prompt`: a
  `PROMPTS` name)."""
  user = (f"Memories:\n{format_memories(memory_texts)}\n\n"
          f"Question: {' '.join(question.split())}\n\n{PROMPTS[prompt].instruction}")
  return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]
