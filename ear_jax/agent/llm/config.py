"""Configuration of the OpenAI-compatible chat client, checked when built (a bad value is a
`ValueError` then, never an exception out of a request), and the endpoint URL."""
from __future__ import annotations

import dataclasses
import math
import numbers
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

STATUSES = ("ok", "unparseable", "http_error", "timeout", "connection_error")
# Counters of a client: `calls` = the sum of the statuses; `unusable` is counted by the caller;
# tokens and `seconds` count fresh replies only.
STATS_KEYS = (("calls",) + STATUSES + ("retries", "cache_hits", "unusable",
              "response_format_fallbacks", "prompt_tokens", "completion_tokens", "seconds"))
DECODING_KEYS = ("temperature", "max_tokens", "seed", "top_p", "stop", "response_format")

REDACTED = "[REDACTED]"
_MAX_SECONDS = 1e6  # larger delays overflow time.sleep / socket timeouts on some platforms


_RULES = {  # numeric field or decoding parameter -> keyword arguments of `_check_number`
    "timeout_s": dict(minimum=0.0, strict=True, maximum=_MAX_SECONDS),
    "max_retries": dict(minimum=0, strict=False, maximum=1000, integer=True),
    "backoff_base_s": dict(minimum=0.0, strict=False, maximum=_MAX_SECONDS),
    "backoff_max_s": dict(minimum=0.0, strict=False, maximum=_MAX_SECONDS),
    "max_response_bytes": dict(minimum=0, strict=True, integer=True),
    "temperature": dict(minimum=0.0, strict=False),
    "top_p": dict(minimum=0.0, strict=True, maximum=1.0),
    "max_tokens": dict(minimum=0, strict=True, integer=True),
    "seed": dict(minimum=-2.0 ** 63, strict=False, maximum=2.0 ** 63, integer=True),
}


def _check_number(owner: str, name: str, value: Any, *, minimum: float, strict: bool,
                  maximum: float = math.inf, integer: bool = False):
  """ValueError naming `owner.name` unless `value` is a finite number (an integer) in range."""
  ok = (isinstance(value, numbers.Integral if integer else numbers.Real)
        and not isinstance(value, bool))
  if ok:
    x = float(value)
    ok = math.isfinite(x) and (x > minimum if strict else x >= minimum) and x <= maximum
  if not ok:
    bound = f"{'>' if strict else '>='} {minimum:g}"
    bound += f", <= {maximum:g}" if maximum < math.inf else ""
    kind = "an integer" if integer else "a finite number"
    raise ValueError(f"{owner}.{name} must be {kind} {bound}, got {value!r}")


def check_decoding(owner: str, decoding: Mapping[str, Any]):
  """Validates decoding parameters (`DECODING_KEYS`); None means 'not sent'."""
  for name, value in decoding.items():
    if name not in DECODING_KEYS:
      raise ValueError(f"{owner}: unknown decoding parameter {name!r}, not in {DECODING_KEYS}")
    if name in _RULES and value is not None:
      _check_number(owner, name, value, **_RULES[name])
    elif name == "stop" and value is not None and not (isinstance(value, str) or (
        isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value))):
      raise ValueError(f"{owner}.stop must be a string or a list of strings, got {value!r}")
    elif name == "response_format" and value is not None:
      if not (isinstance(value, Mapping) and isinstance(value.get("type"), str)):
        raise ValueError(f"{owner}.response_format must be a dict with a string 'type' (e.g. "
                         f"{{'type': 'json_object', 'schema': {{...}}}}), got {value!r}")


def chat_completions_url(base_url: str) -> str:
  """`{base_url}/chat/completions`; ValueError naming the problem for a malformed base URL."""
  if not isinstance(base_url, str) or not base_url.strip():
    raise ValueError(f"base_url must be a non-empty URL string, got {base_url!r}")
  url = base_url.strip()
  shown = repr(url) if "@" not in url else "(not shown: it holds credentials)"
  try:
    parts = urllib.parse.urlsplit(url)
    _ = parts.port  # raises ValueError on a non-numeric port
  except ValueError as e:
    raise ValueError(f"base_url {shown} is not a valid URL: {e}") from None
  for bad, problem in (
      (any(c.isspace() or not c.isprintable() for c in url), "must not hold spaces or controls"),
      (parts.scheme not in ("http", "https"), "must start with http:// or https://"),
      (not parts.hostname, "has no host"),
      ("@" in parts.netloc, "must not hold credentials: put the key in the api_key_env variable"),
      (parts.query or parts.fragment, "must not have a query string or fragment")):
    if bad:
      raise ValueError(f"base_url {shown} {problem}")
  path = parts.path.rstrip("/")
  if not path.endswith("/chat/completions"):
    path += "/chat/completions"
  return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


@dataclasses.dataclass(frozen=True)
class ChatClientConfig:
  """Configuration of a `ChatClient`. Retry `i` waits in `[c / 2, c]`, `c = min(backoff_max_s,
  backoff_base_s * 2**i)`, or a server's `Retry-After` capped at `backoff_max_s`."""
  base_url: str  # the endpoint's base URL, e.g. `http://localhost:8000/v1`
  model: str  # the model name sent in the request body
  # NAME of the environment variable of the API key, read at every request (unset: no key sent)
  api_key_env: str = "OPENAI_API_KEY"
  temperature: float = 0.0  # sampling temperature (0.0 = greedy); finite, >= 0
  max_tokens: int = 512  # the reply's token budget; integer >= 1
  # seconds for connecting, each socket read, and the whole reply; finite, > 0
  timeout_s: float = 60.0
  max_retries: int = 3  # retries for HTTP 429/5xx, timeouts and connection errors; integer >= 0
  backoff_base_s: float = 1.0  # retry `i`'s delay scale (`base * 2**i`); finite, >= 0
  backoff_max_s: float = 30.0  # cap of that delay and of a `Retry-After`; finite, >= 0
  seed: int | None = 0  # sampling seed sent to servers that support it (None: none)
  max_response_bytes: int = 16 << 20  # a longer reply body is 'unparseable'
  cache_dir: str | None = None  # a folder for the on-disk reply cache (`llm.cache`; None: none)

  def __post_init__(self):
    owner = type(self).__name__
    chat_completions_url(self.base_url)
    if not isinstance(self.model, str) or not self.model.strip():
      raise ValueError(f"{owner}.model must be a non-empty string, got {self.model!r}")
    if not (isinstance(self.api_key_env, str) and re.fullmatch(r"[A-Za-z_]\w*", self.api_key_env)
            and self.api_key_env.isascii()):
      raise ValueError(f"{owner}.api_key_env must be an environment variable name, got "
                       f"{self.api_key_env!r}")
    for name in ("timeout_s", "max_retries", "backoff_base_s", "backoff_max_s",
                 "max_response_bytes"):
      _check_number(owner, name, getattr(self, name), **_RULES[name])
    check_decoding(owner, {k: getattr(self, k) for k in ("temperature", "max_tokens", "seed")})
    if self.cache_dir is not None and not (isinstance(self.cache_dir, str) and self.cache_dir):
      raise ValueError(f"{owner}.cache_dir must be a folder path string or None, got "
                       f"{self.cache_dir!r}")
