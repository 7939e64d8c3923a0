"""Learning survives every way a client ends the MCP server: the official `mcp` client's own
shutdown (its `stdio_client` context exit: stdin closed, 2 s, SIGTERM, 2 s, SIGKILL), SIGTERM,
SIGINT, and kill -9 after the learner save interval. The learner step is compiled in the
background as the server starts (`MemoryConfig.warm_learner`), so a shutdown never waits for the
compiler: the learner item is saved within 1 s."""
import asyncio
import os
import pathlib
import signal
import time

import pytest

pytest.importorskip("mcp")

from ear_jax.agent.memory import Memory  # pylint: disable=wrong-import-position
from experiments import mcp_agent  # pylint: disable=wrong-import-position

FACTS = [f"fact {i}: the cat number {i} sleeps in room {i}" for i in range(12)]


def _server_pid(memory_dir: pathlib.Path) -> int:
  """The pid of the server process serving `memory_dir` (its command line names it)."""
  for proc in pathlib.Path("/proc").iterdir():
    try:
      cmd = (proc / "cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
      continue
    if b"ear_jax.agent.mcp_cli" in cmd and f"--memory_dir={memory_dir}".encode() in cmd:
      return int(proc.name)
  raise AssertionError(f"no server of {memory_dir}")


async def _serve(memory_dir, log, extra=(), end=None):
  """Runs the server under the official client: remembers FACTS, asks 4 questions (one round
  each, cited: 4 open sessions with feedback, b = 4), then `end(pid)` if given, then the
  client's own shutdown. Returns `(stats before the end, seconds the end took, time the client's
  shutdown began)`."""
  from mcp import ClientSession  # pylint: disable=g-import-not-at-top
  from mcp.client.stdio import stdio_client  # pylint: disable=g-import-not-at-top
  params = mcp_agent.server_params(memory_dir, list(extra), env={"EAR_NO_COMPILATION_CACHE": "1"})
  params.env = {k: v for k, v in params.env.items()  # (every program compiled by the server)
                if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
  with open(log, "w") as errlog:
    async with stdio_client(params, errlog=errlog) as (read, write):
      async with ClientSession(read, write) as s:
        await s.initialize()
        await mcp_agent.must(s, "remember", {"texts": FACTS})
        for q in range(4):
          got = await mcp_agent.must(s, "recall", {"question": f"where does cat {q} sleep?",
                                                    "k": 3})
          await mcp_agent.must(s, "cite", {"retrieval_id": got["retrieval_id"],
                                           "used_ids": [got["memories"][0]["id"]]})
        st = await mcp_agent.must(s, "stats", {})
        if end is not None:
          await end(s, _server_pid(memory_dir))
        began = time.time()
  return st, began


def _saved_at(log) -> tuple[float, str]:
  """`(time, line)` of the server's 'learner saved' line at shutdown."""
  lines = [l for l in pathlib.Path(log).read_text().splitlines() if "shutdown: learner saved" in l]
  assert len(lines) == 1, pathlib.Path(log).read_text()[-3000:]
  return float(lines[0].rsplit(" at ", 1)[1]), lines[0]


def _learned(memory_dir) -> dict:
  with Memory.open(memory_dir) as m:
    st = m.stats
    return {"step": int(m.learner.step), "feedback": st["feedback"], "ready": st["ready"],
            "memories": len(m)}


@pytest.mark.slow  # a real server (MiniLM) compiling everything: ~40 s
def test_the_official_clients_shutdown_saves_the_learning_within_a_second(tmp_path):
  st, began = asyncio.run(_serve(tmp_path / "mem", tmp_path / "err.log"))
  assert st["feedback"] == 4 and st["pending"] == 4 and st["learner_steps"] == 0
  saved, line = _saved_at(tmp_path / "err.log")
  print(f"{line} ({saved - began:.2f} s after stdin closed)")  # (pytest -s shows it)
  assert saved - began <= 1.0, line  # stdin closed at `began`: the save ended within 1 s
  # the 4 open sessions queued at shutdown made the first learner step, saved before the exit
  assert _learned(tmp_path / "mem") == {"step": 1, "feedback": 4, "ready": 0, "memories": 12}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_save_the_learning_within_a_second(tmp_path, sig):
  sent = []

  async def end(session, pid):
    del session
    sent.append(time.time())
    os.kill(pid, sig)
    for _ in range(200):  # (the server exits by itself; the client then finds it gone)
      if not pathlib.Path(f"/proc/{pid}").exists() or b"Z" in pathlib.Path(
          f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1][:3]:
        break
      await asyncio.sleep(0.05)

  asyncio.run(_serve(tmp_path / "mem", tmp_path / "err.log", end=end))
  saved, line = _saved_at(tmp_path / "err.log")
  print(f"{line} ({saved - sent[0]:.2f} s after {sig.name})")  # (pytest -s shows it)
  assert saved - sent[0] <= 1.0, line
  assert _learned(tmp_path / "mem") == {"step": 1, "feedback": 4, "ready": 0, "memories": 12}


@pytest.mark.slow
def test_kill_9_after_the_save_interval_keeps_the_learning_saved_by_then(tmp_path):
  async def end(session, pid):
    await asyncio.sleep(3.0)  # past the save interval (1 s) after the last change: saved
    assert (await mcp_agent.must(session, "stats", {}))["learner_saves"] >= 1
    os.kill(pid, signal.SIGKILL)

  asyncio.run(_serve(tmp_path / "mem", tmp_path / "err.log", ["--save_learner_s=1"], end=end))
  assert "shutdown: learner saved" not in (tmp_path / "err.log").read_text()  # (killed: none)
  with Memory.open(tmp_path / "mem") as m:  # the 4 open sessions and their feedback were saved
    assert m.stats["feedback"] == 4 and m.stats["sessions"] == 4 and len(m) == 12


@pytest.mark.slow  # (subprocesses: seconds each)
def test_a_process_ends_cleanly_while_the_learner_still_compiles(tmp_path):
  # Closed (or the server ended by stdin EOF) while `warm_learner`'s thread compiles: the process
  # must not crash in the interpreter's teardown (it aborted with the compiler running).
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  env = {**os.environ, "PYTHONPATH": str(mcp_agent.REPO), "JAX_PLATFORMS": "cpu"}
  code = ("import sys; from ear_jax.agent.memory import Memory, MemoryConfig; "
          "Memory.open(sys.argv[1], MemoryConfig(encoder=None, dim=16, warm_learner=True)).close()")
  for i in range(2):
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"m{i}")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "terminate" not in done.stderr, done.stderr[-2000:]
    served = subprocess.run(
        [sys.executable, "-m", "ear_jax.agent.mcp_cli", f"--memory_dir={tmp_path / f's{i}'}",
         "--candidates=dense"], env=env, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL)  # (stdin ends at once: saves and exits)
    assert served.returncode == 0, served.stderr[-2000:]
