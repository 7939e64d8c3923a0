"""Host-side critic loops: one round's slates for a batch of queries, one `Memory` session round,
a training episode with a host critic (`run_critic_episode`), and labels from an agent's answer.

Symbols: `N` queries, `K` candidates, `s` slate size, `T` Explorer rounds, `b` batch size.
Critics follow `ear_jax.core.critic`: `critic(key, view) -> labels [s]` or None (no update).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.agent.memory.checks import InputTypeError
from ear_jax.core import adapter as adapter_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import episode as episode_lib
from ear_jax.core import explorer as explorer_lib
from ear_jax.core import learner as learner_lib
from ear_jax.core import policies
from ear_jax.core import retrieval as retrieval_lib
from ear_jax.core import slates as slates_lib
from ear_jax.core.config import EARConfig, HParams
from ear_jax.core.stream import Stream
from ear_jax.data import answer_support

@functools.partial(jax.jit, static_argnames=("k", "explore"))
def _round_slates(params, queries, candidates, mask, mean, counts, hparams, *, k, explore):
  stats = explorer_lib.BanditStats(mean=mean, counts=counts) if explore else None
  return retrieval_lib.batch_slates(params, queries, candidates, mask, k, hparams, stats)


_update_bandits = jax.jit(jax.vmap(explorer_lib.update_bandit))
_train_step = jax.jit(learner_lib.train_batch_on_feedback, static_argnames=("config",))


def round_slates(params, hparams, queries, candidates, mask, mean, counts, k: int, explore: bool):
  """One round for `n` queries `[n, d]` of candidates `[n, K, d]`, `mask` `[n, K]`: adapter top-k,
  or an Explorer round (Eq. (5)-(8)) by the bandit statistics `mean`, `counts` `[n, K]`.

  Returns:
    `(slate [n, k] int32, slate_mask [n, k] bool, z [n, K] float32)` numpy (`n` padded inside).
  """
  n = queries.shape[0]
  m = 1 << max(n - 1, 0).bit_length()
  pad = lambda a: np.concatenate([a, np.zeros((m - n,) + a.shape[1:], a.dtype)])
  out = _round_slates(params, pad(queries), pad(candidates), pad(mask), pad(mean), pad(counts),
                      hparams, k=k, explore=bool(explore))
  return tuple(np.asarray(x)[:n] for x in out)


def adapted(params, query, candidates, given=None):
  """Traced `(z [K], gram [K, K])` of one query's candidates (Eq. (3)-(4), (6)), or `given`."""
  if given is not None:
    return given
  z, m_t = adapter_lib.relevance(params, query, candidates)
  return z, adapter_lib.gram(m_t)


@functools.partial(jax.jit, static_argnames=("k", "explore"))
def _session_round(params, query, candidates, given, hparams, mask, mean, counts, last, *, k,
                   explore):
  z, gram = adapted(params, query, candidates, given)
  stats = explorer_lib.update_bandit(explorer_lib.BanditStats(mean=mean, counts=counts), *last)
  if explore:
    ucb = explorer_lib.ucb_scores(stats, hparams.alpha)
    slate, slate_mask = explorer_lib.greedy_slate(z, ucb, gram, mask, hparams, k)
  else:
    slate, slate_mask = slates_lib.top_s_slate(z, mask, k)
  # (two host copies instead of five: `[2k]` int32 slate | mask, `[3K]` float32 z | mean | counts)
  packed = (jnp.concatenate([slate, slate_mask.astype(jnp.int32)]),
            jnp.concatenate([z, stats.mean, stats.counts]))
  return packed, (z, gram)


def session_round(params, hparams, query, candidates, mask, mean, counts, last, k: int,
                  explore: bool, given=None):
  """One session round in ONE jitted call: the pending feedback `last` applied (Eq. (9)), then the
  adapter's top-k or an Explorer round (Eq. (5)-(8)); `update_bandits` then `round_slates`.

  Args:
    query, candidates, mask, mean, counts: `[d]`, `[K, d]`, `[K]`, `[K]`, `[K]`.
    last: `(slate, slate_mask, labels)` `[K]` of the feedback not yet in `mean` / `counts`.
    given: an earlier round's `adapted` by the same `params` (None: computed).

  Returns:
    `((slate [k] int32, slate_mask [k] bool, z [K], mean [K], counts [K]) numpy, adapted)`.
  """
  if given is not None:
    params = query = candidates = None
  (ints, floats), adapted_ = _session_round(params, query, candidates, given, hparams, mask, mean,
                                            counts, tuple(last), k=k, explore=bool(explore))
  ints, floats, K = np.asarray(ints), np.asarray(floats), len(mask)
  return (ints[:k], ints[k:].astype(bool), floats[:K], floats[K:2 * K], floats[2 * K:]), adapted_


@functools.partial(jax.jit, static_argnames=("k",))
def _exploit(params, query, candidates, given, mask, mean, counts, last, *, k):
  z, _ = adapted(params, query, candidates, given)
  stats = explorer_lib.update_bandit(explorer_lib.BanditStats(mean=mean, counts=counts), *last)
  slate, slate_mask = explorer_lib.exploit_slate(stats, z, mask, k)
  return slate, slate_mask, z


def exploit(params, query, candidates, mask, mean, counts, last, k: int, given=None):
  """The top-k by bandit mean, ties by relevance, after `last` (as `session_round`); numpy."""
  if given is not None:
    params = query = candidates = None
  return jax.device_get(_exploit(params, query, candidates, given, mask, mean, counts,
                                 tuple(last), k=k))


def no_feedback(num_candidates: int):
  """`last` of `session_round` when there is no feedback to apply: an all-masked round."""
  return (np.full((num_candidates,), -1, np.int32), np.zeros((num_candidates,), bool),
          np.full((num_candidates,), -1.0, np.float32))


def update_bandits(mean, counts, slates, slate_mask, labels):
  """Eq. (9) for `n` queries: `(mean [n, K], counts [n, K])` after the slates' labels (numpy)."""
  stats = _update_bandits(explorer_lib.BanditStats(mean=mean, counts=counts), slates, slate_mask,
                          labels)
  return np.asarray(stats.mean), np.asarray(stats.counts)


def check_labels(labels, k: int, what: str) -> np.ndarray:
  """A critic's `[k]` labels as float32 in {-1, +1}; ValueError naming `what` otherwise."""
  try:
    arr = np.asarray(labels, np.float32)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{what} returned labels that are not a float array: {e}") from None
  if arr.shape != (k,) or not np.all(np.isin(arr, (-1.0, 1.0))):
    raise ValueError(f"{what} must return [{k}] labels in {{-1, +1}} (or None), got shape "
                     f"{arr.shape} with values {np.unique(arr)[:5].tolist()}")
  return arr


_answer_rule = jax.jit(critic_lib.answer_critic)


def check_answer(answer, what: str = "answer") -> str:
  """The agent's answer, checked: a non-empty string (errors name `what`)."""
  if not isinstance(answer, str):
    raise InputTypeError(f"{what} must be a string (the agent's answer to the session's "
                         f"question), got {type(answer).__name__}")
  if not answer.strip():
    raise ValueError(f"{what} is empty: give the agent's answer (or cited ids)")
  return answer


def answer_labels(question: str, answer: str, texts: Sequence[str], memories: np.ndarray,
                  embed: Callable, critic: Optional[critic_lib.AnswerCritic] = None
                  ) -> np.ndarray:
  """`[k]` float32 labels in {-1, +1} of a shown slate from the agent's answer: the benchmarks'
  `AnswerCritic` rule (`critic_lib.answer_critic` of `answer_support.slate_support` features).

  Args:
    texts, memories: `[k]` texts and `[k, d (+ F)]` embeddings of the shown slate.
    embed: `embed(texts) -> [n, d]`, the memories' encoder; critic: None for the defaults.
  """
  critic = critic_lib.make_answer_critic() if critic is None else critic
  support = answer_support.slate_support(question, answer, texts, memories, embed)
  k = support.shape[0]
  m = 1 << max(k - 1, 0).bit_length()  # one compilation per power of two
  padded = np.zeros((m, support.shape[1]), np.float32)
  padded[:k] = support
  y = _answer_rule(padded, np.arange(m) < k, critic.min_overlap, critic.best_min_cosine,
                   critic.min_share, critic.min_cosine)
  return np.asarray(y, np.float32)[:k]


@dataclasses.dataclass(frozen=True)
class AnswerFeedback:
  """A host critic from an agent that only answers: each round `answer_fn(question, texts)`
  answers from the shown texts and `answer_labels` labels the slate (None or '': no update).

  Args:
    answer_fn: `answer_fn(question: str, texts: list[str]) -> str or None`.
    embed: `embed(texts) -> [n, d]` the memories' encoder; None: the memory's own (`bound`).
    critic: an `AnswerCritic` with other thresholds (default `ANSWER_DEFAULTS`).
  """
  answer_fn: Callable
  embed: Optional[Callable] = None
  critic: Optional[critic_lib.AnswerCritic] = None

  def __post_init__(self):
    if not callable(self.answer_fn):
      raise InputTypeError(f"answer_fn must be a function (question, texts) -> answer, got "
                           f"{type(self.answer_fn).__name__}")
    if self.critic is not None and not isinstance(self.critic, critic_lib.AnswerCritic):
      raise InputTypeError(f"critic must be an AnswerCritic (make_answer_critic), got "
                           f"{type(self.critic).__name__}")

  def bound(self, embed: Callable) -> "AnswerFeedback":
    """This critic with `embed` as its encoder, unless it has one."""
    return self if self.embed is not None else dataclasses.replace(self, embed=embed)

  def __call__(self, key, view) -> Optional[np.ndarray]:
    del key
    if self.embed is None:
      raise ValueError("AnswerFeedback has no encoder to embed the answer: use it through "
                       "Memory.recall / llm_feedback (the memory's encoder), or pass "
                       "embed=")
    if view.query_text is None or view.texts is None:
      raise ValueError("AnswerFeedback needs the view's query_text and texts (a host view)")
    answer = self.answer_fn(view.query_text, list(view.texts))
    if answer is None or (isinstance(answer, str) and not answer.strip()):
      return None
    answer = check_answer(answer, "the answer of answer_fn")
    return answer_labels(view.query_text, answer, view.texts, np.asarray(view.memories),
                         self.embed, self.critic)


def run_critic_episode(key: jax.Array, stream: Stream, query_texts: Sequence[str],
                       candidate_texts: np.ndarray, critic, config: EARConfig, hparams: HParams,
                       *, state: Optional[learner_lib.LearnerState] = None, progress=None):
  """Alg. 1 with a host critic (e.g. an `LLMCritic`): per batch of `b` queries, T rounds of
  (Explorer round, Eq. (5)-(8) -> one critic call per query -> Eq. (9)), then one learner step
  (Eq. (10)-(18)). A reply of None leaves that round out. Keys are split as in
  `core.episode.run_episode`, so a simulated critic reproduces it exactly.

  Args:
    key: PRNG key of the episode; the key is consumed.
    stream, query_texts, candidate_texts: `N` queries, their texts, `[N, K]` candidate texts.
    critic: a host critic; config: static config (its `train_slate` the Explorer); hparams.
    state: a learner state to continue from (default: a fresh one from the key).
    progress: optional callable `(queries_done, num_queries)`.

  Returns:
    `(state, stats)` with `stats` counting critic calls, usable / unusable replies and steps.
  """
  if policies.train_slate_policy(config.train_slate) is not policies.explorer_slates:
    raise ValueError("run_critic_episode runs the Explorer: config.train_slate must be 'explorer'")
  episode_lib.validate_stream(stream, config)
  n = stream.num_queries
  if len(query_texts) != n or np.shape(candidate_texts)[:2] != (n, config.num_candidates):
    raise ValueError(f"need {n} query texts and [{n}, {config.num_candidates}] candidate texts, "
                     f"got {len(query_texts)} and {np.shape(candidate_texts)}")
  k_init, keys = episode_lib.episode_keys(key, n)
  if state is None:
    state = learner_lib.init_learner(k_init, config)
  b, T, s, K = config.batch_size, config.num_rounds, config.slate_size, config.num_candidates
  split = jax.vmap(jax.random.split)
  k_slates, k_replay = np.moveaxis(np.asarray(split(keys)), 1, 0)
  round_keys = np.asarray(jax.vmap(lambda k: jax.random.split(k, T))(split(k_slates)[:, 1]))
  host = jax.tree_util.tree_map(np.asarray, stream)
  stats = collections.Counter()
  for start in range(0, n, b):
    rows = np.arange(start, min(start + b, n))
    nb = len(rows)
    idx = np.concatenate([rows, np.full(b - nb, rows[-1])])  # pad the last batch (masked)
    batch = host.take(idx)
    mean, counts = np.zeros((b, K), np.float32), np.zeros((b, K), np.float32)
    slates, slate_mask = np.full((b, T, s), -1, np.int32), np.zeros((b, T, s), bool)
    labels = np.full((b, T, s), -1.0, np.float32)
    for t in range(T):
      sl, sm, _ = round_slates(state.params, hparams, batch.queries, batch.candidates, batch.mask,
                               mean, counts, s, explore=True)
      for i, row in enumerate(rows):
        view = critic_lib.slate_view(batch.queries[i], batch.candidates[i], batch.gold[i], sl[i],
                                     sm[i])._replace(
            query_text=query_texts[row],
            texts=[str(candidate_texts[row][p]) for p in sl[i][sm[i]]])
        got = critic(round_keys[row, t], view)
        stats["critic_calls"] += 1
        if got is None:
          stats["critic_no_update"] += 1
          continue
        stats["critic_ok"] += 1
        lab = check_labels(got, s, "the critic")
        slates[i, t], slate_mask[i, t], labels[i, t] = sl[i], sm[i], np.where(sm[i], lab, -1.0)
      mean, counts = update_bandits(mean, counts, slates[:, t], slate_mask[:, t], labels[:, t])
    state, _ = _train_step(state, k_replay[idx], batch, slates, slate_mask, labels,
                           np.arange(b) < nb, config, hparams)
    stats["learner_steps"] += 1
    stats["queries"] += nb
    if progress is not None:
      progress(int(stats["queries"]), n)
  return state, dict(stats)
