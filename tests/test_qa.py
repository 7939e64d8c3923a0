"""QA from selected memories: the answer prompt, the judges and their verdict parsing, and
the answer -> F1 / BLEU-1 -> judge pipeline against a fake OpenAI-compatible server (bad / missing
server, empty and garbage replies, a resumed run)."""
import json
import socket

import pytest

from ear_jax.agent.llm import qa
from ear_jax.agent.llm import qa_prompts as qp
from ear_jax.agent.llm.client import ChatClient, ChatClientConfig

MEMS = (("Caroline: I went to the LGBTQ support group yesterday.", "1:56 pm on 8 May, 2023"),
        ("Melanie: I ran a charity race last Saturday.", "7:55 pm on 25 May, 2023"),
        ("Caroline: Adoption agencies are my next research topic.", ""))


def _items():
  return [
      qa.QAItem(id="conv-26/q0", question="When did Caroline go to the LGBTQ support group?",
                gold="7 May 2023", category="temporal", memories=MEMS),
      qa.QAItem(id="conv-26/q1", question="What did Caroline research?", gold="Adoption agencies",
                category="multi-hop", memories=MEMS),
      qa.QAItem(id="conv-26/q2", question="What did Melanie run?", gold="A charity race",
                category="single-hop", memories=MEMS[1:2]),
      qa.QAItem(id="conv-26/q3", question="Where does Melanie live?", gold="Boston",
                category="single-hop", memories=()),
  ]


ANSWERS = {"When did Caroline go": "7 May 2023", "What did Caroline research": "adoption agencies",
           "What did Melanie run": "a charity run", "Where does Melanie live": "Paris"}


def _respond(request):
  """A fake answerer + judge: canned answers; the judge says CORRECT when the gold is in the answer."""
  text = request["messages"][-1]["content"]
  if "Short answer:" in text:
    return next(a for q, a in ANSWERS.items() if q in text)
  gold = text.split("Gold answer: ")[-1].split("\n")[0]
  gen = text.split("Generated answer: ")[-1].split("\n")[0]
  label = "CORRECT" if gold.lower() in gen.lower() else "WRONG"
  return f'The answer matches or not. {{"label": "{label}"}}'


def _client(url, tmp_path=None, **kw):
  cfg = dict(base_url=url, model="fake-model", timeout_s=2.0, max_retries=0, backoff_base_s=0.0,
             backoff_max_s=0.0)
  if tmp_path is not None:
    cfg["cache_dir"] = str(tmp_path / "cache")
  cfg.update(kw)
  return ChatClient(ChatClientConfig(**cfg), sleep=lambda s: None)


def test_answer_prompt_holds_every_memory_with_its_session_date():
  msgs = qp.answer_messages("When did Caroline go?", MEMS, question_date="2023/05/30 (Tue) 23:42")
  assert msgs[0]["role"] == "system" and "session" in msgs[0]["content"]
  user = msgs[1]["content"]
  lines = user.splitlines()
  assert lines[1] == ("[1] (session date: 1:56 pm on 8 May, 2023) Caroline: I went to the LGBTQ "
                      "support group yesterday.")
  assert lines[2].startswith("[2] (session date: 7:55 pm on 25 May, 2023) Melanie:")
  assert lines[3] == "[3] Caroline: Adoption agencies are my next research topic."  # no date
  assert "Today's date: 2023/05/30 (Tue) 23:42" in user
  assert user.rstrip().endswith("Question: When did Caroline go?\nShort answer:")
  assert "(no memories)" in qp.answer_messages("Q?", ())[1]["content"]


@pytest.mark.parametrize("reply, verdict", [
    ('{"label": "CORRECT"}', True), ('Reasoning: same date. {"label": "WRONG"}', False),
    ('```json\n{"label": "correct"}\n```', True), ("It refers to May 7. CORRECT", True),
    ("The answer is INCORRECT", False), ("WRONG", False), ("CORRECT or WRONG?", None),
    ("", None), ("I cannot tell.", None), ('{"label": "maybe"}', None),
    ('{"label": "WRONG"} although the topic is correct', False),
])
def test_locomo_verdict_parser(reply, verdict):
  assert qp.parse_locomo_verdict(reply) is verdict


@pytest.mark.parametrize("reply, verdict", [("Yes.", True), ("yes", True), ("No.", False),
                                            ("no, the response is wrong", False), ("", None),
                                            ("   ", None)])
def test_longmemeval_verdict_is_the_official_yes_rule(reply, verdict):
  assert qp.parse_longmemeval_verdict(reply) is verdict


def test_longmemeval_judge_prompts_are_per_question_type():
  t = qp.longmemeval_judge_prompt("temporal-reasoning", "How many days?", "18", "19 days")
  assert "do not penalize off-by-one errors" in t and "Correct Answer: 18" in t
  k = qp.longmemeval_judge_prompt("knowledge-update", "Q", "A", "R")
  assert "updated answer" in k and "off-by-one" not in k
  p = qp.longmemeval_judge_prompt("single-session-preference", "Q", "rubric", "R")
  assert "Rubric: rubric" in p
  a = qp.longmemeval_judge_prompt("multi-session", "Q", "explanation", "R", abstention=True)
  assert "unanswerable" in a and "Explanation: explanation" in a
  with pytest.raises(ValueError, match="no LongMemEval judge prompt for question type 'x'"):
    qp.longmemeval_judge_prompt("x", "Q", "A", "R")
  msgs, decoding = qp.judge_request("longmemeval", "Q", "A", "R", "multi-session")
  assert decoding == {"temperature": 0.0, "max_tokens": 10}
  msgs, decoding = qp.judge_request("locomo", "Q?", "gold", "gen", "temporal")
  assert "Gold answer: gold\nGenerated answer: gen" in msgs[0]["content"]
  assert decoding["response_format"]["schema"]["properties"]["label"]["enum"] == ["CORRECT",
                                                                                  "WRONG"]


def test_pipeline_scores_answers_with_f1_bleu_and_the_judge(fake_llm, tmp_path):
  srv = fake_llm(_respond)
  client = _client(srv.base_url, tmp_path)
  report = qa.evaluate_qa(_items(), client, max_workers=2, progress=False)
  o = {x.id: x for x in report.outcomes}
  assert o["conv-26/q0"].answer == "7 May 2023" and o["conv-26/q0"].f1 == 1.0
  assert o["conv-26/q0"].j == 1.0 and o["conv-26/q0"].bleu1 == 1.0
  assert o["conv-26/q1"].f1 == 1.0 and o["conv-26/q1"].j == 1.0  # stems: agencies ~ agencies
  assert o["conv-26/q2"].f1 == pytest.approx(0.5) and o["conv-26/q2"].j == 0.0  # chariti run|rac
  assert o["conv-26/q3"].f1 == 0.0 and o["conv-26/q3"].verdict is False
  means = report.means()
  assert means["n"] == 4 and means["j"] == 50.0
  assert means["f1"] == pytest.approx(100 * (1 + 1 + 0.5 + 0) / 4)
  assert report.per_category()["single-hop"]["n"] == 2
  c = report.counters
  assert c["answer"]["calls"] == 4 and c["judge"]["calls"] == 4
  assert c["answer"]["unusable"] == 0 and c["judge"]["unusable"] == 0
  # every call: temperature 0 and the fixed seed; the judge asks for the JSON label schema
  bodies = [r["json"] for r in srv.requests]
  assert all(b["temperature"] == 0.0 and b["seed"] == 0 for b in bodies)
  judge_bodies = [b for b in bodies if "Gold answer" in b["messages"][-1]["content"]]
  assert len(judge_bodies) == 4 and all("response_format" in b for b in judge_bodies)


def test_empty_and_garbage_replies_are_unusable_and_scored_zero(fake_llm):
  def respond(request):
    text = request["messages"][-1]["content"]
    if "Short answer:" in text:
      return "   " if "Caroline go" in text else "adoption agencies"
    return "hmm, hard to say"  # no verdict

  srv = fake_llm(respond)
  client = _client(srv.base_url)
  report = qa.evaluate_qa(_items()[:2], client, progress=False)
  empty, garbage = report.outcomes
  assert empty.answer_status == "empty" and (empty.f1, empty.bleu1, empty.j) == (0.0, 0.0, 0.0)
  assert garbage.answer_status == "ok" and garbage.f1 == 1.0
  assert garbage.verdict is None and garbage.j == 0.0
  assert report.counters["answer"]["unusable"] == 1 and report.counters["judge"]["unusable"] == 1
  assert report.counters["judge"]["calls"] == 1  # an unusable answer is never judged
  assert client.stats["unusable"] == 2


def test_a_bad_server_is_scored_zero_never_a_crash(fake_llm):
  srv = fake_llm(lambda request: (_ for _ in ()).throw(RuntimeError("boom")))  # HTTP 500
  report = qa.evaluate_qa(_items()[:2], _client(srv.base_url), progress=False)
  assert [o.answer_status for o in report.outcomes] == ["http_error", "http_error"]
  assert report.means()["j"] == 0.0 and report.counters["answer"]["unusable"] == 2


def test_a_missing_server_is_scored_zero_never_a_crash(monkeypatch):
  monkeypatch.setenv("NO_PROXY", "127.0.0.1")
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # closed when the block ends: nothing listens there
  report = qa.evaluate_qa(_items()[:2], _client(f"http://127.0.0.1:{port}/v1"), progress=False)
  assert [o.answer_status for o in report.outcomes] == ["connection_error"] * 2
  assert report.means()["f1"] == 0.0 and report.counters["judge"]["calls"] == 0


def test_an_interrupted_run_resumes_from_the_cache(fake_llm, tmp_path):
  srv = fake_llm(_respond)
  first = qa.evaluate_qa(_items()[:2], _client(srv.base_url, tmp_path), progress=False)
  assert len(srv.requests) == 4  # 2 answers + 2 verdicts, then "killed"
  client = _client(srv.base_url, tmp_path)  # a new process: same endpoint, model and cache
  report = qa.evaluate_qa(_items(), client, progress=False)
  assert len(srv.requests) == 8  # only the 2 new questions cost calls (2 answers + 2 verdicts)
  assert report.counters["answer"]["cache_hits"] == 2 and report.counters["judge"]["cache_hits"] == 2
  assert [o.j for o in report.outcomes[:2]] == [o.j for o in first.outcomes]
  again = qa.evaluate_qa(_items(), _client(srv.base_url, tmp_path), progress=False)
  assert len(srv.requests) == 8  # a rerun costs nothing
  assert json.dumps([o.__dict__ for o in again.outcomes]) == json.dumps(
      [o.__dict__ for o in report.outcomes])


def test_run_requests_rejects_no_workers(fake_llm):
  with pytest.raises(ValueError, match="max_workers must be >= 1"):
    qa.run_requests(None, [], max_workers=0)


def test_judge_agreement_exposes_a_judge_that_always_says_correct(fake_llm):
  srv = fake_llm(lambda request: '{"label": "CORRECT"}')
  agree = qa.judge_agreement(_items(), _client(srv.base_url), progress=False)
  assert agree["n"] == 4 and agree["gold_judged_correct"] == 100.0
  assert agree["other_judged_wrong"] == 0.0 and agree["balanced_accuracy"] == 50.0
  srv2 = fake_llm(_respond)  # a judge that compares with the gold
  agree = qa.judge_agreement(_items(), _client(srv2.base_url), progress=False)
  assert (agree["gold_judged_correct"], agree["other_judged_wrong"]) == (100.0, 100.0)
  assert agree["unusable"] == 0


def test_a_long_memory_is_cut_in_the_prompt():
  text = "word " * 1000  # 5000 characters
  line = qp.format_memories([(text, "2023/05/20 (Sat) 00:31")])
  assert line.startswith("[1] (session date: 2023/05/20 (Sat) 00:31) word word")
  assert line.endswith(" ...") and len(line) < qp.MAX_MEMORY_CHARS + 60


def test_the_suite_endpoints_stop_cleanly_on_sigterm(tmp_path, fake_llm):
  import signal
  from ear_jax.experiment.suites import qa as qa_suite
  srv = fake_llm(_respond)
  before = signal.getsignal(signal.SIGTERM)
  settings = qa_suite.QASettings(base_url=srv.base_url, model="m")
  with pytest.raises(SystemExit):
    with qa_suite.endpoints(settings, tmp_path) as (answer, judge, info):
      assert answer is judge and info["cache_dir"] == str(tmp_path / "llm_cache")
      assert signal.getsignal(signal.SIGTERM) is qa_suite._exit_on_signal
      signal.raise_signal(signal.SIGTERM)  # unwinds the context (a server would be stopped)
  assert signal.getsignal(signal.SIGTERM) is before
  with pytest.raises(ValueError, match="--model is required"):
    with qa_suite.endpoints(qa_suite.QASettings(base_url=srv.base_url), tmp_path):
      pass
