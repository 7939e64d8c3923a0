"""Measuring the answer-grounded critic against gold evidence: its citation precision / recall on
the slates a training policy shows (the quantities of the simulated critic, Appendix A.2).

Symbols: `s` slate size, `T` Explorer rounds, `K` candidates.

`record_training_slates` records every slate of the training episode's host loop; `select_slates`
keeps per query its first slate holding gold (else its first slate). `citation_metrics` gives
micro precision `sum |cited & gold| / sum |cited|` and recall `sum |cited & gold| / sum |gold
shown|` on gold slates (the simulated critic's `p` and `r`), beside chance and first-position
baselines, the parse rate, citations on gold-free slates and the citation rate per position.
"""
from __future__ import annotations

from collections.abc import Sequence
import functools
import itertools
from typing import Any, NamedTuple

import jax
import numpy as np

from ear_jax.agent.memory import episode as episode_lib
from ear_jax.core import critic as critic_lib


class SlateRecord(NamedTuple):
  """One slate shown by the training policy: `query` (its row in the stream), Explorer `round`
  in `[0, T)`, `question`, the memory `texts` (slate order), `gold` `[len(texts)]` bool and their
  candidate `positions` in `[0, K)`."""
  query: int
  round: int
  question: str
  texts: tuple[str, ...]
  gold: tuple[bool, ...]
  positions: tuple[int, ...] = ()


class _Recorder:
  """A host critic that records each view and answers with `inner` (a jitted critic pytree)."""

  def __init__(self, inner):
    self.inner = inner
    self.views: list[tuple[str, tuple[str, ...], tuple[bool, ...], tuple[int, ...]]] = []

  def __call__(self, key, view):
    shown = np.asarray(view.slate_mask, bool)
    gold = np.asarray(view.gold, bool)[shown]
    self.views.append((view.query_text, tuple(view.texts), tuple(bool(g) for g in gold),
                       tuple(int(p) for p in np.asarray(view.slate)[shown])))
    return np.asarray(self.inner(key, view))


def record_training_slates(key: jax.Array, bench, config, hparams, critic=None) -> list[SlateRecord]:
  """Every slate the Explorer training policy shows on `bench` (one episode, in stream order).

  `bench` is a `candidates.Benchmark` (texts and gold flags), `config` the learner's
  (`train_slate='explorer'`), `critic` the one driving the episode (default: the simulated
  critic). Returns `N * T` records, in the order shown.
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
  return [SlateRecord(query=row, round=t, question=q, texts=texts, gold=gold, positions=pos)
          for (row, t), (q, texts, gold, pos) in zip(order, recorder.views)]


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
    A dict: `slates`, `usable`, `parse_rate`; over usable gold slates `precision`, `recall`, `f1`,
    `chance_precision`, `first_precision` / `first_recall`, `cited_per_slate`, `gold_per_slate`;
    over usable gold-free slates `gold_free_slates`, `gold_free_cited_per_slate`,
    `gold_free_any_cited`; `precision_all_slates`; `position_cite_rate`. NaN where undefined.
  """
  if len(slates) != len(cited):
    raise ValueError(f"{len(slates)} slates but {len(cited)} citation lists")
  tp = n_cited = n_gold = n_shown = n_gold_slates = first_tp = usable = 0
  free_cited = free_any = free_n = 0
  s_max = max((len(r.texts) for r in slates), default=0)
  pos_cited, pos_shown = np.zeros(s_max), np.zeros(s_max)
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
      # Over every usable slate: the precision of the labels the learner gets.
      "precision_all_slates": div(tp, n_cited + free_cited),
      "position_cite_rate": [div(a, b) for a, b in zip(pos_cited, pos_shown)],
  }


@functools.partial(jax.jit, static_argnames=("num_critics",))
def _jitted_labels(critic, keys, queries, candidates, gold, support, slates, slate_mask,
                   num_critics):
  """`[H, n, s]` labels of `H` stacked critics on `n` slates (one key per slate)."""

  def one(c, k, q, cand, g, sup, sl, sm):
    return c(k, critic_lib.slate_view(q, cand, g, sl, sm, sup))

  per_slate = jax.vmap(one, in_axes=(None, 0, 0, 0, 0, 0, 0, 0))
  return jax.vmap(per_slate, in_axes=(0,) + (None,) * 7, axis_size=num_critics)(
      critic, keys, queries, candidates, gold, support, slates, slate_mask)


def jitted_citations(critic, stream, slates: Sequence[SlateRecord], key: jax.Array,
                     slate_size: int, stacked: bool = False) -> list:
  """The citations of a jitted critic (e.g. `AnswerCritic`) on recorded slates.

  Each slate is shown through `critic.slate_view` of its query's row of `stream`, as inside the
  training scan; `key` is split into one key per slate (consumed). With `stacked`, `critic` holds
  `H` critics on a leading axis and `H` lists are returned.

  Returns:
    Per slate, the cited positions (indices into its `texts`).
  """
  if not stacked:
    critic = critic_lib.stack_critics([critic])
  leaves = jax.tree_util.tree_leaves(critic)
  num_critics = int(np.shape(leaves[0])[0]) if leaves else 1
  n = len(slates)
  rows = np.asarray([r.query for r in slates], np.int64)
  sl = np.full((n, slate_size), -1, np.int32)
  for i, r in enumerate(slates):
    if len(r.positions) != len(r.texts):
      raise ValueError(f"slate {i} was recorded without its candidate positions")
    sl[i, :len(r.positions)] = r.positions
  host = jax.tree_util.tree_map(lambda x: np.asarray(x)[rows], stream)
  labels = np.asarray(_jitted_labels(critic, jax.random.split(key, n), host.queries,
                                     host.candidates, host.gold, host.answer_support, sl,
                                     sl >= 0, num_critics))
  out = [[[int(j) for j in np.nonzero(lab[i, :len(r.positions)] > 0)[0]]
          for i, r in enumerate(slates)] for lab in labels]
  return out if stacked else out[0]


# --- the answer-grounded critic ---
# Threshold grid (inf switches a branch off, -inf always cites the best-supported memory) and the
# rule: the highest recall with protocol precision >= `MIN_PRECISION`; ties -> higher precision.
ANSWER_GRID = {"min_overlap": (1.0, 2.0, 3.0, float("inf")),
               "best_min_cosine": (-float("inf"), 0.5, 0.6, float("inf")),
               "min_share": (0.4, 0.5, 0.6, 0.75, float("inf")),
               "min_cosine": (0.7, 0.75, 0.8, float("inf"))}
MIN_PRECISION = 0.8
CHOICE_PRECISION = ("protocol", "precision")  # (metrics part, key) the floor applies to


def answer_grid() -> list[dict]:
  """Every combination of `ANSWER_GRID` as `make_answer_critic` keywords."""
  return [dict(zip(ANSWER_GRID, values)) for values in itertools.product(*ANSWER_GRID.values())]


class SeedSlates(NamedTuple):
  """The slates the training policy showed on one seed's queries (`policy_slates`)."""
  seed: int
  part: Any  # the `Benchmark` restricted to the rows the episode ran on (answer support included)
  records: list  # every SlateRecord shown, in order
  gold: list  # per query, its first slate holding gold (the protocol's slates)
  free: list  # the first slate of each query whose slates never hold gold


def policy_slates(bench, rows, seed: int, config, hparams) -> SeedSlates:
  """Records the Explorer training episode's slates on `bench.take(rows)` (key `PRNGKey(seed)`)."""
  part = bench.take(np.asarray(rows))
  records = record_training_slates(jax.random.PRNGKey(seed), part, config, hparams)
  gold, free = select_slates(records)
  return SeedSlates(seed=seed, part=part, records=records, gold=gold, free=free)


def critic_metrics(critic, seed_slates: Sequence[SeedSlates], slate_size: int,
                   stacked: bool = False) -> list[dict]:
  """Per critic, `{"protocol": ..., "all_slates": ...}` `citation_metrics`, pooled over seeds."""
  critic = critic if stacked else critic_lib.stack_critics([critic])
  shown, every, cited, every_cited = [], [], [], []  # the last two: per seed, [H] citation lists
  for ss in seed_slates:
    key = jax.random.PRNGKey(10_000 + ss.seed)
    cite = lambda slates, k, ss=ss: jitted_citations(critic, ss.part.stream, slates, k,
                                                     slate_size, stacked=True)
    sel = ss.gold + ss.free
    shown += sel
    every += ss.records
    cited.append(cite(sel, key))
    every_cited.append(cite(ss.records, jax.random.fold_in(key, 1)))
  pool = lambda per_seed, i: [c for seed in per_seed for c in seed[i]]  # critic i, every seed
  return [{"protocol": citation_metrics(shown, pool(cited, i)),
           "all_slates": citation_metrics(every, pool(every_cited, i))}
          for i in range(len(cited[0]))]


def choose_answer_thresholds(settings: Sequence[dict], metrics: Sequence[dict],
                             min_precision: float = MIN_PRECISION,
                             precision: tuple = CHOICE_PRECISION) -> dict:
  """The setting with the highest protocol recall whose precision is `>= min_precision` (ties:
  higher precision, then earlier in the grid); None when none is."""
  best, best_key = None, None
  for i, (s, m) in enumerate(zip(settings, metrics)):
    p = m[precision[0]][precision[1]]
    if not p >= min_precision:
      continue
    key = (m["protocol"]["recall"], p, -i)
    if best_key is None or key > best_key:
      best, best_key = {"setting": s, "index": i, "metrics": m}, key
  return best
