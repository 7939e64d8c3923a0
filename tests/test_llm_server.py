"""Tests of ear_jax/agent/llm/server.py: locating the model, start-up failures, readiness, stopping.

The real llama.cpp server is exercised in tests/test_llm_real.py (slow tier); here the server is a
small Python command (`command=`), so these tests need no `llama_cpp`.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from ear_jax.agent.llm import server as llm_server
from ear_jax.agent.llm.server import LlamaServer, LlamaServerError
from tests.llm_fakes import FAKE_FORKING_SERVER, FAKE_MODELS_SERVER

@pytest.fixture
def gguf(tmp_path) -> pathlib.Path:
  path = tmp_path / "tiny.gguf"
  path.write_bytes(b"GGUF" + bytes(60))
  return path


def test_server_command_is_llama_cpp_server_on_the_given_host_and_port():
  argv = llm_server.server_command("/m.gguf", "127.0.0.1", 8123, model_alias="a", n_ctx=512,
                                   n_threads=2, extra_args=["--n_batch", "64"])
  assert argv[:3] == [sys.executable, "-m", "llama_cpp.server"]
  pairs = dict(zip(argv[3::2], argv[4::2]))
  assert pairs == {"--model": "/m.gguf", "--host": "127.0.0.1", "--port": "8123",
                   "--model_alias": "a", "--n_ctx": "512", "--n_threads": "2",
                   "--n_threads_batch": "2", "--n_batch": "64"}
  default = llm_server.server_command("/m.gguf", "127.0.0.1", 1, model_alias="a")
  assert default[default.index("--n_threads") + 1] == "1"
  assert "--n_threads" not in llm_server.server_command("/m.gguf", "h", 1, model_alias="a",
                                                        n_threads=None)


def test_missing_model_file_is_an_error_naming_it(tmp_path):
  missing = tmp_path / "nope.gguf"
  with pytest.raises(LlamaServerError, match="nope.gguf.*does not exist"):
    LlamaServer(missing, command=[sys.executable, "-c", "pass"]).start()


def test_a_file_that_is_not_gguf_is_an_error_naming_it(tmp_path):
  pointer = tmp_path / "lfs.gguf"
  pointer.write_text("version https://git-lfs.github.com/spec/v1\n")
  with pytest.raises(LlamaServerError, match="lfs.gguf.*not a GGUF file"):
    llm_server.check_gguf(pointer)


def test_default_gguf_is_found_without_importing_the_package(tmp_path, monkeypatch):
  package = tmp_path / llm_server.GGUF_PACKAGE
  package.mkdir()
  (package / "__init__.py").write_text("raise ImportError('importing this package is not allowed')")
  (package / llm_server.GGUF_FILE).write_bytes(b"GGUF")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, llm_server.GGUF_PACKAGE, raising=False)
  assert llm_server.default_gguf_path() == package / llm_server.GGUF_FILE
  assert llm_server.GGUF_PACKAGE not in sys.modules


def test_missing_default_package_names_the_requirements_file(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(llm_server.importlib.util, "find_spec",
                      lambda name, *a: None if name == llm_server.GGUF_PACKAGE else real(name, *a))
  with pytest.raises(LlamaServerError, match="requirements-llm.txt"):
    llm_server.default_gguf_path()


def test_missing_llama_cpp_names_the_requirements_file(monkeypatch, gguf):
  real = importlib.util.find_spec
  monkeypatch.setattr(llm_server.importlib.util, "find_spec",
                      lambda name, *a: None if name == "llama_cpp" else real(name, *a))
  with pytest.raises(LlamaServerError, match=r"modules \[.*'llama_cpp'.*requirements-llm.txt"):
    LlamaServer(gguf).start()


def test_server_that_exits_at_start_is_an_error_naming_the_log(gguf, tmp_path):
  log = tmp_path / "server.log"
  code = "import sys; print('ggml: illegal instruction (simulated)'); sys.exit(3)"
  server = LlamaServer(gguf, log_path=log, command=[sys.executable, "-c", code])
  t0 = time.monotonic()
  with pytest.raises(LlamaServerError) as info:
    server.start()
  assert time.monotonic() - t0 < 10
  message = str(info.value)
  assert "exited with code 3" in message and str(log) in message
  assert "illegal instruction (simulated)" in message  # the log's last lines are quoted
  assert not server.running


@pytest.mark.slow
def test_server_that_never_answers_times_out_and_is_stopped(gguf, tmp_path):
  log = tmp_path / "silent.log"
  server = LlamaServer(gguf, log_path=log, startup_timeout_s=1.0, stop_timeout_s=2.0,
                       command=[sys.executable, "-c", "import time; time.sleep(60)"])
  t0 = time.monotonic()
  with pytest.raises(LlamaServerError, match=r"did not answer .*within 1s.*silent.log"):
    server.start()
  assert time.monotonic() - t0 < 10
  assert not server.running and server.process is None


@pytest.mark.slow
def test_server_that_ignores_sigterm_is_killed(gguf, tmp_path):
  code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "print('ignoring', flush=True); time.sleep(60)")
  server = LlamaServer(gguf, log_path=tmp_path / "stubborn.log", startup_timeout_s=1.0,
                       stop_timeout_s=0.5, command=[sys.executable, "-c", code])
  t0 = time.monotonic()
  with pytest.raises(LlamaServerError, match="did not answer"):
    server.start()
  assert time.monotonic() - t0 < 10 and not server.running


def test_context_manager_waits_until_ready_then_stops(gguf, tmp_path):
  log = tmp_path / "ok.log"
  with LlamaServer(gguf, log_path=log, model_alias="alias-x", startup_timeout_s=30,
                   command=[sys.executable, "-c", FAKE_MODELS_SERVER, "{port}"]) as server:
    assert server.running
    assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
    assert server.model == "alias-x"
    process = server.process
    server.check_alive()
    info = server.info()
    assert info["model_path"] == str(gguf.resolve()) and info["log_path"] == str(log)
  assert process.poll() is not None and not server.running
  assert "fake server up" in log.read_text()
  server.stop()  # a second stop is a no-op


def test_the_model_alias_names_the_gguf_file(gguf, tmp_path):
  with LlamaServer(gguf, log_path=tmp_path / "a.log", startup_timeout_s=30,
                   command=[sys.executable, "-c", FAKE_MODELS_SERVER, "{port}"]) as server:
    assert server.model == "tiny"  # tiny.gguf: another model than the default one's name


def test_check_alive_reports_a_crash_after_start(gguf, tmp_path):
  code = FAKE_MODELS_SERVER.replace("serve_forever()",
                                    "handle_request(); print('crashed', flush=True)")
  server = LlamaServer(gguf, log_path=tmp_path / "crash.log", startup_timeout_s=30,
                       command=[sys.executable, "-c", code, "{port}"])
  with server:
    deadline = time.monotonic() + 10
    while server.process.poll() is None and time.monotonic() < deadline:
      time.sleep(0.05)
    with pytest.raises(LlamaServerError, match=r"exited with code 0.*crash.log"):
      server.check_alive()


def test_bad_timeouts_are_value_errors():
  with pytest.raises(ValueError, match="startup_timeout_s"):
    LlamaServer(startup_timeout_s=0)
  with pytest.raises(ValueError, match="stop_timeout_s"):
    LlamaServer(stop_timeout_s=float("nan"))


def test_base_url_before_start_is_an_error():
  with pytest.raises(LlamaServerError, match="not been started"):
    _ = LlamaServer().base_url


@pytest.mark.slow  # a subprocess: ~3 s
def test_program_exits_with_an_error_naming_a_missing_model(tmp_path):
  missing = tmp_path / "absent.gguf"
  repo = pathlib.Path(__file__).resolve().parents[1]
  proc = subprocess.run([sys.executable, "-m", "ear_jax.agent.llm.server_cli",
                         f"--model_path={missing}"],
                        cwd=repo, capture_output=True, text=True, timeout=60, check=False)
  assert proc.returncode == 1
  assert "absent.gguf" in proc.stderr and "does not exist" in proc.stderr


def test_a_port_already_in_use_is_an_error_never_taken_for_our_server(gguf, tmp_path):
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as orphan:  # e.g. an orphaned server of an earlier run
    orphan.bind(("127.0.0.1", 0))
    orphan.listen()
    port = orphan.getsockname()[1]
    server = LlamaServer(gguf, port=port, log_path=tmp_path / "s.log",
                         command=[sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(LlamaServerError, match=f"port {port} .* already in use"):
      server.start()
    assert server.process is None


# ------------------------------------------------------------------------------------------------
# processes the server forked stop with it


def _alive(pid: int) -> bool:
  """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
  except FileNotFoundError:
    return False
  except OSError:  # no /proc (not Linux)
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return False
    return True


def _forked_pids(pid_file: pathlib.Path, timeout_s: float = 30) -> list[int]:
  deadline = time.monotonic() + timeout_s
  while not pid_file.exists():
    assert time.monotonic() < deadline, "the fake server never wrote its children's pids"
    time.sleep(0.05)
  return [int(p) for p in pid_file.read_text().split()]


def _assert_gone(pids: list[int], what: str, timeout_s: float = 20):
  deadline = time.monotonic() + timeout_s
  try:
    while any(map(_alive, pids)) and time.monotonic() < deadline:
      time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    assert not left, f"processes forked by the server {left} still run {timeout_s:g} s after {what}"
  finally:
    for p in pids:  # never leave them behind, whatever happened
      try:
        os.kill(p, signal.SIGKILL)
      except ProcessLookupError:
        pass


@pytest.mark.slow  # three processes: ~2 s
def test_stop_also_stops_the_processes_the_server_forked(gguf, tmp_path):
  pid_file = tmp_path / "kids"
  with LlamaServer(gguf, log_path=tmp_path / "fork.log", startup_timeout_s=30,
                   command=[sys.executable, "-c", FAKE_FORKING_SERVER, "{port}", str(pid_file)]):
    kids = _forked_pids(pid_file)
    assert all(map(_alive, kids))
  _assert_gone(kids, "stop()")


_STARTER = r"""
import sys, time
from ear_jax.agent.llm.server import LlamaServer
LlamaServer(sys.argv[1], log_path=sys.argv[2], startup_timeout_s=60,
            command=[sys.executable, "-c", sys.argv[3], "{port}", sys.argv[4]]).start()
print("READY", flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # a starter process that imports the package: ~5 s
def test_sigkill_of_the_starter_also_stops_the_processes_the_server_forked(gguf, tmp_path):
  pid_file = tmp_path / "kids"
  repo = pathlib.Path(__file__).resolve().parents[1]
  starter = subprocess.Popen(
      [sys.executable, "-c", _STARTER, str(gguf), str(tmp_path / "fork.log"), FAKE_FORKING_SERVER,
       str(pid_file)], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
      env={**os.environ, "PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"})
  try:
    assert starter.stdout.readline().startswith("READY"), (tmp_path / "fork.log").read_text()
    kids = _forked_pids(pid_file)
    assert all(map(_alive, kids))
    starter.kill()
  finally:
    if starter.poll() is None:
      starter.kill()
    starter.wait(timeout=30)
    starter.stdout.close()
  _assert_gone(kids, "the starting process was killed")
