"""A probe, not part of the library (session 18, issue 27's guard): would a guard that may serve
a shrunk adapter, `first + lam (params - first)`, keep more of the gain safely?

Usage (LoCoMo validation only; the test split is never read):
  EAR_DATA_DIR=../shared/data python docs/probes/shrunk_guard.py locomo

Per `suites.guard.SETTINGS` setting, `ear_safe` is trained over hybrid candidates on each seed's fit
part (5 seeds); for lam in LAMS the shrunk parameters are scored on the validation questions and on
the held-out ring (its lower bound at z = 0.25). Rules compared: the guard as it is (lam 1 or the
first stage), the largest lam whose ring bound is above 0 ("sequence"), the lam of the best bound.
~1 min on 2 cores.
"""
import os, sys, json
import jax, jax.numpy as jnp, numpy as np
from ear_jax.core import critic as critic_lib, guard as guard_lib
from ear_jax.experiment import runner
from ear_jax.experiment.suites.options import Options
from ear_jax.experiment.suites.run_cache import Runner
from ear_jax.experiment.suites.first_stage import _validation
from ear_jax.experiment.suites.guard import SETTINGS

bench = sys.argv[1]
if bench != "locomo":
  sys.exit("LongMemEval_S is held out: this probe reads LoCoMo validation only")
split, feats = "val", None
r = Runner(Options(benchmark=bench, data_dir=os.environ.get("EAR_DATA_DIR", "../shared/data"),
                   candidates="hybrid", seeds=5,
                   workdir="runs/shrunk_guard", progress=False, features=feats))
b = r.bench(); stream = b.stream
fit, ev = _validation(r)
LAMS = (1.0, 0.75, 0.5, 0.25, 0.0)
out = {}
for name, (c_over, h_over) in SETTINGS.items():
  m = runner.build_method("ear_safe", dim=stream.dim, num_candidates=stream.num_candidates,
                          hparams=h_over, side_features=stream.num_side_features)
  config = m.config
  critic = critic_lib.make_simulated_critic(**c_over) if c_over else None
  res = runner.train_and_evaluate("probe", stream, fit, ev, config, m.hparams, r.seeds, critic=critic, progress=False)
  st = res.final_state
  num = len(r.seeds)
  first = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num,) + x.shape), guard_lib.first_stage_params(config))
  rows = {}
  for lam in LAMS:
    p = jax.tree_util.tree_map(lambda a, f: None if a is None else f + lam * (a - f), st.params, first)
    ev_l = runner.evaluate_params(p, stream, ev, config, m.hparams, r.seeds, critic)
    rec = 100 * np.asarray(ev_l["recall_adapter"], np.float64)
    lcb, n = jax.vmap(lambda g, pp: guard_lib.holdout_lower_bound(pp, g.holdout, config, 0.25))(st.guard, p)
    d, cnt = jax.vmap(lambda g, pp: guard_lib.holdout_evidence(pp, g.holdout, config.slate_size, True))(st.guard, p)
    meand = [float(np.asarray(d)[i][np.asarray(cnt)[i]].mean()) for i in range(num)]
    rows[lam] = dict(recall=rec.tolist(), lcb=np.asarray(lcb).tolist(), n=np.asarray(n).tolist(), mean_d=meand)
  fz = np.asarray(rows[0.0]["recall"])
  print(f"== {bench} {split} {name}: frozen {fz.mean():.2f}")
  for lam in LAMS:
    rr = rows[lam]
    print(f" lam {lam}: dR@5 {np.mean(np.asarray(rr['recall'])-fz):+.2f} per seed {np.round(np.asarray(rr['recall'])-fz,1).tolist()} lcb {np.round(rr['lcb'],3).tolist()} d {np.round(rr['mean_d'],3).tolist()}")
  # rules
  def rule(choose):
    got = []
    for i in range(num):
      lam = choose(i)
      got.append(rows[lam]["recall"][i] - fz[i])
    return np.mean(got), got
  cur = rule(lambda i: 1.0 if rows[1.0]["lcb"][i] > 0 and rows[1.0]["n"][i] >= config.guard_min_queries else 0.0)
  seq = rule(lambda i: next((l for l in LAMS[:-1] if rows[l]["lcb"][i] > 0 and rows[l]["n"][i] >= config.guard_min_queries), 0.0))
  best = rule(lambda i: max(LAMS, key=lambda l: rows[l]["lcb"][i] if (l == 0.0 or rows[l]["n"][i] >= config.guard_min_queries) else -9) if max(rows[l]["lcb"][i] for l in LAMS[:-1]) > 0 else 0.0)
  print(f" rule current {cur[0]:+.2f}  sequence {seq[0]:+.2f} {np.round(seq[1],1).tolist()}  best-lcb {best[0]:+.2f}")
  out[name] = rows
os.makedirs("runs/shrunk_guard", exist_ok=True)
json.dump(out, open(f"runs/shrunk_guard/{bench}_{split}_{feats}.json", "w"))
