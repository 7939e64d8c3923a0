"""The MCP server under concurrent clients, for `tests/test_mcp_load.py`: the memory directory, the
server, the clients' loop, what they saw, and `run`, the whole workload.

Symbols: `N` memories, `S` scopes, `C` concurrent clients.

`prefill` writes `N` memories in `S` scopes, each text starting with its scope's `marker`.
`Server` runs `ear-mcp-server --transport=http` on 127.0.0.1 (a subprocess); a client calls the
tools through `http_call` (one MCP session each) or `direct_call` (a `MemoryService` in-process: no
HTTP, no JSON). `run_phase` runs C clients, client `j` in scope `s{j % S}`, each looping remember /
recall / cite / search; a `Record` keeps latencies, errors, acknowledged `remember`s and leaks (a
result without the client's marker). `check_acknowledged` then checks every acknowledged
`remember` is held.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

import numpy as np

from ear_jax.agent import mcp_server
from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.data import encoders
from ear_jax.experiment import benchmarking as bm

TOOLS = ("remember", "recall", "cite", "search")
_WHO = ("Alice", "Bob", "Carol", "Dan", "Erin", "Frank", "Grace", "Heidi")
_DID = ("bought", "painted", "lost", "fixed", "sold", "borrowed", "cooked", "planted")
_WHAT = ("a red bicycle", "the blue kitchen", "an old guitar", "two tomato plants",
         "a wooden boat", "the garden fence", "a birthday cake", "a pair of hiking boots")
TEMPLATES = tuple(f"{w} {d} {x}." for w in _WHO for d in _DID for x in _WHAT)  # 512
QUESTIONS = tuple(f"What did {w} do with {x}?" for w in _WHO[:4] for x in _WHAT[:4])


def scope_name(s: int) -> str:
  return f"s{s:03d}"


def marker(scope: str) -> str:
  """The prefix of every text of `scope` (how a leak is seen)."""
  return f"[{scope}]"


# --- the memory directory ---


def prefill(memory_dir: pathlib.Path, n: int, s: int, encoder, seed: int = 0) -> dict:
  """Writes `n` memories in `s` scopes into the new directory `memory_dir` (one durable `add` per
  scope; distinct sentences encoded once, plus noise)."""
  t0 = time.perf_counter()
  base = encoders.encode(encoder, list(TEMPLATES), use_cache=False, progress=False)
  encode_s = time.perf_counter() - t0
  rng = np.random.default_rng(seed)
  per = -(-n // s)
  t1 = time.perf_counter()
  with Memory.open(memory_dir, MemoryConfig(method="ear_tuned", candidates="dense"),
                   encoder=encoder) as mem:
    for j in range(s):
      rows = np.arange(j * per, min(n, (j + 1) * per))
      if not len(rows):
        break
      scope = scope_name(j)
      texts = [f"{marker(scope)} {TEMPLATES[r % len(TEMPLATES)]} (#{r})" for r in rows]
      emb = base[rows % len(TEMPLATES)] + 0.05 * rng.standard_normal((len(rows), base.shape[1]),
                                                                     np.float32)
      mem.add(texts, scope=scope, embeddings=emb)
    held = len(mem)
  return {"memories": held, "scopes": s, "encode_templates_s": encode_s,
          "add_s": time.perf_counter() - t1}


def check_acknowledged(memory_dir: pathlib.Path, acked: list) -> dict:
  """Opens the directory; `missing`: acknowledged `(id, text, scope)` not held as such."""
  with Memory.open(memory_dir) as mem:
    held = len(mem)
    got = {r["id"]: r for scope in sorted({a[2] for a in acked}) for r in mem.list(scope)}
  missing = [a for a in acked if a[0] not in got or (got[a[0]]["text"], got[a[0]]["scope"])
             != (a[1], a[2])]
  return {"acknowledged": len(acked), "missing": len(missing), "held": held,
          "missing_examples": [list(m) for m in missing[:3]]}


# --- the server and how a client calls it ---


class Server:
  """`ear-mcp-server --transport=http` on `memory_dir` (a subprocess on a free port)."""

  def __init__(self, repo: pathlib.Path, memory_dir: pathlib.Path, log: pathlib.Path,
               server_args: tuple = ()):
    with socket.socket() as sock:
      sock.bind(("127.0.0.1", 0))
      self.port = sock.getsockname()[1]
    self.token = secrets.token_hex(16)
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
  """`open_call` of `run_phase` over streamable HTTP (one MCP session per client)."""
  import httpx  # pylint: disable=g-import-not-at-top
  from mcp import ClientSession  # pylint: disable=g-import-not-at-top
  from mcp.client.streamable_http import streamable_http_client  # pylint: disable=g-import-not-at-top

  @contextlib.asynccontextmanager
  async def open_call(j):
    del j
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {server.token}"},
                                 timeout=timeout_s) as client, \
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
  """`open_call` of `run_phase` in-process, in `pool`'s threads."""

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


# --- the clients ---


class Record:
  """What one phase's clients saw: latencies per tool, errors, leaks, acknowledged remembers."""

  def __init__(self):
    self.seconds = {t: [] for t in TOOLS}
    self.errors = {t: 0 for t in TOOLS}
    self.error_examples: list[str] = []
    self.leaks, self.interrupted, self.session_errors = 0, 0, 0
    self.acked: list[tuple] = []  # (id, text, scope)
    self.calls = 0

  def summary(self, seconds: float) -> dict:
    return {"seconds": seconds, "calls": self.calls, "calls_per_s": self.calls / seconds,
            "errors": sum(self.errors.values()) + self.session_errors, "leaks": self.leaks,
            "interrupted": self.interrupted, "acknowledged": len(self.acked),
            "tools": {t: {**bm.percentiles(self.seconds[t]), "errors": self.errors[t]}
                      for t in TOOLS},
            "error_examples": self.error_examples[:5]}


class _Stop(Exception):
  """The server is gone (the kill -9 phase): the client stops."""


async def _client(call: Callable, j: int, s: int, deadline: float, rec: Record,
                  stop_on_failure: bool, min_iterations: int = 0) -> None:
  """One client's loop until `deadline` (at least `min_iterations`); `call(tool, args)` ->
  `(ok, payload)`, an exception is a failure (with `stop_on_failure`: the loop ends)."""
  scope = scope_name(j % s)
  tag = marker(scope)

  async def one(tool, args):
    t = time.perf_counter()
    try:
      ok, out = await call(tool, args)
    except Exception as e:  # pylint: disable=broad-except  (a transport failure)
      if stop_on_failure:
        rec.interrupted += 1
        raise _Stop() from e
      ok, out = False, f"{type(e).__name__}: {e}"
    rec.seconds[tool].append(time.perf_counter() - t)
    rec.calls += 1
    if not ok:
      rec.errors[tool] += 1
      rec.error_examples.append(f"{tool}: {str(out)[:300]}")
      return None
    if tool in ("recall", "search"):
      rec.leaks += sum(not m["text"].startswith(tag) for m in out["memories"])
    return out

  i = 0
  more = lambda: i < min_iterations or time.monotonic() < deadline
  try:
    while more():
      text = f"{tag} client {j} note {i}: {TEMPLATES[(7 * i + j) % len(TEMPLATES)]}"
      out = await one("remember", {"texts": [text], "scope": scope})
      if out is not None:
        rec.acked.append((out["ids"][0], text, scope))
      q = QUESTIONS[(i + j) % len(QUESTIONS)]
      out = more() and await one("recall", {"question": q, "k": 5, "scope": scope})
      if out and out["memories"] and more():
        await one("cite", {"retrieval_id": out["retrieval_id"],
                           "used_ids": [out["memories"][0]["id"]]})
      if more():
        await one("search", {"question": q, "k": 5, "scope": scope})
      i += 1
  except _Stop:
    pass


async def _progress(rec: Record, label: str, t0: float, every_s: float = 10.0) -> None:
  while True:
    await asyncio.sleep(every_s)
    dt = time.perf_counter() - t0
    print(f"  {label}: {dt:5.0f} s, {rec.calls} calls ({rec.calls / dt:.2f}/s), "
          f"{sum(rec.errors.values())} errors", flush=True)


async def run_phase(clients: int, s: int, seconds: float, label: str, open_call,
                    kill: Optional[Callable] = None, min_iterations: int = 0) -> tuple:
  """`(summary, Record)` of `clients` concurrent `_client` loops for `seconds`; `open_call(j)`
  yields client `j`'s `call`. With `kill`: `kill()` halfway, after an acknowledged `remember`;
  calls then in flight count as interrupted (never as errors), and the phase ends."""
  rec = Record()
  t0 = time.perf_counter()
  deadline = time.monotonic() + (float("inf") if kill else seconds)

  async def one(j):
    try:
      async with open_call(j) as call:
        await _client(call, j, s, deadline, rec, kill is not None, min_iterations)
    except asyncio.CancelledError:  # (the server was killed)
      rec.interrupted += 1
    except Exception as e:  # pylint: disable=broad-except  (a session failed to open or close)
      if kill is not None:
        rec.interrupted += 1
      else:
        rec.session_errors += 1
        rec.error_examples.append(f"client {j}: {type(e).__name__}: {e}"[:300])

  tick = asyncio.ensure_future(_progress(rec, label, t0))
  tasks = [asyncio.ensure_future(one(j)) for j in range(clients)]
  try:
    if kill is None:
      await asyncio.gather(*tasks)
    else:
      await asyncio.sleep(seconds / 2)
      while not rec.acked:
        await asyncio.sleep(0.1)
      await asyncio.to_thread(kill)
      for t in tasks:
        t.cancel()
      await asyncio.gather(*tasks, return_exceptions=True)
  finally:
    tick.cancel()
  out = {**rec.summary(time.perf_counter() - t0), "clients": clients}
  print(f"  {label}: {out['calls']} calls in {out['seconds']:.1f} s = {out['calls_per_s']:.2f}/s, "
        f"{out['errors']} errors, {out['leaks']} leaks, {out['interrupted']} interrupted",
        flush=True)
  return out, rec


_BATCH = ("batch_windows", "batch_requests", "batch_encoder_calls", "batch_searches")


def _batching(before: dict, after: dict) -> dict:
  """The micro-batching counters' growth over a phase (`stats`), and requests per window."""
  d = {k: after.get(k, 0) - before.get(k, 0) for k in _BATCH}
  return {**d, "requests_per_window": d["batch_requests"] / max(d["batch_windows"], 1)}


def run(repo: pathlib.Path, *, memories: int = 100_000, scopes: int = 100,
        clients: int = 16, seconds: float = 30.0, warmup_s: float = 10.0,
        batch_window_ms: float = 5.0, encoder_batch_tokens: int = 512,
        server_args: tuple = (),
        timeout_s: float = 300.0) -> dict:
  """The whole workload in a new temporary directory, removed after a run without errors and
  kept (its path printed) otherwise. `memories`, `scopes`, `clients`: `N`, `S`, `C`; `seconds`
  per timed phase. Phases: warm-up (untimed), C = 1, C clients, SIGTERM, a kill -9 phase
  (SIGKILL halfway; the server restarts on the directory), then the same workload in-process
  (`MemoryService`, threads) with C = 1 and C; after each, every acknowledged `remember` is
  checked."""
  if not 1 <= scopes <= memories:
    raise ValueError(f"scopes must be in [1, memories], got scopes={scopes}, memories={memories}")
  if clients > scopes:
    raise ValueError(f"clients={clients} > scopes={scopes}: each client needs a scope of its own")
  work = pathlib.Path(tempfile.mkdtemp(prefix="ear_mcp_load_"))
  try:
    res = _run(repo, work, memories, scopes, clients, seconds, warmup_s, batch_window_ms,
               encoder_batch_tokens, server_args, timeout_s)
  except BaseException:
    print(f"mcp load failed: its memory directory and server log are kept in {work}",
          flush=True)
    raise
  if res["errors"] or res["leaks"] or res["missing"]:
    print(f"mcp load: errors, leaks or missing writes: kept {work}", flush=True)
  else:
    shutil.rmtree(work, ignore_errors=True)
  return res


def _run(repo, work, memories, scopes, clients, seconds, warmup_s, batch_window_ms,
         encoder_batch_tokens, server_args, timeout_s) -> dict:
  memory_dir, log = work / "memory", work / "server.log"
  server_args = (f"--batch_window_ms={batch_window_ms}",
                 f"--encoder_batch_tokens={encoder_batch_tokens}", *server_args)
  encoder = encoders.load_encoder("minilm", tokens_per_batch=encoder_batch_tokens)
  res = {"config": {"memories": memories, "scopes": scopes, "clients": clients,
                    "seconds": seconds, "warmup_s": warmup_s, "batch_window_ms": batch_window_ms,
                    "encoder_batch_tokens": encoder_batch_tokens,
                    "server_args": list(server_args), "cpu_count": os.cpu_count(),
                    "load_average": os.getloadavg()}}
  print(f"mcp load: {memories} memories in {scopes} scopes, {clients} clients, {seconds} s "
        "per phase", flush=True)
  res["prefill"] = prefill(memory_dir, memories, scopes, encoder)
  print(f"  prefill: {res['prefill']}", flush=True)
  acked, phases = [], {}

  def phase(label, c, secs, open_call, stats=None, **opts):
    before = stats() if stats else {}
    out, rec = asyncio.run(run_phase(c, scopes, secs, label, open_call, **opts))
    if stats:
      out["batching"] = _batching(before, stats())
    acked.extend(rec.acked)
    phases[label] = out

  def check(key, after):
    res[key] = check_acknowledged(memory_dir, acked)
    print(f"  {after}: {res[key]}", flush=True)

  def http_stats(server):
    async def go():
      async with http_call(server, timeout_s)(0) as c:
        return await c("stats", {})
    ok, st = asyncio.run(go())
    if not ok:
      raise RuntimeError(f"the server's stats tool failed: {st}")
    return st

  # 1. HTTP: warm-up, C = 1, C.
  with Server(repo, memory_dir, log, server_args) as server:
    res["server_start_s"] = server.wait_ready()
    call, stats = http_call(server, timeout_s), lambda: http_stats(server)
    phase("http_warmup", clients, warmup_s, call, min_iterations=2)
    phase("http_c1", 1, seconds, call, stats)
    phase(f"http_c{clients}", clients, seconds, call, stats)
    res["server_exit"] = server.stop()
  check("check_after_http", "after the HTTP phases")

  # 2. kill -9 halfway through C clients, then a restart on the same directory.
  with Server(repo, memory_dir, log, server_args) as server:
    server.wait_ready()
    phase("http_kill9", clients, seconds, http_call(server, timeout_s), kill=server.kill)
  with Server(repo, memory_dir, log, server_args) as server:
    res["restart_s"] = server.wait_ready()
    res["stats_after_restart"] = http_stats(server)
    res["server_exit_after_restart"] = server.stop()
  check("check_after_kill9", "after kill -9 and a restart")

  # 3. In-process: the service over the opened directory, C threads.
  service = mcp_server.MemoryService(Memory.open(memory_dir, encoder=encoder,
                                                 batch_window_ms=batch_window_ms), memory_dir)
  try:
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
      call = direct_call(service, pool)
      phase("direct_warmup", clients, warmup_s, call, min_iterations=2)
      phase("direct_c1", 1, seconds, call, service.stats)
      phase(f"direct_c{clients}", clients, seconds, call, service.stats)
  finally:
    service.close()
  check("check_final", "final")

  res["phases"] = phases
  res["errors"] = sum(p["errors"] for p in phases.values())
  res["leaks"] = sum(p["leaks"] for p in phases.values())
  res["missing"] = max(res[k]["missing"] for k in ("check_after_http", "check_after_kill9",
                                                   "check_final"))

  return res
