"""The critic protocol and the simulated citation critic of Appendix A.2.

Symbols: `s` slate size, `d` dimension.

A critic is a callable `critic(key, view) -> labels`: it sees one shown slate through a
`SlateView` and returns `[s]` float32 labels in {-1, +1} (+1 = cited, -1 at empty positions).
Jitted critics are `flax.struct.dataclass` pytrees owning their parameters as array leaves (a sweep
is a `vmap`; a plain function becomes one with `jax.tree_util.Partial(fn)`). A host-side critic (an
LLM) implements the same call on host arrays and may return None for an unusable reply.

`CRITICS` maps command-line names to constructors.
"""
from __future__ import annotations

from typing import Any, Optional

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core.slates import gather_slate
from ear_jax.core.types import Critic, SlateView  # pylint: disable=unused-import

# The paper's simulated critic (Appendix A.2): precision 0.88, recall 0.86.
DEFAULT_PRECISION = 0.88
DEFAULT_RECALL = 0.86

# The answer-support features of a candidate, in column order (`ear_jax.data.answer_support`).
ANSWER_FEATURES = ("new_words", "new_word_share", "answer_cosine", "question_answer_cosine")
# The answer critic's thresholds: `experiments.critic_eval --critic=answer --subset=validation`.
ANSWER_DEFAULTS = {"min_overlap": 1.0, "best_min_cosine": -float("inf"), "min_share": 0.75,
                   "min_cosine": 0.75}


def slate_view(query: jax.Array, candidates: jax.Array, gold: Optional[jax.Array],
               slate: jax.Array, slate_mask: jax.Array,
               answer_support: Optional[jax.Array] = None) -> SlateView:
  """The `SlateView` of a slate of one query's K candidates.

  Args:
    query: `[d]` pre-adapter query.
    candidates: `[K, d]` pre-adapter candidates.
    gold: `[K]` bool gold flags, or None when unknown (all False).
    slate: `[s]` int32 candidate positions (-1 = empty).
    slate_mask: `[s]` bool.
    answer_support: optional `[K, A]` answer-support features (`Stream.answer_support`).
  """
  gold_s = (jnp.zeros(slate.shape, bool) if gold is None else
            gather_slate(gold, slate, slate_mask, False))
  support = (None if answer_support is None else
             gather_slate(answer_support, slate, slate_mask, 0.0))
  return SlateView(query=query, slate=slate, slate_mask=slate_mask,
                   memories=gather_slate(candidates, slate, slate_mask, 0.0), gold=gold_s,
                   answer_support=support)


def false_positive_rate(num_gold: jax.Array, num_other: jax.Array, precision: jax.Array,
                        recall: jax.Array) -> jax.Array:
  """`p_fp = n r (1 - p) / (u p)`, clipped to [0, 1]; 0 when `n = 0` or `u = 0` (Appendix A.2).

  `n` gold and `u` non-gold items in the slate, `p` target precision, `r` target recall.
  """
  n = jnp.asarray(num_gold, jnp.float32)
  u = jnp.asarray(num_other, jnp.float32)
  rate = n * recall * (1.0 - precision) / (jnp.maximum(u, 1.0) * precision)
  return jnp.where((n > 0) & (u > 0), jnp.clip(rate, 0.0, 1.0), 0.0)


def simulated_critic(key: jax.Array, slate_gold: jax.Array, slate_mask: jax.Array,
                     precision: jax.Array, recall: jax.Array) -> jax.Array:
  """Labels a slate like an LLM citing memories with given precision and recall (Appendix A.2).

  Each gold item is cited with probability `r`, each non-gold item with `p_fp`, from one uniform
  draw per slate position; cited -> +1, else -1 (also at empty positions). The key is consumed;
  `slate_gold`, `slate_mask` are `[s]` bool.

  Returns:
    `[s]` float32 labels in {-1, +1}.
  """
  chex.assert_rank([slate_gold, slate_mask], 1)
  gold = slate_gold & slate_mask
  other = ~slate_gold & slate_mask
  p_fp = false_positive_rate(jnp.sum(gold), jnp.sum(other), precision, recall)
  u = jax.random.uniform(key, slate_mask.shape)
  cited = (gold & (u < recall)) | (other & (u < p_fp))
  return jnp.where(cited, 1.0, -1.0).astype(jnp.float32)


@flax.struct.dataclass
class SimulatedCritic:
  """The simulated critic of Appendix A.2 as a critic pytree (build: `make_simulated_critic`)."""
  precision: jax.Array  # [] float32, p
  recall: jax.Array  # [] float32, r

  def __call__(self, key: jax.Array, view: SlateView) -> jax.Array:
    return simulated_critic(key, view.gold, view.slate_mask, self.precision, self.recall)


def oracle_critic(key: jax.Array, slate_gold: jax.Array, slate_mask: jax.Array) -> jax.Array:
  """A noiseless critic: +1 exactly for gold items (precision = recall = 1). The key is unused."""
  del key
  return jnp.where(slate_gold & slate_mask, 1.0, -1.0).astype(jnp.float32)


@flax.struct.dataclass
class OracleCritic:
  """`oracle_critic` as a critic pytree (no parameters)."""

  def __call__(self, key: jax.Array, view: SlateView) -> jax.Array:
    return oracle_critic(key, view.gold, view.slate_mask)


def answer_critic(support: jax.Array, slate_mask: jax.Array, min_overlap: jax.Array,
                  best_min_cosine: jax.Array, min_share: jax.Array,
                  min_cosine: jax.Array) -> jax.Array:
  """Labels the shown memories the agent's answer draws on (no LLM call, no key).

  The slate's best-supported memory (most new answer words, ties by question-answer cosine) is cited
  when it holds `>= min_overlap` new words or its cosine reaches `best_min_cosine`; any memory is
  cited with at least one new word and a share `>= min_share` of them, or a cosine `>= min_cosine`.
  A threshold of `inf` switches its branch off. `support [s, A]` in `ANSWER_FEATURES` order,
  `slate_mask [s]`, thresholds `[]`.

  Returns:
    `[s]` float32 labels in {-1, +1} (-1 at empty positions).
  """
  chex.assert_rank([support, slate_mask], [2, 1])
  new_words = support[:, ANSWER_FEATURES.index("new_words")]
  share = support[:, ANSWER_FEATURES.index("new_word_share")]
  qa_cos = support[:, ANSWER_FEATURES.index("question_answer_cosine")]
  low = jnp.float32(-jnp.inf)
  most = jnp.max(jnp.where(slate_mask, new_words, low))
  tied = slate_mask & (new_words == most)
  best = tied & (qa_cos == jnp.max(jnp.where(tied, qa_cos, low)))
  cited = ((best & ((new_words >= min_overlap) | (qa_cos >= best_min_cosine)))
           | ((new_words >= 1.0) & (share >= min_share)) | (qa_cos >= min_cosine))
  return jnp.where(cited & slate_mask, 1.0, -1.0).astype(jnp.float32)


@flax.struct.dataclass
class AnswerCritic:
  """`answer_critic` as a critic pytree of threshold leaves (build: `make_answer_critic`)."""
  min_overlap: jax.Array  # [] float32
  best_min_cosine: jax.Array  # [] float32
  min_share: jax.Array  # [] float32
  min_cosine: jax.Array  # [] float32

  def __call__(self, key: jax.Array, view: SlateView) -> jax.Array:
    del key
    if view.answer_support is None:
      raise ValueError("AnswerCritic needs the answer's support of each shown memory: build the "
                       "stream with ear_jax.data.answer_support.with_answer_support (the view's "
                       "answer_support is None)")
    return answer_critic(view.answer_support, view.slate_mask, self.min_overlap,
                         self.best_min_cosine, self.min_share, self.min_cosine)


def make_answer_critic(min_overlap=None, best_min_cosine=None, min_share=None,
                       min_cosine=None) -> AnswerCritic:
  """An `AnswerCritic` (scalars, or arrays for a sweep); None = the default of `ANSWER_DEFAULTS`.

  Raises:
    ValueError: for a NaN threshold or a negative `min_overlap` / `min_share`.
  """
  given = {"min_overlap": min_overlap, "best_min_cosine": best_min_cosine,
           "min_share": min_share, "min_cosine": min_cosine}
  values = {k: ANSWER_DEFAULTS[k] if v is None else v for k, v in given.items()}
  for name, value in values.items():
    v = np.asarray(value, np.float64)
    if np.any(np.isnan(v)) or (name in ("min_overlap", "min_share") and np.any(v < 0)):
      raise ValueError(f"answer critic {name} must be a number (>= 0 for counts and shares; inf "
                       f"switches its branch off), got {value!r}")
  return AnswerCritic(**{k: jnp.asarray(v, jnp.float32) for k, v in values.items()})


def make_simulated_critic(precision=DEFAULT_PRECISION, recall=DEFAULT_RECALL) -> SimulatedCritic:
  """A `SimulatedCritic` (scalars, or arrays for a sweep), both values checked to be in (0, 1]."""
  for name, value in (("precision", precision), ("recall", recall)):
    v = np.asarray(value, np.float64)
    if not np.all((v > 0) & (v <= 1)):
      raise ValueError(f"critic {name} must be in (0, 1], got {value!r}")
  return SimulatedCritic(precision=jnp.asarray(precision, jnp.float32),
                         recall=jnp.asarray(recall, jnp.float32))


def default_critic() -> SimulatedCritic:
  """The paper's simulated critic, p = 0.88, r = 0.86 (Appendix A.2); usable inside `jit`."""
  return make_simulated_critic()


def or_default(critic: Optional[Critic]) -> Critic:
  """`critic`, or the paper's simulated critic (`default_critic()`) when it is None."""
  return default_critic() if critic is None else critic


def stack_critics(critics) -> Any:
  """Stacks critic pytrees of one type along a new leading axis (for `vmap` sweeps)."""
  return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *critics)


# Command-line names -> constructors (keyword arguments are the critic's parameters).
CRITICS = {
    "simulated": make_simulated_critic,
    "oracle": OracleCritic,
    "answer": make_answer_critic,
}
