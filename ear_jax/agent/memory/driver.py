"""The learner driver of `Memory`: closed sessions queue up; every `b` of them -> ONE learner step.

Symbols: `b` batch size (`config.batch_size`), `T` Explorer rounds, `K` candidates, `d` dimension.

The driver owns the `LearnerState`. `push` queues the `TrainItem`s of closed sessions (see
`ear_jax.agent.memory.sessions`); as soon as `b` are queued, ONE call of
`ear_jax.core.learner.train_batch_on_feedback` (jitted with the state donated: updated in place)
trains on them: slates, masks and labels
`[b, T, K]` (every shown slate stored K wide, masked, so the shown size `k <= K` may vary), the
current loss over each query's rounds (Eq. (10)), the replay loss (Eq. (15)-(16)), one optax step
(Eq. (17)-(18)), then ONE experience per query pushed (Eq. (11)-(14)). This is the same step, with
the same shapes, as the benchmark episodes' `train_batch` (which collects its slates with a jitted
critic). `flush` trains what is queued in one padded, masked batch per `b` items.

Keys: `k_init, k_train, k_critic = jax.random.split(jax.random.PRNGKey(seed), 3)`; `k_init`
initialises the learner, batch number `j` (0, 1, ...) uses the replay keys
`jax.random.split(jax.random.fold_in(k_train, j), b)` (one per query of the batch), and `k_critic`
is `Memory`'s (critic calls). The same calls with the same seed give the same parameters.

Not thread-safe on its own: `Memory` holds its lock around every call.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory.sessions import TrainItem
from ear_jax.core import learner as learner_lib
from ear_jax.core.config import EARConfig, HParams
from ear_jax.core.stream import Stream


_BUFFER_CANDIDATES = ".buffer.candidates"  # the learner leaf saved as bank rows
LEARNER_LAYOUT = "named-1"  # meta["learner_layout"]: the state saved as its named pytree

# The learner step with the state donated: the step updates the `[C, K, d]` replay buffer and the
# optimizer state in place instead of copying them (and allocates no fresh buffer per step).
_train_step = jax.jit(learner_lib.train_batch_on_feedback, static_argnames=("config",),
                      donate_argnums=0)


def _owned(state):
  """`state` with every leaf in its own buffer (donation needs distinct, JAX-owned buffers)."""
  return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)


def seed_keys(seed: int):
  """`(k_init, k_train, k_critic)` of ONE memory's seed (see the module docstring); a run's keys,
  one per seed, are `ear_jax.experiment.runner.per_seed_keys`."""
  k_init, k_train, k_critic = jax.random.split(jax.random.PRNGKey(int(seed)), 3)
  return k_init, k_train, k_critic


class Driver:
  """Queue of closed sessions and the learner state they train.

  Args:
    config: static config.
    hparams: hyperparameters.
    seed: the memory's seed (see `seed_keys`).
  """

  def __init__(self, config: EARConfig, hparams: HParams, seed: int):
    self.config = config
    self.hparams = hparams
    k_init, self.train_key, _ = seed_keys(seed)
    self.state: learner_lib.LearnerState = _owned(learner_lib.init_learner(k_init, config))
    self.ready: list[TrainItem] = []
    self.num_batches = 0
    # The bank rows of the replay buffer's candidates, slot by slot (-1 = padding or empty): what
    # checkpoints save instead of the `[C, K, d]` embeddings. None after restoring a checkpoint
    # written before rows were kept (then the embeddings are saved inline).
    cap, k = config.buffer_capacity, config.num_candidates
    self.buffer_rows: Optional[np.ndarray] = np.full((cap, k), -1, np.int32)
    self.insert_index = 0  # host copy of `state.buffer.insert_index`

  def push(self, items) -> int:
    """Queues closed sessions and trains every full batch; returns the learner steps taken."""
    self.ready.extend(items)
    steps = 0
    while len(self.ready) >= self.config.batch_size:
      self._train(self.config.batch_size)
      steps += 1
    return steps

  def flush(self) -> int:
    """Trains everything queued (the last batch padded and masked); returns the steps taken."""
    steps = self.push(())
    if self.ready:
      self._train(len(self.ready))
      steps += 1
    return steps

  def _train(self, n: int) -> None:
    items, self.ready = self.ready[:n], self.ready[n:]
    b = self.config.batch_size
    pad = [items[0]] * (b - n)  # padding rows (where = False): no loss, not pushed
    stacked = TrainItem(*(np.stack(x) for x in zip(*(items + pad))))
    batch = Stream(queries=stacked.query, candidates=stacked.candidates, mask=stacked.mask,
                   gold=np.zeros(stacked.mask.shape, bool),
                   num_gold=np.zeros((b,), np.int32))
    keys = jax.random.split(jax.random.fold_in(self.train_key, self.num_batches), b)
    self.state, _ = _train_step(
        self.state, keys, batch, stacked.slates, stacked.slate_mask, stacked.labels,
        jnp.arange(b) < n, self.config, self.hparams)
    self.num_batches += 1
    cap = self.config.buffer_capacity  # the step pushed the n queries in order (`push_experiences`)
    if self.buffer_rows is not None:
      self.buffer_rows[(self.insert_index + np.arange(n)) % cap] = np.where(
          stacked.mask[:n], stacked.rows[:n], -1)
    self.insert_index = (self.insert_index + n) % cap

  # ----------------------------------------------------------------------------------------------
  # snapshot / restore

  def snapshot(self):
    """`(arrays, meta)`: learner state, hyperparameters and queued items (host copies).

    The learner state is saved as the named pytree it is (`LearnerState`, leaves named by their
    field path, e.g. 'params/w_q') and restored by name against the abstract state of the config
    (`restore`). The replay buffer's candidates (`[C, K, d]`, the largest part) are saved as their
    bank rows (`buffer_rows [C, K]`) and an empty placeholder, and gathered back from the bank."""
    by_rows = self.buffer_rows is not None
    state = _without_candidates(self.state) if by_rows else self.state
    arrays = {"learner": jax.tree_util.tree_map(np.array, state),  # own host copies
              "hparams": {f.name: np.asarray(getattr(self.hparams, f.name))
                          for f in dataclasses.fields(self.hparams)}}
    if by_rows:
      arrays["buffer_rows"] = self.buffer_rows.copy()
      if self.config.side_features:  # the candidates' first-stage features are not bank rows
        arrays["buffer_features"] = np.asarray(
            self.state.buffer.candidates[..., self.config.dim:])
    if self.ready:
      arrays["ready"] = {f: np.stack([getattr(it, f) for it in self.ready])
                         for f in TrainItem._fields}
    return arrays, {"num_batches": self.num_batches, "num_ready": len(self.ready),
                    "learner_layout": LEARNER_LAYOUT,
                    "num_learner_leaves": len(jax.tree_util.tree_leaves(self.state))}

  @classmethod
  def restore(cls, config: EARConfig, seed: int, arrays, meta, where: str, gather) -> "Driver":
    """The driver of `snapshot`; ValueError naming `where` when it does not fit `config`.
    `gather(rows [n, K], mask [n, K], where)` gives bank rows' embeddings (the buffer's
    candidates). Checkpoints written before the learner state was named (its leaves keyed by
    flatten position, '0000', '0001', ...) still load."""
    hparams = HParams(**{k: jnp.asarray(v, jnp.float32) for k, v in arrays["hparams"].items()})
    out = cls(config, hparams, seed)
    by_rows = "buffer_rows" in arrays
    target = jax.eval_shape(lambda: out.state)
    if meta.get("learner_layout") == LEARNER_LAYOUT:
      abstract = _without_candidates(target) if by_rows else target
      from ear_jax.io import checkpoints  # pylint: disable=g-import-not-at-top
      state = checkpoints.fit_target(abstract, arrays["learner"], f"{where}: the learner state")
      state = jax.tree_util.tree_map(lambda x, t: jnp.asarray(x, t.dtype), state, abstract)
    else:
      state = _positional_state(target, arrays, meta, by_rows, where)
    if by_rows:
      t = target.buffer.candidates
      rows = np.asarray(arrays["buffer_rows"])
      if rows.shape != t.shape[:2]:
        raise ValueError(f"{where}: buffer_rows has shape {rows.shape}, expected {t.shape[:2]}")
      out.buffer_rows = rows.astype(np.int32)
      cands = gather(rows, rows >= 0, f"the replay buffer of {where}")
      if config.side_features:
        feats = np.asarray(arrays.get("buffer_features", np.zeros((0,))), np.float32)
        if feats.shape != t.shape[:2] + (config.side_features,):
          raise ValueError(f"{where}: buffer_features has shape {feats.shape}, expected "
                           f"{t.shape[:2] + (config.side_features,)}")
        cands = jnp.concatenate([cands, jnp.asarray(feats)], -1)
      state = state.replace(buffer=state.buffer.replace(candidates=cands))
    out.state = _owned(state)
    out.insert_index = int(out.state.buffer.insert_index)
    if not by_rows:  # written before rows were kept: keep saving the embeddings inline
      out.buffer_rows = None
    if meta["num_ready"]:
      r = dict(arrays["ready"])
      T, K, d = config.num_rounds, config.num_candidates, config.dim
      if "rows" not in r:  # written before rows were kept
        r["rows"] = np.full((meta["num_ready"], K), -1, np.int32)
        out.buffer_rows = None
      shapes = dict(query=(d,), candidates=(K, d + config.side_features), mask=(K,),
                    slates=(T, K), slate_mask=(T, K), labels=(T, K), rows=(K,))
      for f, shape in shapes.items():
        if np.shape(r[f]) != (meta["num_ready"],) + shape:
          raise ValueError(f"{where}: queued training array {f!r} has shape {np.shape(r[f])}, "
                           f"expected {(meta['num_ready'],) + shape}")
      out.ready = [TrainItem(*(np.asarray(r[f][j]) for f in TrainItem._fields))
                   for j in range(meta["num_ready"])]
    out.num_batches = int(meta["num_batches"])
    return out


def _without_candidates(state):
  """`state` with the replay buffer's candidates replaced by an empty `[0]` placeholder (saved as
  bank rows instead); works on arrays and on abstract (`ShapeDtypeStruct`) states."""
  empty = jax.ShapeDtypeStruct if isinstance(state.buffer.candidates, jax.ShapeDtypeStruct) else (
      lambda shape, dtype: np.zeros(shape, dtype))
  return state.replace(buffer=state.buffer.replace(
      candidates=empty((0,), state.buffer.candidates.dtype)))


def _positional_state(target, arrays, meta, by_rows: bool, where: str):
  """The learner state of a checkpoint written before it was named: leaves keyed by flatten
  position ('0000', ...), checked by count and shape (the buffer's candidates are filled in by
  the caller when saved as bank rows)."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(target)
  stored = dict(arrays["learner"])
  if len(stored) + by_rows != len(paths) or meta["num_learner_leaves"] != len(paths):
    raise ValueError(f"{where}: the learner state has {len(stored) + by_rows} arrays, expected "
                     f"{len(paths)} for this config")
  leaves = []
  for i, (p, t) in enumerate(paths):
    if by_rows and jax.tree_util.keystr(p) == _BUFFER_CANDIDATES:
      leaves.append(np.zeros((0,), t.dtype))
      continue
    key = f"{i:04d}"
    if key not in stored:
      raise ValueError(f"{where}: learner array {i} is missing")
    x = np.asarray(stored[key])
    if x.shape != t.shape:
      raise ValueError(f"{where}: learner array {i} has shape {x.shape}, expected {t.shape}")
    leaves.append(jnp.asarray(x, t.dtype))
  return jax.tree_util.tree_unflatten(treedef, leaves)
