"""A fake OpenAI-compatible chat-completions server on 127.0.0.1 for the default-tier tests.

Two ways to script it:
  * `server` / `second_server` fixtures: a `ChatServer`; set `server.script = [Reply(...), ...]`
    (replies are used in order, the last one repeats) and read `server.requests`.
  * `fake_llm` fixture: a factory, `srv = fake_llm(respond)`, where `respond(request_json)` returns the
    reply's content (a str) or a `Reply`; a `respond` that raises gives an HTTP 500 naming the error.
    `srv.base_url`, `srv.model` and `srv.requests` (method, path, headers, json) are what a test needs.
Every server started by a fixture is stopped at the end of the test. The fixtures are registered for
every test module through tests/conftest.py.
"""
from __future__ import annotations

import dataclasses
import http.server
import json
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest

from ear_jax.agent.llm.client import ChatClient, ChatClientConfig

# A stand-in for the llama.cpp server process (`python -c FAKE_MODELS_SERVER <port>`): answers
# GET /v1/models (the readiness probe) on 127.0.0.1:<port>, prints one line, serves until killed.
FAKE_MODELS_SERVER = r"""
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
  def log_message(self, *a): pass
  def do_GET(self):
    body = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()
    self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
    self.wfile.write(body)
print("fake server up", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

# FAKE_MODELS_SERVER that first starts two children (`sleep`), one in its own session (out of the
# server's process group), and writes their pids to argv[2]: `python -c FAKE_FORKING_SERVER <port>
# <pid file>` (the llama.cpp server may fork helpers too; stopping it must stop them).
FAKE_FORKING_SERVER = r"""
import os, subprocess, sys
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
kids = [subprocess.Popen(sleep), subprocess.Popen(sleep, start_new_session=True)]
with open(sys.argv[2] + ".tmp", "w") as f:
  f.write(" ".join(str(k.pid) for k in kids))
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
""" + FAKE_MODELS_SERVER

KEY_ENV = "EAR_JAX_TEST_LLM_KEY"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
FAKE_MODEL = "fake-model"


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
    self.respond: Callable[[dict], Any] | None = None  # request json -> str | Reply; else script
    self.requests: list[dict] = []
    self.model = FAKE_MODEL
    self.stop = threading.Event()
    self.lock = threading.Lock()

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.server_address[1]}/v1"

  @property
  def base_url(self) -> str:
    return self.url

  def next_reply(self, request_json: Any = None) -> Reply:
    if self.respond is not None:
      try:
        reply = self.respond(request_json)
      except Exception as e:  # pylint: disable=broad-except  # surfaces as an HTTP 500
        return Reply(status=500, raw_body=json.dumps(
            {"error": {"message": f"respond raised {type(e).__name__}: {e}"}}).encode())
      return reply if isinstance(reply, Reply) else Reply(content=reply)
    with self.lock:
      return self.script.pop(0) if len(self.script) > 1 else self.script[0]

  def handle_error(self, request, client_address):
    pass  # the client hung up on a slow reply: expected, keep the test output clean


class _ChatHandler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"

  def log_message(self, *args):
    pass

  def do_GET(self):  # pylint: disable=invalid-name  # /v1/models, or a followed redirect
    if self.path.rstrip("/").endswith("/models") and self.server.respond is not None:
      body = json.dumps({"object": "list", "data": [{"id": self.server.model}]}).encode()
      self.send_response(200)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)
      return
    self._reply()

  def do_POST(self):  # pylint: disable=invalid-name
    self._reply()

  def _reply(self):
    length = int(self.headers.get("Content-Length", "0"))
    raw = self.rfile.read(length) if length else b""
    server: ChatServer = self.server
    request_json = json.loads(raw) if raw else None
    with server.lock:
      server.requests.append({"method": self.command, "path": self.path,
                              "headers": dict(self.headers.items()), "json": request_json})
    reply = server.next_reply(request_json)
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


def clear_proxies(monkeypatch):
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


def _served(monkeypatch):
  clear_proxies(monkeypatch)
  srv, thread = start_server()
  yield srv
  stop_server(srv, thread)


@pytest.fixture
def server(monkeypatch):
  yield from _served(monkeypatch)


@pytest.fixture
def second_server(monkeypatch):
  yield from _served(monkeypatch)


class RecordingSleep:

  def __init__(self):
    self.delays: list[float] = []

  def __call__(self, seconds: float):
    self.delays.append(seconds)


def make_client(server, sleep=None, *, client_cls=ChatClient, config_cls=ChatClientConfig,
                **overrides):
  """A `client_cls` (ChatClient, or LLMCritic with its config) on `server`: fast retries, fixed rng."""
  kwargs = dict(base_url=server.url, model="test-model", api_key_env=KEY_ENV, timeout_s=0.3,
                max_retries=2, backoff_base_s=0.0, backoff_max_s=0.0)
  kwargs.update(overrides)
  return client_cls(config_cls(**kwargs), sleep=sleep or RecordingSleep(), rng=random.Random(0))




@pytest.fixture
def fake_llm(monkeypatch):
  """Factory fixture: `fake_llm(respond) -> ChatServer` (see the module docstring)."""
  clear_proxies(monkeypatch)
  started = []

  def start(respond: Callable[[dict], Any]) -> ChatServer:
    srv, thread = start_server()
    srv.respond = respond
    started.append((srv, thread))
    return srv

  yield start
  for srv, thread in started:
    stop_server(srv, thread)
