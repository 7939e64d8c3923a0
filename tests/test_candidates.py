"""Tests for ear_jax/data/candidates.py: top-K, padding/masks, gold, multi-store, the Benchmark."""
import pathlib

import numpy as np
import pytest

from ear_jax.data import candidates
from ear_jax.data import corpus as corpus_lib

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"


def _unit(x):
  return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("m, k", [(100, 20), (20, 20), (37, 5), (300, 20)])
def test_top_k_equals_numpy_argsort(m, k):
  rng = np.random.default_rng(m)
  q, bank = _unit(rng.normal(size=(70, 16))), _unit(rng.normal(size=(m, 16)))
  idx, sc, mask = candidates.top_k_candidates(q, bank, k, batch_size=32)
  ref = np.argsort(-(q @ bank.T), axis=1, kind="stable")[:, :k]
  np.testing.assert_array_equal(idx, ref)
  np.testing.assert_allclose(sc, np.take_along_axis(q @ bank.T, ref, 1), atol=1e-5)
  assert mask.all()


def test_top_k_respects_valid_memories():
  rng = np.random.default_rng(1)
  q, bank = _unit(rng.normal(size=(9, 8))), _unit(rng.normal(size=(40, 8)))
  valid = np.arange(40) % 3 == 0
  idx, _, mask = candidates.top_k_candidates(q, bank, 6, valid=valid)
  s = np.where(valid, q @ bank.T, -np.inf)
  np.testing.assert_array_equal(idx, np.argsort(-s, axis=1, kind="stable")[:, :6])
  assert valid[idx].all() and mask.all()


def test_bank_smaller_than_k_is_padded_and_masked():
  rng = np.random.default_rng(2)
  q, bank = _unit(rng.normal(size=(3, 8))), _unit(rng.normal(size=(7, 8)))
  idx, sc, mask = candidates.top_k_candidates(q, bank, 20)
  assert idx.shape == (3, 20)
  assert mask[:, :7].all() and not mask[:, 7:].any()
  assert (idx[:, 7:] == -1).all() and np.isneginf(sc[:, 7:]).all()
  assert sorted(idx[0, :7].tolist()) == list(range(7))


def _corpus(bank_sizes, gold, stores=None, refs=None, d=8, seed=0):
  rng = np.random.default_rng(seed)
  banks, embs = [], []
  for g, m in enumerate(bank_sizes):
    st = np.zeros(m, np.int8) if stores is None else np.asarray(stores[g], np.int8)
    rf = [()] * m if refs is None else refs[g]
    banks.append(corpus_lib.Bank(ids=[f"b{g}m{i}" for i in range(m)], texts=[f"text {g}/{i}" for i in range(m)],
                               stores=st, refs=rf))
    embs.append(_unit(rng.normal(size=(m, d))))
  queries = [corpus_lib.Query(id=f"q{n}", text=f"query {n}", gold=tuple(gids), category=f"c{n % 2}",
                            group=g) for n, (g, gids) in enumerate(gold)]
  qe = _unit(rng.normal(size=(len(queries), d)))
  corpus = corpus_lib.Corpus("toy", banks, queries, {"queries": len(queries)})
  return corpus_lib.EmbeddedCorpus(corpus, embs, qe)


def test_stream_gold_mask_and_gold_outside_top_k():
  ec = _corpus([50, 5], [(0, [f"b0m{i}" for i in range(50)][:30]), (1, ["b1m2"]), (0, ["b0m7"])])
  bench = candidates.build_benchmark(ec, k=10)
  s = bench.stream
  assert s.candidates.shape == (3, 10, 8) and s.num_gold.tolist() == [30, 1, 1]
  # Query 0: 30 of 50 memories gold, only 10 candidates -> at least 20 gold outside the top-K.
  assert s.gold[0].sum() <= 10 and s.num_gold[0] - s.gold[0].sum() >= 20
  # Query 1: bank of 5 < K -> padded; its gold is in the bank so it is a candidate.
  assert s.mask[1].sum() == 5 and s.gold[1].sum() == 1
  assert (s.candidates[1, 5:] == 0).all() and (bench.candidate_ids[1, 5:] == "").all()
  j = list(bench.candidate_ids[1]).index("b1m2")
  assert s.gold[1, j] and bench.candidate_texts[1, j] == "text 1/2"
  # Candidates are the memories' embeddings, in cosine order.
  np.testing.assert_allclose(s.candidates[2, 0], ec.bank_embeddings[0][int(bench.candidate_ids[2, 0][3:])])
  assert np.all(np.diff(bench.candidate_scores[2]) <= 1e-7)
  r = bench.stats["retriever"]["overall"]
  assert r["n"] == 3 and r["gold_outside_top_k"] == int((s.num_gold - s.gold.sum(1)).sum())


def test_retriever_report_hand_case():
  ec = _corpus([30], [(0, ["b0m0"]), (0, ["b0m1", "b0m2"])])
  bench = candidates.build_benchmark(ec, k=20)
  gold = np.zeros((2, 20), bool)
  gold[0, 3] = True  # in the top 5
  gold[1, [1, 9]] = True  # one in the top 5, one at rank 10
  bench.stream = bench.stream.replace(gold=gold, num_gold=np.array([1, 2], np.int32))
  r = candidates.retriever_report(bench)["overall"]
  assert (r["recall@5"], r["hitrate@5"], r["recall@K_ceiling"]) == (50.0, 100.0, 100.0)


def test_multistore_takes_half_from_each_store_and_derives_observation_gold():
  stores = [[0] * 20 + [1] * 10]
  refs = [[()] * 20 + [(f"b0m{i}",) for i in range(10)]]  # observation 20+i references turn i
  ec = _corpus([30], [(0, ["b0m3"]), (0, ["b0m15"])], stores=stores, refs=refs)
  bench = candidates.build_benchmark(ec, k=8, multistore=True)
  assert (bench.candidate_store == 1).sum(1).tolist() == [4, 4]
  assert (bench.candidate_store == 0).sum(1).tolist() == [4, 4]
  assert bench.num_gold_store.tolist() == [[1, 1], [1, 0]]  # turn 3 + its observation; turn 15 only
  assert bench.stream.num_gold.tolist() == [2, 1]
  for n in range(2):
    for j in np.nonzero(bench.stream.gold[n])[0]:
      cid = bench.candidate_ids[n, j]
      assert cid in ("b0m3", "b0m23", "b0m15")
  assert np.all(np.diff(bench.candidate_scores, axis=1) <= 1e-7)  # merged in cosine order
  assert "per_store" in bench.stats["retriever"]
  single = candidates.build_benchmark(ec, k=8)
  assert (single.candidate_store == 0).all() and single.stream.num_gold.tolist() == [1, 1]


def test_benchmark_take_selects_rows():
  ec = _corpus([30, 30], [(0, ["b0m1"]), (1, ["b1m1"]), (0, ["b0m2"])])
  bench = candidates.build_benchmark(ec, k=5)
  sub = bench.take(np.array([2, 0]))
  assert sub.query_ids == ["q2", "q0"] and sub.group.tolist() == [0, 0]
  np.testing.assert_array_equal(sub.stream.queries, bench.stream.queries[[2, 0]])


@pytest.mark.slow
def test_longmemeval_fixture_end_to_end_with_minilm(minilm, tmp_path):
  bench = candidates.load_benchmark(str(FIXTURES / "longmemeval_tiny.json"), encoder=minilm,
                                    cache_dir=tmp_path, progress=False)
  assert bench.query_ids == ["a1b2c3d4", "gpt4_0c1d2e3f"]
  assert bench.stream.mask.sum(1).tolist() == [4, 4]  # banks of 4 user turns, padded to 20
  assert bench.stream.num_gold.tolist() == [1, 2]
  assert bench.categories.tolist() == ["single-session-user", "multi-session"]
  # The dog question ranks the border-collie turn first.
  assert bench.candidate_ids[0, 0] == "answer_5f1e2a_1_1" and bench.stream.gold[0, 0]
  assert bench.stats["retriever"]["overall"]["hitrate@5"] == 100.0


@pytest.mark.slow
def test_locomo_one_conversation_with_minilm(locomo_path, minilm, tmp_path):
  bench = candidates.load_benchmark("locomo", data_dir=locomo_path.parent, encoder=minilm, limit=1,
                                    multistore=True, cache_dir=tmp_path, progress=False)
  assert bench.stats["conversations"] == 1 and bench.num_queries == 150
  assert bench.stream.candidates.shape == (150, 20, 384)
  assert ((bench.candidate_store == 1).sum(1) == 10).all()
  rep = bench.stats["retriever"]
  assert 10 < rep["overall"]["hitrate@5"] <= 100 and rep["per_store"]["observation"]["n"] > 0
