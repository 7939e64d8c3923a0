"""Measures an LLM critic's citation precision / recall against the gold evidence (Appendix A.2).

On the slates the EAR training policy shows (`ear_jax.experiment.critic_eval`); `--subset=pilot`
and `--subset=eval` are disjoint. Without `--base_url` the local llama.cpp server is started;
replies are cached (`--llm_cache_dir`). `--critic=answer` measures the answer-grounded critic
(`--subset=validation` chooses its thresholds, `--subset=test` measures the library's);
`--answers=llm` uses the local LLM's own answers from `--answers_file`.

  python -m experiments.critic_eval --subset=eval --num_slates=300 --num_gold_free=60
  python -m experiments.critic_eval --base_url=http://localhost:8000/v1 --model=qwen2.5-7b
  python -m experiments.critic_eval --critic=answer --subset=validation --seeds=5
  python -m experiments.critic_eval --critic=answer --subset=test --seeds=10
  python -m experiments.critic_eval --critic=answer --subset=test --seeds=1 --answers=llm \
      --generate_answers
"""
import json
import pathlib
import time

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np
import tqdm

from ear_jax.agent.llm.critic import DEFAULT_PROMPT, PROMPTS, LLMCritic, LLMCriticConfig
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.data import corpora as datasets
from ear_jax.experiment import critic_eval
from experiments import cli
from experiments import data_flags
from experiments import llm_flags

_DATA = data_flags.define(["locomo", "longmemeval"], "Which benchmark (texts and gold evidence).")
_LLM = llm_flags.define(max_tokens=96)
_SEED = flags.DEFINE_integer("seed", 0, "Split and episode seed.")
_SUBSET = flags.DEFINE_enum("subset", "eval", ["pilot", "eval", "validation", "test"], "pilot: "
                            "the first --pilot_queries training queries (prompt choice); eval: "
                            "the rest; --critic=answer: validation (each seed's last 20 % of the "
                            "training stream: the threshold choice) or test (each seed's test "
                            "split).")
_CRITIC = flags.DEFINE_enum("critic", "llm", ["llm", "answer"], "llm: the LLM critic; answer: the "
                            "answer-grounded critic with the gold answers (no LLM).")
_SEEDS = flags.DEFINE_integer("seeds", 5, "--critic=answer: seeds 0..N-1 (their splits and "
                              "episodes), pooled.", lower_bound=1)
_PER_SEED = flags.DEFINE_integer("queries_per_seed", None, "--critic=answer: only the first N "
                                 "queries of each seed's split (the QA suite's subset rule; the "
                                 "episode runs on them); default all.", lower_bound=1)
_ANSWERS = flags.DEFINE_enum("answers", "gold", ["gold", "llm"], "--critic=answer: the agent's "
                             "answers the critic reads: gold (a competent agent) or llm (the LLM's "
                             "answers from --answers_file, beside the gold row; --subset=test).")
_ANSWERS_FILE = flags.DEFINE_string("answers_file", None, "--answers=llm: the stored answers "
                                    "(default results/critic_eval/llm_answers_<benchmark>.json).")
_GENERATE = flags.DEFINE_bool("generate_answers", False, "--answers=llm: ask the LLM (--base_url, "
                              "else the local server) for the answers the file lacks and write "
                              "it first.")
_PILOT = flags.DEFINE_integer("pilot_queries", 60, "Training queries reserved for the pilot.")
_NUM = flags.DEFINE_integer("num_slates", 300, "Slates holding gold evidence to critique.")
_NUM_FREE = flags.DEFINE_integer("num_gold_free", 60, "Gold-free slates to critique.")
_PROMPT = flags.DEFINE_enum("prompt", DEFAULT_PROMPT, list(PROMPTS), "Critic prompt.")
_CONSTRAINED = flags.DEFINE_bool("constrained", True, "Send the reply's JSON schema as "
                                 "response_format (constrained decoding).")
_OUT = flags.DEFINE_string("out", None, "JSON output (default runs/critic_eval/<subset>_<prompt>"
                           "[_free].json).")
_RESCORE = flags.DEFINE_string("rescore", None, "Recompute the metrics of a JSON this program wrote "
                               "(its slates' gold flags and citations), in place; no LLM call.")


def _summary(model, prompt, constrained, n_gold, n_free, m, seconds_per_call, cache_hits, out):
  return (f"{model} ({prompt}, constrained={constrained}), {n_gold} gold + {n_free} gold-free "
          f"slates: precision {m['precision']:.3f}, recall {m['recall']:.3f}, F1 {m['f1']:.3f} "
          f"(chance precision {m['chance_precision']:.3f}; citing the first memory: P "
          f"{m['first_precision']:.3f} / R {m['first_recall']:.3f}); parse rate "
          f"{m['parse_rate']:.3f}; cited/gold slate {m['cited_per_slate']:.2f}; gold-free slates "
          f"with a citation {m['gold_free_any_cited']:.3f}; by position "
          f"{np.round(m['position_cite_rate'], 2).tolist()}; "
          f"{'%.2f s' % seconds_per_call if seconds_per_call else 'n/a'} per fresh call, "
          f"{cache_hits} cache hits; wrote {out}")


def _rescore(path: pathlib.Path):
  result = json.loads(path.read_text())
  slates = [critic_eval.SlateRecord(query=s["query"], round=s["round"], question="",
                                    texts=("",) * len(s["gold"]), gold=tuple(s["gold"]))
            for s in result["slates"]]
  cited = [s["cited"] for s in result["slates"]]
  n_gold = sum(any(s.gold) for s in slates)
  result["metrics"] = critic_eval.citation_metrics(slates, cited)
  result["metrics_gold_slates"] = critic_eval.citation_metrics(slates[:n_gold], cited[:n_gold])
  cli.write_json(path, result, default=float)
  print(_summary(result["endpoint"]["model"], result["prompt"], result["constrained"], n_gold,
                 len(slates) - n_gold, result["metrics"], result["seconds_per_fresh_call"],
                 result["client_stats"]["cache_hits"], path))


def _config(bench) -> EARConfig:
  return EARConfig(dim=bench.stream.dim, num_candidates=_DATA.k.value,
                   slate_size=min(5, _DATA.k.value))


def _slates(bench, config, hparams):
  """The pilot or eval slates (gold, gold-free) of the training split."""
  train_idx, _ = datasets.split_indices(bench.num_queries, _SEED.value)
  pilot = min(_PILOT.value, len(train_idx))
  rows = train_idx[:pilot] if _SUBSET.value == "pilot" else train_idx[pilot:]
  # Enough queries for the requested slates (about 2/3 of LoCoMo's have a gold slate), not more.
  need = int(1.6 * _NUM.value + 1.2 * _NUM_FREE.value) + 20
  rows = rows[:need] if _SUBSET.value == "eval" else rows
  part = bench.take(rows)
  t0 = time.perf_counter()
  records = critic_eval.record_training_slates(jax.random.PRNGKey(_SEED.value), part, config,
                                               hparams)
  gold, free = critic_eval.select_slates(records)
  logging.info("recorded %d slates of %d queries in %.1fs: %d with gold, %d gold-free queries",
               len(records), len(rows), time.perf_counter() - t0, len(gold), len(free))
  if len(gold) < _NUM.value or len(free) < _NUM_FREE.value:
    logging.warning("only %d gold / %d gold-free slates available (asked %d / %d)", len(gold),
                    len(free), _NUM.value, _NUM_FREE.value)
  return gold[:_NUM.value], free[:_NUM_FREE.value], len(rows)


def _answer_row(name, m):
  p, a = m["protocol"], m["all_slates"]
  return (f"| {name} | {p['precision']:.3f} | {p['recall']:.3f} | {p['f1']:.3f} | "
          f"{a['precision_all_slates']:.3f} | {a['recall']:.3f} | {p['gold_free_any_cited']:.3f} |")


_ANSWER_HEADER = ("| critic | precision | recall | F1 | precision, every slate shown | recall, every "
                  "slate shown | gold-free slates with a citation |\n|---|---|---|---|---|---|---|")


def _llm_answer_bench(bench, needed):
  """`(bench with the LLM's answer support, info)` from --answers_file (see --generate_answers)."""
  from ear_jax.data import answer_metrics  # pylint: disable=g-import-not-at-top
  from ear_jax.data import answer_support  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import agent_answers  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(_ANSWERS_FILE.value or f"results/critic_eval/llm_answers_{bench.name}.json")
  if _GENERATE.value:
    _generate_answers(bench, needed, path)
  try:
    body = agent_answers.load_answers(path)
    answers = agent_answers.read_answers(path, bench, needed, body=body)
  except (FileNotFoundError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  status = {a["query_id"]: a.get("status", "ok") for a in body["answers"]}
  f1 = [answer_metrics.answer_f1(bench.name, answers[n], bench.answers[n], bench.categories[n])
        if answers[n] else 0.0 for n in needed]
  info = {"file": str(path), "model": body.get("model", "the LLM"),
          "memories_shown": body.get("memories_shown"), "questions": int(len(needed)),
          "unusable": sum(status.get(bench.query_ids[n]) != "ok" for n in needed),
          "answer_f1": answer_metrics.mean_percent(f1),
          "source": {k: v for k, v in body.items() if k != "answers"}}
  return answer_support.with_answer_support(bench, answers, encoder=_DATA.encoder.value,
                                            cache_dir=_DATA.cache_dir.value), info


def _generate_answers(bench, needed, path):
  """Asks the LLM for the answers of `needed` that `path` lacks, and writes the file."""
  from ear_jax.experiment import agent_answers  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment.suites import qa as qa_suite  # pylint: disable=g-import-not-at-top
  kept = agent_answers.load_answers(path)["answers"] if path.is_file() else []
  have = {a["query_id"]: a for a in kept if a.get("status") in ("ok", "empty")}
  todo = [n for n in needed if bench.query_ids[n] not in have or
          have[bench.query_ids[n]]["question"] != bench.query_texts[n]]
  corpus = datasets.load_corpus(data_flags.benchmark_name(_DATA), data_dir=_DATA.data_dir.value,
                                limit=_DATA.limit.value)
  items = agent_answers.answer_items(bench, corpus, todo)
  settings = qa_suite.QASettings(base_url=_LLM.base_url.value, model=_LLM.model.value,
                                 cache_dir=_LLM.llm_cache_dir.value or None, port=None,
                                 gguf=_LLM.model_path.value, timeout_s=_LLM.timeout_s.value)
  t0 = time.perf_counter()
  with qa_suite.endpoints(settings, pathlib.Path("runs")) as (client, _, info):
    fresh = agent_answers.generate_answers(client, items) if items else []
    stats = dict(client.stats)
  done = {a["query_id"] for a in fresh}
  merged = [a for a in kept if a["query_id"] not in done] + fresh
  calls = stats.get("calls", 0) - stats.get("cache_hits", 0)
  logging.info("%d answers asked (%d fresh calls, %.1f s; %.2f s per fresh call)", len(fresh),
               calls, time.perf_counter() - t0, stats.get("seconds", 0.0) / max(calls, 1))
  agent_answers.write_answers(path, bench.name, merged, {
      "model": info["answer_model"], "local_server": not _LLM.base_url.value,
      "memories_shown": agent_answers.ANSWER_MEMORIES,
      "memories": "the frozen first stage's top-5 candidates (the QA suite's Only Retriever slate)",
      "prompt": "ear_jax.agent.llm.qa_prompts.answer_messages (the QA suite's answer request)",
      "max_tokens": agent_answers.qa_lib.ANSWER_MAX_TOKENS, "temperature": 0.0})


def _answer_main():
  """--critic=answer: the threshold choice (validation) or the measurement (test)."""
  from ear_jax.core import critic as critic_lib  # pylint: disable=g-import-not-at-top
  from ear_jax.data import answer_support  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import agent_answers  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import runner  # pylint: disable=g-import-not-at-top
  if _SUBSET.value not in ("validation", "test"):
    raise app.UsageError("--critic=answer takes --subset=validation (the threshold choice) or "
                         "--subset=test")
  if _ANSWERS.value == "llm" and _SUBSET.value != "test":
    raise app.UsageError("--answers=llm measures the chosen thresholds: it takes --subset=test")
  if _SUBSET.value == "validation" and _DATA.benchmark.value == "longmemeval":
    raise app.UsageError("--subset=validation chooses thresholds: LongMemEval_S is never tuned "
                         "on; use --benchmark=locomo")
  if _ANSWERS.value == "llm" and _ANSWERS_FILE.value and not _GENERATE.value:
    try:  # a missing or bad file fails before the benchmark loads
      agent_answers.load_answers(_ANSWERS_FILE.value)
    except (FileNotFoundError, ValueError) as e:
      raise app.UsageError(str(e)) from None
  t0 = time.perf_counter()
  bench = answer_support.with_answer_support(data_flags.load_benchmark(_DATA, progress=False),
                                             encoder=_DATA.encoder.value,
                                             cache_dir=_DATA.cache_dir.value)
  config = _config(bench)
  seeds = list(range(_SEEDS.value))
  train, test = runner.seed_splits(bench.num_queries, seeds)
  rows = runner.validation_split(train)[1] if _SUBSET.value == "validation" else test
  if _PER_SEED.value:
    rows = [np.asarray(r)[:_PER_SEED.value] for r in rows]
  if _ANSWERS.value == "llm":  # read (or make) the answers first: a bad file fails at once
    llm_bench, info = _llm_answer_bench(bench, np.unique(np.concatenate(
        [np.asarray(r).reshape(-1) for r in rows])))
  slates = [critic_eval.policy_slates(bench, rows[i], s, config, default_hparams())
            for i, s in enumerate(seeds)]
  logging.info("recorded the slates of %d seeds in %.1f s", len(seeds), time.perf_counter() - t0)
  s = config.slate_size
  counts = {"all": sum(len(x.records) for x in slates), "gold": sum(len(x.gold) for x in slates),
            "gold_free": sum(len(x.free) for x in slates)}
  result = {"benchmark": bench.name, "subset": _SUBSET.value, "seeds": seeds,
            "queries_per_seed": _PER_SEED.value, "slates": counts}
  protocol = (f"{counts['gold']} gold + {counts['gold_free']} gold-free protocol slates, "
              f"{counts['all']} slates shown")
  lines = []
  if _SUBSET.value == "validation":
    settings = critic_eval.answer_grid()
    stacked = critic_lib.stack_critics([critic_lib.make_answer_critic(**g) for g in settings])
    metrics = critic_eval.critic_metrics(stacked, slates, s, stacked=True)
    chosen = critic_eval.choose_answer_thresholds(settings, metrics)
    defaults = dict(critic_lib.ANSWER_DEFAULTS)
    holds = chosen is not None and chosen["setting"] == defaults
    result.update(grid=[{"setting": g, "metrics": m} for g, m in zip(settings, metrics)],
                  chosen=chosen, library_defaults=defaults, defaults_hold_choice=holds,
                  rule=f"highest recall with precision >= {critic_eval.MIN_PRECISION}")
    strict = critic_eval.choose_answer_thresholds(settings, metrics,
                                                  precision=("all_slates", "precision_all_slates"))
    result["chosen_if_every_slate_counted"] = strict
    top = sorted(range(len(settings)), key=lambda i: (-metrics[i]["protocol"]["recall"],
                                                      -metrics[i]["protocol"]["precision"]))
    ok = [i for i in top if metrics[i]["protocol"]["precision"] >= critic_eval.MIN_PRECISION][:5]
    alt = [] if strict is None else [strict["index"]]
    lines += [f"Answer critic, threshold choice on {bench.name} validation ({len(seeds)} seeds, "
              f"{protocol}); rule: {result['rule']}", "", _ANSWER_HEADER]
    for tag, idx in (("", ok), (" (the choice if precision counted every slate shown)", alt)):
      for i in idx:
        lines.append(_answer_row(f"{settings[i]}{tag}", metrics[i]))
    lines += ["", f"chosen: {None if chosen is None else chosen['setting']}; library defaults "
              f"{defaults} {'hold' if holds else 'DO NOT hold'} it."]
  else:
    answer = critic_lib.make_answer_critic()
    gold_row = f"answer critic {dict(critic_lib.ANSWER_DEFAULTS)}, gold answers"
    rows_m = {gold_row: critic_eval.critic_metrics(answer, slates, s)[0]}
    agent = ""
    if _ANSWERS.value == "llm":
      llm_slates = [x._replace(part=llm_bench.take(np.asarray(rows[i])))
                    for i, x in enumerate(slates)]
      agent = f"{info['model']}'s answers (retriever top-{info['memories_shown']})"
      rows_m[f"answer critic, {agent}"] = critic_eval.critic_metrics(answer, llm_slates, s)[0]
      result["agent_answers"] = info
    rows_m.update({
        "simulated critic, the paper's p 0.88 / r 0.86":
        critic_eval.critic_metrics(critic_lib.default_critic(), slates, s)[0],
        "oracle (p = r = 1)": critic_eval.critic_metrics(critic_lib.OracleCritic(), slates, s)[0]})
    result["critics"] = rows_m
    first = rows_m[gold_row]["protocol"]
    per = f", the first {_PER_SEED.value} test queries of each" if _PER_SEED.value else ""
    lines += [f"Answer critic on {bench.name} test slates ({len(seeds)} seeds{per}, {protocol}), "
              f"the same thresholds with the gold answers{' and ' + agent if agent else ''} as "
              "the agent's", "", _ANSWER_HEADER]
    lines += [_answer_row(k, m) for k, m in rows_m.items()]
    lines += [f"| chance (cite at random) | {first['chance_precision']:.3f} | – | – | – | – | – |",
              f"| cite each slate's first memory | {first['first_precision']:.3f} | "
              f"{first['first_recall']:.3f} | – | – | – | – |"]
    if bench.name == "locomo":
      lines.append("| SmolLM2-135M as the critic, `judge_each_json` (RESULTS.md, LLM critic: 300 + "
                   "30 slates of seed 0's training split; not rerun) | 0.274 | 0.289 | – | – | – "
                   "| 0.667 |")
    if agent:
      lines += ["", f"The agent's answers: {info['questions']} test questions, "
                f"{info['unusable']} unusable (failed or empty: zero support, on which the critic "
                f"cites the whole slate); their answer F1 against the gold answers "
                f"{info['answer_f1']:.2f} % (read from {info['file']})."]
  result["wall_seconds"] = round(time.perf_counter() - t0, 1)
  out = cli.write_json(_OUT.value or f"results/critic_eval/answer_{bench.name}_{_SUBSET.value}"
                       f"{'_llm' if _ANSWERS.value == 'llm' else ''}.json", result, default=float)
  print("\n".join(lines) + f"\n\nwrote {out} ({result['wall_seconds']} s)")


def main(argv):
  del argv
  if _CRITIC.value == "answer":
    _answer_main()
    return
  if _SUBSET.value not in ("pilot", "eval"):
    raise app.UsageError(f"--subset={_SUBSET.value} is for --critic=answer")
  if _RESCORE.value:
    _rescore(pathlib.Path(_RESCORE.value))
    return
  t0 = time.perf_counter()
  bench = data_flags.load_benchmark(_DATA, progress=False)
  gold, free, num_queries = _slates(bench, _config(bench), default_hparams())
  slates = gold + free
  with llm_flags.endpoint(_LLM) as (base_url, model, info):
    critic = LLMCritic(LLMCriticConfig(**llm_flags.client_kwargs(_LLM, base_url, model),
                                       prompt=_PROMPT.value, constrained=_CONSTRAINED.value))
    bar = tqdm.tqdm(total=len(slates), desc="critic", unit="slate", mininterval=5.0)
    t_llm = time.perf_counter()
    replies = critic_eval.critique_slates(critic, slates, progress=lambda i, n: bar.update(1))
    t_llm = time.perf_counter() - t_llm
    bar.close()
  cited = [r["cited"] for r in replies]
  metrics = critic_eval.citation_metrics(slates, cited)
  stats = dict(critic.client.stats)
  fresh = stats["calls"] - stats["cache_hits"]
  result = {
      "benchmark": bench.name, "seed": _SEED.value, "subset": _SUBSET.value,
      "queries_recorded": num_queries, "prompt": _PROMPT.value,
      "constrained": _CONSTRAINED.value, "endpoint": info, "max_tokens": _LLM.max_tokens.value,
      "metrics": metrics, "metrics_gold_slates": critic_eval.citation_metrics(gold, cited[:len(gold)]),
      "client_stats": stats, "critic_stats": dict(critic.stats),
      "seconds_per_fresh_call": stats["seconds"] / fresh if fresh else None,
      "llm_seconds": round(t_llm, 2), "wall_seconds": round(time.perf_counter() - t0, 2),
      "constrained_replies": sum(bool(r["constrained"]) for r in replies),
      "slates": [dict(query=s.query, round=s.round, gold=list(s.gold), **r)
                 for s, r in zip(slates, replies)],
  }
  out = cli.write_json(_OUT.value or f"runs/critic_eval/{_SUBSET.value}_{_PROMPT.value}"
                       f"{'' if _CONSTRAINED.value else '_free'}.json", result, default=float)
  print(_summary(model, _PROMPT.value, _CONSTRAINED.value, len(gold), len(free), metrics,
                 result["seconds_per_fresh_call"], stats["cache_hits"], out))

if __name__ == "__main__":
  cli.run(main)  # a usage error: its message, not absl's help dump
