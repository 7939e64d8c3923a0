"""The MCP server under load (issue 30): C concurrent clients over loopback HTTP, N memories in S
scopes, every acknowledged write checked, a kill -9 mid-run, and the same workload in-process.

Symbols: `N` memories, `S` scopes, `C` concurrent clients.

`run` prepares a memory directory (`Memory.open`, the server's default `MemoryConfig`) holding `N`
memories in `S` scopes of `N / S` each: synthetic sentences (`TEMPLATES` words) whose MiniLM
embeddings are computed once per distinct sentence and passed to `Memory.add(embeddings=)` (plus a
little noise per memory, so no two are equal); every text starts with its scope's marker `[sNNN]`.
It then starts `python -m experiments.mcp_server --transport=http` on 127.0.0.1 (a free port, a
random bearer token) on that directory and runs clients through the `mcp` SDK's streamable HTTP
client, client `j` in scope `s{j % S}`, each a loop for `seconds` of one iteration after another:
`remember` one new memory, `recall` (k = 5) one of `QUESTIONS` questions (they repeat, so later
rounds resume the question's session), `cite` its first memory, `search` (k = 5) the same question.
The encoder runs for every `remember`, `recall` and `search` (the prefill alone is precomputed).

Phases, in one run: warm-up (C clients, untimed: the encoder loads and the shapes compile), C = 1,
C clients, SIGTERM (the learner saved), then the kill -9 phase (a new server on the directory, C
clients, SIGKILL halfway: calls in flight then fail and are counted apart, not as errors; the
server restarts on the same directory and answers `stats`), then the same workload in-process
(`MemoryService` over `Memory.open` of the directory, from C threads: no HTTP, no JSON) with C = 1
and C. After every phase each acknowledged `remember` must be in the directory (`Memory.open`:
its text and scope), and no `recall` / `search` result may hold a memory of another scope (its
marker). Reported per phase: tool calls/s, p50 / p99 latency per tool, errors, leaks, the
memory's micro-batching counters (`stats`: requests per batch window); the throughput ratio C vs
1 (target `THROUGHPUT_TARGET`); beside them the encoder alone measured in the same run (one
question, and C questions in one call: what batching can gain).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
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
from typing import Callable, Optional

import numpy as np

THROUGHPUT_TARGET = 3.0  # issue 30: C = 16 clients vs one, calls/s
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


_BATCH = ("batch_windows", "batch_requests", "batch_encoder_calls", "batch_searches")


def _batching(before: dict, after: dict) -> dict:
  """The micro-batching counters' growth over a phase (`stats`), and requests per window."""
  d = {k: after.get(k, 0) - before.get(k, 0) for k in _BATCH}
  return {**d, "requests_per_window": d["batch_requests"] / max(d["batch_windows"], 1)}


def _pct(ms: list) -> dict:
  if not ms:
    return {"n": 0, "p50_ms": None, "p99_ms": None}
  a = np.asarray(ms)
  return {"n": len(a), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}


# --------------------------------------------------------------------------------------------------
# the memory directory


def prefill(memory_dir: pathlib.Path, n: int, s: int, encoder, seed: int = 0) -> dict:
  """Writes `n` memories in `s` scopes into the new directory `memory_dir` (one durable `add` of
  `n / s` memories per scope; embeddings of the distinct sentences, encoded once, plus noise)."""
  from ear_jax.agent.memory import Memory, MemoryConfig  # pylint: disable=g-import-not-at-top
  from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
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
  """Opens the directory; `missing`: acknowledged `(id, text, scope)` not held with that text and
  scope."""
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  with Memory.open(memory_dir) as mem:
    held = len(mem)
    got = {r["id"]: r for scope in sorted({a[2] for a in acked}) for r in mem.list(scope)}
  missing = [a for a in acked if a[0] not in got or (got[a[0]]["text"], got[a[0]]["scope"])
             != (a[1], a[2])]
  return {"acknowledged": len(acked), "missing": len(missing), "held": held,
          "missing_examples": [list(m) for m in missing[:3]]}


def encoder_bound(encoder, c: int, reps: int = 3) -> dict:
  """Milliseconds of encoding one question and `c` questions in one call (minimum of `reps`)."""
  from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
  out = {}
  for n in (1, c):
    texts = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    encoders.encode(encoder, texts, use_cache=False, progress=False)
    ts = []
    for _ in range(reps):
      t = time.perf_counter()
      encoders.encode(encoder, texts, use_cache=False, progress=False)
      ts.append(time.perf_counter() - t)
    out[f"encode_{n}_ms"] = 1e3 * min(ts)
  return out


# --------------------------------------------------------------------------------------------------
# the workload


class Record:
  """What one phase's clients saw: latencies per tool, errors, leaks, acknowledged remembers."""

  def __init__(self):
    self.ms = {t: [] for t in TOOLS}
    self.errors = {t: 0 for t in TOOLS}
    self.error_examples: list[str] = []
    self.leaks, self.interrupted, self.session_errors = 0, 0, 0
    self.acked: list[tuple] = []  # (id, text, scope)
    self.calls = 0

  def summary(self, seconds: float) -> dict:
    return {"seconds": seconds, "calls": self.calls, "calls_per_s": self.calls / seconds,
            "errors": sum(self.errors.values()) + self.session_errors, "leaks": self.leaks,
            "interrupted": self.interrupted, "acknowledged": len(self.acked),
            "tools": {t: {**_pct(self.ms[t]), "errors": self.errors[t]} for t in TOOLS},
            "error_examples": self.error_examples[:5]}


class _Stop(Exception):
  """The server is gone (the kill -9 phase): the client stops."""


async def _client(call: Callable, j: int, s: int, deadline: float, rec: Record,
                  stop_on_failure: bool, min_iterations: int = 0) -> None:
  """One client's loop: remember / recall / cite / search in scope `s{j % S}` until `deadline`
  (and at least `min_iterations` whole iterations).

  `call(tool, args)` -> `(ok, payload)`; an exception is a failure (with `stop_on_failure`: an
  interruption, the loop ends)."""
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
    rec.ms[tool].append(1e3 * (time.perf_counter() - t))
    rec.calls += 1
    if not ok:
      rec.errors[tool] += 1
      rec.error_examples.append(f"{tool}: {str(out)[:300]}")
      return None
    if tool in ("recall", "search"):
      rec.leaks += sum(not m["text"].startswith(tag) for m in out["memories"])
    return out

  i = 0

  def more():
    return i < min_iterations or time.monotonic() < deadline

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


async def _phase(clients: int, s: int, seconds: float, label: str, open_call,
                 kill: Optional[Callable] = None, min_iterations: int = 0) -> tuple:
  """`(summary, Record)` of `clients` concurrent `_client` loops for `seconds` (and at least
  `min_iterations` each); `open_call(j)` is an async context manager yielding client `j`'s
  `call`. With `kill`: `kill()` (in a thread)
  halfway, once a `remember` of this phase was acknowledged; the calls then in flight are
  cancelled and counted as interrupted (never as errors), and the phase ends."""
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
  out = rec.summary(time.perf_counter() - t0)
  out["clients"] = clients
  print(f"  {label}: {out['calls']} calls in {out['seconds']:.1f} s = {out['calls_per_s']:.2f}/s, "
        f"{out['errors']} errors, {out['leaks']} leaks, {out['interrupted']} interrupted",
        flush=True)
  return out, rec


# --------------------------------------------------------------------------------------------------
# the server


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


class Server:
  """`python -m experiments.mcp_server --transport=http` on `memory_dir` (a subprocess)."""

  def __init__(self, repo: pathlib.Path, memory_dir: pathlib.Path, log: pathlib.Path,
               server_args: tuple = ()):
    self.port, self.token = _free_port(), secrets.token_hex(16)
    self.url = f"http://127.0.0.1:{self.port}/mcp"
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "EAR_MCP_TOKEN": self.token}
    self._log = open(log, "a")  # pylint: disable=consider-using-with
    self.proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-m", "experiments.mcp_server", f"--memory_dir={memory_dir}",
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


def _http_call(server: Server, timeout_s: float):
  """`open_call` of `_phase` over the server's streamable HTTP (one MCP session per client)."""
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


def _direct_call(service, pool):
  """`open_call` of `_phase` in-process: the service's tool methods in `pool`'s threads."""
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


# --------------------------------------------------------------------------------------------------


def run(repo: pathlib.Path, *, memories: int = 100_000, scopes: int = 100,
        clients: int = 16, seconds: float = 30.0, warmup_s: float = 10.0,
        batch_window_ms: float = 5.0, encoder_batch_tokens: int = 512,
        server_args: tuple = (),
        timeout_s: float = 300.0) -> dict:
  """The whole benchmark (see the module doc), in a new temporary directory (the memory
  directory and the servers' stderr, `server.log`), removed after a run without errors and kept
  (its path printed) otherwise.

  Args:
    repo: the repository root (where `python -m experiments.mcp_server` runs).
    memories, scopes, clients, seconds: `N`, `S`, `C` and each timed phase's duration.
    warmup_s: the untimed warm-up's duration (C clients).
    batch_window_ms: the micro-batching window of the server (`--batch_window_ms`) and of the
      in-process phases' memory.
    encoder_batch_tokens: the server's `--encoder_batch_tokens` (and the in-process phases'
      encoder's).
    server_args: more `experiments.mcp_server` flags.
    timeout_s: a client's limit on one call.
  """
  import shutil  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  if not 1 <= scopes <= memories:
    raise ValueError(f"scopes must be in [1, memories], got scopes={scopes}, memories={memories}")
  if clients > scopes:
    raise ValueError(f"clients={clients} > scopes={scopes}: each client needs a scope of its own")
  work = pathlib.Path(tempfile.mkdtemp(prefix="ear_server_bench_"))
  try:
    res = _run(repo, work, memories, scopes, clients, seconds, warmup_s, batch_window_ms,
               encoder_batch_tokens, server_args, timeout_s)
  except BaseException:
    print(f"server bench failed: its memory directory and server log are kept in {work}",
          flush=True)
    raise
  if res["errors"] or res["leaks"] or res["missing"]:
    print(f"server bench: errors, leaks or missing writes: kept {work}", flush=True)
  else:
    shutil.rmtree(work, ignore_errors=True)
  return res


def _run(repo, work, memories, scopes, clients, seconds, warmup_s, batch_window_ms,
         encoder_batch_tokens, server_args, timeout_s) -> dict:
  from ear_jax.agent import mcp_server  # pylint: disable=g-import-not-at-top
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
  memory_dir, log = work / "memory", work / "server.log"
  server_args = (f"--batch_window_ms={batch_window_ms}",
                 f"--encoder_batch_tokens={encoder_batch_tokens}", *server_args)
  encoder = encoders.load_encoder("minilm", tokens_per_batch=encoder_batch_tokens)
  res = {"config": {"memories": memories, "scopes": scopes, "clients": clients,
                    "seconds": seconds, "warmup_s": warmup_s, "batch_window_ms": batch_window_ms,
                    "encoder_batch_tokens": encoder_batch_tokens,
                    "server_args": list(server_args), "cpu_count": os.cpu_count(),
                    "load_average": os.getloadavg()}}
  print(f"server bench: {memories} memories in {scopes} scopes, {clients} clients, {seconds} s "
        "per phase", flush=True)
  res["encoder_bound"] = encoder_bound(encoder, clients)
  print(f"  encoder: {res['encoder_bound']}", flush=True)
  res["prefill"] = prefill(memory_dir, memories, scopes, encoder)
  print(f"  prefill: {res['prefill']}", flush=True)
  acked, phases = [], {}

  def timed(label, c, secs, open_call, stats=None, **opts):
    before = stats() if stats else {}
    out, rec = asyncio.run(_phase(c, scopes, secs, label, open_call, **opts))
    if stats:
      out["batching"] = _batching(before, stats())
    acked.extend(rec.acked)
    phases[label] = out
    return out

  def http_stats(server):
    async def go():
      async with _http_call(server, timeout_s)(0) as c:
        return await c("stats", {})
    ok, st = asyncio.run(go())
    if not ok:
      raise RuntimeError(f"the server's stats tool failed: {st}")
    return st

  # 1. HTTP: warm-up, C = 1, C.
  with Server(repo, memory_dir, log, server_args) as server:
    res["server_start_s"] = server.wait_ready()
    call = _http_call(server, timeout_s)

    def stats():
      return http_stats(server)
    timed("http_warmup", clients, warmup_s, call, min_iterations=2)
    timed("http_c1", 1, seconds, call, stats)
    timed(f"http_c{clients}", clients, seconds, call, stats)
    res["server_exit"] = server.stop()
  res["check_after_http"] = check_acknowledged(memory_dir, acked)
  print(f"  after the HTTP phases: {res['check_after_http']}", flush=True)

  # 2. kill -9 halfway through C clients, then a restart on the same directory.
  with Server(repo, memory_dir, log, server_args) as server:
    server.wait_ready()
    timed("http_kill9", clients, seconds, _http_call(server, timeout_s), kill=server.kill)
  with Server(repo, memory_dir, log, server_args) as server:
    res["restart_s"] = server.wait_ready()
    res["stats_after_restart"] = http_stats(server)
    res["server_exit_after_restart"] = server.stop()
  res["check_after_kill9"] = check_acknowledged(memory_dir, acked)
  print(f"  after kill -9 and a restart: {res['check_after_kill9']}", flush=True)

  # 3. In-process: the service over the opened directory, C threads.
  service = mcp_server.MemoryService(Memory.open(memory_dir, encoder=encoder,
                                                 batch_window_ms=batch_window_ms), memory_dir)
  try:
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
      call = _direct_call(service, pool)
      timed("direct_warmup", clients, warmup_s, call, min_iterations=2)
      timed("direct_c1", 1, seconds, call, service.stats)
      timed(f"direct_c{clients}", clients, seconds, call, service.stats)
  finally:
    service.close()
  res["check_final"] = check_acknowledged(memory_dir, acked)
  print(f"  final: {res['check_final']}", flush=True)

  res["phases"] = phases
  res["errors"] = sum(p["errors"] for p in phases.values())
  res["leaks"] = sum(p["leaks"] for p in phases.values())
  res["missing"] = max(res[k]["missing"] for k in ("check_after_http", "check_after_kill9",
                                                   "check_final"))

  def ratio(kind):
    return phases[f"{kind}_c{clients}"]["calls_per_s"] / phases[f"{kind}_c1"]["calls_per_s"]
  res["throughput_ratio"] = {"http": ratio("http"), "direct": ratio("direct"),
                             "target": THROUGHPUT_TARGET,
                             "met": bool(ratio("http") >= THROUGHPUT_TARGET)}
  res["transport_cost"] = {  # HTTP calls/s over in-process calls/s, at 1 and at C clients
      "c1": phases["http_c1"]["calls_per_s"] / phases["direct_c1"]["calls_per_s"],
      f"c{clients}": (phases[f"http_c{clients}"]["calls_per_s"]
                      / phases[f"direct_c{clients}"]["calls_per_s"])}
  return res


def _met(ok) -> str:
  return "yes" if ok else "NO"


def table(res: dict) -> str:
  """The markdown tables of `run`'s results."""
  cfg, bound = res["config"], res["encoder_bound"]
  c = cfg["clients"]
  lines = [f"N = {cfg['memories']:,} memories in S = {cfg['scopes']} scopes, C = {c} clients, "
           f"{cfg['seconds']:g} s per phase, batch window {cfg['batch_window_ms']:g} ms, "
           f"encoder batch tokens {cfg['encoder_batch_tokens']}; the encoder alone: one question "
           f"{bound['encode_1_ms']:.1f} ms, {c} in one call {bound[f'encode_{c}_ms']:.1f} ms", "",
           "| phase | clients | calls/s | " + " | ".join(f"{t} p50 / p99 ms" for t in TOOLS)
           + " | errors | leaks | interrupted | acknowledged | requests per batch window |",
           "|---|---|---|" + "---|" * len(TOOLS) + "---|---|---|---|---|"]
  for name, p in res["phases"].items():
    cells = []
    for t in TOOLS:
      x = p["tools"][t]
      cells.append("-" if not x["n"] else f"{x['p50_ms']:.0f} / {x['p99_ms']:.0f}")
    lines.append(f"| {name} | {p['clients']} | {p['calls_per_s']:.2f} | " + " | ".join(cells)
                 + f" | {p['errors']} | {p['leaks']} | {p['interrupted']} | {p['acknowledged']} | "
                 + (f"{p['batching']['requests_per_window']:.1f} |" if "batching" in p else "- |"))
  r = res["throughput_ratio"]
  lines += ["", "| check | value | target | met |", "|---|---|---|---|",
            f"| throughput C = {c} / C = 1 (HTTP) | {r['http']:.2f}x | >= "
            f"{r['target']:g}x | {_met(r['met'])} |",
            f"| throughput C = {c} / C = 1 (in-process) | {r['direct']:.2f}x | - | - |",
            f"| errors (every phase) | {res['errors']} | 0 | {_met(not res['errors'])} |",
            f"| leaks across scopes | {res['leaks']} | 0 | {_met(not res['leaks'])} |",
            f"| acknowledged remembers missing (after the run, after kill -9 + restart, at the "
            f"end) | {res['check_after_http']['missing']} / {res['check_after_kill9']['missing']}"
            f" / {res['check_final']['missing']} of {res['check_final']['acknowledged']} | 0 | "
            f"{_met(not res['missing'])} |",
            f"| HTTP / in-process calls/s (C = 1, C = {c}) | "
            + " / ".join(f"{v:.2f}" for v in res["transport_cost"].values()) + " | - | - |"]
  return "\n".join(lines)
