"""The answer critic with an agent's own answers: `experiment.agent_answers` and
`experiments.critic_eval --answers=llm`."""
import json
import os
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

from ear_jax.agent.llm.client import ChatResult
from ear_jax.data.corpus import Bank, Corpus, Query
from ear_jax.experiment import agent_answers

_REPO = pathlib.Path(__file__).resolve().parent.parent


def _bench(name="locomo"):
  """A 3-query stand-in with the fields the answer file is checked against."""
  return types.SimpleNamespace(
      name=name, num_queries=3, query_ids=["c/q0", "c/q1", "c/q2"],
      query_texts=["Where did Ann go?", "What did Bo buy?", "Who called?"],
      categories=np.asarray(["single-hop"] * 3), group=np.zeros(3, np.int32),
      candidate_ids=np.asarray([["m3", "m1", "m0", "m2", "m4", "m5"]] * 3),
      candidate_texts=np.asarray([["t3", "t1", "t0", "t2", "t4", "t5"]] * 3, object))


def _write(path, bench_name="locomo", answers=None):
  answers = answers if answers is not None else [
      {"query_id": "c/q0", "question": "Where did Ann go?", "answer": "Paris", "status": "ok"},
      {"query_id": "c/q2", "question": "Who called?", "answer": "", "status": "empty"}]
  agent_answers.write_answers(path, bench_name, answers, {"model": "fake"})
  return path


def test_answers_read_from_a_file_come_back_in_query_order_blank_outside_the_rows(tmp_path):
  path = _write(tmp_path / "a.json")
  assert agent_answers.read_answers(path, _bench(), [2, 0]) == ["Paris", "", ""]
  assert agent_answers.read_answers(path, _bench(), [0]) == ["Paris", "", ""]


def test_missing_answers_file_is_an_error_naming_it_and_how_to_make_it(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"nope\.json not found.*--generate_answers"):
    agent_answers.read_answers(tmp_path / "nope.json", _bench(), [0])


def test_answers_file_lacking_a_needed_query_names_the_file_and_the_query(tmp_path):
  path = _write(tmp_path / "a.json")
  with pytest.raises(ValueError, match=r"a\.json has no answer for 1 of the 2 queries.*c/q1"):
    agent_answers.read_answers(path, _bench(), [0, 1])


def test_answers_file_whose_question_differs_is_refused_as_misaligned(tmp_path):
  path = _write(tmp_path / "a.json", answers=[
      {"query_id": "c/q0", "question": "Where did Ann fly?", "answer": "Paris", "status": "ok"}])
  with pytest.raises(ValueError, match=r"a\.json: the stored question of 1 queries differs.*c/q0"):
    agent_answers.read_answers(path, _bench(), [0])


def test_answers_file_of_another_benchmark_or_format_is_refused(tmp_path):
  path = _write(tmp_path / "a.json", bench_name="longmemeval")
  with pytest.raises(ValueError, match=r"a\.json holds 'longmemeval' answers, not 'locomo'"):
    agent_answers.read_answers(path, _bench(), [0])
  (tmp_path / "b.json").write_text(json.dumps([1, 2]))
  with pytest.raises(ValueError, match=r"b\.json is not a ear_jax.agent_answers.v1 file"):
    agent_answers.read_answers(tmp_path / "b.json", _bench(), [0])


def test_answer_items_show_the_retriever_top_five_in_rank_order_with_their_dates():
  bank = Bank(ids=[f"m{i}" for i in range(6)], texts=[f"t{i}" for i in range(6)],
              stores=np.zeros(6, np.int8), refs=[()] * 6, dates=[f"d{i}" for i in range(6)])
  corpus = Corpus(name="locomo", banks=[bank],
                  queries=[Query(id="c/q1", text="What did Bo buy?", gold=("m1",),
                                 category="single-hop", group=0, answer="a hat", date="qd")],
                  stats={})
  (item,) = agent_answers.answer_items(_bench(), corpus, [1])
  assert item.memories == (("t3", "d3"), ("t1", "d1"), ("t0", "d0"), ("t2", "d2"), ("t4", "d4"))
  assert (item.id, item.question, item.gold, item.question_date) == ("c/q1", "What did Bo buy?",
                                                                     "a hat", "qd")


class _Client:
  """Answers with the scripted texts (None: a failed call), recording the requests."""

  def __init__(self, texts):
    self.texts, self.requests = list(texts), []

  def complete(self, messages, **decoding):
    self.requests.append((messages, decoding))
    text = self.texts[len(self.requests) - 1]
    return ChatResult(text=text or "", usage={}, status="ok" if text is not None else
                      "http_error", attempts=1, error=None if text is not None else "HTTP 500")


def test_generate_answers_makes_one_qa_answer_call_per_question_and_blanks_failures():
  from ear_jax.agent.llm import qa, qa_prompts
  items = [qa.QAItem(id=f"q{i}", question=f"Q{i}?", gold="", category="c",
                     memories=(("mem", "d"),)) for i in range(3)]
  client = _Client([" Paris \n", "   ", None])
  out = agent_answers.generate_answers(client, items, max_workers=1, progress=False)
  assert [(a["answer"], a["status"]) for a in out] == [("Paris", "ok"), ("", "empty"),
                                                       ("", "http_error")]
  assert len(client.requests) == 3
  sent = sorted(client.requests, key=lambda r: r[0][1]["content"])
  assert sent[0] == (qa_prompts.answer_messages("Q0?", (("mem", "d"),)),
                     {"temperature": 0.0, "max_tokens": qa.ANSWER_MAX_TOKENS})


def _program(*args, timeout=900):
  env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "experiments.critic_eval", "--critic=answer",
                         "--subset=test", *args], cwd=_REPO, env=env, capture_output=True,
                        text=True, timeout=timeout)


@pytest.mark.slow
def test_program_with_llm_answers_and_no_answers_file_names_the_file(tmp_path):
  # Before any work: the (empty) data directory is never read.
  res = _program(f"--data_dir={tmp_path}", "--seeds=1", "--limit=1", "--answers=llm",
                 f"--answers_file={tmp_path / 'none.json'}", f"--out={tmp_path / 'o.json'}")
  assert res.returncode != 0
  assert "none.json not found" in res.stderr + res.stdout
  assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_program_reads_the_llm_answers_and_prints_them_beside_the_gold_row(data_dir, locomo_path,
                                                                          minilm, tmp_path):
  """On conversation 0 of LoCoMo, answers from the file (each question given the next one's gold
  answer: a wrong agent) replace the gold ones in the second row: its recall drops."""
  from ear_jax.data import candidates
  from ear_jax.experiment import runner
  bench = candidates.load_benchmark("locomo", data_dir=data_dir, limit=1, progress=False)
  test = runner.seed_splits(bench.num_queries, [0])[1][0]
  agent_answers.write_answers(tmp_path / "wrong.json", "locomo", [
      {"query_id": bench.query_ids[n], "question": bench.query_texts[n],
       "answer": bench.answers[(n + 1) % bench.num_queries], "status": "ok"} for n in test],
                              {"model": "wrong", "memories_shown": 5})
  res = _program(f"--data_dir={data_dir}", "--seeds=1", "--limit=1", "--answers=llm",
                 f"--answers_file={tmp_path / 'wrong.json'}", f"--out={tmp_path / 'o.json'}")
  assert res.returncode == 0, res.stderr[-2000:]
  assert "| answer critic, wrong's answers (retriever top-5) |" in res.stdout
  crit = json.loads((tmp_path / "o.json").read_text())["critics"]
  names = list(crit)
  assert names[0].endswith("gold answers") and names[1].startswith("answer critic, wrong's")
  gold_row, llm_row = crit[names[0]]["protocol"], crit[names[1]]["protocol"]
  assert llm_row["recall"] < gold_row["recall"] - 0.2, (llm_row, gold_row)


@pytest.mark.slow
@pytest.mark.real_llm
def test_local_llm_answers_two_locomo_questions_from_their_top_five(data_dir, minilm, tmp_path,
                                                                   monkeypatch, local_llm):
  llm_server = local_llm
  from ear_jax.agent.llm.client import ChatClient, ChatClientConfig
  from ear_jax.data import candidates, corpora
  monkeypatch.setenv("NO_PROXY", "127.0.0.1")
  bench = candidates.load_benchmark("locomo", data_dir=data_dir, limit=1, progress=False)
  corpus = corpora.load_corpus("locomo", data_dir=data_dir, limit=1)
  items = agent_answers.answer_items(bench, corpus, [0, 1])
  with llm_server.LlamaServer(n_ctx=4096) as srv:
    client = ChatClient(ChatClientConfig(base_url=srv.base_url, model=srv.model, temperature=0.0,
                                         seed=0, timeout_s=180.0, cache_dir=str(tmp_path / "c")))
    out = agent_answers.generate_answers(client, items, progress=False)
  assert [a["status"] for a in out] == ["ok", "ok"] and all(a["answer"] for a in out)
  agent_answers.write_answers(tmp_path / "a.json", "locomo", out, {"model": srv.model})
  assert agent_answers.read_answers(tmp_path / "a.json", bench, [0, 1])[:2] == [
      a["answer"] for a in out]
