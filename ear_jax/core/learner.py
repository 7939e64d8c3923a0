"""Assimilating Reflection and whole online episodes (Alg. 1, Alg. 3, Eq. (17)-(18), Appendix A.1).

Symbols: `N` training queries, `b` batch size, `K` candidates, `s` slate size, `R` slates per
training query (`T` for the Explorer, 1 for the single-slate methods), `B` replayed experiences,
`d` dimension.

A batch of `b` queries is processed together (`vmap`) against the adapter and buffer as they stood at
the batch's start; their losses are averaged into one gradient and one optimizer step; then their
experiences are pushed into the buffer. With `b = 1` this is exactly Algorithm 1. A whole episode is
ONE `jax.lax.scan` over batches under `jit`; per-query keys are split up front.

One loss, `query_loss(params, query, candidates, where, feedback, replay, config, hparams)`, takes a
query's `Feedback` (slates, mask, labels) and its gathered `Replay`. One learner step for every
caller: `train_batch_on_feedback` takes the slates and labels of a batch (wherever they came from),
vmaps `query_loss` and does the gradient step and the push. `train_batch` (the scanned
episodes) first collects them with a jitted critic (`collect_feedback`), `ear_jax.agent.Memory` and
the LLM episode collect them on the host.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import flax
import jax
import jax.numpy as jnp
import optax

from ear_jax.core import adapter as adapter_lib
from ear_jax.core import buffer as buffer_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import guard as guard_lib
from ear_jax.core import losses
from ear_jax.core import policies
from ear_jax.core import retrieval
from ear_jax.core.config import EARConfig, HParams, optimizer_fn
from ear_jax.core.critic import Critic
from ear_jax.core.slates import gather_slate
from ear_jax.core.stream import Stream


@flax.struct.dataclass
class LearnerState:
  """Everything an online EAR learner carries from one batch to the next."""
  params: adapter_lib.AdapterParams  # {W_q, W_m}, Eq. (3)
  opt_state: Any  # optax state of `make_optimizer(config)`
  buffer: buffer_lib.ReplayBuffer  # Experience Buffer, Eq. (13)-(14)
  step: jax.Array  # [] int32, optimizer steps taken
  queries_seen: jax.Array  # [] int32, training queries processed
  critic_calls: jax.Array  # [] int32, critic calls spent in training
  # The guard's held-out ring (`config.guard_holdout`, `ear_jax.core.guard`); None when it is off.
  guard: Optional[guard_lib.GuardState] = None


class QueryRecord(NamedTuple):
  """Per-training-query record (stacked to `[N, ...]` by `train_stream`)."""
  slates: jax.Array  # [R, s] int32 (-1 = empty position)
  slate_mask: jax.Array  # [R, s] bool
  labels: jax.Array  # [R, s] float32 critic labels
  loss: jax.Array  # [] float32, L_EAR of Eq. (17) (before the update)
  loss_cur: jax.Array  # [] float32, Eq. (10)
  loss_rep: jax.Array  # [] float32, Eq. (16)
  num_replayed: jax.Array  # [] int32, |J_n|


def make_optimizer(config: EARConfig) -> optax.GradientTransformation:
  """`config.optimizer` (an optax alias, Adam by default) with its learning rate injected as state.

  `optax.inject_hyperparams` keeps the learning rate in the optimizer state, where
  `apply_gradients` sets it from `HParams.learning_rate` before every step, so it can be swept with
  `vmap`.
  """
  optimizer = optimizer_fn(config)
  # Only the learning rate is injected (the wrapper hides the alias's other arguments). A weak 0.0:
  # `init` stores it in the parameters' float dtype (float32, or float64 for a float64 run), and
  # `apply_gradients` keeps that dtype.
  return optax.inject_hyperparams(lambda learning_rate: optimizer(learning_rate))(
      learning_rate=0.0)


def init_learner(key: jax.Array, config: EARConfig) -> LearnerState:
  """A fresh learner: identity adapter, empty optimizer state and buffer, zero counters.

  Args:
    key: PRNG key of the adapter's init (`adapter.init_adapter`); the key is consumed.
    config: static config.

  Raises:
    ValueError: for a strategy name of `config` that no registry holds.
  """
  policies.train_slate_policy(config.train_slate)  # unknown names fail here, before any step
  buffer_lib.replay_strategy(config.replay_strategy)
  params = adapter_lib.init_adapter(key, config)
  zero = jnp.zeros((), jnp.int32)
  return LearnerState(params=params, opt_state=make_optimizer(config).init(params),
                      buffer=buffer_lib.init_buffer(config), step=zero, queries_seen=zero,
                      critic_calls=zero,
                      guard=guard_lib.init_guard(config) if config.guard else None)


def apply_gradients(state: LearnerState, grads: adapter_lib.AdapterParams, config: EARConfig,
                    hparams: HParams) -> LearnerState:
  """One optax step `phi <- phi - eta * direction(grad)`, Eq. (18), with `eta` from `hparams`.

  `eta` takes the dtype of the learning rate in the optimizer state (the run's float dtype: float32,
  or float64 in a float64 run), so a float64 run's `eta` is never rounded to float32.
  """
  stored = state.opt_state.hyperparams["learning_rate"]
  opt_state = state.opt_state._replace(hyperparams={
      **state.opt_state.hyperparams,
      "learning_rate": jnp.asarray(hparams.learning_rate, stored.dtype)})
  updates, opt_state = make_optimizer(config).update(grads, opt_state, state.params)
  return state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                       step=state.step + 1)


def collect_feedback(key: jax.Array, params: adapter_lib.AdapterParams, query: jax.Array,
                     candidates: jax.Array, where: jax.Array, gold: jax.Array, config: EARConfig,
                     hparams: HParams, critic: Critic,
                     answer_support: Optional[jax.Array] = None,
                     held: Optional[jax.Array] = None):
  """The training slates of one query and the critic's labels, by `config.train_slate`.

  Adapts the candidates (Eq. (3)-(4)) with the parameters at the batch's start and runs the
  training-slate policy (the Explorer's T rounds, Alg. 2, by default), showing each slate to the
  critic through a `SlateView`. Nothing here is differentiated.

  Args:
    key: PRNG key of the query's training slates; the key is consumed.
    params: adapter parameters.
    query: `[d]` pre-adapter query.
    candidates: `[K, d]` pre-adapter candidates.
    where: `[K]` bool, valid candidates.
    gold: `[K]` bool, gold candidates (seen only by simulated critics).
    config: static config.
    hparams: hyperparameters.
    critic: a critic pytree `(key, SlateView) -> labels [s]`.
    answer_support: optional `[K, A]` answer-support features (`Stream.answer_support`), shown
      to the critic in `SlateView.answer_support`.
    held: optional `[]` bool, the query is held out for the guard (`config.guard_holdout`): its
      slates are then T pages of the first stage's ranking (`retrieval.paging_slate`; with
      `K > T s` of it and the adapted one interleaved, `guard.page_relevance`) instead of the
      policy's.

  Returns:
    The query's `Feedback`: `slates [R, s]` int32, `slate_mask [R, s]` bool, `labels [R, s]`.
  """
  params = jax.lax.stop_gradient(params)
  z, m_t = adapter_lib.relevance(params, query, candidates)

  def feedback(k, slate, slate_mask):
    return critic(k, critic_lib.slate_view(query, candidates, gold, slate, slate_mask,
                                           answer_support))

  policy = policies.train_slate_policy(config.train_slate)
  if policy is None:
    raise ValueError("a config without a training-slate policy (train_slate='none') does not train")
  out = Feedback(*policy(key, z, lambda: adapter_lib.gram(m_t), where, feedback, config, hparams))
  if config.guard_holdout and held is not None:
    z_first, _ = adapter_lib.relevance(guard_lib.first_stage_params(config), query, candidates)
    pages = retrieval.paging_slate(jax.random.split(key)[1],
                                   guard_lib.page_relevance(z, z_first, where, config), where,
                                   feedback, config.num_rounds, config.slate_size)
    if out.slates.shape != pages.pages.shape:
      raise ValueError(f"guard_holdout: the training policy's {out.slates.shape[0]} slates and "
                       f"the held-out pages ({config.num_rounds}) differ in number")
    pick = lambda a, b: jnp.where(held, b, a)
    out = Feedback(pick(out.slates, pages.pages), pick(out.slate_mask, pages.page_mask),
                   pick(out.labels, pages.labels))
  return out


class Feedback(NamedTuple):
  """The slates one training query showed the critic and the critic's labels (unbatched).

  Where they came from does not matter: a jitted critic (`collect_feedback`) or the host (an LLM,
  `ear_jax.agent.Memory`).
  """
  slates: jax.Array  # [R, s] int32 (-1 = empty position)
  slate_mask: jax.Array  # [R, s] bool; an all-False row: the critic gave no usable answer
  labels: jax.Array  # [R, s] float32 in {-1, +1}


class Replay(NamedTuple):
  """The replay of one query, selected and gathered before the loss (so outside the gradient)."""
  key: jax.Array  # PRNG key of the replay slates (Eq. (19)), split into one key per experience
  indices: jax.Array  # [B] int32 buffer slots (Eq. (15))
  mask: jax.Array  # [B] bool, slots holding an experience
  experiences: buffer_lib.Experiences  # [B, ...] the gathered experiences


def prepare_replay(key: jax.Array, buffer: buffer_lib.ReplayBuffer, query: jax.Array,
                   config: EARConfig) -> Replay:
  """Selects (Eq. (15), by `config.replay_strategy`) and gathers the B experiences of one query.

  Args:
    key: PRNG key, split into (selection, replay slates); the key is consumed.
    buffer: the buffer as it stood at the batch's start.
    query: `[d]` pre-adapter query.
    config: static config.
  """
  k_select, k_gumbel = jax.random.split(key)
  idx, replay_mask = buffer_lib.select_replay(k_select, buffer, query, config.replay_size,
                                              config.replay_strategy)
  return Replay(key=k_gumbel, indices=idx, mask=replay_mask,
                experiences=buffer_lib.gather_experiences(buffer, idx))


def experience_replay_loss(params: adapter_lib.AdapterParams, replay: Replay, config: EARConfig,
                           hparams: HParams):
  """Replay loss of one query on its gathered experiences, Eq. (16), (19)-(20) (Alg. 3 l. 14-22).

  Re-applies the current adapter to the experiences' pre-adapter embeddings, samples a Gumbel
  top-s slate per experience and applies the ranking loss with the binary replay rewards.

  Args:
    params: current adapter parameters (differentiated).
    replay: the query's `Replay` (`prepare_replay`).
    config: static config.
    hparams: hyperparameters.

  Returns:
    `(loss [], num_replayed [] int32)`.
  """

  def one(k, e):
    z, _ = adapter_lib.relevance(params, e.queries, e.candidates)
    support = losses.loss_support(e.mask, e.observed, config.loss_support, config.loss_window)
    slate, slate_mask = losses.gumbel_top_s(k, z, support, hparams.tau, config.slate_size)
    rewards, counted = losses.replay_rewards(e.ybar, e.observed, config.replay_unobserved)
    r = gather_slate(rewards, slate, slate_mask, -1.0)
    c = gather_slate(counted, slate, slate_mask, False)
    return losses.ranking_loss(z, support, slate[None], slate_mask[None], r[None],
                               hparams.baseline, config.loss_form, count_mask=c[None])

  per_exp = jax.vmap(one)(jax.random.split(replay.key, config.replay_size), replay.experiences)
  return losses.replay_loss(per_exp, replay.mask), jnp.sum(replay.mask).astype(jnp.int32)


def query_loss(params: adapter_lib.AdapterParams, query: jax.Array, candidates: jax.Array,
               where: jax.Array, feedback: Feedback, replay: Optional[Replay], config: EARConfig,
               hparams: HParams):
  """`L_EAR` of one training query whose feedback is known, Eq. (10)-(12), (15)-(17).

  The current loss (Eq. (10)) on the query's slates and labels, the replay loss (Eq. (16)) on its
  gathered experiences, combined (Eq. (17)); also the aggregated feedback (Eq. (11)-(12)) that is
  pushed into the buffer after the step.

  Args:
    params: adapter parameters (differentiated).
    query: `[d]` pre-adapter query.
    candidates: `[K, d]` pre-adapter candidates (`[K, d + F]` with side features).
    where: `[K]` bool, valid candidates.
    feedback: the query's `Feedback` (`[R, s]` slates, mask and labels).
    replay: the query's `Replay` (`prepare_replay`), or None without replay.
    config: static config.
    hparams: hyperparameters.

  Returns:
    `(loss [], (record: QueryRecord, observed [K] bool, ybar [K] float32))`.
  """
  slates, slate_mask, labels = feedback
  z, _ = adapter_lib.relevance(params, query, candidates)
  loss_logits = z / hparams.tau if config.loss_on_tempered_logits else z
  observed, ybar = losses.aggregate_feedback(slates, slate_mask, labels, config.num_candidates)
  support = losses.loss_support(where, observed, config.loss_support, config.loss_window)
  loss_cur = losses.ranking_loss(loss_logits, support, slates, slate_mask, labels,
                                 hparams.baseline, config.loss_form)
  if config.use_replay:
    loss_rep, num_replayed = experience_replay_loss(params, replay, config, hparams)
  else:
    loss_rep, num_replayed = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
  loss = losses.combined_loss(loss_cur, loss_rep, hparams.lambda_rep)
  record = QueryRecord(slates=slates, slate_mask=slate_mask, labels=labels, loss=loss,
                       loss_cur=loss_cur, loss_rep=loss_rep, num_replayed=num_replayed)
  return loss, (record, observed, ybar)


def _batch_replay(keys, buffer, queries, config):
  """The batch's replays, gathered once before the gradient: `(replay [b, ...], buffer)`.

  The returned buffer equals `buffer`; pushing into it (rather than into `buffer`) orders the push
  after the gathers, so the `[C, K, d]` buffer is updated in place (see `buffer.after_reads`).
  """
  if not config.use_replay:
    return None, buffer
  replay = jax.vmap(prepare_replay, in_axes=(0, None, 0, None))(keys, buffer, queries, config)
  return replay, buffer_lib.after_reads(buffer, replay.indices, replay.experiences)


def _step(state, batch_loss, batch, where, config, hparams, buffer, trained=None):
  """Gradient of the batch-mean loss, one optimizer step, then the batch's experiences pushed
  (those of `trained`, default `where`: held-out queries are not)."""
  trained = where if trained is None else trained
  grads, (records, observed, ybar) = jax.grad(batch_loss, has_aux=True)(state.params)
  new_state = apply_gradients(state, grads, config, hparams)
  num = jnp.sum(where).astype(jnp.int32)
  new_state = new_state.replace(
      buffer=buffer_lib.push_experiences(buffer, batch.queries, batch.candidates,
                                         batch.mask, observed, ybar, trained),
      queries_seen=state.queries_seen + num,
      critic_calls=state.critic_calls + jnp.sum(
          jnp.where(where[:, None], jnp.any(records.slate_mask, -1), False)).astype(jnp.int32))
  return new_state, records


def _masked_batch_mean(loss, where):
  return jnp.sum(jnp.where(where, loss, 0.0)) / jnp.maximum(jnp.sum(where), 1)


def train_batch(state: LearnerState, keys: jax.Array, batch: Stream, where: jax.Array,
                config: EARConfig, hparams: HParams, critic: Optional[Critic] = None):
  """One online step on a batch of queries with a jitted critic (Appendix A.1; Alg. 1 lines 1-11):
  the batch's slates and labels (`collect_feedback`, vmapped), then `train_batch_on_feedback`.

  Args:
    state: learner state at the batch's start.
    keys: `[b]` PRNG keys, one per query, each split into (slates, replay); consumed.
    batch: a `Stream` of `b` queries.
    where: `[b]` bool, real (non-padding) queries.
    config: static config.
    hparams: hyperparameters.
    critic: a critic pytree (default: the paper's simulated critic).

  Returns:
    `(new_state, records)` with `QueryRecord` fields stacked to `[b, ...]`.
  """
  critic = critic_lib.or_default(critic)
  k_train, k_replay = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
  held = None
  if config.guard_holdout:  # (stream positions: the learner's count of queries before the batch)
    held = guard_lib.held_out(state.queries_seen, where.shape[0], config) & where
  slates, slate_mask, labels = jax.vmap(
      collect_feedback, in_axes=(0, None, 0, 0, 0, 0, None, None, None, 0, 0))(
          k_train, state.params, batch.queries, batch.candidates, batch.mask, batch.gold, config,
          hparams, critic, batch.answer_support, held)
  return train_batch_on_feedback(state, k_replay, batch, slates, slate_mask, labels, where,
                                 config, hparams, held)


def train_batch_on_feedback(state: LearnerState, keys: jax.Array, batch: Stream,
                            slates: jax.Array, slate_mask: jax.Array, labels: jax.Array,
                            where: jax.Array, config: EARConfig, hparams: HParams,
                            held: Optional[jax.Array] = None, ring: Optional[jax.Array] = None):
  """THE learner step: a batch's slates and labels -> one optimizer step and the batch's pushes.

  The batch's replays are selected and gathered once (Eq. (15)), its losses (Eq. (10)-(17)) are
  vmapped and averaged into one gradient, one optimizer step follows (Eq. (18)), then the batch's
  experiences (Eq. (11)-(14)) are pushed. The slates and labels may come from a jitted critic
  (`train_batch`) or from the host (an LLM critic, `ear_jax.agent.Memory`). With the guard its
  held-out queries go to its ring (`guard.push_holdout`).

  Args:
    state: learner state at the batch's start.
    keys: `[b]` PRNG keys for the replay; consumed.
    batch: a `Stream` of `b` queries (`gold` is not used).
    slates: `[b, R, s]` int32 slates shown to the critic (-1 = empty position).
    slate_mask: `[b, R, s]` bool; a query whose critic gave no usable answer has an all-False row
      and contributes only its replay loss.
    labels: `[b, R, s]` labels in {-1, +1}.
    where: `[b]` bool, real queries.
    config: static config.
    hparams: hyperparameters.
    held: `[b]` bool, the real queries held out for the guard (`config.guard_holdout`; None:
      none): left out of the loss and the replay buffer, pushed to the guard's held-out ring.
    ring: `[b]` bool, which of the held-out queries go to the ring (default: all; `Memory` leaves
      out a held-out question asked again, so the ring's questions stay independent).

  Returns:
    `(new_state, records)` as in `train_batch`.
  """
  # The batch's replays are gathered once, before the gradient; `query_loss` is vmapped over them.
  replay, buffer = _batch_replay(keys, state.buffer, batch.queries, config)
  feedback = Feedback(slates=slates, slate_mask=slate_mask, labels=labels)

  trained = where if held is None else where & ~held

  def batch_loss(params):
    loss, aux = jax.vmap(query_loss, in_axes=(None, 0, 0, 0, 0, 0, None, None))(
        params, batch.queries, batch.candidates, batch.mask, feedback, replay, config, hparams)
    return _masked_batch_mean(loss, trained), aux

  new_state, records = _step(state, batch_loss, batch, where, config, hparams, buffer, trained)
  if config.guard and held is not None:
    new_state = new_state.replace(guard=guard_lib.push_holdout(
        state.guard, guard_lib.first_stage_params(config), batch.queries, batch.candidates,
        batch.mask, slates, slate_mask, labels, (held if ring is None else held & ring) & where,
        config.slate_size))
  return new_state, records
