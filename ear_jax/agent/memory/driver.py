"""The learner driver of `Memory`: every `b` queued `TrainItem`s make ONE learner step.

Symbols: `b` batch size, `T` Explorer rounds, `K` candidates, `d` dimension, `F` side features,
`C` replay buffer capacity.

A step is ONE call of `core.learner.train_batch_on_feedback` (state donated) with `[b, T, K]`
slates, masks and labels (Eq. (10)-(18)), as the benchmark episodes' `train_batch`. The learner
item (`snapshot` / `restore`) holds candidates as bank rows, never a memory's embedding or text.

Keys: `k_init, k_train, k_critic = split(PRNGKey(seed), 3)`; batch `j` uses the replay keys
`split(fold_in(k_train, j), b)`. Not thread-safe: `Learning` holds the memory's lock.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory.sessions import TrainItem
from ear_jax.core import learner as learner_lib
from ear_jax.core.config import EARConfig, HParams
from ear_jax.core.stream import Stream

# The learner step with the state donated (replay buffer and optimizer state updated in place).
train_step = jax.jit(learner_lib.train_batch_on_feedback, static_argnames=("config",),
                      donate_argnums=0)
# The `[b]` replay keys of learner step n, `split(fold_in(k_train, n), b)`, in one call.
_step_keys = jax.jit(lambda key, n, b: jax.random.split(jax.random.fold_in(key, n), b),
                     static_argnums=2)
UNKNOWN = -2  # `Driver.buffer_rows` of a slot whose candidate's bank row is not known yet
MAX_QUESTIONS = 16384  # questions whose held-out part a memory remembers (`Driver.next_held`)


def question_key(question: str) -> int:
  """A question's key for `Driver.next_held`: the first 8 bytes of its text's sha256, int64."""
  return int.from_bytes(hashlib.sha256(question.encode("utf-8")).digest()[:8], "little",
                        signed=True)


def _owned(state):
  """`state` with every leaf in its own buffer (donation needs distinct, JAX-owned buffers)."""
  return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)


def seed_keys(seed: int):
  """`(k_init, k_train, k_critic)` of ONE memory's seed (see the module docstring)."""
  return tuple(jax.random.split(jax.random.PRNGKey(int(seed)), 3))


def mask_item(item: TrainItem, rows: np.ndarray) -> TrainItem:
  """A queued item with the candidates at bank `rows` masked out (mask, slates, labels, row)."""
  hit = np.isin(item.rows, rows) & item.mask
  if not hit.any():
    return item
  in_slate = np.isin(item.slates, np.flatnonzero(hit)) & item.slate_mask
  cands = item.candidates.copy()
  cands[hit] = 0.0
  return item._replace(candidates=cands, mask=item.mask & ~hit,
                       slate_mask=item.slate_mask & ~in_slate,
                       labels=np.where(in_slate, 0.0, item.labels).astype(item.labels.dtype),
                       rows=np.where(hit, -1, item.rows).astype(item.rows.dtype))


class Driver:
  """Queue of closed sessions and the learner state they train (default: fresh from `seed`)."""

  def __init__(self, config: EARConfig, hparams: HParams, seed: int,
               state: Optional[learner_lib.LearnerState] = None):
    self.config, self.hparams = config, hparams
    k_init, self.train_key, _ = seed_keys(seed)
    self.state = _owned(learner_lib.init_learner(k_init, config) if state is None else state)
    self.ready: list[TrainItem] = []
    self.num_batches = 0
    # the bank rows of the replay buffer's candidates, slot by slot (-1 = padding or empty)
    self.buffer_rows = np.full((config.buffer_capacity, config.num_candidates), -1, np.int32)
    if state is not None:  # (rows unknown until `resolve_rows`)
      self.buffer_rows[np.asarray(self.state.buffer.mask)] = UNKNOWN
    self.insert_index = int(self.state.buffer.insert_index)  # host copy
    # the guard's held-out ring: its slots' bank rows, its count, the training sessions opened
    ring = self.state.guard
    self.holdout_rows = None if ring is None else np.full(ring.mask.shape, -1, np.int32)
    self.holdout_count = 0 if ring is None else int(ring.count)
    if ring is not None and state is not None:
      self.holdout_rows[np.asarray(ring.mask)] = UNKNOWN
    self.opened = int(self.state.queries_seen)
    # question key -> held out: a question asked again keeps its part (the newest MAX_QUESTIONS)
    self.questions: "collections.OrderedDict[int, bool]" = collections.OrderedDict()
    self._warming = None  # the thread compiling the learner step (`warm`), until it is joined

  def warm(self, also: Callable) -> None:
    """Compiles the learner step (a masked step on zeros) then runs `also()`, in a background
    thread; `push` defers steps until it is done."""
    def run():
      k_init = seed_keys(0)[0]
      shapes = jax.eval_shape(lambda: learner_lib.init_learner(k_init, self.config))
      zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      b, T, K = self.config.batch_size, self.config.num_rounds, self.config.num_candidates
      width = self.config.dim + self.config.side_features
      item = TrainItem(np.zeros(self.config.dim, np.float32), np.zeros((K, width), np.float32),
                       np.zeros(K, bool), np.full((T, K), -1, np.int32), np.zeros((T, K), bool),
                       np.full((T, K), -1.0, np.float32), np.full(K, -1, np.int32), np.int8(0))
      args, _ = self._step_args([item] * b, np.zeros(b, bool), 0)
      jax.block_until_ready(train_step(zeros, *args))
      also()
    self._warming = threading.Thread(target=run, daemon=True, name="ear-learner-warm")
    self._warming.start()

  def join_warm(self) -> None:
    """Waits for `warm`'s compilation, if one runs (call it without the memory's lock)."""
    warming = self._warming
    if warming is not None:
      warming.join()

  def next_held(self, question: str = "", scope=()) -> int:
    """Whether a training session of `question` in `scope` is held out for the guard: a question
    seen before in the same scopes keeps its part; a new one is held out when it is the
    `config.guard_holdout`-th new one.

    Returns:
      0: trained; 1: held out, its feedback goes to the ring; 2: held out again (not in the ring).
    """
    n = self.config.guard_holdout
    if not n:
      return 0
    key = question_key("\x00".join([*map(str, scope or ()), question])) if question else None
    if key is not None and key in self.questions:
      self.questions.move_to_end(key)
      return 2 if self.questions[key] else 0
    held = self.opened % n == n - 1
    self.opened += 1
    if key is not None:
      self.questions[key] = held
      while len(self.questions) > MAX_QUESTIONS:
        self.questions.popitem(last=False)
    return int(held)

  def push(self, items) -> int:
    """Queues closed sessions and trains every full batch (none while `warm` compiles); returns
    the learner steps taken."""
    self.ready.extend(items)
    if self._warming is not None and self._warming.is_alive():
      return 0
    steps = 0
    while len(self.ready) >= self.config.batch_size:
      self._train()
      steps += 1
    return steps

  def flush(self) -> int:
    """Trains every queued item now (the rest as one masked batch); returns the steps taken."""
    steps = self.push([])
    if self.ready:
      self._train()
      steps += 1
    return steps

  def _step_args(self, items, valid, step: int):
    """`(train_step's arguments after the state, (rows, held, ring))` of `b` items."""
    b = self.config.batch_size
    stacked = TrainItem(*(np.stack(x) for x in zip(*items)))
    batch = Stream(queries=stacked.query, candidates=stacked.candidates, mask=stacked.mask,
                   gold=np.zeros(stacked.mask.shape, bool), num_gold=np.zeros((b,), np.int32))
    keys = _step_keys(self.train_key, step, b)
    code = np.asarray(stacked.held, np.int8).reshape(b)  # (`next_held`: 0 / 1 / 2)
    held, ring = (code > 0) & valid, (code == 1) & valid
    extra = (held, ring) if self.config.guard_holdout else ()  # (else the paper's call)
    rows = np.where(stacked.mask, stacked.rows, -1)
    return (keys, batch, stacked.slates, stacked.slate_mask, stacked.labels, jnp.asarray(valid),
            self.config, self.hparams, *extra), (rows, held, ring)

  def _train(self) -> None:
    """ONE learner step on the first `b` queued items (fewer: the batch padded, masked)."""
    if self._warming is not None:  # (compiling it: the step waits, and is not compiled twice)
      self._warming.join()
      self._warming = None
    b = self.config.batch_size
    items, self.ready = self.ready[:b], self.ready[b:]
    valid = np.arange(b) < len(items)
    items = items + [items[-1]] * (b - len(items))  # (padding: masked out of the step)
    args, (rows, held, ring) = self._step_args(items, valid, self.num_batches)
    self.state, _ = train_step(self.state, *args)
    self.num_batches += 1
    cap = self.config.buffer_capacity  # the step pushed the trained queries in order
    pushed = valid & ~held  # (`push_experiences`: held-out and padding queries are not pushed)
    n = int(pushed.sum())
    self.buffer_rows[(self.insert_index + np.arange(n)) % cap] = rows[pushed]
    self.insert_index = (self.insert_index + n) % cap
    if ring.any():  # ... and the ring's went to the guard's ring (`guard.push_holdout`)
      h = self.holdout_rows.shape[0]
      self.holdout_rows[(self.holdout_count + np.arange(int(ring.sum()))) % h] = rows[ring]
      self.holdout_count += int(ring.sum())

  def forget(self, rows: np.ndarray) -> None:
    """Masks the candidates at bank `rows` out of the queued items, replay buffer and guard ring."""
    self.ready = [mask_item(it, rows) for it in self.ready]
    for slot_rows, _, mask in self._slots():
      hit = np.isin(slot_rows, rows)
      slot_rows[hit] = -1
      mask(hit)

  def _slots(self):
    """`(bank rows, candidates (a thunk), masking method)` of the replay buffer and the ring."""
    out = [(self.buffer_rows, lambda: self.state.buffer.candidates, self._mask_buffer)]
    if self.holdout_rows is not None:
      out.append((self.holdout_rows, lambda: self.state.guard.candidates, self._mask_ring))
    return out

  def _mask_ring(self, hit: np.ndarray) -> None:
    """Clears the held-out ring's candidates where `hit [H, K]`."""
    ring = self.state.guard
    hit = hit & np.asarray(ring.mask)
    if hit.any():
      h = jnp.asarray(hit)
      ring = ring.replace(candidates=jnp.where(h[..., None], 0.0, ring.candidates),
                          mask=ring.mask & ~h, cited=ring.cited & ~h, in_first=ring.in_first & ~h)
      self.state = self.state.replace(guard=ring)

  def _mask_buffer(self, hit: np.ndarray) -> None:
    """Clears the buffer's candidates where `hit [C, K]`."""
    buf = self.state.buffer
    hit = hit & np.asarray(buf.mask)
    if hit.any():
      h = jnp.asarray(hit)
      self.state = self.state.replace(buffer=buf.replace(
          candidates=jnp.where(h[..., None], 0.0, buf.candidates), mask=buf.mask & ~h,
          observed=buf.observed & ~h, ybar=jnp.where(h, 0.0, buf.ybar)))

  # ----------------------------------------------------------------------------------------------
  # the learner item

  def snapshot(self):
    """`(arrays, meta)` host copies of the learner state and queued items (candidates as rows)."""
    d = self.config.dim
    arrays = {"learner": jax.tree_util.tree_map(np.array, _without_candidates(self.state)),
              "hparams": {f.name: np.asarray(getattr(self.hparams, f.name))
                          for f in dataclasses.fields(self.hparams)},
              "buffer_rows": self.buffer_rows.copy(),
              "buffer_features": np.asarray(self.state.buffer.candidates[..., d:])}
    if self.holdout_rows is not None:  # (the ring's candidates likewise: rows and features)
      arrays["holdout_rows"] = self.holdout_rows.copy()
      arrays["holdout_features"] = np.asarray(self.state.guard.candidates[..., d:])
      arrays["questions"] = {"keys": np.asarray(list(self.questions), np.int64).reshape(-1),
                             "held": np.asarray(list(self.questions.values()), bool).reshape(-1)}
    if self.ready:
      arrays["ready"] = {f: np.stack([getattr(it, f) for it in self.ready])
                         for f in TrainItem._fields if f != "candidates"}
      arrays["ready"]["features"] = np.stack([it.candidates[:, d:] for it in self.ready])
    return arrays, {"num_batches": self.num_batches, "num_ready": len(self.ready),
                    "opened": self.opened}

  @classmethod
  def restore(cls, config: EARConfig, seed: int, arrays, meta, where: str, gather: Callable,
              live: Callable) -> "Driver":
    """The driver of `snapshot`; ValueError naming `where` when it does not fit `config`.
    `gather(rows [n, K], mask [n, K]) -> [n, K, d]`; `live(rows) -> bool`: the others are masked."""
    from ear_jax.io import checkpoints  # pylint: disable=g-import-not-at-top
    hparams = HParams(**{k: jnp.asarray(v, jnp.float32) for k, v in arrays["hparams"].items()})
    out = cls(config, hparams, seed)
    abstract = _without_candidates(jax.eval_shape(lambda: out.state))
    learner = dict(arrays["learner"])
    if isinstance(learner.get("guard"), dict) and "holdout" in learner["guard"]:
      learner["guard"] = learner["guard"]["holdout"]  # (saved beside evidence sums no longer kept)
    state = checkpoints.fit_target(abstract, learner, f"{where}: the learner state")
    state = jax.tree_util.tree_map(lambda x, t: jnp.asarray(x, t.dtype), state, abstract)
    rows = np.asarray(arrays["buffer_rows"]).astype(np.int32)
    feats = np.asarray(arrays["buffer_features"], np.float32)
    want = out.state.buffer.candidates.shape
    if rows.shape != want[:2] or feats.shape != want[:2] + (config.side_features,):
      raise ValueError(f"{where}: buffer_rows {rows.shape} / buffer_features {feats.shape} do "
                       f"not fit the replay buffer {want}")
    cands = jnp.concatenate([jnp.asarray(gather(rows, rows >= 0)), jnp.asarray(feats)], -1)
    state = state.replace(buffer=state.buffer.replace(candidates=cands))
    if out.holdout_rows is not None:
      if "holdout_rows" not in arrays:
        raise ValueError(f"{where}: the learner has a held-out ring (guard_holdout) but no "
                         "holdout_rows were saved")
      hrows = np.asarray(arrays["holdout_rows"]).astype(np.int32)
      hfeats = np.asarray(arrays["holdout_features"], np.float32)
      if hrows.shape != out.holdout_rows.shape:
        raise ValueError(f"{where}: holdout_rows {hrows.shape} do not fit the held-out ring "
                         f"{out.holdout_rows.shape}")
      ring = state.guard.replace(candidates=jnp.concatenate(
          [jnp.asarray(gather(hrows, hrows >= 0)), jnp.asarray(hfeats)], -1))
      state = state.replace(guard=ring)
      out.holdout_rows, out.holdout_count = hrows, int(ring.count)
    out.state = _owned(state)
    out.buffer_rows, out.insert_index = rows, int(out.state.buffer.insert_index)
    if meta["num_ready"]:
      r = {k: np.asarray(v) for k, v in arrays["ready"].items()}
      r["candidates"] = np.concatenate(
          [np.asarray(gather(r["rows"], r["rows"] >= 0)), r.pop("features")], -1)
      r.setdefault("held", np.zeros((meta["num_ready"],), np.int8))  # (saved before it existed)
      out.ready = [TrainItem(*(r[f][j] for f in TrainItem._fields))
                   for j in range(meta["num_ready"])]
    out.num_batches = int(meta["num_batches"])
    out.opened = int(meta.get("opened", int(out.state.queries_seen) + len(out.ready)))
    if "questions" in arrays:
      q = arrays["questions"]
      out.questions = collections.OrderedDict(
          zip(np.asarray(q["keys"], np.int64).tolist(), np.asarray(q["held"], bool).tolist()))
    ring_rows = [] if out.holdout_rows is None else [out.holdout_rows.ravel()]
    dead = np.unique(np.concatenate([out.buffer_rows.ravel()] + ring_rows
                                    + [it.rows for it in out.ready]))
    dead = dead[(dead >= 0) & ~live(dead)]
    if dead.size:
      out.forget(dead)
    return out

  def resolve_rows(self, rows_of_embedding: Callable) -> None:
    """Gives `UNKNOWN` slots (buffer, ring) their bank rows by `rows_of_embedding` (-1: masked)."""
    for rows, candidates, mask in self._slots():
      todo = rows == UNKNOWN
      if todo.any():
        rows[todo] = rows_of_embedding(np.asarray(candidates()[..., :self.config.dim])[todo])
        mask(rows < 0)


def _without_candidates(state):
  """`state` with the replay buffer's candidates replaced by an empty `[0]` placeholder."""
  empty = jax.ShapeDtypeStruct if isinstance(state.buffer.candidates, jax.ShapeDtypeStruct) else (
      lambda shape, dtype: np.zeros(shape, dtype))
  state = state.replace(buffer=state.buffer.replace(
      candidates=empty((0,), state.buffer.candidates.dtype)))
  if state.guard is not None:  # (the held-out ring likewise)
    state = state.replace(guard=state.guard.replace(
        candidates=empty((0,), state.guard.candidates.dtype)))
  return state
