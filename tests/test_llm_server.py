"""Tests of ear_jax/agent/llm/server.py: locating the model, start-up failures, readiness, stopping.

The real llama.cpp server is exercised in tests/test_llm_real.py (slow tier); here the server is a
small Python command (`command=`), so these tests need no `llama_cpp`.
"""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import time

import pytest

from ear_jax.agent.llm import server as llm_server
from ear_jax.agent.llm.server import LlamaServer, LlamaServerError
from tests.llm_fakes import FAKE_MODELS_SERVER

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
  proc = subprocess.run([sys.executable, "-m", "experiments.llm_server", f"--model_path={missing}"],
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
