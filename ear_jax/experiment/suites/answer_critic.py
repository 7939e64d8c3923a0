"""Suite `answer_critic`: EAR trained by the answer-grounded critic, the feedback an agent gives by
answering.

`ear` and `ear_tuned` learn each seed's training stream with the simulated critic and with
`AnswerCritic` at `ANSWER_DEFAULTS` (chosen by `python -m experiments.critic_eval --critic=answer
--subset=validation` on LoCoMo), the gold answers playing the agent's. The test split is scored
adapter-only, paired with the frozen first stage and between the two critics.
"""
from __future__ import annotations

from ear_jax.core import critic as critic_lib
from ear_jax.experiment.suites.pairing import DELTA_NOTE, fd, get_metric, pair_runs
from ear_jax.experiment.suites.paper import fmt, md_table
from ear_jax.experiment.suites.run_cache import Runner

METHODS = ("ear", "ear_tuned")
CRITICS = {"simulated": "simulated (p 0.88 / r 0.86, reads the gold labels)",
           "answer": "answer-grounded (gold answers)"}
# The target: the adapter-only gain over the frozen first stage with the answer critic.
TARGET = {"locomo": "gain > 0, 95% interval above 0"}


def suite_answer_critic(r: Runner) -> str:
  """Frozen first stage vs `ear` / `ear_tuned` trained by the simulated or the answer critic."""
  ret = r.run("retriever")
  rows = [["frozen first stage", "–", fmt(get_metric(ret, "recall_adapter")), "(baseline)", "–",
           fmt(get_metric(ret, "hitrate_adapter")), "–"]]
  target = TARGET.get(r.opts.benchmark)
  for m in METHODS:
    runs = {c: r.run(m, critic=c) for c in CRITICS}
    for c, s in runs.items():
      d = pair_runs(r, "answer_critic", (f"{m} ({c} critic)", s, "adapter"),
                    ("frozen first stage", ret, "adapter"), primary={"recall"})
      vs_sim = "–"
      if c != "simulated":
        vs_sim = fd(pair_runs(r, "answer_critic", (f"{m} ({c} critic)", s, "adapter"),
                              (f"{m} (simulated critic)", runs["simulated"], "adapter"),
                              metrics=("recall",), primary=False)["recall"])
      cell = "–"
      if c == "answer" and target:
        met = d["recall"]["mean"] > 0 and d["recall"]["lo"] > 0
        cell = f"{'met' if met else 'not met'} ({target})"
      rows.append([m, CRITICS[c], fmt(get_metric(s, "recall_adapter")), fd(d["recall"]), vs_sim,
                   fmt(get_metric(s, "hitrate_adapter")), cell])
  return "\n".join([
      f"### EAR trained by the answer-grounded critic — {r.opts.benchmark}, {r.opts.candidates} "
      f"first stage, adapter-only test Recall@5 ({len(r.seeds)} seeds)", "",
      md_table(["method", "critic during training", "R@5", "Δ R@5 vs frozen first stage "
                "[95% CI]", "Δ R@5 vs the simulated critic [95% CI]", "Hit@5",
                "target"], rows), "",
      DELTA_NOTE + f" Answer critic thresholds: {dict(critic_lib.ANSWER_DEFAULTS)} (chosen on "
      "LoCoMo validation: `python -m experiments.critic_eval --critic=answer --subset=validation`)."
      " No critic call at test time (adapter only)."])
