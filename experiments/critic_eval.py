"""Measures an LLM critic's citation precision / recall against the gold evidence (Appendix A.2).

The slates are those the EAR training policy shows (`ear_jax.experiment.critic_eval`): one episode
of the Explorer over the K=20 retrieved candidates of the training split's queries (`--seed`
split, the paper's simulated critic driving it), keeping per query its first slate that holds a gold
memory; plus gold-free slates of queries whose slates never hold one. `--subset=pilot` uses the
first `--pilot_queries` training queries (choose the prompt there), `--subset=eval` the following
ones (report these). Without `--base_url` the local llama.cpp server with SmolLM2-135M-Instruct is
started for the run. Replies are cached on disk (`--llm_cache_dir`): an interrupted run resumes.

  python -m experiments.critic_eval --subset=eval --num_slates=300 --num_gold_free=60
  python -m experiments.critic_eval --subset=pilot --num_slates=40 --num_gold_free=10 --prompt=cite_json
  python -m experiments.critic_eval --base_url=http://localhost:8000/v1 --model=qwen2.5-7b
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
from ear_jax.data import candidates
from ear_jax.data import corpora as datasets
from ear_jax.experiment import critic_eval
from experiments import cli
from experiments import data_flags
from experiments import llm_flags

_DATA = data_flags.define(["locomo", "longmemeval"], "Which benchmark (texts and gold evidence).")
_LLM = llm_flags.define(max_tokens=96)
_SEED = flags.DEFINE_integer("seed", 0, "Split and episode seed.")
_SUBSET = flags.DEFINE_enum("subset", "eval", ["pilot", "eval"], "pilot: the first "
                            "--pilot_queries training queries (prompt choice); eval: the rest.")
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
  path.write_text(json.dumps(result, indent=1, default=float))
  print(_summary(result["endpoint"]["model"], result["prompt"], result["constrained"], n_gold,
                 len(slates) - n_gold, result["metrics"], result["seconds_per_fresh_call"],
                 result["client_stats"]["cache_hits"], path))


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


def main(argv):
  del argv
  if _RESCORE.value:
    _rescore(pathlib.Path(_RESCORE.value))
    return
  t0 = time.perf_counter()
  bench = candidates.load_benchmark(data_flags.benchmark_name(_DATA), data_dir=_DATA.data_dir.value,
                                    encoder=_DATA.encoder.value, k=_DATA.k.value,
                                    limit=_DATA.limit.value, cache_dir=_DATA.cache_dir.value,
                                    progress=False)
  config = EARConfig(dim=bench.stream.dim, num_candidates=_DATA.k.value,
                     slate_size=min(5, _DATA.k.value))
  gold, free, num_queries = _slates(bench, config, default_hparams())
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
  out = pathlib.Path(_OUT.value or f"runs/critic_eval/{_SUBSET.value}_{_PROMPT.value}"
                     f"{'' if _CONSTRAINED.value else '_free'}.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1, default=float))
  print(_summary(model, _PROMPT.value, _CONSTRAINED.value, len(gold), len(free), metrics,
                 result["seconds_per_fresh_call"], stats["cache_hits"], out))

if __name__ == "__main__":
  cli.run(main)  # a usage error: its message, not absl's help dump
