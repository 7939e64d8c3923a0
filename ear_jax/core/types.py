"""The plug-in points of EAR, written as types in one place (as mctx's `base.py` does).

Symbols: `K` candidates, `s` slate size, `R` slates per training query, `C` buffer capacity,
`d` dimension. Each registry sits beside the functions that implement it: `critic.CRITICS`,
`policies.TRAIN_SLATES`, `buffer.REPLAY_STRATEGIES`, `config.OPTIMIZERS`,
`ear_jax.data.first_stage.GENERATORS`. This module imports nothing from `ear_jax`.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import jax


class SlateView(NamedTuple):
  """What a critic sees of one shown slate (unbatched); host critics also read the texts."""
  query: jax.Array  # [d] float32, pre-adapter query embedding
  slate: jax.Array  # [s] int32 candidate positions (-1 = empty position)
  slate_mask: jax.Array  # [s] bool, positions holding a memory
  memories: jax.Array  # [s, d] float32 pre-adapter embeddings of the slate's memories (0 if empty)
  gold: jax.Array  # [s] bool, gold flags where known (simulated critics); False otherwise
  query_text: Optional[str] = None  # host critics only
  texts: Optional[Sequence[str]] = None  # host critics only: the memories' texts, in slate order
  ids: Optional[Sequence[str]] = None  # host critics only: the memories' ids, in slate order
  answer_support: Optional[jax.Array] = None  # [s, A] float32 (0 if empty), or None


# critic(key, view) -> labels [s] float32 in {-1, +1} (None from a host critic = unusable reply).
Critic = Callable[[jax.Array, SlateView], Optional[jax.Array]]

# The critic of one query as the slate policies and the Explorer see it:
# feedback(key, slate [s] int32, slate_mask [s] bool) -> labels [s] float32.
SlateFeedback = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

# policy(key, relevance [K], gram_fn () -> [K, K], where [K], feedback, config, hparams)
#   -> (slates [R, s] int32, slate_mask [R, s] bool, labels [R, s] float32).
TrainSlatePolicy = Callable[
    [jax.Array, jax.Array, Callable[[], jax.Array], jax.Array, SlateFeedback, Any, Any],
    Tuple[jax.Array, jax.Array, jax.Array]]

# strategy(key, buffer: ReplayBuffer, query [d]) -> scores [C]; the top-B valid slots are replayed.
ReplayStrategy = Callable[[jax.Array, Any, jax.Array], jax.Array]

# An optax alias: learning_rate -> optax.GradientTransformation.
Optimizer = Callable[[Any], Any]

# generator(scores: first_stage.BankScores, k, options: first_stage.FirstStageOptions)
#   -> (rows [q, k] int32, scores [q, k] float32), jittable with `k` and `options` static.
CandidateGenerator = Callable[[Any, int, Any], Tuple[Any, Any]]
