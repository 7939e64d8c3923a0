"""experiments/llm_episode.py end to end against a chat-completions server on 127.0.0.1.

The server plays an LLM that cites exactly the gold memories shown to it, answers one request with
HTTP 500 (retried) and some with malformed text (no update, counted). The benchmark is a user JSONL
bank with precomputed embeddings (no model download): per query, the gold memory lies along a hidden
rotation of the query and the distractors along the query itself, so the frozen retriever misses the
gold and a learned adapter can find it.
"""
from __future__ import annotations

import http.server
import json
import os
import pathlib
import re
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from ear_jax.agent.memory import episode as episode_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import episode as core_episode
from ear_jax.core.config import EARConfig, default_hparams

from tests.core_utils import learnable_stream

_REPO = pathlib.Path(__file__).resolve().parents[1]
_MEMORY_LINE = re.compile(r"^\[(\d+)\] (.*)$")


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def __init__(self, gold_texts):
    super().__init__(("127.0.0.1", 0), _Handler)
    self.gold_texts = gold_texts
    self.count = 0
    self.lock = threading.Lock()


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"

  def log_message(self, *args):
    pass

  def do_POST(self):  # pylint: disable=invalid-name
    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
    srv: _Server = self.server
    with srv.lock:
      srv.count += 1
      n = srv.count
    if n == 1:
      self._send(500, {"error": {"message": "warming up"}})
      return
    user = body["messages"][-1]["content"]
    shown = [m.group(2) for line in user.splitlines() if (m := _MEMORY_LINE.match(line))]
    cited = [i for i, t in enumerate(shown) if t in srv.gold_texts]
    if n % 9 == 0:
      text = "I am not sure which memories helped."  # no citation list: unparseable
    else:
      text = "Answer.\n" + (f"[{', '.join(map(str, cited))}]" if cited else "[NO_CITE]")
    self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": "stop"}]})

  def _send(self, status, obj):
    raw = json.dumps(obj).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(raw)))
    self.end_headers()
    self.wfile.write(raw)


def _write_bank(tmp_path, n=60, k=8):
  st = learnable_stream(0, n, d=16, k=k, num_gold=1)
  lines, texts, emb, gold_texts = [], [], [], set()
  for i in range(n):
    for j in range(k):
      text = f"memory {j} of bank {i}"
      lines.append({"type": "memory", "id": f"m{i}-{j}", "text": text, "bank": f"b{i}"})
      texts.append(text)
      emb.append(st.candidates[i, j])
      if st.gold[i, j]:
        gold_texts.add(text)
    lines.append({"type": "query", "id": f"q{i}", "text": f"question number {i}?", "bank": f"b{i}",
                  "gold": [f"m{i}-{j}" for j in np.nonzero(st.gold[i])[0]]})
    texts.append(f"question number {i}?")
    emb.append(st.queries[i])
  jsonl = tmp_path / "bank.jsonl"
  jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
  npz = tmp_path / "emb.npz"
  np.savez(npz, texts=np.asarray(texts), embeddings=np.asarray(emb, np.float32))
  return jsonl, npz, gold_texts


@pytest.mark.slow
def test_run_critic_episode_with_a_jitted_critic_equals_run_episode():
  """The host loop (one jitted Explorer round per batch, critic(key, view) per query, one learner
  step per batch) with the simulated critic is `run_episode` exactly: same keys, same step."""
  stream = learnable_stream(0, 10, d=16, k=8, num_gold=2)  # 10 queries: the last batch is padded
  cfg = EARConfig(dim=16, num_candidates=8, slate_size=3, num_rounds=2, batch_size=4,
                  buffer_capacity=16, replay_size=2)
  hp = default_hparams(learning_rate=0.05)
  critic = critic_lib.make_simulated_critic(0.8, 0.9)
  texts = np.full((10, 8), "memory")
  state, stats = episode_lib.run_critic_episode(jax.random.PRNGKey(3), stream,
                                                [f"q{i}" for i in range(10)], texts, critic, cfg,
                                                hp)
  ref, _ = core_episode.run_episode(jax.random.PRNGKey(3), stream, cfg, hp, critic)
  assert stats == {"critic_calls": 20, "critic_ok": 20, "learner_steps": 3, "queries": 10}
  assert int(state.step) == int(ref.step) == 3 and int(state.queries_seen) == 10
  for x, y in zip(jax.tree_util.tree_leaves((state.params, state.buffer)),
                  jax.tree_util.tree_leaves((ref.params, ref.buffer))):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_llm_episode_program_learns_from_a_loopback_llm(tmp_path, monkeypatch):
  for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
    monkeypatch.delenv(var, raising=False)
  jsonl, npz, gold_texts = _write_bank(tmp_path)
  srv = _Server(gold_texts)
  thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
  thread.start()
  out = tmp_path / "result.json"
  env = {**os.environ, "NO_PROXY": "127.0.0.1", "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": str(_REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
  for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
    env.pop(var, None)
  try:
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.llm_episode", "--benchmark=jsonl", f"--jsonl={jsonl}",
         f"--encoder={npz}", "--k=8", "--num_rounds=2", "--learning_rate=0.03",
         f"--base_url=http://127.0.0.1:{srv.server_address[1]}/v1", "--model=loopback",
         "--api_key_env=EAR_TEST_NO_KEY", "--timeout_s=5", "--max_retries=2",
         "--backoff_base_s=0", f"--out={out}", f"--cache_dir={tmp_path / 'cache'}",
         "--llm_cache_dir=", "--simulated=1:1"],
        cwd=_REPO, env=env, capture_output=True, text=True, timeout=300)
  finally:
    srv.shutdown()
    srv.server_close()
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads(out.read_text())
  assert res["num_train_queries"] == 48 and res["num_test_queries"] == 12
  critic = res["critic"]
  assert critic["calls"] == 48 * 2 and critic["retries"] == 1 and critic["http_error"] == 0
  assert critic["unparseable"] >= 5 and critic["ok"] == 96 - critic["unparseable"]
  assert res["episode"]["critic_no_update"] == critic["unparseable"]
  assert res["episode"]["learner_steps"] == 12 and res["params_finite"]
  assert res["test_recall@5_retriever"] <= 20.0
  assert res["test_recall@5_ear_adapter"] >= res["test_recall@5_retriever"] + 40.0
  # The simulated critic P = R = 1 (an oracle, like this loopback LLM) ran the same episode.
  oracle = res["runs"]["simulated P=1 R=1"]
  assert oracle["episode"]["critic_ok"] == 96 and "critic_no_update" not in oracle["episode"]
  assert oracle["test_recall@5_adapter"] >= res["test_recall@5_retriever"] + 40.0
