"""Measures the answer-grounded critic's citation precision / recall against the gold evidence.

On the slates the EAR training policy shows (`ear_jax.experiment.critic_eval`):
`--subset=validation` chooses its thresholds, `--subset=test` measures the library's; the gold
answers play the agent's.

  python -m experiments.critic_eval --subset=validation --seeds=5
  python -m experiments.critic_eval --subset=test --seeds=10
"""
import time

from absl import app
from absl import flags
from absl import logging
import numpy as np

from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.experiment import critic_eval
from experiments import cli
from experiments import data_flags

_DATA = data_flags.define(["locomo", "longmemeval"], "Which benchmark (texts and gold evidence).")
_SUBSET = flags.DEFINE_enum("subset", "test", ["validation", "test"], "validation: each seed's "
                            "last 20 % of the training stream (the threshold choice); test: each "
                            "seed's test split.")
_SEEDS = flags.DEFINE_integer("seeds", 5, "Seeds 0..N-1 (their splits and episodes), pooled.",
                              lower_bound=1)
_PER_SEED = flags.DEFINE_integer("queries_per_seed", None, "Only the first N queries of each "
                                 "seed's split (the QA suite's subset rule; the episode runs on "
                                 "them); default all.", lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "JSON output (default results/critic_eval/"
                           "answer_<benchmark>_<subset>.json).")


def _answer_row(name, m):
  p, a = m["protocol"], m["all_slates"]
  return (f"| {name} | {p['precision']:.3f} | {p['recall']:.3f} | {p['f1']:.3f} | "
          f"{a['precision_all_slates']:.3f} | {a['recall']:.3f} | {p['gold_free_any_cited']:.3f} |")


_ANSWER_HEADER = ("| critic | precision | recall | F1 | precision, every slate shown | recall, every "
                  "slate shown | gold-free slates with a citation |\n|---|---|---|---|---|---|---|")


def main(argv):
  """The threshold choice (validation) or the measurement (test)."""
  del argv
  from ear_jax.core import critic as critic_lib  # pylint: disable=g-import-not-at-top
  from ear_jax.data import answer_support  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import runner  # pylint: disable=g-import-not-at-top
  if _SUBSET.value == "validation" and _DATA.benchmark.value == "longmemeval":
    raise app.UsageError("--subset=validation chooses thresholds: LongMemEval_S is never tuned "
                         "on; use --benchmark=locomo")
  t0 = time.perf_counter()
  bench = answer_support.with_answer_support(data_flags.load_benchmark(_DATA, progress=False),
                                             encoder=_DATA.encoder.value,
                                             cache_dir=_DATA.cache_dir.value)
  config = EARConfig(dim=bench.stream.dim, num_candidates=_DATA.k.value,
                     slate_size=min(5, _DATA.k.value))
  seeds = list(range(_SEEDS.value))
  train, test = runner.seed_splits(bench.num_queries, seeds)
  rows = runner.validation_split(train)[1] if _SUBSET.value == "validation" else test
  if _PER_SEED.value:
    rows = [np.asarray(r)[:_PER_SEED.value] for r in rows]
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
    rows_m.update({
        "simulated critic, the paper's p 0.88 / r 0.86":
        critic_eval.critic_metrics(critic_lib.default_critic(), slates, s)[0],
        "oracle (p = r = 1)": critic_eval.critic_metrics(critic_lib.OracleCritic(), slates, s)[0]})
    result["critics"] = rows_m
    first = rows_m[gold_row]["protocol"]
    per = f", the first {_PER_SEED.value} test queries of each" if _PER_SEED.value else ""
    lines += [f"Answer critic on {bench.name} test slates ({len(seeds)} seeds{per}, {protocol}), "
              "the same thresholds with the gold answers as the agent's", "", _ANSWER_HEADER]
    lines += [_answer_row(k, m) for k, m in rows_m.items()]
    lines += [f"| chance (cite at random) | {first['chance_precision']:.3f} | – | – | – | – | – |",
              f"| cite each slate's first memory | {first['first_precision']:.3f} | "
              f"{first['first_recall']:.3f} | – | – | – | – |"]
  result["wall_seconds"] = round(time.perf_counter() - t0, 1)
  out = cli.write_json(_OUT.value or f"results/critic_eval/answer_{bench.name}_{_SUBSET.value}"
                       ".json", result, default=float)
  print("\n".join(lines) + f"\n\nwrote {out} ({result['wall_seconds']} s)")


if __name__ == "__main__":
  cli.run(main)  # a usage error: its message, not absl's help dump
