"""A probe, not part of the library (session 19, issue 27's strength target): does an online
learner that trains only the side-feature weights `w_side` (the adapter's `W_q`, `W_m` frozen at
0, so Eq. (3) is the identity) generalise better than the full adapter? The gold-label headroom
(RESULTS.md "Headroom", BUILD_NOTES "Session 16") fitted with the context features gave the side
weights alone +5.53 against +4.72 for every parameter, on LoCoMo validation.

Usage (LoCoMo validation only; the test split is never read; LongMemEval_S is held out):
  EAR_DATA_DIR=../shared/data python docs/probes/side_only_online.py locomo [features] [lr ...]

`ear_tuned` is trained online from the simulated critic over hybrid candidates on each seed's fit
part (5 seeds), once with every parameter (the preset) and once per learning rate with the updates
of `W_q` / `W_m` set to zero (`optax.masked(optax.set_to_zero())` after the optimizer); each is
scored adapter-only on the seed's validation questions against the frozen first stage, paired.
"""
import os, sys
import jax, jax.numpy as jnp, numpy as np, optax
from ear_jax.core import critic as critic_lib, guard as guard_lib, learner as learner_lib
from ear_jax.experiment import runner
from ear_jax.experiment.suites.options import Options
from ear_jax.experiment.suites.run_cache import Runner
from ear_jax.experiment.suites.first_stage import _validation

bench = sys.argv[1]
if bench != "locomo":
  sys.exit("LongMemEval_S is held out: this probe reads LoCoMo validation only")
feats = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "first_stage" else None
lrs = [float(x) for x in sys.argv[3:]] or [1e-4, 1e-3, 3e-3, 1e-2]
method = os.environ.get("PROBE_METHOD", "ear_tuned")
r = Runner(Options(benchmark=bench, data_dir=os.environ.get("EAR_DATA_DIR", "../shared/data"),
                   candidates="hybrid", seeds=5, workdir="runs/side_only", progress=False,
                   features=feats))
stream = r.bench().stream
fit, ev = _validation(r)
base = runner.build_method(method, dim=stream.dim, num_candidates=stream.num_candidates,
                           side_features=stream.num_side_features)
first = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (len(r.seeds),) + x.shape),
                               guard_lib.first_stage_params(base.config))
score = lambda p: 100 * np.asarray(runner.evaluate_params(p, stream, ev, base.config, base.hparams,
                                                          r.seeds)["recall_adapter"], np.float64)
fz = score(first)
print(f"== {bench} validation, hybrid, features={feats or 'first_stage'}, {method}: frozen "
      f"{fz.mean():.2f}", flush=True)
orig = learner_lib.optimizer_fn


def run(tag, lr, side_only):
  learner_lib.optimizer_fn = orig if not side_only else (
      lambda config: lambda learning_rate: optax.chain(
          orig(config)(learning_rate),
          optax.masked(optax.set_to_zero(),
                       lambda p: jax.tree_util.tree_map(lambda _: True, p).replace(w_side=False))))
  jax.clear_caches()  # (the optimizer is built at trace time: no compiled step of another run)
  hp = base.hparams.replace(learning_rate=jnp.float32(lr))
  res = runner.train_and_evaluate(tag, stream, fit, ev, base.config, hp, r.seeds)
  d = 100 * np.asarray(res.eval["recall_adapter"], np.float64) - fz
  w = np.asarray(res.final_state.params.w_side)
  moved = float(np.abs(np.asarray(res.final_state.params.w_q)).max())
  print(f"  {tag:28s} dR@5 {d.mean():+.2f}  per seed {np.round(d, 2).tolist()}  "
        f"w_side (seed 0) {np.round(w[0], 3).tolist()}  max |W_q| {moved:.3g}", flush=True)


run(f"every parameter, lr {float(base.hparams.learning_rate):g}",
    float(base.hparams.learning_rate), False)
for lr in lrs:
  run(f"side weights only, lr {lr:g}", lr, True)
