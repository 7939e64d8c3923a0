"""Tests of ear_jax/agent/llm_client.py against a real chat-completions HTTP server on 127.0.0.1.

The loopback server here (`ChatServer`, `Reply`, the `server` fixture) is shared with
tests/test_llm_critic.py and tests/test_hostile_llm.py.
"""
from __future__ import annotations

import dataclasses
import http.server
import json
import random
import sys
import threading

import pytest

from ear_jax.agent import llm_client
from ear_jax.agent.llm_client import (ChatClient, ChatClientConfig, ChatError, ChatResult,
                                      chat_completions_url)

KEY_ENV = "EAR_JAX_TEST_LLM_KEY"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]


@dataclasses.dataclass
class Reply:
  """One scripted server reply."""
  status: int = 200
  content: str | None = "Paris.\n[0]"
  raw_body: bytes | None = None  # sent as is instead of a chat-completions JSON body
  delay_s: float = 0.0  # before the status line
  trickle_s: float = 0.0  # between body bytes
  headers: dict[str, str] = dataclasses.field(default_factory=dict)
  usage: dict | None = None  # the reply's `usage` object
  truncate_to: int | None = None  # send only this many body bytes (full Content-Length), then close
  echo_headers: bool = False  # the body is the request's headers, as JSON
  raw_response: bytes | None = None  # written to the socket instead of an HTTP response, then close


class ChatServer(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def __init__(self):
    super().__init__(("127.0.0.1", 0), _ChatHandler)
    self.script: list[Reply] = [Reply()]
    self.requests: list[dict] = []
    self.stop = threading.Event()
    self.lock = threading.Lock()

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.server_address[1]}/v1"

  def next_reply(self) -> Reply:
    with self.lock:
      return self.script.pop(0) if len(self.script) > 1 else self.script[0]

  def handle_error(self, request, client_address):
    pass  # the client hung up on a slow reply: expected, keep the test output clean


class _ChatHandler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"

  def log_message(self, *args):
    pass

  def do_GET(self):  # pylint: disable=invalid-name  # only a followed redirect would send one
    self._reply()

  def do_POST(self):  # pylint: disable=invalid-name
    self._reply()

  def _reply(self):
    length = int(self.headers.get("Content-Length", "0"))
    raw = self.rfile.read(length) if length else b""
    server: ChatServer = self.server
    with server.lock:
      server.requests.append({"method": self.command, "path": self.path,
                              "headers": dict(self.headers.items()),
                              "json": json.loads(raw) if raw else None})
    reply = server.next_reply()
    if reply.delay_s and server.stop.wait(reply.delay_s):
      return
    if reply.raw_response is not None:
      self.wfile.write(reply.raw_response)
      self.close_connection = True
      return
    if reply.echo_headers:
      body = json.dumps({"error": {"message": "echo", "headers": dict(self.headers.items())}}).encode()
    elif reply.raw_body is not None:
      body = reply.raw_body
    elif reply.status == 200:
      payload = {"id": "x", "object": "chat.completion", "choices": [
          {"index": 0, "message": {"role": "assistant", "content": reply.content},
           "finish_reason": "stop"}]}
      if reply.usage is not None:
        payload["usage"] = reply.usage
      body = json.dumps(payload).encode()
    else:
      body = json.dumps({"error": {"message": f"scripted {reply.status}"}}).encode()
    self.send_response(reply.status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(body)))
    for k, v in reply.headers.items():
      self.send_header(k, v)
    self.end_headers()
    if reply.truncate_to is not None:
      self.wfile.write(body[:reply.truncate_to])
      self.wfile.flush()
      self.close_connection = True
    elif reply.trickle_s:
      for i in range(len(body)):
        if server.stop.wait(reply.trickle_s):
          return
        self.wfile.write(body[i:i + 1])
        self.wfile.flush()
    else:
      self.wfile.write(body)


def _clear_proxies(monkeypatch):
  for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("NO_PROXY", "127.0.0.1")


def start_server() -> tuple[ChatServer, threading.Thread]:
  srv = ChatServer()
  thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
  thread.start()
  return srv, thread


def stop_server(srv: ChatServer, thread: threading.Thread):
  srv.stop.set()
  srv.shutdown()
  srv.server_close()
  thread.join(timeout=5)


@pytest.fixture
def server(monkeypatch):
  _clear_proxies(monkeypatch)
  srv, thread = start_server()
  yield srv
  stop_server(srv, thread)


@pytest.fixture
def second_server(monkeypatch):
  _clear_proxies(monkeypatch)
  srv, thread = start_server()
  yield srv
  stop_server(srv, thread)


class RecordingSleep:

  def __init__(self):
    self.delays: list[float] = []

  def __call__(self, seconds: float):
    self.delays.append(seconds)


def make_client(server, sleep=None, **overrides) -> ChatClient:
  kwargs = dict(base_url=server.url, model="test-model", api_key_env=KEY_ENV, timeout_s=0.3,
                max_retries=2, backoff_base_s=0.0, backoff_max_s=0.0)
  kwargs.update(overrides)
  return ChatClient(ChatClientConfig(**kwargs), sleep=sleep or RecordingSleep(),
                    rng=random.Random(0))


# ---------------------------------------------------------------------------------------------------


def test_chat_returns_text_and_numeric_usage(server):
  server.script = [Reply(content="Hello.", usage={"prompt_tokens": 7, "completion_tokens": 2,
                                                  "note": "x", "flag": True})]
  client = make_client(server)
  text, usage = client.chat(MESSAGES)
  assert text == "Hello."
  assert usage == {"prompt_tokens": 7, "completion_tokens": 2}
  assert client.stats == {"calls": 1, "ok": 1, "unparseable": 0, "http_error": 0, "timeout": 0,
                          "connection_error": 0, "retries": 0}


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
  make_client(server).chat(MESSAGES)
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
  assert set(llm_client.STATS_KEYS) == set(llm_client.STATUSES) | {"calls", "retries"}
