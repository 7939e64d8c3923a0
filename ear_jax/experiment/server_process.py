"""The MCP server of the load benchmark (`server_bench`): a subprocess and how a client
calls its tools.

`Server` starts `ear-mcp-server --transport=http` on 127.0.0.1 on a memory directory and stops it
with SIGTERM or SIGKILL. Clients call the tools through `http_call` (one MCP session each) or
`direct_call` (a `MemoryService` in-process: no HTTP, no JSON).
"""
from __future__ import annotations

import asyncio
import datetime
import json
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import time


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


class Server:
  """`ear-mcp-server --transport=http` on `memory_dir` (a subprocess)."""

  def __init__(self, repo: pathlib.Path, memory_dir: pathlib.Path, log: pathlib.Path,
               server_args: tuple = ()):
    self.port, self.token = _free_port(), secrets.token_hex(16)
    self.url = f"http://127.0.0.1:{self.port}/mcp"
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "EAR_MCP_TOKEN": self.token}
    self._log = open(log, "a")  # pylint: disable=consider-using-with
    self.proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-m", "ear_jax.agent.mcp_cli", f"--memory_dir={memory_dir}",
         "--transport=http", "--host=127.0.0.1", f"--port={self.port}", "--method=ear_tuned",
         "--candidates=dense", *server_args], env=env, cwd=str(repo),
        stdout=subprocess.DEVNULL, stderr=self._log)

  def __enter__(self) -> "Server":
    return self

  def __exit__(self, *exc) -> None:
    if self.proc.poll() is None:  # (a failure on the way: never leave a server behind)
      self.kill()

  @property
  def headers(self) -> dict:
    return {"Authorization": f"Bearer {self.token}"}

  def wait_ready(self, timeout_s: float = 600.0) -> float:
    """Seconds until the server answers HTTP (a 401 without the token)."""
    import httpx  # pylint: disable=g-import-not-at-top
    t0 = time.monotonic()
    while True:
      if self.proc.poll() is not None:
        raise RuntimeError(f"the MCP server exited with code {self.proc.returncode} before "
                           f"answering (its log: {self._log.name})")
      try:
        httpx.post(self.url, json={}, timeout=5.0)
        return time.monotonic() - t0
      except httpx.TransportError:
        if time.monotonic() - t0 > timeout_s:
          raise RuntimeError(f"the MCP server did not answer within {timeout_s:.0f} s") from None
        time.sleep(0.3)

  def stop(self, timeout_s: float = 300.0) -> int:
    """SIGTERM (the learner saved, the directory released); the exit code."""
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
    rc = self.proc.wait(timeout=timeout_s)
    self._log.close()
    return rc

  def kill(self) -> None:
    """SIGKILL (kill -9)."""
    self.proc.kill()
    self.proc.wait()
    self._log.close()


def http_call(server: Server, timeout_s: float):
  """`open_call` of `server_load.run_phase` over streamable HTTP (one MCP session per client)."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import httpx  # pylint: disable=g-import-not-at-top
  from mcp import ClientSession  # pylint: disable=g-import-not-at-top
  from mcp.client.streamable_http import streamable_http_client  # pylint: disable=g-import-not-at-top

  @contextlib.asynccontextmanager
  async def open_call(j):
    del j
    async with httpx.AsyncClient(headers=server.headers, timeout=timeout_s) as client, \
        streamable_http_client(server.url, http_client=client) as (read, write, _), \
        ClientSession(read, write, read_timeout_seconds=datetime.timedelta(
            seconds=timeout_s)) as session:
      await session.initialize()

      async def call(tool, args):
        res = await session.call_tool(tool, args)
        text = res.content[0].text if res.content else ""
        return (False, text) if res.isError else (True, json.loads(text))
      yield call
  return open_call


def direct_call(service, pool):
  """`open_call` of `server_load.run_phase` in-process, in `pool`'s threads."""
  import contextlib  # pylint: disable=g-import-not-at-top

  @contextlib.asynccontextmanager
  async def open_call(j):
    del j

    async def call(tool, args):
      try:
        out = await asyncio.get_running_loop().run_in_executor(
            pool, lambda: getattr(service, tool)(**args))
      except (ValueError, TypeError, KeyError) as e:  # the server's tool errors
        return False, f"{type(e).__name__}: {e}"
      return True, out
    yield call
  return open_call

