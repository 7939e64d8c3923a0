"""Hostile conditions for the MCP server: kill -9 right after an acknowledged `remember` / `forget`,
a second server on one memory directory, wrong JSON types on every tool, a forged Host header on a
loopback address other than 127.0.0.1, and raw stdio bytes a well-behaved client never sends (a lone
surrogate, `params` that is not an object, invalid UTF-8)."""
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("mcp")

from ear_jax.agent import mcp_stdio  # pylint: disable=wrong-import-position
from ear_jax.agent.memory import Memory  # pylint: disable=wrong-import-position
from experiments import mcp_agent  # pylint: disable=wrong-import-position
from tests.test_mcp_server import FACTS, _run, _service  # pylint: disable=wrong-import-position


# --------------------------------------------------------------------------------------------------
# JSON values of the wrong type are refused, never coerced


def test_k_that_is_not_a_json_integer_is_a_tool_error_never_coerced():
  """`k=true` is not 1 and `k="5"` is not 5 (pydantic's lax mode would coerce both)."""
  bad = [True, False, "5", "2", 2.0, [2], None]

  async def script(s):
    await mcp_agent.must(s, "remember", {"texts": FACTS})
    out = []
    for tool in ("recall", "search"):
      for k in bad:
        out.append((tool, k, *(await mcp_agent.call(s, tool, {"question": "red cat", "k": k}))))
    out.append(("recall", 2, *(await mcp_agent.call(s, "recall", {"question": "red cat", "k": 2}))))
    st = await mcp_agent.must(s, "stats", {})
    return out, st
  out, st = _run(_service(), script)
  for tool, k, ok, err in out[:-1]:
    assert not ok, f"{tool}(k={k!r}) was accepted: {err}"
    assert "k" in err and "integer" in err.lower() and "Traceback" not in err, err
  assert out[-1][2], out[-1]  # a JSON integer is fine
  assert st["rounds"] == 1 and st["searches"] == 0  # no refused call reached the memory



def test_unknown_arguments_are_a_tool_error_naming_them_and_reach_no_tool():
  """`stats(extra=1)` was answered (pydantic ignores unknown fields), `recall(question=..., kk=2)`
  ran with k=5: a misspelt argument must not be silently dropped."""
  calls = [("stats", {"extra": 1}, ["extra"]),
           ("remember", {"texts": ["a fact"], "scopes": "user-1"}, ["scopes"]),
           ("recall", {"question": "red cat", "kk": 2, "z": None}, ["kk", "z"]),
           ("search", {"question": "red cat", "k": 2, "learn": False}, ["learn"]),
           ("forget", {"ids": ["m0"], "force": True}, ["force"]),
           ("cite", {"retrieval_id": "x", "used": []}, ["used"])]

  async def script(s):
    await mcp_agent.must(s, "remember", {"texts": FACTS})
    out = [(tool, names, *(await mcp_agent.call(s, tool, args))) for tool, args, names in calls]
    tools = {t.name: t.inputSchema for t in (await s.list_tools()).tools}
    return out, tools, await mcp_agent.must(s, "stats", {})
  out, tools, st = _run(_service(), script)
  for tool, names, ok, err in out:
    assert not ok, f"{tool} accepted unknown arguments {names}: {err}"
    assert f"unknown argument(s) {names}" in err and tool in err and "Traceback" not in err, err
  assert all(schema.get("additionalProperties") is False for schema in tools.values()), tools
  assert st["memories"] == len(FACTS) and st["rounds"] == 0 and st["searches"] == 0


def _free_port(host: str) -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def _env(**extra):
  return {**os.environ, "PYTHONPATH": str(mcp_agent.REPO), "JAX_PLATFORMS": "cpu", **extra}


@pytest.mark.slow  # a server process: ~10 s
def test_forged_host_on_another_loopback_address_is_refused(tmp_path):
  """`--host=127.0.0.2` needs no token (loopback), so the Host / Origin check is what stops a web
  page that rebinds its DNS name to 127.0.0.2; the SDK's default covers only 127.0.0.1."""
  import httpx  # pylint: disable=g-import-not-at-top
  host = "127.0.0.2"
  port = _free_port(host)
  proc = subprocess.Popen(
      [sys.executable, "-m", "ear_jax.agent.mcp_cli", f"--memory_dir={tmp_path / 'mem'}",
       "--transport=http", f"--host={host}", f"--port={port}"], env=_env(EAR_MCP_TOKEN=""),
      cwd=str(mcp_agent.REPO), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  url = f"http://{host}:{port}/mcp"
  init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
      "protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
  accept = {"Accept": "application/json, text/event-stream"}
  try:
    deadline = time.monotonic() + 120
    while True:
      try:
        forged = httpx.post(url, json=init, headers={**accept, "Host": f"evil.example:{port}"})
        break
      except httpx.TransportError:
        assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
        time.sleep(0.5)
    other_origin = httpx.post(url, json=init, headers={**accept, "Origin": "http://evil.example"})
    right = httpx.post(url, json=init, headers=accept)  # Host: 127.0.0.2:port
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
  assert forged.status_code == 421, (forged.status_code, forged.text[:200])
  assert other_origin.status_code == 403, (other_origin.status_code, other_origin.text[:200])
  assert right.status_code == 200, (right.status_code, right.text[:200])


# --------------------------------------------------------------------------------------------------
# stdio answers every request with an id, whatever its bytes


class _RawStdio:
  """`ear-mcp-server` over stdio, written to with raw bytes; `reply(id)` waits
  (bounded) for the JSON-RPC message answering `id`."""

  def __init__(self, memory_dir):
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "ear_jax.agent.mcp_cli", f"--memory_dir={memory_dir}",
         "--save_learner_s=0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, env=_env(), cwd=str(mcp_agent.REPO))
    self.lines = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()
    self.seen = {}

  def _read(self):
    for line in self.proc.stdout:
      self.lines.put(line)
    self.lines.put(None)

  def send(self, raw: bytes):
    self.proc.stdin.write(raw.rstrip(b"\n") + b"\n")
    self.proc.stdin.flush()

  def call(self, rid, method, params):
    self.send(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}).encode())

  def reply(self, rid, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while rid not in self.seen:
      try:
        line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
      except queue.Empty:
        raise AssertionError(f"no JSON-RPC response to id {rid!r} within {timeout_s:g} s (a "
                             f"client would wait forever); got {sorted(self.seen, key=str)}") from None
      assert line is not None, f"the server exited (code {self.proc.wait()}) before answering {rid!r}"
      msg = json.loads(line)
      self.seen[msg.get("id")] = msg
    return self.seen[rid]

  def close(self):
    self.proc.stdin.close()
    return self.proc.wait(timeout=120)


@pytest.mark.slow  # a server process: ~10-20 s
def test_stdio_answers_malformed_requests_with_json_rpc_errors_and_keeps_serving(tmp_path):
  srv = _RawStdio(tmp_path / "mem")
  try:
    srv.call(1, "initialize", {"protocolVersion": "2025-03-26", "capabilities": {},
                               "clientInfo": {"name": "t", "version": "0"}})
    assert "result" in srv.reply(1, timeout_s=120)
    srv.send(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}')
    remember = b'{"jsonrpc": "2.0", "id": %d, "method": "tools/call", "params": {"name": "remember", "arguments": {"texts": ["%s"]}}}'
    srv.send(remember % (2, b"lone \\ud800 surrogate"))
    srv.send(b'{"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": 7}')
    srv.send(remember % (4, b"bad \xff\xfe utf-8"))
    srv.send(b'{"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": [1, 2]}')
    srv.send(b'{"jsonrpc": "2.0", "id": 6, "method": ')  # not JSON at all: id unknown, null
    srv.send(remember % (7, "caf\u00e9 \U0001f600 ok".encode()))  # valid UTF-8: stored
    errors = {rid: srv.reply(rid) for rid in (2, 3, 4, 5)}
    null, stored = srv.reply(None), srv.reply(7, timeout_s=120)  # (loads the encoder)
    srv.call(8, "tools/call", {"name": "stats", "arguments": {}})  # (after 7: calls run at once)
    stats = srv.reply(8)
  finally:
    code = srv.close()
  assert errors[2]["error"]["code"] == -32700 and "surrogate" in errors[2]["error"]["message"]
  assert errors[3]["error"]["code"] == -32602 and "params" in errors[3]["error"]["message"]
  assert errors[4]["error"]["code"] == -32700 and "UTF-8" in errors[4]["error"]["message"]
  assert errors[5]["error"]["code"] == -32602
  assert null["error"]["code"] == -32700
  assert not stored["result"].get("isError"), stored
  st = json.loads(stats["result"]["content"][0]["text"])
  assert st["memories"] == 1, st  # only the valid one: nothing stored as U+FFFD
  assert code == 0
  with Memory.open(tmp_path / "mem") as m:
    texts = [r["text"] for r in m.list()]
  assert texts == ["caf\u00e9 \U0001f600 ok"], texts


def test_stdio_lines_the_sdk_cannot_read_get_json_rpc_errors_naming_the_problem():
  """`check_stdio_line`, the stdin layer of `serve_stdio` (the process test above is slow)."""
  head = b'{"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": '
  cases = {head + b'{"name": "stats", "arguments": {"a": "\\ud800"}}}': (-32700, "surrogate"),
           head + b'{"name": "stats", "arguments": {"a": "\xc3"}}}': (-32700, "UTF-8"),
           head + b'7}': (-32602, "params must be an object"),
           head + b'"x"}': (-32602, "params must be an object"),
           b'{"jsonrpc": "1.0", "id": 9, "method": "ping"}': (-32600, "Invalid Request")}
  for raw, (code, words) in cases.items():
    line, error = mcp_stdio.check_stdio_line(raw)
    assert line is None and error is not None, raw
    error = json.loads(error)
    assert error["id"] == 9 and error["error"]["code"] == code, (raw, error)
    assert words in error["error"]["message"], (raw, error)
  assert json.loads(mcp_stdio.check_stdio_line(b'{"id": 9, "meth')[1])["id"] is None
  good = head + '{"name": "remember", "arguments": {"texts": ["caf\u00e9 \U0001f600"]}}}'.encode()
  assert mcp_stdio.check_stdio_line(good) == (good.decode(), None)
  assert mcp_stdio.check_stdio_line(b'{"jsonrpc": "2.0", "method": "n", "params": 7}') == (
      None, None)  # a notification is never answered


# --------------------------------------------------------------------------------------------------
# every acknowledged write is durable; one server per memory directory


def _tool(srv, rid, name, arguments):
  """The JSON result of a tools/call (the reply has arrived: the call was acknowledged)."""
  srv.call(rid, "tools/call", {"name": name, "arguments": arguments})
  reply = srv.reply(rid, timeout_s=120)
  assert not reply["result"].get("isError"), reply
  return json.loads(reply["result"]["content"][0]["text"])


def _start(srv):
  srv.call(1, "initialize", {"protocolVersion": "2025-03-26", "capabilities": {},
                             "clientInfo": {"name": "t", "version": "0"}})
  assert "result" in srv.reply(1, timeout_s=120)
  srv.send(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}')


@pytest.mark.slow  # a server process: ~15 s
def test_an_acknowledged_remember_or_forget_survives_kill_9_of_the_server(tmp_path):
  """kill -9 right after the replies (no learner save ever ran: `--save_learner_s=0`): the reopened
  directory holds exactly the acknowledged memories, and no file in it holds the forgotten text."""
  srv = _RawStdio(tmp_path / "mem")
  secret = "the vault code is 7341-zebra-quartz"
  try:
    _start(srv)
    ids = _tool(srv, 2, "remember", {"texts": ["alpha beta", secret, "gamma delta"]})["ids"]
    r = _tool(srv, 3, "recall", {"question": "alpha", "k": 2})
    _tool(srv, 4, "cite", {"retrieval_id": r["retrieval_id"], "used_ids": []})
    assert _tool(srv, 5, "forget", {"ids": [ids[1]]})["deleted"] == [ids[1]]
    last = _tool(srv, 6, "remember", {"texts": ["epsilon zeta"], "scope": "u1"})["ids"]
    srv.proc.send_signal(signal.SIGKILL)  # at once: no shutdown, no save of any kind
    assert srv.proc.wait(timeout=60) == -signal.SIGKILL
  finally:
    if srv.proc.poll() is None:
      srv.proc.kill()
  with Memory.open(tmp_path / "mem") as m:
    records = m.list()
  assert [r["id"] for r in records] == [ids[0], ids[2], *last]
  assert [r["scope"] for r in records][-1] == "u1"
  for f in (tmp_path / "mem").rglob("*"):
    if f.is_file():
      assert secret.encode() not in f.read_bytes(), f"{f} holds the forgotten memory's text"


@pytest.mark.slow  # two server processes: ~15 s
def test_a_second_server_on_one_memory_dir_exits_naming_the_first_servers_pid(tmp_path):
  srv = _RawStdio(tmp_path / "mem")
  try:
    _start(srv)  # (the first server holds the directory)
    second = subprocess.run([sys.executable, "-m", "ear_jax.agent.mcp_cli",
                             f"--memory_dir={tmp_path / 'mem'}"], capture_output=True, text=True,
                            env=_env(), cwd=str(mcp_agent.REPO), timeout=120,
                            stdin=subprocess.DEVNULL)
    assert _tool(srv, 2, "stats", {})["memories"] == 0  # the first one still serves
  finally:
    code = srv.close()
  assert second.returncode != 0 and f"pid {srv.proc.pid}" in second.stderr, second.stderr
  assert str(tmp_path / "mem") in second.stderr and "Traceback" not in second.stderr
  assert code == 0
