"""Suite `guard_diagnosis` (issue 27): the guard's evidence against held-out measurements.

For the runner's first stage (`--candidates`) and `ear_safe`'s training (`ear_tuned`'s: the guard
only records), one training run per variant of the evidence: the training slates' (`guard`), the probe's
(`guard_probe`: one more interleaved critic call per training question, training unchanged) and the
probe's with a perfect critic (P = R = 1, the probe then reads the gold difference itself). Per
variant and seed:

  - the training stream's evidence: mean `d` over the counted training questions, each scored with
    the parameters trained on the questions before it (prequential; what `serve_adapted` reads);
  - the same probe with the final parameters on the test questions and on the training questions (in
    sample), a perfect critic labelling (`probe_on_test`, `probe_in_sample`);
  - the test split: gold memories in the adapter's top-s minus in the first stage's, and Δ R@5;
  - the training questions with the final parameters: Δ R@5 (in sample);
  - stream-end validation: the adapter trained on the first 80 % of each training stream, scored on
    the rest (Δ R@5; the protocol of `--suite=guard_tune`, here also on LongMemEval_S: a diagnosis,
    nothing is chosen from it);
  - along the stream (session 10): the evidence `d` in each quarter of the training stream, and the
    test split's Δ R@5 of adapters trained on the first 25 / 50 / 75 / 100 % of it (does the
    adapter get worse the longer it trains, while the evidence averages over the whole stream?).

    python -m experiments.run --benchmark=longmemeval --suite=guard_diagnosis --candidates=hybrid
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import adapter as adapter_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import guard as guard_lib
from ear_jax.experiment import runner
from ear_jax.experiment.suites.paper import md_table
from ear_jax.experiment.suites.run_cache import Runner

METHOD = "ear_safe"
# The diagnosis is of the prequential evidence: `ear_safe` as it was before session 11 (its
# held-out ring off; the probe variants cannot be combined with the ring).
PREQUENTIAL = dict(guard_holdout=0, guard_z=0.5, guard_evidence="items")
PREFIXES = (0.25, 0.5, 0.75, 1.0)  # shares of the training stream trained on (along the stream)
# name -> (config overrides, simulated critic overrides)
VARIANTS = {"training slates": ({}, {}),
            "probe": ({"guard_probe": True}, {}),
            "probe, perfect critic": ({"guard_probe": True}, {"precision": 1.0, "recall": 1.0})}


def _probe_d(params, first, stream, index, config, seed: int) -> float:
  """Mean probe `d` of `params` over the questions `index` (a perfect critic labels the probe)."""
  sub = stream.take(np.asarray(index))

  def one(key, q, c, w, g):
    slate, mask = guard_lib.probe_slate(key, adapter_lib.adapter_scores(params, q, c),
                                        adapter_lib.adapter_scores(first, q, c), w,
                                        config.slate_size)
    labels = jnp.where(mask & g[jnp.maximum(slate, 0)], 1.0, -1.0)
    return guard_lib.probe_evidence(params, first, q, c, w, slate[None], mask[None],
                                    labels[None], config.slate_size)

  keys = jax.random.split(jax.random.PRNGKey(seed), len(index))
  d, counts = (np.asarray(x) for x in jax.jit(jax.vmap(one))(
      keys, sub.queries, sub.candidates, sub.mask, sub.gold))
  return float(d[counts].mean()) if counts.any() else 0.0


def _gold_in_top(ev, stream, index) -> np.ndarray:
  """`[S, M]` gold memories in each question's adapter-only top-s."""
  gold, slates = np.asarray(stream.gold), np.asarray(ev["adapter_slates"])
  out = []
  for i, idx in enumerate(np.asarray(index)):
    g = np.pad(gold[idx], ((0, 0), (0, 1)))  # (index K: an empty position, never gold)
    out.append(np.take_along_axis(g, np.where(slates[i] < 0, g.shape[1] - 1, slates[i]), 1).sum(1))
  return np.stack(out)


def diagnose(r: Runner, config_over: dict, critic_over: dict) -> dict:
  """One variant: every per-seed quantity of the module docstring."""
  b = r.bench()
  stream = b.stream
  train, test = r._splits[False]  # pylint: disable=protected-access
  m = runner.build_method(METHOD, dim=stream.dim, num_candidates=stream.num_candidates,
                          side_features=stream.num_side_features or None,
                          **{**PREQUENTIAL, **r.opts.config_overrides, **config_over})
  config = m.config
  critic = critic_lib.make_simulated_critic(**critic_over)
  num = len(r.seeds)
  first = guard_lib.first_stage_params(config)
  firsts = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num,) + x.shape), first)
  score = lambda p, idx: runner.evaluate_params(p, stream, idx, config, m.hparams, r.seeds, critic)
  res = runner.train_and_evaluate("guard_diagnosis", stream, train, test, config, m.hparams,
                                  r.seeds, critic=critic, progress=r.opts.progress)
  params = res.final_state.params
  ef, ea = score(firsts, test), score(params, test)
  tf, ta = score(firsts, train), score(params, train)
  fit, val = runner.validation_split(train)
  pct = lambda a, f: (100.0 * (np.asarray(a["recall_adapter"], np.float64)
                               - np.asarray(f["recall_adapter"]))).tolist()
  val_res = runner.train_and_evaluate("guard_diagnosis_validation", stream, fit, val, config,
                                      m.hparams, r.seeds, critic=critic, progress=r.opts.progress)
  vf, va = score(firsts, val), score(val_res.final_state.params, val)
  d, counts = np.asarray(res.train_log["guard_d"]), np.asarray(res.train_log["guard_counts"])
  quarters = np.array_split(np.arange(d.shape[1]), 4)
  by_quarter = [float(np.mean([d[i][q][counts[i][q]].mean() for i in range(num)
                               if counts[i][q].any()] or [0.0])) for q in quarters]
  by_prefix = []
  for frac in PREFIXES:
    n = max(config.batch_size, int(round(frac * train.shape[1])))
    if n >= train.shape[1]:  # (the run above)
      by_prefix.append(float(np.mean(pct(ea, ef))))
      continue
    part = runner.train_and_evaluate(
        "guard_diagnosis_prefix", stream, train[:, :n], test, config, m.hparams, r.seeds,
        critic=critic, progress=r.opts.progress)
    by_prefix.append(float(np.mean(pct(score(part.final_state.params, test), ef))))
  seed_params = lambda i: jax.tree_util.tree_map(lambda x: x[i], params)
  return {
      "config": config_over, "critic": critic_over,
      "evidence_mean_d": [float(d[i][counts[i]].mean()) if counts[i].any() else 0.0
                          for i in range(num)],
      "probe_on_test": [_probe_d(seed_params(i), first, stream, test[i], config, i)
                        for i in range(num)],
      "probe_in_sample": [_probe_d(seed_params(i), first, stream, train[i], config, i)
                          for i in range(num)],
      "test_gold_diff": (_gold_in_top(ea, stream, test) - _gold_in_top(ef, stream, test)
                         ).mean(1).tolist(),
      "test_recall_diff": pct(ea, ef), "in_sample_recall_diff": pct(ta, tf),
      "validation_recall_diff": pct(va, vf), "evidence_by_quarter": by_quarter,
      "test_recall_diff_by_prefix": by_prefix}


def suite_guard_diagnosis(r: Runner) -> str:
  """The module docstring's table for `r.opts.candidates`; writes guard_diagnosis.json."""
  results = {name: diagnose(r, *over) for name, over in VARIANTS.items()}
  if r.writes:
    (r.workdir / "guard_diagnosis.json").write_text(json.dumps(results, indent=1))
  mean = lambda v, f="+.3f": format(float(np.mean(v)), f)
  rows = [[name, " ".join(f"{x:+.3f}" for x in res["evidence_mean_d"]),
           mean(res["evidence_mean_d"]), mean(res["probe_on_test"]), mean(res["probe_in_sample"]),
           mean(res["test_gold_diff"]), mean(res["test_recall_diff"], "+.2f"),
           mean(res["in_sample_recall_diff"], "+.2f"), mean(res["validation_recall_diff"], "+.2f")]
          for name, res in results.items()]
  return "\n".join([
      f"### Guard diagnosis — {r.opts.benchmark}, {r.opts.candidates} candidates, `{METHOD}`'s "
      f"training ({len(r.seeds)} seeds)", "",
      md_table(["evidence from", "training evidence: mean d per seed", "mean d",
                "probe of the final adapter on the test split (perfect critic)",
                "the same on the training questions (in sample)",
                "test: gold in adapted top-5 − in first stage's", "test: Δ R@5",
                "training questions (in sample): Δ R@5", "stream-end validation: Δ R@5"], rows),
      "", "d: cited memories in the adapted top-5 minus in the first stage's, per counted "
      "training question, each scored with the parameters trained on the questions before it "
      "(what the guard reads). Every other column is a held-out or in-sample measurement of the "
      "same adapters (the validation column: a second run on each stream's first 80 %).", "",
      "Along the training stream (mean over seeds):", "",
      md_table(["evidence from"] + [f"mean d, quarter {j + 1}" for j in range(4)]
               + [f"test Δ R@5 after {int(100 * f)} %" for f in PREFIXES],
               [[name] + [f"{x:+.3f}" for x in res["evidence_by_quarter"]]
                + [f"{x:+.2f}" for x in res["test_recall_diff_by_prefix"]]
                for name, res in results.items()]),
      "", "Quarter j: the counted training questions of the stream's j-th quarter (their "
      "prequential d); after f %: an adapter trained on the first f % of each training stream "
      "(100 %: the run above), scored on the test split against the first stage."])


__all__ = ["METHOD", "VARIANTS", "diagnose", "suite_guard_diagnosis"]
