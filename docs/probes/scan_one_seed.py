"""A probe, not part of the library (session 18, issue 30): the jitted scan's cost per question for
one seed (what one `Memory` learns) against ten seeds vmapped (the reference of issue 30's
target), compiled, LoCoMo, `ear`. Usage: EAR_DATA_DIR=../shared/data python docs/probes/scan_one_seed.py"""
import time, numpy as np
from ear_jax.experiment import live, runner
data = live.load_live_data("locomo", progress=False)
m = runner.build_method("ear", dim=data.bench.stream.dim, num_candidates=20, side_features=data.bench.stream.num_side_features)
for seeds in ([0], list(range(10))):
  train, test = runner.seed_splits(data.bench.num_queries, seeds)
  res, warm = live.run_runner(data, m, seeds, train, test, timing_repeat=True)
  per_q = train.shape[1] + test.shape[1]
  print(len(seeds), "seeds: compiled scan", round(warm, 2), "s;", round(1e3 * warm / (per_q * len(seeds)), 3), "ms per (seed, question)")
