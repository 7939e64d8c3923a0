"""Running EAR experiments: seeds under `vmap`, chunked training with test evaluations (learning
curves) and checkpoints. JSON summaries of a `RunResult` live in `summaries`.

Symbols: `S` seeds, `N` training queries (times epochs), `M` test queries, `K` candidates, `s` slate
size, `d` dimension.

Protocol (Section 4.4): seed `i` permutes the queries with `datasets.split_indices(N, i)`; the
first 80 % are the online training stream, the rest the test set; all seeds run in one vmapped call.
Training runs in segments of `gcd(checkpoint_every, eval_every)` queries, and query `n` of seed `i`
always uses key `keys[i, n]`, so a run resumed from a checkpoint is bitwise identical to an
uninterrupted one. The test set is evaluated after every segment ending on a multiple of
`eval_every` (the learning curves of Figs. 3-5).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from absl import logging
import numpy as np

from ear_jax.data import corpora as datasets
from ear_jax.core import inference
from ear_jax.core import episode
from ear_jax.core import learner
from ear_jax.core.config import EARConfig, HParams, METHODS, Method, default_hparams
from ear_jax.core import critic as critic_lib
from ear_jax.core.stream import Stream


# Test-time mode of each method when a single number is quoted (Tables 2-3).
METRIC_NAMES = ("recall_adapter", "hitrate_adapter", "recall_explorer", "hitrate_explorer")


class Interrupted(Exception):
  """Raised by `train_and_evaluate` after `stop_after_chunks` segments (simulates a kill)."""

  def __init__(self, position: int):
    super().__init__(f"stopped after position {position} (stop_after_chunks)")
    self.position = position


def build_method(method: str, *, dim: int, num_candidates: int, hparams: Optional[dict] = None,
                 critic=None, **overrides) -> Method:
  """`Method.named(method, ...)`: the preset's config and hyperparameters (None overrides dropped)."""
  overrides = {k: v for k, v in overrides.items() if v is not None}
  return Method.named(method, hparams=hparams, critic=critic, dim=dim,
                      num_candidates=num_candidates, **overrides)


def build_config(method: str, *, dim: int, num_candidates: int, **overrides) -> EARConfig:
  """The config of `build_method` alone (for callers that hold the hyperparameters apart)."""
  return build_method(method, dim=dim, num_candidates=num_candidates, **overrides).config


def seed_splits(num_queries: int, seeds: Sequence[int], train_fraction: float = 0.8):
  """Per-seed 80/20 splits stacked: `(train_idx [S, N], test_idx [S, M])` (Section 4.4)."""
  if not seeds:
    raise ValueError("need at least one seed")
  parts = [datasets.split_indices(num_queries, int(s), train_fraction) for s in seeds]
  train, test = (np.stack(p) for p in zip(*parts))
  if train.shape[1] == 0 or test.shape[1] == 0:
    raise ValueError(f"{num_queries} queries give an empty training or test set")
  return train, test


def validation_split(train_index: np.ndarray, validation_fraction: float = 0.2):
  """Per seed, the training stream's last `validation_fraction` as a validation set.

  Never touches the test split; `fit + validation == train` per seed, in stream order.

  Args:
    train_index: `[S, N]` training queries per seed (from `seed_splits`).
    validation_fraction: share of each training stream held out, in (0, 1).

  Returns:
    `(fit_index [S, N - V], validation_index [S, V])`, `V = round(validation_fraction * N)`.

  Raises:
    ValueError: for a fraction outside (0, 1) or a stream too short for both parts.
  """
  if not 0.0 < validation_fraction < 1.0:
    raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
  train_index = np.asarray(train_index)
  n = train_index.shape[1]
  v = int(round(validation_fraction * n))
  if v < 1 or v >= n:
    raise ValueError(f"a training stream of {n} queries gives an empty fit or validation part "
                     f"(validation_fraction={validation_fraction})")
  return train_index[:, :n - v], train_index[:, n - v:]


def stack_streams(stream: Stream, index: np.ndarray) -> Stream:
  """`[S, n, ...]` stream: row `i` is `stream.take(index[i])`."""
  index = np.asarray(index)
  return jax.tree_util.tree_map(lambda x: np.asarray(x)[index], stream)


def per_seed_keys(seeds: Sequence[int]) -> jax.Array:
  """`[S, 2]` one PRNG key per seed: `PRNGKey(seed)`."""
  return jnp.stack([jax.random.PRNGKey(int(s)) for s in seeds])


@functools.partial(jax.jit, static_argnames=("config",))
def _init_states(keys, config):
  return jax.vmap(lambda k: learner.init_learner(k, config))(keys)


@functools.partial(jax.jit, static_argnames=("config",))
def _train_segment(states, keys, streams, where, hparams, config, critic):
  """All seeds: `keys [S, L]`, `streams [S, L, ...]`, `where [L]` (L a multiple of the batch)."""
  return jax.vmap(lambda st, k, s: episode.train_stream(st, k, s, config, hparams, critic,
                                                       where=where))(states, keys, streams)


def _eval_config(config: EARConfig) -> EARConfig:
  """The fields `inference.evaluate` depends on, so methods share one compiled evaluation."""
  return EARConfig(dim=config.dim, num_candidates=config.num_candidates,
                   slate_size=config.slate_size, num_rounds=config.eval_rounds,
                   replay_size=1, batch_size=1,
                   buffer_capacity=1, final_slate=config.final_slate,
                   side_features=config.side_features, side_init=config.side_init)


@functools.partial(jax.jit, static_argnames=("config",))
def _evaluate_seeds(keys, params, streams, hparams, config, critic):
  return jax.vmap(lambda k, p, s: inference.evaluate(k, p, s, config, hparams, critic))(
      keys, params, streams)


@functools.partial(jax.jit, static_argnames=("config",))
def served_params(states, config: EARConfig):
  """`inference.served_params` of every seed's learner (`states` stacked `[S, ...]`)."""
  return jax.vmap(lambda st: inference.served_params(st, config))(states)


@functools.partial(jax.jit, static_argnames=("num",))
def _episode_keys(keys, num):
  return jax.vmap(lambda k: episode.episode_keys(k, num))(keys)


def _split_seed_keys(keys):
  pair = jax.vmap(jax.random.split)(keys)  # [S, 2, 2]
  return pair[:, 0], pair[:, 1]


def segment_length(num_train: int, batch_size: int, checkpoint_every: Optional[int],
                   eval_every: Optional[int]) -> int:
  """Queries per training segment: gcd of the checkpoint and evaluation periods (or the stream).

  Raises:
    ValueError: when a period is not a positive multiple of the batch size.
  """
  periods = []
  for name, p in (("checkpoint_every", checkpoint_every), ("eval_every", eval_every)):
    if p is None:
      continue
    if p < 1 or p % batch_size:
      raise ValueError(f"{name}={p} must be a positive multiple of batch_size={batch_size}")
    periods.append(p)
  if not periods:
    return num_train
  return min(functools.reduce(math.gcd, periods), num_train) if num_train else 1


@dataclasses.dataclass
class RunResult:
  """Outcome of one method on `S` seeds (numpy arrays, leading axis = seed)."""
  name: str
  config: EARConfig
  hparams: HParams
  seeds: list
  train_index: np.ndarray  # [S, N] query indices of the training stream (with epochs)
  test_index: np.ndarray  # [S, M]
  eval: dict  # EvalResult fields, numpy, [S, M] / [S]
  curve: list  # [{position, queries_seen [S], critic_calls [S], <METRIC_NAMES> [S]}]
  train_log: dict  # name -> [S, N] per-query training log
  final_state: Any  # stacked LearnerState [S, ...]
  critic_calls: np.ndarray  # [S] critic calls spent in training
  wall_seconds: float
  resumed_from: int = 0


def _record_log(records) -> dict:
  labels = np.asarray(records.labels)
  mask = np.asarray(records.slate_mask)
  return {
      "loss": np.asarray(records.loss, np.float32),
      "loss_cur": np.asarray(records.loss_cur, np.float32),
      "loss_rep": np.asarray(records.loss_rep, np.float32),
      "num_replayed": np.asarray(records.num_replayed, np.int32),
      "positive_labels": ((labels > 0) & mask).sum((-1, -2)).astype(np.int32),
      "critic_calls": mask.any(-1).sum(-1).astype(np.int32),
  }


def _curve_point(position, queries_seen, critic_calls, ev: dict) -> dict:
  return {"position": int(position), "queries_seen": np.asarray(queries_seen).tolist(),
          "critic_calls": np.asarray(critic_calls).tolist(),
          **{m: (100.0 * np.asarray(ev[m], np.float64)).tolist() for m in METRIC_NAMES}}


def _concat_logs(logs: list) -> dict:
  return {k: np.concatenate([l[k] for l in logs], 1) for k in logs[0]} if logs else {}


def train_and_evaluate(name: str, stream: Stream, train_index: np.ndarray,
                       test_index: np.ndarray, config: EARConfig, hparams: HParams,
                       seeds: Sequence[int], *, epochs: int = 1,
                       eval_every: Optional[int] = None,
                       checkpoint_every: Optional[int] = None,
                       checkpointer=None, resume: bool = False,
                       stop_after_chunks: Optional[int] = None,
                       critic=None, progress: bool = False) -> RunResult:
  """Trains one method on every seed at once (vmap) and evaluates it on each seed's test set.

  Args:
    name: run name (logs, checkpoints).
    stream: the benchmark's stream of all queries.
    train_index: `[S, N]` training queries per seed, in stream order (one epoch).
    test_index: `[S, M]` test queries per seed.
    config, hparams: the method (hyperparameters shared by the seeds).
    seeds: the `S` seeds; seed `i` uses `PRNGKey(seeds[i])`, split into (episode, evaluation).
    epochs: passes over the training stream.
    eval_every: evaluate the test set every this many training queries, at 0 and at the end;
      None: only at the end.
    checkpoint_every: save a checkpoint every this many training queries and at the end.
    checkpointer: a `run_checkpoints.RunCheckpointer` (None: no checkpoints); `resume` continues
      from its latest checkpoint; `stop_after_chunks` raises `Interrupted` after that many
      segments (after their checkpoint).
    critic: a critic pytree shared by the seeds (default: the paper's simulated critic).
  """
  t0 = time.perf_counter()
  critic = critic_lib.or_default(critic)
  seeds = list(seeds)
  train_index = np.tile(np.asarray(train_index), (1, epochs))
  n = train_index.shape[1]
  train = stack_streams(stream, train_index)
  test = stack_streams(stream, test_index)
  episode_key, eval_key = _split_seed_keys(per_seed_keys(seeds))
  init_keys, query_keys = _episode_keys(episode_key, n)
  states = _init_states(init_keys, config)
  seg = segment_length(n, config.batch_size, checkpoint_every, eval_every)
  seg = -(-seg // config.batch_size) * config.batch_size
  ecfg = _eval_config(config)
  position, curve, logs, resumed_from = 0, [], [], 0
  if checkpointer is not None:
    checkpointer.bind(config=config, hparams=hparams, seeds=seeds, num_train=n, segment=seg,
                      target=states)
    if resume and checkpointer.latest_position() is not None:
      states, position, extra = checkpointer.restore()
      curve = extra.get("curve", [])
      logs = [{k: np.asarray(v) for k, v in extra.get("train_log", {}).items()}] if position else []
      resumed_from = position
      logging.info("%s: resumed from position %d/%d", name, position, n)

  def evaluate(keys, states):
    params = served_params(states, config) if config.guard else states.params
    return _evaluate_seeds(keys, params, test, hparams, ecfg, critic)

  def curve_point():  # the test set at `position`, with its own evaluation keys
    ev = evaluate(jax.vmap(jax.random.fold_in, (0, None))(eval_key, position), states)
    seen, calls, ev = jax.device_get((states.queries_seen, states.critic_calls, ev))
    curve.append(_curve_point(position, seen, calls, ev._asdict()))

  if config.trains:
    if eval_every and position == 0:
      curve_point()
    from tqdm import auto as tqdm  # pylint: disable=g-import-not-at-top
    with tqdm.tqdm(total=n, initial=position, desc=f"{name} (x{len(seeds)} seeds)", unit="q",
                   leave=False, mininterval=2.0, disable=not progress) as bar:
      chunks = 0
      while position < n:
        start, end = position, min(position + seg, n)
        # Every segment has length `seg` (the last padded with masked queries): one compilation.
        pad = np.minimum(np.arange(start, start + seg), n - 1)
        where = np.arange(start, start + seg) < n
        states, records = _train_segment(states, query_keys[:, pad],
                                         jax.tree_util.tree_map(lambda x: x[:, pad], train),
                                         jnp.asarray(where), hparams, config, critic)
        logs.append(_record_log(jax.tree_util.tree_map(lambda r: r[:, :end - start],
                                                       jax.device_get(records))))
        position = end
        bar.update(end - start)
        if eval_every and (position % eval_every == 0 or position == n):
          curve_point()
        chunks += 1
        if checkpointer is not None and (position == n or (
            checkpoint_every and position % checkpoint_every == 0)):
          checkpointer.save(position, states, {"curve": curve, "train_log": {
              k: v.tolist() for k, v in _concat_logs(logs).items()}})
        if stop_after_chunks is not None and chunks >= stop_after_chunks and position < n:
          raise Interrupted(position)
  elif checkpointer is not None and checkpointer.latest_position() is None:
    checkpointer.save(0, states, {"curve": [], "train_log": {}})
  ev, final_state = jax.device_get((evaluate(eval_key, states), states))
  ev = {k: np.asarray(v) for k, v in ev._asdict().items()}
  if eval_every and not config.trains:
    curve = [_curve_point(0, final_state.queries_seen, final_state.critic_calls, ev)]
  return RunResult(name=name, config=config, hparams=hparams, seeds=seeds,
                   train_index=train_index, test_index=np.asarray(test_index), eval=ev,
                   curve=curve, train_log=_concat_logs(logs), final_state=final_state,
                   critic_calls=np.asarray(final_state.critic_calls),
                   wall_seconds=time.perf_counter() - t0, resumed_from=resumed_from)


def evaluate_params(params, stream: Stream, test_index: np.ndarray, config: EARConfig,
                    hparams: HParams, seeds: Sequence[int], critic=None) -> dict:
  """Scores `[S]` stacked adapter parameters on each seed's test queries with the evaluation keys
  of `train_and_evaluate`; returns the `EvalResult` fields as numpy arrays (`[S, M]` / `[S]`)."""
  _, eval_key = _split_seed_keys(per_seed_keys(list(seeds)))
  ev = _evaluate_seeds(eval_key, params, stack_streams(stream, test_index), hparams,
                       _eval_config(config), critic_lib.or_default(critic))
  return {k: np.asarray(v) for k, v in jax.device_get(ev)._asdict().items()}


__all__ = ["Interrupted", "RunResult", "build_config", "build_method", "default_hparams",
           "evaluate_params",
           "per_seed_keys", "seed_splits", "segment_length", "served_params", "stack_streams",
           "train_and_evaluate",
           "METHODS", "METRIC_NAMES"]
