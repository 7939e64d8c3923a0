"""The paper's experiments as suites: which runs, and how their results become tables and plots.

No algorithm lives here: runs go through `runner.train_and_evaluate` (via `Runner`); a suite writes
markdown tables beside the paper's numbers, plots, per-run JSON and `results.json`, and compares
its methods with a baseline on paired seeds (`pairing`, `stats`).
"""
from __future__ import annotations

import dataclasses
import json
import time

from absl import logging
import jax
import numpy as np

from ear_jax.experiment import plots
from ear_jax.experiment import results_md
from ear_jax.experiment import runner
from ear_jax.experiment import summaries
from ear_jax.experiment.suites import answer_critic
from ear_jax.experiment.suites import first_stage
from ear_jax.experiment.suites import guard
from ear_jax.experiment.suites import hparams_curves
from ear_jax.experiment.suites import main_ablation
from ear_jax.experiment.suites import noise_multistore
from ear_jax.experiment.suites import pool
from ear_jax.experiment.suites import qa
from ear_jax.experiment.suites import side_init
from ear_jax.experiment.suites import tune
from ear_jax.experiment.suites.options import Options
from ear_jax.experiment.suites.pairing import DELTA_NOTE, get_metric
from ear_jax.experiment.suites.paper import PAPER, fmt, md_table, with_cell_note
from ear_jax.experiment.suites.run_cache import Runner


# Suite name -> `(Runner) -> markdown`; `--suite=all` runs `ALL_ORDER`, the paper's suites.
SUITES = {
    "main": main_ablation.suite_main,  # Table 2
    "ablation": main_ablation.suite_ablation,  # Table 3
    "hparams": hparams_curves.suite_hparams,  # Tables 6-7
    "curves": hparams_curves.suite_curves,  # Figs. 3-4
    "noise": noise_multistore.suite_noise,  # Fig. 5
    "multistore": noise_multistore.suite_multistore,  # Tables 4-5, Fig. 6, Appendix C
}
ALL_ORDER = tuple(SUITES)
# By name only: an LLM endpoint (qa) or beyond the paper (validation tuning, test comparisons).
SUITES.update({
    "qa": qa.suite_qa,  # F1 / BLEU-1 / J of answers from the final slates
    "tune": tune.suite_tune,
    "beyond": tune.suite_beyond,
    "first_stage_tune": first_stage.suite_first_stage_tune,
    "first_stage": first_stage.suite_first_stage,
    "answer_critic": answer_critic.suite_answer_critic,  # EAR trained by the agent's answers
    "guard_tune": guard.suite_guard_tune,  # ear_safe's guard, LoCoMo validation
    "guard": guard.suite_guard,  # ear_safe vs the frozen first stage and paging, test split
    "pool_tune": pool.suite_pool_tune,  # the candidate pool K > T s
    "pool": pool.suite_pool,
    "side_init_tune": side_init.suite_side_init_tune,  # ear_tuned's side_init, every K
})
SUITE_NAMES = tuple(SUITES) + ("all",)  # the values of `--suite`


def suite_names(suite: str, benchmark: str) -> list:
  """The suites `suite` stands for ('all': every suite the benchmark supports)."""
  names = list(ALL_ORDER) if suite == "all" else [suite]
  if suite == "all" and benchmark == "longmemeval":
    names.remove("multistore")  # LongMemEval has no observation store
  return names


def run_single_method(r: Runner) -> str:
  """Runs `opts.method` alone (no suite): its table and, with `eval_every`, its learning curve."""
  s = r.run(r.opts.method, eval_every=r.opts.eval_every or None)
  rows = [[s["method"]] + [fmt(get_metric(s, m)) for m in runner.METRIC_NAMES]
          + [fmt(s["ceiling"]["recall@K"])]]
  if s.get("curve") and len(s["curve"]) > 1:
    plots.learning_curves(r.plot_path(f"curve_{s['method']}"), {s["method"]: s["curve"]},
                          title=f"{s['method']} on {r.opts.benchmark}")
  return with_cell_note("\n".join([f"### {s['method']} — {r.opts.benchmark}", "",
                                   md_table(["method", "R@5 adapter", "Hit@5 adapter",
                                             "R@5 explorer", "Hit@5 explorer",
                                             "Recall@K ceiling"], rows)]))


class _CompileClock:
  """Sums JAX's tracing, lowering and XLA compile durations (`jax.monitoring` events)."""

  def __init__(self):
    self.seconds = 0.0

  def __call__(self, event: str, duration: float, **_):
    if event.startswith("/jax/core/compile/"):
      self.seconds += duration

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self)


def run(opts: Options) -> dict:
  """Runs `opts.suite` (or the single `opts.method`) and writes the workdir; returns results."""
  with _CompileClock() as clock:
    return _run(opts, clock)


def _run(opts: Options, clock: _CompileClock) -> dict:
  t_start = time.perf_counter()
  r = Runner(opts)
  compile_seconds = {}
  names = suite_names(opts.suite, opts.benchmark) if opts.suite else []
  md_parts = []
  if not names:
    md_parts.append(run_single_method(r))
    r.timings["method"] = round(time.perf_counter() - t_start, 1)
  for i, name in enumerate(names):
    t0, c0 = time.perf_counter(), clock.seconds
    elapsed = t0 - t_start
    eta = ("" if i == 0 else
           f", ETA for the remaining suites ~{elapsed / i * (len(names) - i):.0f} s")
    logging.info("suite %d/%d: %s on %s (%.0f s elapsed%s)", i + 1, len(names), name,
                 opts.benchmark, elapsed, eta)
    md = with_cell_note(SUITES[name](r))
    r.tables[name] = md  # RESULTS.md adds the readings from results.json "paired"
    r.timings[name] = round(time.perf_counter() - t0, 1)
    compile_seconds[name] = round(clock.seconds - c0, 1)
    readings = results_md.readings_md(r.paired.get(name, []))
    md_parts.append(md + ("\n\n" + readings if readings else ""))
    (r.workdir / f"table_{name}.md").write_text(md_parts[-1] + "\n")
  results = {
      "command": opts.command, "suite": opts.suite, "method": None if opts.suite else opts.method,
      "benchmark": opts.benchmark, "options": {k: v for k, v in dataclasses.asdict(opts).items()
                                               if k != "command"},
      "versions": summaries.versions(), "seeds": r.seeds,
      "processes": {"count": jax.process_count(), "devices": jax.device_count()},
      "dataset": {k: v for k, v in r.bench().stats.items() if k != "evidence_ids_dropped_list"},
      "runs": r.summaries, "tables": r.tables, "plots": r.plots,
      # suite -> [`pairing.pair` records]
      "paired": r.paired, "paired_note": DELTA_NOTE,
      "qa": getattr(r, "qa", None),  # --suite=qa: settings, endpoints, per-method QA results
      "suite_wall_seconds": r.timings, "wall_seconds": round(time.perf_counter() - t_start, 1),
      # JAX tracing + lowering + XLA compilation inside each suite (`jax.monitoring` events).
      "suite_compile_seconds": compile_seconds, "compile_seconds": round(clock.seconds, 1),
  }
  (r.workdir / "results.json").write_text(json.dumps(results, indent=1, default=_json_default))
  (r.workdir / "tables.md").write_text("\n\n".join(md_parts) + "\n")
  return results


def _json_default(o):
  """`json.dump` fallback: numpy scalars / arrays as JSON, anything else as str."""
  return o.tolist() if isinstance(o, (np.integer, np.floating, np.ndarray)) else str(o)


__all__ = ["ALL_ORDER", "DELTA_NOTE", "Options", "PAPER", "Runner", "SUITES", "SUITE_NAMES", "run",
           "run_single_method", "suite_names"]
