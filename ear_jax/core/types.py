"""The plug-in points of EAR, written as types in one place (as mctx's `base.py` does).

Symbols: `K` candidates, `s` slate size, `R` slates per training query, `C` buffer capacity,
`d` dimension, `n` queries, `M` bank rows.

Behaviour is passed in, not switched on strings inside the core. Each plug-in point below is a
`Callable` whose registry (name -> function, for the command line and for `EARConfig`'s string
fields) sits beside the functions that implement it:

| plug-in | signature | registry |
|---|---|---|
| critic | `Critic` | `ear_jax.core.critic.CRITICS` |
| training-slate policy | `TrainSlatePolicy` | `ear_jax.core.policies.TRAIN_SLATES` |
| replay strategy | `ReplayStrategy` | `ear_jax.core.buffer.REPLAY_STRATEGIES` |
| optimizer | `Optimizer` (an optax alias) | `ear_jax.core.config.OPTIMIZERS` |
| candidate generator | `CandidateGenerator` | `ear_jax.data.first_stage.GENERATORS` |

This module imports nothing from `ear_jax`, so every module may import it.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import jax


class SlateView(NamedTuple):
  """What a critic sees of one shown slate (unbatched).

  Jitted critics read the array fields; host critics (LLMs) read `query_text` and `texts`. The
  answer-grounded critic reads `answer_support`.
  """
  query: jax.Array  # [d] float32, pre-adapter query embedding
  slate: jax.Array  # [s] int32 candidate positions (-1 = empty position)
  slate_mask: jax.Array  # [s] bool, positions holding a memory
  memories: jax.Array  # [s, d] float32 pre-adapter embeddings of the slate's memories (0 if empty)
  gold: jax.Array  # [s] bool, gold flags where known (simulated critics); False otherwise
  query_text: Optional[str] = None  # host critics only
  texts: Optional[Sequence[str]] = None  # host critics only: the memories' texts, in slate order
  ids: Optional[Sequence[str]] = None  # host critics only: the memories' ids, in slate order
  # [s, A] float32 answer-support features of the slate's memories (0 if empty), or None when the
  # stream carries none (`Stream.answer_support`, `ear_jax.core.critic.ANSWER_FEATURES`).
  answer_support: Optional[jax.Array] = None


# critic(key, view) -> labels [s] float32 in {-1, +1} (None from a host critic = unusable reply).
# A jitted critic is a pytree that owns its parameters (`ear_jax.core.critic`).
Critic = Callable[[jax.Array, SlateView], Optional[jax.Array]]

# The critic of one query as the slate policies and the Explorer see it:
# feedback(key, slate [s] int32, slate_mask [s] bool) -> labels [s] float32.
SlateFeedback = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

# policy(key, relevance [K], gram_fn () -> [K, K], where [K], feedback, config, hparams)
#   -> (slates [R, s] int32, slate_mask [R, s] bool, labels [R, s] float32).
# `config` is an `EARConfig`, `hparams` an `HParams`; the key is consumed.
TrainSlatePolicy = Callable[
    [jax.Array, jax.Array, Callable[[], jax.Array], jax.Array, SlateFeedback, Any, Any],
    Tuple[jax.Array, jax.Array, jax.Array]]

# strategy(key, buffer: ReplayBuffer, query [d]) -> scores [C]; the top-B valid slots are replayed
# (Eq. (15), Table 7); the key is consumed.
ReplayStrategy = Callable[[jax.Array, Any, jax.Array], jax.Array]

# An optax alias: learning_rate -> optax.GradientTransformation.
Optimizer = Callable[[Any], Any]

# generator(scores: first_stage.BankScores, k, options: first_stage.FirstStageOptions)
#   -> (rows [q, k] int32, scores [q, k] float32), jittable with `k` and `options` static.
CandidateGenerator = Callable[[Any, int, Any], Tuple[Any, Any]]
