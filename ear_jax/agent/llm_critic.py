"""LLM critic: ±1 labels for a slate from a real LLM's citations (the critic of Alg. 1 line 15).

The simulated critic of Appendix A.2 stands in for this one in the experiments; this module asks a real
model. It talks to any OpenAI-compatible chat-completions endpoint (vLLM, llama.cpp server, Ollama,
a hosted API) with the standard library only, asks the model to answer the question from the numbered
memories of the slate and to cite the ones it used, and turns the citations into labels.

Symbols: `s` slate size (the number of memories shown to the model).

Citation format (RMM / EAR): the memories are numbered from 0 as `[0] text`, `[1] text`, ... and the
reply ends with a line holding the cited indices as a bracketed list, `[0, 2]`, or `[NO_CITE]` when no
memory was useful. `parse_citations` reads that line strictly, see its docstring.

Failure policy: `LLMCritic.critique` never raises into the agent loop once the client is built (only
programmer errors raise `ValueError`: an empty memory list, an empty question, a bad config). HTTP 429,
HTTP 5xx, timeouts and connection errors are retried with exponential backoff and jitter up to
`max_retries` times; other HTTP errors (400, 401, 403, 404, ...) are not retried. A reply whose
citations cannot be parsed is not retried either. Whenever no labels come out (`labels is None`) the
caller must apply no update for that slate; every such outcome is counted in `LLMCritic.stats` and
logged as a warning.

This is host-side code (network I/O): it is not jitted and keeps a small mutable counter dict.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import os
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from absl import logging
import numpy as np

# Outcome of one `critique` call.
STATUSES = ("ok", "unparseable", "http_error", "timeout", "connection_error")

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
_MAX_ERROR_BODY_CHARS = 500
_READ_CHUNK_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class LLMCriticConfig:
  """Configuration of an `LLMCritic` (host-side; never a jit argument).

  Attributes:
    base_url: the endpoint's base URL, e.g. `http://localhost:8000/v1` (requests go to
      `{base_url}/chat/completions`); a URL already ending in `/chat/completions` is used as is.
    model: the model name sent in the request body.
    api_key_env: NAME of the environment variable holding the API key, read at every request. A
      missing or empty variable sends no `Authorization` header (fine for local servers).
    temperature: sampling temperature (0.0 = greedy, the most reproducible).
    max_tokens: the reply's token budget (answer plus the citation line).
    timeout_s: seconds allowed for connecting, for each socket read, and for reading the whole reply.
    max_retries: retries after the first attempt for HTTP 429/5xx, timeouts and connection errors;
      a call makes at most `1 + max_retries` requests.
    backoff_base_s: the delay before retry `i` (0-based) is drawn uniformly from
      `[c / 2, c]` with `c = min(backoff_max_s, backoff_base_s * 2**i)` (exponential, equal jitter).
    backoff_max_s: cap of the exponential delay.
    system_prompt: the system message.
  """
  base_url: str
  model: str
  api_key_env: str = "OPENAI_API_KEY"
  temperature: float = 0.0
  max_tokens: int = 512
  timeout_s: float = 60.0
  max_retries: int = 3
  backoff_base_s: float = 1.0
  backoff_max_s: float = 30.0
  system_prompt: str = DEFAULT_SYSTEM_PROMPT

  def __post_init__(self):
    _chat_completions_url(self.base_url)  # raises ValueError on a malformed base URL
    if not isinstance(self.model, str) or not self.model.strip():
      raise ValueError(f"LLMCriticConfig.model must be a non-empty string, got {self.model!r}")
    if not isinstance(self.api_key_env, str) or not self.api_key_env:
      raise ValueError(
          f"LLMCriticConfig.api_key_env must be an environment variable name, got {self.api_key_env!r}")
    if not self.timeout_s > 0:
      raise ValueError(f"LLMCriticConfig.timeout_s must be > 0, got {self.timeout_s!r}")
    if int(self.max_retries) != self.max_retries or self.max_retries < 0:
      raise ValueError(f"LLMCriticConfig.max_retries must be an integer >= 0, got {self.max_retries!r}")
    if int(self.max_tokens) != self.max_tokens or self.max_tokens < 1:
      raise ValueError(f"LLMCriticConfig.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
    if not (self.backoff_base_s >= 0 and self.backoff_max_s >= 0):
      raise ValueError(
          "LLMCriticConfig.backoff_base_s and backoff_max_s must be >= 0, got "
          f"{self.backoff_base_s!r} and {self.backoff_max_s!r}")
    if not self.temperature >= 0:
      raise ValueError(f"LLMCriticConfig.temperature must be >= 0, got {self.temperature!r}")


class CriticResult(NamedTuple):
  """Outcome of one `LLMCritic.critique` call.

  Attributes:
    labels: `[s]` float32 of ±1 (+1 = cited), or None when the call produced no usable citations;
      None means: apply no update for this slate.
    cited: sorted 0-based indices of the cited memories (`()` for `[NO_CITE]`), or None.
    raw_text: the model's reply text ('' when no reply arrived).
    status: one of `STATUSES`: 'ok', 'unparseable', 'http_error', 'timeout', 'connection_error'.
    attempts: HTTP requests made (1 + retries).
    error: a short description of the failure, None when `status == 'ok'`.
  """
  labels: np.ndarray | None
  cited: tuple[int, ...] | None
  raw_text: str
  status: str
  attempts: int
  error: str | None


def parse_citations(text: str, num_memories: int) -> tuple[int, ...] | None:
  """Parses the citations of a reply, strictly.

  The citation list is the LAST bracketed group of the reply (inline markers such as `... Paris [0].`
  earlier in the answer are ignored). It is accepted only if it is exactly one of:
  `[NO_CITE]` (any case, surrounding spaces allowed) -> `()`; or one or more non-negative decimal
  integers separated by commas, spaces around them allowed (`[0, 2]`, `[0,2]`, `[ 2 ]`), every one
  `< num_memories`. Duplicates (`[1, 1]`) are collapsed: they name the same memory, so no information
  is lost. Anything else gives None: no bracketed group, an empty list `[]`, an index out of range, a
  negative or non-integer entry (`[-1]`, `[1.5]`, `[a]`, `[+1]`), `NO_CITE` mixed with indices, a
  missing or trailing comma (`[0 2]`, `[0, 2,]`), or a last group that is not a citation list at all.

  Args:
    text: the model's reply.
    num_memories: `s`, the number of memories shown to the model.

  Returns:
    The sorted, de-duplicated cited indices (`()` for `[NO_CITE]`), or None when the reply has no valid
    citation list.

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
  if body.upper() == _NO_CITE:
    return ()
  items = [item.strip() for item in body.split(",")]
  if not all(_INDEX.fullmatch(item) for item in items):
    return None
  indices = {int(item) for item in items}
  if any(i >= num_memories for i in indices):
    return None
  return tuple(sorted(indices))


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


def _chat_completions_url(base_url: str) -> str:
  """`{base_url}/chat/completions`; ValueError naming the problem for a malformed base URL."""
  if not isinstance(base_url, str) or not base_url.strip():
    raise ValueError(f"base_url must be a non-empty URL string, got {base_url!r}")
  try:
    parts = urllib.parse.urlsplit(base_url.strip())
    _ = parts.port  # raises ValueError on a non-numeric port
  except ValueError as e:
    raise ValueError(f"base_url {base_url!r} is not a valid URL: {e}") from None
  if parts.scheme not in ("http", "https"):
    raise ValueError(f"base_url {base_url!r} must start with http:// or https://")
  if not parts.hostname:
    raise ValueError(f"base_url {base_url!r} has no host")
  if parts.query or parts.fragment:
    raise ValueError(f"base_url {base_url!r} must not have a query string or fragment")
  path = parts.path.rstrip("/")
  if not path.endswith("/chat/completions"):
    path += "/chat/completions"
  return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class _Failure(Exception):
  """One failed attempt: `status` in STATUSES, and whether it may be retried."""

  def __init__(self, status: str, message: str, retryable: bool, retry_after_s: float | None = None):
    super().__init__(message)
    self.status = status
    self.retryable = retryable
    self.retry_after_s = retry_after_s


def _is_timeout(exc: BaseException) -> bool:
  return isinstance(exc, (TimeoutError, socket.timeout))


def _retry_after_seconds(headers: Any) -> float | None:
  try:
    value = headers.get("Retry-After") if headers is not None else None
    return max(0.0, float(value)) if value is not None else None
  except (TypeError, ValueError):
    return None  # an HTTP-date or garbage: fall back to the exponential delay


def _reply_text(payload: Any) -> str:
  """`choices[0].message.content` of a chat-completions reply; content parts are joined."""
  content = payload["choices"][0]["message"]["content"]
  if content is None:
    return ""
  if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))
  if not isinstance(content, str):
    raise TypeError(f"message content has type {type(content).__name__}")
  return content


class LLMCritic:
  """A citation critic backed by an OpenAI-compatible chat-completions endpoint.

  `critique(question, memory_texts)` returns a `CriticResult` and never raises once the client is
  built, except `ValueError` for programmer errors. `stats` counts the outcomes:
  `calls`, `ok`, `unparseable`, `http_error`, `timeout`, `connection_error`, and `retries` (requests
  repeated after a retryable failure). Safe to share between threads.

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
    self.url = _chat_completions_url(config.base_url)
    self._sleep = sleep
    self._rng = rng if rng is not None else random.Random()
    self._lock = threading.Lock()
    self.stats: dict[str, int] = {
        "calls": 0, "ok": 0, "unparseable": 0, "http_error": 0, "timeout": 0,
        "connection_error": 0, "retries": 0}

  def __repr__(self):
    return f"LLMCritic(url={self.url!r}, model={self.config.model!r})"

  def backoff_delay(self, retry_index: int, retry_after_s: float | None = None) -> float:
    """Seconds to wait before retry `retry_index` (0-based); honours a server's Retry-After, capped."""
    cap = min(self.config.backoff_max_s, self.config.backoff_base_s * 2.0 ** retry_index)
    with self._lock:
      delay = cap * (0.5 + 0.5 * self._rng.random())
    if retry_after_s is not None:
      delay = max(delay, min(retry_after_s, self.config.backoff_max_s))
    return delay

  def critique(self, question: str, memory_texts: Sequence[str]) -> CriticResult:
    """Asks the model to answer `question` from the slate and labels the memories it cited.

    Args:
      question: the user's question (non-empty).
      memory_texts: the `s >= 1` memory texts of the slate, in slate order.

    Returns:
      A `CriticResult`; `labels` is `[s]` float32 ±1 when `status == 'ok'`, else None (apply no update).

    Raises:
      ValueError: if `question` is empty or not a string, or `memory_texts` is empty or holds a
        non-string.
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
    body = json.dumps({
        "model": self.config.model,
        "messages": build_messages(question, memory_texts, self.config.system_prompt),
        "temperature": self.config.temperature,
        "max_tokens": int(self.config.max_tokens),
        "stream": False,
    }).encode("utf-8")

    attempts = 0
    failure: _Failure | None = None
    text = ""
    for retry_index in range(int(self.config.max_retries) + 1):
      if retry_index > 0:
        delay = self.backoff_delay(retry_index - 1, failure.retry_after_s if failure else None)
        self._count("retries")
        logging.info("LLM critic: retry %d/%d in %.3fs after %s: %s", retry_index,
                     self.config.max_retries, delay, failure.status, failure)
        self._sleep(delay)
      attempts += 1
      try:
        text = self._request(body)
        failure = None
        break
      except _Failure as f:
        failure = f
        if not f.retryable:
          break
      except Exception as e:  # pylint: disable=broad-except  # never crash the agent loop
        failure = _Failure("connection_error", f"{type(e).__name__}: {e}", retryable=False)
        break

    if failure is not None:
      return self._give_up(failure.status, str(failure), attempts, raw_text="")

    cited = parse_citations(text, s)
    if cited is None:
      tail = text.strip().splitlines()[-1] if text.strip() else ""
      return self._give_up("unparseable", f"no valid citation list for {s} memories; last line: "
                           f"{tail[:200]!r}", attempts, raw_text=text)
    self._count("calls", "ok")
    return CriticResult(labels=labels_from_citations(cited, s), cited=cited, raw_text=text,
                        status="ok", attempts=attempts, error=None)

  def _count(self, *keys: str):
    with self._lock:
      for key in keys:
        self.stats[key] += 1

  def _give_up(self, status: str, error: str, attempts: int, raw_text: str) -> CriticResult:
    self._count("calls", status)
    logging.warning("LLM critic: %s after %d attempt(s), no update for this slate: %s",
                    status, attempts, error)
    return CriticResult(labels=None, cited=None, raw_text=raw_text, status=status,
                        attempts=attempts, error=error)

  def _request(self, body: bytes) -> str:
    """One POST; returns the reply text or raises `_Failure`."""
    headers = {"Content-Type": "application/json", "Accept": "application/json",
               "User-Agent": "ear_jax-llm-critic"}
    api_key = os.environ.get(self.config.api_key_env, "")
    if api_key:
      headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
    timeout = float(self.config.timeout_s)
    deadline = time.monotonic() + timeout
    try:
      with urllib.request.urlopen(request, timeout=timeout) as response:
        chunks = []
        while True:
          if time.monotonic() > deadline:
            raise TimeoutError(f"reply not complete within {timeout}s")
          chunk = response.read1(_READ_CHUNK_BYTES)  # one recv: the deadline is checked often
          if not chunk:
            break
          chunks.append(chunk)
        raw = b"".join(chunks)
    except urllib.error.HTTPError as e:
      try:
        detail = e.read(_MAX_ERROR_BODY_CHARS).decode("utf-8", "replace")
      except Exception:  # pylint: disable=broad-except
        detail = ""
      finally:
        e.close()
      retryable = e.code == 429 or 500 <= e.code <= 599
      raise _Failure("http_error", f"HTTP {e.code} {e.reason}: {detail.strip()}", retryable,
                     _retry_after_seconds(e.headers)) from None
    except urllib.error.URLError as e:
      if _is_timeout(e.reason):
        raise _Failure("timeout", f"timed out after {timeout}s: {e.reason}", True) from None
      raise _Failure("connection_error", f"{e.reason}", True) from None
    except (TimeoutError, socket.timeout) as e:
      raise _Failure("timeout", f"timed out after {timeout}s: {e}", True) from None
    except (http.client.HTTPException, ConnectionError, OSError) as e:
      raise _Failure("connection_error", f"{type(e).__name__}: {e}", True) from None

    try:
      return _reply_text(json.loads(raw.decode("utf-8")))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
      raise _Failure("unparseable", f"not a chat-completions reply ({type(e).__name__}: {e}): "
                     f"{raw[:200]!r}", retryable=False) from None
