"""Suites `guard_tune` and `guard`: does `ear_safe`'s guard (`core.guard`) keep EAR's adapter-only
ranking at or above the first stage's?

`guard_tune` (LoCoMo validation only; never reads the test split) trains one `ear_safe` run per
setting in `SETTINGS` and reads every row from it: the frozen first stage, the adapter unguarded,
and the guard at each `Z_GRID` value, paired per seed with the frozen first stage. `guard` (test
split) does the same per first stage and critic (`TEST_CRITICS`) for the rows of `TEST_ROWS`.
"""
from __future__ import annotations

import json
from typing import Optional

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import critic as critic_lib
from ear_jax.core import guard as guard_lib
from ear_jax.experiment import runner
from ear_jax.experiment import stats
from ear_jax.experiment import summaries
from ear_jax.experiment.suites.first_stage import GENERATORS_SHOWN, sub_runner
from ear_jax.experiment.suites.pairing import DELTA_NOTE, fd, pair, side
from ear_jax.experiment.suites.paper import fmt, md_table
from ear_jax.experiment.suites.run_cache import Runner
from ear_jax.io import run_checkpoints

METHOD = "ear_safe"
# name -> (critic (precision, recall) overrides, hyperparameter overrides); the last is a setting
# whose adapter is worse than the first stage: what the guard is for.
SETTINGS = {"default critic (P .88, R .86)": ({}, {}),
            "noisy critic (P = R = 0.7)": ({"precision": 0.7, "recall": 0.7}, {}),
            "default critic, learning rate 3e-3": ({}, {"learning_rate": 3e-3})}
Z_GRID = (0.0, 0.25, 0.5, 1.0, 1.645)


def _pct(ev, mode) -> list:
  return (100.0 * np.asarray(ev[f"recall_{mode}"], np.float64)).tolist()


def _guarded(r: Runner, suite: str, hparams: Optional[dict] = None):
  """`ear_safe` over `r`'s benchmark (ValueError when the options turn its guard off)."""
  m = r.method(METHOD, hparams=hparams)
  if not m.config.guard:
    raise ValueError(f"{suite}: --guard_holdout=0 turns the guard off")
  return m


def _first_and_adapted(m, stream, index, seeds, critic, params) -> tuple:
  """`runner.evaluate_params` of the first stage's and of the adapted `[S]` parameters."""
  first = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (len(seeds),) + x.shape),
                                 guard_lib.first_stage_params(m.config))
  score = lambda p: runner.evaluate_params(p, stream, index, m.config, m.hparams, seeds, critic)
  return score(first), score(params)


def guard_rows(r: Runner, critic_name: str, critic_over: dict, hparam_over: dict) -> dict:
  """One `ear_safe` run on the fit part; every row's per-seed validation R@5 (percent)."""
  stream = r.bench().stream
  fit, val = r.validation_split()
  m = _guarded(r, "guard_tune", hparam_over)
  config = m.config
  critic = critic_lib.make_simulated_critic(**critic_over) if critic_over else None
  res = runner.train_and_evaluate(f"guard_tune {critic_name}", stream, fit, val, config,
                                  m.hparams, r.seeds, critic=critic, progress=r.opts.progress)
  states = res.final_state
  ev_first, ev_adapted = _first_and_adapted(m, stream, val, r.seeds, critic, states.params)
  out = {"critic": critic_name, "critic_overrides": critic_over, "hparam_overrides": hparam_over,
         "config": config.to_dict(),
         "frozen": _pct(ev_first, "adapter"), "adapted": _pct(ev_adapted, "adapter"),
         "guarded_run": _pct(res.eval, "adapter"), "explorer_adapted": _pct(ev_adapted, "explorer"),
         "explorer_first": _pct(ev_first, "explorer"), "guard": []}
  for z in Z_GRID:  # the ring scored once per z: the decision and the bound it read
    serve, lcb, _ = (np.asarray(x) for x in jax.vmap(lambda g, p: guard_lib.holdout_decision(
        p, g, config, z))(states.guard, states.params))
    out["guard"].append({
        "z": z, "serve_adapted": serve.tolist(), "lcb": lcb.tolist(),
        "adapter": np.where(serve, out["adapted"], out["frozen"]).tolist(),
        "explorer_guarded": np.where(serve, out["explorer_adapted"],
                                     out["explorer_first"]).tolist()})
  # The run's own evaluation is the guard at the config's z: a consistency check.
  own = [row for row in out["guard"] if row["z"] == config.guard_z]
  if own and not np.allclose(own[0]["adapter"], out["guarded_run"]):
    raise AssertionError("guard_tune: the run's guarded evaluation differs from the guard's "
                         f"decision on its ring: {out['guarded_run']} vs {own[0]['adapter']}")
  logging.info("guard_tune %s: frozen %.2f, adapted %.2f, guarded (run) %.2f", critic_name,
               np.mean(out["frozen"]), np.mean(out["adapted"]), np.mean(out["guarded_run"]))
  return out


def suite_guard_tune(r: Runner) -> str:
  """The guard on LoCoMo validation (see the module docstring); writes guard_tune.json."""
  r.refuse_transfer_benchmark("guard_tune")
  results = [guard_rows(r, name, *over) for name, over in SETTINGS.items()]
  r.write_json(r.workdir / "guard_tune.json", results)
  rows = []
  for res in results:
    frozen = res["frozen"]
    d = lambda v: fd(stats.paired_difference(v, frozen).to_json())
    holdout = res["config"]["guard_holdout"]
    rows.append([res["critic"], "frozen first stage", "–", f"{np.mean(frozen):.2f}", "(baseline)",
                 "–", "–"])
    rows.append([res["critic"], "the same adapter unguarded (trained without the held-out "
                 "queries)", "adapter", f"{np.mean(res['adapted']):.2f}", d(res["adapted"]),
                 f"{len(frozen)}/{len(frozen)}", "–"])
    for row in res["guard"]:
      rows.append([res["critic"], f"held-out guard (every {holdout}th query) z = {row['z']:g}",
                   "adapter", f"{np.mean(row['adapter']):.2f}", d(row["adapter"]),
                   f"{int(np.sum(row['serve_adapted']))}/{len(frozen)}",
                   " ".join(f"{x:+.2f}" for x in row["lcb"])])
    for z, key in (("adapted z", "explorer_adapted"), ("first stage's z", "explorer_first")):
      rows.append([res["critic"], f"ear_tuned explorer, {z}", "explorer T = 4",
                   f"{np.mean(res[key]):.2f}", d(res[key]), "–", "–"])
  return "\n".join([
      f"### Guard: adapter-only vs the frozen first stage — {r.opts.benchmark}, "
      f"{r.opts.candidates} candidates ({len(r.seeds)} seeds, validation = last 20 % of each "
      "seed's training stream; the test split is not read)", "",
      md_table(["setting", "row", "mode", "validation R@5", "Δ vs frozen first stage [95% CI]",
                "seeds serving the adapter", "LCB of mean d per seed"], rows), "",
      DELTA_NOTE + " One `ear_safe` training run per setting; the unguarded row and every guard "
      "setting come from the same adapters (the guard's held-out ring scores the final "
      "parameters at each z)."])


# --suite=guard: the simulated critics of the safety and paging targets (training and test time).
TEST_CRITICS = {"default critic (P .88, R .86)": {},
                "noisy critic (P = R = 0.7)": {"precision": 0.7, "recall": 0.7}}
# The safety target for `ear_safe` adapter-only minus the same frozen first stage (points).
SAFETY_MEAN, SAFETY_LOWER = 0.0, -1.0
# Row -> (its values' source: 'safe' run, 'adapted' unguarded, 'first' untrained; EvalResult mode).
TEST_ROWS = {
    "frozen first stage": ("first", "adapter"),
    "ear_tuned adapter-only (guard off)": ("adapted", "adapter"),
    "ear_safe adapter-only (guarded)": ("safe", "adapter"),
    "ear_safe explorer-assisted": ("safe", "explorer"),
    "paging over the first stage": ("safe", "paging_first_stage"),
    "paging over the served ranking": ("safe", "paging_adapted"),
}
MODE_LABELS = {"adapter": "top-5", "explorer": "explorer T = {t}",
               "paging_first_stage": "{t} pages of 5", "paging_adapted": "{t} pages of 5"}


def guard_test_rows(r: Runner, candidates: str, critic_name: str, critic_over: dict) -> dict:
  """One `ear_safe` run over `candidates` on the test split: `{"rows": {row: {"recall": [S],
  "hitrate": [S]}}, "serve_adapted": [S], "summary": ...}` (percent), cached under
  `<workdir>/guard/`."""
  sub = sub_runner(r, candidates)
  b = sub.bench()
  train, test = sub._splits[False]  # pylint: disable=protected-access
  m = _guarded(sub, "guard")
  config = m.config
  critic = critic_lib.make_simulated_critic(**critic_over)
  p, rc = float(critic.precision), float(critic.recall)
  run_name = f"guard_{candidates}_critic_p{p:.2f}_r{rc:.2f}"
  cache = r.workdir / "guard" / f"{run_name}.json"
  ident = {"config": config.to_dict(), "hparams": summaries.hparams_dict(m.hparams),
           "seeds": r.seeds, "critic": critic_over, "test_index": np.asarray(test).tolist()}
  if r.opts.resume and cache.is_file():
    saved = json.loads(cache.read_text())
    if saved.get("ident") == ident:
      logging.info("guard %s: finished earlier, loaded %s", run_name, cache)
      r.summaries[run_name] = saved["summary"]
      return saved
  res = runner.train_and_evaluate(run_name, b.stream, train, test, config, m.hparams, r.seeds,
                                  critic=critic, progress=r.opts.progress)
  first, adapted = _first_and_adapted(m, b.stream, test, r.seeds, critic, res.final_state.params)
  evs = {"safe": res.eval, "first": first, "adapted": adapted}
  # The same keys and critic: paging over the first stage does not depend on the served params.
  for src_name in ("first", "adapted"):
    if not np.array_equal(evs[src_name]["paging_first_stage_slates"],
                          res.eval["paging_first_stage_slates"]):
      raise AssertionError(f"guard {run_name}: paging over the first stage differs between the "
                           f"run's evaluation and the {src_name} parameters'")
  rows = {name: {metric: (100.0 * np.asarray(evs[src][f"{metric}_{mode}"], np.float64)).tolist()
                 for metric in ("recall", "hitrate")}
          for name, (src, mode) in TEST_ROWS.items()}
  serve = run_checkpoints.guard_decisions(res.final_state, config)
  summary = summaries.summarize(res, b.stream, b.categories)
  summary.update(method=METHOD, run=run_name, critic={k: float(getattr(critic, k))
                                                       for k in ("precision", "recall")},
                 candidates=candidates, epochs=1)
  out = {"ident": ident, "candidates": candidates, "critic": critic_name, "rows": rows,
         "serve_adapted": serve.tolist(), "test_rounds": config.eval_rounds, "summary": summary}
  r.summaries[run_name] = summary
  r.write_json(cache, out)
  logging.info("guard %s: frozen %.2f, ear_tuned %.2f, ear_safe %.2f, explorer %.2f, paging "
               "first stage %.2f, paging served %.2f (R@5)", run_name,
               *[np.mean(rows[k]["recall"]) for k in TEST_ROWS])
  return out


def _at_least(value: float, bound: float) -> bool:
  """`value >= bound` up to float rounding (a per-seed tie's mean prints as -0.00)."""
  return value >= bound - 1e-9


def suite_guard(r: Runner) -> str:
  """`ear_safe` against the frozen first stage and paging, every first stage and critic (test)."""
  results = [guard_test_rows(r, g, name, over) for g in GENERATORS_SHOWN
             for name, over in TEST_CRITICS.items()]
  r.write_json(r.workdir / "guard.json",
               [{k: v for k, v in res.items() if k != "summary"} for res in results])
  table, targets = [], []
  for res in results:
    rows, t = res["rows"], res["test_rounds"]
    frozen, paging = rows["frozen first stage"], rows["paging over the first stage"]
    label = f"{res['candidates']}, {res['critic']}"
    for name, (_, mode) in TEST_ROWS.items():
      vals = rows[name]
      cells = [res["candidates"], res["critic"], name, MODE_LABELS[mode].format(t=t),
               fmt(summaries.mean_std(vals["recall"]))]
      if name == "frozen first stage":
        cells += ["(baseline)", "–"]
      else:
        d = pair(r, "guard", side(f"{name} / {label}", res["summary"], mode),
                 side(f"frozen first stage / {label}", res["summary"], "adapter"), "R@5",
                 vals["recall"], frozen["recall"], primary=name.startswith("ear_safe"))
        cells.append(fd(d))
        if mode in ("explorer", "paging_adapted"):
          dp = pair(r, "guard", side(f"{name} / {label}", res["summary"], mode),
                    side(f"paging over the first stage / {label}", res["summary"],
                         "paging_first_stage"), "R@5", vals["recall"], paging["recall"],
                    primary=mode == "explorer")
          cells.append(fd(dp))
        else:
          cells.append("(baseline)" if mode == "paging_first_stage" else "–")
      cells.append(fmt(summaries.mean_std(vals["hitrate"])))
      serving, target = "–", "–"
      if name == "ear_safe adapter-only (guarded)":
        serving = f"{int(np.sum(res['serve_adapted']))}/{len(res['serve_adapted'])}"
        ok = _at_least(d["mean"], SAFETY_MEAN) and _at_least(d["lo"], SAFETY_LOWER)
        target = (f"safety: {'met' if ok else 'not met'} (mean ≥ {SAFETY_MEAN:g}, lower bound ≥ "
                  f"{SAFETY_LOWER:g})")
        targets.append(("safety", ok))
      elif mode == "explorer":
        ok = _at_least(dp["mean"], 0.0)
        target = f"paging: {'met' if ok else 'not met'} (Δ vs paging ≥ 0)"
        targets.append(("paging", ok))
      table.append(cells + [serving, target])
  met = {kind: sum(ok for k, ok in targets if k == kind) for kind in ("safety", "paging")}
  total = {kind: sum(k == kind for k, _ in targets) for kind in ("safety", "paging")}
  holdout = results[0]["ident"]["config"]["guard_holdout"]
  training = (f"with guard_holdout = {holdout} every {holdout}-th training query is held out "
              "(paged over the first stage, never trained on), so the 'guard off' row is THAT "
              "adapter served unguarded, trained on the other queries: not `ear_tuned`'s")
  return "\n".join([
      f"### Guard: ear_safe against the frozen first stage and paging — {r.opts.benchmark} "
      f"(test split, {len(r.seeds)} seeds)", "",
      md_table(["first stage", "critic", "row", "test mode", "R@5", "Δ R@5 vs frozen first stage "
                "[95% CI]", "Δ R@5 vs paging over the first stage [95% CI]", "Hit@5",
                "seeds serving the adapter", "target"], table), "",
      DELTA_NOTE + f" One `ear_safe` training run per first stage and critic ({training}); every "
      "row is scored with that run's critic and evaluation keys. Paging: the critic reads the "
      f"ranking's top {results[0]['test_rounds']} x 5 in pages of 5 (the same calls as the "
      "Explorer) and the answer puts the cited memories first. Targets met: safety "
      f"{met['safety']}/{total['safety']}, paging {met['paging']}/{total['paging']}."])
