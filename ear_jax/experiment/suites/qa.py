"""Suite `qa`: answers generated from each method's final slate, scored with F1, BLEU-1 and J.

Table 2's QA columns, Table 4's candidate types and Table 5's J per category, on the runs of `main`
/ `multistore`. Each test query's final slate is read from the run's `test_eval.npz` (checked to
reproduce its Recall@5) and answered by `agent.llm.qa.evaluate_qa` on a subset (`QASettings`);
without `base_url` the local llama.cpp server runs on a fixed port, so the reply cache makes a
rerun free. Table 4's 'Only Observations' pool (`observation_bench`) is the top-K observations of
each query's bank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import signal
import threading
from typing import Optional

import numpy as np

from ear_jax.agent.llm import qa as qa_lib
from ear_jax.experiment import plots
from ear_jax.experiment import runner as runner_lib
from ear_jax.experiment import stats
from ear_jax.experiment.suites.paper import fmt_num, md_table
from ear_jax.experiment.suites.run_cache import Runner

# The paper's QA numbers (percent; Contriever, GPT-class answerer and judge): (F1, J).
PAPER_QA = {
    "main": {"longmemeval": {"retriever": (36.12, 54.84), "rl_update": (35.06, 49.46),
                             "ear": (41.34, 65.23)},
             "locomo": {"retriever": (25.23, 45.45), "rl_update": (17.11, 30.08),
                        "ear": (29.85, 54.44)}},
    "table4": {("retriever", "Only Dialogues"): (25.23, 45.45),
               ("retriever", "Only Observations"): (23.77, 34.74),
               ("retriever", "Dialogue + Observations"): (28.88, 47.73),
               ("ear", "Only Dialogues"): (31.27, 54.22),
               ("ear", "Only Observations"): (25.83, 39.94),
               ("ear", "Dialogue + Observations"): (34.40, 59.09)},
    "table5_j": {"retriever": {"single-hop": 61.85, "multi-hop": 20.75, "temporal": 37.50,
                               "open-domain": 27.78},
                 "ear": {"single-hop": 73.99, "multi-hop": 30.19, "temporal": 51.56,
                         "open-domain": 27.78}},
}
# (row label, method, test mode) of Table 2's QA columns.
MAIN_ROWS = (("Only Retriever", "retriever", "adapter"),
             ("Reranker + RL update", "rl_update", "adapter"),
             ("EAR (ours)", "ear", "explorer"),
             ("EAR (adapter only)", "ear", "adapter"))
DEFAULT_PORT = 18650
OBSERVATIONS = "observations"  # the Runner's benchmark key of the observation-only pool


@dataclasses.dataclass
class QASettings:
  """`--suite=qa` settings (`Options.qa` holds them as a dict)."""
  limit: Optional[int] = 50  # test questions per seed (the first of each seed's split); None: all
  seeds: int = 1  # QA on the first this many seeds
  base_url: Optional[str] = None  # answering endpoint; None: start the local llama.cpp server
  model: Optional[str] = None
  judge_base_url: Optional[str] = None  # default: the answering endpoint
  judge_model: Optional[str] = None  # default: the answering model
  workers: int = 2  # requests in flight
  cache_dir: Optional[str] = None  # default: <workdir>/llm_cache
  gguf: Optional[str] = None  # the local server's model file (default: SmolLM2-135M)
  port: int = DEFAULT_PORT  # the local server's port (fixed, so the cache keys are stable)
  timeout_s: float = 180.0
  n_ctx: int = 4096  # the local server's context window (LongMemEval turns can be long)
  multistore: bool = True  # Tables 4-5 (LoCoMo only)
  judge_checks: int = 20  # questions whose known pairs test the judge (`qa.judge_agreement`)
  observations: bool = True  # Table 4's 'Only Observations' row (LoCoMo, with `multistore`)


def _hits(b, test_index, slates) -> tuple:
  """`(gold memories in each slate, gold per query)`, both `[S, M]`."""
  gold = np.asarray(b.stream.gold)[test_index]  # [S, M, K]
  hits = np.take_along_axis(gold, np.clip(slates, 0, gold.shape[-1] - 1), -1).sum(-1)
  return hits, np.asarray(b.stream.num_gold)[test_index]


def slates_for(r: Runner, summary: dict, mode: str, multistore: bool = False) -> tuple:
  """`(test_index [S, M], slates [S, M, s])` of a run, checked against the run's Recall@5.

  Raises:
    FileNotFoundError: naming the file when the run's test_eval.npz is missing.
    ValueError: when the stored slates do not reproduce the run's Recall@5.
  """
  path = r.workdir / "runs" / summary["run"] / "test_eval.npz"
  if not path.is_file():
    raise FileNotFoundError(f"{path} not found: the run's test slates are needed for QA (rerun "
                            "without --resume, or point --workdir at the run's workdir)")
  with np.load(path) as z:
    test_index, slates = z["test_index"], z[f"{mode}_slates"]
  hits, num_gold = _hits(r.bench(multistore), test_index, slates)
  has = num_gold > 0
  recall = 100.0 * ((hits >= num_gold) & has).sum(-1) / np.maximum(has.sum(-1), 1)
  expected = np.asarray(summary["metrics"][f"recall_{mode}"]["per_seed"], np.float64)
  if not np.allclose(recall, expected, atol=1e-3):
    raise ValueError(f"{path}: the stored {mode} slates give Recall@5 {recall.tolist()}, but the "
                     f"run reported {expected.tolist()}")
  return test_index, slates


def observation_bench(r: Runner):
  """The observation-only candidate pool (see the module docstring), registered with the Runner."""
  if OBSERVATIONS not in r._benches:  # pylint: disable=protected-access
    from ear_jax.data import candidates, corpora  # pylint: disable=g-import-not-at-top
    o = r.opts
    corpus = corpora.load_corpus(o.benchmark, data_dir=o.data_dir, limit=o.limit)
    ec, info = candidates.embed_corpus(corpus, o.encoder, cache_dir=o.cache_dir,
                                       progress=o.progress, multistore=True)
    swapped = dataclasses.replace(corpus, banks=[
        dataclasses.replace(bk, stores=(1 - bk.stores).astype(np.int8)) for bk in corpus.banks])
    b = candidates.build_benchmark(dataclasses.replace(ec, corpus=swapped), k=o.k)
    b.candidate_store = (1 - b.candidate_store).astype(np.int8)  # the true stores again
    b.num_gold_store = b.num_gold_store[:, ::-1].copy()
    b.stats["encoding"] = info
    r._benches[OBSERVATIONS] = b  # pylint: disable=protected-access
    r._splits[OBSERVATIONS] = runner_lib.seed_splits(b.num_queries, r.seeds)  # pylint: disable=protected-access
  return r._benches[OBSERVATIONS]  # pylint: disable=protected-access


def qa_items(r: Runner, test_index, slates, settings: QASettings, multistore: bool = False):
  """`QAItem`s of the first `settings.limit` test questions of the first `settings.seeds` seeds."""
  b = r.bench(multistore)
  if not hasattr(r, "qa_answers"):  # query id -> Query, (group, memory id) -> session date
    from ear_jax.data import corpora  # pylint: disable=g-import-not-at-top
    corpus = corpora.load_corpus(r.benchmark_name(), data_dir=r.opts.data_dir, limit=r.opts.limit)
    r.qa_answers = ({q.id: q for q in corpus.queries},
                    {(g, mid): date for g, bank in enumerate(corpus.banks)  # '' without dates
                     for mid, date in zip(bank.ids, bank.dates or [""] * len(bank.ids))})
  queries, dates = r.qa_answers
  items, skipped = [], 0
  for s in range(min(settings.seeds, test_index.shape[0])):
    rows = test_index[s] if settings.limit is None else test_index[s][:settings.limit]
    for m, n in enumerate(rows):
      q = queries.get(b.query_ids[n])
      if q is None or q.answer is None:
        skipped += 1
        continue
      mem = tuple((str(b.candidate_texts[n, j]), dates.get((int(b.group[n]),
                                                           str(b.candidate_ids[n, j])), ""))
                  for j in slates[s, m] if 0 <= j and b.candidate_ids[n, j] != "")
      items.append(qa_lib.QAItem(id=f"{q.id}@seed{s}", question=q.text, gold=q.answer,
                                 category=q.category, memories=mem, question_date=q.date,
                                 benchmark=b.name))
  return items, skipped


def _exit_on_signal(signum, frame):
  del frame
  raise SystemExit(128 + signum)


@contextlib.contextmanager
def endpoints(settings: QASettings, workdir):
  """`(answer_client, judge_client, info)`; starts the local llama.cpp server when no base_url."""
  from ear_jax.agent.llm.client import ChatClient, ChatClientConfig  # pylint: disable=g-import-not-at-top
  cache = settings.cache_dir or str(workdir / "llm_cache")
  with contextlib.ExitStack() as stack:
    if threading.current_thread() is threading.main_thread():
      # A SIGTERM (e.g. `kill`) unwinds like Ctrl-C, so the server below is stopped, not orphaned.
      stack.callback(signal.signal, signal.SIGTERM, signal.signal(signal.SIGTERM, _exit_on_signal))
    base_url, model = settings.base_url, settings.model
    if not base_url:
      from ear_jax.agent.llm import server as llm_server  # pylint: disable=g-import-not-at-top
      server = stack.enter_context(llm_server.LlamaServer(settings.gguf, port=settings.port,
                                                          n_ctx=settings.n_ctx))
      base_url, model = server.base_url, model or server.model
    if not model:
      raise ValueError("--model is required with --base_url (the model name the endpoint serves)")
    judge_url = settings.judge_base_url or base_url
    judge_model = settings.judge_model or model

    def client(url, name):
      return ChatClient(ChatClientConfig(base_url=url, model=name, temperature=0.0, seed=0,
                                         timeout_s=settings.timeout_s, cache_dir=cache))

    answer = client(base_url, model)
    judge = answer if (judge_url, judge_model) == (base_url, model) else client(judge_url,
                                                                               judge_model)
    yield answer, judge, {"answer_base_url": base_url, "answer_model": model,
                          "judge_base_url": judge_url, "judge_model": judge_model,
                          "cache_dir": cache}


def _evaluate(r: Runner, label, items, clients, settings) -> dict:
  report = qa_lib.evaluate_qa(items, clients[0], clients[1], max_workers=settings.workers,
                              progress=r.opts.progress, desc=label)
  out = r.workdir / "qa" / (re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") + ".jsonl")
  out.parent.mkdir(parents=True, exist_ok=True)
  with open(out, "w") as f:
    for it, o in zip(items, report.outcomes):
      f.write(json.dumps({**dataclasses.asdict(o), "question": it.question, "gold": it.gold,
                          "memories": it.memories}, default=str) + "\n")
  return {"means": report.means(), "per_category": report.per_category(),
          "counters": report.counters, "file": str(out),
          "per_question": {k: [getattr(o, k) for o in report.outcomes]
                           for k in ("f1", "bleu1", "j")}}


def _delta(res: dict, base: dict, metric: str) -> str:
  d = stats.paired_difference(res["per_question"][metric], base["per_question"][metric])
  interval = f" [{100 * d.lo:+.2f}, {100 * d.hi:+.2f}]" if np.isfinite(d.lo) else ""
  return f"{100 * d.mean:+.2f}{interval}"


def suite_qa(r: Runner) -> str:
  settings = QASettings(**r.opts.qa)
  bname = r.opts.benchmark
  results, info = {}, {}
  with endpoints(settings, r.workdir) as (answer, judge, info):
    specs = [(lab, m, mode, False) for lab, m, mode in MAIN_ROWS]
    if settings.multistore and bname == "locomo":
      specs += [("Retriever Only, dialogue + observations", "retriever", "adapter", True),
                ("EAR, dialogue + observations", "ear", "explorer", True)]
      if settings.observations:
        observation_bench(r)
        specs += [("Retriever Only, observations", "retriever", "adapter", OBSERVATIONS),
                  ("EAR, observations", "ear", "explorer", OBSERVATIONS)]
    for label, method, mode, ms in specs:
      s = r.run(method, multistore=ms, label=f"{method}_{OBSERVATIONS}" if ms == OBSERVATIONS
                else None)
      test_index, slates = slates_for(r, s, mode, ms)
      items, skipped = qa_items(r, test_index, slates, settings, ms)
      res = _evaluate(r, label, items, (answer, judge), settings)
      res.update(method=method, mode=mode, multistore=ms, skipped_without_answer=skipped,
                 recall_at_5_subset=_subset_recall(r, test_index, slates, settings, ms))
      results[label] = res
      if label == MAIN_ROWS[0][0] and settings.judge_checks:
        info["judge_agreement"] = qa_lib.judge_agreement(
            items, judge, limit=settings.judge_checks, max_workers=settings.workers,
            progress=r.opts.progress)
  r.qa = {"settings": dataclasses.asdict(settings), "endpoints": info, "results": results}
  return _tables(r, results, info, settings)


def _subset_recall(r, test_index, slates, settings, ms) -> float:
  k = settings.seeds
  ti = test_index[:k] if settings.limit is None else test_index[:k, :settings.limit]
  hits, num_gold = _hits(r.bench(ms), ti, slates[:k, :ti.shape[1]])
  return round(100.0 * float((hits >= num_gold).mean()), 2)


def _tables(r: Runner, results: dict, info: dict, settings: QASettings) -> str:
  bname = r.opts.benchmark
  pq = PAPER_QA["main"].get(bname, {})
  base = results["Only Retriever"]
  rows = []
  for label, m, mode in MAIN_ROWS:
    res = results[label]
    mm = res["means"]
    paper = pq.get(m) if mode == ("adapter" if m != "ear" else "explorer") else None
    c = res["counters"]
    rows.append([label, mode, mm["n"], fmt_num(res["recall_at_5_subset"]),
                 fmt_num(paper[0]) if paper else "–", fmt_num(mm["f1"]), fmt_num(mm["bleu1"]),
                 fmt_num(paper[1]) if paper else "–", fmt_num(mm["j"]),
                 "(baseline)" if res is base else _delta(res, base, "j"),
                 "(baseline)" if res is base else _delta(res, base, "f1"),
                 f"{c['answer']['unusable']} / {c['judge']['unusable']}"])
  subset = (f"the first {settings.limit} test questions" if settings.limit else
            "all test questions") + f" of {settings.seeds} seed(s)"
  md = [f"### Table 2 (QA columns: F1, BLEU-1, J) — {bname}", "",
        f"Answers from each method's final 5 memories (with session dates) on {subset}. "
        f"Answering model: `{info.get('answer_model')}`; judge: `{info.get('judge_model')}` "
        f"({'mem0 generous-match judge' if bname == 'locomo' else 'LongMemEval official prompts'}"
        "). F1: " + ("LoCoMo's official per-category rules" if bname == "locomo" else
                     "the stemmed token F1 of LoCoMo's scorer (LongMemEval's has no F1)") +
        "; BLEU-1: sentence BLEU-1 (mem0 / A-Mem). Paper: Contriever retriever, a GPT-class "
        "answerer and judge.", "",
        md_table(["Method", "test mode", "n", "R@5 (these questions)", "paper F1", "F1", "BLEU-1",
                  "paper J", "J", "Δ J vs retriever [95% CI]", "Δ F1 vs retriever [95% CI]",
                  "unusable answers / verdicts"], rows), "",
        "Δ columns: mean per-question paired difference (same questions) with its 95% t-interval "
        "over questions."]
  agree = info.get("judge_agreement")
  if agree:
    md += ["", f"Judge check on {agree['n']} questions with known verdicts: a question's gold "
               f"answer judged CORRECT {agree['gold_judged_correct']:.1f}%, another question's "
               f"gold answer judged WRONG {agree['other_judged_wrong']:.1f}% (balanced accuracy "
               f"{agree['balanced_accuracy']:.1f}%; {agree['unusable']} unusable verdicts). A judge "
               "giving one verdict to everything scores 100 / 0 or 0 / 100 here (balanced "
               "accuracy 50%), and its J then measures nothing."]
  cats = sorted({c for res in results.values() for c in res["per_category"]})
  crow = [[c, results["Only Retriever"]["per_category"].get(c, {}).get("n", 0)] +
          [fmt_num(results[lab]["per_category"].get(c, {}).get("j")) for lab, _, _ in MAIN_ROWS]
          for c in cats]
  md += ["", "J per category (single-store candidates):", "",
         md_table(["category", "n"] + [lab for lab, _, _ in MAIN_ROWS], crow)]
  ms_labels = [lab for lab, res in results.items() if res["multistore"] is True]
  if ms_labels:
    rows4 = []
    for name, single, mixed, key in (("Retriever Only", "Only Retriever",
                                      "Retriever Only, dialogue + observations", "retriever"),
                                     ("EAR", "EAR (ours)", "EAR, dialogue + observations", "ear")):
      obs = f"{name}, observations" if f"{name}, observations" in results else None
      for typ, lab in (("Only Dialogues", single), ("Only Observations", obs),
                       ("Dialogue + Observations", mixed)):
        p = PAPER_QA["table4"][(key, typ)]
        mm = results[lab]["means"] if lab else None
        rows4.append([name, typ, fmt_num(p[0]), fmt_num(mm["f1"]) if mm else "not run",
                      fmt_num(mm["bleu1"]) if mm else "–", fmt_num(p[1]),
                      fmt_num(mm["j"]) if mm else "not run"])
    rows5 = []
    for name, lab, key in (("Retriever Only", ms_labels[0], "retriever"),
                           ("EAR", ms_labels[-1], "ear")):
      for c in sorted(results[lab]["per_category"]):
        v = results[lab]["per_category"][c]
        rows5.append([name, c, v["n"], fmt_num(PAPER_QA["table5_j"][key].get(c)),
                      fmt_num(v["j"]), fmt_num(v["f1"])])
    md += ["", f"### Table 4 (F1 / J by candidate type) — {bname}", "",
           "EAR with explorer-assisted test slates. Candidates: top-K dialogue turns / top-K "
           "observations / top-K/2 of each (Section 5.1). The observation-only pool keeps the "
           "queries with a gold observation, so its questions differ from the other rows'.", "",
           md_table(["Method", "candidates", "paper F1", "F1", "BLEU-1", "paper J", "J"], rows4),
           "", f"### Table 5 (J per category, dialogue + observation candidates) — {bname}", "",
           md_table(["Method", "category", "n", "paper J", "J", "F1"], rows5)]
  counters = [res["counters"]["answer"] for res in results.values()]
  ans = sum(c.get("calls", 0) - c.get("cache_hits", 0) for c in counters)
  secs = sum(c["wall_seconds"] for c in counters)
  hits = sum(c.get("cache_hits", 0) for c in counters)
  rate = (f"{ans} fresh answer calls in {secs:.0f} s of answering wall time "
          f"({60 * ans / secs:.1f} answers/min, {settings.workers} in flight)" if ans and secs
          else "no fresh answer call")
  md += ["", f"This run: {rate}; {hits} answers from the reply cache. Per-method call counters "
             "(calls, cache hits, tokens, seconds, unusable replies) are in results.json under "
             "'qa'."]
  labels = [lab for lab, _, _ in MAIN_ROWS]
  # Error bars over questions pooled across `settings.seeds` seeds.
  per_q = {lab: {name: [np.nan if v is None else 100.0 * v
                        for v in results[lab]["per_question"][key]]
                 for name, key in (("F1", "f1"), ("BLEU-1", "bleu1"), ("J", "j"))}
           for lab in labels}
  plots.grouped_bars(r.plot_path("qa_table2"), ["F1", "BLEU-1", "J"], per_q,
                     title=f"QA from the final 5 memories, {bname} ({info.get('answer_model')})",
                     ylabel="%", paper={lab: {"F1": pq[m][0], "J": pq[m][1]}
                                        for lab, m, mode in MAIN_ROWS[:3] if m in pq},
                     interval="95% t-interval over questions")
  plots.grouped_bars(r.plot_path("qa_j_per_category"), cats,
                     {lab: {c: [results[lab]["per_category"].get(c, {}).get("j", np.nan)]
                            for c in cats} for lab in labels},
                     title=f"J per category, {bname}", ylabel="J (%)")
  return "\n".join(md)
