"""Serves one persistent EAR `Memory` over the Model Context Protocol (stdio or streamable HTTP).

  python -m experiments.mcp_server --memory_dir=~/.ear_memory                 # stdio (default)
  python -m experiments.mcp_server --memory_dir=DIR --method=ear --candidates=hybrid
  EAR_MCP_TOKEN=secret python -m experiments.mcp_server --memory_dir=DIR --transport=http --port=8765

Tools: remember, recall, cite, search, forget, stats (`ear_jax.agent.mcp_server`). The memory is
`Memory.open(--memory_dir)`: created with the flags' settings when the directory holds none, else
opened (a restart continues where it stopped; a memory of other settings is refused at start,
naming the differing fields). Every `remember` / `forget` is durable when it is acknowledged; the
learner is saved every `--save_learner_s` seconds after a change and at shutdown (stdin EOF,
SIGTERM, Ctrl-C). HTTP is served on loopback unless `--host` names another address (then a bearer
token is required). Concurrent HTTP clients are served at once (`--worker_threads` tool calls);
the memory micro-batches their questions and texts (`--batch_window_ms`: one encoder call and one
search per window) and the encoder answers a small batch quickly (`--encoder_batch_tokens`).

Needs `pip install mcp` (requirements.txt).
"""
import dataclasses
import os
import pathlib
import signal
import sys

from absl import app
from absl import flags
from absl import logging

from ear_jax.agent import mcp_server
from ear_jax.agent import mcp_stdio
from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.agent.memory import config as config_lib
from ear_jax.agent.memory.config import DEFAULT_METHOD  # (a new directory's, as Memory()'s)
from ear_jax.core.config import METHODS
from ear_jax.data import encoders
from ear_jax.data import first_stage

# Tokens per encoder call: one question pays for a whole call (the encoder's bulk default, 4,096,
# is a 128 x 32 batch). `python -m experiments.bench --suite=server` reports the cost of one
# question and of 16 (`encode_1_ms`, `encode_16_ms`; `--server_encoder_batch_tokens=4096` for the
# default): on 2 loaded CPU cores 0.26-0.32 s / 0.34-0.45 s at 512, 2.2 s for one at 4,096.
BATCH_TOKENS = 512

_DIR = flags.DEFINE_string("memory_dir", None, "The memory directory (created with the settings "
                           "below if it holds no memory; else opened, and its stored settings "
                           "must equal them).", required=True)
_METHOD = flags.DEFINE_enum("method", None, list(METHODS), "EAR method of the memory (config "
                            "and hyperparameters). Default: the directory's; for a new one "
                            "'ear_safe' (the held-out guard: RESULTS.md \"The held-out guard\").")
_CANDIDATES = flags.DEFINE_enum("candidates", None, ["dense", "bm25", "hybrid"],
                                "First stage: frozen cosine, BM25, or both fused. Default: the "
                                "directory's; for a new one 'hybrid' (MemoryConfig's default with "
                                "an encoder; RESULTS.md \"First stage\").")
_FEATURES = flags.DEFINE_enum("features", None, list(first_stage.FEATURE_SETS), "Side features "
                              "of each candidate: first_stage, or context (plus same session, "
                              "adjacent turn and speaker named; a session is a scope and a "
                              "date: remember a session's turns with its date; RESULTS.md "
                              "\"Context features\"). Default: the directory's; for a new one "
                              "first_stage.")
_ENCODER = flags.DEFINE_string("encoder", "minilm", "Encoder spec of the memory: 'minilm' or a "
                               "local Hugging Face checkpoint directory.")
_CACHE = flags.DEFINE_string("cache_dir", None, "Embedding cache directory (default: none).")
_SAVE_LEARNER = flags.DEFINE_float("save_learner_s", mcp_server.SAVE_LEARNER_S, "Save the learner "
                                   "(adapter, replay buffer, open sessions) this often after a "
                                   "change, and at shutdown (0: at shutdown only); memories are "
                                   "durable at once.", lower_bound=0.0)
_TRANSPORT = flags.DEFINE_enum("transport", "stdio", ["stdio", "http"], "MCP transport: stdio, or "
                               "streamable HTTP at http://HOST:PORT/mcp.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "HTTP address to bind. Only loopback unless given "
                            "explicitly; a non-loopback address requires a bearer token.")
_PORT = flags.DEFINE_integer("port", 8765, "HTTP port.")
_TOKEN_ENV = flags.DEFINE_string("token_env", "EAR_MCP_TOKEN", "Environment variable holding the "
                                 "HTTP bearer token; when it is set, every HTTP request must send "
                                 "'Authorization: Bearer <token>'.")
_SEED = flags.DEFINE_integer("seed", 0, "Learner seed of the memory.")
_WORKERS = flags.DEFINE_integer("worker_threads", mcp_server.WORKER_THREADS, "Tool calls served "
                                "at once (worker threads); more wait for a free one.",
                                lower_bound=1)
_WINDOW = flags.DEFINE_float("batch_window_ms", 5.0, "Micro-batching: the questions and texts "
                             "that arrive within this many milliseconds share one encoder call "
                             "and one search (MemoryConfig.batch_window_ms; 0: each call alone).",
                             lower_bound=0.0)
_BATCH_MAX = flags.DEFINE_integer("batch_max_queries", 64, "Micro-batching: a window closes early "
                                  "once it holds this many queries.", lower_bound=1)
_BATCH_TOKENS = flags.DEFINE_integer("encoder_batch_tokens", BATCH_TOKENS, "Tokens per encoder "
                                     "call (rows x padded length) of a checkpoint encoder: one "
                                     "question costs a whole call, so a server answering single "
                                     "questions wants a small one (512: 16 questions of up to 32 "
                                     "tokens; the encoder's bulk default is 4,096).",
                                     lower_bound=1)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # (stdout is the protocol; orbax logs each save)
  host = _HOST.value
  token = os.environ.get(_TOKEN_ENV.value) or None
  if _TRANSPORT.value == "http" and not mcp_server.is_loopback(host) and not token:
    sys.exit(f"--host={host} is not a loopback address: set the bearer token in "
             f"${_TOKEN_ENV.value} first (the memory would be open to the network)")
  memory_dir = pathlib.Path(_DIR.value).expanduser()
  try:  # (a second server on this directory is refused, naming the first one's pid)
    encoder = encoders.load_encoder(_ENCODER.value, tokens_per_batch=_BATCH_TOKENS.value)
    on_disk = config_lib.stored_memory_config(memory_dir)
    stored = on_disk if _METHOD.value is None else None
    learner = (dict(method=stored.method, config=stored.config, hparams=stored.hparams)
               if stored is not None else dict(method=_METHOD.value or DEFAULT_METHOD))
    fs = on_disk.first_stage if on_disk is not None else first_stage.FirstStageOptions()
    if _FEATURES.value is not None:
      fs = dataclasses.replace(fs, features=_FEATURES.value)
    memory = Memory.open(memory_dir, MemoryConfig(
        **learner, candidates=_CANDIDATES.value, first_stage=fs, encoder=_ENCODER.value,
        cache_dir=_CACHE.value, seed=_SEED.value, batch_window_ms=_WINDOW.value,
        batch_max_queries=_BATCH_MAX.value), encoder=encoder)
  except ValueError as e:
    sys.exit(f"mcp_server: {e}")
  service = mcp_server.MemoryService(memory, memory_dir, _SAVE_LEARNER.value)
  server = mcp_server.build_server(service, host=host, port=_PORT.value,
                                   worker_threads=_WORKERS.value)

  def on_term(signum, frame):
    del signum, frame
    if service.closed:  # the final save is running (in this thread): let it finish, then exit
      return
    service.close()
    os._exit(0)  # pylint: disable=protected-access

  signal.signal(signal.SIGTERM, on_term)
  try:
    if _TRANSPORT.value == "stdio":
      mcp_stdio.serve_stdio(server)  # returns at stdin EOF
    else:
      print(f"EAR memory MCP server at http://{host}:{_PORT.value}/mcp"
            + (" (bearer token required)" if token else ""), file=sys.stderr, flush=True)
      mcp_server.serve_http(server, host, _PORT.value, token)
  except KeyboardInterrupt:
    pass
  finally:
    service.close()


if __name__ == "__main__":
  app.run(main)
