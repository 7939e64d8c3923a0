"""Tests for the first stage: BM25 on bm25s, the generator registry (dense / bm25 / hybrid), the
side features, and EAR's side term `z = q~.m~ + w . f` (`core.adapter.relevance`)."""
import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.core import adapter as adapter_lib
from ear_jax.core import episode
from ear_jax.core import inference
from ear_jax.core import learner
from ear_jax.core import stream as stream_lib
from ear_jax.core.config import EARConfig, default_hparams, hparams_for_method
from ear_jax.data import candidates
from ear_jax.data import first_stage
from ear_jax.data import lexical

_REPO = pathlib.Path(__file__).resolve().parent.parent
BANK = ["Alice: I adopted a cat named Luna.", "Bob: I started learning the violin.",
        "Alice: Luna sleeps on my keyboard.", "Bob: My sister lives in Lisbon.",
        "Alice: I work as a nurse in Boston.", "Bob: I ran a marathon last spring.",
        "Alice: the cat Luna is grey.", ""]
QUERIES = ["What is the name of Alice's cat?", "Where does Bob's sister live?", "What did he do?"]


def _unit(x):
  return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _bank(seed=0, d=8):
  rng = np.random.default_rng(seed)
  return _unit(rng.normal(size=(len(QUERIES), d))), _unit(rng.normal(size=(len(BANK), d)))


def _bm25(texts=BANK, queries=QUERIES):
  """Each query's BM25 `(rows, scores)` over `texts` (one `lexical.BM25Index`, one scope)."""
  vocab = {}
  index = lexical.BM25Index()
  ids = [lexical.term_ids(vocab, t, grow=True) for t in lexical.tokenize(texts)]
  index.add(np.arange(len(texts)), np.zeros(len(texts), np.int32), *lexical.pack(ids))
  return index.scores([lexical.term_ids(vocab, t) for t in lexical.tokenize(queries)])


def _dense_bm25():
  out = np.zeros((len(QUERIES), len(BANK)), np.float32)
  for i, (r, s) in enumerate(_bm25()):
    out[i, r] = s
  return out


def _rank(name, k, seed=0, valid=None, options=first_stage.FirstStageOptions()):
  q, bank = _bank(seed)
  valid = np.ones(len(BANK), bool) if valid is None else valid
  return first_stage.bank_first_stage(q, bank, np.zeros(len(BANK), np.int8), valid, _bm25(), k,
                                      name, options, multistore=False)


# -- BM25 ----------------------------------------------------------------------------------------
def test_tokenize_lowercases_and_drops_stop_and_question_words():
  assert lexical.tokenize(["What did Alice's CAT do?", ""]) == [["alice", "cat"], []]  # "s": a stop word


def test_bm25_scores_equal_bm25s_directly_and_zero_without_a_shared_term():
  import bm25s  # pylint: disable=g-import-not-at-top
  scores = _dense_bm25()
  engine = bm25s.BM25(k1=lexical.K1, b=lexical.B, method="lucene")
  engine.index(lexical.tokenize(BANK), show_progress=False)
  for i, tokens in enumerate(lexical.tokenize(QUERIES)):
    ref = engine.get_scores(tokens) if tokens else np.zeros(len(BANK))
    np.testing.assert_array_equal(scores[i], ref.astype(np.float32))
  assert scores[0, [0, 2, 6]].min() > 0 and scores[0, 1] == 0  # 'cat' / 'luna' / 'alice' rows
  assert np.argmax(scores[1]) == 3  # sister / lives
  assert not scores[2].any()  # only stop words: no lexical evidence


# -- generators ----------------------------------------------------------------------------------
def test_registry_names_the_three_generators_and_refuses_others():
  assert set(first_stage.GENERATORS) == {"dense", "bm25", "hybrid"}
  with pytest.raises(ValueError, match="unknown candidates='bm42'"):
    first_stage.check_generator("bm42")


def test_bm25_generator_ranks_by_bm25_with_ties_by_lower_row():
  idx, sc, _ = _rank("bm25", 8)
  ref = np.argsort(-_dense_bm25(), axis=1, kind="stable")
  np.testing.assert_array_equal(idx, ref)
  assert (np.diff(sc, axis=1) <= 0).all()
  np.testing.assert_array_equal(idx[2], np.arange(8))  # all scores 0: bank order


def test_generators_pad_when_fewer_rows_are_valid_than_k():
  valid = np.zeros(len(BANK), bool)
  valid[[1, 4]] = True
  for name in first_stage.GENERATORS:
    idx, sc, _ = _rank(name, 8, valid=valid)
    assert (idx[:, 2:] == -1).all() and np.isinf(sc[:, 2:]).all(), name
    assert set(idx[:, :2].ravel()) == {1, 4}, name


@pytest.mark.parametrize("weight, reference", [(1.0, "bm25"), (0.0, "dense")])
def test_weighted_hybrid_at_the_ends_is_the_single_first_stage(weight, reference):
  opts = first_stage.FirstStageOptions(fusion="weighted", lexical_weight=weight)
  idx, _, _ = _rank("hybrid", 8, seed=3, options=opts)
  ref, _, _ = _rank(reference, 8, seed=3)
  if reference == "bm25":  # rows without lexical evidence tie at 0: compare the scored rows
    n = (_dense_bm25() > 0).sum(1)
    for i in range(len(QUERIES)):
      np.testing.assert_array_equal(idx[i, :n[i]], ref[i, :n[i]])
  else:
    np.testing.assert_array_equal(idx, ref)


@pytest.mark.parametrize("rrf_k", [60.0, 1.0])
def test_rrf_hybrid_sums_reciprocal_ranks_of_both_rankings(rrf_k):
  opts = first_stage.FirstStageOptions(fusion="rrf", rrf_k=rrf_k)
  idx, sc, _ = _rank("hybrid", 8, seed=4, options=opts)
  q, bank = _bank(4)
  lex, cos = _dense_bm25(), np.asarray(jnp.asarray(q) @ jnp.asarray(bank).T)
  for i in range(len(QUERIES)):
    r_lex = np.argsort(np.argsort(-lex[i], kind="stable"), kind="stable") + 1
    r_cos = np.argsort(np.argsort(-cos[i], kind="stable"), kind="stable") + 1
    f32 = lambda r: np.float32(1) / (np.float32(rrf_k) + r.astype(np.float32))
    fused = f32(r_lex) + f32(r_cos)  # float32, as the kernel
    np.testing.assert_array_equal(idx[i], np.argsort(-fused, kind="stable")[:8])
    np.testing.assert_allclose(sc[i], np.sort(fused)[::-1][:8], rtol=1e-6)


def test_ranks_equal_a_comparison_count_with_ties_and_masked_rows():
  rng = np.random.default_rng(0)
  ranks = jax.jit(first_stage._ranks_one)  # pylint: disable=protected-access
  for _ in range(10):
    x = rng.integers(0, 12, 300).astype(np.float32)  # many equal values
    where = rng.random(300) < 0.7
    rows = rng.choice(300, 25, replace=False).astype(np.int32)
    got = np.asarray(ranks(x, where, rows, x[rows]))
    want = [1 + np.sum(where & ((x > x[r]) | ((x == x[r]) & (np.arange(300) < r)))) for r in rows]
    np.testing.assert_array_equal(got[where[rows]], np.asarray(want)[where[rows]])


def test_bad_fusion_options_are_refused_naming_the_field():
  with pytest.raises(ValueError, match="fusion"):
    first_stage.FirstStageOptions(fusion="max")
  with pytest.raises(ValueError, match="lexical_weight"):
    first_stage.FirstStageOptions(fusion="weighted", lexical_weight=1.5)


def test_lexical_first_stage_without_texts_names_the_problem():
  from ear_jax.data import corpus as corpus_lib  # pylint: disable=g-import-not-at-top
  bank = corpus_lib.Bank(ids=["a", "b"], texts=["", ""], stores=np.zeros(2, np.int8),
                         refs=[()] * 2)
  query = corpus_lib.Query(id="q", text="", gold=("a",), category="c", group=0)
  ec = corpus_lib.EmbeddedCorpus(corpus_lib.Corpus("t", [bank], [query], {}),
                                 [np.eye(2, dtype=np.float32)], np.eye(2, dtype=np.float32)[:1])
  with pytest.raises(ValueError, match="needs the memories' texts"):
    candidates.build_benchmark(ec, k=2, candidates="bm25")


def test_features_are_the_normalised_first_stage_score_the_cosine_and_bm25():
  idx, _, f = _rank("bm25", 8, seed=5)
  q, bank = _bank(5)
  assert f.shape == (3, 8, len(first_stage.FEATURES))
  first = f[..., 0]
  assert (np.diff(first, axis=1) <= 0).all() and first.min() >= 0 and first.max() <= 1
  np.testing.assert_allclose(first[0, [0, -1]], [1.0, 0.0])
  np.testing.assert_allclose(f[..., 1], np.einsum("nkd,nd->nk", bank[idx], q), atol=1e-6)
  np.testing.assert_allclose(f[0, 0, 2], 1.0)  # the best candidate's BM25 / the best BM25
  assert not f[2, :, 0].any() and not f[2, :, 2].any()  # no lexical evidence at all: zeros


# -- EAR with side features -----------------------------------------------------------------------
def _side_stream(n=24, k=8, d=6, seed=0):
  """A stream whose first-stage order (feature 0, decreasing) disagrees with the cosine."""
  rng = np.random.default_rng(seed)
  q = _unit(rng.normal(size=(n, d)))
  c = _unit(rng.normal(size=(n, k, d)))
  cos = np.einsum("nkd,nd->nk", c, q)
  first = np.tile(np.linspace(1.0, 0.0, k, dtype=np.float32), (n, 1))  # rank order = position
  feats = np.stack([first, cos, rng.uniform(size=(n, k)).astype(np.float32)], -1)
  gold = np.zeros((n, k), bool)
  gold[np.arange(n), rng.integers(0, k, n)] = True
  return stream_lib.make_stream(q, c, gold=gold, features=feats)


def test_side_features_off_leaves_params_buffer_and_shapes_as_the_paper():
  config = EARConfig(dim=6, num_candidates=8, slate_size=3, buffer_capacity=16)
  state = learner.init_learner(jax.random.PRNGKey(0), config)
  assert state.params.w_side is None
  assert state.buffer.candidates.shape == (16, 8, 6)


def test_side_features_must_hold_the_first_stage_and_the_cosine():
  with pytest.raises(ValueError, match="side_features"):
    EARConfig(side_features=1)
  with pytest.raises(ValueError, match="side_init"):
    EARConfig(side_features=3, side_init=-1.0)


def test_make_stream_appends_features_and_validates_their_shape():
  s = _side_stream()
  assert s.candidates.shape == (24, 8, 9) and s.num_side_features == 3 and s.dim == 6
  with pytest.raises(ValueError, match="features must be"):
    stream_lib.make_stream(s.queries, s.candidates[..., :6], features=np.zeros((24, 7, 3)))


@pytest.mark.slow  # (fast tier's budget; CI's full suite runs it)
@pytest.mark.parametrize("side_init", [0.025, 1.0])
def test_before_feedback_the_adapter_only_slate_is_the_first_stage_top_s(side_init):
  s = _side_stream(seed=1)
  config = EARConfig(dim=6, num_candidates=8, slate_size=3, side_features=3, side_init=side_init)
  params = learner.init_learner(jax.random.PRNGKey(0), config).params
  np.testing.assert_array_equal(params.w_side, np.float32([side_init, -1.0, 0.0]))
  res = inference.evaluate(jax.random.PRNGKey(1), params, stream_lib.to_device(s), config,
                           default_hparams())
  np.testing.assert_array_equal(np.asarray(res.adapter_slates), np.tile([0, 1, 2], (24, 1)))
  # ... while the plain cosine would pick other candidates for most queries.
  cos_top = np.argsort(-np.asarray(s.candidates[..., -2]), axis=1, kind="stable")[:, :3]
  assert (np.sort(cos_top, 1) != [0, 1, 2]).any(1).mean() > 0.5


def test_relevance_adds_the_weighted_features_to_the_adapted_cosine():
  s = _side_stream(n=2)
  params = adapter_lib.AdapterParams(w_q=jnp.zeros((6, 6)), w_m=jnp.zeros((6, 6)),
                                     w_side=jnp.asarray([0.3, 2.0, -1.0]))
  z, m_t = adapter_lib.relevance(params, s.queries[0], s.candidates[0])
  f = s.candidates[0, :, 6:]
  np.testing.assert_allclose(z, s.candidates[0, :, :6] @ s.queries[0] + f @ [0.3, 2.0, -1.0],
                             atol=1e-6)
  assert m_t.shape == (8, 6)


@pytest.mark.slow
def test_training_with_side_features_moves_the_side_weights_and_stays_finite():
  s = _side_stream(n=32, seed=2)
  config = EARConfig.for_method("ear", dim=6, num_candidates=8, slate_size=3, side_features=3,
                                buffer_capacity=32)
  state, records = episode.run_episode(jax.random.PRNGKey(0), stream_lib.to_device(s), config,
                                       default_hparams())
  assert state.buffer.candidates.shape == (32, 8, 9)
  assert np.isfinite(np.asarray(records.loss)).all()
  assert not np.allclose(state.params.w_side, [config.side_init, -1.0, 0.0])
  assert np.isfinite(np.asarray(state.params.w_side)).all()


def test_a_stream_without_features_is_refused_by_a_side_feature_config():
  s = _side_stream()
  config = EARConfig(dim=6, num_candidates=8, slate_size=3, side_features=3)
  plain = stream_lib.make_stream(s.queries, s.candidates[..., :6])
  with pytest.raises(ValueError, match="side_features=3"):
    episode.validate_stream(plain, config)


def test_side_config_fields_round_trip_and_default_configs_keep_their_dict():
  config = EARConfig.for_method("ear_tuned", side_features=3, side_init=0.1)
  assert EARConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
  assert "side_features" not in EARConfig.for_method("ear").to_dict()


def test_ear_tuned_hparams_apply_with_side_features():
  hp = hparams_for_method("ear_tuned")
  assert float(hp.learning_rate) == pytest.approx(1e-4)


# -- the benchmark pipeline and the programs --------------------------------------------------------
@pytest.mark.slow
def test_dense_candidates_are_unchanged_and_bm25_beats_dense_on_three_conversations(
    locomo_path, minilm):
  del minilm
  data = str(locomo_path.parent)
  dense = candidates.load_benchmark("locomo", data_dir=data, progress=False, limit=3)
  explicit = candidates.load_benchmark("locomo", data_dir=data, progress=False, limit=3,
                                       candidates="dense")
  np.testing.assert_array_equal(dense.stream.candidates, explicit.stream.candidates)
  bm25 = candidates.load_benchmark("locomo", data_dir=data, progress=False, candidates="bm25",
                                   side_features=True, limit=3)
  recall = bm25.stats["retriever"]["overall"]["recall@5"]  # 48.30 (dense: 34.20)
  assert recall >= 45.0 and recall > dense.stats["retriever"]["overall"]["recall@5"] + 10
  assert bm25.stream.num_side_features == 3
  np.testing.assert_array_equal(bm25.stream.gold.sum(1) <= bm25.stream.num_gold, True)


def _run(args, tmp_path):
  import os  # pylint: disable=g-import-not-at-top
  env = {**os.environ, "PYTHONPATH": str(_REPO)}
  return subprocess.run([sys.executable, "-m"] + args, cwd=tmp_path, env=env, text=True,
                        capture_output=True, timeout=900)


@pytest.mark.slow
def test_prepare_prints_the_bm25_first_stage(locomo_path, tmp_path):
  out = _run(["experiments.prepare", "--benchmark=locomo",
              f"--data_dir={locomo_path.parent.resolve()}", "--candidates=bm25", "--limit=3",
              "--noprogress", f"--out={tmp_path / 'p.json'}"], tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "candidates=bm25" in out.stdout
  overall = json.loads((tmp_path / "p.json").read_text())["retriever"]["overall"]
  assert overall["recall@5"] >= 45.0 and overall["recall@K_ceiling"] >= overall["recall@5"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["retriever", "ear_tuned"])
def test_run_with_hybrid_candidates_writes_per_seed_recalls(locomo_path, tmp_path, method):
  out = _run(["experiments.run", "--benchmark=locomo", f"--data_dir={locomo_path.parent.resolve()}",
              f"--method={method}", "--candidates=hybrid", "--limit=2", "--seeds=2",
              "--checkpoint_every=0", "--eval_every=64", "--noprogress",
              f"--workdir={tmp_path / 'w'}"], tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  res = json.loads((tmp_path / "w" / "results.json").read_text())
  assert res["options"]["candidates"] == "hybrid"
  summary = next(iter(res["runs"].values()))
  assert summary["config"].get("side_features") == 3
  for key in ("recall_adapter", "recall_explorer"):
    assert len(summary["metrics"][key]["per_seed"]) == 2


@pytest.mark.slow
def test_fusion_flags_without_hybrid_are_a_usage_error(tmp_path):
  out = _run(["experiments.prepare", "--benchmark=synthetic", "--candidates=bm25",
              "--lexical_weight=0.3"], tmp_path)
  assert out.returncode != 0 and "--lexical_weight applies to --candidates=hybrid" in (
      out.stdout + out.stderr)


@pytest.mark.slow
def test_first_stage_suite_runs_every_generator_and_pairs_by_seed(locomo_path, tmp_path):
  from ear_jax.experiment import suites  # pylint: disable=g-import-not-at-top
  opts = suites.Options(benchmark="locomo", data_dir=str(locomo_path.parent.resolve()), limit=1, seeds=2,
                        workdir=str(tmp_path / "w"), suite="first_stage", checkpoint_every=None,
                        progress=False)
  res = suites.run(opts)
  md = res["tables"]["first_stage"]
  for g in ("dense", "bm25", "hybrid"):
    assert f"| {g} | frozen first stage |" in md
  records = res["paired"]["first_stage"]
  assert records and all(len(rec["per_seed"]) == 2 for rec in records)
  assert (tmp_path / "w" / "first_stage" / "bm25" / "runs").is_dir()
  assert dataclasses.asdict(opts)["candidates"] == "dense"
