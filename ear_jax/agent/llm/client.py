"""A generic client for OpenAI-compatible chat-completions endpoints (standard library only).

`ChatClient.chat(messages, **decoding) -> (text, usage)`; `ChatClient.complete(...)` returns a
`ChatResult` with a status and never raises on a network or server failure. Guarantees:
  * No redirects: an HTTP 3xx is an `http_error`.
  * The API key, read from `api_key_env` at each request, is sent only in its `Authorization`
    header, never stored, and `[REDACTED]` (any escaped or split form) in every error and log
    line; a key holding a control or non-ASCII character is refused before anything is sent.
  * Statuses: 'unparseable' (not retried), 'http_error' (429 and 5xx retried), 'timeout' /
    'connection_error' (retried); at most `1 + max_retries` attempts of about `timeout_s` each.
  * Thread-safe; temperature 0 and seed 0 by default; `cache_dir` caches usable replies on disk.
  * A `response_format` refused with HTTP 400 / 422 is dropped: sent again without it, and never
    afterwards.
"""
from __future__ import annotations

import http.client
import json
import math
import os
import random
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from absl import logging

from ear_jax.agent.llm.cache import ResponseCache, cache_key
from ear_jax.agent.llm.config import (DECODING_KEYS, REDACTED, STATS_KEYS, STATUSES,
                                      ChatClientConfig, chat_completions_url, check_decoding)

__all__ = ["ChatClient", "ChatClientConfig", "ChatError", "ChatResult", "DECODING_KEYS",
           "STATS_KEYS", "STATUSES", "scrub"]

_MAX_ERROR_BODY_BYTES = 4096  # of an HTTP error's body, read to quote it
_MAX_MESSAGE_CHARS = 600  # of an error message
_READ_CHUNK_BYTES = 1 << 16
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class ChatResult(NamedTuple):
  """Outcome of one `ChatClient.complete` call."""
  text: str  # the reply's `choices[0].message.content` ('' when none)
  usage: dict[str, Any]  # the reply's numeric `usage` counters ({} when absent)
  status: str  # one of `STATUSES`
  attempts: int  # HTTP requests made (1 + retries; 0 for a reply from the cache)
  error: str | None  # a short, key-free description of the failure; None when 'ok'
  cached: bool = False  # the reply came from the on-disk cache
  constrained: bool = False  # the reply was decoded under a `response_format`


class ChatError(RuntimeError):
  """Raised by `ChatClient.chat` when no usable reply arrived; `result` is the `ChatResult`."""

  def __init__(self, result: ChatResult):
    super().__init__(f"{result.status} after {result.attempts} attempt(s): {result.error}")
    self.result, self.status = result, result.status


class _Failure(Exception):
  """One failed attempt: `status` in STATUSES, and whether it may be retried."""

  def __init__(self, status: str, message: str, retryable: bool, retry_after_s=None,
               code: int | None = None):
    super().__init__(message)
    self.status, self.retryable, self.retry_after_s = status, retryable, retry_after_s
    self.code = code  # the HTTP status of an http_error


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
  """Follows no redirect: the 3xx reply surfaces as an `HTTPError`."""

  def redirect_request(self, *args, **kwargs):
    return None


def _escape(text: str) -> str:
  """`text` with control characters escaped (no log injection from server text)."""
  return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _replace_secrets(text: str, secrets: Sequence[str]) -> str:
  for secret in filter(None, secrets):
    forms = {secret, secret.strip(), repr(secret)[1:-1], json.dumps(secret)[1:-1],
             str(secret.encode("utf-8", "backslashreplace"))[2:-1], _escape(secret)}
    forms.update(part for part in re.split(r"[\r\n]+", secret) if len(part.strip()) >= 4)
    for form in sorted(filter(None, forms), key=len, reverse=True):
      text = text.replace(form, REDACTED)
      for k in range(len(form) - 1, 3, -1):  # a form cut off at the end of the text
        if text.endswith(form[:k]):
          text = text[:-k] + REDACTED
          break
  return text


def scrub(text: str, secrets: Sequence[str], limit: int | None = None) -> str:
  """`text` with every secret (any escaped, split or cut form) `REDACTED`, cut to `limit` chars."""
  text = _replace_secrets(text, secrets)
  if limit is not None and len(text) > limit:
    text = _replace_secrets(text[:limit], secrets) + "..."
  return text


def _message(failure: Exception, secrets: Sequence[str]) -> str:
  """A failure's message for results and logs: key-free, control characters escaped, bounded."""
  return scrub(_escape(scrub(str(failure), secrets)), secrets, _MAX_MESSAGE_CHARS)


def _check_api_key(name: str, key: str):
  """ValueError (naming the variable, never the value) for a key that cannot be a header value."""
  if any(not 0x20 <= ord(c) <= 0x7e for c in key):
    raise ValueError(
        f"the API key in ${name} contains a line break, a control character or a non-ASCII "
        "character; it was not sent (the value is not shown). Fix the environment variable.")


def _retry_after_seconds(headers: Any) -> float | None:
  try:
    seconds = float(headers.get("Retry-After"))
  except (AttributeError, TypeError, ValueError):
    return None  # none, an HTTP-date or garbage: fall back to the exponential delay
  return max(0.0, seconds) if math.isfinite(seconds) else None


def _parse_reply(raw: bytes) -> tuple[str, dict[str, int | float]]:
  """`(choices[0].message.content, usage)` of a chat-completions body; ValueError if malformed."""
  try:
    payload = json.loads(raw.decode("utf-8"))
    content = payload["choices"][0]["message"]["content"]
  except RecursionError:
    raise ValueError("JSON nested too deeply") from None
  except (ValueError, KeyError, IndexError, TypeError) as e:
    raise ValueError(f"{type(e).__name__}: {e}") from None
  if isinstance(content, list) and all(  # content parts: [{"type": "text", "text": ...}, ...]
      isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
    content = "".join(p.get("text", "") for p in content)
  if not isinstance(content, (str, type(None))):
    raise ValueError(f"message content has type {type(content).__name__}")
  usage = payload.get("usage") if isinstance(payload, dict) else None  # keep numeric counters only
  usage = {str(k): v for k, v in usage.items() if isinstance(v, (int, float))
           and not isinstance(v, bool)} if isinstance(usage, dict) else {}
  return content or "", usage


class ChatClient:
  """An OpenAI-compatible chat-completions client with retries (the module's Guarantees).

  Args:
    config: the endpoint, decoding defaults and retry settings.
    sleep, rng: called with each backoff delay in seconds; the jitter's `random.Random`.
  """

  def __init__(self, config: ChatClientConfig, *, sleep: Callable[[float], None] = time.sleep,
               rng: random.Random | None = None):
    if not isinstance(config, ChatClientConfig):
      raise ValueError(f"config must be a ChatClientConfig, got {type(config).__name__}")
    self.config = config
    self.url = chat_completions_url(config.base_url)
    self._sleep = sleep
    self._rng = rng if rng is not None else random.Random()
    self._lock = threading.Lock()
    self.stats: dict[str, float] = {key: 0 for key in STATS_KEYS}
    self.cache = ResponseCache(config.cache_dir) if config.cache_dir is not None else None
    self.response_format_supported = True

  def __repr__(self):
    return f"ChatClient(url={self.url!r}, model={self.config.model!r})"

  def count(self, *keys: str, n: float = 1):
    """Adds `n` to each `stats[key]`, atomically (thread-safe)."""
    with self._lock:
      for key in keys:
        self.stats[key] = self.stats.get(key, 0) + n

  def redact(self, text: str, limit: int | None = None) -> str:
    """`scrub(text, [current API key], limit)`: for reply text a caller puts in a message."""
    return scrub(text, [os.environ.get(self.config.api_key_env, "")], limit)

  def backoff_delay(self, retry_index: int, retry_after_s: float | None = None) -> float:
    """Seconds to wait before retry `retry_index` (0-based); honours Retry-After, capped."""
    growth = 2.0 ** min(int(retry_index), 1000)  # no OverflowError for huge retry counts
    cap = min(self.config.backoff_max_s, self.config.backoff_base_s * growth)
    with self._lock:
      delay = cap * (0.5 + 0.5 * self._rng.random())
    if retry_after_s is not None:
      delay = max(delay, min(retry_after_s, self.config.backoff_max_s))
    return delay

  def request_body(self, messages: Sequence[Mapping[str, Any]], **decoding: Any) -> dict[str, Any]:
    """The request body as a dict; `decoding` (`DECODING_KEYS`) overrides the config's values."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
      raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
      if (not isinstance(m, Mapping) or not isinstance(m.get("role"), str)
          or not isinstance(m.get("content"), (str, list))):
        raise ValueError(f"messages[{i}] must be a dict with a string 'role' and a 'content'")
    check_decoding("decoding", decoding)
    params = {k: getattr(self.config, k) for k in ("temperature", "max_tokens", "seed")} | decoding
    body = {"model": self.config.model, "messages": [dict(m) for m in messages], "stream": False}
    body.update({k: int(v) if k in ("max_tokens", "seed") else v
                 for k, v in params.items() if v is not None})
    if "response_format" in body:
      body["response_format"] = dict(body["response_format"])
    self._encode(body)
    return body

  @staticmethod
  def _encode(body: dict[str, Any]) -> bytes:
    try:
      return json.dumps(body, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
      raise ValueError(f"request body is not JSON-serializable: {e}") from None

  def chat(self, messages: Sequence[Mapping[str, Any]],
           **decoding: Any) -> tuple[str, dict[str, Any]]:
    """One chat completion: `(reply text, usage)`.

    Raises:
      ChatError: when no usable reply arrived after the retries (`.status`, `.result`).
      ValueError: for malformed messages, a bad decoding parameter or a malformed API key.
    """
    result = self.complete(messages, **decoding)
    if result.status != "ok":
      raise ChatError(result)
    return result.text, result.usage

  def complete(self, messages: Sequence[Mapping[str, Any]], **decoding: Any) -> ChatResult:
    """One chat completion with retries (or from the cache); never raises on a network or server
    failure (a refused `response_format` is dropped: `stats['response_format_fallbacks']`).

    Raises:
      ValueError: for malformed messages or decoding, or a malformed API key (nothing sent).
    """
    body = self.request_body(messages, **decoding)
    if "response_format" in body and not self.response_format_supported:
      del body["response_format"]
    result, code = self._complete_body(body)
    if result.status == "http_error" and code in (400, 422) and "response_format" in body:
      logging.warning("LLM chat: the endpoint rejected response_format (%s); repeating without "
                      "it, and sending none from now on", result.error)
      self.response_format_supported = False
      self.count("response_format_fallbacks")
      del body["response_format"]
      retry, _ = self._complete_body(body)
      result = retry._replace(attempts=retry.attempts + result.attempts)
    self.count("calls", result.status)
    if result.cached:
      self.count("cache_hits")
    return result._replace(constrained="response_format" in body and result.status == "ok")

  def _complete_body(self, body: dict[str, Any]) -> tuple[ChatResult, int | None]:
    """`(result, HTTP status of a failed reply or None)`: from the cache, or by requests."""
    key = cache_key(self.url, body) if self.cache is not None else ""
    if self.cache is not None and (hit := self.cache.get(key)) is not None:
      return ChatResult(text=hit[0], usage=hit[1], status="ok", attempts=0, error=None,
                        cached=True), None
    t0 = time.perf_counter()
    raw_body = self._encode(body)
    secrets: list[str] = []
    attempts, raw, failure = 0, b"", None
    for retry_index in range(int(self.config.max_retries) + 1):
      if retry_index > 0:
        delay = self.backoff_delay(retry_index - 1, failure.retry_after_s if failure else None)
        self.count("retries")
        logging.info("LLM chat: retry %d/%d in %.3fs after %s: %s", retry_index,
                     self.config.max_retries, delay, failure.status, _message(failure, secrets))
        self._sleep(delay)
      api_key = os.environ.get(self.config.api_key_env, "")
      if api_key:
        _check_api_key(self.config.api_key_env, api_key)
        secrets.append(api_key)
      attempts += 1
      try:
        raw = self._attempt(raw_body, api_key)
        failure = None
        break
      except _Failure as f:
        failure = f
        if not f.retryable:
          break
      except Exception as e:  # pylint: disable=broad-except  # never crash the caller's loop
        failure = _Failure("connection_error", f"{type(e).__name__}: {e}", retryable=False)
        break

    if failure is None:
      try:
        text, usage = _parse_reply(raw)
      except ValueError as e:
        failure = _Failure("unparseable", f"not a chat-completions reply ({e}): "
                           f"{raw[:_MAX_ERROR_BODY_BYTES].decode('utf-8', 'replace')!r}",
                           retryable=False)
    self.count("seconds", n=time.perf_counter() - t0)
    if failure is not None:
      error = _message(failure, secrets)
      logging.info("LLM chat: %s after %d attempt(s): %s", failure.status, attempts, error)
      return ChatResult(text="", usage={}, status=failure.status, attempts=attempts,
                        error=error), failure.code
    for name in ("prompt_tokens", "completion_tokens"):
      if isinstance(usage.get(name), (int, float)) and math.isfinite(usage[name]):
        self.count(name, n=usage[name])
    if self.cache is not None:
      self.cache.put(key, text, usage, url=self.url, model=self.config.model)
    return ChatResult(text=text, usage=usage, status="ok", attempts=attempts, error=None), None

  def _attempt(self, body: bytes, api_key: str) -> bytes:
    """One POST, no redirects; returns the raw reply body or raises `_Failure`."""
    headers = {"Content-Type": "application/json", "Accept": "application/json",
               "User-Agent": "ear_jax-llm-client"}
    if api_key:
      headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
    opener = urllib.request.build_opener(_RefuseRedirects)
    timeout, limit = float(self.config.timeout_s), int(self.config.max_response_bytes)
    deadline = time.monotonic() + timeout
    try:
      with opener.open(request, timeout=timeout) as response:
        raw = bytearray()
        while chunk := response.read1(_READ_CHUNK_BYTES):  # one recv: the deadline is checked often
          raw += chunk
          if time.monotonic() > deadline:
            raise TimeoutError(f"reply not complete within {timeout}s")
          if len(raw) > limit:
            raise _Failure("unparseable", f"reply body exceeds max_response_bytes={limit}", False)
        expected = response.headers.get("Content-Length")
        if expected is not None and expected.strip().isdigit() and len(raw) < int(expected):
          raise http.client.IncompleteRead(raw, int(expected) - len(raw))  # server closed early
    except urllib.error.HTTPError as e:
      try:
        detail = e.read(_MAX_ERROR_BODY_BYTES).decode("utf-8", "replace")
      except Exception:  # pylint: disable=broad-except
        detail = ""
      finally:
        e.close()
      note = " (redirects are never followed)" if 300 <= e.code <= 399 else ""
      retryable = e.code == 429 or 500 <= e.code <= 599
      raise _Failure("http_error", f"HTTP {e.code} {str(e.reason)[:80]}{note}: {detail.strip()}",
                     retryable, _retry_after_seconds(e.headers), code=e.code) from None
    except urllib.error.URLError as e:
      if isinstance(e.reason, TimeoutError):  # (socket.timeout is TimeoutError)
        raise _Failure("timeout", f"timed out after {timeout}s: {e.reason}", True) from None
      raise _Failure("connection_error", f"{e.reason}", True) from None
    except TimeoutError as e:
      raise _Failure("timeout", f"timed out after {timeout}s: {e}", True) from None
    except (http.client.HTTPException, ConnectionError, OSError) as e:
      raise _Failure("connection_error", f"{type(e).__name__}: {e}", True) from None
    return bytes(raw)
