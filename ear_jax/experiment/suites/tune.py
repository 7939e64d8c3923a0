"""Suite `tune`: choose EAR's settings on validation data only, in staged vmapped sweeps.

Protocol (`sweep`): per seed the training stream's last 20 % is validation; the test split is never
read, and LongMemEval_S (the held-out transfer benchmark) is refused. Selection: the highest mean
validation Recall@5 (adapter only; test-time choices by explorer-assisted Recall@5).
Stages: 1. learning rate x baseline b (`LR_GRID` x `B_GRID`); 2. each of `STATIC_VARIANTS`
around stage 1's best; 3. greedy combination of those that beat stage 1; 4. the continuous
hyperparameters one at a time (`REFINE`), then together. Every call is cached in
`<workdir>/tune/*.json`; the choice goes to `tune/chosen.json`, and the table says whether the
`ear_tuned` preset holds it.
"""
from __future__ import annotations

import dataclasses
import json

from absl import logging
import numpy as np

from ear_jax.core import config as config_lib
from ear_jax.experiment import plots
from ear_jax.experiment import stats
from ear_jax.experiment import sweep
from ear_jax.experiment.suites.beyond import suite_beyond  # noqa: F401 (re-exported)
from ear_jax.experiment.suites.pairing import fd
from ear_jax.experiment.suites.paper import md_table
from ear_jax.experiment.suites.run_cache import Runner, slug

LR_GRID = (3e-5, 1e-4, 3e-4, 1e-3)
B_GRID = (0.0, 0.25, 0.5)
TEST_ROUNDS = 4  # the paper's test budget: T = 4 critic calls per test query
EVAL_VARIANTS = {"round_T": {"test_rounds": TEST_ROUNDS, "final_slate": "round_T"},
                 "exploit": {"test_rounds": TEST_ROUNDS, "final_slate": "exploit"}}
# One static choice at a time (EARConfig overrides on top of the paper's switches).
STATIC_VARIANTS = {
    "T_train=2": {"num_rounds": 2},
    "T_train=8": {"num_rounds": 8},
    "B=8": {"replay_size": 8},
    "random replay": {"replay_strategy": "random"},
    "no replay": {"use_replay": False},
    "sequential loss": {"loss_form": "sequential"},
}
# Stage 4: continuous hyperparameters, one change at a time around the best (then together).
REFINE = {
    "lambda_rep=0.5": {"lambda_rep": 0.5}, "lambda_rep=2": {"lambda_rep": 2.0},
    "tau=0.25": {"tau": 0.25}, "tau=1": {"tau": 1.0},
    "alpha=0.25": {"alpha": 0.25}, "alpha=1": {"alpha": 1.0},
    "lambda=0.6/0.2/0.2": {"lambda_rel": 0.6, "lambda_div": 0.2, "lambda_exp": 0.2},
    "lambda=0.3/0.2/0.5": {"lambda_rel": 0.3, "lambda_div": 0.2, "lambda_exp": 0.5},
    "lr x0.5": {"learning_rate": 0.5}, "lr x2": {"learning_rate": 2.0},
}
MAX_COMBINE = 4
# "Better" means higher by more than float32 rounding of a mean: equal scores are ties.
_EPS = 1e-3


class _Tuner:
  """Runs and caches validation sweeps; keeps every scored setting as a row."""

  def __init__(self, r: Runner):
    self.r, self.stream = r, r.bench().stream
    self.fit, self.val = r.validation_split()
    self.dir = r.workdir / "tune"
    self.rows = []  # {stage, variant, switches, hparams, adapter [S], round_T [S], exploit [S]}

  def run(self, stage, variant, switches, hp_list, method="ear"):
    """Scores `hp_list` (dicts of HParams overrides) under `switches`; returns the new rows."""
    config = self.r.method(method, **switches).config
    hps = [self.r.method(method, hparams=h, **switches).hparams for h in hp_list]
    ident = {"config": config.to_dict(), "seeds": self.r.seeds,
             "hparams": [{k: float(v) for k, v in dataclasses.asdict(h).items()} for h in hps],
             "fit": self.fit.tolist(), "validation": self.val.tolist()}
    path = self.dir / f"{slug(stage + '_' + variant)}.json"
    res = None
    if self.r.opts.resume and path.is_file():
      stored = json.loads(path.read_text())
      if stored.get("ident") == ident:
        res = stored["result"]
        logging.info("tune %s / %s: loaded %s", stage, variant, path)
    if res is None:
      logging.info("tune %s / %s: %d settings x %d seeds", stage, variant, len(hps),
                   len(self.r.seeds))
      out = sweep.sweep_validation(self.stream, self.fit, self.val, config,
                                   config_lib.stack_hparams(hps), self.r.seeds,
                                   eval_variants=EVAL_VARIANTS)
      res = {"adapter": out["recall_adapter"].tolist(), "seconds": round(out["seconds"], 1),
             **{v: out["explorer"][v]["recall"].tolist() for v in EVAL_VARIANTS}}
      self.r.write_json(path, {"ident": ident, "result": res}, indent=None)
    rows = [{"stage": stage, "variant": variant, "method": method, "switches": dict(switches),
             "hparams": dict(ident["hparams"][i]), "changed": dict(h),
             "adapter": res["adapter"][i], **{v: res[v][i] for v in EVAL_VARIANTS}}
            for i, h in enumerate(hp_list)]
    self.rows += rows
    return rows


def _mean(row, key="adapter"):
  return float(np.mean(row[key]))


def _best(rows, key="adapter"):
  """The row of the highest mean; within `_EPS` of it, the first listed (ties keep the earlier)."""
  top = max(_mean(row, key) for row in rows)
  return next(row for row in rows if _mean(row, key) >= top - _EPS)


def _lr_b(lr, b):
  return {"learning_rate": lr, "baseline": b}


def _around(best):
  lr = best["hparams"]["learning_rate"]
  return [_lr_b(x, b) for x in (lr / 3, lr, lr * 3) for b in (0.0, 0.5)]


def _delta(row, ref):
  return stats.paired_difference(row["adapter"], ref["adapter"]).to_json()


def tune(r: Runner) -> dict:
  """Runs stages 1-4; returns `{rows, chosen, retriever, paper}` (see the module docstring)."""
  r.refuse_transfer_benchmark("--suite=tune")
  if len(r.seeds) < 5:
    logging.warning("tune: %d seeds; the protocol selects on at least 5", len(r.seeds))
  t = _Tuner(r)
  retriever = t.run("0", "retriever", {}, [{}], method="retriever")[0]
  stage1 = t.run("1", "paper switches", {}, [_lr_b(lr, b) for lr in LR_GRID for b in B_GRID])
  paper = next(row for row in stage1 if np.isclose(row["hparams"]["learning_rate"], 1e-3)
               and np.isclose(row["hparams"]["baseline"], 0.5))
  best1 = _best(stage1)
  singles = {name: _best(t.run("2", name, sw, _around(best1)))
             for name, sw in STATIC_VARIANTS.items()}
  # Stage 3: greedy combination of the improving static choices, best first.
  improving = sorted((n for n in singles if _mean(singles[n]) > _mean(best1) + _EPS),
                     key=lambda n: -_mean(singles[n]))
  current = _best([best1] + [singles[n] for n in improving[:1]])
  for n in improving[1:1 + MAX_COMBINE]:
    sw = STATIC_VARIANTS[n]
    if set(sw) & set(current["switches"]):
      continue  # e.g. two values of T: the better one is already in
    cand = _best(t.run("3", " + ".join(sorted(list(_names(current)) + [n])),
                       {**current["switches"], **sw}, _around(current)))
    if _mean(cand) > _mean(current) + _EPS:
      current = cand
  # Stage 4: the continuous hyperparameters one at a time, then the improving ones together.
  base = {k: current["hparams"][k] for k in ("learning_rate", "baseline")}
  hp_list = [base] + [_refined(base, ch) for ch in REFINE.values()]
  label = " + ".join(sorted(_names(current))) or "paper switches"
  refined = t.run("4", "refine " + label, current["switches"], hp_list)
  better = [ch for ch, row in zip(REFINE.values(), refined[1:])
            if _mean(row) > _mean(refined[0]) + _EPS]
  chosen = _best(refined + [current])
  if len(better) > 1:
    merged = {}
    for ch in better:
      for k in ch:
        merged.setdefault(k, ch[k])  # the first (listed) value of a hyperparameter wins
    combined = t.run("4", "refine combined", current["switches"], [_refined(base, merged)])[0]
    chosen = _best([chosen, combined])
  final = "exploit" if _mean(chosen, "exploit") > _mean(chosen, "round_T") + _EPS else "round_T"
  return {"rows": t.rows, "chosen": chosen, "final_slate": final, "retriever": retriever,
          "paper": paper, "best_stage1": best1, "singles": singles}


def _names(row):
  sw = row["switches"]
  return {n for n, v in STATIC_VARIANTS.items() if all(sw.get(k) == x for k, x in v.items())}


def _refined(base, change):
  out = dict(base)
  for k, v in change.items():
    out[k] = base[k] * v if k == "learning_rate" else v
  return out


def chosen_preset(result: dict) -> tuple[dict, dict]:
  """`(switches, hparams)` of the chosen setting as `ear_tuned` would hold them."""
  c = result["chosen"]
  switches = {**c["switches"], "final_slate": result["final_slate"], "test_rounds": TEST_ROUNDS}
  hp = {k: float(np.float32(v)) for k, v in c["hparams"].items()
        if not np.isclose(v, config_lib.HPARAM_DEFAULTS[k])}
  return switches, hp


def preset_matches(result: dict) -> bool:
  """Whether `core.config`'s `ear_tuned` preset holds the chosen setting."""
  switches, hp = chosen_preset(result)
  want = config_lib.Method.named("ear", hparams=hp, **switches)
  have = config_lib.Method.named("ear_tuned")
  # `test_rounds` None and `test_rounds == num_rounds` are the same setting.
  want_hp, have_hp = want.hparams, have.hparams
  want, have = (dataclasses.replace(m.config, test_rounds=m.config.eval_rounds).to_dict()
                for m in (want, have))
  return want == have and all(np.isclose(float(getattr(have_hp, k)), float(getattr(want_hp, k)))
                              for k in config_lib.HPARAM_DEFAULTS)


def _fmt(row, key):
  v = np.asarray(row[key], np.float64)
  return f"{v.mean():.2f} ± {v.std(ddof=1) if v.size > 1 else 0.0:.2f}"


def suite_tune(r: Runner) -> str:
  res = tune(r)
  rows, ret, paper, chosen = res["rows"], res["retriever"], res["paper"], res["chosen"]
  switches, hp = chosen_preset(res)
  r.write_json(r.workdir / "tune" / "chosen.json", {
      "switches": switches, "hparams": hp, "final_slate": res["final_slate"],
      "validation_recall_adapter": chosen["adapter"],
      "validation_recall_explorer": chosen[res["final_slate"]]})

  def line(label, row):
    return [label, _hp_text(row), _fmt(row, "adapter"), fd(_delta(row, ret)),
            fd(_delta(row, paper)), _fmt(row, "round_T"), _fmt(row, "exploit")]

  table = [line("Only Retriever", ret), line("EAR, paper (lr 1e-3, b 0.5)", paper),
           line("EAR, paper switches, best lr x b", res["best_stage1"])]
  table += [line(n, s) for n, s in res["singles"].items()]
  combos = {}
  for row in rows:  # stage 3: each combination at its best lr x b
    if row["stage"] == "3":
      combos[row["variant"]] = _best([combos.get(row["variant"], row), row])
  table += [line(f"stage 3: {v}", row) for v, row in combos.items()]
  table += [line(f"stage 4: {', '.join(f'{k}={v:.3g}' for k, v in row['changed'].items())}", row)
            for row in rows if row["stage"] == "4"]
  table.append(line("**chosen**", chosen))
  grid = np.array([[_mean(next(x for x in rows if x["stage"] == "1"
                               and np.isclose(x["hparams"]["learning_rate"], lr)
                               and np.isclose(x["hparams"]["baseline"], b))) for b in B_GRID]
                   for lr in LR_GRID])
  plots.heatmap(r.plot_path("tune_lr_b"), LR_GRID, B_GRID, grid,
                title=f"validation Recall@5 (adapter), paper switches, {len(r.seeds)} seeds",
                row_label="learning rate", col_label="baseline b")
  shown = dict([("retriever", ret), ("paper EAR", paper), ("best lr x b", res["best_stage1"])]
               + list(res["singles"].items()) + [("chosen", chosen)])
  series = {name: {label: row[key] for label, row in shown.items()}
            for name, key in (("adapter only", "adapter"), ("explorer T=4, exploit", "exploit"))}
  plots.grouped_bars(r.plot_path("tune_variants"), list(shown), series,
                     title="validation Recall@5 per setting (mean, 95% interval over seeds)",
                     ylabel="Recall@5 (%)")
  r.write_json(r.workdir / "tune" / "sweep_table.json", rows)
  fit, val = r.validation_split()
  md = [f"### Tuning on validation — {r.opts.benchmark}", "",
        f"Per seed the training stream's last 20 % ({val.shape[1]} queries) is validation; "
        f"candidates are trained online on the first {fit.shape[1]} and scored there; the test "
        f"split is never read. {len(r.seeds)} seeds; {len(rows)} settings scored. Selection: mean "
        "validation Recall@5 of the adapter alone; the final-slate rule by explorer-assisted "
        f"validation Recall@5 at T = {TEST_ROUNDS}. Static choices are one at a time at their "
        "best lr x b (stage 2), then combined (stage 3); continuous ones refined (stage 4).", "",
        md_table(["setting", "changed hyperparameters", "val R@5 adapter",
                  "Δ vs retriever [95% CI]", "Δ vs paper EAR [95% CI]",
                  f"val R@5 explorer T={TEST_ROUNDS} round T", f"val R@5 explorer T={TEST_ROUNDS} "
                  "exploit"], table), "",
        f"Chosen: switches {switches}, hyperparameters {hp} (others the paper's); final slate "
        f"'{res['final_slate']}'. `ear_tuned` preset in `ear_jax/core/config.py` "
        f"{'holds this setting' if preset_matches(res) else 'DIFFERS from this setting'}.",
        "", f"All {len(rows)} scored settings: `{r.workdir}/tune/sweep_table.json`."]
  return "\n".join(md)


def _hp_text(row):
  h = row["hparams"]
  parts = [f"{k}={h[k]:.3g}" for k in config_lib.HPARAM_DEFAULTS
           if not np.isclose(h[k], config_lib.HPARAM_DEFAULTS[k])]
  sw = [f"{k}={v}" for k, v in row["switches"].items()]
  return ", ".join(sw + parts) or "(paper)"


__all__ = ["B_GRID", "EVAL_VARIANTS", "LR_GRID", "REFINE", "STATIC_VARIANTS", "TEST_ROUNDS",
           "chosen_preset", "preset_matches", "suite_beyond", "suite_tune", "tune"]
