"""The MCP server under load: C concurrent clients over loopback HTTP, N memories in S
scopes, every acknowledged write checked, a kill -9 mid-run, and the same workload in-process.

Symbols: `N` memories, `S` scopes, `C` concurrent clients.

`run` prefills a memory directory and starts `ear-mcp-server --transport=http` on it; each client
loops remember / recall / cite / search in its own scope. Phases: warm-up (untimed), C = 1,
C clients, SIGTERM, a kill -9 phase (SIGKILL halfway; calls in flight are counted apart; the
server restarts on the directory), then the same workload in-process (`MemoryService`, threads)
with C = 1 and C. After every phase each acknowledged `remember` must be in the directory and no
result may hold another scope's memory. `table` reports per phase calls/s, p50 / p99 latency,
errors, leaks and batching counters, the ratio C vs 1 (target `THROUGHPUT_TARGET`), and the
encoder alone.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pathlib
import shutil
import tempfile

from ear_jax.agent import mcp_server
from ear_jax.agent.memory import Memory
from ear_jax.data import encoders
from ear_jax.experiment import benchmarking as bm
from ear_jax.experiment.server_load import (QUESTIONS, TOOLS, Server, check_acknowledged,
                                            direct_call, http_call, prefill, run_phase)

THROUGHPUT_TARGET = 3.0  # C = 16 clients vs one, calls/s

_BATCH = ("batch_windows", "batch_requests", "batch_encoder_calls", "batch_searches")


def _batching(before: dict, after: dict) -> dict:
  """The micro-batching counters' growth over a phase (`stats`), and requests per window."""
  d = {k: after.get(k, 0) - before.get(k, 0) for k in _BATCH}
  return {**d, "requests_per_window": d["batch_requests"] / max(d["batch_windows"], 1)}


def encoder_bound(encoder, c: int, reps: int = 3) -> dict:
  """Milliseconds of encoding one question and `c` questions in one call (minimum of `reps`)."""
  out = {}
  for n in (1, c):
    encode = lambda: encoders.encode(encoder, [QUESTIONS[i % len(QUESTIONS)] for i in range(n)],
                                     use_cache=False, progress=False)
    encode()
    out[f"encode_{n}_ms"] = 1e3 * bm.min_time(encode, reps)
  return out


def run(repo: pathlib.Path, *, memories: int = 100_000, scopes: int = 100,
        clients: int = 16, seconds: float = 30.0, warmup_s: float = 10.0,
        batch_window_ms: float = 5.0, encoder_batch_tokens: int = 512,
        server_args: tuple = (),
        timeout_s: float = 300.0) -> dict:
  """The whole benchmark in a new temporary directory, removed after a run without errors and
  kept (its path printed) otherwise. `memories`, `scopes`, `clients`: `N`, `S`, `C`; `seconds`
  per timed phase; `batch_window_ms` / `encoder_batch_tokens` apply to the server and in-process."""
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

  ratio = lambda a, b: phases[a]["calls_per_s"] / phases[b]["calls_per_s"]
  http = ratio(f"http_c{clients}", "http_c1")
  res["throughput_ratio"] = {"http": http, "direct": ratio(f"direct_c{clients}", "direct_c1"),
                             "target": THROUGHPUT_TARGET, "met": bool(http >= THROUGHPUT_TARGET)}
  # HTTP calls/s over in-process calls/s, at 1 and at C clients
  res["transport_cost"] = {f"c{c}": ratio(f"http_c{c}", f"direct_c{c}") for c in (1, clients)}
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
    cells = ["-" if not x["n"] else f"{x['p50_ms']:.0f} / {x['p99_ms']:.0f}"
             for x in (p["tools"][t] for t in TOOLS)]
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
