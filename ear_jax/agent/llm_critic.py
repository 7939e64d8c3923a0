"""LLM critic: ±1 labels for a slate from a real LLM's citations (the critic of Alg. 1 line 15).

The simulated critic of Appendix A.2 stands in for this one in the experiments; this module asks a real
model. It talks to any OpenAI-compatible chat-completions endpoint (vLLM, llama.cpp server, Ollama,
a hosted API) through `llm_client.ChatClient` (standard library only; no redirects, and the API key is
never written anywhere: see that module's Guarantees), asks the model to answer the question from the
numbered memories of the slate and to cite the ones it used, and turns the citations into labels.
`critic(key, view)` is the library's critic protocol; `critic.critique(question, texts)` the lower level.

Symbols: `s` slate size (the number of memories shown to the model).

Citation format (RMM / EAR): the memories are numbered from 0 as `[0] text`, `[1] text`, ... and the
reply ends with a line holding the cited indices as a bracketed list, `[0, 2]`, or `[NO_CITE]` when no
memory was useful. `parse_citations` reads that line strictly, see its docstring.

Failure policy: `LLMCritic.critique` never raises into the agent loop once the client is built (only
programmer errors raise `ValueError`: an empty memory list, an empty question, a bad config, an API key
holding a line break). HTTP 429, HTTP 5xx, timeouts, connection errors and replies cut short are retried
with exponential backoff and jitter up to `max_retries` times; other HTTP errors (3xx, 400, 401, 403,
404, ...) are not retried. A reply that is not a chat completion, or whose citations cannot be parsed,
is not retried either. Whenever no labels come out (`labels is None`) the caller must apply no update
for that slate; every such outcome is counted in `LLMCritic.stats` and logged as a warning.

This is host-side code (network I/O): it is not jitted and keeps a small counter dict, updated under a
lock (one critic may be shared by several threads).
"""
from __future__ import annotations

import dataclasses
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from absl import logging
import numpy as np

from ear_jax.agent.llm_client import STATS_KEYS, STATUSES, ChatClient, ChatClientConfig

__all__ = ["STATUSES", "DEFAULT_SYSTEM_PROMPT", "LLMCriticConfig", "CriticResult", "LLMCritic",
           "parse_citations", "format_citations", "labels_from_citations", "format_memories",
           "build_messages"]

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

# The last bracketed group of a reply (innermost brackets: no `[` or `]` inside).
_BRACKET_GROUP = re.compile(r"\[([^\[\]]*)\]")
_INDEX = re.compile(r"[0-9]+")
_NO_CITE = "NO_CITE"


@dataclasses.dataclass(frozen=True)
class LLMCriticConfig(ChatClientConfig):
  """Configuration of an `LLMCritic` (host-side; never a jit argument).

  Every field of `llm_client.ChatClientConfig` (base_url, model, api_key_env, temperature, max_tokens,
  timeout_s, max_retries, backoff_base_s, backoff_max_s, seed, max_response_bytes; all validated at
  construction: a non-finite or out-of-range value is a `ValueError` naming the field), plus:

  Attributes:
    system_prompt: the system message.
  """
  system_prompt: str = DEFAULT_SYSTEM_PROMPT

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.system_prompt, str):
      raise ValueError(f"LLMCriticConfig.system_prompt must be a string, got {self.system_prompt!r}")


class CriticResult(NamedTuple):
  """Outcome of one `LLMCritic.critique` call.

  Attributes:
    labels: `[s]` float32 of ±1 (+1 = cited), or None when the call produced no usable citations;
      None means: apply no update for this slate.
    cited: sorted 0-based indices of the cited memories (`()` for `[NO_CITE]`), or None.
    raw_text: the model's reply text ('' when no reply arrived).
    status: one of `STATUSES`: 'ok', 'unparseable', 'http_error', 'timeout', 'connection_error'.
    attempts: HTTP requests made (1 + retries).
    error: a short description of the failure (never holding the API key), None when `status == 'ok'`.
  """
  labels: np.ndarray | None
  cited: tuple[int, ...] | None
  raw_text: str
  status: str
  attempts: int
  error: str | None


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
                   system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> list[dict[str, str]]:
  """The chat messages asking the model to answer `question` from the memories and cite them.

  Args:
    question: the user's question.
    memory_texts: `s` memory texts, in slate order (memory `i` is shown as `[i]`).
    system_prompt: the system message.

  Returns:
    `[{"role": "system", ...}, {"role": "user", ...}]`.
  """
  user = (f"Memories:\n{format_memories(memory_texts)}\n\n"
          f"Question: {' '.join(question.split())}\n\n{_INSTRUCTION}")
  return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]


def _view_attr(view: Any, name: str) -> Any:
  value = getattr(view, name, None)
  if value is None:
    raise TypeError(f"the LLM critic needs a view with {name!r} set (a host SlateView), got "
                    f"{type(view).__name__} without it")
  return value


class LLMCritic:
  """A citation critic backed by an OpenAI-compatible chat-completions endpoint.

  `critic(key, view)` is the library's critic protocol (labels or None); `critique(question,
  memory_texts)` returns a `CriticResult`. Neither raises once the critic is built, except
  `ValueError` for programmer errors. `stats` counts the outcomes: `calls`, `ok`, `unparseable`,
  `http_error`, `timeout`, `connection_error`, and `retries` (requests repeated after a retryable
  failure). Safe to share between threads.

  Args:
    config: the endpoint and retry settings.
    sleep: called with the backoff delay in seconds (inject a no-op or a recorder in tests).
    rng: source of the backoff jitter (`random.Random`; a fixed seed makes delays reproducible).
  """

  def __init__(self, config: LLMCriticConfig, *, sleep: Callable[[float], None] = time.sleep,
               rng: random.Random | None = None):
    if not isinstance(config, LLMCriticConfig):
      raise ValueError(f"config must be an LLMCriticConfig, got {type(config).__name__}")
    self.config = config
    self.client = ChatClient(config, sleep=sleep, rng=rng)
    self.url = self.client.url
    self._lock = threading.Lock()
    self.stats: dict[str, int] = {key: 0 for key in STATS_KEYS}

  def __repr__(self):
    return f"LLMCritic(url={self.url!r}, model={self.config.model!r})"

  def backoff_delay(self, retry_index: int, retry_after_s: float | None = None) -> float:
    """Seconds to wait before retry `retry_index` (0-based); honours a server's Retry-After, capped."""
    return self.client.backoff_delay(retry_index, retry_after_s)

  def __call__(self, key: Any, view: Any) -> np.ndarray | None:
    """The critic protocol: labels for a slate view, or None when the reply is unusable.

    Args:
      key: ignored (an LLM at temperature 0 is deterministic enough; kept for the protocol).
      view: a `SlateView`-like object: `query_text` (str), `texts` (the memory texts of the slate's
        non-empty positions, in slate order; texts for all `s` positions are accepted too, those at
        empty positions are then ignored) and `slate_mask` (`[s]` bool, True = non-empty).

    Returns:
      `[s]` float32: +1 at cited positions, -1 at the other positions and at empty ones; None when
      the reply is unusable or the slate is empty (apply no update).

    Raises:
      TypeError: if `view` lacks one of the attributes (or it is None).
      ValueError: if `slate_mask` is not 1-D, or `texts` has neither one text per True position
        nor one per position.
    """
    del key
    query = _view_attr(view, "query_text")
    texts = list(_view_attr(view, "texts"))
    mask = np.asarray(_view_attr(view, "slate_mask")).astype(bool)
    if mask.ndim != 1:
      raise ValueError(f"view.slate_mask must be 1-D [s], got shape {mask.shape}")
    positions = np.flatnonzero(mask)
    if len(texts) == len(mask) != len(positions):
      texts = [texts[p] for p in positions]
    if len(texts) != len(positions):
      raise ValueError(f"view.texts has {len(texts)} texts for {len(positions)} non-empty slate "
                       f"positions (of {len(mask)})")
    if not texts:
      return None
    result = self.critique(query, texts)
    if result.labels is None:
      return None
    labels = np.full(mask.shape, -1.0, dtype=np.float32)
    labels[positions] = result.labels
    return labels

  def critique(self, question: str, memory_texts: Sequence[str]) -> CriticResult:
    """Asks the model to answer `question` from the slate and labels the memories it cited.

    Args:
      question: the user's question (non-empty).
      memory_texts: the `s >= 1` memory texts of the slate, in slate order.

    Returns:
      A `CriticResult`; `labels` is `[s]` float32 ±1 when `status == 'ok'`, else None (apply no update).

    Raises:
      ValueError: if `question` is empty or not a string, `memory_texts` is empty or holds a
        non-string, or the API key's environment variable holds a line break or control character.
    """
    if not isinstance(question, str) or not question.strip():
      raise ValueError(f"question must be a non-empty string, got {question!r}")
    if isinstance(memory_texts, str):
      raise ValueError("memory_texts must be a sequence of strings, not a single string")
    memory_texts = list(memory_texts)
    if not memory_texts:
      raise ValueError("memory_texts is empty: the critic needs at least one memory to judge")
    for i, text in enumerate(memory_texts):
      if not isinstance(text, str):
        raise ValueError(f"memory_texts[{i}] must be a string, got {type(text).__name__}")

    s = len(memory_texts)
    reply = self.client.complete(build_messages(question, memory_texts, self.config.system_prompt))
    if reply.attempts > 1:
      self._count("retries", n=reply.attempts - 1)
    if reply.status != "ok":
      return self._give_up(reply.status, reply.error or "", reply.attempts, raw_text="")
    text = reply.text
    cited = parse_citations(text, s)
    if cited is None:
      tail = text.strip().splitlines()[-1] if text.strip() else ""
      return self._give_up("unparseable", f"no valid citation list for {s} memories; last line: "
                           f"{self.client.redact(tail, 200)!r}", reply.attempts, raw_text=text)
    self._count("calls", "ok")
    return CriticResult(labels=labels_from_citations(cited, s), cited=cited, raw_text=text,
                        status="ok", attempts=reply.attempts, error=None)

  def _count(self, *keys: str, n: int = 1):
    with self._lock:
      for key in keys:
        self.stats[key] += n

  def _give_up(self, status: str, error: str, attempts: int, raw_text: str) -> CriticResult:
    self._count("calls", status)
    logging.warning("LLM critic: %s after %d attempt(s), no update for this slate: %s",
                    status, attempts, error)
    return CriticResult(labels=None, cited=None, raw_text=raw_text, status=status,
                        attempts=attempts, error=error)
