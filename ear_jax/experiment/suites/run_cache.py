"""`Runner`: loads the benchmark(s) once, runs (and memoizes) method runs, writes per-run outputs.

A run is `runner.train_and_evaluate` of one method on all seeds, computed once per process; with
`Options.resume` a matching `runs/<run>/result.json` is loaded instead and interrupted runs continue
from `checkpoints/<run>/`. Per run the workdir gets `runs/<run>/{result.json, train_log.npz,
test_eval.npz, adapter/}`. In multi-process runs only process 0 writes, and nothing is
checkpointed.
"""
from __future__ import annotations

import json
import pathlib
import re
import time
from typing import Optional

from absl import logging
import jax
import numpy as np

from ear_jax.core import critic as critic_lib
from ear_jax.experiment import runner
from ear_jax.experiment import sharding
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
    self.writes = sharding.is_primary()  # multi-process: process 0 alone writes the workdir
    # Orbax saves are collectives over every process: multi-process runs are not checkpointed.
    self.checkpoints = bool(opts.checkpoint_every) and jax.process_count() == 1
    if opts.checkpoint_every and not self.checkpoints:
      logging.warning("%d processes: runs are not checkpointed (--checkpoint_every ignored)",
                      jax.process_count())
    if self.writes:
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

  # -- data ---------------------------------------------------------------------------------------
  def bench(self, multistore: bool = False):
    """The benchmark (loaded and split into per-seed train / test sets once)."""
    if multistore not in self._benches:
      o = self.opts
      t0 = time.perf_counter()
      if o.benchmark == "synthetic":
        from ear_jax.data import candidates, synthetic  # pylint: disable=g-import-not-at-top
        ec = synthetic.make_synthetic(seed=0, num_queries=o.synthetic_queries,
                                      dim=o.synthetic_dim, multistore=multistore,
                                      num_banks=max(2, min(25, o.synthetic_queries // 8)))
        b = candidates.build_benchmark(ec, k=o.k, multistore=multistore,
                                       candidates=o.candidates,
                                       side_features=o.use_side_features,
                                       first_stage_options=o.first_stage_options())
        b.stats["encoding"] = {"encoder": "synthetic"}
      else:
        from ear_jax.data import candidates  # pylint: disable=g-import-not-at-top
        name = "jsonl:" + o.jsonl if o.benchmark == "jsonl" else o.benchmark
        b = candidates.load_benchmark(name, data_dir=o.data_dir, encoder=o.encoder, k=o.k,
                                      multistore=multistore, limit=o.limit,
                                      cache_dir=o.cache_dir, progress=o.progress,
                                      candidates=o.candidates,
                                      side_features=o.use_side_features,
                                      first_stage_options=o.first_stage_options())
      logging.info("benchmark %s%s: %d queries, d=%d, K=%d (%.1f s)", o.benchmark,
                   " (multi-store)" if multistore else "", b.num_queries, b.stream.dim,
                   b.stream.num_candidates, time.perf_counter() - t0)
      self._benches[multistore] = b
      self._splits[multistore] = runner.seed_splits(b.num_queries, self.seeds)
    return self._benches[multistore]

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

  # -- one run ------------------------------------------------------------------------------------
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
    cfg_over = {**o.config_overrides, **(config_overrides or {})}
    hp_over = {**o.hparam_overrides, **(hparam_overrides or {})}
    m = runner.build_method(  # the preset with its own hyperparameters
        method, dim=b.stream.dim, num_candidates=b.stream.num_candidates, hparams=hp_over,
        side_features=b.stream.num_side_features or None, **cfg_over)
    config, hparams = m.config, m.hparams
    # A method that does not train keeps the simulated critic, so its run is shared.
    answer = critic_name == "answer" and config.trains
    if answer:
      b = self.answer_bench(multistore)
    critic_over = {**o.critic_overrides, **(critic_overrides or {})}
    if answer:
      critic = critic_lib.make_answer_critic()
      critic_json = {"name": "answer", **{k: float(getattr(critic, k))
                                          for k in critic_lib.ANSWER_DEFAULTS}}
    else:
      critic = critic_lib.make_simulated_critic(**critic_over)
      critic_json = {"precision": float(critic.precision), "recall": float(critic.recall)}
    if not config.trains:
      epochs, eval_every = 1, eval_every
    key = (multistore, method, config, tuple(sorted(summaries.hparams_dict(hparams).items())),
           tuple(sorted(critic_json.items())), epochs, eval_every)
    if key in self._memo:
      return self._memo[key]
    name = label or method
    parts = [name] + [f"{k}={v}" for k, v in sorted((config_overrides or {}).items())]
    parts += [f"{k}={v}" for k, v in sorted((hparam_overrides or {}).items())]
    parts += [f"critic_{k}={v}" for k, v in sorted((critic_overrides or {}).items())]
    if answer:
      parts.append("critic=answer")
    if multistore:
      parts.append("multistore")
    if epochs > 1:
      parts.append(f"epochs={epochs}")
    if eval_every:
      parts.append(f"eval={eval_every}")
    run_name = slug("_".join(parts))
    run_dir = self.workdir / "runs" / run_name
    done = run_dir / "result.json"
    if o.resume and done.is_file():
      with open(done) as f:
        summary = json.load(f)
      if (summary.get("config") == summaries.config_dict(config)
          and summary.get("seeds") == self.seeds
          and summary.get("hparams") == summaries.hparams_dict(hparams)
          and summary.get("critic") == critic_json and summary.get("epochs", 1) == epochs):
        logging.info("%s: finished earlier, loaded %s", run_name, done)
        self._memo[key] = summary
        self.summaries[run_name] = summary
        return summary
    ckpt = None
    if self.checkpoints and config.trains:
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
    summary["method"] = method
    summary["critic"] = critic_json
    summary["run"] = run_name
    summary["epochs"] = epochs
    if multistore:
      summary["multistore"] = self._multistore_extras(b, result)
    if self.writes:
      self._write_run(run_dir, result, summary)
    logging.info("%s: R@5 adapter %s | explorer %s (%.1f s)", run_name,
                 fmt(summary["metrics"]["recall_adapter"]),
                 fmt(summary["metrics"]["recall_explorer"]), time.perf_counter() - t0)
    self._memo[key] = summary
    self.summaries[run_name] = summary
    return summary

  def _write_run(self, run_dir, result, summary) -> None:
    """`runs/<run>/{train_log.npz, test_eval.npz, adapter/, result.json}`; result.json last (it
    marks done); `adapter/` is what `run_checkpoints.restore_adapter` reads."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if result.train_log:
      np.savez_compressed(run_dir / "train_log.npz", train_index=result.train_index,
                          seeds=np.asarray(self.seeds), **result.train_log)
    np.savez_compressed(run_dir / "test_eval.npz", test_index=result.test_index,
                        **{k: v for k, v in result.eval.items()})
    # Orbax saves are collectives over every process (see __init__): multi-process runs keep none.
    if result.config.trains and jax.process_count() == 1:
      served = (run_checkpoints.guard_decisions(result.final_state, result.config)
                if result.config.guard else None)  # (restore_adapter serves what the guard does)
      run_checkpoints.save_adapter(run_dir / run_checkpoints.ADAPTER_DIR, result.final_state.params,
                                 config=result.config, hparams=result.hparams, seeds=result.seeds,
                                 position=result.train_index.shape[1], served=served)
    with open(run_dir / "result.json", "w") as f:
      json.dump(summary, f, indent=1)

  def _multistore_extras(self, b, result) -> dict:
    """Table 5 / Fig. 6 per category and mode, and the Appendix C diagnostic (all seeds)."""
    import jax  # pylint: disable=g-import-not-at-top
    ti = result.test_index
    gold = np.asarray(b.stream.gold)[ti]
    store = b.candidate_store[ti]
    ngs = b.num_gold_store[ti]
    cats = b.categories[ti]
    out = {"per_category": {}}
    for mode, slates in (("adapter", result.eval["adapter_slates"]),
                         ("explorer", result.eval["explorer_slates"])):
      per = {}
      for c in ["all"] + sorted(set(b.categories.tolist())):
        where = np.ones(cats.shape, bool) if c == "all" else cats == c
        m = summaries.store_metrics(slates, gold, store, ngs, where)
        per[c] = {k: summaries.mean_std(v) for k, v in m.items()}
        per[c]["n"] = summaries.mean_std(where.sum(-1))
      out["per_category"][mode] = per
    # Appendix C: Delta before / after the adapter on the test queries vs their candidate stores.
    deltas = {"before": [], "after": []}
    s_q = np.asarray(b.stream.queries)[ti]
    s_c = np.asarray(b.stream.candidates)[ti]
    s_m = np.asarray(b.stream.mask)[ti]
    for i in range(len(result.seeds)):
      params = jax.tree_util.tree_map(lambda x: x[i], result.final_state.params)
      d0, d1 = summaries.store_proximity_delta(params, s_q[i], s_c[i], s_m[i], store[i])
      deltas["before"].append(np.asarray(d0))
      deltas["after"].append(np.asarray(d1))
    before, after = np.stack(deltas["before"]), np.stack(deltas["after"])  # [S, M]
    # Group queries by where their gold lies among the candidates (LoCoMo has no store labels).
    g_obs = (gold & (store == 1)).sum(-1)
    g_dia = (gold & (store == 0)).sum(-1)
    groups = {"all": np.ones(cats.shape, bool),
              "gold only in dialogue candidates": (g_dia > 0) & (g_obs == 0),
              "gold only in observation candidates": (g_obs > 0) & (g_dia == 0),
              "gold in both": (g_dia > 0) & (g_obs > 0)}
    for c in sorted(set(b.categories.tolist())):
      groups[f"category {c}"] = cats == c
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

  # -- output helpers -----------------------------------------------------------------------------
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

