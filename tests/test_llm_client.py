"""Tests of ear_jax/agent/llm/client.py against a real chat-completions HTTP server on 127.0.0.1.

The loopback server (`ChatServer`, `Reply`, the `server` fixture) lives in tests/llm_fakes.py.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import threading

import pytest

from ear_jax.agent.llm import client as llm_client
from ear_jax.agent.llm.client import (ChatClient, ChatClientConfig, ChatError, ChatResult,
                                      chat_completions_url)

from tests.llm_fakes import KEY_ENV, MESSAGES, Reply, make_client


# ---------------------------------------------------------------------------------------------------


def test_chat_returns_text_and_numeric_usage(server):
  server.script = [Reply(content="Hello.", usage={"prompt_tokens": 7, "completion_tokens": 2,
                                                  "note": "x", "flag": True})]
  client = make_client(server)
  text, usage = client.chat(MESSAGES)
  assert text == "Hello."
  assert usage == {"prompt_tokens": 7, "completion_tokens": 2}
  seconds = client.stats.pop("seconds")
  assert 0 < seconds < 5
  assert client.stats == {"calls": 1, "ok": 1, "unparseable": 0, "http_error": 0, "timeout": 0,
                          "connection_error": 0, "retries": 0, "cache_hits": 0, "unusable": 0,
                          "response_format_fallbacks": 0, "prompt_tokens": 7,
                          "completion_tokens": 2}


def test_complete_returns_a_chat_result(server):
  server.script = [Reply(content=None)]
  result = make_client(server).complete(MESSAGES)
  assert isinstance(result, ChatResult)
  assert result == ChatResult(text="", usage={}, status="ok", attempts=1, error=None)


def test_content_parts_are_joined(server):
  parts = json.dumps({"choices": [{"message": {"content": [
      {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}}]}).encode()
  server.script = [Reply(raw_body=parts)]
  assert make_client(server).chat(MESSAGES)[0] == "ab"


def test_request_body_holds_model_messages_and_config_decoding(server, monkeypatch):
  monkeypatch.setenv(KEY_ENV, "sk-test-123")
  make_client(server, temperature=0.25, max_tokens=77, seed=5).chat(MESSAGES)
  (request,) = server.requests
  assert request["method"] == "POST" and request["path"] == "/v1/chat/completions"
  assert request["headers"]["Authorization"] == "Bearer sk-test-123"
  body = request["json"]
  assert body == {"model": "test-model", "messages": MESSAGES, "stream": False,
                  "temperature": 0.25, "max_tokens": 77, "seed": 5}


def test_decoding_overrides_replace_the_config_values(server):
  make_client(server).chat(MESSAGES, temperature=0.7, max_tokens=5, seed=3, top_p=0.9, stop=["\n"])
  body = server.requests[0]["json"]
  assert (body["temperature"], body["max_tokens"], body["seed"]) == (0.7, 5, 3)
  assert body["top_p"] == 0.9 and body["stop"] == ["\n"]


def test_seed_none_is_not_sent(server):
  make_client(server, seed=None).chat(MESSAGES)
  assert "seed" not in server.requests[0]["json"] and "top_p" not in server.requests[0]["json"]


@pytest.mark.parametrize("decoding, match", [
    ({"temprature": 0.1}, "unknown decoding parameter"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": "1"}, "seed"),
    ({"stop": 3}, "stop"),
])
def test_bad_decoding_parameters_are_value_errors_before_any_request(server, decoding, match):
  client = make_client(server)
  with pytest.raises(ValueError, match=match):
    client.chat(MESSAGES, **decoding)
  assert server.requests == [] and client.stats["calls"] == 0


@pytest.mark.parametrize("messages", [[], "hi", [{"role": "user"}], [{"content": "x"}], [3]])
def test_malformed_messages_are_value_errors(server, messages):
  with pytest.raises(ValueError, match="messages"):
    make_client(server).chat(messages)
  assert server.requests == []


def test_chat_raises_chat_error_with_the_result(server):
  server.script = [Reply(status=500)]
  client = make_client(server, max_retries=1)
  with pytest.raises(ChatError) as info:
    client.chat(MESSAGES)
  assert info.value.status == "http_error" and info.value.result.attempts == 2
  assert "HTTP 500" in str(info.value)
  assert client.stats["http_error"] == 1 and client.stats["retries"] == 1


def test_complete_never_raises_on_failure(server):
  server.script = [Reply(status=503)]
  result = make_client(server, max_retries=0).complete(MESSAGES)
  assert result.status == "http_error" and result.text == "" and result.attempts == 1


@pytest.mark.parametrize("base_url, url", [
    ("http://localhost:8000/v1", "http://localhost:8000/v1/chat/completions"),
    ("https://api.example.com/v1/chat/completions/", "https://api.example.com/v1/chat/completions"),
])
def test_chat_completions_url(base_url, url):
  assert chat_completions_url(base_url) == url


def test_base_url_with_credentials_is_rejected_without_echoing_them():
  with pytest.raises(ValueError, match="credentials") as info:
    ChatClientConfig(base_url="http://user:hunter2@localhost/v1", model="m")
  assert "hunter2" not in str(info.value)


def test_config_is_frozen_and_the_client_checks_its_type():
  config = ChatClientConfig(base_url="http://localhost:1/v1", model="m")
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.timeout_s = 1.0  # type: ignore[misc]
  with pytest.raises(ValueError, match="ChatClientConfig"):
    ChatClient({"base_url": "http://localhost:1/v1"})  # type: ignore[arg-type]


def test_concurrent_calls_from_threads_are_all_counted(server):
  client = make_client(server, timeout_s=2.0)
  results, errors = [], []

  def worker():
    try:
      for _ in range(5):
        results.append(client.complete(MESSAGES).status)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=worker) for _ in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=20)
  assert not errors and results == ["ok"] * 30
  assert client.stats["calls"] == 30 and client.stats["ok"] == 30


def test_counter_updates_are_atomic_under_contention():
  client = ChatClient(ChatClientConfig(base_url="http://localhost:1/v1", model="m"))
  old = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)
  try:
    threads = [threading.Thread(target=lambda: [client.count("calls", "ok") for _ in range(2000)])
               for _ in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=20)
  finally:
    sys.setswitchinterval(old)
  assert client.stats["calls"] == 8000 and client.stats["ok"] == 8000


def test_statuses_and_stats_keys():
  assert llm_client.STATUSES == ("ok", "unparseable", "http_error", "timeout", "connection_error")
  assert set(llm_client.STATS_KEYS) == set(llm_client.STATUSES) | {
      "calls", "retries", "cache_hits", "unusable", "response_format_fallbacks", "prompt_tokens",
      "completion_tokens", "seconds"}
