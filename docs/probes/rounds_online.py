"""A probe, not part of the library (session 19, issue 27's strength target): does more feedback
per training question (T = 8 Explorer rounds instead of 4: twice the critic calls) raise
`ear_tuned`'s adapter-only gain over hybrid candidates? Table 6 (dense, the paper's EAR) had
T = 8 best; over hybrid it was never measured.

Usage (LoCoMo validation only; the test split is never read; LongMemEval_S is held out):
  EAR_DATA_DIR=../shared/data python docs/probes/rounds_online.py locomo [features] [T ...]
"""
import dataclasses, os, sys
import jax, jax.numpy as jnp, numpy as np
from ear_jax.core import guard as guard_lib
from ear_jax.experiment import runner
from ear_jax.experiment.suites.options import Options
from ear_jax.experiment.suites.run_cache import Runner
from ear_jax.experiment.suites.first_stage import _validation

bench = sys.argv[1]
if bench != "locomo":
  sys.exit("LongMemEval_S is held out: this probe reads LoCoMo validation only")
feats = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "first_stage" else None
rounds = [int(x) for x in sys.argv[3:]] or [4, 8]
r = Runner(Options(benchmark=bench, data_dir=os.environ.get("EAR_DATA_DIR", "../shared/data"),
                   candidates="hybrid", seeds=5, workdir="runs/rounds", progress=False,
                   features=feats))
stream = r.bench().stream
fit, ev = _validation(r)
m = runner.build_method("ear_tuned", dim=stream.dim, num_candidates=stream.num_candidates,
                        side_features=stream.num_side_features)
first = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (len(r.seeds),) + x.shape),
                               guard_lib.first_stage_params(m.config))
fz = 100 * np.asarray(runner.evaluate_params(first, stream, ev, m.config, m.hparams, r.seeds)[
    "recall_adapter"], np.float64)
print(f"== {bench} validation, hybrid, features={feats or 'first_stage'}: frozen {fz.mean():.2f}",
      flush=True)
for t in rounds:
  config = dataclasses.replace(m.config, num_rounds=t, test_rounds=4)
  res = runner.train_and_evaluate(f"T={t}", stream, fit, ev, config, m.hparams, r.seeds)
  d = 100 * np.asarray(res.eval["recall_adapter"], np.float64) - fz
  print(f"  ear_tuned T={t}: dR@5 {d.mean():+.2f}  per seed {np.round(d, 2).tolist()}  critic "
        f"calls per seed {int(np.asarray(res.critic_calls)[0])}", flush=True)
