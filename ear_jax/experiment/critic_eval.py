"""Measuring a critic against gold evidence: the slates a training policy shows, and the critic's
citation precision / recall on them (the quantities of the simulated critic, Appendix A.2).

Symbols: `s` slate size, `T` Explorer rounds, `K` candidates.

Slates: `record_training_slates` runs the training episode's host loop
(`ear_jax.agent.memory.episode.run_critic_episode`: T Explorer rounds per query over the K retrieved
candidates, the learner step after each batch) with the paper's simulated critic and records every
slate shown, with the memory texts and gold flags. `select_slates` keeps, per query, the first
slate holding at least one gold memory (the slates on which precision and recall are defined) and,
separately, the first slate of queries whose slates never hold a gold memory (the simulated critic
cites nothing there; a real one may).

Metrics (`citation_metrics`), over the slates with a usable reply: micro precision
`sum |cited & gold| / sum |cited|` and recall `sum |cited & gold| / sum |gold shown|` on gold
slates, exactly the simulated critic's `p` and `r` (in expectation it cites `n r` gold and
`n r (1-p)/p` other items on a slate with `n` gold); the chance precision of a critic citing at
random (`sum |gold| / sum |shown|`); the precision / recall of a critic citing only each slate's
first memory (position 0: the policy's top pick, gold there most often); the parse rate; the mean number cited on gold-free slates; and
the citation rate per slate position (position bias).

Host-side code; the episode inside is the library's jitted learner step.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ear_jax.agent.memory import episode as episode_lib
from ear_jax.core import critic as critic_lib


class SlateRecord(NamedTuple):
  """One slate shown by the training policy.

  Attributes:
    query: the query's row in the stream the episode ran on.
    round: the Explorer round `t` in `[0, T)`.
    question: the query text.
    texts: the slate's memory texts (non-empty positions, slate order).
    gold: `[len(texts)]` bool, which of them are gold evidence.
  """
  query: int
  round: int
  question: str
  texts: tuple[str, ...]
  gold: tuple[bool, ...]


class _Recorder:
  """A host critic that records each view and answers with `inner` (a jitted critic pytree)."""

  def __init__(self, inner):
    self.inner = inner
    self.views: list[tuple[str, tuple[str, ...], tuple[bool, ...]]] = []

  def __call__(self, key, view):
    gold = np.asarray(view.gold, bool)[np.asarray(view.slate_mask, bool)]
    self.views.append((view.query_text, tuple(view.texts), tuple(bool(g) for g in gold)))
    return np.asarray(self.inner(key, view))


def record_training_slates(key: jax.Array, bench, config, hparams, critic=None) -> list[SlateRecord]:
  """Every slate the Explorer training policy shows on `bench` (one episode, in stream order).

  Args:
    key: the episode's PRNG key.
    bench: an `ear_jax.data.candidates.Benchmark` (texts and gold flags).
    config, hparams: the learner's (the Explorer policy: `train_slate='explorer'`).
    critic: the jitted critic that drives the episode (default: the paper's simulated critic).

  Returns:
    `N * T` records, in the order shown; `query` is the row in `bench`.
  """
  recorder = _Recorder(critic_lib.or_default(critic))
  episode_lib.run_critic_episode(key, bench.stream, bench.query_texts, bench.candidate_texts,
                                 recorder, config, hparams)
  n, b, T = bench.stream.num_queries, config.batch_size, config.num_rounds
  # run_critic_episode's call order: per batch of b queries, T rounds, each over the batch's rows.
  order = [(row, t) for start in range(0, n, b) for t in range(T)
           for row in range(start, min(start + b, n))]
  if len(order) != len(recorder.views):
    raise RuntimeError(f"expected {len(order)} critic calls, recorded {len(recorder.views)}")
  return [SlateRecord(query=row, round=t, question=q, texts=texts, gold=gold)
          for (row, t), (q, texts, gold) in zip(order, recorder.views)]


def select_slates(records: Sequence[SlateRecord]) -> tuple[list[SlateRecord], list[SlateRecord]]:
  """`(gold_slates, gold_free_slates)`: per query, its first slate with a gold memory; and the
  first slate of each query none of whose slates holds one. Both in query order."""
  by_query: dict[int, list[SlateRecord]] = {}
  for r in records:
    by_query.setdefault(r.query, []).append(r)
  gold, free = [], []
  for q in sorted(by_query):
    with_gold = [r for r in by_query[q] if any(r.gold)]
    if with_gold:
      gold.append(with_gold[0])
    else:
      free.append(by_query[q][0])
  return gold, free


def citation_metrics(slates: Sequence[SlateRecord],
                     cited: Sequence[Sequence[int] | None]) -> dict[str, Any]:
  """Precision / recall of citations against gold flags (see the module docstring).

  Args:
    slates: the slates shown.
    cited: per slate, the cited positions, or None for an unusable reply.

  Returns:
    A dict: `slates`, `usable`, `parse_rate`, and over usable slates with gold: `precision`,
    `recall`, `f1`, `chance_precision`, `first_precision` / `first_recall` (a critic citing
    exactly the slate's first memory, the policy's top pick), `cited_per_slate`, `gold_per_slate`;
    over usable slates
    without gold: `gold_free_slates`, `gold_free_cited_per_slate`, `gold_free_any_cited`; and
    `position_cite_rate` (per slate position, over usable slates). NaN where undefined.
  """
  if len(slates) != len(cited):
    raise ValueError(f"{len(slates)} slates but {len(cited)} citation lists")
  tp = n_cited = n_gold = n_shown = n_gold_slates = first_tp = 0
  free_cited, free_any, free_n = 0, 0, 0
  s_max = max((len(r.texts) for r in slates), default=0)
  pos_cited, pos_shown = np.zeros(s_max), np.zeros(s_max)
  usable = 0
  for r, c in zip(slates, cited):
    if c is None:
      continue
    usable += 1
    c = sorted(set(int(i) for i in c))
    gold = np.asarray(r.gold, bool)
    pos_shown[:len(gold)] += 1
    pos_cited[c] += 1
    if gold.any():
      n_gold_slates += 1
      tp += int(gold[c].sum())
      first_tp += int(gold[0])
      n_cited += len(c)
      n_gold += int(gold.sum())
      n_shown += len(gold)
    else:
      free_n += 1
      free_cited += len(c)
      free_any += int(len(c) > 0)
  div = lambda a, b: float(a) / b if b else float("nan")
  p, rec = div(tp, n_cited), div(tp, n_gold)
  return {
      "slates": len(slates), "usable": usable, "parse_rate": div(usable, len(slates)),
      "gold_slates": n_gold_slates, "precision": p, "recall": rec,
      "f1": 2 * p * rec / (p + rec) if p + rec > 0 else float("nan"),
      "chance_precision": div(n_gold, n_shown),
      "first_precision": div(first_tp, n_gold_slates), "first_recall": div(first_tp, n_gold),
      "cited_per_slate": div(n_cited, n_gold_slates),
      "gold_per_slate": div(n_gold, n_gold_slates), "gold_free_slates": free_n,
      "gold_free_cited_per_slate": div(free_cited, free_n),
      "gold_free_any_cited": div(free_any, free_n),
      "position_cite_rate": [div(a, b) for a, b in zip(pos_cited, pos_shown)],
  }


def critique_slates(critic, slates: Sequence[SlateRecord],
                    progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
  """Asks a host critic (`LLMCritic`) about each slate: per slate `{cited, status, cached,
  constrained, raw_text}` (`cited` None for an unusable reply). Never raises on a bad reply."""
  out = []
  for i, r in enumerate(slates):
    result = critic.critique(r.question, list(r.texts))
    out.append({"cited": None if result.cited is None else list(result.cited),
                "status": result.status, "cached": result.cached,
                "constrained": result.constrained, "raw_text": result.raw_text[:500]})
    if progress is not None:
      progress(i + 1, len(slates))
  return out
