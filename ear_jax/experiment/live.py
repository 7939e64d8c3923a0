"""The live benchmark: a benchmark's questions streamed through `Memory`, beside the jitted runner.

Symbols: `S` seeds, `N` training questions, `M` test questions, `K` candidates, `s` slate size,
`T` Explorer rounds, `d` dimension.

`run_seed` replays one seed of `runner.train_and_evaluate` one question at a time through
`Memory`: the same banks (one `scope` per bank), the same split (`runner.seed_splits`) and the
simulated critic with the runner's per-round keys (`StreamCritic`), so a slate both show gets the
same labels. Given the runner's replay keys the live run equals the runner slate for slate
(`tests/test_live.py`); otherwise the check is the paired difference live - runner over seeds.
Each call is timed without the critic, beside the scan's cost per question plus one dispatch.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Optional, Sequence

from absl import logging
import jax
import numpy as np

from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.agent.memory import driver as memory_driver
from ear_jax.agent.memory import episode as memory_episode
from ear_jax.core import critic as critic_lib
from ear_jax.core import episode
from ear_jax.core import learner as learner_lib
from ear_jax.core.config import Method
from ear_jax.core.stream import Stream
from ear_jax.data import candidates as candidates_lib
from ear_jax.data import corpora
from ear_jax.data import corpus as corpus_lib
from ear_jax.data import synthetic
from ear_jax.experiment import benchmarking
from ear_jax.experiment import runner
from ear_jax.experiment import scale_bench
from ear_jax.experiment import stats

# Test modes: `Memory.search`, recall(learn=False, rule='explorer'), recall(learn=False, 'paging').
MODES = ("adapter", "explorer", "paging_adapted")
# Timed steps (`SeedResult.per_question_ms`).
STEPS = ("train", "search", "recall_test", "recall_paging")
MODE_NAMES = {"adapter": "adapter-only", "explorer": "explorer-assisted",
              "paging_adapted": "paging over the adapted ranking"}


@dataclasses.dataclass
class LiveData:
  """A benchmark as both the runner and `Memory` see it.

  Attributes:
    bench: the runner's `Benchmark` (its stream, candidates, in query order).
    ec: the embedded corpus it was built from (banks, texts, embeddings).
    gold_ids: per benchmark query, the `Memory` ids of its gold dialogue memories (whole bank).
    memory_ids: per bank `g`, the `Memory` ids of its dialogue rows (None for unqueried banks).
    dialogue_rows: per bank, its dialogue rows (indices into `ec.bank_embeddings[g]`).
    bank_id_of: `Memory` id -> the memory's id in its bank (the benchmark's candidate ids).
  """
  bench: candidates_lib.Benchmark
  ec: corpus_lib.EmbeddedCorpus
  gold_ids: list
  memory_ids: list
  dialogue_rows: list
  bank_id_of: dict

  def scope(self, group: int) -> str:
    """The `Memory` scope of bank `group`."""
    return f"{self.bench.name}-{int(group)}"

  def query_text(self, i: int) -> str:
    """Benchmark query `i`'s text (a placeholder for text-less synthetic queries)."""
    return self.bench.query_texts[i] or f"question {self.bench.query_ids[i]}"

  def candidate_bank_ids(self, i: int) -> list:
    """The bank ids of the runner's candidates of benchmark query `i`, in rank order."""
    return [c for c in self.bench.candidate_ids[i] if c]

  def source(self, memory_id: str) -> tuple:
    """`(bank, id in the bank)` of a `Memory` id (bank ids repeat across banks)."""
    return int(memory_id.split(":", 1)[0]), self.bank_id_of[memory_id]


def _memory_ids(bank: corpus_lib.Bank, g: int, rows: np.ndarray) -> list:
  """Memory ids `"<g>:<id>"` of a bank's rows (`"<g>:<id>#<row>"` where the bank repeats an id)."""
  counts = collections.Counter(bank.ids[r] for r in rows)
  return [f"{g}:{bank.ids[r]}" + (f"#{r}" if counts[bank.ids[r]] > 1 else "") for r in rows]


def live_data(ec: corpus_lib.EmbeddedCorpus, *, k: int = candidates_lib.DEFAULT_K) -> LiveData:
  """The runner's benchmark of `ec` (single store, dense candidates) and `Memory`'s ids for it.

  Raises:
    ValueError: when the benchmark's queries cannot be matched with the corpus's.
  """
  bench = candidates_lib.build_benchmark(ec, k=k)
  corpus = ec.corpus
  queried = sorted(set(int(g) for g in bench.group))
  memory_ids, rows_of = [None] * len(corpus.banks), [None] * len(corpus.banks)
  for g in queried:
    bank = corpus.banks[g]
    rows = np.nonzero(bank.stores == corpus_lib.STORE_DIALOGUE)[0]
    rows_of[g], memory_ids[g] = rows, _memory_ids(bank, g, rows)
  # The benchmark keeps the corpus queries with gold among the dialogue turns, in file order.
  keep = [n for n, q in enumerate(corpus.queries)
          if (corpus_lib.gold_mask(corpus.banks[q.group], q.gold)
              & (corpus.banks[q.group].stores == corpus_lib.STORE_DIALOGUE)).any()]
  if len(keep) != bench.num_queries or any(
      corpus.queries[n].id != qid for n, qid in zip(keep, bench.query_ids)):
    raise ValueError("the benchmark's queries do not match the corpus's queries with gold")
  gold_ids = []
  for n in keep:
    q = corpus.queries[n]
    gm = corpus_lib.gold_mask(corpus.banks[q.group], q.gold)[rows_of[q.group]]
    gold_ids.append(frozenset(np.asarray(memory_ids[q.group], object)[gm].tolist()))
  bank_id_of = {m: corpus.banks[g].ids[r] for g in queried
                for m, r in zip(memory_ids[g], rows_of[g])}
  return LiveData(bench=bench, ec=ec, gold_ids=gold_ids, memory_ids=memory_ids,
                  dialogue_rows=rows_of, bank_id_of=bank_id_of)


def load_live_data(benchmark: str, *, data_dir=None, encoder="minilm", cache_dir=None,
                   limit: Optional[int] = None, k: int = candidates_lib.DEFAULT_K,
                   progress: bool = True, synthetic_queries: int = 500,
                   synthetic_dim: int = 32) -> LiveData:
  """`live_data` of 'locomo' / 'longmemeval' (embedding cache) or 'synthetic'."""
  if benchmark == "synthetic":
    ec = synthetic.make_synthetic(seed=0, num_queries=synthetic_queries, dim=synthetic_dim,
                                  num_banks=max(2, min(25, synthetic_queries // 8)))
  else:
    corpus = corpora.load_corpus(benchmark, data_dir=data_dir, limit=limit)
    ec, _ = candidates_lib.embed_corpus(corpus, encoder, cache_dir=cache_dir, progress=progress)
  return live_data(ec, k=k)


def build_memory(data: LiveData, method: Method, seed: int) -> Memory:
  """A `Memory` of `method` holding every queried bank's dialogue turns, one scope per bank."""
  groups = sorted(set(int(g) for g in data.bench.group))
  total = sum(len(data.dialogue_rows[g]) for g in groups)
  mem = Memory(MemoryConfig(encoder=None, config=method.config, hparams=method.hparams, seed=seed,
                            initial_capacity=max(total, 1), max_sessions=64))
  for g in groups:
    bank, rows, ids = data.ec.corpus.banks[g], data.dialogue_rows[g], data.memory_ids[g]
    texts = [(bank.texts[r] if bank.texts and bank.texts[r] else f"memory {i}")
             for r, i in zip(rows, ids)]
    mem.add(texts, ids=ids, embeddings=data.ec.bank_embeddings[g][rows], scope=data.scope(g))
  return mem


def critic_round_keys(seed: int, num_train: int, num_test: int, train_rounds: int,
                      test_rounds: int):
  """The runner's critic keys of one seed: `(train [N, T, 2], test [M, T_test, 2])` uint32.

  Split exactly as `runner.train_and_evaluate`, `learner.train_batch`, `explorer.explore` and
  `inference.evaluate` split theirs.
  """
  episode_key, eval_key = jax.random.split(runner.per_seed_keys([seed])[0])
  _, query_keys = episode.episode_keys(episode_key, num_train)
  split = jax.vmap(jax.random.split)
  k_critic = split(split(query_keys)[:, 0])[:, 1]
  train = jax.vmap(lambda k: jax.random.split(k, train_rounds))(k_critic)
  test = jax.vmap(lambda k: jax.random.split(k, test_rounds))(jax.random.split(eval_key, num_test))
  return np.asarray(train), np.asarray(test)


_simulated = jax.jit(critic_lib.simulated_critic)


class StreamCritic:
  """The simulated critic of Appendix A.2 as a host critic for `Memory.recall`.

  `start(gold_ids, round_keys)` sets the question's gold ids and `[T, 2]` round keys; call t then
  labels the shown slate under `round_keys[t]` (`Memory`'s key is ignored), padded to `s` as the
  runner's slate: the runner's labels for the same slate. `seconds` sums the time inside calls.

  Args:
    critic: the `SimulatedCritic` (precision, recall).
    slate_size: `s`.
  """

  def __init__(self, critic: critic_lib.SimulatedCritic, slate_size: int):
    self.critic, self.slate_size = critic, int(slate_size)
    self.seconds = 0.0
    self._gold, self._keys, self._t = frozenset(), None, 0

  def start(self, gold_ids, round_keys: np.ndarray) -> None:
    self._gold, self._keys, self._t = frozenset(gold_ids), np.asarray(round_keys), 0

  def __call__(self, key, view):
    del key
    t0 = time.perf_counter()
    if self._keys is None or self._t >= len(self._keys):
      raise RuntimeError("StreamCritic: more calls than round keys (call start first)")
    k = len(view.ids)
    s = max(self.slate_size, k)
    gold = np.zeros((s,), bool)
    gold[:k] = [i in self._gold for i in view.ids]
    labels = np.asarray(_simulated(self._keys[self._t], gold, np.arange(s) < k,
                                   self.critic.precision, self.critic.recall))[:k]
    self._t += 1
    self.seconds += time.perf_counter() - t0
    return labels


@dataclasses.dataclass
class SeedResult:
  """One seed streamed through `Memory`.

  Attributes:
    recall, hitrate: mode -> the fraction of test questions with every / some gold memory in the
      slate (Recall@s / Hitrate@s).
    slates: mode -> `[M]` tuples of the returned memory ids.
    seconds: per step of `STEPS` (critic excluded), 'critic' and 'add'.
    per_question_ms: step -> `[N]` or `[M]` ms (critic excluded).
    outside_candidates: shown or returned ids not among the runner's candidates of the question.
    pending: training questions left queued (fewer than `b`).
    bank_bytes: the bytes one exact search reads (the bank's `[C, d]` embeddings).
  """
  seed: int
  recall: dict
  hitrate: dict
  slates: dict
  seconds: dict
  per_question_ms: dict
  outside_candidates: int
  pending: int = 0
  bank_bytes: int = 0


def run_seed(data: LiveData, method: Method, seed: int, train_index: Sequence[int],
             test_index: Sequence[int], critic: Optional[critic_lib.SimulatedCritic] = None, *,
             progress: Optional[Callable[[str], None]] = None) -> SeedResult:
  """Streams one seed's split through a fresh `Memory` (see the module docstring).

  `method` is the runner's (`runner.build_method`); `seed` gives the runner's keys of this seed
  and the `Memory`'s seed; `train_index [N]` / `test_index [M]` are benchmark queries in stream
  order; `progress` takes a line every 500 questions.
  """
  critic = critic or critic_lib.make_simulated_critic()
  config, s = method.config, method.config.slate_size
  train_index, test_index = np.asarray(train_index), np.asarray(test_index)
  t0 = time.perf_counter()
  mem = build_memory(data, method, seed)
  add_seconds = time.perf_counter() - t0
  train_keys, test_keys = critic_round_keys(seed, len(train_index), len(test_index),
                                            config.num_rounds, config.eval_rounds)
  host = StreamCritic(critic, s)
  queries = np.asarray(data.bench.stream.queries)
  outside, ms = 0, {step: [] for step in STEPS}

  def check(i, ids):  # the shown memories are among the runner's candidates of question i
    nonlocal outside
    cands = {(int(data.bench.group[i]), c) for c in data.candidate_bank_ids(i)}
    outside += sum(1 for x in ids if data.source(x) not in cands)

  def timed(step, i, call, *args, **kwargs):  # `call` on question i, timed without the critic
    c0, t = host.seconds, time.perf_counter()
    out = call(data.query_text(i), *args, query_embedding=queries[i],
               scope=data.scope(data.bench.group[i]), **kwargs)
    ms[step].append(1e3 * (time.perf_counter() - t - (host.seconds - c0)))
    return out

  for n, i in enumerate(train_index):
    host.start(data.gold_ids[i], train_keys[n])
    out = timed("train", i, mem.recall, host, s)
    check(i, [x for r in out.rounds for x in r.ids])
    if progress is not None and (n + 1) % 500 == 0:
      progress(f"seed {seed}: {n + 1}/{len(train_index)} training questions")
  steps, pending = int(mem.stats["learner_steps"]), int(mem.stats["pending"])
  slates = {"adapter": [tuple(timed("search", i, mem.search, s).ids) for i in test_index]}
  # The same critic keys for both rules: page t gets round t's (as `evaluate`).
  for mode, rule, step in (("explorer", "explorer", "recall_test"),
                           ("paging_adapted", "paging", "recall_paging")):
    slates[mode] = []
    for j, i in enumerate(test_index):
      host.start(data.gold_ids[i], test_keys[j])
      slates[mode].append(tuple(timed(step, i, mem.recall, host, s, learn=False, rule=rule).ids))
  if int(mem.stats["learner_steps"]) != steps:
    raise RuntimeError("the test questions trained the adapter")
  ng = np.asarray(data.bench.stream.num_gold)[test_index]
  has = ng > 0
  recall, hitrate = {}, {}
  for mode in MODES:
    for i, ids in zip(test_index, slates[mode]):
      check(i, ids)
    hits = np.asarray([sum(x in data.gold_ids[i] for x in ids)
                       for i, ids in zip(test_index, slates[mode])])
    recall[mode] = float((hits >= ng)[has].mean()) if has.any() else 0.0
    hitrate[mode] = float((hits > 0)[has].mean()) if has.any() else 0.0
  seconds = {k: float(np.sum(v)) / 1e3 for k, v in ms.items()}
  seconds.update(critic=host.seconds, add=add_seconds)
  return SeedResult(seed=int(seed), recall=recall, hitrate=hitrate, slates=slates,
                    seconds=seconds, per_question_ms={k: np.asarray(v) for k, v in ms.items()},
                    outside_candidates=int(outside), pending=pending,
                    bank_bytes=int(mem.stats["capacity"] * method.config.dim * 4))


def _call_ms(fn, calls: int, warmup: int) -> np.ndarray:
  """`[calls]` wall times of `fn()` (its result waited for) after `warmup` calls, in ms."""
  for _ in range(warmup):
    benchmarking.block(fn())
  return 1e3 * np.asarray([benchmarking.timed(fn) for _ in range(calls)])


def measure_round_costs(method: Method, calls: int = 500, dispatch_calls: int = 2000) -> tuple:
  """The device calls of one training question served alone, each timed to its host result.

  Returns:
    `(dispatch [dispatch_calls] ms, floor)`: the round trips of one trivial jitted call with a
    session round's argument and output shapes (after a warm-up), and the floor `{first_round_ms
    (`session_round` computing the adapter, Eq. (3)-(4), and the Gram of Eq. (6)), later_round_ms,
    learner_step_ms (one `driver.train_step` on `b` queries), per_training_question_ms = first +
    (T - 1) later + step / b}`, no search; means over `calls`.
  """
  config, hp = method.config, method.hparams
  K, T, b, s = config.num_candidates, config.num_rounds, config.batch_size, config.slate_size
  width = config.dim + config.side_features
  rng = np.random.default_rng(0)
  state = jax.tree_util.tree_map(lambda x: jax.numpy.array(x, copy=True),
                                 learner_lib.init_learner(jax.random.PRNGKey(0), config))
  q = rng.standard_normal(config.dim).astype(np.float32)
  c = rng.standard_normal((K, width)).astype(np.float32)
  mask, zeros = np.ones((K,), bool), np.zeros((K,), np.float32)
  last = (np.full((K,), -1, np.int32), np.zeros((K,), bool), np.full((K,), -1.0, np.float32))
  args = (state.params, hp, q, c, mask, zeros, zeros, last)
  trivial = jax.jit(lambda p, h, q, c, m, mean, counts, last: (
      jax.numpy.zeros((s,), jax.numpy.int32), m[:s], mean, mean, counts))
  dispatch = _call_ms(lambda: jax.device_get(trivial(*args)), dispatch_calls, 50)
  one = lambda given=None: memory_episode.session_round(*args, s, True, given)
  _, given = one()
  first = float(_call_ms(one, calls, 20).mean())
  later = float(_call_ms(lambda: one(given), calls, 20).mean())
  batch = Stream(queries=rng.standard_normal((b, config.dim)).astype(np.float32),
                 candidates=rng.standard_normal((b, K, width)).astype(np.float32),
                 mask=np.ones((b, K), bool), gold=np.zeros((b, K), bool),
                 num_gold=np.zeros((b,), np.int32))
  slates = np.tile(np.arange(K, dtype=np.int32)[:s], (b, T, 1))
  slates = np.pad(slates, ((0, 0), (0, 0), (0, K - s)), constant_values=-1)
  smask, labels = slates >= 0, np.full(slates.shape, -1.0, np.float32)
  keys = jax.random.split(jax.random.PRNGKey(1), b)
  box = [state]

  def train():  # the driver's own compiled step (state donated)
    box[0], _ = memory_driver.train_step(box[0], keys, batch, slates, smask, labels,
                                         np.ones((b,), bool), config, hp)
    return box[0].params

  step = float(_call_ms(train, max(calls // 5, 20), 20).mean())
  return dispatch, {"first_round_ms": first, "later_round_ms": later, "learner_step_ms": step,
                    "per_training_question_ms": first + (T - 1) * later + step / b}


def run_runner(data: LiveData, method: Method, seeds: Sequence[int], train_index: np.ndarray,
               test_index: np.ndarray, critic: Optional[critic_lib.SimulatedCritic] = None, *,
               name: str = "runner", timing_repeat: bool = True):
  """The jitted runner on the same seeds and splits: `(RunResult, warm_seconds or None)`; with
  `timing_repeat` it runs twice and `warm_seconds` is the compiled call's wall time."""
  critic = critic or critic_lib.make_simulated_critic()
  args = (data.bench.stream, train_index, test_index, method.config, method.hparams, list(seeds))
  result = runner.train_and_evaluate(name, *args, critic=critic)
  if not timing_repeat:
    return result, None
  return result, runner.train_and_evaluate(name, *args, critic=critic).wall_seconds


def compare(data: LiveData, result, live: Sequence[SeedResult], scan_seconds: float) -> dict:
  """Runner vs live per mode: Recall@s / Hitrate@s (percent), the paired difference live - runner
  (95 % t-interval), the share of identical slates, and the costs per question (ms)."""
  out = {"modes": {}, "seeds": [r.seed for r in live]}
  for mode in MODES:
    rec = {}
    for metric in ("recall", "hitrate"):
      run_v = (100.0 * np.asarray(result.eval[f"{metric}_{mode}"], np.float64)).tolist()
      live_v = [100.0 * getattr(r, metric)[mode] for r in live]
      d = stats.paired_difference(live_v, run_v)
      rec[metric] = {"runner": run_v, "live": live_v,
                     "runner_mean": float(np.mean(run_v)), "live_mean": float(np.mean(live_v)),
                     "difference": d.to_json(),
                     "within_noise": bool(d.n < 2 or (d.lo <= 0 <= d.hi))}
    rec["same_slate"] = [_same_slates(data, result, j, r, mode) for j, r in enumerate(live)]
    out["modes"][mode] = rec
  n_train, n_test = result.train_index.shape[1], result.test_index.shape[1]
  per_q = n_train + n_test
  warm = live[1:] if len(live) > 1 else live
  per_step = {k: np.concatenate([r.per_question_ms[k] for r in warm]) for k in STEPS}
  total = float(np.mean([(r.seconds["train"] + r.seconds["search"] + r.seconds["recall_test"])
                         for r in warm]))
  out["cost_ms_per_question"] = {
      "live": 1e3 * total / per_q,
      "live_by_step_mean": {k: float(np.mean(v)) for k, v in per_step.items()},
      "live_by_step_p50": {k: float(np.median(v)) for k, v in per_step.items()},
      "scan": 1e3 * scan_seconds / (per_q * len(live)),
      "definition": ("per question of one seed (N training questions trained, M test questions "
                     "evaluated in both modes): live = time in Memory.recall / search "
                     "without the critic, mean over the seeds after the first (warm); scan = the "
                     "runner's compiled train_and_evaluate wall time over all seeds / (S (N + M))"),
      "num_train": int(n_train), "num_test": int(n_test),
      "critic_seconds": [r.seconds["critic"] for r in live],
      "add_seconds": [r.seconds["add"] for r in live],
  }
  out["outside_candidates"] = [r.outside_candidates for r in live]
  out["untrained_pending"] = [r.pending for r in live]
  return out


def _same_slates(data: LiveData, result, j: int, live: SeedResult, mode: str) -> float:
  """Share of seed `j`'s test questions whose live slate holds the runner's memories."""
  slates = np.asarray(result.eval[f"{mode}_slates"])[j]  # [M, s] candidate positions
  same = []
  for i, pos, ids in zip(result.test_index[j], slates, live.slates[mode]):
    g, cands = int(data.bench.group[int(i)]), data.bench.candidate_ids[int(i)]
    same.append(sorted((g, cands[p]) for p in pos if p >= 0) == sorted(map(data.source, ids)))
  return float(np.mean(same)) if same else 1.0


def run(data: LiveData, method: Method, seeds: Sequence[int],
        critic: Optional[critic_lib.SimulatedCritic] = None, *, time_scan: bool = True,
        name: str = "live") -> tuple[dict, list]:
  """The jitted runner and the live stream on the same seeds and splits, compared (`compare`),
  with the measured dispatch, device floor and physical bounds.

  `time_scan` times a second, compiled runner call (else the first, compilation included).
  Returns `(comparison dict, [SeedResult])`.
  """
  critic = critic or critic_lib.make_simulated_critic()
  seeds = [int(x) for x in seeds]
  train_index, test_index = runner.seed_splits(data.bench.num_queries, seeds)
  logging.info("%s: runner, %d seeds, %d training / %d test questions", name, len(seeds),
               train_index.shape[1], test_index.shape[1])
  result, warm = run_runner(data, method, seeds, train_index, test_index, critic, name=name,
                            timing_repeat=time_scan)
  logging.info("%s: runner R@5 adapter %.2f explorer %.2f (%.1f s; compiled %s s)", name,
               100 * float(np.mean(result.eval["recall_adapter"])),
               100 * float(np.mean(result.eval["recall_explorer"])), result.wall_seconds,
               "-" if warm is None else f"{warm:.1f}")
  live = []
  for j, seed in enumerate(seeds):
    t0 = time.perf_counter()
    r = run_seed(data, method, seed, train_index[j], test_index[j], critic,
                 progress=lambda line: logging.info("%s: %s", name, line))
    live.append(r)
    logging.info("%s: seed %d (%d/%d): live R@5 adapter %.2f explorer %.2f | runner %.2f %.2f "
                 "(%.1f s)", name, seed, j + 1, len(seeds), 100 * r.recall["adapter"],
                 100 * r.recall["explorer"], 100 * float(result.eval["recall_adapter"][j]),
                 100 * float(result.eval["recall_explorer"][j]), time.perf_counter() - t0)
  cmp = compare(data, result, live, result.wall_seconds if warm is None else warm)
  cmp["scan_seconds"] = {"first": result.wall_seconds, "compiled": warm}
  peak = benchmarking.measure_peak()
  bandwidth = scale_bench.measure_bandwidth()
  flops = benchmarking.ear_flops_per_query(method.config)["total"]
  dispatch, floor = measure_round_costs(method)  # the target: within 2x of (scan + dispatch)
  c = cmp["cost_ms_per_question"]
  c.update(dispatch_ms=float(dispatch.mean()), dispatch_p50_ms=float(np.median(dispatch)),
           device_floor=floor)
  target = c["scan"] + c["dispatch_ms"]
  c["ratio_to_scan_plus_dispatch"] = {step: c["live_by_step_mean"][step] / target
                                      for step in STEPS}
  c["ratio_to_scan_plus_dispatch"]["all_steps"] = c["live"] / target
  c.update(matmul_peak_gflops=peak["gflops"], flops_per_training_question=flops,
           bound_ms_per_training_question=1e3 * flops / (peak["gflops"] * 1e9),
           bandwidth_gb_per_s=bandwidth["gb_per_s"], bank_bytes=live[0].bank_bytes,
           bound_ms_per_search=1e3 * live[0].bank_bytes / (bandwidth["gb_per_s"] * 1e9))
  cmp.update(method=method.name, benchmark=data.bench.name, num_queries=data.bench.num_queries)
  return cmp, live


def table_md(cmp: dict, *, title: str) -> str:
  """The markdown table of `run`'s comparison: means, paired differences, costs per question."""
  lines = [f"### {title}", "",
           "| mode | metric | runner | live | live − runner [95% CI] | within noise |",
           "|---|---|---|---|---|---|"]
  names = MODE_NAMES
  for mode in MODES:
    for metric, label in (("recall", "R@5"), ("hitrate", "Hit@5")):
      r = cmp["modes"][mode][metric]
      lines.append(f"| {names[mode]} | {label} | {r['runner_mean']:.2f} | {r['live_mean']:.2f} | "
                   f"{stats.format_difference(r['difference'])} | "
                   f"{'yes' if r['within_noise'] else '**no**'} |")
  same = ", ".join(f"{names[m]} {100 * float(np.mean(cmp['modes'][m]['same_slate'])):.1f} %"
                   for m in MODES)
  lines += ["", f"Test questions whose live slate holds the runner's memories (mean over seeds): "
            f"{same}. Shown ids outside the runner's candidates: "
            f"{sum(cmp['outside_candidates'])}. Training questions left queued (the runner trains "
            f"its last, padded batch; `Memory` full batches only): {cmp['untrained_pending']}."]
  c = cmp["cost_ms_per_question"]
  mean, p50 = c["live_by_step_mean"], c["live_by_step_p50"]
  r, f = c["ratio_to_scan_plus_dispatch"], c["device_floor"]
  lines += [
      "", "| cost per question (critic excluded) | ms |", "|---|---|",
      f"| live (`Memory`), all steps | {c['live']:.2f} |"]
  lines += [f"| live: {what}, mean / p50 | {mean[step]:.2f} / {p50[step]:.2f} |" for what, step in (
      ("training `recall` (T rounds + learner step / b)", "train"),
      ("test `search` (adapter-only)", "search"),
      ("test `recall(learn=False, rule='explorer')`", "recall_test"),
      ("test `recall(learn=False)` (paging, the default)", "recall_paging"))]
  lines += [
      f"| scan (`runner.train_and_evaluate`, compiled, all seeds vmapped) | {c['scan']:.3f} |",
      f"| one dispatch (a trivial jitted call with a round's argument shapes, round trip, "
      f"mean / p50) | {c['dispatch_ms']:.3f} / {c['dispatch_p50_ms']:.3f} |",
      f"| ratio live / (scan + one dispatch): training `recall` / test explorer `recall` / test "
      f"paging `recall` / `search` / all steps | {r['train']:.2f} / {r['recall_test']:.2f} / "
      f"{r['recall_paging']:.2f} / {r['search']:.2f} / {r['all_steps']:.2f} |",
      f"| floor: a training question's device calls one question at a time (first "
      f"round {f['first_round_ms']:.3f} + (T - 1) x later round "
      f"{f['later_round_ms']:.3f} + learner step {f['learner_step_ms']:.3f} / b; no "
      f"search), against the target 2 x (scan + one dispatch) = "
      f"{2 * (c['scan'] + c['dispatch_ms']):.3f} | {f['per_training_question_ms']:.3f} |",
      f"| bound: one search reads the bank ({c['bank_bytes'] / 1e6:.1f} MB) / memory "
      f"bandwidth measured in this run ({c['bandwidth_gb_per_s']:.1f} GB/s) | "
      f"{c['bound_ms_per_search']:.3f} |",
      f"| bound: FLOPs of a training question ({c['flops_per_training_question'] / 1e6:.1f} "
      f"M) / matmul peak measured in this run ({c['matmul_peak_gflops']:.0f} GFLOP/s) | "
      f"{c['bound_ms_per_training_question']:.3f} |"]
  per = ["", "| seed | " + " | ".join(f"{names[m]} runner / live" for m in MODES) + " |",
         "|---|" + "---|" * len(MODES)]
  for j, seed in enumerate(cmp["seeds"]):
    cells = [f"{cmp['modes'][m]['recall']['runner'][j]:.2f} / "
             f"{cmp['modes'][m]['recall']['live'][j]:.2f}" for m in MODES]
    per.append(f"| {seed} | " + " | ".join(cells) + " |")
  return "\n".join(lines + ["", "Recall@5 per seed:"] + per)
