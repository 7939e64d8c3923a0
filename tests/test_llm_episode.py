"""A training episode with an LLM critic (`run_critic_episode` + `LLMCritic`) against a
chat-completions server on 127.0.0.1.

The server plays an LLM that cites exactly the gold memories shown to it, answers one request with
HTTP 500 (retried) and some with malformed text (no update, counted). Per query, the gold memory
lies along a hidden rotation of the query and the distractors along the query itself, so the
frozen retriever misses the gold and a learned adapter can find it.
"""
from __future__ import annotations

import http.server
import json
import re
import threading

import jax
import numpy as np
import pytest

from ear_jax.agent.llm.critic import LLMCritic, LLMCriticConfig
from ear_jax.agent.memory import episode as episode_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import episode as core_episode
from ear_jax.core import inference
from ear_jax.core import learner as learner_lib
from ear_jax.core.config import EARConfig, default_hparams

from tests.core_utils import learnable_stream

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


def _texts(stream):
  """`[N, K]` memory texts and the set of the gold ones."""
  n, k = stream.gold.shape
  texts = np.asarray([[f"memory {j} of bank {i}" for j in range(k)] for i in range(n)])
  return texts, set(texts[np.asarray(stream.gold, bool)].tolist())


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
def test_an_episode_learns_from_a_loopback_llm_critic(monkeypatch):
  for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("NO_PROXY", "127.0.0.1")
  stream = learnable_stream(0, 60, d=16, k=8, num_gold=1)
  texts, gold_texts = _texts(stream)
  train, test = stream.take(np.arange(48)), stream.take(np.arange(48, 60))
  cfg = EARConfig(dim=16, num_candidates=8, slate_size=5, num_rounds=2, batch_size=4)
  hp = default_hparams(learning_rate=0.03)
  srv = _Server(gold_texts)
  thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
  thread.start()
  try:
    critic = LLMCritic(LLMCriticConfig(
        base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", model="loopback",
        api_key_env="EAR_TEST_NO_KEY", timeout_s=5, max_retries=2, backoff_base_s=0))
    state, stats = episode_lib.run_critic_episode(
        jax.random.PRNGKey(1), train, [f"question number {i}?" for i in range(48)], texts[:48],
        critic, cfg, hp)
  finally:
    srv.shutdown()
    srv.server_close()
  calls = critic.stats
  assert calls["calls"] == 48 * 2 and calls["retries"] == 1 and calls["http_error"] == 0
  assert calls["unparseable"] >= 5 and calls["ok"] == 96 - calls["unparseable"]
  assert stats["critic_no_update"] == calls["unparseable"] and stats["learner_steps"] == 12
  key = jax.random.PRNGKey(2)
  frozen = learner_lib.init_learner(jax.random.PRNGKey(0), cfg).params
  before = inference.evaluate(key, frozen, test, cfg, hp).recall_adapter
  after = inference.evaluate(key, state.params, test, cfg, hp).recall_adapter
  assert float(before) <= 0.2 and float(after) >= float(before) + 0.4, (before, after)
