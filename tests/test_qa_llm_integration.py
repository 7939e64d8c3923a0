"""End to end with the real local LLM: start llama.cpp's server with the SmolLM2-135M GGUF
(`LlamaServer`), then answer, judge and critique three LoCoMo questions from slates holding their
gold turns. Slow tier; skipped (with the reason printed) when the LLM extra is not installed."""
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.real_llm]  # real_llm: conftest.py


def test_local_llm_answers_judges_and_critiques_three_locomo_questions(data_dir, tmp_path,
                                                                       monkeypatch, local_llm):
  llm_server = local_llm
  from ear_jax.agent.llm import qa
  from ear_jax.agent.llm.client import ChatClient, ChatClientConfig, STATUSES
  from ear_jax.agent.llm.critic import LLMCritic, LLMCriticConfig
  from ear_jax.data import corpora
  if not (data_dir / "locomo10.json").is_file():
    pytest.skip("locomo10.json not found")
  monkeypatch.setenv("NO_PROXY", "127.0.0.1")
  corpus = corpora.load_corpus("locomo", data_dir=data_dir, limit=1)
  bank = corpus.banks[0]
  where = {m: i for i, m in enumerate(bank.ids)}
  items = []
  for q in corpus.queries[:3]:
    first = where[q.gold[0]]
    idx = list(dict.fromkeys([where[g] for g in q.gold] + list(range(first + 1, first + 5))))[:5]
    items.append(qa.QAItem(id=q.id, question=q.text, gold=q.answer, category=q.category,
                           memories=tuple((bank.texts[i], bank.dates[i]) for i in idx)))
  with llm_server.LlamaServer(log_path=tmp_path / "server.log") as server:
    client = ChatClient(ChatClientConfig(base_url=server.base_url, model=server.model,
                                         timeout_s=180.0, cache_dir=str(tmp_path / "cache")))
    report = qa.evaluate_qa(items, client, max_workers=2, progress=False)
    critic = LLMCritic(LLMCriticConfig(base_url=server.base_url, model=server.model,
                                       timeout_s=180.0))
    critiques = [critic.critique(it.question, [t for t, _ in it.memories]) for it in items]
  assert [o.answer_status for o in report.outcomes] == ["ok"] * 3, report.outcomes
  assert all(o.answer.strip() for o in report.outcomes)
  assert report.counters["answer"]["calls"] == 3 and report.counters["judge"]["calls"] == 3
  assert report.counters["answer"]["completion_tokens"] > 0
  for o in report.outcomes:  # constrained JSON verdicts: always usable
    assert o.verdict is not None and o.j in (0.0, 1.0), o.judge_reply
    assert 0.0 <= o.f1 <= 1.0 and 0.0 <= o.bleu1 <= 1.0
  for it, c in zip(items, critiques):
    assert c.status in STATUSES
    if c.status == "ok":
      assert c.labels.shape == (len(it.memories),) and set(c.labels.tolist()) <= {-1.0, 1.0}
  assert sum(c.status == "ok" for c in critiques) >= 1, [c.raw_text for c in critiques]
