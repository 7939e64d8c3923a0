"""Test-time retrieval (Section 3.6) and evaluation of a test stream in one call.

Symbols: `M` test queries, `K` candidates, `s` slate size, `T` Explorer rounds.

Adapter-only inference takes the top-s of the adapted logits `z`; explorer-assisted inference runs
T Explorer rounds with the critic (`EARConfig.eval_rounds`) and returns round T's slate (the paper)
or, with `final_slate='exploit'`, the top-s by bandit mean.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from typing import Optional

from ear_jax.core import adapter as adapter_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import explorer as explorer_lib
from ear_jax.core import metrics
from ear_jax.core import retrieval
from ear_jax.core.config import EARConfig, HParams
from ear_jax.core.critic import Critic
from ear_jax.core.stream import Stream


def adapter_only_slate(params: adapter_lib.AdapterParams, query: jax.Array,
                       candidates: jax.Array, where: jax.Array, slate_size: int):
  """`S_adapter = TopS_i z_i^phi` for one query (Section 3.6): `retrieval.slate_from_candidates`.

  Returns:
    `(slate [s] int32, slate_mask [s] bool, logits [K])`.
  """
  return retrieval.slate_from_candidates(params, query, candidates, where, slate_size)


def explorer_slate(key: jax.Array, params: adapter_lib.AdapterParams, query: jax.Array,
                   candidates: jax.Array, where: jax.Array, feedback, config: EARConfig,
                   hparams: HParams) -> explorer_lib.ExplorerOutput:
  """Explorer-assisted inference for one query (Section 3.6): `retrieval.explorer_slate`.

  Returns:
    The `ExplorerOutput` of `config.eval_rounds` rounds (`final_slate` picks the answer).
  """
  return retrieval.explorer_slate(key, params, query, candidates, where, feedback,
                                  config.eval_rounds, config.slate_size, hparams)


def final_slate(out: explorer_lib.ExplorerOutput, relevance: jax.Array, where: jax.Array,
                config: EARConfig):
  """The explorer-assisted answer by `config.final_slate`: round T's slate (the paper) or the
  top-s by bandit mean (`explorer.exploit_slate`). Returns `(slate [s], slate_mask [s])`."""
  if config.final_slate == "round_T":
    return out.slates[-1], out.slate_mask[-1]
  return explorer_lib.exploit_slate(out.stats, relevance, where, config.slate_size)


class EvalResult(NamedTuple):
  """Per-query test results in both inference modes (`[M]` fields, named by what they hold), and
  their means over queries with gold (`[]` fields, named by the metric: `recall_*`, `hitrate_*`)."""
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


def evaluate(key: jax.Array, params: adapter_lib.AdapterParams, stream: Stream,
             config: EARConfig, hparams: HParams, critic: Optional[Critic] = None) -> EvalResult:
  """Scores a test stream in one vmapped call, in both inference modes (adapter frozen).

  Args:
    key: PRNG key for the Explorer's critic calls; the key is consumed.
    params: adapter parameters.
    stream: `M` test queries.
    config: static config.
    hparams: hyperparameters (the Explorer's weights; the critic owns its own parameters).
    critic: the critic used by explorer-assisted inference (default: the paper's simulated
      critic).

  Returns:
    An `EvalResult`; means are over queries with gold (`num_gold > 0`).
  """
  critic = critic_lib.or_default(critic)
  keys = jax.random.split(key, stream.queries.shape[0])

  def one(k, q, c, where, gold, num_gold):
    a_slate, a_mask, z = adapter_only_slate(params, q, c, where, config.slate_size)

    def feedback(kk, slate, slate_mask):
      return critic(kk, critic_lib.slate_view(q, c, gold, slate, slate_mask))

    out = explorer_slate(k, params, q, c, where, feedback, config, hparams)
    e_slate, e_mask = final_slate(out, z, where, config)
    a_hits = metrics.gold_in_slate(gold, a_slate, a_mask)
    e_hits = metrics.gold_in_slate(gold, e_slate, e_mask)
    return (a_slate, metrics.slate_recall(a_hits, num_gold), metrics.slate_hit(a_hits),
            e_slate, metrics.slate_recall(e_hits, num_gold), metrics.slate_hit(e_hits))

  a_s, a_r, a_h, e_s, e_r, e_h = jax.vmap(one)(keys, stream.queries, stream.candidates,
                                               stream.mask, stream.gold, stream.num_gold)
  has_gold = stream.num_gold > 0
  return EvalResult(
      adapter_slates=a_s, adapter_all_gold=a_r, adapter_any_gold=a_h, explorer_slates=e_s,
      explorer_all_gold=e_r, explorer_any_gold=e_h,
      recall_adapter=metrics.masked_mean(a_r, has_gold),
      hitrate_adapter=metrics.masked_mean(a_h, has_gold),
      recall_explorer=metrics.masked_mean(e_r, has_gold),
      hitrate_explorer=metrics.masked_mean(e_h, has_gold))

