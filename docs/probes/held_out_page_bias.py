"""A probe, not part of the library (session 18, issue 27's guard): does the order in which a
held-out question's candidates are paged to the critic bias the guard's evidence?

Usage (validation only: each seed's training stream split 80 / 20; the test split is never read):
  EAR_DATA_DIR=../shared/data python docs/probes/held_out_page_bias.py locomo|longmemeval

Per setting (the default critic, P = R = 0.7), `ear_safe` (guard_pages='first_stage', as the
preset) is trained over hybrid candidates on each seed's fit part (5 seeds). Its final adapter
and the first stage are then compared on the seed's validation questions, whose gold is known:
  true dR@5   Recall@5 (every gold memory in the top-5, `core.metrics`) adapted minus frozen;
  true q-d    the same per question with a gold item among the candidates (the ring's unit with
              perfect citations);
and the ring's units read from a simulated critic shown the K candidates in T pages of s, the
pages either in the first stage's order (what the ring does with guard_pages='first_stage') or in
a random order ('shuffled'):
  q-d         1[every cited item in the adapted top-5] - 1[... in the first stage's];
  items       cited items in the adapted top-5 minus in the first stage's.
A faithful unit has the sign of the true columns. ~1 min (LoCoMo) on 2 cores.
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import adapter as adapter_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import guard as guard_lib
from ear_jax.experiment import runner
from ear_jax.experiment.suites.first_stage import _validation
from ear_jax.experiment.suites.guard import SETTINGS
from ear_jax.experiment.suites.options import Options
from ear_jax.experiment.suites.run_cache import Runner

bench = sys.argv[1]
r = Runner(Options(benchmark=bench, data_dir=os.environ.get("EAR_DATA_DIR", "../shared/data"),
                   candidates="hybrid", seeds=5, workdir="runs/held_out_page_bias",
                   progress=False))
stream = r.bench().stream
fit, val = _validation(r)
T, s = 4, 5


def top5(p, q, c, m):
  return guard_lib._top_mask(adapter_lib.adapter_scores(p, q, c), m, s)  # pylint: disable=protected-access


for name, (c_over, h_over) in list(SETTINGS.items())[:2]:
  m = runner.build_method("ear_safe", dim=stream.dim, num_candidates=stream.num_candidates,
                          hparams=h_over, side_features=stream.num_side_features)
  crit = critic_lib.make_simulated_critic(**c_over) if c_over else critic_lib.default_critic()
  res = runner.train_and_evaluate("probe", stream, fit, val, m.config, m.hparams, r.seeds,
                                  critic=crit, progress=False)
  first = guard_lib.first_stage_params(m.config)
  print(f"== {bench} validation, hybrid, {name}")
  for i in range(len(r.seeds)):
    p = jax.tree_util.tree_map(lambda x: x[i], res.final_state.params)  # pylint: disable=cell-var-from-loop
    idx = val[i]
    Q, C, M = (jnp.asarray(x[idx]) for x in (stream.queries, stream.candidates, stream.mask))
    G = np.asarray(stream.gold[idx]) & np.asarray(stream.mask[idx])
    num_gold = np.asarray(stream.num_gold[idx])
    A = np.asarray(jax.vmap(lambda q, c, mm: top5(p, q, c, mm))(Q, C, M))  # pylint: disable=cell-var-from-loop
    F = np.asarray(jax.vmap(lambda q, c, mm: top5(first, q, c, mm))(Q, C, M))  # pylint: disable=cell-var-from-loop
    z_first = np.asarray(jax.vmap(lambda q, c: adapter_lib.adapter_scores(first, q, c))(Q, C))  # pylint: disable=cell-var-from-loop
    all_a = (num_gold > 0) & ((G & A).sum(1) >= num_gold)
    all_f = (num_gold > 0) & ((G & F).sum(1) >= num_gold)
    true_dr = 100.0 * (all_a.mean() - all_f.mean())
    has = G.any(1)
    true_q = (np.all(~G | A, 1).astype(float) - np.all(~G | F, 1))[has].mean()
    rng = np.random.default_rng(i)
    units = {}
    for order in ("first_stage", "shuffled"):
      cited = np.zeros_like(G)
      for j in range(len(idx)):
        valid = np.flatnonzero(np.asarray(M[j]))
        ranked = (valid[np.argsort(-z_first[j][valid], kind="stable")] if order == "first_stage"
                  else rng.permutation(valid))
        for t in range(T):
          page = ranked[s * t:s * (t + 1)]
          if not len(page):
            break
          lab = critic_lib.simulated_critic(jax.random.PRNGKey(1000 * i + 10 * j + t),
                                            jnp.asarray(G[j, page]), jnp.ones(len(page), bool),
                                            crit.precision, crit.recall)
          cited[j, page] = np.asarray(lab) > 0
      cnt = cited.any(1)
      q_d = (np.all(~cited | A, 1).astype(float) - np.all(~cited | F, 1))[cnt].mean()
      items = ((cited & A).sum(1) - (cited & F).sum(1))[cnt].mean()
      units[order] = (q_d, items)
    print(f" seed {i}: true dR@5 {true_dr:+.2f}, true q-d {true_q:+.3f} | first-stage pages: "
          f"q-d {units['first_stage'][0]:+.3f} items {units['first_stage'][1]:+.3f} | shuffled "
          f"pages: q-d {units['shuffled'][0]:+.3f} items {units['shuffled'][1]:+.3f}")
