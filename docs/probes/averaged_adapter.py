"""A probe, not part of the library (session 19, issue 27's strength target): does serving an
average of the adapter's iterates (Polyak-Ruppert tail average, or an exponential moving average)
instead of the last iterate raise the adapter-only gain over the first stage?

Usage (LoCoMo validation only; the test split is never read; LongMemEval_S is held out):
  EAR_DATA_DIR=../shared/data python docs/probes/averaged_adapter.py locomo [features]

`ear_tuned` (and the paper's `ear`) is trained online from the simulated critic over hybrid
candidates on each seed's fit part (5 seeds, vmapped), one batch per call (the chunks equal one
scan: runner's segments); after every step the averages are updated; each is scored adapter-only
on the seed's validation questions against the frozen first stage, paired per seed.
"""
import os, sys
import jax, jax.numpy as jnp, numpy as np
from ear_jax.core import critic as critic_lib, guard as guard_lib
from ear_jax.experiment import runner
from ear_jax.experiment.suites.options import Options
from ear_jax.experiment.suites.run_cache import Runner
from ear_jax.experiment.suites.first_stage import _validation

bench = sys.argv[1]
if bench != "locomo":
  sys.exit("LongMemEval_S is held out: this probe reads LoCoMo validation only")
feats = sys.argv[2] if len(sys.argv) > 2 else None
methods = os.environ.get("PROBE_METHODS", "ear_tuned").split(",")
r = Runner(Options(benchmark=bench, data_dir=os.environ.get("EAR_DATA_DIR", "../shared/data"),
                   candidates="hybrid", seeds=5, workdir="runs/averaged_adapter",
                   progress=False, features=feats))
stream = r.bench().stream
fit, ev = _validation(r)
DECAYS = (0.9, 0.97, 0.99, 0.995)
TAILS = (0.5, 0.25)  # average of the last half / quarter of the iterates
for name in methods:
  m = runner.build_method(name, dim=stream.dim, num_candidates=stream.num_candidates,
                          side_features=stream.num_side_features)
  config, hp = m.config, m.hparams
  critic = critic_lib.or_default(None)
  seeds = r.seeds
  train = runner.stack_streams(stream, fit)
  n = fit.shape[1]
  episode_key, _ = runner._split_seed_keys(runner.per_seed_keys(seeds))
  init_keys, query_keys = runner._episode_keys(episode_key, n)
  states = runner._init_states(init_keys, config)
  b = config.batch_size
  steps = -(-n // b)
  emas = {d: states.params for d in DECAYS}
  tails = {t: (None, 0) for t in TAILS}
  for i in range(steps):
    pad = np.minimum(np.arange(i * b, i * b + b), n - 1)
    where = np.arange(i * b, i * b + b) < n
    states, _ = runner._train_segment(states, query_keys[:, pad],
                                      jax.tree_util.tree_map(lambda x: x[:, pad], train),
                                      jnp.asarray(where), hp, config, critic)
    for d in DECAYS:
      emas[d] = jax.tree_util.tree_map(lambda e, p: d * e + (1 - d) * p, emas[d], states.params)
    for t in TAILS:
      if i >= steps * (1 - t):
        s, c = tails[t]
        tails[t] = (states.params if s is None else
                    jax.tree_util.tree_map(lambda a, p: a + p, s, states.params), c + 1)
  first = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (len(seeds),) + x.shape),
                                 guard_lib.first_stage_params(config))
  def score(p):
    e = runner.evaluate_params(p, stream, ev, config, hp, seeds, critic)
    return 100 * np.asarray(e["recall_adapter"], np.float64)
  fz = score(first)
  rows = {"last iterate": states.params}
  rows.update({f"EMA {d}": p for d, p in emas.items()})
  rows.update({f"tail {t}": jax.tree_util.tree_map(lambda a: a / c, s) for t, (s, c) in tails.items()})
  print(f"== {bench} validation, hybrid, {name}, features={feats}: frozen {fz.mean():.2f} ({n} fit questions, {steps} steps)")
  for k, p in rows.items():
    d = score(p) - fz
    print(f"  {k:14s} dR@5 {d.mean():+.2f}  per seed {np.round(d, 2).tolist()}", flush=True)
