"""Suites `main` (Table 2: Only Retriever, RL-update reranker, EAR) and `ablation` (Table 3); each
explorer-assisted row is followed by its two paging neighbours (`pairing.paging_rows`)."""
from __future__ import annotations

from ear_jax.experiment import plots
from ear_jax.experiment.suites.pairing import (DELTA_NOTE, PAGING_DELTA_HEADER, fd, get_metric,
                                               insert_rows, pair_runs, paging_note, paging_rows)
from ear_jax.experiment.suites.paper import PAPER, fmt, fmt_num, md_table
from ear_jax.experiment.suites.run_cache import Runner


def suite_main(r: Runner) -> str:
  pk = r.paper_key()
  pm = PAPER["main"].get(pk, {})  # (R@5, Hit@5) per method; {} without the paper's numbers
  runs = {m: r.run(m) for m in ("retriever", "rl_update", "ear")}
  modes = {"retriever": "adapter", "rl_update": "adapter", "ear": "explorer"}
  names = {"retriever": "Only Retriever", "rl_update": "Reranker + RL update",
           "ear": "EAR (ours)"}
  rows, deltas = [], {}
  base = ("Only Retriever", runs["retriever"], "adapter")
  pbase = pm.get("retriever")
  for m, s in runs.items():
    mode = modes[m]
    other = "explorer" if mode == "adapter" else "adapter"
    paper = pm.get(m)
    dcells = ["(baseline)", "(baseline)"]
    if m != "retriever":
      deltas[names[m]] = pair_runs(
          r, "main", (names[m], s, mode), base,
          paper={"recall": paper[0] - pbase[0], "hitrate": paper[1] - pbase[1]} if paper else None)
      dcells = [fd(deltas[names[m]]["recall"]), fd(deltas[names[m]]["hitrate"])]
    rows.append([names[m], mode, fmt_num(paper[0]) if paper else "–",
                 fmt(get_metric(s, f"recall_{mode}")), fmt_num(paper[1]) if paper else "–",
                 fmt(get_metric(s, f"hitrate_{mode}")), fmt(get_metric(s, f"recall_{other}")),
                 fmt(get_metric(s, f"hitrate_{other}")), dcells[0], dcells[1],
                 "(reference)" if mode == "explorer" else "–"])
  # The paper's headline ordering also puts EAR above the RL-update reranker.
  prl, pear = pm.get("rl_update"), pm.get("ear")
  pair_runs(r, "main", (names["ear"], runs["ear"], "explorer"),
            (names["rl_update"], runs["rl_update"], "adapter"),
            paper={"recall": pear[0] - prl[0], "hitrate": pear[1] - prl[1]} if pear else None,
            primary={"recall"})
  paging = []  # after the paper's comparisons, so their records keep their positions
  for i, m in enumerate(runs):
    if modes[m] == "explorer":
      new = []
      for mode, text, d in paging_rows(r, "main", names[m], runs[m]):
        dr = pair_runs(r, "main", (names[m], runs[m], mode), base, primary=False)
        new.append([text, "paging", "–", fmt(get_metric(runs[m], f"recall_{mode}")), "–",
                    fmt(get_metric(runs[m], f"hitrate_{mode}")), "–", "–", fd(dr["recall"]),
                    fd(dr["hitrate"]), fd(d)])
      paging.append((i, new))
  rows = insert_rows(rows, paging)
  ceil = runs["retriever"]["ceiling"]
  md = [f"### Table 2 (retrieval columns) — {r.opts.benchmark}", "",
        md_table(["Method", "test mode", "paper R@5", "R@5", "paper Hit@5", "Hit@5",
                  "R@5 (other mode)", "Hit@5 (other mode)", "Δ R@5 vs retriever [95% CI]",
                  "Δ Hit@5 vs retriever [95% CI]", PAGING_DELTA_HEADER], rows), "",
        DELTA_NOTE + " Baseline: Only Retriever (the frozen retriever's top-5).", "",
        paging_note(runs["ear"], r.opts.k), "",
        f"Test queries per seed: {runs['ear']['num_test']}, training queries: "
        f"{runs['ear']['num_train']}, seeds: {len(r.seeds)}. Recall@K ceiling (all gold in the "
        f"top-{r.opts.k}): {fmt(ceil['recall@K'])}; with ≤ 5 gold: {fmt(ceil['recall@5'])}; "
        f"Hitrate@K ceiling {fmt(ceil['hitrate@K'])}. Paper: Contriever; here: "
        f"{r.bench().stats.get('encoding', {}).get('encoder')}. 'other mode' = the same adapter "
        "evaluated with the other test-time mode (adapter-only / explorer-assisted)."]
  cats = sorted(runs["ear"].get("per_category", {}))
  if cats:
    crow = [[c, fmt(runs["retriever"]["per_category"][c]["n"], 0)]
            + [fmt(runs[m]["per_category"][c][f"recall_{modes[m]}"]) for m in runs]
            + [fmt(runs["ear"]["per_category"][c]["recall_adapter"])] for c in cats]
    md += ["", "Recall@5 per category / question type:", "",
           md_table(["category", "n test", "Only Retriever", "RL update", "EAR (explorer)",
                     "EAR (adapter only)"], crow)]
  series = {names[m]: {"Recall@5": get_metric(runs[m], f"recall_{modes[m]}")["per_seed"],
                       "Hitrate@5": get_metric(runs[m], f"hitrate_{modes[m]}")["per_seed"]}
            for m in runs}
  paper = ({names[m]: {"Recall@5": pm[m][0], "Hitrate@5": pm[m][1]} for m in runs}
           if pk else None)
  plots.grouped_bars(r.plot_path("table2_main"), ["Recall@5", "Hitrate@5"], series,
                     title=f"Table 2, {r.opts.benchmark} (mean over {len(r.seeds)} seeds; "
                           "— paper)", ylabel="%", paper=paper)
  plots.paired_differences(
      r.plot_path("table2_paired_vs_retriever"),
      {lab: {"Recall@5": d["recall"], "Hitrate@5": d["hitrate"]} for lab, d in deltas.items()},
      title=f"Table 2, {r.opts.benchmark}: paired difference vs Only Retriever, "
            f"{len(r.seeds)} seeds", ylabel="Δ (points)", baseline="Only Retriever")
  if cats:
    plots.grouped_bars(r.plot_path("table2_per_category"), cats,
                       {names[m]: {c: runs[m]["per_category"][c][f"recall_{modes[m]}"]["per_seed"]
                                   for c in cats} for m in runs},
                       title=f"Recall@5 per category, {r.opts.benchmark}", ylabel="Recall@5 (%)")
  return "\n".join(md)


def suite_ablation(r: Runner) -> str:
  pk = r.paper_key()
  rows_spec = [("Adapter (Tan et al., 2025) = RL update", "rl_update", "adapter"),
               ("+ Only Explorer during training", "ear_no_replay", "adapter"),
               ("+ Only Experience Buffer during training", "ear_no_explorer", "adapter"),
               ("EAR w/o Explorer at test time", "ear", "adapter"),
               ("Only Explorer at test time", "retriever", "explorer"),
               ("EAR (ours)", "ear", "explorer")]
  rows, series, deltas = [], {}, {}
  base = ("Only Retriever", r.run("retriever"), "adapter")
  pret = PAPER["main"][pk]["retriever"][0] if pk else None  # Table 2's retriever
  ear = r.run("ear")
  for label, method, mode in rows_spec:
    s = r.run(method)
    pl, pc = (PAPER["ablation"][b][(method, mode)] for b in ("longmemeval", "locomo"))
    pv = PAPER["ablation"][pk][(method, mode)] if pk else None
    # Baselines: the frozen retriever and full EAR in the same test mode.
    d_ret = pair_runs(r, "ablation", (label, s, mode), base,
                      paper={"recall": pv - pret} if pk else None, primary={"recall"})
    deltas[label] = {"vs Only Retriever": d_ret["recall"]}
    d_ear = None
    if method != "ear":
      d_ear = deltas[label]["vs EAR (same test mode)"] = pair_runs(
          r, "ablation", (label, s, mode), (f"EAR ({mode} at test)", ear, mode),
          metrics=("recall",),
          paper={"recall": pv - PAPER["ablation"][pk][("ear", mode)]} if pk else None)["recall"]
    rows.append([label, mode, fmt_num(pl), fmt_num(pc), fmt(get_metric(s, f"recall_{mode}")),
                 fd(d_ret["recall"]), fd(d_ear) if d_ear is not None else "(reference)",
                 fmt(get_metric(s, f"hitrate_{mode}")), fd(d_ret["hitrate"]),
                 "(reference)" if mode == "explorer" else "–"])
    series[label] = {"Recall@5": get_metric(s, f"recall_{mode}")["per_seed"]}
  paging = []  # after the paper's comparisons, so their records keep their positions
  for i, (label, method, mode) in enumerate(rows_spec):
    if mode == "explorer":
      s = r.run(method)
      new = []
      for pmode, text, d in paging_rows(r, "ablation", label, s):
        dr = pair_runs(r, "ablation", (label, s, pmode), base, primary=False)
        new.append([text, "paging", "–", "–", fmt(get_metric(s, f"recall_{pmode}")),
                    fd(dr["recall"]), "–", fmt(get_metric(s, f"hitrate_{pmode}")),
                    fd(dr["hitrate"]), fd(d)])
      paging.append((i, new))
  rows = insert_rows(rows, paging)
  md = [f"### Table 3 (ablation) — {r.opts.benchmark}", "",
        "Top four rows: explorer disabled at test (adapter top-5); bottom two: explorer at test.",
        "", md_table(["Variant", "test mode", "paper LongMemEval R@5", "paper LoCoMo R@5",
                  "R@5 (here)", "Δ R@5 vs retriever [95% CI]",
                  "Δ R@5 vs EAR, same test mode [95% CI]", "Hit@5 (here)",
                  "Δ Hit@5 vs retriever [95% CI]", PAGING_DELTA_HEADER], rows), "",
        DELTA_NOTE + " Baselines: Only Retriever (top-5 of the frozen retriever) and EAR's own "
        "adapter evaluated in the row's test mode ('(reference)': EAR itself).", "",
        paging_note(ear, r.opts.k)]
  paper = ({lab: {"Recall@5": PAPER["ablation"][pk][(m, mo)]} for lab, m, mo in rows_spec}
           if pk else None)
  plots.grouped_bars(r.plot_path("table3_ablation"), ["Recall@5"], series,
                     title=f"Table 3, {r.opts.benchmark} (— paper)", ylabel="Recall@5 (%)",
                     paper=paper)
  plots.paired_differences(r.plot_path("table3_paired"), deltas,
                           title=f"Table 3, {r.opts.benchmark}: paired Δ Recall@5, "
                                 f"{len(r.seeds)} seeds", ylabel="Δ Recall@5 (points)",
                           baseline="Only Retriever / EAR (same test mode)")
  return "\n".join(md)
