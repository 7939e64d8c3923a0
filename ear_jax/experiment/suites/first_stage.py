"""Suites `first_stage_tune` and `first_stage`: EAR over dense, BM25 and hybrid first stages
(the paper's Table 10 question: another first stage, its scores as side information).

`first_stage_tune` (LoCoMo validation only; never reads the test split) chooses the hybrid fusion
(`LEXICAL_WEIGHT_GRID`) by the frozen first stage's Recall@5 and `ear`'s `side_init`
(`SIDE_INIT_GRID`) by adapter-only Recall@5 at K = 20, and says whether the library's defaults
hold them (`ear_tuned`'s `side_init`: `side_init_tune`). `first_stage` (test split) pairs per
first stage in `GENERATORS_SHOWN` the frozen first stage with `ear` / `ear_tuned`, each
explorer-assisted row beside its paging neighbours.
"""
from __future__ import annotations

import dataclasses

from absl import logging
import numpy as np

from ear_jax.core import config as config_lib
from ear_jax.data import candidates as candidates_lib
from ear_jax.data import first_stage
from ear_jax.experiment import plots
from ear_jax.experiment import sweep
from ear_jax.experiment.suites.pairing import (DELTA_NOTE, PAGING_DELTA_HEADER, explorer_rounds,
                                               fd, get_metric, insert_rows, pair_runs,
                                               paging_note, paging_rows)
from ear_jax.experiment.suites.paper import fmt, fmt_seeds, md_table
from ear_jax.experiment.suites.run_cache import Runner

GENERATORS_SHOWN = ("dense", "bm25", "hybrid")
LEXICAL_WEIGHT_GRID = (0.3, 0.4, 0.5, 0.6, 0.7)
SIDE_INIT_GRID = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
TUNED_METHODS = ("ear", "ear_tuned")
SIDE_INIT_METHODS = ("ear",)  # ear_tuned's side_init: suites/side_init.py
TEST_ROUNDS = 4
MODES = {"adapter": "adapter only", "explorer": "explorer-assisted, T = 4"}
# The targets (test split, 10 seeds).
TARGETS = {"locomo": {"first_stage": 46.0, "adapter_gain": 5.0, "explorer": 55.0},
           "longmemeval": {"adapter_gain": 3.0, "explorer": 80.0}}


def sub_runner(r: Runner, candidates: str, **options) -> Runner:
  """A `Runner` over the same benchmark, seeds and splits with another first stage; runs go to
  `<workdir>/first_stage/<candidates>[...]/`, records into `r`'s results.json."""
  tag = "_".join([candidates] + [f"{k}={v}" for k, v in sorted(options.items())])
  return r.child(r.workdir / "first_stage" / tag, candidates=candidates, **options)


def first_stage_recall(r: Runner, index: np.ndarray) -> np.ndarray:
  """`[S]` Recall@5 (percent) of the frozen first stage's own top-5 on `index [S, V]`."""
  b = r.bench()
  return np.asarray([candidates_lib.retriever_report(b.take(i))["overall"]["recall@5"]
                     for i in index])


def tune_first_stage(r: Runner) -> dict:
  """Stages A and B on validation data (see the module docstring); returns every scored row."""
  r.refuse_transfer_benchmark("first_stage_tune")
  out = {"fusion": [], "side_init": []}
  fit, val = r.validation_split()
  options = [("rrf", {"fusion": "rrf"})] + [
      (f"weighted {w}", {"fusion": "weighted", "lexical_weight": w}) for w in LEXICAL_WEIGHT_GRID]
  for name, over in [("dense", None), ("bm25", None)] + [("hybrid " + n, o) for n, o in options]:
    sub = sub_runner(r, name.split()[0], side_features=False, **(over or {}))
    rec = first_stage_recall(sub, val)
    out["fusion"].append({"first_stage": name, "options": over, "per_seed": rec.tolist(),
                          "mean": float(rec.mean())})
    logging.info("first_stage_tune A: %s validation R@5 %.2f", name, rec.mean())
  hybrids = [row for row in out["fusion"] if row["first_stage"].startswith("hybrid")]
  best = max(hybrids, key=lambda row: row["mean"] + 1e-9 * (row["options"]["fusion"] == "rrf"))
  out["chosen_fusion"] = best["options"]
  for cand, over in (("bm25", {}), ("hybrid", best["options"])):
    sub = sub_runner(r, cand, side_features=True, **over)
    stream = sub.bench().stream
    for method in SIDE_INIT_METHODS:
      for side_init in SIDE_INIT_GRID:
        m = sub.method(method, side_init=side_init)
        res = sweep.sweep_validation(
            stream, fit, val, m.config, config_lib.stack_hparams([m.hparams]), r.seeds,
            eval_variants={"T4": {"test_rounds": TEST_ROUNDS, "final_slate": m.config.final_slate}})
        row = {"first_stage": cand, "method": method, "side_init": side_init,
               "adapter": res["recall_adapter"][0].tolist(),
               "explorer": res["explorer"]["T4"]["recall"][0].tolist()}
        out["side_init"].append(row)
        logging.info("first_stage_tune B: %s %s side_init=%g: validation R@5 adapter %.2f, "
                     "explorer %.2f", cand, method, side_init, np.mean(row["adapter"]),
                     np.mean(row["explorer"]))
  out["chosen_side_init"] = {}
  for method in SIDE_INIT_METHODS:
    means = {si: np.mean([np.mean(row["adapter"]) for row in out["side_init"]
                          if row["method"] == method and row["side_init"] == si])
             for si in SIDE_INIT_GRID}
    out["chosen_side_init"][method] = max(SIDE_INIT_GRID, key=lambda si: (means[si], -si))
  return out


def library_defaults() -> dict:
  """What the library runs without flags: the hybrid fusion and each method's `side_init`."""
  fs = first_stage.FirstStageOptions()
  fusion = {"fusion": fs.fusion} if fs.fusion == "rrf" else {
      "fusion": fs.fusion, "lexical_weight": fs.lexical_weight}
  return {"fusion": fusion, "side_init": {
      m: config_lib.EARConfig.for_method(m, side_features=3).side_init for m in SIDE_INIT_METHODS}}


def suite_first_stage_tune(r: Runner) -> str:
  """Validation tuning of the first stage's settings (LoCoMo); writes first_stage_tune.json."""
  res = tune_first_stage(r)
  lib = library_defaults()
  res["library_defaults"] = lib
  res["defaults_hold_choice"] = (lib["fusion"] == res["chosen_fusion"]
                                 and lib["side_init"] == res["chosen_side_init"])
  r.write_json(r.workdir / "first_stage_tune.json", res)
  rows_a = [[row["first_stage"], fmt_seeds(row["per_seed"])] for row in res["fusion"]]
  rows_b = [[row["first_stage"], row["method"], f"{row['side_init']:g}",
             fmt_seeds(row["adapter"]), fmt_seeds(row["explorer"])] for row in res["side_init"]]
  return "\n".join([
      f"### First stage: validation tuning — {r.opts.benchmark} ({len(r.seeds)} seeds, "
      "validation = last 20 % of each seed's training stream; the test split is not read)", "",
      "A. Frozen first stage, validation Recall@5 (its own top-5):", "",
      md_table(["first stage", "validation R@5"], rows_a), "",
      f"Chosen hybrid fusion: {res['chosen_fusion']}.", "",
      "B. `side_init` (the first stage's weight in z at the start), trained on the fit part:", "",
      md_table(["first stage", "method", "side_init", "validation R@5 adapter",
                "validation R@5 explorer T=4"], rows_b), "",
      f"Chosen side_init (best mean adapter-only validation R@5 over bm25 and hybrid): "
      f"{res['chosen_side_init']}. Library defaults: {lib}; they "
      f"{'hold' if res['defaults_hold_choice'] else 'DO NOT hold'} the chosen values.",
      "Cells: mean ± std over seeds (percent)."])


def suite_first_stage(r: Runner) -> str:
  """Frozen first stage vs `ear` / `ear_tuned` over dense, BM25 and hybrid candidates (test)."""
  runs = {}
  for g in GENERATORS_SHOWN:
    sub = sub_runner(r, g)
    runs[g] = {m: sub.run(m) for m in ("retriever",) + TUNED_METHODS}
    for m in TUNED_METHODS:
      if explorer_rounds(runs[g][m]) != TEST_ROUNDS:
        raise ValueError(f"{m} tests with T != {TEST_ROUNDS}; this suite compares at T = 4")
  best = max(runs, key=lambda g: get_metric(runs[g]["retriever"], "recall_adapter")["mean"])
  best_ret = (f"{best} first stage", runs[best]["retriever"], "adapter")
  targets = TARGETS.get(r.opts.benchmark, {})
  rows, diffs, explorer_rows = [], {}, []
  for g in GENERATORS_SHOWN:
    ret = runs[g]["retriever"]
    rows.append([g, "frozen first stage", "top-5", fmt(get_metric(ret, "recall_adapter")),
                 "(baseline)", "(baseline)" if g == best else fd(pair_runs(
                     r, "first_stage", (f"{g} first stage", ret, "adapter"), best_ret,
                     metrics=("recall",), primary=False)["recall"]),
                 fmt(get_metric(ret, "hitrate_adapter")), "–", "–"])
    for m in TUNED_METHODS:
      for mode in MODES:
        s = runs[g][m]
        d_own = pair_runs(r, "first_stage", (f"{m} over {g}", s, mode),
                          (f"{g} first stage", ret, "adapter"), primary={"recall"})
        d_best = pair_runs(r, "first_stage", (f"{m} over {g}", s, mode), best_ret,
                           metrics=("recall",), primary=False)
        diffs[f"{m} / {g} [{MODES[mode]}]"] = {"Recall@5": d_best["recall"]}
        target = "–"
        if g == best and mode == "adapter" and "adapter_gain" in targets:
          met = d_best["recall"]["mean"] >= targets["adapter_gain"]
          target = f"{'met' if met else 'not met'} (Δ ≥ +{targets['adapter_gain']:g})"
        elif mode == "explorer" and "explorer" in targets:
          met = get_metric(s, "recall_explorer")["mean"] >= targets["explorer"]
          target = f"{'met' if met else 'not met'} (≥ {targets['explorer']:g})"
        rows.append([g, m, MODES[mode], fmt(get_metric(s, f"recall_{mode}")),
                     fd(d_own["recall"]), fd(d_best["recall"]),
                     fmt(get_metric(s, f"hitrate_{mode}")), target,
                     "(reference)" if mode == "explorer" else "–"])
        if mode == "explorer":
          explorer_rows.append((len(rows) - 1, g, m))
  paging = []  # after the targets' comparisons, so their records keep their positions
  for i, g, m in explorer_rows:
    s, ret, new = runs[g][m], runs[g]["retriever"], []
    for mode, text, d in paging_rows(r, "first_stage", f"{m} over {g}", s):
      d_own = pair_runs(r, "first_stage", (f"{m} over {g}", s, mode),
                        (f"{g} first stage", ret, "adapter"), metrics=("recall",), primary=False)
      d_best = pair_runs(r, "first_stage", (f"{m} over {g}", s, mode), best_ret,
                         metrics=("recall",), primary=False)
      new.append([g, m, text, fmt(get_metric(s, f"recall_{mode}")), fd(d_own["recall"]),
                  fd(d_best["recall"]), fmt(get_metric(s, f"hitrate_{mode}")), "–", fd(d)])
    paging.append((i, new))
  rows = insert_rows(rows, paging)
  best_mean = get_metric(runs[best]["retriever"], "recall_adapter")["mean"]
  note = ""
  if "first_stage" in targets:
    note = (f" Target for the best frozen first stage (R@5 ≥ {targets['first_stage']:g}): "
            f"{best} {best_mean:.2f}, {'met' if best_mean >= targets['first_stage'] else 'not met'}.")
  ceil = {g: fmt(runs[g]["retriever"]["ceiling"]["recall@K"]) for g in GENERATORS_SHOWN}
  plots.paired_differences(r.plot_path("first_stage_paired_vs_best"), diffs,
                           title=f"{r.opts.benchmark}: paired Δ R@5 vs the best frozen first "
                                 f"stage ({best}), {len(r.seeds)} seeds", ylabel="Δ (points)",
                           baseline=f"{best} first stage")
  fs_opts = dataclasses.asdict(r.opts.first_stage_options())
  return "\n".join([
      f"### First stage: EAR over dense, BM25 and hybrid candidates — {r.opts.benchmark} "
      "(test split)", "",
      md_table(["first stage", "method", "test mode", "R@5", "Δ R@5 vs same first stage "
                "[95% CI]", f"Δ R@5 vs best first stage ({best}) [95% CI]", "Hit@5",
                "target", PAGING_DELTA_HEADER], rows), "",
      DELTA_NOTE + f" The frozen first stage is the generator's own top-5. Side information: on "
      f"for bm25 and hybrid (z = adapted cosine + w . [first-stage score, dense cosine, BM25]), off "
      f"for dense (the paper's EAR). Hybrid fusion: {fs_opts}. Recall@K ceiling (all gold in the "
      f"K = {r.opts.k} candidates): {ceil}." + note, "",
      paging_note(runs[best]["ear"], r.opts.k)])
