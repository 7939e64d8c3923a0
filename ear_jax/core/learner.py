"""Assimilating Reflection and whole online episodes (Alg. 1, Alg. 3, Eq. (17)-(18), Appendix A.1).

Symbols: `N` training queries, `b` batch size, `K` candidates, `s` slate size, `R` slates per
training query (`T` for the Explorer, 1 for the single-slate methods), `B` replayed experiences.

A batch of `b` queries is vmapped against the adapter and buffer as they stood at the batch's
start: one averaged gradient, one optimizer step, then the batch's experiences are pushed.
`train_batch_on_feedback` is the one learner step for every caller (with `b = 1` exactly Alg. 1);
`train_batch` first collects the feedback with a jitted critic.
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
  """`config.optimizer` with its learning rate injected as state (set from `HParams` every step)."""
  optimizer = optimizer_fn(config)
  # A weak 0.0: `init` stores it in the parameters' float dtype, which `apply_gradients` keeps.
  return optax.inject_hyperparams(lambda learning_rate: optimizer(learning_rate))(
      learning_rate=0.0)


def init_learner(key: jax.Array, config: EARConfig) -> LearnerState:
  """A fresh learner: identity adapter, empty optimizer state and buffer, zero counters.

  Args:
    key: PRNG key of the adapter's init; the key is consumed.

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
  """One optax step, Eq. (18), with `eta` from `hparams` in the optimizer state's dtype."""
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

  Args:
    key: PRNG key of the query's training slates; the key is consumed.
    query: `[d]` pre-adapter query; candidates: `[K, d]`; where, gold: `[K]` bool.
    critic: a critic pytree `(key, SlateView) -> labels [s]`.
    answer_support: optional `[K, A]` answer-support features, shown to the critic.
    held: optional `[]` bool, held out for the guard: its slates are pages, not the policy's.

  Returns:
    The query's `Feedback` (`[R, s]` slates, mask and labels), not differentiated.
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
  """The slates one training query showed the critic and the critic's labels (unbatched)."""
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

  The key is consumed; `buffer` is the buffer as it stood at the batch's start.
  """
  k_select, k_gumbel = jax.random.split(key)
  idx, replay_mask = buffer_lib.select_replay(k_select, buffer, query, config.replay_size,
                                              config.replay_strategy)
  return Replay(key=k_gumbel, indices=idx, mask=replay_mask,
                experiences=buffer_lib.gather_experiences(buffer, idx))


def experience_replay_loss(params: adapter_lib.AdapterParams, replay: Replay, config: EARConfig,
                           hparams: HParams):
  """Replay loss of one query under the current adapter, Eq. (16), (19)-(20) (Alg. 3 l. 14-22).

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

  `query [d]`, `candidates [K, d (+ F)]`, `where [K]`; `replay` None without replay.

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


def train_batch(state: LearnerState, keys: jax.Array, batch: Stream, where: jax.Array,
                config: EARConfig, hparams: HParams, critic: Optional[Critic] = None):
  """One online step on a batch with a jitted critic (Alg. 1 lines 1-11).

  Args:
    state: learner state at the batch's start.
    keys: `[b]` PRNG keys, one per query, each split into (slates, replay); consumed.
    batch: a `Stream` of `b` queries; where: `[b]` bool, real (non-padding) queries.
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

  Replays gathered once (Eq. (15)), losses (Eq. (10)-(17)) vmapped and averaged into one gradient,
  one optimizer step (Eq. (18)), then the experiences pushed (Eq. (11)-(14)); with the guard, its
  held-out queries go to its ring instead.

  Args:
    state: learner state at the batch's start.
    keys: `[b]` PRNG keys for the replay; consumed.
    batch: a `Stream` of `b` queries (`gold` is not used).
    slates: `[b, R, s]` int32 slates shown to the critic (-1 = empty position).
    slate_mask: `[b, R, s]` bool; an all-False row (no usable answer) adds only replay loss.
    labels: `[b, R, s]` labels in {-1, +1}.
    where: `[b]` bool, real queries.
    held: `[b]` bool, queries held out for the guard (None: none): not trained on.
    ring: `[b]` bool, which held-out queries go to the guard's ring (default: all).

  Returns:
    `(new_state, records)` as in `train_batch`.
  """
  replay, buffer = None, state.buffer
  if config.use_replay:  # gathered once; `after_reads` orders the push after the gathers
    replay = jax.vmap(prepare_replay, in_axes=(0, None, 0, None))(keys, buffer, batch.queries,
                                                                  config)
    buffer = buffer_lib.after_reads(buffer, replay.indices, replay.experiences)
  feedback = Feedback(slates=slates, slate_mask=slate_mask, labels=labels)
  trained = where if held is None else where & ~held

  def batch_loss(params):
    loss, aux = jax.vmap(query_loss, in_axes=(None, 0, 0, 0, 0, 0, None, None))(
        params, batch.queries, batch.candidates, batch.mask, feedback, replay, config, hparams)
    return jnp.sum(jnp.where(trained, loss, 0.0)) / jnp.maximum(jnp.sum(trained), 1), aux

  grads, (records, observed, ybar) = jax.grad(batch_loss, has_aux=True)(state.params)
  new_state = apply_gradients(state, grads, config, hparams).replace(
      buffer=buffer_lib.push_experiences(buffer, batch.queries, batch.candidates, batch.mask,
                                         observed, ybar, trained),
      queries_seen=state.queries_seen + jnp.sum(where).astype(jnp.int32),
      critic_calls=state.critic_calls + jnp.sum(
          jnp.where(where[:, None], jnp.any(records.slate_mask, -1), False)).astype(jnp.int32))
  if config.guard and held is not None:
    new_state = new_state.replace(guard=guard_lib.push_holdout(
        state.guard, guard_lib.first_stage_params(config), batch.queries, batch.candidates,
        batch.mask, slates, slate_mask, labels, (held if ring is None else held & ring) & where,
        config.slate_size))
  return new_state, records
