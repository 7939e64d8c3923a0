"""Query streams: the fixed-shape arrays that an EAR episode consumes.

Symbols: `N` queries, `K` candidates per query, `d` embedding dimension. Per query: its frozen
embedding, its top-K candidates' (Eq. (1)), a `mask` (small banks padded), a `gold` mask and
`num_gold` over its whole bank (gold outside the top-K are misses). `answer_support` is optional;
None leaves every computation as without the field.
"""
from __future__ import annotations

from typing import Any, Optional

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class Stream:
  """A stream of queries with their top-K candidate sets (numpy or jax arrays)."""
  queries: jax.Array  # [N, d] float32 pre-adapter unit query embeddings
  candidates: jax.Array  # [N, K, d (+ F)] float32 candidate rows [embedding | side features]
  mask: jax.Array  # [N, K] bool, a real memory (0 rows where masked)
  gold: jax.Array  # [N, K] bool, a gold memory of the query
  num_gold: jax.Array  # [N] int32 gold memories in the whole bank (>= gold.sum(-1))
  answer_support: Optional[jax.Array] = None  # [N, K, A] float32 (`critic.ANSWER_FEATURES`)

  @property
  def num_queries(self) -> int:
    return int(self.queries.shape[0])

  @property
  def dim(self) -> int:
    return int(self.queries.shape[-1])

  @property
  def num_side_features(self) -> int:
    """`F`, first-stage side features per candidate row (0: plain embeddings)."""
    return int(self.candidates.shape[-1] - self.queries.shape[-1])

  @property
  def num_candidates(self) -> int:
    return int(self.candidates.shape[-2])

  def take(self, index: Any) -> "Stream":
    """Rows `index` of every field (a slice or an integer index array), on the host."""
    return jax.tree_util.tree_map(lambda x: x[index], self)


def _check(assertion, *args, message: str):
  """Runs a `chex` assertion; a failure is a `ValueError` with `message` (naming the field)."""
  try:
    assertion(*args)
  except AssertionError as e:
    raise ValueError(f"{message} ({str(e).strip()[:200]})") from None


def make_stream(queries, candidates, mask=None, gold=None, num_gold=None,
                features=None, answer_support=None) -> Stream:
  """Builds and validates a `Stream` of numpy arrays from array-likes.

  `queries [N, d]`, `candidates [N, K, d]`; optional `mask`, `gold` `[N, K]` (default all valid,
  no gold), `num_gold [N]` (default `gold.sum(-1)`), `features [N, K, F]` appended to each row,
  `answer_support [N, K, A]`.

  Raises:
    ValueError: naming the field whose shape, dtype or values are wrong.
  """
  queries = np.asarray(queries, np.float32)
  candidates = np.asarray(candidates, np.float32)
  _check(chex.assert_rank, queries, 2, message=f"queries must be [N, d], got shape {queries.shape}")
  _check(chex.assert_rank, candidates, 3,
         message=f"candidates must be [N, K, d], got shape {candidates.shape}")
  n, d = queries.shape
  _check(chex.assert_shape, candidates, (n, None, d),
         message=f"candidates shape {candidates.shape} does not match queries shape "
                 f"{queries.shape}: expected [{n}, K, {d}]")
  k = candidates.shape[1]
  mask = np.ones((n, k), bool) if mask is None else np.asarray(mask, bool)
  gold = np.zeros((n, k), bool) if gold is None else np.asarray(gold, bool)
  for name, arr in (("mask", mask), ("gold", gold)):
    _check(chex.assert_shape, arr, (n, k),
           message=f"{name} must have shape [N, K] = {(n, k)}, got {arr.shape}")
  if np.any(gold & ~mask):
    raise ValueError("gold marks a masked (padding) candidate")
  if num_gold is None:
    num_gold = gold.sum(-1)
  num_gold = np.asarray(num_gold, np.int32)
  _check(chex.assert_shape, num_gold, (n,),
         message=f"num_gold must have shape [N] = {(n,)}, got {num_gold.shape}")
  if np.any(num_gold < gold.sum(-1)):
    raise ValueError("num_gold is smaller than the number of gold candidates for some query")
  for name, arr in (("queries", queries), ("candidates", candidates)):
    _check(chex.assert_tree_all_finite, arr, message=f"{name} contains NaN or Inf")

  def per_candidate(name, x, width):
    """`x [N, K, width]` as float32, checked, 0 at masked candidates."""
    x = np.asarray(x, np.float32)
    _check(chex.assert_shape, x, (n, k, None),
           message=f"{name} must be [N, K, {width}] with [N, K] = {(n, k)}, got {x.shape}")
    _check(chex.assert_tree_all_finite, x, message=f"{name} contains NaN or Inf")
    return np.where(mask[..., None], x, 0.0)

  if features is not None:
    candidates = np.concatenate([candidates, per_candidate("features", features, "F")], -1)
  if answer_support is not None:
    answer_support = per_candidate("answer_support", answer_support, "A").astype(np.float32)
  return Stream(queries=queries, candidates=candidates, mask=mask, gold=gold, num_gold=num_gold,
                answer_support=answer_support)


def to_device(stream: Stream) -> Stream:
  """The stream's fields as `jax.Array`s."""
  return jax.tree_util.tree_map(jnp.asarray, stream)
