"""Test-time retrieval (Section 3.6) and evaluation of a test stream in one call.

Symbols: `M` test queries, `K` candidates, `s` slate size, `T` Explorer rounds.

Adapter-only inference takes the top-s of `z`; explorer-assisted inference runs T rounds with the
critic and answers round T's slate (or, with `final_slate='exploit'`, the top-s by bandit mean).
With the guard the served parameters are `served_params`. Paging (beyond the paper) is the
explorer's baseline with the same T critic calls (`retrieval.paging_slate`), scored over the first
stage's ranking and the served one.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax

from ear_jax.core import adapter as adapter_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import explorer as explorer_lib
from ear_jax.core import guard as guard_lib
from ear_jax.core import metrics
from ear_jax.core import retrieval
from ear_jax.core.config import EARConfig, HParams
from ear_jax.core.critic import Critic
from ear_jax.core.stream import Stream


def served_params(state, config: EARConfig, z=None) -> adapter_lib.AdapterParams:
  """The adapter parameters a learner serves at test time (the guard's choice when it is on).

  Args:
    state: a `learner.LearnerState` (anything with `params` and `guard`).
    config: the learner's static config.
    z: optional confidence overriding `config.guard_z` (float or traced scalar).
  """
  return guard_lib.served_params(state.params, state.guard, config, z)


def explorer_slate(key: jax.Array, params: adapter_lib.AdapterParams, query: jax.Array,
                   candidates: jax.Array, where: jax.Array, feedback, config: EARConfig,
                   hparams: HParams) -> explorer_lib.ExplorerOutput:
  """Explorer-assisted inference for one query (Section 3.6): `config.eval_rounds` rounds."""
  return retrieval.explorer_slate(key, params, query, candidates, where, feedback,
                                  config.eval_rounds, config.slate_size, hparams)


def final_slate(out: explorer_lib.ExplorerOutput, relevance: jax.Array, where: jax.Array,
                config: EARConfig):
  """The explorer-assisted answer by `config.final_slate`: `(slate [s], slate_mask [s])`."""
  if config.final_slate == "round_T":
    return out.slates[-1], out.slate_mask[-1]
  return explorer_lib.exploit_slate(out.stats, relevance, where, config.slate_size)


class EvalResult(NamedTuple):
  """Per-query test results in every mode (`[M]` fields) and their means over queries with gold.

  The paging fields come last, so the paper's fields keep their positions.
  """
  adapter_slates: jax.Array  # [M, s] int32
  adapter_all_gold: jax.Array  # [M] bool, every gold memory in the adapter-only slate (Recall@s)
  adapter_any_gold: jax.Array  # [M] bool, some gold memory in it (Hitrate@s)
  explorer_slates: jax.Array  # [M, s] int32 (round T's slate, or the exploit slate)
  explorer_all_gold: jax.Array  # [M] bool, every gold memory in the explorer-assisted slate
  explorer_any_gold: jax.Array  # [M] bool, some gold memory in it
  recall_adapter: jax.Array  # [] Recall@s, adapter-only
  hitrate_adapter: jax.Array  # [] Hitrate@s, adapter-only
  recall_explorer: jax.Array  # [] Recall@s, explorer-assisted
  hitrate_explorer: jax.Array  # [] Hitrate@s, explorer-assisted
  # Paging over the first stage's ranking and over the served one.
  paging_first_stage_slates: jax.Array  # [M, s] int32
  paging_first_stage_all_gold: jax.Array  # [M] bool
  paging_first_stage_any_gold: jax.Array  # [M] bool
  paging_adapted_slates: jax.Array  # [M, s] int32
  paging_adapted_all_gold: jax.Array  # [M] bool
  paging_adapted_any_gold: jax.Array  # [M] bool
  recall_paging_first_stage: jax.Array  # [] Recall@s, paging over the first stage's ranking
  hitrate_paging_first_stage: jax.Array  # [] Hitrate@s, paging over the first stage's ranking
  recall_paging_adapted: jax.Array  # [] Recall@s, paging over the served ranking
  hitrate_paging_adapted: jax.Array  # [] Hitrate@s, paging over the served ranking


def evaluate(key: jax.Array, params: adapter_lib.AdapterParams, stream: Stream,
             config: EARConfig, hparams: HParams, critic: Optional[Critic] = None,
             first_stage: Optional[adapter_lib.AdapterParams] = None) -> EvalResult:
  """Scores a test stream in one vmapped call, in every test-time mode (adapter frozen).

  Query m's key drives its Explorer rounds and both pagings alike (common random numbers).

  Args:
    key: PRNG key for the critic's calls; the key is consumed.
    stream: `M` test queries.
    critic: the critic of explorer-assisted inference and paging (default: the simulated one).
    first_stage: the parameters whose ranking is the first stage's (default: the untrained
      adapter, `guard.first_stage_params`).

  Returns:
    An `EvalResult`; means are over queries with gold (`num_gold > 0`).

  Raises:
    ValueError: when `first_stage` is None and `params`' side-feature weights do not match
      `config.side_features`.
  """
  critic = critic_lib.or_default(critic)
  if first_stage is None:
    f = 0 if params.w_side is None else params.w_side.shape[-1]
    if f != config.side_features:
      raise ValueError(f"evaluate: params have {f} side-feature weights but config.side_features "
                       f"is {config.side_features}; pass the config the adapter was trained with "
                       "(or first_stage=...)")
    first_stage = guard_lib.first_stage_params(config)
  keys = jax.random.split(key, stream.queries.shape[0])
  rounds, s = config.eval_rounds, config.slate_size

  def one(k, q, c, where, gold, num_gold, support):
    a_slate, a_mask, z = retrieval.slate_from_candidates(params, q, c, where, s)  # S_adapter

    def feedback(kk, slate, slate_mask):
      return critic(kk, critic_lib.slate_view(q, c, gold, slate, slate_mask, support))

    def scored(slate, slate_mask):
      hits = metrics.gold_in_slate(gold, slate, slate_mask)
      return slate, metrics.slate_recall(hits, num_gold), metrics.slate_hit(hits)

    out = explorer_slate(k, params, q, c, where, feedback, config, hparams)
    e_slate, e_mask = final_slate(out, z, where, config)
    z_first = adapter_lib.adapter_scores(first_stage, q, c)
    p_first = retrieval.paging_slate(k, z_first, where, feedback, rounds, s)
    p_adapted = retrieval.paging_slate(k, z, where, feedback, rounds, s)
    return (scored(a_slate, a_mask), scored(e_slate, e_mask),
            scored(p_first.slate, p_first.slate_mask),
            scored(p_adapted.slate, p_adapted.slate_mask))

  (a_s, a_r, a_h), (e_s, e_r, e_h), (f_s, f_r, f_h), (p_s, p_r, p_h) = jax.vmap(one)(
      keys, stream.queries, stream.candidates, stream.mask, stream.gold, stream.num_gold,
      stream.answer_support)
  has_gold = stream.num_gold > 0
  mean = lambda v: metrics.masked_mean(v, has_gold)
  return EvalResult(
      adapter_slates=a_s, adapter_all_gold=a_r, adapter_any_gold=a_h, explorer_slates=e_s,
      explorer_all_gold=e_r, explorer_any_gold=e_h,
      recall_adapter=mean(a_r), hitrate_adapter=mean(a_h),
      recall_explorer=mean(e_r), hitrate_explorer=mean(e_h),
      paging_first_stage_slates=f_s, paging_first_stage_all_gold=f_r,
      paging_first_stage_any_gold=f_h, paging_adapted_slates=p_s, paging_adapted_all_gold=p_r,
      paging_adapted_any_gold=p_h,
      recall_paging_first_stage=mean(f_r), hitrate_paging_first_stage=mean(f_h),
      recall_paging_adapted=mean(p_r), hitrate_paging_adapted=mean(p_h))
