"""`--suite=qa` end to end on one LoCoMo conversation against a fake OpenAI-compatible server: the
answers come from each run's own final slates, the tables and results.json are written, a resumed
run costs no LLM call, and slates that do not reproduce the run's Recall@5 are refused.
Slow tier: it trains the methods (about a minute)."""
import json

import numpy as np
import pytest

from ear_jax.experiment import suites
from ear_jax.experiment.suites import qa as qa_suite
from ear_jax.experiment.suites.run_cache import Runner

pytestmark = pytest.mark.slow


def _respond(request):
  text = request["messages"][-1]["content"]
  if "Short answer:" in text:  # the first memory's text, as the "answer"
    return text.split("Memories:\n")[1].split("\n")[0].split(") ", 1)[-1][:80]
  gold = text.split("Gold answer: ")[-1].split("\n")[0]
  gen = text.split("Generated answer: ")[-1].split("\n")[0]
  return '{"label": "%s"}' % ("CORRECT" if gold.lower() in gen.lower() else "WRONG")


def _opts(tmp_path, data_dir, srv, resume=False):
  return suites.Options(
      benchmark="locomo", data_dir=str(data_dir), limit=1, seeds=2, suite="qa",
      workdir=str(tmp_path / "qa"), checkpoint_every=None, eval_every=64, progress=False,
      resume=resume, qa={"base_url": srv.base_url, "model": srv.model, "limit": 4, "seeds": 1,
                         "judge_checks": 3})


def test_qa_suite_answers_from_the_runs_final_slates(tmp_path, data_dir, fake_llm):
  if not (data_dir / "locomo10.json").is_file():
    pytest.skip("locomo10.json not found")
  srv = fake_llm(_respond)
  res = suites.run(_opts(tmp_path, data_dir, srv))
  qa = res["qa"]["results"]
  assert list(qa) == [lab for lab, _, _ in qa_suite.MAIN_ROWS] + [
      "Retriever Only, dialogue + observations", "EAR, dialogue + observations",
      "Retriever Only, observations", "EAR, observations"]
  assert all(v["means"]["n"] == 4 for v in qa.values())
  assert res["qa"]["endpoints"]["answer_model"] == srv.model
  agree = res["qa"]["endpoints"]["judge_agreement"]
  assert (agree["n"], agree["gold_judged_correct"], agree["other_judged_wrong"]) == (3, 100, 100)
  table = res["tables"]["qa"]
  assert "### Table 2 (QA columns: F1, BLEU-1, J)" in table and "### Table 5" in table
  assert "| Retriever Only | Only Observations |" in table and "not run" not in table
  obs_lines = [json.loads(l) for l in open(qa["EAR, observations"]["file"])]
  assert all(not t.startswith(("Caroline:", "Melanie:")) for l in obs_lines  # no dialogue turn
             for t, _ in l["memories"])
  on_disk = json.loads((tmp_path / "qa" / "results.json").read_text())
  assert on_disk["qa"]["results"]["EAR (ours)"]["means"] == qa["EAR (ours)"]["means"]

  # The prompts held the run's own explorer-assisted slates, with session dates.
  r = Runner(_opts(tmp_path, data_dir, srv, resume=True))
  ear = r.run("ear")
  test_index, slates = qa_suite.slates_for(r, ear, "explorer")
  b = r.bench()
  lines = [json.loads(l) for l in open(qa["EAR (ours)"]["file"])]
  for m, line in enumerate(lines):
    n = test_index[0, m]
    assert [t for t, _ in line["memories"]] == [b.candidate_texts[n, j] for j in slates[0, m]]
    assert all(d for _, d in line["memories"])  # every LoCoMo turn has its session date
    assert line["id"] == f"{b.query_ids[n]}@seed0"
  calls = len(srv.requests)

  # A resumed run loads the trained runs and answers from the reply cache: no new LLM call.
  again = suites.run(_opts(tmp_path, data_dir, srv, resume=True))
  assert len(srv.requests) == calls
  assert again["qa"]["results"]["EAR (ours)"]["means"] == qa["EAR (ours)"]["means"]

  # Slates that do not give the run's Recall@5 are refused, naming the file.
  path = tmp_path / "qa" / "runs" / ear["run"] / "test_eval.npz"
  with np.load(path) as z:
    data = dict(z)
  data["explorer_slates"] = np.roll(data["explorer_slates"], 1, axis=1)
  np.savez(path, **data)
  with pytest.raises(ValueError, match="test_eval.npz: the stored explorer slates give Recall@5"):
    qa_suite.slates_for(r, ear, "explorer")


@pytest.mark.parametrize("args, flag", [
    (["--base_url=http://127.0.0.1:9/v1"], "--model is required with --base_url"),
    (["--base_url=ftp://127.0.0.1/v1", "--model=m"], "--base_url: base_url 'ftp://127.0.0.1/v1' "
                                                     "must start with http:// or https://"),
    (["--qa_workers=0"], "--qa_workers"),
])
def test_bad_qa_flags_fail_before_any_work(tmp_path, args, flag):
  import subprocess
  import sys
  p = subprocess.run([sys.executable, "-m", "experiments.run", "--benchmark=synthetic",
                      "--suite=qa", f"--workdir={tmp_path / 'wd'}"] + args,
                     capture_output=True, text=True, timeout=300,
                     cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
  assert p.returncode != 0 and flag in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]
  assert "Traceback" not in p.stdout + p.stderr
  assert not (tmp_path / "wd").exists()
