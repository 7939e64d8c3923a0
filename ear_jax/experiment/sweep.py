"""Validation sweeps: `H` stacked `HParams` x `S` seeds trained in one compiled episode.

Symbols: `H` hyperparameter settings, `S` seeds, `N` fit queries, `V` validation queries.

Every setting is trained online on the fit part of `runner.validation_split` and scored on its
validation part; the test split is not an argument, so a sweep cannot read it. Keys are derived as
in `runner.train_and_evaluate`, so an `H = 1` sweep equals `train_and_evaluate(train=fit,
test=validation)` (`tests/test_validation_split.py`). Test-time settings are scored from the same
adapters (`eval_variants`), without retraining.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Mapping, Optional, Sequence

from absl import logging
import jax
import numpy as np

from ear_jax.core import critic as critic_lib
from ear_jax.core import episode
from ear_jax.core import inference
from ear_jax.core import learner
from ear_jax.core.config import EARConfig, HParams
from ear_jax.core.stream import Stream
from ear_jax.experiment import runner


@functools.partial(jax.jit, static_argnames=("config",))
def _train_grid(init_keys, query_keys, streams, hparams, config, critic):
  """`[H, S]` learners: `init_keys [S]`, `query_keys [S, N]`, `streams [S, N, ...]`, `hparams [H]`."""

  def per_setting(hp):
    def per_seed(k0, keys, s):
      state = learner.init_learner(k0, config)
      state, _ = episode.train_stream(state, keys, s, config, hp, critic)
      return state.params
    return jax.vmap(per_seed)(init_keys, query_keys, streams)

  return jax.vmap(per_setting)(hparams)


@functools.partial(jax.jit, static_argnames=("config",))
def _init_grid(init_keys, hparams, config):
  """`[H, S]` untrained adapters (the identity: a config that does not train, e.g. retriever)."""
  return jax.vmap(lambda hp: jax.vmap(lambda k: learner.init_learner(k, config).params)(
      init_keys))(hparams)


@functools.partial(jax.jit, static_argnames=("config",))
def _evaluate_grid(eval_keys, params, streams, hparams, config, critic):
  """Means of `inference.evaluate` for `[H, S]` adapters on `[S]` validation streams."""

  def per_setting(p_h, hp):
    def per_seed(k, p, s):
      ev = inference.evaluate(k, p, s, config, hp, critic)
      return (ev.recall_adapter, ev.hitrate_adapter, ev.recall_explorer, ev.hitrate_explorer)
    return jax.vmap(per_seed)(eval_keys, p_h, streams)

  return jax.vmap(per_setting)(params, hparams)


def num_settings(hparams: HParams) -> int:
  """`H` of stacked `HParams` (every leaf `[H]`)."""
  shapes = {np.shape(x) for x in jax.tree_util.tree_leaves(hparams)}
  if len(shapes) != 1 or len(next(iter(shapes))) != 1:
    raise ValueError(f"hparams must be stacked to [H] in every leaf (stack_hparams); got leaf "
                     f"shapes {sorted(shapes)}")
  return next(iter(shapes))[0]


def sweep_validation(stream: Stream, fit_index: np.ndarray, validation_index: np.ndarray,
                     config: EARConfig, hparams: HParams, seeds: Sequence[int], *,
                     critic=None,
                     eval_variants: Optional[Mapping[str, dict]] = None) -> dict:
  """Trains `H x S` learners on the fit streams and scores them on the validation streams.

  Args:
    stream: the benchmark's stream of all queries.
    fit_index: `[S, N]` fit queries per seed, in stream order (`runner.validation_split`).
    validation_index: `[S, V]` validation queries per seed.
    config: static config of the training run (one compile per config).
    hparams: `HParams` stacked to `[H]` (`config.stack_hparams`).
    seeds: the `S` seeds.
    critic: a critic pytree shared by all learners (default: the paper's simulated critic).
    eval_variants: name -> `EARConfig` overrides of inference fields (`test_rounds`,
      `final_slate`) scored from the same adapters; default `{"default": {}}`.

  Returns:
    `{"recall_adapter", "hitrate_adapter": [H, S] percent, "explorer": {variant: {"recall",
    "hitrate": [H, S]}}, "seconds"}`.
  """
  t0 = time.perf_counter()
  critic = critic_lib.or_default(critic)
  seeds = list(seeds)
  h = num_settings(hparams)
  fit = runner.stack_streams(stream, fit_index)
  val = runner.stack_streams(stream, validation_index)
  n = np.asarray(fit_index).shape[1]
  episode_key, eval_key = runner._split_seed_keys(  # pylint: disable=protected-access
      runner.per_seed_keys(seeds))
  init_keys, query_keys = runner._episode_keys(episode_key, n)  # pylint: disable=protected-access
  if config.trains:
    params = _train_grid(init_keys, query_keys, fit, hparams, config, critic)
  else:
    params = _init_grid(init_keys, hparams, config)
  variants = dict(eval_variants or {"default": {}})
  out = {"explorer": {}}
  for name, over in variants.items():
    unknown = set(over) - {"test_rounds", "final_slate"}
    if unknown:
      raise ValueError(f"eval variant {name!r}: only test_rounds / final_slate change inference, "
                       f"got {sorted(unknown)}")
    ecfg = runner._eval_config(dataclasses.replace(config, **over))  # pylint: disable=protected-access
    ra, ha, re, he = (100.0 * np.asarray(x, np.float64) for x in _evaluate_grid(
        eval_key, params, val, hparams, ecfg, critic))
    out["recall_adapter"], out["hitrate_adapter"] = ra, ha
    out["explorer"][name] = {"recall": re, "hitrate": he}
  out["seconds"] = time.perf_counter() - t0
  logging.info("sweep: %d settings x %d seeds, %d fit / %d validation queries: %.1f s", h,
               len(seeds), n, np.asarray(validation_index).shape[1], out["seconds"])
  return out
