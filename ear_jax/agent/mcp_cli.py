"""`ear-mcp-server`: one persistent EAR `Memory` served over the Model Context Protocol.

  ear-mcp-server --memory_dir=~/.ear_memory                        # stdio (default)
  ear-mcp-server --memory_dir=DIR --method=ear --candidates=hybrid --k=50
  EAR_MCP_TOKEN=secret ear-mcp-server --memory_dir=DIR --transport=http --port=8765

The memory is `Memory.open(--memory_dir)`: created with the flags' settings, or reopened (other
settings than the directory's are refused). The learner is saved every `--save_learner_s` seconds
after a change and at shutdown. HTTP off loopback requires a bearer token.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import signal
import sys
from typing import Optional, Sequence

from ear_jax.agent import mcp_http
from ear_jax.agent import mcp_server

# Tokens per encoder call of a checkpoint encoder: small, for single questions.
BATCH_TOKENS = 512


def _at_least(minimum, kind):
  def parse(text):
    value = kind(text)
    if value < minimum:
      raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
    return value
  return parse


def parser() -> argparse.ArgumentParser:
  """The program's flags."""
  from ear_jax.core.config import METHODS  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(prog="ear-mcp-server", description="One persistent EAR memory "
                              "served over the Model Context Protocol (stdio or HTTP).",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add = p.add_argument
  add("--memory_dir", required=True, help="The memory directory (created with the settings below "
      "if it holds no memory; else opened, and its stored settings must equal them).")
  add("--method", choices=list(METHODS), default=None, help="EAR method of the memory (config and "
      "hyperparameters). Default: the directory's; for a new one the default learner "
      "(ear_jax.agent.memory.config.DEFAULT_METHOD).")
  add("--candidates", choices=["dense", "bm25", "hybrid"], default=None, help="First stage: "
      "frozen cosine, BM25, or both fused. Default: the directory's; for a new one 'hybrid'.")
  add("--k", type=_at_least(1, int), default=None, help="K, the candidates per question the "
      "learner picks each slate from (MemoryConfig.num_candidates). Default: the directory's; for "
      "a new one the preset's pool (100 for the default ear_safe; 20 for the others).")
  add("--encoder", default="minilm", help="Encoder spec of the memory: 'minilm' or a local "
      "Hugging Face checkpoint directory.")
  add("--cache_dir", default=None, help="Embedding cache directory (default: none).")
  add("--save_learner_s", type=_at_least(0.0, float), default=mcp_server.SAVE_LEARNER_S,
      help="Save the learner (adapter, replay buffer, open sessions) this often after a change, "
      "and at shutdown (0: at shutdown only); memories are durable at once.")
  add("--transport", choices=["stdio", "http"], default="stdio", help="MCP transport: stdio, or "
      "streamable HTTP at http://HOST:PORT/mcp.")
  add("--host", default="127.0.0.1", help="HTTP address to bind. Only loopback unless given "
      "explicitly; a non-loopback address requires a bearer token.")
  add("--port", type=int, default=8765, help="HTTP port.")
  add("--token_env", default="EAR_MCP_TOKEN", help="Environment variable holding the HTTP bearer "
      "token; when it is set, every HTTP request must send 'Authorization: Bearer <token>'.")
  add("--seed", type=int, default=0, help="Learner seed of a new memory.")
  add("--worker_threads", type=_at_least(1, int), default=mcp_server.WORKER_THREADS,
      help="Tool calls served at once (worker threads); more wait for a free one.")
  add("--batch_window_ms", type=_at_least(0.0, float), default=5.0, help="Micro-batching: the "
      "questions and texts arriving within this many milliseconds share one encoder call and "
      "one search (0: each call alone).")
  add("--batch_max_queries", type=_at_least(1, int), default=64, help="Micro-batching: a window "
      "closes early once it holds this many queries.")
  add("--encoder_batch_tokens", type=_at_least(1, int), default=BATCH_TOKENS, help="Tokens per "
      "encoder call (rows x padded length) of a checkpoint encoder.")
  return p


def open_memory(args):
  """The `Memory` of the parsed flags: the directory's settings, the flags given on top."""
  from ear_jax.agent.memory import Memory, MemoryConfig  # pylint: disable=g-import-not-at-top
  from ear_jax.agent.memory import config as config_lib  # pylint: disable=g-import-not-at-top
  from ear_jax.data import encoders  # pylint: disable=g-import-not-at-top
  from ear_jax.data import first_stage  # pylint: disable=g-import-not-at-top
  memory_dir = pathlib.Path(args.memory_dir).expanduser()
  encoder = encoders.load_encoder(args.encoder, tokens_per_batch=args.encoder_batch_tokens)
  on_disk = config_lib.stored_memory_config(memory_dir)
  stored = on_disk if args.method is None else None
  learner = (dict(method=stored.method, config=stored.config, hparams=stored.hparams)
             if stored is not None else dict(method=args.method or config_lib.DEFAULT_METHOD))
  fs = on_disk.first_stage if on_disk is not None else first_stage.FirstStageOptions()
  k = args.k if args.k is not None or on_disk is None else on_disk.num_candidates
  return Memory.open(memory_dir, MemoryConfig(
      **learner, num_candidates=k, candidates=args.candidates, first_stage=fs,
      encoder=args.encoder, cache_dir=args.cache_dir, seed=args.seed,
      batch_window_ms=args.batch_window_ms, batch_max_queries=args.batch_max_queries,
      warm_learner=True),  # (a shutdown never waits for the compiler)
                     encoder=encoder), memory_dir


def main(argv: Optional[Sequence[str]] = None) -> None:
  """Parses `argv` and serves until stdin ends (stdio), or until SIGTERM / SIGINT."""
  args = parser().parse_args(argv)
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)  # (stdout is the protocol; orbax logs each save)
  token = os.environ.get(args.token_env) or None
  if args.transport == "http" and not mcp_http.is_loopback(args.host) and not token:
    sys.exit(f"ear-mcp-server: --host={args.host} is not a loopback address: set the bearer "
             f"token in ${args.token_env} first (the memory would be open to the network)")
  try:  # (a second server on this directory is refused, naming the first one's pid)
    memory, memory_dir = open_memory(args)
  except ValueError as e:
    sys.exit(f"ear-mcp-server: {e}")
  service = mcp_server.MemoryService(memory, memory_dir, args.save_learner_s)
  server = mcp_server.build_server(service, host=args.host, port=args.port,
                                   worker_threads=args.worker_threads)

  def on_term(signum, frame):
    del signum, frame
    if service.closed:  # the final save is running (in this thread): let it finish, then exit
      return
    service.close()
    os._exit(0)  # pylint: disable=protected-access

  # SIGTERM and SIGINT save and exit at once (asyncio would wait for the stdin reader's thread)
  signal.signal(signal.SIGTERM, on_term)
  signal.signal(signal.SIGINT, on_term)
  try:
    if args.transport == "stdio":
      from ear_jax.agent import mcp_stdio  # pylint: disable=g-import-not-at-top
      mcp_stdio.serve_stdio(server)  # returns at stdin EOF
    else:
      print(f"EAR memory MCP server at http://{args.host}:{args.port}/mcp"
            + (" (bearer token required)" if token else ""), file=sys.stderr, flush=True)
      mcp_http.serve_http(server, args.host, args.port, token)
  except KeyboardInterrupt:
    pass
  finally:
    service.close()
  # Everything is saved. Skip the interpreter's teardown: tearing JAX down under the warm-up
  # thread's compilation crashes the process.
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(ValueError, OSError):  # (stdio's transport closed stdout)
      stream.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  main()
