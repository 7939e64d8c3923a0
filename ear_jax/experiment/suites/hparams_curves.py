"""Suites `hparams` (Tables 6-7: rounds T, replay batch B, replay strategy) and `curves` (Figs. 3-4:
learning curves and the matched critic budget)."""
from __future__ import annotations

import numpy as np

from ear_jax.experiment import plots
from ear_jax.experiment import summaries
from ear_jax.experiment.suites.pairing import DELTA_NOTE, fd, get_metric, pair_runs
from ear_jax.experiment.suites.paper import PAPER, fmt, fmt_num, md_table
from ear_jax.experiment.suites.run_cache import Runner


def suite_hparams(r: Runner) -> str:
  pkl = PAPER["hparams"]["longmemeval"]
  # Paired baselines (adapter-only): the frozen retriever and the paper's default (T=4, B=4,
  # similarity replay); the paper's direction is checked on LongMemEval only (its numbers').
  lme = r.opts.benchmark == "longmemeval"
  pret = PAPER["main"]["longmemeval"]["retriever"][0]
  base = ("Only Retriever", r.run("retriever"), "adapter")
  default = r.run("ear", config_overrides={"num_rounds": 4, "replay_size": 4})

  def deltas(label, s, tag, default_label, default_tag):
    # Table 7's 'similarity' row is the T=4, B=4 run of Table 6: not read twice.
    d_ret = pair_runs(r, "hparams", (label, s, "adapter"), base,
                      paper={"recall": pkl[tag] - pret} if lme else None,
                      primary={"recall"} if tag != "similarity" else False)
    if tag == default_tag:
      return d_ret, None
    d_def = pair_runs(r, "hparams", (label, s, "adapter"), (default_label, default, "adapter"),
                      metrics=("recall",),
                      paper={"recall": pkl[tag] - pkl[default_tag]} if lme else None)
    return d_ret, d_def["recall"]

  rows, series = [], {}
  for t, bsz in ((2, 4), (4, 4), (8, 4), (4, 2), (4, 8)):
    s = r.run("ear", config_overrides={"num_rounds": t, "replay_size": bsz})
    tag = f"T{t}B{bsz}"
    d_ret, d_def = deltas(f"EAR T={t}, B={bsz}", s, tag, "EAR T=4, B=4", "T4B4")
    rows.append([t, bsz, fmt_num(pkl[tag]), fmt(get_metric(s, "recall_adapter")),
                 fd(d_ret["recall"]), fd(d_def) if d_def is not None else "(reference)",
                 fmt(get_metric(s, "recall_explorer")), fmt(s["critic_calls"], 0)])
    series[f"T={t}, B={bsz}"] = {"Recall@5": get_metric(s, "recall_adapter")["per_seed"]}
  rows7, series7 = [], {}
  for strat in ("similarity", "reward", "random"):
    s = r.run("ear", config_overrides={"replay_strategy": strat, "num_rounds": 4,
                                       "replay_size": 4})
    d_ret, d_def = deltas(f"EAR {strat} replay", s, strat, "EAR similarity replay", "similarity")
    rows7.append([strat, fmt_num(pkl[strat]), fmt(get_metric(s, "recall_adapter")),
                  fd(d_ret["recall"]), fd(d_def) if d_def is not None else "(reference)",
                  fmt(get_metric(s, "recall_explorer"))])
    series7[strat] = {"Recall@5": get_metric(s, "recall_adapter")["per_seed"]}
  md = [f"### Table 6 (exploration rounds T, replay batch B) — {r.opts.benchmark}", "",
        "Paper: LongMemEval, Recall@5 of the updated adapter (explorer off at test).", "",
        md_table(["T", "B", "paper R@5", "R@5 adapter (here)", "Δ R@5 vs retriever [95% CI]",
                  "Δ R@5 vs T=4, B=4 [95% CI]", "R@5 explorer (here)",
                  "critic calls (train)"], rows), "",
        f"### Table 7 (replay sampling strategy) — {r.opts.benchmark}", "",
        md_table(["strategy", "paper R@5", "R@5 adapter (here)", "Δ R@5 vs retriever [95% CI]",
                  "Δ R@5 vs similarity [95% CI]", "R@5 explorer (here)"], rows7), "",
        DELTA_NOTE + " Adapter-only test mode; baselines: Only Retriever and the default "
        "setting (T=4, B=4, similarity replay; '(reference)')."]
  plots.grouped_bars(r.plot_path("table6_T_B"), ["Recall@5"], series,
                     title=f"Table 6, {r.opts.benchmark} (adapter only)", ylabel="Recall@5 (%)")
  plots.grouped_bars(r.plot_path("table7_strategy"), ["Recall@5"], series7,
                     title=f"Table 7, {r.opts.benchmark} (adapter only)", ylabel="Recall@5 (%)")
  return "\n".join(md)


def curve_eval_every(r: Runner) -> int:
  """Evaluation period of the learning curves: `--eval_every`, shortened to give ~8 points."""
  n_train, e = r.num_train(), r.opts.eval_every
  if n_train is not None:  # at least ~8 points per curve, a multiple of the batch size
    b = r.opts.config_overrides.get("batch_size", 4)
    e = max(b, min(e, (n_train // 8) // b * b or b))
  return e


def suite_curves(r: Runner) -> str:
  r.bench()
  ev = curve_eval_every(r)
  base = r.run("retriever", eval_every=ev)
  ref = get_metric(base, "recall_adapter")["mean"]
  names = {"rl_update": "RL update", "ear": "EAR", "ear_no_replay": "only Explorer (no replay)",
           "ear_no_explorer": "only Experience Buffer"}
  runs = {m: r.run(m, eval_every=ev) for m in names}
  t = runs["ear"]["config"]["num_rounds"]
  rl_e = r.run("rl_update", eval_every=ev * t, epochs=t, label="rl_update_budget")
  rows = []
  for m, s in list(runs.items()) + [("rl_update_budget", rl_e)]:
    curve = s["curve"]
    mins = min(float(np.mean(p["recall_adapter"])) for p in curve)
    label = names.get(m, f"RL update, {t} epochs (matched critic budget)")
    # Final test Recall@5 paired with the retriever (the figures give only a direction).
    d = pair_runs(r, "curves", (label, s, "adapter"), ("Only Retriever", base, "adapter"),
                  metrics=("recall",), expected={"recall": 1} if m == "ear" else None)
    rows.append([label, fmt(get_metric(s, "recall_adapter")), fd(d["recall"]), f"{mins - ref:+.2f}",
                 fmt_num(summaries.first_crossing(curve, "recall_adapter", ref, "queries_seen")),
                 fmt_num(summaries.first_crossing(curve, "recall_adapter", ref, "critic_calls")),
                 fmt(s["critic_calls"], 0)])
  md = [f"### Figures 3–4 (learning curves, explorer off at test) — {r.opts.benchmark}", "",
        f"Test Recall@5 evaluated every {ev} training queries inside the chunked scan. Only "
        f"Retriever: {ref:.2f}. Paper: {PAPER['curves']['fig3']} {PAPER['curves']['fig4']}", "",
        md_table(["run", "final R@5", "Δ final R@5 vs retriever [95% CI]",
                  "worst drop vs retriever", "queries to reach retriever",
                  "critic calls to reach retriever", "critic calls (total)"], rows), "",
        DELTA_NOTE + " Curve bands in the plots: the same interval of the mean at each point."]
  # Fig. 4: at a matched critic budget EAR stays ahead of the multi-epoch RL update.
  pair_runs(r, "curves", ("EAR", runs["ear"], "adapter"),
             (f"RL update, {t} epochs", rl_e, "adapter"), metrics=("recall",),
            expected={"recall": 1})
  plots.learning_curves(r.plot_path("fig3_sample_efficiency"),
                        {names[m]: runs[m]["curve"] for m in names}, x="queries_seen",
                        hlines={"Only Retriever": ref},
                        title=f"Fig. 3: {r.opts.benchmark}, test Recall@5 (explorer off), "
                              f"{len(r.seeds)} seeds")
  plots.learning_curves(r.plot_path("fig4_critic_budget"),
                        {"EAR": runs["ear"]["curve"], f"RL update ({t} epochs)": rl_e["curve"]},
                        x="critic_calls", hlines={"Only Retriever": ref},
                        title=f"Fig. 4: {r.opts.benchmark}, matched critic budget")
  return "\n".join(md)
