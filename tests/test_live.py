"""The live benchmark (`ear_jax.experiment.live`, `python -m experiments.live`) and
`Memory.recall(learn=False)`, on a small multi-bank synthetic benchmark."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.agent.memory import driver as driver_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import episode
from ear_jax.core import inference
from ear_jax.core import stream as stream_lib
from ear_jax.data import synthetic
from ear_jax.experiment import live
from ear_jax.experiment import runner

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data():
  ec = synthetic.make_synthetic(seed=0, num_queries=100, dim=16, num_banks=4)
  return live.live_data(ec)


@pytest.fixture(scope="module")
def data50():
  """K = 50 > T s = 20 candidates (banks of 12 to 96 memories: some questions hold fewer)."""
  ec = synthetic.make_synthetic(seed=0, num_queries=100, dim=16, num_banks=4)
  return live.live_data(ec, k=50)


def _method(data, name, **overrides):
  s = data.bench.stream
  return runner.build_method(name, dim=s.dim, num_candidates=s.num_candidates, **overrides)


def _compare(data, name, seed=0):
  method = _method(data, name)
  train, test = runner.seed_splits(data.bench.num_queries, [seed])
  result, _ = live.run_runner(data, method, [seed], train, test, timing_repeat=False)
  r = live.run_seed(data, method, seed, train[0], test[0])
  return live.compare(data, result, [r], 1.0), r


def _candidates(mem, data, i, query):
  """The candidates of benchmark question `i` in its scope: `search` with k = K (or all the scope
  holds, when fewer) shows them all, ranked by the untrained adapter (the first stage's order)."""
  scope = data.scope(data.bench.group[i])
  k = min(mem.config.ear.num_candidates, len(mem.list(scope)))
  return mem.search("q", k, query_embedding=query, scope=scope).ids


def test_live_candidates_are_the_runners_candidates(data):
  mem = live.build_memory(data, _method(data, "ear"), seed=0)
  queries = np.asarray(data.bench.stream.queries)
  assert len(set(data.bench.group.tolist())) == 4  # several banks: the scopes matter
  for i in range(data.bench.num_queries):
    ids = _candidates(mem, data, i, queries[i])
    # The same memories of the question's own bank (bank ids repeat across banks), same order.
    g = int(data.bench.group[i])
    assert [data.source(x) for x in ids] == [(g, c) for c in data.candidate_bank_ids(i)], i


_GUARD = {"guard_holdout": 5, "guard_min_queries": 4}


@pytest.mark.slow
@pytest.mark.parametrize("k,overrides", [
    (20, {}), (20, _GUARD), (50, {"loss_support": "auto"}),
    (50, {"loss_support": "auto", **_GUARD})],
    ids=["ear", "ear_with_held_out_guard", "k50_auto", "k50_auto_with_held_out_guard"])
def test_live_equals_the_runner_given_the_runners_replay_keys(request, monkeypatch, k, overrides):
  # The only difference by construction: Memory's learner draws its replay keys from its own seed
  # (`driver.seed_keys`). Handing it the runner's per-query replay keys makes EAR's run (similarity
  # replay, Gumbel replay slates) identical to the runner's. With the held-out guard every 5th
  # training question pages the first stage in both (with K > T s interleaved with the adapted
  # ranking, `guard.page_relevance`), and the ring decides what both serve.
  data = request.getfixturevalue("data" if k == 20 else "data50")
  assert data.bench.stream.num_candidates == k
  method = _method(data, "ear", **overrides)
  train, test = runner.seed_splits(data.bench.num_queries, [0])
  episode_key, _ = jax.random.split(runner.per_seed_keys([0])[0])
  _, query_keys = episode.episode_keys(episode_key, train.shape[1])
  replay_keys = np.asarray(jax.vmap(jax.random.split)(query_keys)[:, 1])

  def runner_keys(key, n, b):  # (`driver._step_keys`: learner step n's `[b]` replay keys)
    del key
    return jnp.asarray(replay_keys[np.minimum(np.arange(n * b, (n + 1) * b),
                                              len(replay_keys) - 1)])

  monkeypatch.setattr(driver_lib, "_step_keys", runner_keys)
  built = []
  build = live.build_memory
  monkeypatch.setattr(live, "build_memory", lambda *a: built.append(build(*a)) or built[-1])
  result, _ = live.run_runner(data, method, [0], train, test, timing_repeat=False)
  r = live.run_seed(data, method, 0, train[0], test[0])
  cmp = live.compare(data, result, [r], 1.0)
  for mode in live.MODES:
    assert cmp["modes"][mode]["same_slate"] == [1.0], mode
  if method.config.guard_holdout:  # the same held-out questions, pages and citations in the ring
    ring, live_ring = result.final_state.guard, built[0].learner.guard
    assert int(live_ring.count) == int(ring.count[0]) > 0
    np.testing.assert_array_equal(np.asarray(live_ring.cited), np.asarray(ring.cited[0]))


@pytest.mark.slow
def test_live_and_runner_are_close_for_ear_tuned_on_one_seed(data):
  cmp, _ = _compare(data, "ear_tuned", seed=1)
  for mode in live.MODES:
    rec = cmp["modes"][mode]["recall"]
    assert abs(rec["live"][0] - rec["runner"][0]) <= 10.0, (mode, rec)
    assert np.mean(cmp["modes"][mode]["same_slate"]) >= 0.5, mode


def test_stream_critic_gives_the_jitted_critics_labels():
  critic = critic_lib.make_simulated_critic(precision=0.7, recall=0.8)
  host = live.StreamCritic(critic, slate_size=5)
  keys = np.asarray(jax.random.split(jax.random.PRNGKey(3), 4))
  host.start({"a", "c"}, keys)
  view = critic_lib.SlateView(query=None, slate=None, slate_mask=np.ones(5, bool), memories=None,
                              gold=None, ids=["a", "b", "c", "d", "e"])
  gold = np.asarray([True, False, True, False, False])
  for t in range(4):
    want = critic_lib.simulated_critic(keys[t], gold, np.ones(5, bool), critic.precision,
                                       critic.recall)
    np.testing.assert_array_equal(host(None, view), np.asarray(want))
  with pytest.raises(RuntimeError, match="more calls"):
    host(None, view)


def _memory(method):
  rng = np.random.default_rng(0)
  emb = rng.normal(size=(48, 16)).astype(np.float32)
  mem = Memory(MemoryConfig(encoder=None, method=method, dim=16))
  mem.add([f"memory {i}" for i in range(48)], embeddings=emb)
  return mem, emb


def _gold_critic(key, view):
  del key
  return np.where([i in {"m1", "m3", "m7"} for i in view.ids], 1.0, -1.0).astype(np.float32)


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it; test_memory_recall's fast
# test_recall_equals_evaluates_explorer_assisted_slate checks the same slates)
@pytest.mark.parametrize("method", ["ear", "ear_tuned"])
def test_recall_without_learning_equals_evaluate_and_trains_nothing(method):
  mem, emb = _memory(method)
  config = mem.config.ear
  before = mem.learner.params
  query = emb[1] + emb[3] + 0.3 * emb[20]
  outs = [mem.recall(f"question {i}", _gold_critic, k=5, query_embedding=query, learn=False,
                     rule="explorer") for i in range(6)]  # more than a batch: a learning recall would have trained
  assert mem.stats["learner_steps"] == 0 and mem.stats["queries_queued"] == 0
  assert mem.stats["pending"] == 0 and mem.stats["critic_calls"] == 6 * config.num_rounds
  np.testing.assert_array_equal(np.asarray(mem.learner.params.w_q), np.asarray(before.w_q))
  # The same slate as `evaluate`'s explorer-assisted inference (the perfect simulated critic
  # cites exactly the gold) and as a learning recall. The candidates: all K, by `search`.
  ids = list(mem.search("q", config.num_candidates, query_embedding=query).ids)
  rows = [int(i[1:]) for i in ids]  # ("m<row>": the embedding added as `emb[row]`)
  unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
  gold = np.asarray([i in {"m1", "m3", "m7"} for i in ids])
  stream = stream_lib.make_stream(unit(query)[None], unit(emb[rows])[None],
                                  np.ones((1, len(ids)), bool), gold[None])
  perfect = critic_lib.make_simulated_critic(precision=1.0, recall=1.0)
  res = inference.evaluate(jax.random.PRNGKey(0), mem.learner.params,
                           stream_lib.to_device(stream), config, mem.config.learner_hparams,
                           perfect)
  expected = [ids[j] for j in np.asarray(res.explorer_slates[0]) if j >= 0]
  assert all(list(o.ids) == expected for o in outs)
  assert list(mem.recall("q", _gold_critic, k=5, query_embedding=query).ids) == expected


@pytest.mark.slow  # a subprocess
def test_program_writes_results_and_table(tmp_path):
  out = tmp_path / "live"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.live", "--benchmark=synthetic", "--method=ear_no_replay",
       "--seeds=2", "--synthetic_queries=48", "--synthetic_dim=8", "--time_scan=false",
       f"--out={out}"], cwd=_REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads((out / "results.json").read_text())
  table = (out / "table.md").read_text()
  assert res["seeds"] == [0, 1] and res["method"] == "ear_no_replay"
  assert res["outside_candidates"] == [0, 0]
  for mode in ("adapter", "explorer"):
    # ear_no_replay draws no replay keys: the runner's critic keys, order and batches are all
    # there is, so every test slate of both seeds must be the runner's.
    assert res["modes"][mode]["same_slate"] == [1.0, 1.0], mode
    rec = res["modes"][mode]["recall"]
    assert len(rec["live"]) == 2 and rec["difference"]["n"] == 2
    assert rec["live"] == pytest.approx(rec["runner"], abs=1e-3)
  assert res["cost_ms_per_question"]["live"] > 0 and res["cost_ms_per_question"]["scan"] > 0
  assert "| adapter-only | R@5 |" in table and "| explorer-assisted | R@5 |" in table
  assert "live − runner [95% CI]" in table and "scan (" in table


@pytest.mark.slow  # a subprocess
def test_program_refuses_a_method_memory_cannot_run():
  proc = subprocess.run([sys.executable, "-m", "experiments.live", "--benchmark=synthetic",
                         "--method=ear", "--test_rounds=2"], cwd=_REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode != 0 and "test_rounds" in proc.stderr


@pytest.mark.slow  # the LoCoMo file and the MiniLM encoder
def test_live_candidates_are_the_runners_on_locomo(data_dir, locomo_path, minilm):
  del locomo_path
  from ear_jax.data import candidates, corpora  # pylint: disable=g-import-not-at-top
  corpus = corpora.load_corpus("locomo", data_dir=data_dir, limit=2)
  ec, _ = candidates.embed_corpus(corpus, minilm, progress=False)
  data = live.live_data(ec)
  mem = live.build_memory(data, _method(data, "ear"), seed=0)
  queries = np.asarray(data.bench.stream.queries)
  reordered = 0
  for i in range(data.bench.num_queries):
    g = int(data.bench.group[i])
    got = [data.source(x) for x in _candidates(mem, data, i, queries[i])]
    want = [(g, c) for c in data.candidate_bank_ids(i)]
    assert sorted(got) == sorted(want), i  # the same K memories of the question's conversation
    if got != want:  # in another order only where the frozen cosines tie (to float rounding)
      reordered += 1
      sc = np.asarray(data.bench.candidate_scores[i])
      j = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
      assert abs(sc[j] - sc[j + 1]) < 1e-6, i
  assert reordered <= 2
