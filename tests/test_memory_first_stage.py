"""`Memory(candidates='bm25' | 'hybrid')`: the benchmark pipeline's first stage in a live memory."""

import jax
import numpy as np
import pytest

from ear_jax.agent.memory import lexical_bank
from ear_jax.agent.memory import Memory
from ear_jax.core.config import EARConfig
from ear_jax.data import first_stage

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango").split()
DIM = 16


def _texts(n, seed):
  """`n` texts of 2..7 words from a small Zipf-like vocabulary (shared terms, repeated terms)."""
  rng = np.random.default_rng(seed)
  p = 1.0 / np.arange(1, len(WORDS) + 1)
  p /= p.sum()
  return [" ".join(rng.choice(WORDS, rng.integers(2, 8), p=p)) for _ in range(n)]


def _unit(x):
  return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _bank(n=60, nq=6, seed=0):
  rng = np.random.default_rng(seed)
  return (_texts(n, seed), _unit(rng.standard_normal((n, DIM))), _texts(nq, seed + 100),
          _unit(rng.standard_normal((nq, DIM))))


def _candidates(mem, retrievals):
  """`(rows [n, K], features [n, K, F])` of the sessions these retrievals opened."""
  ss = [mem._sessions.by_id[r.session_id] for r in retrievals]  # pylint: disable=protected-access
  rows = np.stack([s.cand_idx for s in ss])
  feats = np.stack([s.cand_emb[:, DIM:] for s in ss])
  return rows, feats


def _pipeline(texts, emb, qtexts, qemb, stores, k, name, options, multistore):
  """What `candidates.build_benchmark` computes for one bank (its calls, its arguments)."""
  gen = first_stage.check_generator(name)
  used = np.ones(len(texts), bool) if multistore else stores == 0
  inputs = first_stage.bank_inputs(qemb, emb, qtexts, texts, used, lexical_rows=used)
  if multistore:
    parts = [gen(inputs._replace(valid=stores == s), k // 2, options) for s in (0, 1)]
    idx = np.concatenate([p[0] for p in parts], 1)
    sc = np.concatenate([p[1] for p in parts], 1)
    order = np.argsort(-sc, axis=1, kind="stable")
    idx, sc = np.take_along_axis(idx, order, 1), np.take_along_axis(sc, order, 1)
  else:
    idx, sc = gen(inputs, k, options)
  return idx, first_stage.features(inputs, idx, sc)


_slow = pytest.mark.slow
# (the default hybrid, single and multi-store, is in the fast tier: test_..._equal_build_benchmark)
CASES = [pytest.param("hybrid", first_stage.FirstStageOptions(fusion="rrf"), True, marks=_slow),
         pytest.param("bm25", first_stage.FirstStageOptions(), False, marks=_slow),
         pytest.param("hybrid", first_stage.FirstStageOptions(fusion="weighted"), False,
                      marks=_slow),
         pytest.param("hybrid", first_stage.FirstStageOptions(fusion="rrf"), False, marks=_slow),
         pytest.param("hybrid", first_stage.FirstStageOptions(fusion="rrf", rrf_k=3.0), False,
                      marks=_slow),
         pytest.param("hybrid", first_stage.FirstStageOptions(fusion="weighted",
                                                              lexical_weight=0.3), True,
                      marks=_slow),
         pytest.param("bm25", first_stage.FirstStageOptions(), True, marks=_slow),
         pytest.param("dense", first_stage.FirstStageOptions(), False, marks=_slow)]


@pytest.mark.parametrize("name,options,multistore", CASES)
def test_memory_candidates_equal_the_benchmark_pipeline(name, options, multistore):
  texts, emb, qtexts, qemb = _bank()
  texts[40:50], emb[40:50] = texts[10:20], emb[10:20]  # duplicates: equal scores, ties by row
  stores = (np.arange(len(texts)) % 3 == 2).astype(np.int8)  # every third memory an observation
  config = EARConfig(dim=DIM, num_candidates=8, side_features=3)
  mem = Memory(None, config=config, candidates=name, first_stage_options=options,
               multistore=multistore, initial_capacity=64)  # one capacity: fewer compiles
  # added in three calls (the index is rebuilt after each), with a search in between
  for a, b in ((0, 20), (20, 21), (21, 60)):
    mem.add(texts[a:b], embeddings=emb[a:b], store=[int(s) for s in stores[a:b]])
    mem.retrieve(qtexts[0], k=2, query_embedding=qemb[0])
  got = mem.retrieve_batch(qtexts, k=5, query_embeddings=qemb)
  rows, feats = _candidates(mem, got)
  want_rows, want_feats = _pipeline(texts, emb, qtexts, qemb, stores, 8, name, options,
                                    multistore)
  np.testing.assert_array_equal(rows, want_rows)
  np.testing.assert_allclose(feats, want_feats, atol=1e-5)
  # before any feedback the adapter-only slate is the first stage's own top-k (up to the order of
  # equal first-stage scores: z = side_init f_0 + (cos - f_1), and cos - f_1 is float rounding)
  shown = np.asarray([[mem.ids.index(i) for i in r.ids] for r in got])
  first = np.asarray([[f[list(r).index(j), 0] for j in sh] for f, r, sh in zip(feats, rows, shown)])
  np.testing.assert_allclose(first, want_feats[:, :5, 0], atol=1e-5)


def test_ranks_equal_a_comparison_count_with_ties_and_masked_rows():
  rng = np.random.default_rng(0)
  ranks = jax.jit(lexical_bank._ranks_one)  # pylint: disable=protected-access
  for _ in range(10):
    x = rng.integers(0, 12, 300).astype(np.float32)  # many equal values
    where = rng.random(300) < 0.7
    rows = rng.choice(300, 25, replace=False).astype(np.int32)
    got = np.asarray(ranks(x, where, rows, x[rows]))
    want = [1 + np.sum(where & ((x > x[r]) | ((x == x[r]) & (np.arange(300) < r)))) for r in rows]
    np.testing.assert_array_equal(got[where[rows]], np.asarray(want)[where[rows]])


def test_bm25_scores_equal_the_lexical_module():
  texts, _, qtexts, _ = _bank(n=40)
  texts[3] = "What is the"  # stop words only: an empty document
  texts[9] = "golf golf golf golf hotel"
  lex = lexical_bank.LexicalBank("bm25", first_stage.FirstStageOptions(), multistore=True)
  for a, b in ((0, 7), (7, 8), (8, 40)):
    lex.append(lexical_bank.tokenize(texts[a:b]), np.zeros(b - a, np.int8), a)
  rows, scores = lex.pairs(qtexts, capacity=64, num_padded=len(qtexts))
  dense = np.zeros((len(qtexts), 65), np.float32)
  np.put_along_axis(dense, rows, scores, 1)
  want = first_stage.lexical.bm25_scores(texts, qtexts)
  np.testing.assert_array_equal(dense[:, :40], want)  # bit for bit: the same engine and tokens


def test_hybrid_sets_side_features_and_refuses_what_it_cannot_serve():
  mem = Memory(None, dim=DIM, candidates="hybrid")
  assert mem.config.side_features == 3 and mem.candidates == "hybrid"
  assert Memory(None, dim=DIM).config.side_features == 0  # dense: unchanged
  with pytest.raises(ValueError, match="side_features"):
    Memory(None, config=EARConfig(dim=DIM, side_features=2), candidates="bm25")
  with pytest.raises(ValueError, match="unknown candidates"):
    Memory(None, dim=DIM, candidates="splade")
  with pytest.raises(ValueError, match="index='exact'"):
    Memory(None, dim=DIM, candidates="hybrid", index="faiss_hnsw")
  mem.add(["alpha bravo"], embeddings=np.ones((1, DIM)))
  with pytest.raises(ValueError, match="query's text"):
    mem.retrieve(query_embedding=np.ones(DIM), k=1)


def test_dense_default_keeps_the_dense_path():
  mem = Memory(None, dim=DIM)
  assert mem._lexical is None and mem.candidates == "dense"  # pylint: disable=protected-access


def test_query_without_shared_terms_ranks_by_row_as_the_pipeline():
  texts, emb, _, qemb = _bank(n=30)
  mem = Memory(None, dim=DIM, candidates="bm25")
  mem.add(texts, embeddings=emb)
  got = mem.retrieve("zulu yankee", k=5, query_embedding=qemb[0])
  rows, feats = _candidates(mem, [got])
  np.testing.assert_array_equal(rows[0], np.arange(20))  # all score 0: lower row first
  assert not feats[0, :, 0].any() and not feats[0, :, 2].any()


def _trained_memory(tmp_path, candidates="hybrid"):
  texts, emb, qtexts, qemb = _bank(n=50, nq=10)
  config = EARConfig(dim=DIM, num_candidates=8, batch_size=2)
  mem = Memory(None, config=config, candidates=candidates, seed=3)
  mem.add(texts, embeddings=emb)
  for i, (t, q) in enumerate(zip(qtexts, qemb)):
    r = mem.retrieve(t, k=3, query_embedding=q, explore=bool(i % 2))
    if i < 8:
      mem.feedback(r, [r.ids[0]])  # sessions closed: learner steps, experiences in the buffer
  return mem, qtexts, qemb


@pytest.mark.slow
def test_save_load_gives_the_same_memory(tmp_path):
  mem, qtexts, qemb = _trained_memory(tmp_path)
  mem.save(tmp_path / "m")
  back = Memory.load(tmp_path / "m", encoder=None)
  assert back.candidates == "hybrid" and back.first_stage_options == mem.first_stage_options
  assert back.config == mem.config
  np.testing.assert_array_equal(back.params.w_side, mem.params.w_side)
  np.testing.assert_array_equal(back.state.buffer.candidates, mem.state.buffer.candidates)
  for a, b in zip(mem._sessions.by_id.values(), back._sessions.by_id.values()):  # pylint: disable=protected-access
    np.testing.assert_array_equal(a.cand_emb, b.cand_emb)  # features restored with the rows
  got = [back.retrieve(t, k=3, query_embedding=q) for t, q in zip(qtexts, qemb)]
  want = [mem.retrieve(t, k=3, query_embedding=q) for t, q in zip(qtexts, qemb)]
  assert [g.ids for g in got] == [w.ids for w in want]
  np.testing.assert_allclose([g.scores for g in got], [w.scores for w in want], atol=1e-6)
  # then both add the same memory: the lexical index follows (rebuilt from the texts)
  for m in (mem, back):
    m.add(["tango tango tango"], embeddings=np.ones((1, DIM)))
  assert (back.retrieve("tango", k=3, query_embedding=qemb[0]).ids
          == mem.retrieve("tango", k=3, query_embedding=qemb[0]).ids)


@pytest.mark.slow
def test_restore_refuses_another_first_stage_and_rebuilds_the_index(tmp_path):
  mem, qtexts, qemb = _trained_memory(tmp_path)
  mem.save(tmp_path / "m")
  other = Memory(None, config=mem.config, candidates="bm25")
  with pytest.raises(ValueError, match="candidates='hybrid'"):
    other.restore(tmp_path / "m")
  same = Memory(None, config=mem.config, candidates="hybrid")
  same.add(["something else entirely"], embeddings=np.ones((1, DIM)))
  same.retrieve("something", k=1, query_embedding=np.ones(DIM))
  same.restore(tmp_path / "m")
  assert len(same) == len(mem)
  assert (same.retrieve(qtexts[0], k=3, query_embedding=qemb[0]).ids
          == mem.retrieve(qtexts[0], k=3, query_embedding=qemb[0]).ids)


def test_load_without_learning_keeps_first_stage_and_candidates(tmp_path):
  texts, emb, qtexts, qemb = _bank(n=40)
  mem = Memory(None, config=EARConfig(dim=DIM, num_candidates=8), candidates="bm25",
               first_stage_options=first_stage.FirstStageOptions(fusion="weighted"))
  mem.add(texts, embeddings=emb)
  want = mem.retrieve_batch(qtexts, k=3, query_embeddings=qemb)
  mem.save(tmp_path / "m")
  back = Memory.load(tmp_path / "m", encoder=None)
  assert (back.candidates, back.first_stage_options) == (mem.candidates, mem.first_stage_options)
  got = back.retrieve_batch(qtexts, k=3, query_embeddings=qemb)
  np.testing.assert_array_equal(_candidates(back, got)[0], _candidates(mem, want)[0])
  np.testing.assert_array_equal(_candidates(back, got)[1], _candidates(mem, want)[1])


def test_tampered_texts_are_refused_naming_the_shard(tmp_path):
  texts, emb, _, _ = _bank(n=40)
  mem = Memory(None, dim=DIM, candidates="hybrid")
  mem.add(texts, embeddings=emb)
  mem.save(tmp_path / "m")
  hits = [p for p in (tmp_path / "m" / "bank_shards").rglob("*")
          if p.is_file() and b"tango" in p.read_bytes()]
  assert hits
  hits[0].write_bytes(hits[0].read_bytes().replace(b"tango", b"tangy", 1))
  with pytest.raises(Exception, match="bank_shards|shard") as e:
    Memory.load(tmp_path / "m", encoder=None)
  assert "Traceback" not in str(e.value)


def test_old_checkpoints_without_a_first_stage_are_dense():
  assert lexical_bank.options_from_meta(None, "x") == ("dense", first_stage.FirstStageOptions())
  with pytest.raises(ValueError, match="first_stage"):
    lexical_bank.options_from_meta({"candidates": "splade", "options": {}}, "meta.json")


@pytest.mark.parametrize("rrf_k", [60.0, 3.0, 1.0])
def test_rrf_score_rounds_as_the_pipelines_float64_sum(rrf_k):
  a, b = np.meshgrid(np.arange(1, 400), np.arange(1, 400))
  want = (1.0 / (rrf_k + a) + 1.0 / (rrf_k + b)).astype(np.float32)
  score = jax.jit(lexical_bank._rrf_score)  # pylint: disable=protected-access  (as XLA compiles it)
  got = np.asarray(score(np.float32(rrf_k) + a.astype(np.float32),
                         np.float32(rrf_k) + b.astype(np.float32)))
  plain = (np.float32(1) / (np.float32(rrf_k) + a.astype(np.float32))
           + np.float32(1) / (np.float32(rrf_k) + b.astype(np.float32)))
  assert (plain != want).any()  # plain float32 would break ties the pipeline keeps
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("multistore", [False, True])
def test_memory_candidates_equal_build_benchmark(multistore):
  """The benchmark pipeline itself (`candidates.build_benchmark`, default hybrid options) and a
  `Memory` over the same bank: the same candidate ids in the same order, the same features."""
  from ear_jax.data import candidates as candidates_lib  # pylint: disable=g-import-not-at-top
  from ear_jax.data import corpus as corpus_lib  # pylint: disable=g-import-not-at-top
  texts, emb, qtexts, qemb = _bank(n=50, nq=8, seed=4)
  stores = (np.arange(50) % 4 == 3).astype(np.int8)
  ids = [f"d{i}" for i in range(50)]
  bank = corpus_lib.Bank(ids=ids, texts=texts, stores=stores, refs=[()] * 50)
  queries = [corpus_lib.Query(id=f"q{i}", text=t, gold=(ids[4 * i],), category="c", group=0)
             for i, t in enumerate(qtexts)]
  ec = corpus_lib.EmbeddedCorpus(corpus_lib.Corpus("t", [bank], queries, {}), [emb], qemb)
  bench = candidates_lib.build_benchmark(ec, k=8, multistore=multistore, candidates="hybrid",
                                         side_features=True)
  mem = Memory(None, config=EARConfig(dim=DIM, num_candidates=8), candidates="hybrid",
               multistore=multistore)
  mem.add(texts, ids=ids, embeddings=emb, store=[int(s) for s in stores])
  got = mem.retrieve_batch(qtexts, k=3, query_embeddings=qemb)
  rows, feats = _candidates(mem, got)
  np.testing.assert_array_equal(np.where(rows >= 0, np.asarray(ids)[rows], ""),
                                bench.candidate_ids)
  np.testing.assert_allclose(feats, np.asarray(bench.stream.candidates)[..., DIM:], atol=1e-5)


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
def test_threads_adding_and_retrieving_leave_the_index_in_step():
  import threading  # pylint: disable=g-import-not-at-top
  texts, emb, qtexts, qemb = _bank(n=64, nq=4, seed=7)
  mem = Memory(None, config=EARConfig(dim=DIM, num_candidates=8), candidates="hybrid",
               initial_capacity=64)
  mem.add(texts[:8], embeddings=emb[:8])
  errors = []

  def adder(lo):
    try:
      for i in range(lo, lo + 28, 4):
        mem.add(texts[i:i + 4], ids=[f"t{j}" for j in range(i, i + 4)], embeddings=emb[i:i + 4])
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  def retriever():
    try:
      for t, q in zip(qtexts * 3, np.concatenate([qemb] * 3)):
        mem.discard(mem.retrieve(t, k=2, query_embedding=q))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=adder, args=(8,)), threading.Thread(target=adder, args=(36,)),
             threading.Thread(target=retriever), threading.Thread(target=retriever)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  assert len(mem) == 64
  bank_texts = list(mem._bank.texts)  # pylint: disable=protected-access  (rows in the threads' order)
  got = mem.retrieve_batch(qtexts, k=2, query_embeddings=qemb)
  rows, feats = _candidates(mem, got)
  want_rows, want_feats = _pipeline(bank_texts, mem.embeddings(), qtexts, qemb,
                                    np.zeros(64, np.int8), 8, "hybrid",
                                    first_stage.FirstStageOptions(), False)
  np.testing.assert_array_equal(rows, want_rows)
  np.testing.assert_allclose(feats, want_feats, atol=1e-5)
