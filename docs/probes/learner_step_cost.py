"""A probe, not part of the library (session 19, issue 30's floor): what one call of the memory's
compiled learner step (`agent.memory.driver.train_step`, state donated) costs for `ear` at
d = 384, b = 4, and which part of it is the replay (Eq. (15)-(16)) and the buffer's size.

Usage: python docs/probes/learner_step_cost.py   (~1 min; random inputs, no data files)
"""
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory import driver as memory_driver
from ear_jax.core import learner as learner_lib
from ear_jax.core.config import Method
from ear_jax.core.stream import Stream

m = Method.named("ear")
config, hp = dataclasses.replace(m.config, dim=384), m.hparams
K, T, b, s = config.num_candidates, config.num_rounds, config.batch_size, config.slate_size
rng = np.random.default_rng(0)
batch = Stream(queries=rng.standard_normal((b, config.dim)).astype(np.float32),
               candidates=rng.standard_normal((b, K, config.dim)).astype(np.float32),
               mask=np.ones((b, K), bool), gold=np.zeros((b, K), bool),
               num_gold=np.zeros((b,), np.int32))
slates = np.pad(np.tile(np.arange(K, dtype=np.int32)[:s], (b, T, 1)),
                ((0, 0), (0, 0), (0, K - s)), constant_values=-1)
labels = np.where(rng.random(slates.shape) < .3, 1., -1.).astype(np.float32)
args = (jax.random.split(jax.random.PRNGKey(1), b), batch, slates, slates >= 0, labels,
        np.ones((b,), bool))
for capacity, replay in [(2048, True), (64, True), (2048, False)]:
  c = dataclasses.replace(config, buffer_capacity=capacity, use_replay=replay)
  box = [jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True),
                                learner_lib.init_learner(jax.random.PRNGKey(0), c))]

  def run(n):
    for _ in range(n):
      box[0], _ = memory_driver.train_step(box[0], *args, c, hp)
    jax.block_until_ready(box[0].params)

  run(30)
  t = time.perf_counter()
  run(200)
  print(f"buffer {capacity:5d}, replay {str(replay):5s}: "
        f"{1e3 * (time.perf_counter() - t) / 200:.2f} ms per step of {b} questions")
