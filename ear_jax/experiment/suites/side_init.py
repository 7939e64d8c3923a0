"""Suite `side_init_tune`: `ear_tuned`'s `side_init` (the first stage's weight in
`z = q~·m~ + w·f` before any feedback) and learning rate, chosen on the validation part of every
benchmark in `BENCHMARKS` at every pool size K in `pool.K_VALUES`.

Each setting trains `ear_tuned` on the fit part of `runner.validation_split` (the test split is
not read), scored by adapter-only Recall@5 paired per seed with the frozen first stage. `choose`:
the setting whose every (benchmark, K) has mean Δ >= 0 and a 95 % lower bound >= -1 (the `pool`
table's bar on the test split), with the largest summed Δ.
"""
from __future__ import annotations

import dataclasses

from absl import logging
import numpy as np

from ear_jax.core import config as config_lib
from ear_jax.experiment import stats
from ear_jax.experiment import sweep
from ear_jax.experiment.suites import pool
from ear_jax.experiment.suites.first_stage import first_stage_recall
from ear_jax.experiment.suites.pairing import DELTA_NOTE, fd
from ear_jax.experiment.suites.paper import md_table
from ear_jax.experiment.suites.run_cache import Runner

BENCHMARKS = ("locomo", "longmemeval")
SIDE_INITS = (0.05, 0.1, 0.25, 0.5)
LEARNING_RATES = (1e-4, 3e-5)
LOWER_BOUND = -1.0  # the least 95 % lower bound of a safe (benchmark, K) cell


def tune_side_init(r: Runner) -> list:
  """Every (benchmark, K, side_init, learning rate): per-seed adapter-only Δ R@5 (validation)."""
  rows = []
  for bench in BENCHMARKS:
    for k in pool.K_VALUES:
      sub = Runner(dataclasses.replace(r.opts, benchmark=bench, k=k,
                                       workdir=str(r.workdir / f"{bench}_k{k}")))
      stream = sub.bench().stream
      fit, val = sub.validation_split()
      frozen = first_stage_recall(sub, val)
      for side_init in SIDE_INITS:
        methods = [sub.method(pool.TUNED, hparams={"learning_rate": lr}, side_init=side_init)
                   for lr in LEARNING_RATES]
        res = sweep.sweep_validation(stream, fit, val, methods[0].config,
                                     config_lib.stack_hparams([m.hparams for m in methods]),
                                     r.seeds)
        for i, lr in enumerate(LEARNING_RATES):
          delta = res["recall_adapter"][i] - frozen
          rows.append({"benchmark": bench, "k": k, "side_init": side_init, "learning_rate": lr,
                       "frozen": frozen.tolist(), "delta": delta.tolist()})
          logging.info("side_init_tune %s K=%d side_init=%g lr=%g: validation Δ R@5 %+.2f",
                       bench, k, side_init, lr, float(np.mean(delta)))
  return rows


def choose(rows: list) -> dict:
  """The (side_init, learning rate) safe in every (benchmark, K) with the largest summed mean Δ;
  `chosen` is None when no setting is safe everywhere."""
  settings = sorted({(row["side_init"], row["learning_rate"]) for row in rows})

  def cells(setting):
    return [row for row in rows if (row["side_init"], row["learning_rate"]) == setting]

  def safe(row):
    mean, lo, _, _ = stats.mean_interval(row["delta"])
    return mean >= 0.0 and (np.isnan(lo) or lo >= LOWER_BOUND)  # (lo is nan for 1 seed)

  summed = {s: float(sum(np.mean(row["delta"]) for row in cells(s))) for s in settings}
  ok = [s for s in settings if all(safe(row) for row in cells(s))]
  chosen = max(ok, key=lambda s: (summed[s], -s[0])) if ok else None
  return {"chosen": None if chosen is None else {"side_init": chosen[0],
                                                 "learning_rate": chosen[1]},
          "summed_delta": [{"side_init": s[0], "learning_rate": s[1], "sum": summed[s],
                            "safe": s in ok} for s in settings]}


def suite_side_init_tune(r: Runner) -> str:
  """`side_init_tune`: the validation table of every benchmark and K; writes side_init_tune.json."""
  rows = tune_side_init(r)
  res = {"rows": rows, **choose(rows)}
  preset = config_lib.EARConfig.for_method(pool.TUNED, side_features=3).side_init
  preset_lr = round(float(config_lib.hparams_for_method(pool.TUNED).learning_rate), 10)
  res["preset"] = {"side_init": preset, "learning_rate": preset_lr}
  r.write_json(r.workdir / "side_init_tune.json", res)
  ks = pool.K_VALUES
  table = []
  for setting in sorted({(row["side_init"], row["learning_rate"]) for row in rows}):
    cell = {(row["benchmark"], row["k"]): row for row in rows
            if (row["side_init"], row["learning_rate"]) == setting}
    table.append([f"{setting[0]:g}", f"{setting[1]:g}"] + [
        fd(stats.paired_difference(cell[(b, k)]["delta"], np.zeros(len(cell[(b, k)]["delta"]))))
        for b in BENCHMARKS for k in ks])
  chosen = res["chosen"]
  return "\n".join([
      f"### `ear_tuned`'s side_init: validation — {', '.join(BENCHMARKS)}, {r.opts.candidates} "
      f"({len(r.seeds)} seeds; validation = the last 20 % of each seed's training stream, the "
      "test split is not read)", "",
      "Δ adapter-only R@5 vs the frozen first stage on the same validation questions [95% CI]:",
      "", md_table(["side_init", "learning rate"] + [f"{b}, K = {k}" for b in BENCHMARKS
                                                    for k in ks], table), "",
      "Chosen (rule in `side_init.choose`: mean Δ ≥ 0 and lower bound ≥ −1 in every column, "
      f"then the largest summed Δ): {chosen}. The preset: {res['preset']}"
      + (" (it holds the chosen values)." if chosen == res["preset"] else
         " (it does NOT hold the chosen values)."), DELTA_NOTE])
