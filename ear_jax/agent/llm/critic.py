"""LLM critic: ±1 labels for a slate from a real LLM's citations (the critic of Alg. 1 line 15).

Symbols: `s` slate size (the number of memories shown to the model).

A model behind any OpenAI-compatible endpoint (`client.ChatClient`) answers the question from the
slate's numbered memories and cites the ones it used (prompts and parsers: `citations`). Once
built, `LLMCritic` never raises into the agent loop (only programmer errors: `ValueError`): a
failed or unusable reply gives None (no update), counted in `LLMCritic.stats` and logged.
"""
from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from absl import logging
import numpy as np

# pylint: disable-next=unused-import
from ear_jax.agent.llm.citations import (DEFAULT_PROMPT, DEFAULT_SYSTEM_PROMPT, PROMPTS,
                                         build_messages, citation_schema, format_citations,
                                         format_memories, labels_from_citations, parse_citations,
                                         parse_json_citations, parse_reply, response_format)
from ear_jax.agent.llm.client import STATUSES, ChatClient, ChatClientConfig

__all__ = ["STATUSES", "DEFAULT_SYSTEM_PROMPT", "PROMPTS", "LLMCriticConfig", "CriticResult",
           "LLMCritic", "parse_citations", "parse_json_citations", "parse_reply",
           "format_citations", "labels_from_citations", "format_memories", "build_messages",
           "citation_schema", "response_format"]

# The critic's own counters (its client's `client.stats` also has tokens, cache hits, seconds).
CRITIC_STATS_KEYS = ("calls",) + STATUSES + ("retries",)


@dataclasses.dataclass(frozen=True)
class LLMCriticConfig(ChatClientConfig):
  """Configuration of an `LLMCritic`: the fields of `ChatClientConfig`, plus its prompts."""
  system_prompt: str = DEFAULT_SYSTEM_PROMPT
  prompt: str = DEFAULT_PROMPT  # a `PROMPTS` name
  constrained: bool = True  # send the prompt's JSON schema as `response_format`

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.system_prompt, str):
      raise ValueError(f"LLMCriticConfig.system_prompt must be a string, got "
                       f"{self.system_prompt!r}")
    if self.prompt not in PROMPTS:
      raise ValueError(f"LLMCriticConfig.prompt must be one of {sorted(PROMPTS)}, got "
                       f"{self.prompt!r}")
    if not isinstance(self.constrained, bool):
      raise ValueError(f"LLMCriticConfig.constrained must be a bool, got {self.constrained!r}")


class CriticResult(NamedTuple):
  """Outcome of one `LLMCritic.critique` call (the fields after `raw_text` as `ChatResult`'s)."""
  labels: np.ndarray | None  # [s] float32 ±1 (+1 = cited); None: no usable citations, no update
  cited: tuple[int, ...] | None  # sorted 0-based cited indices (() for [NO_CITE]), or None
  raw_text: str  # the model's reply ('' when none arrived)
  status: str
  attempts: int
  error: str | None
  cached: bool = False
  constrained: bool = False


def _view_attr(view: Any, name: str) -> Any:
  value = getattr(view, name, None)
  if value is None:
    raise TypeError(f"the LLM critic needs a view with {name!r} set (a host SlateView), got "
                    f"{type(view).__name__} without it")
  return value


class LLMCritic:
  """A citation critic backed by an OpenAI-compatible chat-completions endpoint: `critic(key, view)`
  (the critic protocol) or `critique(question, memory_texts)`; `stats` counts the outcomes.

  Args:
    config: the critic's settings (its `ChatClientConfig` fields configure `self.client`).
    sleep, rng: passed to the `ChatClient`.
  """

  def __init__(self, config: LLMCriticConfig, *, sleep: Callable[[float], None] = time.sleep,
               rng: random.Random | None = None):
    if not isinstance(config, LLMCriticConfig):
      raise ValueError(f"config must be an LLMCriticConfig, got {type(config).__name__}")
    self.config = config
    self.client = ChatClient(config, sleep=sleep, rng=rng)
    self.url = self.client.url
    self._lock = threading.Lock()
    self.stats: dict[str, int] = {key: 0 for key in CRITIC_STATS_KEYS}

  def __repr__(self):
    return f"LLMCritic(url={self.url!r}, model={self.config.model!r})"

  def __call__(self, key: Any, view: Any) -> np.ndarray | None:
    """The critic protocol (`key` ignored).

    Args:
      view: a host `SlateView`: `query_text`, `texts` (of the non-empty positions, or of all `s`)
        and `slate_mask` (`[s]` bool, True = non-empty).

    Returns:
      `[s]` float32: +1 at cited positions, -1 elsewhere; None: an unusable reply or empty slate.

    Raises:
      TypeError: `view` lacks one of the attributes; ValueError: `texts` does not fit `slate_mask`.
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
    """Asks the model to answer `question` from the `s >= 1` slate texts and labels those it cited.

    Returns:
      A `CriticResult`; `labels` `[s]` float32 ±1 when `status == 'ok'`, else None (no update).

    Raises:
      ValueError: an empty or non-string question or memory text, or a malformed API key.
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
    prompt = PROMPTS[self.config.prompt]
    decoding = {}
    if self.config.constrained and prompt.schema is not None:
      decoding["response_format"] = response_format(prompt.schema(s))
    reply = self.client.complete(
        build_messages(question, memory_texts, self.config.system_prompt, self.config.prompt),
        **decoding)
    if reply.attempts > 1:
      self._count("retries", n=reply.attempts - 1)
    if reply.status != "ok":
      return self._give_up(reply.status, reply.error or "", reply.attempts, raw_text="")
    text = reply.text
    cited = parse_reply(text, s)
    if cited is None:
      self.client.count("unusable")
      tail = text.strip().splitlines()[-1] if text.strip() else ""
      return self._give_up("unparseable", f"no valid citation list for {s} memories; last line: "
                           f"{self.client.redact(tail, 200)!r}", reply.attempts, raw_text=text,
                           cached=reply.cached)
    self._count("calls", "ok")
    return CriticResult(labels=labels_from_citations(cited, s), cited=cited, raw_text=text,
                        status="ok", attempts=reply.attempts, error=None, cached=reply.cached,
                        constrained=reply.constrained)

  def _count(self, *keys: str, n: int = 1):
    with self._lock:
      for key in keys:
        self.stats[key] += n

  def _give_up(self, status: str, error: str, attempts: int, raw_text: str,
               cached: bool = False) -> CriticResult:
    self._count("calls", status)
    logging.warning("LLM critic: %s after %d attempt(s), no update for this slate: %s",
                    status, attempts, error)
    return CriticResult(labels=None, cited=None, raw_text=raw_text, status=status,
                        attempts=attempts, error=error, cached=cached)
