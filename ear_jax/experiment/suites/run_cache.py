"""`Runner`: loads the benchmark(s) once, runs (and memoizes) method runs, writes per-run outputs.

A run is `runner.train_and_evaluate` of one method on all seeds, computed once per process; with
`Options.resume` a matching `runs/<run>/result.json` is loaded instead and interrupted runs continue
from `checkpoints/<run>/`. Per run the workdir gets `runs/<run>/{result.json, train_log.npz,
test_eval.npz, adapter/}`.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import time
from typing import Optional

from absl import logging
import jax
import numpy as np

from ear_jax.core import critic as critic_lib
from ear_jax.core.config import Method
from ear_jax.experiment import runner
from ear_jax.experiment import summaries
from ear_jax.experiment.suites.options import Options
from ear_jax.experiment.suites.paper import fmt
from ear_jax.io import run_checkpoints


def slug(s: str) -> str:
  """A run (or file) name safe as a directory name."""
  return re.sub(r"[^A-Za-z0-9_.=-]+", "_", s)


class Runner:
  """Loads the benchmark(s) once, runs (and caches) method runs, writes the workdir."""

  def __init__(self, opts: Options):
    self.opts = opts
    self.workdir = pathlib.Path(opts.workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    self._benches = {}
    self._answer_benches = {}
    self._splits = {}
    self._memo = {}
    self.summaries = {}  # run name -> summary
    self.tables = {}  # suite -> markdown
    self.plots = []
    self.timings = {}
    self.paired = {}  # suite -> [paired-comparison records] (see `pairing.pair`)
    self.seeds = list(range(opts.seeds))

  def bench(self, multistore: bool = False):
    """The benchmark (loaded and split into per-seed train / test sets once)."""
    if multistore not in self._benches:
      from ear_jax.data import candidates, synthetic  # pylint: disable=g-import-not-at-top
      o = self.opts
      t0 = time.perf_counter()
      common = dict(k=o.k, multistore=multistore, candidates=o.candidates,
                    side_features=o.use_side_features, first_stage_options=o.first_stage_options())
      if o.benchmark == "synthetic":
        ec = synthetic.make_synthetic(seed=0, num_queries=o.synthetic_queries,
                                      dim=o.synthetic_dim, multistore=multistore,
                                      num_banks=max(2, min(25, o.synthetic_queries // 8)))
        b = candidates.build_benchmark(ec, **common)
        b.stats["encoding"] = {"encoder": "synthetic"}
      else:
        b = candidates.load_benchmark(self.benchmark_name(), data_dir=o.data_dir,
                                      encoder=o.encoder, limit=o.limit, cache_dir=o.cache_dir,
                                      progress=o.progress, **common)
      logging.info("benchmark %s%s: %d queries, d=%d, K=%d (%.1f s)", o.benchmark,
                   " (multi-store)" if multistore else "", b.num_queries, b.stream.dim,
                   b.stream.num_candidates, time.perf_counter() - t0)
      self._benches[multistore] = b
      self._splits[multistore] = runner.seed_splits(b.num_queries, self.seeds)
    return self._benches[multistore]

  def refuse_transfer_benchmark(self, suite: str) -> None:
    """Raises ValueError on LongMemEval_S: the transfer benchmark, never tuned on."""
    if self.opts.benchmark == "longmemeval":
      raise ValueError(f"{suite}: LongMemEval_S is the transfer benchmark; this suite tunes on "
                       "LoCoMo only: use --benchmark=locomo")

  def benchmark_name(self) -> str:
    """The options' benchmark as `candidates.load_benchmark` names it (`jsonl:PATH`)."""
    return "jsonl:" + self.opts.jsonl if self.opts.benchmark == "jsonl" else self.opts.benchmark

  def validation_split(self):
    """`(fit [S, N], validation [S, V])` of every seed's training stream (`runner.validation_split`;
    the test split is never in either)."""
    self.bench()
    return runner.validation_split(self._splits[False][0])

  def answer_bench(self, multistore: bool = False):
    """`bench(multistore)` with answer support from the gold answers (same queries and splits)."""
    if multistore not in self._answer_benches:
      from ear_jax.data import answer_support  # pylint: disable=g-import-not-at-top
      t0 = time.perf_counter()
      self._answer_benches[multistore] = answer_support.with_answer_support(
          self.bench(multistore), encoder=self.opts.encoder, cache_dir=self.opts.cache_dir,
          progress=self.opts.progress)
      logging.info("answer support of %d queries (%.1f s)", self.bench(multistore).num_queries,
                   time.perf_counter() - t0)
    return self._answer_benches[multistore]

  def child(self, workdir, **options) -> "Runner":
    """A `Runner` with `options` replaced, its runs under `workdir`, its records (paired
    comparisons, run summaries, plots) going into this one's results.json."""
    sub = Runner(dataclasses.replace(self.opts, workdir=str(workdir), **options))
    sub.paired, sub.summaries, sub.plots = self.paired, self.summaries, self.plots
    return sub

  def method(self, name: str, stream=None, hparams: Optional[dict] = None,
             **config) -> Method:
    """The preset `name` over `stream` (default `bench()`'s) with the options' config and
    hyperparameter overrides, then `config` / `hparams` on top (None values dropped)."""
    stream = self.bench().stream if stream is None else stream
    return runner.build_method(name, dim=stream.dim, num_candidates=stream.num_candidates,
                               hparams={**self.opts.hparam_overrides, **(hparams or {})},
                               side_features=stream.num_side_features or None,
                               **{**self.opts.config_overrides, **config})

  def run(self, method: str, *, multistore: bool = False, config_overrides=None,
          hparam_overrides=None, critic_overrides=None, epochs: int = 1,
          eval_every: Optional[int] = None, label: Optional[str] = None,
          critic: Optional[str] = None) -> dict:
    """Runs `method` on all seeds (or returns the cached result); returns its summary dict.

    `critic`: 'simulated' or 'answer' (default `Options.critic`); a trained method with the
    answer critic runs on `answer_bench` and is named `<method>_..._critic=answer`.
    """
    o = self.opts
    critic_name = critic or o.critic
    if critic_name not in ("simulated", "answer"):
      raise ValueError(f"critic must be 'simulated' or 'answer', got {critic_name!r}")
    b = self.bench(multistore)
    m = self.method(method, b.stream, hparam_overrides, **(config_overrides or {}))
    config, hparams = m.config, m.hparams
    # A method that does not train keeps the simulated critic, so its run is shared.
    answer = critic_name == "answer" and config.trains
    if answer:
      b = self.answer_bench(multistore)
      critic = critic_lib.make_answer_critic()
      critic_json = {"name": "answer", **{k: float(getattr(critic, k))
                                          for k in critic_lib.ANSWER_DEFAULTS}}
    else:
      critic = critic_lib.make_simulated_critic(**{**o.critic_overrides,
                                                   **(critic_overrides or {})})
      critic_json = {"precision": float(critic.precision), "recall": float(critic.recall)}
    if not config.trains:
      epochs = 1
    key = (multistore, method, config, tuple(sorted(summaries.hparams_dict(hparams).items())),
           tuple(sorted(critic_json.items())), epochs, eval_every)
    if key in self._memo:
      return self._memo[key]
    parts = [label or method] + [f"{k}={v}" for k, v in sorted((config_overrides or {}).items())]
    parts += [f"{k}={v}" for k, v in sorted((hparam_overrides or {}).items())]
    parts += [f"critic_{k}={v}" for k, v in sorted((critic_overrides or {}).items())]
    parts += [tag for tag, on in (("critic=answer", answer), ("multistore", multistore),
                                  (f"epochs={epochs}", epochs > 1),
                                  (f"eval={eval_every}", eval_every)) if on]
    run_name = slug("_".join(parts))
    run_dir = self.workdir / "runs" / run_name
    done = run_dir / "result.json"
    if o.resume and done.is_file():
      summary = json.loads(done.read_text())
      if (summary.get("config") == config.to_dict() and summary.get("seeds") == self.seeds
          and summary.get("hparams") == summaries.hparams_dict(hparams)
          and summary.get("critic") == critic_json and summary.get("epochs", 1) == epochs):
        logging.info("%s: finished earlier, loaded %s", run_name, done)
        self._memo[key] = self.summaries[run_name] = summary
        return summary
    ckpt = None
    if o.checkpoint_every and config.trains:
      ckpt_dir = self.workdir / "checkpoints" / run_name
      ckpt = run_checkpoints.RunCheckpointer(ckpt_dir)
      if ckpt.existing_steps() and not o.resume:
        raise ValueError(f"{ckpt_dir} already holds checkpoints: pass --resume to continue that "
                         "run, or choose another --workdir (nothing was overwritten)")
    train_idx, test_idx = self._splits[multistore]
    t0 = time.perf_counter()
    try:
      result = runner.train_and_evaluate(
          run_name, b.stream, train_idx, test_idx, config, hparams, self.seeds, epochs=epochs,
          eval_every=eval_every, checkpoint_every=o.checkpoint_every if ckpt else None,
          checkpointer=ckpt, resume=o.resume, stop_after_chunks=o.stop_after_chunks,
          critic=critic, progress=o.progress)
    finally:
      if ckpt is not None:
        ckpt.close()
    summary = summaries.summarize(result, b.stream, b.categories)
    summary.update(method=method, critic=critic_json, run=run_name, epochs=epochs)
    if multistore:
      summary["multistore"] = self._multistore_extras(b, result)
    self._write_run(run_dir, result, summary)
    logging.info("%s: R@5 adapter %s | explorer %s (%.1f s)", run_name,
                 fmt(summary["metrics"]["recall_adapter"]),
                 fmt(summary["metrics"]["recall_explorer"]), time.perf_counter() - t0)
    self._memo[key] = self.summaries[run_name] = summary
    return summary

  def _write_run(self, run_dir, result, summary) -> None:
    """`runs/<run>/{train_log.npz, test_eval.npz, adapter/, result.json}`; result.json last (it
    marks done); `adapter/` is what `run_checkpoints.restore_adapter` reads."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if result.train_log:
      np.savez_compressed(run_dir / "train_log.npz", train_index=result.train_index,
                          seeds=np.asarray(self.seeds), **result.train_log)
    np.savez_compressed(run_dir / "test_eval.npz", test_index=result.test_index, **result.eval)
    if result.config.trains:
      served = (run_checkpoints.guard_decisions(result.final_state, result.config)
                if result.config.guard else None)  # (restore_adapter serves what the guard does)
      run_checkpoints.save_adapter(run_dir / run_checkpoints.ADAPTER_DIR, result.final_state.params,
                                 config=result.config, hparams=result.hparams, seeds=result.seeds,
                                 position=result.train_index.shape[1], served=served)
    (run_dir / "result.json").write_text(json.dumps(summary, indent=1))

  def _multistore_extras(self, b, result) -> dict:
    """Table 5 / Fig. 6 per category and mode, and the Appendix C diagnostic (all seeds)."""
    ti = result.test_index
    gold = np.asarray(b.stream.gold)[ti]
    store = b.candidate_store[ti]
    ngs = b.num_gold_store[ti]
    cats = b.categories[ti]
    out = {"per_category": {}}
    for mode, slates in (("adapter", result.eval["adapter_slates"]),
                         ("explorer", result.eval["explorer_slates"])):
      per = out["per_category"][mode] = {}
      for c in ["all"] + sorted(set(b.categories.tolist())):
        where = np.ones(cats.shape, bool) if c == "all" else cats == c
        m = summaries.store_metrics(slates, gold, store, ngs, where)
        per[c] = {**{k: summaries.mean_std(v) for k, v in m.items()},
                  "n": summaries.mean_std(where.sum(-1))}
    # Appendix C: Delta before / after the adapter on the test queries vs their candidate stores.
    s_q, s_c, s_m = (np.asarray(x)[ti] for x in (b.stream.queries, b.stream.candidates,
                                                 b.stream.mask))
    params = result.final_state.params
    deltas = [summaries.store_proximity_delta(jax.tree_util.tree_map(lambda x: x[i], params),
                                              s_q[i], s_c[i], s_m[i], store[i])
              for i in range(len(result.seeds))]
    before, after = (np.stack([np.asarray(d[j]) for d in deltas]) for j in (0, 1))  # [S, M]
    # Group queries by where their gold lies among the candidates (LoCoMo has no store labels).
    g_obs = (gold & (store == 1)).sum(-1)
    g_dia = (gold & (store == 0)).sum(-1)
    groups = {"all": np.ones(cats.shape, bool),
              "gold only in dialogue candidates": (g_dia > 0) & (g_obs == 0),
              "gold only in observation candidates": (g_obs > 0) & (g_dia == 0),
              "gold in both": (g_dia > 0) & (g_obs > 0)}
    groups.update({f"category {c}": cats == c for c in sorted(set(b.categories.tolist()))})
    diag = {}
    for gname, sel in groups.items():
      sel = sel & np.isfinite(before) & np.isfinite(after)
      if not sel.any():
        continue
      mb = [float(before[i][sel[i]].mean()) if sel[i].any() else np.nan for i in range(len(sel))]
      ma = [float(after[i][sel[i]].mean()) if sel[i].any() else np.nan for i in range(len(sel))]
      diag[gname] = {"n": summaries.mean_std(sel.sum(-1)), "delta_before": summaries.mean_std(mb),
                     "delta_after": summaries.mean_std(ma)}
    out["appendix_c"] = diag
    return out

  def write_json(self, path, obj, indent: Optional[int] = 1) -> None:
    """`obj` as JSON at `path`, folders created."""
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(json.dumps(obj, indent=indent))

  def plot_path(self, name):
    """`<workdir>/plots/<benchmark>_<name>.png`, registered for results.json."""
    p = self.workdir / "plots" / f"{self.opts.benchmark}_{name}.png"
    self.plots.append(str(p))
    return p

  def paper_key(self):
    """The benchmark's key in `paper.PAPER` (None for synthetic / jsonl data)."""
    return self.opts.benchmark if self.opts.benchmark in ("locomo", "longmemeval") else None

  def num_train(self, multistore: bool = False) -> Optional[int]:
    """Training queries per seed of a loaded benchmark (None before `bench` loaded it)."""
    split = self._splits.get(multistore)
    return None if split is None else split[0].shape[1]

