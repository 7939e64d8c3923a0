"""`Memory(candidates='bm25' | 'hybrid')`: the benchmark pipeline's first stage in a live memory."""
import dataclasses

import numpy as np
import pytest

from ear_jax.agent import lexical_bank
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


CASES = [("bm25", first_stage.FirstStageOptions(), False),
         ("hybrid", first_stage.FirstStageOptions(fusion="rrf"), False),
         ("hybrid", first_stage.FirstStageOptions(fusion="weighted"), False),
         ("hybrid", first_stage.FirstStageOptions(fusion="rrf", rrf_k=3.0), False),
         ("hybrid", first_stage.FirstStageOptions(fusion="rrf"), True),
         ("hybrid", first_stage.FirstStageOptions(fusion="weighted", lexical_weight=0.3), True),
         ("bm25", first_stage.FirstStageOptions(), True),
         ("dense", first_stage.FirstStageOptions(), False)]


@pytest.mark.parametrize("name,options,multistore", CASES)
def test_memory_candidates_equal_the_benchmark_pipeline(name, options, multistore):
  texts, emb, qtexts, qemb = _bank()
  stores = (np.arange(len(texts)) % 3 == 2).astype(np.int8)  # every third memory an observation
  config = EARConfig(dim=DIM, num_candidates=8, side_features=3)
  mem = Memory(None, config=config, candidates=name, first_stage_options=options,
               multistore=multistore)
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


def test_bm25_scores_equal_the_lexical_module():
  texts, _, qtexts, _ = _bank(n=40)
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


def test_tampered_texts_are_refused_naming_the_shard(tmp_path):
  mem, _, _ = _trained_memory(tmp_path)
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
