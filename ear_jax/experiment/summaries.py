"""JSON-able summaries of experiment runs: mean ± std over seeds, the Recall@K ceiling,
per-category metrics, learning curves, the multi-store diagnostics (Table 5, Fig. 6, Appendix C)
and the library versions a result depends on.

`summarize` turns a `runner.RunResult` into the per-run dict of `result.json` / `results.json`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ear_jax.core import adapter as adapter_lib
from ear_jax.core.config import HParams
from ear_jax.core.stream import Stream
from ear_jax.experiment.runner import METRIC_NAMES, RunResult

# Paging: the critic reads a ranking's top T x s in T pages of s.
PAGING_METRIC_NAMES = ("recall_paging_first_stage", "hitrate_paging_first_stage",
                       "recall_paging_adapted", "hitrate_paging_adapted")
# (per-query field of `RunResult.eval`, per-category metric name), in the order they are written.
_CATEGORY_FIELDS = tuple((f"{mode}_{gold}_gold", f"{metric}_{mode}")
                         for mode in ("adapter", "explorer", "paging_first_stage", "paging_adapted")
                         for metric, gold in (("recall", "all"), ("hitrate", "any")))


def hparams_dict(hparams: HParams) -> dict:
  """The hyperparameters as plain floats (for JSON)."""
  return {f.name: float(np.asarray(getattr(hparams, f.name)))
          for f in dataclasses.fields(hparams)}


def mean_std(values) -> dict:
  """`{"per_seed", "mean", "std"}` (population std over seeds; NaN seeds ignored)."""
  v = np.asarray(values, np.float64).reshape(-1)
  ok = v[np.isfinite(v)]
  return {"per_seed": [None if not np.isfinite(x) else round(float(x), 4) for x in v],
          "mean": round(float(ok.mean()), 4) if ok.size else None,
          "std": round(float(ok.std()), 4) if ok.size else None}


def _masked_pct(values, where):
  values, where = np.asarray(values, np.float64), np.asarray(where, bool)
  return 100.0 * (values * where).sum(-1) / np.maximum(where.sum(-1), 1)


def ceiling(stream: Stream, test_index: np.ndarray, slate_size: int = 5,
            window: Optional[int] = None) -> dict:
  """Best achievable test metrics of any reranker of the K candidates, per seed (percent).

  `recall@K`: all gold inside the top-K; `recall@s`: that and at most `s` gold; `hitrate@K`: any.
  With `window < K` (`T s`) also `recall@window`: all gold inside the first stage's top `window`.
  """
  gold_k = np.asarray(stream.gold)[test_index]
  gold = gold_k.sum(-1)
  ng = np.asarray(stream.num_gold)[test_index]
  has = ng > 0
  out = {"recall@K": mean_std(_masked_pct(gold >= ng, has)),
         f"recall@{slate_size}": mean_std(_masked_pct((gold >= ng) & (ng <= slate_size), has)),
         "hitrate@K": mean_std(_masked_pct(gold > 0, has))}
  if window is not None and window < gold_k.shape[-1]:
    out[f"recall@{window}"] = mean_std(_masked_pct(gold_k[..., :window].sum(-1) >= ng, has))
  return out


def beyond_window(slates: np.ndarray, gold: np.ndarray, window: int) -> dict:
  """Share of a served top-s outside the first stage's top `window` (`T s`), and the gold share
  of those (percent, per seed). `slates [S, M, s]` (-1 = empty), `gold [S, M, K]`."""
  slates = np.asarray(slates)
  valid = slates >= 0
  deep = valid & (slates >= window)
  hit = np.take_along_axis(np.asarray(gold), np.maximum(slates, 0), -1) & deep
  share = 100.0 * deep.sum((-1, -2)) / np.maximum(valid.sum((-1, -2)), 1)
  gold_rate = np.where(deep.sum((-1, -2)) > 0,
                       100.0 * hit.sum((-1, -2)) / np.maximum(deep.sum((-1, -2)), 1), np.nan)
  return {"share": mean_std(share), "gold_rate": mean_std(gold_rate)}


def summarize(result: RunResult, stream: Stream, categories: Optional[np.ndarray] = None,
              slate_size: int = 5) -> dict:
  """JSON-able summary of a run: per-seed and mean ± std test metrics (percent), per category,
  the Recall@K ceiling, critic calls, the learning curve and wall time."""
  ev, window = result.eval, result.config.loss_window
  has = np.asarray(stream.num_gold)[result.test_index] > 0
  out = {"name": result.name, "config": result.config.to_dict(),
         "hparams": hparams_dict(result.hparams), "seeds": result.seeds,
         "num_train": int(result.train_index.shape[1]), "num_test": int(result.test_index.shape[1]),
         "metrics": {m: mean_std(100.0 * np.asarray(ev[m], np.float64))
                     for m in METRIC_NAMES + PAGING_METRIC_NAMES},
         "ceiling": ceiling(stream, result.test_index, slate_size, window),
         "critic_calls": mean_std(result.critic_calls),
         "wall_seconds": round(result.wall_seconds, 2), "resumed_from": result.resumed_from}
  if np.shape(stream.gold)[-1] > window:  # the served top-s beyond the first stage's top T s
    out["beyond_window"] = beyond_window(
        ev["adapter_slates"], np.asarray(stream.gold)[result.test_index], window)
  if categories is not None:
    cats = np.asarray(categories)[result.test_index]  # [S, M]
    per = out["per_category"] = {}
    for c in sorted(set(np.asarray(categories).tolist())):
      sel = (cats == c) & has
      per[c] = {"n": mean_std(sel.sum(-1))}
      for src, m in _CATEGORY_FIELDS:
        per[c][m] = mean_std(np.where(sel.sum(-1) > 0, _masked_pct(ev[src], sel), np.nan))
  if result.curve:
    out["curve"] = result.curve
  return out


def first_crossing(curve: list, metric: str, level: float, x: str = "queries_seen"):
  """Mean-over-seeds x at which `metric` first reaches `level` (None if never)."""
  for p in curve:
    if np.mean(p[metric]) >= level and p["position"] > 0:
      return float(np.mean(p[x]))
  return None


def store_metrics(slates: np.ndarray, gold: np.ndarray, store: np.ndarray,
                  num_gold_store: np.ndarray, where: Optional[np.ndarray] = None) -> dict:
  """Per-store Recall@s and observations in the final slate (Table 5, Fig. 6), in percent.

  `slates [..., M, s]` (-1 = empty), `gold` / `store` `[..., M, K]` (store 0 dialogue, 1
  observation), `num_gold_store [..., M, 2]` gold per store in the whole bank, `where [..., M]`
  queries to average over. Returns `recall_dialogue` / `recall_observation` (over queries with
  gold in that store) and `observations_in_slate` (mean count), each `[...]`.
  """
  slates = np.asarray(slates)
  valid = slates >= 0
  idx = np.maximum(slates, 0)
  g = np.take_along_axis(np.asarray(gold), idx, -1) & valid
  st = np.take_along_axis(np.asarray(store), idx, -1)
  where = np.ones(slates.shape[:-1], bool) if where is None else np.asarray(where, bool)
  out = {}
  for sid, sname in ((0, "dialogue"), (1, "observation")):
    ng = np.asarray(num_gold_store)[..., sid]
    hits = (g & (st == sid)).sum(-1)
    sel = where & (ng > 0)
    out[f"recall_{sname}"] = np.where(sel.sum(-1) > 0, _masked_pct(hits >= ng, sel), np.nan)
  obs = ((st == 1) & valid).sum(-1)
  out["observations_in_slate"] = (obs * where).sum(-1) / np.maximum(where.sum(-1), 1)
  return out


def store_proximity_delta(params: adapter_lib.AdapterParams, queries: jax.Array,
                          candidates: jax.Array, mask: jax.Array, store: jax.Array):
  """Appendix C, Eq. (21)-(23): `Delta(q) = d_e(q) - d_s(q)` before and after the adapter.

  `d_e` / `d_s`: the mean cosine distance of the query to its store-0 / store-1 candidates
  (positive: closer to semantic memories). Inputs are unbatched params, `queries [M, d]`,
  `candidates [M, K, d]`, `mask` / `store` `[M, K]`. Returns `(delta_before [M], delta_after
  [M])`; NaN where a query lacks candidates of one store.
  """
  def delta(q, m):
    sim = jnp.einsum("nd,nkd->nk", q, m)
    out = []
    for sid in (0, 1):
      w = mask & (store == sid)
      d = jnp.sum(jnp.where(w, 1.0 - sim, 0.0), -1) / jnp.maximum(jnp.sum(w, -1), 1)
      out.append(jnp.where(jnp.any(w, -1), d, jnp.nan))
    return out[0] - out[1]

  unit = adapter_lib.safe_normalize
  candidates = adapter_lib.split_candidates(params, candidates)[0]  # embeddings (no side features)
  before = delta(unit(queries), unit(candidates))
  q_t = jax.vmap(lambda q: adapter_lib.adapt_queries(params, q))(queries)
  m_t = jax.vmap(lambda c: adapter_lib.adapt_memories(params, c))(candidates)
  return before, delta(q_t, m_t)


def versions() -> dict:
  """Versions of the libraries a result depends on."""
  import platform  # pylint: disable=g-import-not-at-top
  import flax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import ear_jax  # pylint: disable=g-import-not-at-top
  out = {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__,
         "optax": optax.__version__, "ear_jax": ear_jax.__version__,
         "numpy": np.__version__, "backend": jax.default_backend()}
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    out["orbax_checkpoint"] = ocp.__version__
  except Exception:  # pylint: disable=broad-except
    pass
  # Float rounding can differ between CPU models (XLA targets the host's instruction set).
  out["cpu"] = _cpu_model()
  return out


def _cpu_model() -> str:
  """The CPU model name (Linux `/proc/cpuinfo`), else `platform.processor()` / machine."""
  import platform  # pylint: disable=g-import-not-at-top
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine() or "unknown"
