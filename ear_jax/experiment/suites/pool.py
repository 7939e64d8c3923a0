"""Suites `pool_tune` and `pool`: EAR over larger candidate pools (K > T s), same critic budget.

The critic sees at most `T s` memories per question, so a larger pool K holds more gold but
Eq. (10)'s softmax over all K pushes probability onto the never-shown tail
(`EARConfig.loss_support`). `pool_tune` (LoCoMo validation only; never reads the test split)
trains `ear_tuned` with each `loss_support` for K in `K_VALUES`; `pool` (test split) runs every
shipped learning preset for K in `K_VALUES`, paired with the frozen first stage and its
Recall@(T s) ceiling.
"""
from __future__ import annotations

import json

from absl import logging
import numpy as np

from ear_jax.core import config as config_lib
from ear_jax.experiment import runner
from ear_jax.experiment import stats
from ear_jax.experiment import summaries
from ear_jax.experiment.suites.pairing import DELTA_NOTE, fd, get_metric, pair, pair_runs
from ear_jax.experiment.suites.paper import fmt, fmt_seeds, md_table
from ear_jax.experiment.suites.run_cache import Runner

K_VALUES = (20, 50, 100)
# The supports trained on validation ('auto' is 'all' at K <= T s and 'labelled' beyond).
SUPPORTS = ("all", "window", "labelled")
TUNED = "ear_tuned"
# The learning presets the `pool` table reports (each with its own `loss_support`).
PRESETS = ("ear", "ear_tuned", "ear_safe")
# Rows beside them at K > T s: `ear_tuned` with the softmax over all K, the paper's EAR with 'auto'.
COLLAPSE = ("ear_tuned", {"loss_support": "all"})
PAPER_AUTO = ("ear", {"loss_support": "auto"})


def _window(stream) -> int:
  return runner.build_config(TUNED, dim=stream.dim, num_candidates=stream.num_candidates,
                             side_features=stream.num_side_features or None).loss_window


def pushed_up_share(sub: Runner, summary: dict) -> float | None:
  """Percent of a run's training questions with `sum_j (y_j - b) < 0` over the shown positions
  (Eq. (10) then raises every unshown candidate); None without `train_log.npz`."""
  path = sub.workdir / "runs" / summary["run"] / "train_log.npz"
  if not path.is_file():
    return None
  log = np.load(path)
  b = summary["hparams"]["baseline"]
  pos = log["positive_labels"].astype(np.float64)
  shown = summary["config"]["slate_size"] * log["critic_calls"].astype(np.float64)  # full slates
  net = pos * (1.0 - b) - (shown - pos) * (1.0 + b)
  return float(100.0 * np.mean(net < 0))


def _pct(ev, key):
  return 100.0 * np.asarray(ev[key], np.float64)


def tune_pool(r: Runner) -> dict:
  """Every `pool_tune` row's per-seed validation Recall@5 (percent)."""
  r.refuse_transfer_benchmark("pool_tune")
  done_path = r.workdir / "pool_tune_rows.json"  # each row as it finishes (for --resume)
  rows = json.loads(done_path.read_text()) if r.opts.resume and done_path.is_file() else []
  for k in K_VALUES:
    sub = r.child(r.workdir / f"k{k}", k=k)
    stream = sub.bench().stream
    fit, val = sub.validation_split()
    window = _window(stream)
    ceiling = summaries.ceiling(stream, val, 5, window).get(f"recall@{window}")
    for method, over in [("retriever", {})] + [(TUNED, {"loss_support": s}) for s in SUPPORTS]:
      if method == TUNED and k <= window and over["loss_support"] == "window":
        continue  # the same set as 'all' at K <= T s (`losses.loss_support`)
      if any(row["k"] == k and row["method"] == method and row.get("loss_support") ==
             over.get("loss_support") for row in rows):
        continue  # finished before a --resume
      m = sub.method(method, **over)
      res = runner.train_and_evaluate(f"pool_tune k={k} {method} {over}", stream, fit, val,
                                      m.config, m.hparams, r.seeds, progress=r.opts.progress)
      row = {"k": k, "method": method, **over,
             "adapter": _pct(res.eval, "recall_adapter").tolist(),
             "paging_served": _pct(res.eval, "recall_paging_adapted").tolist(),
             "paging_first_stage": _pct(res.eval, "recall_paging_first_stage").tolist(),
             "ceiling_window": None if ceiling is None else ceiling["per_seed"]}
      del res  # its final learner state (a [S, C, K, d] buffer) before the next run allocates one
      rows.append(row)
      r.write_json(done_path, rows, indent=None)
      logging.info("pool_tune K=%d %s %s: validation R@5 adapter %.2f, paging %.2f", k, method,
                   over, np.mean(row["adapter"]), np.mean(row["paging_served"]))
  return {"rows": rows, **choose(rows)}


def choose(rows: list) -> dict:
  """The rule (validation only): the `loss_support` with mean adapter-only Δ R@5 >= 0 at every K
  and the largest sum; then the K with the best paging Recall@5 among those with Δ >= 0."""
  frozen = {row["k"]: np.asarray(row["adapter"]) for row in rows if row["method"] == "retriever"}

  def delta(row):
    return float(np.mean(np.asarray(row["adapter"]) - frozen[row["k"]]))

  def rows_of(support):
    """Per K, the row trained with `support` ('window' / 'auto' at K <= T s: the 'all' row)."""
    out = []
    for k in sorted(frozen):
      small = k == min(frozen)  # K = T s: 'window' and 'auto' are 'all'
      name = {"window": "all" if small else "window",
              "auto": "all" if small else "labelled"}.get(support, support)
      out += [row for row in rows if row["method"] == TUNED and row["k"] == k
              and row["loss_support"] == name]
    return out

  supports = SUPPORTS + ("auto",)
  safe = [s for s in supports if all(delta(row) >= 0 for row in rows_of(s))]
  if not safe:
    return {"chosen_support": None, "chosen_k": None}
  support = max(safe, key=lambda s: sum(delta(row) for row in rows_of(s)))
  best = max((row for row in rows_of(support) if delta(row) >= 0),
             key=lambda row: np.mean(row["paging_served"]))
  return {"chosen_support": support, "chosen_k": best["k"],
          "summed_delta": {s: sum(delta(row) for row in rows_of(s)) for s in supports}}


def suite_pool_tune(r: Runner) -> str:
  """`pool_tune`: `loss_support` and K on LoCoMo validation; writes pool_tune.json."""
  res = tune_pool(r)
  r.write_json(r.workdir / "pool_tune.json", res)
  frozen = {row["k"]: np.asarray(row["adapter"]) for row in res["rows"]
            if row["method"] == "retriever"}
  table = []
  for row in res["rows"]:
    a = np.asarray(row["adapter"])
    is_frozen = row["method"] == "retriever"
    table.append([
        str(row["k"]), "frozen first stage" if is_frozen else
        f"{row['method']}, loss_support={row['loss_support']}",
        fmt_seeds(a),
        "(baseline)" if is_frozen else fd(stats.paired_difference(a, frozen[row["k"]])),
        fmt_seeds(row["paging_first_stage" if is_frozen else "paging_served"]),
        "–" if row["ceiling_window"] is None else f"{np.mean(row['ceiling_window']):.2f}"])
  return "\n".join([
      f"### Candidate pool: validation — {r.opts.benchmark}, {r.opts.candidates} ({len(r.seeds)} "
      "seeds; validation = the last 20 % of each seed's training stream, the test split is not "
      "read)", "",
      md_table(["K", "method", "R@5 adapter-only", "Δ vs frozen [95% CI]",
                "R@5 paging (served ranking; frozen: first stage)",
                "first stage's R@20 ceiling"], table), "",
      f"Chosen (rule in `pool.choose`; 'auto' = the 'all' row at K = 20 and the 'labelled' rows "
      f"beyond): loss_support = {res['chosen_support']}, K = {res['chosen_k']}. Summed Δ over "
      f"K: " + ", ".join(f"{k} {v:+.2f}" for k, v in res["summed_delta"].items()) + ". "
      f"The `{TUNED}` preset runs loss_support = "
      f"{config_lib.EARConfig.for_method(TUNED).loss_support}. " + DELTA_NOTE])


def suite_pool(r: Runner) -> str:
  """`pool`: every learning preset at K in `K_VALUES` against the frozen first stage (test)."""
  rows, comp = [], []
  for k in K_VALUES:
    sub = r.child(r.workdir / f"k{k}", k=k)
    stream = sub.bench().stream
    window = _window(stream)
    frozen = sub.run("retriever")
    ceiling = frozen["ceiling"].get(f"recall@{window}")
    runs = [(m, m, None) for m in PRESETS]
    if k > window:
      runs += [(f"{m}, loss_support={over['loss_support']}", m, over)
               for m, over in (COLLAPSE, PAPER_AUTO)]
    rows.append([str(k), "frozen first stage", fmt(get_metric(frozen, "recall_adapter")),
                 "(baseline)", fmt(get_metric(frozen, "recall_explorer")),
                 fmt(get_metric(frozen, "recall_paging_first_stage")),
                 "–" if ceiling is None else fmt(ceiling), "–"])
    for label, method, over in runs:
      s = sub.run(method, config_overrides=over)
      paging = get_metric(s, "recall_paging_adapted")
      d = pair_runs(sub, "pool", (f"{label} (K={k})", s, "adapter"),
                    (f"frozen first stage (K={k})", frozen, "adapter"),
                    metrics=("recall",))["recall"]
      vs_ceiling = "–" if ceiling is None else fd(pair(
          sub, "pool", {"label": f"{label} (K={k}), paging", "run": s["run"], "mode": "paging"},
          {"label": f"first stage's R@{window} (K={k})", "run": frozen["run"], "mode": "ceiling"},
          "R@5", paging["per_seed"], ceiling["per_seed"], primary=False))
      rows.append([str(k), label, fmt(get_metric(s, "recall_adapter")), fd(d),
                   fmt(get_metric(s, "recall_explorer")), fmt(paging), "–" if ceiling is None
                   else fmt(ceiling), vs_ceiling])
      if "beyond_window" in s:
        pushed = pushed_up_share(sub, s)
        comp.append([str(k), label, fmt(s["beyond_window"]["share"]),
                     fmt(s["beyond_window"]["gold_rate"]),
                     "–" if pushed is None else f"{pushed:.1f}"])
    if "beyond_window" in frozen:
      comp.append([str(k), "frozen first stage", fmt(frozen["beyond_window"]["share"]), "–", "–"])
  return "\n".join([
      f"### Candidate pool K — {r.opts.benchmark}, {r.opts.candidates} (test split, "
      f"{len(r.seeds)} seeds, T = 4 critic calls of s = 5)", "",
      md_table(["K", "method", "R@5 adapter-only", "Δ adapter-only vs frozen [95% CI]",
                "R@5 explorer-assisted", "R@5 paging (served ranking)",
                "first stage's R@20 (ceiling at K = 20)", "Δ paging vs that ceiling [95% CI]"],
               rows), "",
      "Where the adapter-only top-5 comes from (K > T s = 20): the share of its memories "
      "outside the first stage's top 20, and how many of those are gold:", "",
      md_table(["K", "method", "share of the top-5 beyond rank 20 (%)", "gold among them (%)",
                "training questions whose labels sum below b (%)"], comp), "",
      "For a training question whose labels sum below the baseline b, Eq. (10)'s softmax over "
      "all K raises every candidate it did not show (d L / d z_i = p_i Σ_j (y_j − b) for an "
      "unshown i); `loss_support` takes the unshown tail beyond the first stage's top T s out "
      "of the softmax.", "", DELTA_NOTE])
